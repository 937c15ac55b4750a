//! Translation of one decoded trace into code-cache bytes: verbatim copies, the
//! `mangle_*` rewrite rules for control transfers and RIP-relative operands, the
//! trace-entry checks; the inline instrumentation (`insert_*`) is in `insert.rs`.
//!
//! Trace layout (all in one contiguous allocation):
//!
//! ```text
//! checked_entry: PA check against the SoftTLB (`softtlb.rs`; entered by cross-page links)
//!                then jmp entry
//! ret_entry:     full-address check of a return-cache hit, else the shared hash lookup
//! entry:         attention-byte check   (entered by same-page links and IBL hits)
//! body:          guest instructions + glue + instrumentation (dispatcher enters here)
//! stubs:         one exit stub per exit:  mov qword [ctx.exit_word], word; jmp exit
//! ```
//!
//! Invariants: glue never writes EFLAGS unless liveness says all status flags are dead;
//! glue never touches guest memory below RSP; every exit stub restores spilled registers
//! before jumping to the exit routine, so the exit routine always sees the guest state.

use alloc::vec::Vec;

use iced_x86::{Code, Encoder, Instruction, MemoryOperand, OpKind, Register};

use super::decode::{strip_rep, Class, DecodedInsn, DecodedTrace, Scratch, TraceEnd};
use super::emit::{reg, Asm, AsmBuffers, Label, MapMark};
use super::entry::{
    emit_ibl_lookup, exit_word, CtxAddrs, Gencode, EXIT_ATTENTION, EXIT_DIRECT, EXIT_HOIST_MISS,
    EXIT_PA_MISMATCH, EXIT_SENSITIVE,
};
use super::isolate::{hoistable, BaseState, ColdCheck, Hoisted};
use crate::addr::GuestVirt;
use crate::error::EngineError;
use crate::instrument::{Action, CallSpec, IPoint, Insertion, MemOperand};
use crate::platform::SensitiveInsn;
use crate::softtlb::{emit_pa_check, PA_CHECK_SPILLED};

/// Everything the translator needs to know about where the trace will live.
#[derive(Clone, Copy, Debug)]
pub(crate) struct EmitEnv {
    /// Cache address of the first byte of the trace.
    pub base: u64,
    pub ctx: CtxAddrs,
    pub gen: Gencode,
    /// The trace's mode's IBL table and its shared lookup routine.
    pub ibl_table: u64,
    pub ibl_shared: u64,
    /// SoftTLB slot `[va_page, pa_page]` of the trace's page (`softtlb.rs`).
    pub softtlb_slot: u64,
    pub counters: u64,
    pub count_ibl: bool,
    /// The mode's return cache (`ret` goes through it when `return_cache`).
    pub rc_table: u64,
    pub return_cache: bool,
    /// Run analysis calls inline (else every call is an exit through the dispatcher).
    pub inline_calls: bool,
    /// XSAVE area for inline calls, when the engine itself uses vector state.
    pub call_xsave: Option<u64>,
    /// Exit-record index of this trace's first exit.
    pub exit_base: u32,
    /// Access bits every memory record of this trace carries (its CPL, see
    /// `instrument::access::CPL_SHIFT`).
    pub record_bits: u32,
    /// The trace's code lies in the upper half of the address space (where its data most
    /// likely lies too: the order of the isolation checks' compares).
    pub upper_half: bool,
    /// Check memory operands against the reserved zone (`isolate/`).
    pub isolate: bool,
    /// What those checks fence off: the zone (kernel mode) or the upper half (user mode).
    pub fence: super::isolate::Fence,
    /// Hoist the checks of registers a self-looping trace never writes to its top
    /// (`isolate/hoist.rs`).
    pub hoist: bool,
    /// The trace is 32-bit code (`Mode::compat`, `compat.rs`).
    pub compat: bool,
    /// A trace-ending `iretq` runs inline when it can (`Tx::emit_inline_iretq`): virtual
    /// CPL 0, 64-bit, not stepping, virtual flags inline, and a tool that takes no fetch
    /// records (an emulated instruction's fetch record comes from the dispatcher).
    pub inline_iret: bool,
    /// The counters an inline `iretq` adds one to (the mode's instruction count and the
    /// inline emulations), with `Config::count_insns`.
    pub iret_counters: Option<(u64, u64)>,
}

/// An exit of a translated trace, before the dispatcher turns it into a record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ExitSpec {
    /// Direct branch to `target`; the rel32 at `patch_off` is what linking rewrites.
    Direct { target: u64, patch_off: usize },
    /// Sensitive instruction.
    Sensitive(SensitiveInsn),
    /// Attention byte set at entry.
    Attention,
    /// PA check failed at the checked entry.
    PaMismatch,
    /// Record buffer full; resume at `resume_off`. The last `held` records are those of
    /// the instruction about to run: not delivered yet (it may still fault).
    BufferFull { resume_off: usize, held: u8 },
    /// Analysis call number `call` (index in the trace's call list); resume at `resume_off`.
    Call { call: usize, resume_off: usize },
    /// A hoisted check at the top of a self-looping trace found a register in the zone.
    HoistMiss,
}

