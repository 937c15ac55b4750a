//! Decoding a sensitive instruction, the privilege checks common to its family, and the
//! table from iced-x86's `Code` to the handler that emulates it. Every handler has the
//! same shape ([`Handler`]): it returns where the guest continues, why the run stops, or
//! the exception to raise at the instruction (registers as before it), which
//! [`Platform::emulate`] delivers.

use iced_x86::{Code, Decoder, DecoderOptions, Instruction, Mnemonic, OpKind, Register};
use kpin_abi::x86::{cr4, is_canonical, vector};

use super::events::Event;
use super::hardware::{GuestMmu, Hardware};
use super::segments::Sreg;
use super::{Vcpu, VcpuStop};
use crate::{
    Emulation, Gpr, GuestPhys, GuestRegs, GuestVirt, Platform, SegBase, SensitiveInsn,
    SensitiveKind,
};

/// What an emulation does next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    /// Continue at this guest address.
    Continue(GuestVirt),
    /// Stop the run loop for this reason.
    Stop(VcpuStop),
}

impl Flow {
    /// The stop for an instruction (or a case of it) that is not emulated.
    pub fn unsupported(i: &Instruction, why: &'static str) -> Self {
        Flow::Stop(VcpuStop::Unsupported {
            mnemonic: Some(i.mnemonic()),
            why,
        })
    }
}

/// The result of emulating one instruction: what next, or an exception to raise at the
/// instruction (registers as before it).
pub type Step = Result<Flow, Event>;

