//! Trace formation: fetch guest bytes, decode with iced-x86, classify each instruction,
//! and describe the trace for tools.
//!
//! Invariants: every instruction of a trace *starts* on the trace's first page (an
//! instruction may straddle into the next page); a trace never contains a sensitive
//! instruction (it ends before one); it ends after an unconditional control transfer,
//! or after `MAX_TRACE_INSNS` instructions.

use alloc::vec::Vec;

use iced_x86::{
    Code, ConditionCode, Decoder, DecoderError, DecoderOptions, FlowControl, Instruction,
    InstructionInfoFactory, Mnemonic, OpAccess, OpKind, Register,
};

use crate::addr::{GuestPhys, GuestVirt, PAGE_BYTES};
use crate::context::Gpr;
use crate::guest_memory::{GuestMemory, Mode};
use crate::instrument::{access, Bbl, InsInfo, InsKind, MemOperand, MemOps, SegBase};
use crate::layout::{MAX_INSN_BYTES, MAX_TRACE_INSNS};
use crate::platform::{SensitiveInsn, SensitiveKind};

/// How the translator must treat an instruction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Class {
    /// Copy verbatim.
    Plain,
    /// Copy with its RIP-relative memory operand rewritten.
    RipRel,
    /// `jcc`: condition nibble and target.
    Jcc { cc: u8, target: u64 },
    /// `loop*` / `jrcxz` / `jecxz` (rel8 only).
    LoopLike { target: u64 },
    /// Direct `jmp`.
    Jmp { target: u64 },
    /// Direct `jmp` that trace formation followed (same page, forward in the trace):
    /// it emits no code; the trace continues at `target`.
    JmpElided { target: u64 },
    /// Direct `call`.
    Call { target: u64 },
    /// `jmp r/m64`.
    JmpInd,
    /// `call r/m64`.
    CallInd,
    /// `ret` / `ret imm16`.
    Ret { pop: u16 },
    /// `cli`, `sti`, `pushfq` or `popfq` at virtual CPL 0, against the virtual flags in
    /// the context (`crate::vflags`).
    VirtFlags,
}

/// One decoded guest instruction.
#[derive(Clone, Debug)]
pub(crate) struct DecodedInsn {
    pub instr: Instruction,
    pub bytes: [u8; MAX_INSN_BYTES],
    pub class: Class,
}

impl DecodedInsn {
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.bytes[..self.instr.len()]
    }
}

/// How a trace ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TraceEnd {
    /// Falls through to this guest address (size/page limit).
    FallThrough(u64),
    /// The last instruction is an unconditional control transfer.
    Transfer,
    /// Stops before this sensitive instruction.
    Sensitive(SensitiveInsn),
}

/// A decoded trace.
#[derive(Clone, Debug)]
pub(crate) struct DecodedTrace {
    pub start: GuestVirt,
    pub pa: GuestPhys,
    pub insns: Vec<DecodedInsn>,
    pub info: Vec<InsInfo>,
    pub bbls: Vec<Bbl>,
    pub end: TraceEnd,
    /// Guest code bytes covered.
    pub guest_bytes: u64,
}

/// Why a trace could not be formed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct FetchFault(pub GuestVirt);

fn gpr(r: Register) -> Option<Gpr> {
    if r == Register::None {
        return None;
    }
    let f = r.full_register();
    if f.is_gpr64() {
        Gpr::from_number((f as u32 - Register::RAX as u32) as u8)
    } else {
        None
    }
}