/// A translated trace.
#[derive(Debug)]
pub(crate) struct Translated {
    pub code: Vec<u8>,
    pub checked_entry: usize,
    pub ret_entry: usize,
    pub entry: usize,
    pub body: usize,
    /// Where the trace's own back edge enters when linked (attention check, then the
    /// body past the hoisted checks), if it has one.
    pub loop_entry: Option<usize>,
    pub exits: Vec<ExitSpec>,
    pub marks: Vec<MapMark>,
}

pub(super) struct Stub {
    pub(super) label: Label,
    pub(super) word: i32,
    pub(super) restore: u16,
    pub(super) guest_pc: u64,
}

pub(super) struct Tx<'e> {
    pub(super) a: Asm,
    pub(super) env: &'e EmitEnv,
    pub(super) calls: &'e [CallSpec],
    pub(super) exits: Vec<ExitSpec>,
    /// Direct exits whose patch offset is filled once the branch is emitted.
    pub(super) stubs: Vec<Stub>,
    /// Records appended so far for the guest instruction (or `rep` iteration) about to
    /// run: a buffer-full exit holds them back.
    pub(super) records_pending: u8,
    /// Out-of-line slow paths of isolation checks, emitted before the stubs.
    pub(super) cold: Vec<ColdCheck>,
    /// The trace's VA page and the frame it was translated from (every instruction starts
    /// on that page): fetch records carry their physical address from here.
    pub(super) page: (u64, u64),
}

/// The storage translating a trace uses besides its input and output, kept across traces
/// (`Scratch::tx`): a translation reuses the previous ones' buffers instead of allocating.
#[derive(Default)]
pub(crate) struct TxBuffers {
    asm: AsmBuffers,
    exits: Vec<ExitSpec>,
    stubs: Vec<Stub>,
    cold: Vec<ColdCheck>,
    /// The storage of the insertions before and after one instruction (`insertions_at`),
    /// empty between traces.
    before: Vec<&'static Insertion>,
    after: Vec<&'static Insertion>,
}

impl TxBuffers {
    /// Takes back the buffers of `tr` once the dispatcher has committed it.
    pub(crate) fn recycle(&mut self, tr: Translated) {
        self.asm.code = tr.code;
        self.asm.marks = tr.marks;
        self.exits = tr.exits;
    }
}

/// The bytes iced's encoder produces for `lea r64, [mem]` or `mov r64, [mem]` with a
/// 64-bit base and/or index and no prefix — the isolation checks' and records' address
/// computations, most of what the translator encodes — without building an encoder
/// (`add_mem_op`'s choices for 64-bit addressing, legacy encoding). `None`: anything
/// else, including what iced rejects, for iced to encode.
fn encode_load_ea(i: &Instruction) -> Option<([u8; 16], usize)> {
    let opcode = match i.code() {
        Code::Lea_r64_m => 0x8D,
        Code::Mov_r64_rm64 if i.op1_kind() == OpKind::Memory => 0x8B,
        _ => return None,
    };
    if i.segment_prefix() != Register::None
        || i.has_lock_prefix()
        || i.has_rep_prefix()
        || i.has_repne_prefix()
    {
        return None;
    }
    let gpr64 = |r: Register| r.is_gpr64().then(|| hw(r));
    let dst = gpr64(i.op0_register())?;
    let base = match i.memory_base() {
        Register::None => None,
        r => Some(gpr64(r)?),
    };
    let index = match i.memory_index() {
        Register::None => None,
        Register::RSP => return None,
        r => Some(gpr64(r)?),
    };
    encode_load_ea_regs(
        opcode,
        dst,
        base,
        index,
        i.memory_index_scale().trailing_zeros() as u8,
        i.memory_displacement64() as i64,
        i.memory_displ_size(),
    )
}