/// One instruction's emulation: the virtual CPU, the decoded instruction, the guest's
/// registers and the address of the next instruction.
pub type Handler<'a, H, M> =
    fn(&mut Vcpu<'a, H, M>, &Instruction, &mut GuestRegs, GuestVirt) -> Step;

/// Whether `bytes` begin with 15 prefixes (legacy, or REX in 64-bit code): no room is
/// left for an opcode within the architectural 15-byte limit.
fn too_long(bytes: &[u8], bitness: u32) -> bool {
    bytes.len() >= 15
        && bytes[..15].iter().all(|&b| {
            matches!(
                b,
                0x66 | 0x67 | 0xF0 | 0xF2 | 0xF3 | 0x2E | 0x36 | 0x3E | 0x26 | 0x64 | 0x65
            ) || (bitness == 64 && b & 0xF0 == 0x40)
        })
}

/// #GP(0).
pub fn gp0() -> Event {
    Event::fault(vector::GP, 0)
}

/// The 64-bit GPR `r` is part of.
pub fn gpr(r: Register) -> Option<Gpr> {
    let full = r.full_register();
    Gpr::from_number(full.number() as u8).filter(|_| full.is_gpr64())
}

/// Instructions that need CPL 0 (#GP(0) above it). IOPL-sensitive ones (`cli`, `sti`,
/// `in`, `out`) are checked by their handlers.
fn privileged(i: &Instruction, kind: SensitiveKind) -> bool {
    matches!(
        i.mnemonic(),
        Mnemonic::Hlt
            | Mnemonic::Lgdt
            | Mnemonic::Lidt
            | Mnemonic::Ltr
            | Mnemonic::Lldt
            | Mnemonic::Mov
            | Mnemonic::Rdmsr
            | Mnemonic::Wrmsr
            | Mnemonic::Swapgs
            | Mnemonic::Sysretq
            | Mnemonic::Invlpg
            | Mnemonic::Wbinvd
            | Mnemonic::Invd
            | Mnemonic::Clts
            | Mnemonic::Lmsw
    ) && kind != SensitiveKind::SegmentRegister
}

/// Instructions CR4.UMIP makes CPL-0-only.
fn umip_protected(i: &Instruction) -> bool {
    matches!(
        i.mnemonic(),
        Mnemonic::Sgdt | Mnemonic::Sidt | Mnemonic::Sldt | Mnemonic::Str | Mnemonic::Smsw
    )
}

impl<'a, H: Hardware, M: GuestMmu> Vcpu<'a, H, M> {
    /// The handler of `code`, `None` if it is not emulated. One table per family of
    /// instructions, in the order of the modules that hold their handlers (a code is in
    /// one table only; the first that knows it answers).
    fn handler(code: Code) -> Option<Handler<'a, H, M>> {
        Self::system_handler(code)
            .or_else(|| Self::segment_handler(code))
            .or_else(|| Self::machine_handler(code))
            .or_else(|| Self::legacy_handler(code))
            .or_else(|| Self::optional_handler(code))
            .or_else(|| Self::event_handler(code))
    }

    /// Control and debug registers, the virtual IF/IOPL/TF, descriptor-table registers
    /// (`cr.rs`, `flags.rs`, `tables.rs`).
    fn system_handler(code: Code) -> Option<Handler<'a, H, M>> {
        let h: Handler<'a, H, M> = match code {
            // cr.rs
            Code::Mov_r64_cr => Self::mov_from_cr,
            Code::Mov_cr_r64 => Self::mov_to_cr,
            Code::Mov_r64_dr => Self::mov_from_dr,
            Code::Mov_dr_r64 => Self::mov_to_dr,
            Code::Smsw_rm16 | Code::Smsw_r32m16 | Code::Smsw_r64m16 => Self::smsw,
            Code::Lmsw_rm16 | Code::Lmsw_r32m16 => Self::lmsw,
            Code::Clts => Self::clts,
            Code::Invlpg_m => Self::invlpg,
            // flags.rs
            Code::Cli => Self::cli,
            Code::Sti => Self::sti,
            Code::Pushfq | Code::Pushfd => Self::pushfq,
            Code::Popfq | Code::Popfd => Self::popfq,
            // tables.rs
            Code::Lgdt_m1664 | Code::Lidt_m1664 => Self::load_table,
            Code::Sgdt_m1664 | Code::Sidt_m1664 => Self::store_table,
            Code::Str_rm16 | Code::Str_r32m16 | Code::Str_r64m16 => Self::str,
            Code::Sldt_rm16 | Code::Sldt_r32m16 | Code::Sldt_r64m16 => Self::sldt,
            Code::Ltr_rm16
            | Code::Ltr_r32m16
            | Code::Ltr_r64m16
            | Code::Lldt_rm16
            | Code::Lldt_r32m16
            | Code::Lldt_r64m16 => Self::load_system,
            _ => return None,
        };
        Some(h)
    }

    /// Segment registers and the descriptor queries (`segments.rs`,
    /// `segment_query.rs`).
    fn segment_handler(code: Code) -> Option<Handler<'a, H, M>> {
        let h: Handler<'a, H, M> = match code {
            // segments.rs
            Code::Mov_Sreg_rm16 | Code::Mov_Sreg_r32m16 | Code::Mov_Sreg_r64m16 => {
                Self::mov_to_sreg
            }
            Code::Mov_rm16_Sreg | Code::Mov_r32m16_Sreg | Code::Mov_r64m16_Sreg => {
                Self::mov_from_sreg
            }
            // segment_query.rs
            Code::Lar_r16_rm16 | Code::Lar_r32_r32m16 | Code::Lar_r64_r64m16 => Self::lar,
            Code::Lsl_r16_rm16 | Code::Lsl_r32_r32m16 | Code::Lsl_r64_r64m16 => Self::lsl,
            Code::Verr_rm16
            | Code::Verr_r32m16
            | Code::Verr_r64m16
            | Code::Verw_rm16
            | Code::Verw_r32m16
            | Code::Verw_r64m16 => Self::verify,
            Code::Pushw_FS
            | Code::Pushq_FS
            | Code::Pushw_GS
            | Code::Pushq_GS
            | Code::Pushd_FS
            | Code::Pushd_GS
            | Code::Pushd_ES
            | Code::Pushd_CS
            | Code::Pushd_SS
            | Code::Pushd_DS
            | Code::Pushw_ES
            | Code::Pushw_CS
            | Code::Pushw_SS
            | Code::Pushw_DS => Self::push_sreg,
            Code::Popw_FS
            | Code::Popq_FS
            | Code::Popw_GS
            | Code::Popq_GS
            | Code::Popd_FS
            | Code::Popd_GS
            | Code::Popd_ES
            | Code::Popd_SS
            | Code::Popd_DS
            | Code::Popw_ES
            | Code::Popw_SS
            | Code::Popw_DS => Self::pop_sreg,
            Code::Retfw
            | Code::Retfd
            | Code::Retfq
            | Code::Retfw_imm16
            | Code::Retfd_imm16
            | Code::Retfq_imm16 => Self::far_return,
            _ => return None,
        };
        Some(h)
    }

    /// MSRs, `syscall`/`sysret` and base registers, port I/O, and the rest (`cpuid`,
    /// time stamps, `hlt`): `msr.rs`, `syscall.rs`, `port_io.rs`, `misc.rs`.
    fn machine_handler(code: Code) -> Option<Handler<'a, H, M>> {
        let h: Handler<'a, H, M> = match code {
            // msr.rs
            Code::Rdmsr => Self::rdmsr,
            Code::Wrmsr => Self::wrmsr,
            // syscall.rs
            Code::Syscall => Self::syscall,
            Code::Sysretq | Code::Sysretd => Self::sysretq,
            Code::Swapgs => Self::swapgs,
            Code::Rdfsbase_r64 | Code::Rdgsbase_r64 => Self::rd_base,
            Code::Wrfsbase_r64 | Code::Wrgsbase_r64 => Self::wr_base,
            // port_io.rs
            Code::Out_imm8_AL
            | Code::Out_DX_AL
            | Code::Out_imm8_AX
            | Code::Out_DX_AX
            | Code::Out_imm8_EAX
            | Code::Out_DX_EAX
            | Code::In_AL_imm8
            | Code::In_AL_DX
            | Code::In_AX_imm8
            | Code::In_AX_DX
            | Code::In_EAX_imm8
            | Code::In_EAX_DX => Self::port_io,
            Code::Insb_m8_DX
            | Code::Insw_m16_DX
            | Code::Insd_m32_DX
            | Code::Outsb_DX_m8
            | Code::Outsw_DX_m16
            | Code::Outsd_DX_m32 => Self::port_string,
            // misc.rs
            Code::Cpuid => Self::cpuid,
            Code::Wbinvd | Code::Invd => Self::cache_control,
            Code::Xgetbv | Code::Xsetbv => Self::xcr,
            Code::Rdtsc => Self::rdtsc,
            Code::Rdtscp => Self::rdtscp,
            Code::Rdpid_r64 => Self::rdpid,
            Code::Hlt => Self::hlt,
            _ => return None,
        };
        Some(h)
    }

    /// Far transfers and the instructions 64-bit mode dropped (`legacy.rs`).
    fn legacy_handler(code: Code) -> Option<Handler<'a, H, M>> {
        let h: Handler<'a, H, M> = match code {
            // legacy.rs
            Code::Jmp_m1616 | Code::Jmp_m1632 | Code::Jmp_m1664 | Code::Jmp_ptr1632 => {
                Self::far_jmp
            }
            Code::Call_m1616 | Code::Call_m1632 | Code::Call_m1664 | Code::Call_ptr1632 => {
                Self::far_call
            }
            Code::Iretd => Self::iretd,
            Code::Lss_r16_m1616
            | Code::Lss_r32_m1632
            | Code::Lss_r64_m1664
            | Code::Lfs_r16_m1616
            | Code::Lfs_r32_m1632
            | Code::Lfs_r64_m1664
            | Code::Lgs_r16_m1616
            | Code::Lgs_r32_m1632
            | Code::Lgs_r64_m1664
            | Code::Les_r16_m1616
            | Code::Les_r32_m1632
            | Code::Lds_r16_m1616
            | Code::Lds_r32_m1632 => Self::load_far_pointer,
            Code::Pushad | Code::Popad => Self::push_pop_all,
            Code::Into => Self::into,
            Code::Bound_r16_m1616 | Code::Bound_r32_m3232 => Self::bound,
            Code::Aam_imm8 | Code::Aad_imm8 => Self::ascii_adjust,
            Code::Daa | Code::Das | Code::Aaa | Code::Aas => Self::decimal_adjust,
            Code::Salc => Self::salc,
            Code::Arpl_rm16_r16 | Code::Arpl_r32m16_r32 => Self::arpl,
            _ => return None,
        };
        Some(h)
    }

    /// Instructions whose outcome follows a CPUID feature, a control bit or the vendor
    /// (`optional.rs`), and those of facilities the virtual CPU never enables (#UD).
    fn optional_handler(code: Code) -> Option<Handler<'a, H, M>> {
        let h: Handler<'a, H, M> = match code {
            // optional.rs
            Code::Sysenter => Self::sysenter,
            Code::Sysexitd | Code::Sysexitq => Self::sysexit,
            Code::Int1 => Self::int1,
            Code::Serialize => Self::serialize,
            Code::Rdpmc => Self::rdpmc,
            Code::Rdpkru | Code::Wrpkru => Self::pkru,
            Code::Monitorq | Code::Monitord | Code::Mwait => Self::monitor,
            Code::Monitorxq
            | Code::Monitorxd
            | Code::Mwaitx
            | Code::Umwait_r32
            | Code::Umwait_r64 => Self::user_wait,
            Code::Tpause_r32 | Code::Tpause_r64 => Self::user_wait,
            Code::Xbegin_rel32 | Code::Xabort_imm8 | Code::Xend | Code::Xtest => Self::tsx,
            Code::Clac | Code::Stac => Self::clac_stac,
            Code::Xsaves_mem | Code::Xsaves64_mem | Code::Xrstors_mem | Code::Xrstors64_mem => {
                Self::supervisor_only
            }
            Code::Invpcid_r64_m128 => Self::supervisor_only,
            // Facilities the virtual CPU never enables: VMX (CR4.VMXE), SVM (EFER.SVME),
            // SMX (CR4.SMXE), SGX, user interrupts, SMM and IA-64.
            Code::Vmcall | Code::Vmmcall => Self::hypercall,
            Code::Vmfunc
            | Code::Vmlaunch
            | Code::Vmresume
            | Code::Vmxoff
            | Code::Vmxon_m64
            | Code::Vmptrld_m64
            | Code::Vmptrst_m64
            | Code::Vmclear_m64
            | Code::Vmread_rm64_r64
            | Code::Vmwrite_r64_rm64
            | Code::Invept_r64_m128
            | Code::Invvpid_r64_m128
            | Code::Vmrunq
            | Code::Vmloadq
            | Code::Vmsaveq
            | Code::Stgi
            | Code::Clgi
            | Code::Skinit
            | Code::Invlpgaq
            | Code::Invlpgbq
            | Code::Tlbsync
            | Code::Getsecd
            | Code::Getsecq
            | Code::Encls
            | Code::Enclu
            | Code::Stui
            | Code::Clui
            | Code::Senduipi_r64
            | Code::Uiret
            | Code::Rsm => Self::ud,
            _ => return None,
        };
        Some(h)
    }

    /// `iretq`, software interrupts and the #UD opcodes: event delivery (`events.rs`).
    fn event_handler(code: Code) -> Option<Handler<'a, H, M>> {
        let h: Handler<'a, H, M> = match code {
            // events.rs
            Code::Iretq => Self::iretq,
            Code::Int3 => Self::int3,
            Code::Int_imm8 => Self::int_n,
            Code::Ud0
            | Code::Ud1_r16_rm16
            | Code::Ud1_r32_rm32
            | Code::Ud1_r64_rm64
            | Code::Ud2 => Self::ud,
            _ => return None,
        };
        Some(h)
    }

    /// The emulation of one decoded instruction.
    fn emulate_insn(
        &mut self,
        insn: &SensitiveInsn,
        i: &Instruction,
        regs: &mut GuestRegs,
        next: GuestVirt,
    ) -> Step {
        let cpl = self.cpl();
        if privileged(i, insn.kind) && cpl != 0 {
            return Err(gp0());
        }
        if cpl != 0 && self.cr4 & cr4::UMIP != 0 && umip_protected(i) {
            return Err(gp0());
        }
        match Self::handler(i.code()) {
            Some(h) => h(self, i, regs, next),
            None => Ok(Flow::unsupported(i, "not emulated by the virtual CPU yet")),
        }
    }

    /// Emulates `insn` and delivers the exception it raises; what the guest does next.
    fn step(&mut self, insn: &SensitiveInsn, regs: &mut GuestRegs) -> Flow {
        let len = usize::from(insn.len).min(insn.bytes.len());
        // What the translator could not decode may be an AMD encoding: `lock mov cr0`
        // is `mov cr8` where CPUID 0x8000_0001 ECX[4] (AltMovCr8) says so.
        // (Asked only for undecodable bytes: this is the emulation hot path.)
        let alt_mov_cr8 = || self.amd_like() && self.block.cpuid(0x8000_0001, 0)[2] & (1 << 4) != 0;
        let (i, len) = if len == 0 && alt_mov_cr8() {
            let i = Decoder::with_ip(self.bitness(), &insn.bytes, insn.pc.0, DecoderOptions::AMD)
                .decode();
            let n = if i.is_invalid() { 0 } else { i.len() };
            (i, n)
        } else {
            let options = DecoderOptions::NONE;
            let i =
                Decoder::with_ip(self.bitness(), &insn.bytes[..len], insn.pc.0, options).decode();
            (i, len)
        };
        let next = GuestVirt(insn.pc.0.wrapping_add(len as u64));
        let before = *regs;
        self.sti_next = None;
        let user = self.cpl() == 3;
        let step = if len == 0 || i.is_invalid() {
            // Longer than 15 bytes (prefixes filling the limit) is #GP(0), not #UD.
            if too_long(&insn.bytes, self.bitness()) {
                Err(gp0())
            } else {
                Err(Event::ud())
            }
        } else {
            match self.emulate_insn(insn, &i, regs, next) {
                // No instruction of a user process ends the run: what the virtual CPU
                // does not model yet is the #UD of a CPU without it (logged once).
                Ok(Flow::Stop(VcpuStop::Unsupported { mnemonic, why })) if user => {
                    let key = mnemonic.map_or(u32::MAX, |m| m as u32);
                    if self.unsupported_logged.first(key) {
                        self.hw.log(format_args!(
                            "engine: `{:?}` at CPL 3 ({why}) raises #UD in the guest (logged once)",
                            mnemonic.unwrap_or(Mnemonic::INVALID)
                        ));
                    }
                    self.stats.user_unsupported += 1;
                    Err(Event::ud())
                }
                other => other,
            }
        };
        match step {
            Ok(flow) => flow,
            Err(ev) => {
                // Precise: the exception sees the registers from before the instruction;
                // software interrupts return after it.
                *regs = before;
                self.raise(regs, insn.pc.0, next.0, ev)
            }
        }
    }

    /// The linear address of `i`'s memory operand (FS/GS: their virtual bases).
    pub fn data_address(&self, i: &Instruction, regs: &GuestRegs) -> Option<u64> {
        // The memory operand, wherever it is (`lgs r, m`: operand 1).
        let op = (0..i.op_count())
            .find(|&k| i.op_kind(k) == OpKind::Memory)
            .unwrap_or(0);
        i.virtual_address(op, 0, |reg, _, _| {
            if reg.is_segment_register() {
                return Some(match reg {
                    Register::FS => self.segs.sregs[Sreg::Fs as usize].base,
                    Register::GS => self.segs.sregs[Sreg::Gs as usize].base,
                    _ => 0,
                });
            }
            let v = regs.get(gpr(reg)?);
            Some(if reg.is_gpr32() { v & 0xffff_ffff } else { v })
        })
    }

    /// The memory operand's address, or #GP(0) if it is non-canonical.
    pub(super) fn operand_address(&self, i: &Instruction, regs: &GuestRegs) -> Result<u64, Event> {
        self.data_address(i, regs)
            .filter(|&a| is_canonical(a))
            .ok_or_else(gp0)
    }

    /// Reads the 16-bit register or memory operand `op` of `i`.
    pub(super) fn read_rm16(
        &mut self,
        i: &Instruction,
        op: u32,
        regs: &GuestRegs,
    ) -> Result<u16, Event> {
        if i.op_kind(op) == OpKind::Register {
            return Ok(gpr(i.op_register(op)).map_or(0, |n| regs.get(n) as u16));
        }
        let ea = self.operand_address(i, regs)?;
        let mut b = [0u8; 2];
        self.read(ea, &mut b)?;
        Ok(u16::from_le_bytes(b))
    }

    /// Writes `v` to `i`'s first operand: 16 bits to memory or a 16-bit register, the
    /// zero-extended value to a 32/64-bit register.
    pub(super) fn write_rm16(
        &mut self,
        i: &Instruction,
        v: u16,
        regs: &mut GuestRegs,
    ) -> Result<(), Event> {
        if i.op0_kind() == OpKind::Register {
            let r = i.op0_register();
            if let Some(n) = gpr(r) {
                let old = regs.get(n);
                regs.set(
                    n,
                    if r.is_gpr16() {
                        (old & !0xffff) | u64::from(v)
                    } else {
                        u64::from(v)
                    },
                );
            }
            return Ok(());
        }
        let ea = self.operand_address(i, regs)?;
        self.write(ea, &v.to_le_bytes())
    }
}