/// Classifies sensitive instructions (see `platform::SensitiveKind`).
pub(crate) fn sensitive_kind(i: &Instruction) -> Option<SensitiveKind> {
    use Mnemonic as M;
    use SensitiveKind as K;
    let k = match i.mnemonic() {
        M::Cli | M::Sti => K::InterruptFlag,
        M::Pushf | M::Pushfd | M::Pushfq | M::Popf | M::Popfd | M::Popfq => K::Flags,
        M::Iret | M::Iretd | M::Iretq | M::Retf => K::FarTransfer,
        M::Syscall | M::Sysret | M::Sysretq | M::Sysenter | M::Sysexit | M::Sysexitq => {
            K::SystemCall
        }
        M::Swapgs | M::Rdfsbase | M::Rdgsbase | M::Wrfsbase | M::Wrgsbase => K::SegmentBase,
        M::Smsw | M::Lmsw | M::Clts => K::ControlRegister,
        M::Lgdt | M::Lidt | M::Ltr | M::Lldt | M::Sgdt | M::Sidt | M::Sldt | M::Str => {
            K::DescriptorTable
        }
        M::Lar | M::Lsl | M::Verr | M::Verw => K::SegmentQuery,
        M::Rdmsr | M::Wrmsr => K::Msr,
        M::In | M::Out | M::Insb | M::Insw | M::Insd | M::Outsb | M::Outsw | M::Outsd => K::PortIo,
        M::Hlt | M::Monitor | M::Mwait | M::Monitorx | M::Mwaitx | M::Umwait | M::Tpause => K::Halt,
        M::Invlpg | M::Invpcid | M::Invd | M::Wbinvd | M::Invlpga | M::Invlpgb | M::Tlbsync => {
            K::TlbOrCache
        }
        M::Cpuid => K::Cpuid,
        M::Int | M::Int3 | M::Into | M::Int1 => K::SoftwareInterrupt,
        M::Ud0 | M::Ud1 | M::Ud2 => K::Undefined,
        M::Xgetbv | M::Xsetbv => K::ExtendedControl,
        M::Rdpkru | M::Wrpkru => K::ProtectionKeys,
        M::Rdtscp | M::Rdpid | M::Rdpmc => K::Timestamp,
        M::Lss | M::Lfs | M::Lgs | M::Lds | M::Les => K::SegmentRegister,
        M::Xbegin
        | M::Xend
        | M::Xabort
        | M::Xtest
        | M::Vmcall
        | M::Vmmcall
        | M::Vmfunc
        | M::Getsec
        | M::Clac
        | M::Stac
        | M::Encls
        | M::Enclu
        | M::Stui
        | M::Clui
        | M::Senduipi
        | M::Uiret
        | M::Xsaves
        | M::Xrstors
        | M::Jmpe
        | M::Rsm
        | M::Skinit
        | M::Invept
        | M::Invvpid
        | M::Vmlaunch
        | M::Vmresume
        | M::Vmxon
        | M::Vmxoff
        | M::Vmptrld
        | M::Vmptrst
        | M::Vmread
        | M::Vmwrite
        | M::Vmclear
        | M::Vmrun
        | M::Vmload
        | M::Vmsave
        | M::Stgi
        | M::Clgi
        | M::Serialize => K::Other,
        _ => {
            for n in 0..i.op_count() {
                if i.op_kind(n) == OpKind::Register {
                    let r = i.op_register(n);
                    if r.is_cr() {
                        return Some(K::ControlRegister);
                    }
                    if r.is_dr() || r.is_tr() {
                        return Some(K::DebugRegister);
                    }
                    if r.is_segment_register() {
                        return Some(K::SegmentRegister);
                    }
                }
            }
            if matches!(
                i.flow_control(),
                FlowControl::IndirectBranch | FlowControl::IndirectCall
            ) && !matches!(
                i.code(),
                Code::Jmp_rm64 | Code::Call_rm64 | Code::Jmp_rm32 | Code::Call_rm32
            ) {
                return Some(K::FarTransfer);
            }
            if matches!(
                i.flow_control(),
                FlowControl::UnconditionalBranch | FlowControl::Call
            ) && i.op0_kind() == OpKind::FarBranch32
            {
                return Some(K::FarTransfer);
            }
            return None;
        }
    };
    Some(k)
}