/// [`encode_load_ea`] of the instruction with `opcode` (0x8D `lea`, 0x8B `mov`), 64-bit
/// hardware registers `dst`, `base`, `index` (not RSP), `index*(1 << scale)`, and iced's
/// displacement and displacement size: for callers that have the parts, not an
/// `Instruction`.
#[inline]
pub(super) fn encode_load_ea_regs(
    opcode: u8,
    dst: u8,
    base: Option<u8>,
    index: Option<u8>,
    scale: u8,
    displ: i64,
    mut displ_size: u32,
) -> Option<([u8; 16], usize)> {
    if base.is_none() && index.is_none() {
        return None;
    }
    let displ = i32::try_from(displ).ok()?;
    // [rbp]/[r13] => [rbp+00].
    if displ_size == 0 && base.is_some_and(|b| b & 7 == 5) {
        if displ != 0 {
            return None;
        }
        displ_size = 1;
    }
    if displ_size == 1 && i8::try_from(displ).is_err() {
        displ_size = 8;
    }
    // (mod bits, displacement bytes)
    let (md, dn) = match (base, displ_size) {
        (None, _) => (0, 4),
        (Some(_), 1) => (1, 1),
        (Some(_), 8) => (2, 4),
        (Some(_), 0) if displ == 0 => (0, 0),
        _ => return None,
    };
    let mut b = [0u8; 16];
    let rex_x = index.map_or(0, |x| (x >> 3) << 1);
    let rex_b = base.map_or(0, |r| r >> 3);
    b[0] = 0x48 | (dst >> 3) << 2 | rex_x | rex_b;
    b[1] = opcode;
    let reg_bits = (dst & 7) << 3;
    let mut n = 3;
    match (base, index) {
        (Some(r), None) if r & 7 != 4 && scale == 0 => b[2] = md << 6 | reg_bits | (r & 7),
        _ => {
            b[2] = md << 6 | reg_bits | 4;
            b[3] = scale << 6 | base.map_or(5, |r| r & 7) | index.map_or(0x20, |x| (x & 7) << 3);
            n = 4;
        }
    }
    b[n..n + dn].copy_from_slice(&displ.to_le_bytes()[..dn]);
    Some((b, n + dn))
}

pub(super) fn hw(r: Register) -> u8 {
    (r.full_register() as u32 - Register::RAX as u32) as u8
}

pub(super) fn reg_of(n: u8) -> Register {
    // SAFETY-free conversion: RAX..R15 are contiguous in iced's Register enum.
    Register::values()
        .nth(Register::RAX as usize + usize::from(n))
        .unwrap_or(Register::RAX)
}