impl<H: Hardware, M: GuestMmu> Platform for Vcpu<'_, H, M> {
    fn emulate(&mut self, insn: &SensitiveInsn, regs: &mut GuestRegs) -> Emulation {
        if let Some(c) = self.stats.emulated.get_mut(insn.kind as usize) {
            *c += 1;
        }
        let mode_before = self.mode();
        self.step_suppressed = false;
        let flow = self.step(insn, regs);
        // The translator must hear about the shadow's work before guest code runs
        // again, and only the run loop holds the engine: stop there and resume.
        let stop = match flow {
            _ if self.mem.failed() => VcpuStop::ShadowFailure,
            Flow::Continue(next) if self.mem.has_work() => VcpuStop::ShadowWork { resume: next },
            // The CPL changed: traces are keyed by mode (the shadow view already follows).
            Flow::Continue(next) if self.mode() != mode_before => {
                return Emulation::Switch {
                    next,
                    mode: self.mode(),
                    invalidate_mappings: false,
                }
            }
            Flow::Continue(next) => return Emulation::Continue(next),
            Flow::Stop(s) => s,
        };
        self.stop = Some(stop);
        Emulation::Stop
    }

    fn segment_base(&mut self, seg: SegBase) -> u64 {
        match seg {
            SegBase::Fs => self.segs.sregs[Sreg::Fs as usize].base,
            SegBase::Gs => self.segs.sregs[Sreg::Gs as usize].base,
            _ => 0,
        }
    }

    fn set_virtual_flags(&mut self, vif: bool, iopl: u8) {
        self.vif = vif;
        self.iopl = iopl;
    }

    fn virtual_flags(&self) -> Option<(bool, u8)> {
        Some((self.vif, self.iopl))
    }

    fn selectors(&self) -> Option<[u16; 6]> {
        Some(self.segs.selectors())
    }

    fn user_code(&mut self, va: GuestVirt, pa: GuestPhys) {
        if let Some(w) = &mut self.tasks {
            if !w.records_origins() {
                return;
            }
            let t0 = self.hw.tsc();
            let gs = [
                self.segs.sregs[Sreg::Gs as usize].base,
                self.msrs.kernel_gs_base,
            ];
            let mem = &mut self.mem;
            let cr3 = mem.cr3();
            // Read with the kernel's privileges; a fault is only counted.
            w.on_user_code(va.0, pa.0, cr3, gs, &mut |at, out| mem.observe(at, out));
            w.stats.cycles = w.stats.cycles.wrapping_add(self.hw.tsc().wrapping_sub(t0));
        }
    }

    fn take_task_switch(&mut self) -> Option<u64> {
        self.tasks.as_mut()?.take_switch()
    }
}