fn classify(i: &Instruction) -> Class {
    match i.flow_control() {
        FlowControl::ConditionalBranch => {
            let target = i.near_branch_target();
            match i.mnemonic() {
                Mnemonic::Loop
                | Mnemonic::Loope
                | Mnemonic::Loopne
                | Mnemonic::Jrcxz
                | Mnemonic::Jecxz
                | Mnemonic::Jcxz => Class::LoopLike { target },
                _ => {
                    let cc = i.condition_code() as u32 - ConditionCode::o as u32;
                    Class::Jcc {
                        cc: cc as u8,
                        target,
                    }
                }
            }
        }
        FlowControl::UnconditionalBranch => Class::Jmp {
            target: i.near_branch_target(),
        },
        FlowControl::Call => Class::Call {
            target: i.near_branch_target(),
        },
        FlowControl::IndirectBranch => Class::JmpInd,
        FlowControl::IndirectCall => Class::CallInd,
        FlowControl::Return => Class::Ret {
            pop: i.immediate16(),
        },
        _ if i.is_ip_rel_memory_operand() => Class::RipRel,
        _ => Class::Plain,
    }
}

pub(crate) fn is_string_op(i: &Instruction) -> bool {
    use Mnemonic as M;
    matches!(
        i.mnemonic(),
        M::Movsb
            | M::Movsw
            | M::Movsd
            | M::Movsq
            | M::Stosb
            | M::Stosw
            | M::Stosd
            | M::Stosq
            | M::Lodsb
            | M::Lodsw
            | M::Lodsd
            | M::Lodsq
            | M::Cmpsb
            | M::Cmpsw
            | M::Cmpsd
            | M::Cmpsq
            | M::Scasb
            | M::Scasw
            | M::Scasd
            | M::Scasq
    ) && i.op_count() <= 2
        && (0..i.op_count())
            .all(|n| !matches!(i.op_kind(n), OpKind::Register) || i.op_register(n).is_gpr())
}

/// Strips `F2`/`F3` from the legacy prefixes of a string instruction.
pub(crate) fn strip_rep(bytes: &[u8]) -> ([u8; MAX_INSN_BYTES], usize) {
    let mut out = [0u8; MAX_INSN_BYTES];
    let mut n = 0;
    let mut in_prefix = true;
    for &b in bytes {
        if in_prefix && matches!(b, 0xF2 | 0xF3) {
            continue;
        }
        if in_prefix
            && !matches!(
                b,
                0x66 | 0x67 | 0x2E | 0x36 | 0x3E | 0x26 | 0x64 | 0x65 | 0xF0
            )
        {
            in_prefix = false;
        }
        out[n] = b;
        n += 1;
    }
    (out, n)
}

pub(crate) fn mem_operands(factory: &mut InstructionInfoFactory, i: &Instruction) -> MemOps {
    let mut v = MemOps::default();
    let size_hint = i.memory_size().size() as u32;
    let info = factory.info(i);
    for m in info.used_memory() {
        let acc = match m.access() {
            OpAccess::Read | OpAccess::CondRead => access::READ,
            OpAccess::Write | OpAccess::CondWrite => access::WRITE,
            OpAccess::ReadWrite | OpAccess::ReadCondWrite => access::READ | access::WRITE,
            _ => continue,
        };
        if m.vsib_size() != 0 {
            continue;
        }
        let seg = match m.segment() {
            Register::FS => SegBase::Fs,
            Register::GS => SegBase::Gs,
            _ => SegBase::Flat,
        };
        let size = match m.memory_size().size() {
            0 => size_hint,
            s => s as u32,
        };
        v.push(MemOperand {
            base: gpr(m.base()),
            index: gpr(m.index()),
            scale: m.scale() as u8,
            disp: m.displacement(),
            size,
            access: acc,
            seg,
        });
    }
    v
}