impl Tx<'_> {
    pub(super) fn exit_index(&self) -> u32 {
        self.env.exit_base + self.exits.len() as u32
    }

    /// Allocates an exit and its (out-of-line) stub; returns the stub label.
    pub(super) fn new_stub(
        &mut self,
        kind: u32,
        spec: ExitSpec,
        restore: u16,
        guest_pc: u64,
    ) -> Label {
        let label = self.a.new_label();
        let word = exit_word(kind, self.exit_index());
        self.exits.push(spec);
        self.stubs.push(Stub {
            label,
            word,
            restore,
            guest_pc,
        });
        label
    }

    /// Emits a direct exit: `jmp rel32` (or `jcc rel32` when `cc` is given) to a stub.
    fn emit_direct_exit(&mut self, cc: Option<u8>, target: u64, guest_pc: u64) {
        let idx = self.exits.len();
        let l = self.new_stub(
            EXIT_DIRECT,
            ExitSpec::Direct {
                target,
                patch_off: 0,
            },
            0,
            guest_pc,
        );
        let patch_off = match cc {
            Some(c) => self.a.jcc_label(c, l),
            None => self.a.jmp_label(l),
        };
        self.exits[idx] = ExitSpec::Direct { target, patch_off };
    }

    /// `mov qword [ctx.exit_word], word; jmp exit` inline.
    pub(super) fn emit_exit_inline(&mut self, kind: u32, spec: ExitSpec) {
        let word = exit_word(kind, self.exit_index());
        self.exits.push(spec);
        self.a.mov_m64_imm32(self.env.ctx.exit_word, word);
        self.a.jmp_abs(self.env.gen.exit);
    }

    pub(super) fn encode(&self, i: &Instruction, guest_pc: u64) -> Result<Vec<u8>, EngineError> {
        if let Some((b, n)) = encode_load_ea(i) {
            return Ok(b[..n].to_vec());
        }
        let mut enc = Encoder::new(64);
        enc.encode(i, self.a.pc())
            .map_err(|_| EngineError::Encode(GuestVirt(guest_pc)))?;
        Ok(enc.take_buffer())
    }

    /// Emits `i` encoded for 64-bit mode at the current cache address: what
    /// [`Tx::encode`] returns, appended to the code buffer without a `Vec` of its own
    /// (iced's encoder appends to the code buffer lent to it).
    pub(super) fn emit_enc(&mut self, i: &Instruction, guest_pc: u64) -> Result<(), EngineError> {
        if let Some((b, n)) = encode_load_ea(i) {
            self.a.bytes_of(&b, n);
            return Ok(());
        }
        let rip = self.a.pc();
        let len = self.a.buf.len();
        let mut enc = Encoder::new(64);
        enc.set_buffer(core::mem::take(&mut self.a.buf));
        let r = enc.encode(i, rip);
        self.a.buf = enc.take_buffer();
        if r.is_err() {
            self.a.buf.truncate(len);
            return Err(EngineError::Encode(GuestVirt(guest_pc)));
        }
        Ok(())
    }

    /// A scratch GPR instruction `d` does not use (never RSP/RBP/R13).
    fn pick_scratch(&mut self, d: &DecodedInsn, avoid: u16) -> Result<u8, EngineError> {
        let used: u16 = d.gprs_used | avoid | 1 << reg::RSP | 1 << reg::RBP | 1 << reg::R13;
        (0..16u8)
            .find(|r| used & (1 << r) == 0)
            .ok_or(EngineError::Unsupported(GuestVirt(d.instr.ip())))
    }

    // ---- entry checks ------------------------------------------------------------------

    /// The trace's `checked_entry`: the PA check (`softtlb.rs`) with its exit stub.
    fn emit_pa_check(&mut self, va_page: u64, pa_page: u64, guest_pc: u64) {
        let fail = self.new_stub(
            EXIT_PA_MISMATCH,
            ExitSpec::PaMismatch,
            PA_CHECK_SPILLED,
            guest_pc,
        );
        let slot = self.env.softtlb_slot;
        emit_pa_check(&mut self.a, slot, va_page, pa_page, guest_pc, fail);
    }

    fn emit_attention_check(&mut self, flags_dead: bool, guest_pc: u64) {
        self.a.mark_guest(guest_pc);
        if flags_dead {
            let l = self.new_stub(EXIT_ATTENTION, ExitSpec::Attention, 0, guest_pc);
            self.a.cmp_m8_imm8(self.env.ctx.attention, 0);
            self.a.jcc_label(0x5, l);
        } else {
            let l = self.new_stub(EXIT_ATTENTION, ExitSpec::Attention, 1 << reg::RCX, guest_pc);
            let ok = self.a.new_label();
            self.a.emit_spill(reg::RCX);
            self.a.movzx_r32_m8(reg::RCX, self.env.ctx.attention);
            self.a.jrcxz_label(ok);
            self.a.jmp_label(l);
            self.a.bind(ok);
            self.a.emit_unspill(reg::RCX);
        }
    }

    // ---- mangle rules ------------------------------------------------------------------

    /// RIP-relative operand: the cache is > 2 GiB from guest code, so the operand becomes
    /// `[scratch]` with the absolute address loaded into a spilled scratch register
    /// (`lea r, [rip+x]` becomes `mov r, imm`).
    fn mangle_rip_rel(&mut self, d: &DecodedInsn) -> Result<(), EngineError> {
        let i = &d.instr;
        let abs = i.ip_rel_memory_address();
        if i.code() == Code::Lea_r64_m {
            self.a.mov_r_imm64(hw(i.op0_register()), abs);
            return Ok(());
        }
        if i.code() == Code::Lea_r32_m {
            self.a.mov_r_imm64(hw(i.op0_register()), abs & 0xFFFF_FFFF);
            return Ok(());
        }
        let s = self.pick_scratch(d, 0)?;
        self.a.emit_spill(s);
        self.a.mov_r_imm64(s, abs);
        let mut i2 = *i;
        i2.set_memory_base(reg_of(s));
        i2.set_memory_index(Register::None);
        i2.set_memory_displacement64(0);
        i2.set_memory_displ_size(0);
        self.emit_enc(&i2, i.ip())?;
        self.a.emit_unspill(s);
        Ok(())
    }

    /// `mov rdx, [mo]` (the guest instruction at `pc` for errors).
    fn emit_mov_rdx(&mut self, mo: MemoryOperand, pc: u64) -> Result<(), EngineError> {
        let l = Instruction::with2(Code::Mov_r64_rm64, Register::RDX, mo)
            .map_err(|_| EngineError::Encode(GuestVirt(pc)))?;
        self.emit_enc(&l, pc)?;
        Ok(())
    }

    /// Loads the target of `jmp/call r/m64` into RDX (RCX, RDX already spilled, unchanged).
    fn emit_load_target_rdx(&mut self, i: &Instruction) -> Result<(), EngineError> {
        match i.op0_kind() {
            OpKind::Register => {
                let r = hw(i.op0_register());
                if r != reg::RDX {
                    self.a.mov_r_r(reg::RDX, r);
                }
            }
            OpKind::Memory if i.is_ip_rel_memory_operand() => {
                self.a.mov_r_imm64(reg::RDX, i.ip_rel_memory_address());
                if i.segment_prefix() == Register::None {
                    self.a.mov_r_mb(reg::RDX, reg::RDX, 0);
                } else {
                    // `fs:`/`gs:` through the absolute offset: `mov rdx, seg:[rdx]`.
                    let mo = MemoryOperand::with_base_index_scale_bcst_seg(
                        Register::RDX,
                        Register::None,
                        1,
                        false,
                        i.segment_prefix(),
                    );
                    self.emit_mov_rdx(mo, i.ip())?;
                }
            }
            OpKind::Memory => {
                let mo = MemoryOperand::new(
                    i.memory_base(),
                    i.memory_index(),
                    i.memory_index_scale(),
                    i.memory_displacement64() as i64,
                    if i.memory_displacement64() == 0 { 0 } else { 1 },
                    false,
                    i.segment_prefix(),
                );
                self.emit_mov_rdx(mo, i.ip())?;
            }
            _ => return Err(EngineError::Unsupported(GuestVirt(i.ip()))),
        }
        Ok(())
    }

    fn emit_count_lookup(&mut self) {
        if self.env.count_ibl {
            let c = self.env.ctx;
            self.a.mov_r_m(reg::RCX, c.ibl_lookups);
            self.a.lea_r_disp(reg::RCX, reg::RCX, 1);
            self.a.mov_m_r(c.ibl_lookups, reg::RCX);
        }
    }

    /// Inline indirect-branch lookup: RDX = guest target, RCX/RDX spilled. Inlined per
    /// site so that each site ends in its own indirect jump (its own prediction).
    pub(super) fn emit_ibl(&mut self) {
        self.emit_count_lookup();
        let (ctx, table, miss) = (self.env.ctx, self.env.ibl_table, self.env.gen.ibl_miss);
        emit_ibl_lookup(&mut self.a, &ctx, table, miss);
    }

    /// Return through the return cache (HDTrans-style): RDX = popped guest return address,
    /// RCX/RDX spilled. The slot for the low 16 bits of the address holds the `ret_entry`
    /// landing pad of the fragment last seen at such an address; the pad checks the full
    /// address. Empty slots and wrong pads fall back to the shared hash lookup.
    fn emit_return_cache(&mut self) {
        let c = self.env.ctx;
        self.emit_count_lookup();
        let miss = self.a.new_label();
        self.a.mov_m_r(c.ret_target, reg::RDX);
        self.a.movzx_r32_r16(reg::RCX, reg::RDX);
        self.a.lea_r_rip(reg::RDX, self.env.rc_table);
        self.a.mov_r_mbi(reg::RCX, reg::RDX, reg::RCX, 3);
        self.a.jrcxz_label(miss);
        self.a.jmp_r(reg::RCX);
        self.a.bind(miss);
        self.a.mov_r_m(reg::RDX, c.ret_target);
        self.a.jmp_abs(self.env.ibl_shared);
    }

    /// The landing pad a return-cache hit jumps to: checks that the popped address is this
    /// fragment's start, else continues in the shared hash lookup.
    fn emit_ret_entry(&mut self, start: u64) {
        let c = self.env.ctx;
        self.a.mark_guest(start);
        self.a.set_spilled(1 << reg::RCX | 1 << reg::RDX);
        let ok = self.a.new_label();
        self.a.mov_r_m(reg::RCX, c.ret_target);
        self.a.mov_r_imm64(reg::RDX, start.wrapping_neg());
        self.a.lea_r_bi(reg::RCX, reg::RCX, reg::RDX, 0);
        self.a.jrcxz_label(ok);
        self.a.mov_r_m(reg::RDX, c.ret_target);
        self.a.jmp_abs(self.env.ibl_shared);
        self.a.bind(ok);
        self.a.emit_unspill(reg::RCX);
        self.a.emit_unspill(reg::RDX);
    }

    fn mangle_indirect(&mut self, d: &DecodedInsn) -> Result<(), EngineError> {
        let i = &d.instr;
        self.a.emit_spill(reg::RCX);
        self.a.emit_spill(reg::RDX);
        match d.class {
            Class::Ret { pop } if self.env.compat => self.compat_pop_return(pop, i.ip())?,
            Class::Ret { pop } => {
                self.a.pop_r(reg::RDX);
                if pop != 0 {
                    self.a.lea_r_disp(reg::RSP, reg::RSP, i32::from(pop));
                }
            }
            Class::CallInd if self.env.compat => {
                self.compat_load_target_edx(i)?;
                self.compat_push_imm(i.next_ip() as u32, i.ip())?;
            }
            Class::CallInd => {
                self.emit_load_target_rdx(i)?;
                self.a.push_imm64(i.next_ip());
            }
            _ if self.env.compat => self.compat_load_target_edx(i)?,
            _ => self.emit_load_target_rdx(i)?,
        }
        if matches!(d.class, Class::Ret { .. }) && self.env.return_cache {
            self.emit_return_cache();
        } else {
            self.emit_ibl();
        }
        Ok(())
    }

    /// `rep` string instruction with per-iteration records: an explicit loop.
    fn mangle_rep_string(
        &mut self,
        d: &DecodedInsn,
        ops: &[MemOperand],
    ) -> Result<(), EngineError> {
        let i = &d.instr;
        let (one, n) = strip_rep(d.bytes());
        let top = self.a.new_label();
        let body = self.a.new_label();
        let done = self.a.new_label();
        let z = self.a.new_label();
        self.a.bind(top);
        self.a.jrcxz_label(z);
        self.a.bytes(&[0xEB, 0x05]); // jmp short body
        self.a.bind(z);
        self.a.jmp_label(done);
        self.a.bind(body);
        self.records_pending = 0;
        self.insert_mem_records(ops, i.ip(), None)?;
        self.a.bytes(&one[..n]);
        self.a.lea_r_disp(reg::RCX, reg::RCX, -1);
        let conditional = matches!(
            i.mnemonic(),
            iced_x86::Mnemonic::Cmpsb
                | iced_x86::Mnemonic::Cmpsw
                | iced_x86::Mnemonic::Cmpsd
                | iced_x86::Mnemonic::Cmpsq
                | iced_x86::Mnemonic::Scasb
                | iced_x86::Mnemonic::Scasw
                | iced_x86::Mnemonic::Scasd
                | iced_x86::Mnemonic::Scasq
        );
        if conditional {
            // repe: stop when ZF=0 (jne); repne: stop when ZF=1 (je).
            let cc = if i.has_repne_prefix() { 0x4 } else { 0x5 };
            self.a.jcc_label(cc, done);
        }
        self.a.jmp_label(top);
        self.a.bind(done);
        Ok(())
    }

    fn mangle_insn(
        &mut self,
        d: &DecodedInsn,
        rep_records: Option<&[MemOperand]>,
    ) -> Result<(), EngineError> {
        let i = &d.instr;
        let pc = i.ip();
        match d.class {
            Class::Plain if self.env.compat => self.compat_plain(d)?,
            Class::Plain => match rep_records {
                Some(ops) => self.mangle_rep_string(d, ops)?,
                None => self.a.bytes_of(&d.bytes, d.instr.len()),
            },
            Class::LoopLike { target } if self.env.compat => {
                // In ECX: the 0x67 form of the same opcode (`compat::untranslatable`
                // leaves only those), over a short jump to the taken exit.
                let opcode = d.bytes()[0];
                self.a.bytes(&[0x67, opcode, 2, 0xEB, 5]);
                self.emit_direct_exit(None, target, pc);
            }
            Class::RipRel => self.mangle_rip_rel(d)?,
            Class::Jcc { cc, target } => self.emit_direct_exit(Some(cc), target, pc),
            Class::LoopLike { target } => {
                let b = d.bytes();
                self.a.bytes(&b[..b.len() - 1]);
                self.a.bytes(&[2, 0xEB, 5]);
                self.emit_direct_exit(None, target, pc);
            }
            Class::Jmp { target } => self.emit_direct_exit(None, target, pc),
            Class::JmpElided { .. } => {}
            Class::Call { target } if self.env.compat => {
                self.compat_push_imm(i.next_ip() as u32, pc)?;
                self.emit_direct_exit(None, target, pc);
            }
            Class::Call { target } => {
                self.a.push_imm64(i.next_ip());
                self.emit_direct_exit(None, target, pc);
            }
            Class::JmpInd | Class::CallInd | Class::Ret { .. } => self.mangle_indirect(d)?,
            Class::VirtFlags => self.emit_virtual_flags(d)?,
        }
        Ok(())
    }

    fn emit_stubs(&mut self) {
        // Drained, not consumed: the storage goes back to `TxBuffers` for the next trace.
        let mut stubs = core::mem::take(&mut self.stubs);
        for s in stubs.drain(..) {
            self.a.bind(s.label);
            self.a.mark_guest(s.guest_pc);
            self.a.set_spilled(s.restore);
            // Ascending register numbers.
            let mut restore = s.restore;
            while restore != 0 {
                self.a.emit_unspill(restore.trailing_zeros() as u8);
                restore &= restore - 1;
            }
            self.a.mov_m64_imm32(self.env.ctx.exit_word, s.word);
            self.a.jmp_abs(self.env.gen.exit);
        }
        self.stubs = stubs;
    }
}

