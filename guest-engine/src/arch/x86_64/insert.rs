//! Inline instrumentation (`insert_*`): counters, memory-reference records, analysis
//! calls, emitted around a guest instruction's translation.
//!
//! Invariants: an insertion never changes guest-visible state: counters use `add` only
//! where all status flags are dead, records and inline calls restore every register they
//! use, and every exit they take is resumable at the point right after it.

use iced_x86::{Code, Instruction, MemoryOperand, Register};

use super::emit::reg;
use super::entry::{analysis_trampoline, EXIT_ANALYSIS_CALL, EXIT_BUFFER_FULL};
use super::mangle::{encode_load_ea_regs, reg_of, ExitSpec, Tx};
use crate::addr::GuestVirt;
use crate::error::EngineError;
use crate::instrument::{access, Action, IArg, Insertion, MemOperand, SegBase};
use crate::layout::{MEM_RECORD_BYTES, XSAVE_MASK};

impl Tx<'_> {
    pub(super) fn insert_counter(&mut self, slot: u64, amount: i32, flags_dead: bool) {
        if flags_dead {
            self.a.add_m64_imm(slot, amount);
        } else {
            self.a.emit_spill(reg::RAX);
            self.a.mov_r_m(reg::RAX, slot);
            self.a.lea_r_disp(reg::RAX, reg::RAX, amount);
            self.a.mov_m_r(slot, reg::RAX);
            self.a.emit_unspill(reg::RAX);
        }
    }

    /// An analysis call that stays in the cache (see `entry.rs`, "Inline analysis calls").
    fn insert_inline_call(
        &mut self,
        routine: u32,
        args: &[IArg],
        mem: &[MemOperand],
        ip: u64,
    ) -> Result<(), EngineError> {
        const CALLER_SAVED: [u8; 9] = [0, 1, 2, 6, 7, 8, 9, 10, 11];
        let c = self.env.ctx;
        let saved = |r: u8| c.regs + 8 * u64::from(r);
        for r in CALLER_SAVED {
            self.a.mov_m_r(saved(r), r);
        }
        for (k, arg) in args.iter().enumerate() {
            let slot = c.call_args + 8 * k as u64;
            match *arg {
                IArg::InstPtr => {
                    self.a.mov_r_imm64(reg::RAX, ip);
                    self.a.mov_m_r(slot, reg::RAX);
                }
                IArg::Const(v) => {
                    self.a.mov_r_imm64(reg::RAX, v);
                    self.a.mov_m_r(slot, reg::RAX);
                }
                IArg::MemSize(n) => {
                    let size = mem.get(usize::from(n)).map_or(0, |m| m.size);
                    self.a.mov_m64_imm32(slot, size as i32);
                }
                IArg::Reg(r) => {
                    let r = r as u8;
                    if CALLER_SAVED.contains(&r) {
                        self.a.mov_r_m(reg::RAX, saved(r));
                        self.a.mov_m_r(slot, reg::RAX);
                    } else {
                        self.a.mov_m_r(slot, r);
                    }
                }
                IArg::MemEa(n) => {
                    self.a.mov_r_m(reg::RAX, saved(reg::RAX));
                    self.a.mov_r_m(reg::RCX, saved(reg::RCX));
                    match mem.get(usize::from(n)) {
                        Some(m) => self.emit_ea_rcx(m, ip)?,
                        None => self.a.mov_r_imm64(reg::RCX, 0),
                    }
                    self.a.mov_m_r(slot, reg::RCX);
                }
                IArg::MemPa(_) => return Err(EngineError::Unsupported(GuestVirt(ip))),
            }
        }
        self.a.mov_m_r(c.call_rsp, reg::RSP);
        self.a.mov_r_m(reg::RSP, c.host_rsp);
        self.a.lea_r_disp(reg::RSP, reg::RSP, -256);
        self.a.pushfq();
        self.a.pop_m(c.call_flags);
        self.a.bytes(&[0x48, 0x83, 0xE4, 0xF0]); // and rsp, -16 (flags are saved)
        self.a.cld(); // the ABI wants DF clear; the guest may have set it
        if let Some(area) = self.env.call_xsave {
            self.a.mov_r_imm64(reg::RAX, u64::from(XSAVE_MASK));
            self.a.mov_r_imm64(reg::RDX, 0);
            self.a.xsaveopt64_m(area);
        }
        self.a.mov_r_m(7, c.tool);
        self.a.mov_r_imm64(6, u64::from(routine));
        self.a.lea_r_rip(reg::RDX, c.call_args);
        self.a.mov_r_imm64(reg::RCX, args.len() as u64);
        self.a
            .mov_r_imm64(reg::RAX, analysis_trampoline as *const () as u64);
        self.a.bytes(&[0xFF, 0xD0]); // call rax
        if let Some(area) = self.env.call_xsave {
            self.a.mov_r_imm64(reg::RAX, u64::from(XSAVE_MASK));
            self.a.mov_r_imm64(reg::RDX, 0);
            self.a.xrstor64_m(area);
        }
        self.a.push_m(c.call_flags);
        self.a.popfq();
        self.a.mov_r_m(reg::RSP, c.call_rsp);
        for r in CALLER_SAVED {
            self.a.mov_r_m(r, saved(r));
        }
        Ok(())
    }

    fn insert_analysis_call(&mut self, call: usize) {
        let resume = self.a.new_label();
        let idx = self.exits.len();
        self.emit_exit_inline(
            EXIT_ANALYSIS_CALL,
            ExitSpec::Call {
                call,
                resume_off: 0,
            },
        );
        self.a.bind(resume);
        self.exits[idx] = ExitSpec::Call {
            call,
            resume_off: self.a.offset(),
        };
    }

    /// `lea rcx, [operand]` computed from the (unmodified) guest registers, plus the FS/GS
    /// base (`rdfsbase`/`rdgsbase` into RAX, which must be spilled) for segment-relative
    /// operands: the hardware bases are the guest's while it runs in the cache.
    pub(super) fn emit_ea_rcx(&mut self, m: &MemOperand, ip: u64) -> Result<(), EngineError> {
        match (m.base, m.index) {
            // (32-bit code: a 32-bit address, zero-extended.)
            (None, None) if self.env.compat => self.a.mov_r_imm64(reg::RCX, m.disp & 0xffff_ffff),
            (None, None) => self.a.mov_r_imm64(reg::RCX, m.disp),
            // The common case encoded from the parts, without an iced `Instruction`: the
            // bytes `encode_load_ea` gives for the instruction built below.
            (b, x)
                if !self.env.compat
                    && x.is_none_or(|x| x as u8 != reg::RSP)
                    && matches!(m.scale.max(1), 1 | 2 | 4 | 8)
                    && encode_load_ea_regs(
                        0x8D,
                        reg::RCX,
                        b.map(|r| r as u8),
                        x.map(|r| r as u8),
                        m.scale.max(1).trailing_zeros() as u8,
                        m.disp as i64,
                        u32::from(m.disp != 0),
                    )
                    .map(|(bytes, n)| self.a.bytes_of(&bytes, n))
                    .is_some() => {}
            (b, x) => {
                let width = |r: crate::context::Gpr| {
                    let r64 = reg_of(r as u8);
                    if self.env.compat {
                        r64.full_register32()
                    } else {
                        r64
                    }
                };
                let base = b.map_or(Register::None, width);
                let index = x.map_or(Register::None, width);
                let disp = if self.env.compat {
                    i64::from(m.disp as i32)
                } else {
                    m.disp as i64
                };
                let displ_size = if disp == 0 { 0 } else { 1 };
                let mo = MemoryOperand::new(
                    base,
                    index,
                    u32::from(m.scale.max(1)),
                    disp,
                    displ_size,
                    false,
                    Register::None,
                );
                // A 32-bit `lea ecx` computes the address as 32-bit code does (0x67).
                let (code, dst) = if self.env.compat {
                    (Code::Lea_r32_m, Register::ECX)
                } else {
                    (Code::Lea_r64_m, Register::RCX)
                };
                let i = Instruction::with2(code, dst, mo)
                    .map_err(|_| EngineError::Encode(GuestVirt(ip)))?;
                self.emit_enc(&i, ip)?;
            }
        }
        match m.seg {
            SegBase::Flat => {}
            SegBase::Fs => {
                self.a.bytes(&[0xF3, 0x48, 0x0F, 0xAE, 0xC0]); // rdfsbase rax
                self.a.lea_r_bi(reg::RCX, reg::RCX, reg::RAX, 0);
            }
            SegBase::Gs => {
                self.a.bytes(&[0xF3, 0x48, 0x0F, 0xAE, 0xC8]); // rdgsbase rax
                self.a.lea_r_bi(reg::RCX, reg::RCX, reg::RAX, 0);
            }
        }
        Ok(())
    }

    /// Appends one record per operand to the buffer; exits when it fills up. With
    /// `fetch` (the instruction's length and `access::CALL`/`RET` bit), the first record
    /// carries the instruction's fetch too (`access::WITH_FETCH`, its physical address in
    /// `pa` until delivery).
    pub(super) fn insert_mem_records(
        &mut self,
        ops: &[MemOperand],
        ip: u64,
        fetch: Option<(u8, u32)>,
    ) -> Result<(), EngineError> {
        for (k, m) in ops.iter().enumerate() {
            self.a.spill_quiet(reg::RAX);
            self.a.spill_quiet(reg::RCX);
            self.emit_ea_rcx(m, ip)?;
            let access = m.access | self.env.record_bits;
            match fetch.filter(|_| k == 0) {
                Some((len, flow)) => {
                    let pa = self.frame_pa(ip);
                    let with =
                        access::WITH_FETCH | u32::from(len & 0xf) << access::FETCH_LEN_SHIFT | flow;
                    self.append_record(ip, None, Some(pa), m.size, access | with)?;
                }
                None => self.append_record(ip, None, None, m.size, access)?,
            }
        }
        Ok(())
    }

    /// Appends the fetch record of the instruction at `ip` (`len` bytes), with its
    /// physical address: the frame the trace was translated from, which its page maps to
    /// whenever the trace runs (`softtlb.rs`), so the delivery need not resolve it.
    pub(super) fn insert_fetch_record(&mut self, ip: u64, len: u32) -> Result<(), EngineError> {
        self.insert_flow_fetch_record(ip, len, 0)
    }

    /// [`Tx::insert_fetch_record`] for an instruction whose `access::CALL`/`RET` bit is
    /// `flow`.
    fn insert_flow_fetch_record(
        &mut self,
        ip: u64,
        len: u32,
        flow: u32,
    ) -> Result<(), EngineError> {
        self.a.spill_quiet(reg::RAX);
        self.a.spill_quiet(reg::RCX);
        let access = access::FETCH | self.env.record_bits | flow;
        self.append_record(ip, Some(ip), Some(self.frame_pa(ip)), len, access)
    }

    /// The physical address of the instruction at `ip`: in the frame the trace was
    /// translated from, which its page maps to whenever the trace runs (`softtlb.rs`).
    fn frame_pa(&self, ip: u64) -> u64 {
        let (va_page, pa_page) = self.page;
        pa_page + (ip - va_page)
    }

    /// Appends the one record of a run of `n` instructions from `ip` (lengths `lens`, 4
    /// bits each; `access::FETCH_RUN`), with the first one's physical address; `flow`:
    /// the last one's `access::CALL`/`RET` bit.
    pub(super) fn insert_fetch_run(
        &mut self,
        ip: u64,
        n: u8,
        lens: u64,
        flow: u32,
    ) -> Result<(), EngineError> {
        self.a.spill_quiet(reg::RAX);
        self.a.spill_quiet(reg::RCX);
        let access = access::FETCH | access::FETCH_RUN | self.env.record_bits | flow;
        self.append_record(
            ip,
            Some(lens),
            Some(self.frame_pa(ip)),
            u32::from(n),
            access,
        )
    }

    /// With RAX and RCX spilled (quietly: nothing here can fault, and both are back in
    /// their registers before the guest instruction and before the exit, so the code has
    /// no PC-map entries — a record per instruction and operand would otherwise add ~7
    /// entries each to a trace's heap): appends a record whose `ea` is `ea` or else
    /// RCX (and `pa` if given), then unspills them; exits when the buffer is full.
    fn append_record(
        &mut self,
        ip: u64,
        ea: Option<u64>,
        pa: Option<u64>,
        size: u32,
        access: u32,
    ) -> Result<(), EngineError> {
        let c = self.env.ctx;
        self.a.mov_r_m(reg::RAX, c.buf_ptr);
        self.a.mov_mb64_imm(reg::RAX, 0, ip);
        match ea {
            Some(ea) => self.a.mov_mb64_imm(reg::RAX, 8, ea),
            None => self.a.mov_mb_r(reg::RAX, 8, reg::RCX),
        }
        self.a
            .mov_mb64_imm(reg::RAX, 16, u64::from(size) | u64::from(access) << 32);
        if let Some(pa) = pa {
            self.a.mov_mb64_imm(reg::RAX, 24, pa);
        }
        self.a
            .lea_r_disp(reg::RAX, reg::RAX, MEM_RECORD_BYTES as i32);
        self.a.mov_m_r(c.buf_ptr, reg::RAX);
        self.a.mov_r_m(reg::RCX, c.buf_neg_end);
        self.a.lea_r_bi(reg::RCX, reg::RCX, reg::RAX, 0);
        let full = self.a.new_label();
        let resume = self.a.new_label();
        self.a.jrcxz_label(full);
        self.a.unspill_quiet(reg::RAX);
        self.a.unspill_quiet(reg::RCX);
        // jmp short resume
        self.a.bytes(&[0xEB]);
        let at = self.a.offset();
        self.a.bytes(&[0]);
        self.a.bind(full);
        self.a.unspill_quiet(reg::RAX);
        self.a.unspill_quiet(reg::RCX);
        self.records_pending = self.records_pending.saturating_add(1);
        let held = self.records_pending;
        let idx = self.exits.len();
        self.emit_exit_inline(
            EXIT_BUFFER_FULL,
            ExitSpec::BufferFull {
                resume_off: 0,
                held,
            },
        );
        let rel = self.a.offset() - (at + 1);
        self.a.buf[at] = u8::try_from(rel).map_err(|_| EngineError::BranchOutOfRange)?;
        self.a.bind(resume);
        self.exits[idx] = ExitSpec::BufferFull {
            resume_off: self.a.offset(),
            held,
        };
        Ok(())
    }

    pub(super) fn insert_actions(
        &mut self,
        acts: &[&Insertion],
        ops: &[MemOperand],
        ip: u64,
        len: u8,
        flags_dead: bool,
        skip_records: bool,
    ) -> Result<(), EngineError> {
        // The fetch rides on the first operand record when the instruction appends one.
        let records =
            !skip_records && !ops.is_empty() && acts.iter().any(|x| x.action == Action::MemRecords);
        let fetch_in = records.then(|| {
            acts.iter().find_map(|x| match x.action {
                Action::FetchInRecords { flow } => Some(flow),
                _ => None,
            })
        });
        let fetch_in = fetch_in.flatten();
        for ins in acts {
            match &ins.action {
                Action::Counter { id, amount } => {
                    let slot = self.env.counters + 8 * u64::from(id.0);
                    self.insert_counter(slot, *amount, flags_dead);
                }
                Action::MemRecords if !skip_records => {
                    self.insert_mem_records(ops, ip, fetch_in.map(|flow| (len, flow)))?;
                }
                Action::MemRecords => {}
                Action::FetchInRecords { .. } if fetch_in.is_some() => {}
                Action::FetchRecord => self.insert_fetch_record(ip, u32::from(len))?,
                Action::FetchFlowRecord { flow } | Action::FetchInRecords { flow } => {
                    self.insert_flow_fetch_record(ip, u32::from(len), *flow)?;
                }
                Action::FetchRun { n, lens, flow } => {
                    self.insert_fetch_run(ip, *n, *lens, *flow)?;
                }
                Action::Call(c) => {
                    let spec = &self.calls[*c];
                    let inline = self.env.inline_calls
                        && spec.args.len() <= 8
                        && !spec.args.iter().any(|a| a.needs_pa());
                    if inline {
                        let (routine, args, mem) = (spec.routine, spec.args.clone(), spec.ins.mem);
                        self.insert_inline_call(routine, &args, &mem, ip)?;
                    } else {
                        self.insert_analysis_call(*c);
                    }
                }
            }
        }
        Ok(())
    }
}