fn ins_kind(c: Class) -> InsKind {
    match c {
        Class::Plain | Class::RipRel | Class::VirtFlags => InsKind::Plain,
        Class::Jcc { .. } | Class::LoopLike { .. } => InsKind::CondBranch,
        Class::Jmp { .. } | Class::JmpElided { .. } => InsKind::Jump,
        Class::Call { .. } => InsKind::Call,
        Class::JmpInd => InsKind::IndirectJump,
        Class::CallInd => InsKind::IndirectCall,
        Class::Ret { .. } => InsKind::Return,
    }
}

/// Direct jumps one trace may follow.
const MAX_FOLLOWED_JUMPS: usize = 4;

/// Bytes a trace can span: `MAX_TRACE_INSNS` maximal instructions.
const MAX_TRACE_BYTES: usize = MAX_TRACE_INSNS * MAX_INSN_BYTES;

/// Fetches the code a trace starting at `va` can cover: up to `MAX_TRACE_BYTES` of its
/// page, plus the first bytes of the next page when the trace may reach the page end.
/// Returns (bytes on the first page, bytes available).
fn fetch(
    mem: &mut dyn GuestMemory,
    va: GuestVirt,
    pa: GuestPhys,
    mode: Mode,
    buf: &mut [u8; MAX_TRACE_BYTES + 2 * MAX_INSN_BYTES],
) -> Result<(usize, usize), FetchFault> {
    let in_page = (PAGE_BYTES - (va.0 & (PAGE_BYTES - 1))) as usize;
    if in_page >= MAX_TRACE_BYTES + MAX_INSN_BYTES {
        if !mem.read(pa, &mut buf[..MAX_TRACE_BYTES + MAX_INSN_BYTES]) {
            return Err(FetchFault(va));
        }
        return Ok((in_page, MAX_TRACE_BYTES + MAX_INSN_BYTES));
    }
    if !mem.read(pa, &mut buf[..in_page]) {
        return Err(FetchFault(va));
    }
    let next = GuestVirt(va.page().0.wrapping_add(PAGE_BYTES));
    let extra = match mem.translate(next, mode) {
        Some(npa) if mem.read(npa, &mut buf[in_page..in_page + MAX_INSN_BYTES]) => MAX_INSN_BYTES,
        _ => 0,
    };
    Ok((in_page, in_page + extra))
}

/// Reusable decoding state (keeps iced's info factory allocated across traces).
pub(crate) struct Scratch {
    pub(crate) factory: InstructionInfoFactory,
}

impl Scratch {
    pub(crate) fn new() -> Self {
        Self {
            factory: InstructionInfoFactory::new(),
        }
    }
}

/// Whether `i` (at virtual CPL 0, followed by the byte `next` if known) runs inline
/// against the virtual flags (`crate::vflags`): `cli`, `pushfq`, `popfq`, and `sti`
/// unless a `hlt` follows (or the next byte is unknown).
fn inline_flag_insn(i: &Instruction, next: Option<u8>) -> bool {
    match i.code() {
        Code::Cli | Code::Pushfq | Code::Popfq => true,
        Code::Sti => next.is_some_and(|b| b != 0xF4),
        _ => false,
    }
}