/// Offsets in a trace's code of its entry points (the module header's layout).
struct Heads {
    checked_entry: usize,
    ret_entry: usize,
    entry: usize,
    body: usize,
    loop_entry: Option<usize>,
}

impl Tx<'_> {
    /// Emits the trace's heads, in layout order: the PA-checked entry, the return-cache
    /// entry, then at `entry` the hoisted isolation checks (if any) and the attention
    /// check, before the body.
    fn emit_heads(
        &mut self,
        t: &DecodedTrace,
        live: &[u32],
        bases: &mut BaseState,
    ) -> Result<Heads, EngineError> {
        let start = t.start.0;
        let checked_entry = self.a.offset();
        self.emit_pa_check(t.start.page().0, t.pa.page().0, start);
        let entry_label = self.a.new_label();
        self.a.jmp_label(entry_label);
        let ret_entry = self.a.offset();
        self.emit_ret_entry(start);
        self.a.bind(entry_label);
        let entry = self.a.offset();
        let hoisted = if self.env.isolate && self.env.hoist {
            hoistable(self, t, live)
        } else {
            Hoisted::default()
        };
        // A self-looping trace with hoisted checks: they come first (the dispatcher enters
        // there too), the back edge enters at `loop_entry`, the attention check after them.
        let (body, loop_entry) = if hoisted.any() {
            let hit = self.new_stub(EXIT_HOIST_MISS, ExitSpec::HoistMiss, 0, start);
            self.a.mark_guest(start);
            self.emit_hoisted_checks(hoisted, start, bases, hit)?;
            let loop_entry = self.a.offset();
            self.emit_attention_check(live[0] == 0, start);
            (entry, Some(loop_entry))
        } else {
            self.emit_attention_check(live[0] == 0, start);
            (self.a.offset(), None)
        };
        Ok(Heads {
            checked_entry,
            ret_entry,
            entry,
            body,
            loop_entry,
        })
    }

    /// Emits instruction `k` of `t` with what runs around it: its isolation checks, the
    /// `before` insertions, the instruction (mangled), the `after` insertions if it falls
    /// through. `live[k]` is the flags live before it.
    fn emit_insn(
        &mut self,
        t: &DecodedTrace,
        k: usize,
        live: &[u32],
        bases: &mut BaseState,
        before: &mut Vec<&Insertion>,
        after: &[&Insertion],
    ) -> Result<(), EngineError> {
        let d = &t.insns[k];
        let info = &t.info[k];
        let pc = d.instr.ip();
        self.a.mark_guest(pc);
        if self.env.isolate {
            self.emit_isolation_checks(d, &info.mem, bases, live[k] == 0)?;
            self.a.mark_guest(pc);
        }
        let wants_records = before.iter().any(|x| x.action == Action::MemRecords);
        // (32-bit code's `rep` strings run whole, recorded once.)
        let rep_loop = info.rep && wants_records && !self.env.compat && !d.bytes().contains(&0x67);
        // A `rep` string run as a loop of records may fault after some iterations, with
        // buffer deliveries between them: its fetch record goes after it, so that an
        // attempt that faults (taken back, then retried) has delivered none.
        let fetch_after = rep_loop && before.iter().any(|x| x.action == Action::FetchRecord);
        if fetch_after {
            before.retain(|x| x.action != Action::FetchRecord);
        }
        self.records_pending = 0;
        // (No insertions emit nothing, as after the instruction below.)
        if !before.is_empty() {
            self.insert_actions(before, &info.mem, pc, info.len, live[k] == 0, rep_loop)?;
        }
        self.a.mark_guest(pc);
        self.mangle_insn(d, if rep_loop { Some(&info.mem) } else { None })?;
        if fetch_after {
            self.a.mark_guest(d.instr.next_ip());
            self.records_pending = 0;
            self.insert_fetch_record(pc, u32::from(info.len))?;
        }
        let falls_through = matches!(
            d.class,
            Class::Plain
                | Class::RipRel
                | Class::Jcc { .. }
                | Class::LoopLike { .. }
                | Class::VirtFlags
        );
        if falls_through && !after.is_empty() {
            let next = d.instr.next_ip();
            self.a.mark_guest(next);
            self.records_pending = 0;
            self.insert_actions(after, &[], next, 0, live[k + 1] == 0, true)?;
        }
        Ok(())
    }

    /// Emits how the trace leaves when its last instruction does not: a direct exit to
    /// the fall-through address, or the sensitive instruction's exit.
    fn emit_trace_end(&mut self, end: TraceEnd) {
        match end {
            TraceEnd::FallThrough(pc) => {
                self.a.mark_guest(pc);
                self.emit_direct_exit(None, pc, pc);
            }
            TraceEnd::Sensitive(s) => {
                self.a.mark_guest(s.pc.0);
                if self.env.inline_iret && super::vflags::is_iretq(&s) {
                    self.emit_inline_iretq(s);
                } else {
                    self.emit_exit_inline(EXIT_SENSITIVE, ExitSpec::Sensitive(s));
                }
            }
            TraceEnd::Transfer => {}
        }
    }
}