pub(crate) fn decode_trace(
    mem: &mut dyn GuestMemory,
    va: GuestVirt,
    pa: GuestPhys,
    mode: Mode,
    inline_flags: bool,
    scratch: &mut Scratch,
) -> Result<DecodedTrace, FetchFault> {
    let mut buf = [0u8; MAX_TRACE_BYTES + 2 * MAX_INSN_BYTES];
    let (in_page, avail) = fetch(mem, va, pa, mode, &mut buf)?;
    let mut dec = Decoder::with_ip(mode.bitness(), &buf[..avail], va.0, DecoderOptions::NONE);
    let factory = &mut scratch.factory;
    let mut t = DecodedTrace {
        start: va,
        pa,
        insns: Vec::with_capacity(24),
        info: Vec::with_capacity(24),
        bbls: Vec::with_capacity(4),
        end: TraceEnd::Transfer,
        guest_bytes: 0,
    };
    let mut off = 0usize;
    let mut bbl_first = 0usize;
    let mut instr = Instruction::default();
    let mut followed = 0usize;
    // A stepping trace is one instruction (`Mode::stepping`).
    let max_insns = if mode.is_stepping() {
        1
    } else {
        MAX_TRACE_INSNS
    };
    loop {
        let pc = va.0.wrapping_add(off as u64);
        // Stop at the page end, at the size limit, or where a followed jump moved the
        // decoder past the fetched window (a partial-page fetch).
        let window_end = avail < in_page && off + MAX_INSN_BYTES > avail;
        if off >= in_page || t.insns.len() >= max_insns || window_end {
            t.end = TraceEnd::FallThrough(pc);
            break;
        }
        dec.decode_out(&mut instr);
        if instr.is_invalid() {
            if dec.last_error() == DecoderError::NoMoreBytes {
                if t.insns.is_empty() {
                    return Err(FetchFault(GuestVirt(va.page().0.wrapping_add(PAGE_BYTES))));
                }
                t.end = TraceEnd::FallThrough(pc);
                break;
            }
            let mut bytes = [0u8; MAX_INSN_BYTES];
            let n = (avail - off).min(MAX_INSN_BYTES);
            bytes[..n].copy_from_slice(&buf[off..off + n]);
            t.end = TraceEnd::Sensitive(SensitiveInsn {
                pc: GuestVirt(pc),
                len: 0,
                bytes,
                kind: SensitiveKind::Undefined,
            });
            break;
        }
        let len = instr.len();
        let mut bytes = [0u8; MAX_INSN_BYTES];
        bytes[..len].copy_from_slice(&buf[off..off + len]);
        let next_byte = (off + len < avail).then(|| buf[off + len]);
        let virt_flags = inline_flags
            && mode.cpl() == 0
            && !mode.is_stepping()
            && inline_flag_insn(&instr, next_byte);
        // 32-bit code without a 64-bit translation leaves like a sensitive instruction,
        // and so does `rdtsc` under CR4.TSD.
        let kind = sensitive_kind(&instr).or_else(|| {
            if mode.is_compat() && super::compat::untranslatable(&instr) {
                Some(SensitiveKind::Other)
            } else if mode.is_timestamp_faulting() && instr.mnemonic() == Mnemonic::Rdtsc {
                Some(SensitiveKind::Timestamp)
            } else {
                None
            }
        });
        if let Some(kind) = kind.filter(|_| !virt_flags) {
            t.end = TraceEnd::Sensitive(SensitiveInsn {
                pc: GuestVirt(pc),
                len: len as u8,
                bytes,
                kind,
            });
            break;
        }
        let mut class = if virt_flags {
            Class::VirtFlags
        } else {
            classify(&instr)
        };
        if let Class::Jmp { target } = class {
            // Follow a direct jump that stays on the trace's page and does not loop back
            // into the trace (at most `MAX_FOLLOWED_JUMPS` per trace).
            let fits = target.checked_sub(va.0).is_some_and(|toff| {
                toff as usize + MAX_INSN_BYTES <= avail && (toff as usize) < in_page
            });
            let seen = target == pc || t.info.iter().any(|i| i.address.0 == target);
            if fits && !seen && followed < MAX_FOLLOWED_JUMPS && !mode.is_stepping() {
                class = Class::JmpElided { target };
                followed += 1;
            }
        }
        let rep = (instr.has_rep_prefix() || instr.has_repne_prefix()) && is_string_op(&instr);
        let mut mem_ops = mem_operands(factory, &instr);
        if rep {
            // Describe one iteration: decode the instruction without its prefix.
            let (sb, sn) = strip_rep(&bytes[..len]);
            let mut d2 = Decoder::with_ip(mode.bitness(), &sb[..sn], pc, DecoderOptions::NONE);
            let one = d2.decode();
            mem_ops = mem_operands(factory, &one);
        }
        t.info.push(InsInfo {
            address: GuestVirt(pc),
            len: len as u8,
            kind: ins_kind(class),
            mem: mem_ops,
            rep,
            opcode: instr.mnemonic() as u16,
        });
        t.insns.push(DecodedInsn {
            instr,
            bytes,
            class,
        });
        off += len;
        t.guest_bytes += len as u64;
        match class {
            Class::JmpElided { target } => {
                let n = t.insns.len();
                t.bbls.push(Bbl {
                    first: bbl_first,
                    count: n - bbl_first,
                    address: t.info[bbl_first].address,
                });
                bbl_first = n;
                off = target.wrapping_sub(va.0) as usize;
                dec.set_ip(target);
                dec.set_position(off)
                    .map_err(|_| FetchFault(GuestVirt(target)))?;
            }
            Class::Jcc { .. } | Class::LoopLike { .. } => {
                let n = t.insns.len();
                t.bbls.push(Bbl {
                    first: bbl_first,
                    count: n - bbl_first,
                    address: t.info[bbl_first].address,
                });
                bbl_first = n;
            }
            Class::Jmp { .. }
            | Class::Call { .. }
            | Class::JmpInd
            | Class::CallInd
            | Class::Ret { .. } => {
                t.end = TraceEnd::Transfer;
                break;
            }
            Class::Plain | Class::RipRel | Class::VirtFlags => {}
        }
    }
    if bbl_first < t.insns.len() {
        let n = t.insns.len();
        t.bbls.push(Bbl {
            first: bbl_first,
            count: n - bbl_first,
            address: t.info[bbl_first].address,
        });
    }
    Ok(t)
}

/// Status flags (OF SF ZF AF CF PF) in iced's `RflagsBits` encoding.
pub(crate) const STATUS_FLAGS: u32 = 0x3F;

/// Flags live *before* each instruction; index `n` (trace end) is all-live.
pub(crate) fn flags_liveness(t: &DecodedTrace) -> Vec<u32> {
    let n = t.insns.len();
    let mut live = alloc::vec![STATUS_FLAGS; n + 1];
    for k in (0..n).rev() {
        let d = &t.insns[k];
        let i = &d.instr;
        let mut after = live[k + 1];
        if matches!(d.class, Class::Jcc { .. } | Class::LoopLike { .. }) {
            after = STATUS_FLAGS;
        }
        let writes = i.rflags_written() | i.rflags_cleared() | i.rflags_set();
        let kills = if count_may_be_zero(i) { 0 } else { writes };
        live[k] = ((after & !kills) | i.rflags_read()) & STATUS_FLAGS;
    }
    live
}

/// Shifts and rotates leave flags untouched when the (masked) count is zero, and so do
/// `rep` string instructions when RCX is zero.
fn count_may_be_zero(i: &Instruction) -> bool {
    use Mnemonic as M;
    if (i.has_rep_prefix() || i.has_repne_prefix()) && is_string_op(i) {
        return true;
    }
    if !matches!(
        i.mnemonic(),
        M::Shl | M::Shr | M::Sar | M::Sal | M::Rol | M::Ror | M::Rcl | M::Rcr | M::Shld | M::Shrd
    ) {
        return false;
    }
    let last = i.op_count() - 1;
    match i.op_kind(last) {
        OpKind::Immediate8 => {
            let mask = if i.op0_kind() == OpKind::Register && i.op0_register().is_gpr64()
                || i.memory_size().size() == 8
            {
                0x3F
            } else {
                0x1F
            };
            i.immediate8() & mask == 0
        }
        OpKind::Register => true,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use iced_x86::{Decoder, DecoderOptions};

    use super::sensitive_kind;
    use crate::platform::SensitiveKind as K;

    #[test]
    fn test_sensitive_instructions_are_classified() {
        let cases: &[(&[u8], K)] = &[
            (&[0xFA], K::InterruptFlag),
            (&[0xFB], K::InterruptFlag),
            (&[0x9C], K::Flags),
            (&[0x9D], K::Flags),
            (&[0x48, 0xCF], K::FarTransfer),
            (&[0xCB], K::FarTransfer),
            (&[0x0F, 0x05], K::SystemCall),
            (&[0x48, 0x0F, 0x07], K::SystemCall),
            (&[0x0F, 0x01, 0xF8], K::SegmentBase),
            (&[0x0F, 0x22, 0xD8], K::ControlRegister),
            (&[0x0F, 0x21, 0xF8], K::DebugRegister),
            (&[0x8E, 0xD8], K::SegmentRegister),
            (&[0x8C, 0xC8], K::SegmentRegister),
            (&[0x0F, 0xA0], K::SegmentRegister),
            (&[0x0F, 0xA9], K::SegmentRegister),
            (&[0x0F, 0x01, 0x10], K::DescriptorTable),
            (&[0x0F, 0x01, 0x18], K::DescriptorTable),
            (&[0x0F, 0x00, 0xD8], K::DescriptorTable),
            (&[0x0F, 0x00, 0xD0], K::DescriptorTable),
            (&[0x0F, 0x01, 0x00], K::DescriptorTable),
            (&[0x0F, 0x01, 0x08], K::DescriptorTable),
            (&[0x0F, 0x00, 0xC0], K::DescriptorTable),
            (&[0x0F, 0x00, 0xC8], K::DescriptorTable),
            (&[0x0F, 0x01, 0xE0], K::ControlRegister),
            (&[0x0F, 0x32], K::Msr),
            (&[0x0F, 0x30], K::Msr),
            (&[0xEC], K::PortIo),
            (&[0xEE], K::PortIo),
            (&[0x6C], K::PortIo),
            (&[0x6E], K::PortIo),
            (&[0xF4], K::Halt),
            (&[0x0F, 0x01, 0x38], K::TlbOrCache),
            (&[0x0F, 0xA2], K::Cpuid),
            (&[0xCD, 0x80], K::SoftwareInterrupt),
            (&[0xCC], K::SoftwareInterrupt),
            (&[0x0F, 0x0B], K::Undefined),
            (&[0x0F, 0x02, 0xC0], K::SegmentQuery),
            (&[0x0F, 0x03, 0xC0], K::SegmentQuery),
            (&[0x0F, 0x00, 0xE0], K::SegmentQuery),
            (&[0x0F, 0x00, 0xE8], K::SegmentQuery),
            (&[0x0F, 0x01, 0xD1], K::ExtendedControl),
            (&[0x0F, 0x01, 0xEE], K::ProtectionKeys),
            (&[0x0F, 0x01, 0xEF], K::ProtectionKeys),
            (&[0x0F, 0x01, 0xF9], K::Timestamp),
            (&[0xFF, 0x28], K::FarTransfer),
        ];
        for (bytes, kind) in cases {
            let i = Decoder::with_ip(64, bytes, 0x1000, DecoderOptions::NONE).decode();
            assert!(!i.is_invalid(), "{bytes:02x?} does not decode");
            assert_eq!(
                sensitive_kind(&i),
                Some(*kind),
                "{bytes:02x?} ({:?})",
                i.mnemonic()
            );
        }
        for bytes in [
            &[0x48u8, 0x01, 0xC8][..],
            &[0x0F, 0x31],
            &[0xFF, 0xE0],
            &[0xC3],
            &[0x8B, 0x05, 0, 0, 0, 0],
        ] {
            let i = Decoder::with_ip(64, bytes, 0x1000, DecoderOptions::NONE).decode();
            assert_eq!(sensitive_kind(&i), None, "{bytes:02x?}");
        }
    }
}