/// Sorts the insertions at instruction `k` into `before` and `after` (cleared first),
/// keeping their order.
fn insertions_at<'i>(
    insertions: &'i [Insertion],
    k: usize,
    before: &mut Vec<&'i Insertion>,
    after: &mut Vec<&'i Insertion>,
) {
    before.clear();
    after.clear();
    for ins in insertions.iter().filter(|x| x.ins == k) {
        match ins.point {
            IPoint::Before => before.push(ins),
            IPoint::After => after.push(ins),
        }
    }
}

/// Translates `t` (`live`: its `flags_liveness`) for placement at `env.base` with the
/// given insertions: the heads, each instruction with its instrumentation, the trace's
/// end, then the out-of-line code (cold isolation checks, exit stubs).
pub(crate) fn translate_trace(
    t: &DecodedTrace,
    live: &[u32],
    insertions: &[Insertion],
    calls: &[CallSpec],
    env: &EmitEnv,
    scratch: &mut Scratch,
) -> Result<Translated, EngineError> {
    let bufs = &mut scratch.tx;
    let mut tx = Tx {
        a: Asm::with_buffers(env.base, env.ctx.spill, core::mem::take(&mut bufs.asm)),
        env,
        calls,
        exits: cleared(&mut bufs.exits),
        stubs: cleared(&mut bufs.stubs),
        records_pending: 0,
        cold: cleared(&mut bufs.cold),
        page: (t.start.page().0, t.pa.page().0),
    };
    let mut bases = BaseState::default();
    let heads = tx.emit_heads(t, live, &mut bases)?;
    // Reused for every instruction, and across traces.
    let mut before = relifetime(core::mem::take(&mut bufs.before));
    let mut after = relifetime(core::mem::take(&mut bufs.after));
    for k in 0..t.insns.len() {
        insertions_at(insertions, k, &mut before, &mut after);
        tx.emit_insn(t, k, live, &mut bases, &mut before, &after)?;
    }
    bufs.before = relifetime(before);
    bufs.after = relifetime(after);
    tx.emit_trace_end(t.end);
    tx.emit_cold_checks()?;
    tx.emit_stubs();
    bufs.stubs = tx.stubs;
    bufs.cold = tx.cold;
    let mut asm = tx.a.finish_buffers()?;
    let code = core::mem::take(&mut asm.code);
    let marks = core::mem::take(&mut asm.marks);
    // Labels and fixups stay; the code, the PC map and the exits come back through
    // `TxBuffers::recycle`.
    bufs.asm = asm;
    Ok(Translated {
        code,
        checked_entry: heads.checked_entry,
        ret_entry: heads.ret_entry,
        entry: heads.entry,
        body: heads.body,
        loop_entry: heads.loop_entry,
        exits: tx.exits,
        marks,
    })
}

/// `v`'s storage, emptied, for references of another lifetime (collected in place: the
/// allocation is kept).
fn relifetime<'b>(mut v: Vec<&Insertion>) -> Vec<&'b Insertion> {
    v.clear();
    v.into_iter().map(|_| unreachable!("emptied")).collect()
}

/// `v`'s storage, emptied, leaving `v` empty.
fn cleared<T>(v: &mut Vec<T>) -> Vec<T> {
    let mut v = core::mem::take(v);
    v.clear();
    v
}

#[cfg(test)]
mod tests {
    use iced_x86::{Code, Encoder, Instruction, MemoryOperand, Register};

    /// The hand encoder agrees with iced wherever it answers, over every base, index,
    /// scale and displacement class (the translate_digest corpus checks real uses).
    #[test]
    fn test_encode_load_ea_matches_iced() {
        let regs = || {
            core::iter::once(Register::None)
                .chain((0..16u8).map(super::reg_of))
                .chain([Register::EAX, Register::RIP])
        };
        let disps: [i64; 11] = [
            0,
            1,
            -1,
            127,
            128,
            -128,
            -129,
            0x7FFF_FFFF,
            -0x8000_0000,
            0x8000_0000,
            -0x8000_0001,
        ];
        let mut answered = 0;
        for code in [Code::Lea_r64_m, Code::Mov_r64_rm64] {
            for dst in [Register::RCX, Register::RDX, Register::R9, Register::R12] {
                for base in regs() {
                    for index in regs() {
                        for scale in [1, 2, 4, 8] {
                            for disp in disps {
                                for displ_size in [0, 1, 4, 8] {
                                    let mo = MemoryOperand::new(
                                        base,
                                        index,
                                        scale,
                                        disp,
                                        displ_size,
                                        false,
                                        Register::None,
                                    );
                                    let Ok(i) = Instruction::with2(code, dst, mo) else {
                                        continue;
                                    };
                                    let Some((b, n)) = super::encode_load_ea(&i) else {
                                        continue;
                                    };
                                    answered += 1;
                                    let mut enc = Encoder::new(64);
                                    let r = enc.encode(&i, 0x7000_0000_0000);
                                    assert!(r.is_ok(), "{i:?}: iced fails where we answer");
                                    assert_eq!(&b[..n], &enc.take_buffer()[..], "{i:?}");
                                }
                            }
                        }
                    }
                }
            }
        }
        assert!(answered > 100_000, "{answered}");
    }

    #[test]
    fn test_encode_mov_rdx_mem() {
        let mo = MemoryOperand::new(
            Register::RBX,
            Register::None,
            1,
            8,
            1,
            false,
            Register::None,
        );
        let l = Instruction::with2(Code::Mov_r64_rm64, Register::RDX, mo).expect("create");
        let mut enc = Encoder::new(64);
        let r = enc.encode(&l, 0x7000_0000_0000);
        assert!(r.is_ok(), "{r:?}");
    }
}
