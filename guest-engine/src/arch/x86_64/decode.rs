//! Trace formation: fetch guest bytes, decode with iced-x86, classify each instruction,
//! and describe the trace for tools (the fetch and the loop over one trace's
//! instructions are `decode/form.rs`).
//!
//! Invariants: every instruction of a trace *starts* on the trace's first page (an
//! instruction may straddle into the next page); a trace never contains a sensitive
//! instruction (it ends before one); it ends after an unconditional control transfer,
//! or after `MAX_TRACE_INSNS` instructions.

use alloc::vec::Vec;

use iced_x86::{
    Code, ConditionCode, FlowControl, Instruction, InstructionInfo, InstructionInfoFactory,
    Mnemonic, OpAccess, OpKind, Register, UsedMemory,
};

use crate::addr::PAGE_BYTES;
use crate::addr::{GuestPhys, GuestVirt};
use crate::context::Gpr;
use crate::instrument::{access, Bbl, InsInfo, InsKind, MemOperand, MemOps, SegBase};
use crate::layout::MAX_INSN_BYTES;
use crate::platform::{SensitiveInsn, SensitiveKind};
use crate::HostFlags;

mod form;

pub(crate) use form::decode_trace;

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
    /// Its bytes: the first `instr.len()` (`bytes()`; the rest are the guest bytes that
    /// followed it).
    pub bytes: [u8; MAX_INSN_BYTES],
    pub class: Class,
    /// The GPRs (bit = hardware number) the instruction reads or writes, and those it
    /// writes: iced's register usage, taken once at decode (`gpr_usage`).
    pub gprs_used: u16,
    pub gprs_written: u16,
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

impl DecodedTrace {
    /// The guest bytes the trace was translated from, as a length from its start: up to
    /// the end of its last instruction or of the sensitive instruction that ends it
    /// (whose bytes its exit carries). `None` if they reach past the start's page (or the
    /// ending bytes did not decode): such a trace depends on bytes of another frame.
    pub(crate) fn code_len(&self) -> Option<u16> {
        let start = self.start.0;
        let mut end = 0;
        for d in &self.insns {
            end = end.max(d.instr.ip().wrapping_sub(start) + d.instr.len() as u64);
        }
        if let TraceEnd::Sensitive(s) = &self.end {
            if s.len == 0 {
                return None;
            }
            end = end.max(s.pc.0.wrapping_sub(start) + u64::from(s.len));
        }
        let in_page = PAGE_BYTES - (start & (PAGE_BYTES - 1));
        (end > 0 && end <= in_page).then_some(end as u16)
    }
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

/// [`sensitive_kind`] of each `Code`, computed at its first instruction: it depends on
/// the code alone (its mnemonic, the register classes of its operands — a control,
/// debug, test or segment register is never an r/m operand —, its flow control).
pub(crate) struct SensitiveKinds(Vec<Option<Option<SensitiveKind>>>);

impl SensitiveKinds {
    fn new() -> Self {
        Self(alloc::vec![None; Code::values().count()])
    }

    /// `sensitive_kind(i)`.
    #[inline]
    pub(crate) fn of(&mut self, i: &Instruction) -> Option<SensitiveKind> {
        let slot = &mut self.0[i.code() as usize];
        match *slot {
            Some(k) => {
                debug_assert_eq!(k, sensitive_kind(i), "{:?}", i.code());
                k
            }
            None => *slot.insert(sensitive_kind(i)),
        }
    }
}

#[inline]
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
    mem_operands_of(factory.info(i), i)
}

/// iced's memory operands in `info` that [`mem_operands_of`] lists, in its order: those
/// the instruction accesses (not `lea`'s address), without VSIB ones (a gather's lanes
/// are checked apart).
pub(crate) fn listed_memory(info: &InstructionInfo) -> impl Iterator<Item = &UsedMemory> {
    info.used_memory().iter().filter(|m| {
        !matches!(m.access(), OpAccess::None | OpAccess::NoMemAccess) && m.vsib_size() == 0
    })
}

/// [`mem_operands`] from iced's `info` of `i` already computed.
pub(crate) fn mem_operands_of(info: &InstructionInfo, i: &Instruction) -> MemOps {
    let mut v = MemOps::default();
    let size_hint = i.memory_size().size() as u32;
    for m in listed_memory(info) {
        let acc = match m.access() {
            OpAccess::Read | OpAccess::CondRead => access::READ,
            OpAccess::Write | OpAccess::CondWrite => access::WRITE,
            // ReadWrite, ReadCondWrite (`listed_memory` leaves no other).
            _ => access::READ | access::WRITE,
        };
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

/// Entries of `Usage`'s cache (a power of two).
const USAGE_ENTRIES: usize = 2048;

/// An instruction's use of GPRs and memory (`gpr_usage`, `mem_operands_of`) from iced's
/// info factory, remembered by the instruction's shape (`usage_key`), of which iced's
/// answer is a function (but for the explicit operand's displacement): most of a
/// trace's instructions repeat shapes seen before (`mov rdi, rbx`, `push rbp`,
/// `test eax, eax`, `jcc`, `ret`, `mov rax, [rdi+disp]`).
pub(crate) struct Usage {
    pub(crate) factory: InstructionInfoFactory,
    /// Direct-mapped by the key's hash; `key.0 == u64::MAX`: empty.
    cache: Vec<UsageEntry>,
}

#[derive(Clone, Copy)]
struct UsageEntry {
    key: (u64, u64),
    used: u16,
    written: u16,
    mem: MemOps,
}

/// The shape of an instruction: its code, its register operands, its explicit memory
/// operand's base, index and scale (not its displacement), its segment, `rep` and `lock`
/// prefixes and its code size — everything iced's register and memory usage depends on
/// but the displacement, which goes only into the explicit operand's own entry
/// (implicit accesses, stack ones among them, depend on the code and the code size;
/// `xor r, r`-style idioms on the registers; `xstore`'s on `rep`). The second word is 0
/// without an explicit memory operand. `None` for what is not cached: a string's or
/// `maskmov`'s implicit operand, an op mask or broadcast, `enter`.
/// `test_usage_is_a_function_of_the_usage_key` checks it over random instructions.
#[inline]
fn usage_key(i: &Instruction) -> Option<(u64, u64)> {
    let mut key = i.code() as u64;
    let mut mem = 0;
    for n in 0..i.op_count() {
        match i.op_kind(n) {
            OpKind::Register => key |= (i.op_register(n) as u64) << (16 + 8 * n),
            OpKind::Memory => {
                mem = 1
                    | (i.memory_base() as u64) << 8
                    | (i.memory_index() as u64) << 16
                    | u64::from(i.memory_index_scale().trailing_zeros()) << 24;
            }
            OpKind::NearBranch16
            | OpKind::NearBranch32
            | OpKind::NearBranch64
            | OpKind::FarBranch16
            | OpKind::FarBranch32
            | OpKind::Immediate8
            | OpKind::Immediate8_2nd
            | OpKind::Immediate16
            | OpKind::Immediate32
            | OpKind::Immediate64
            | OpKind::Immediate8to16
            | OpKind::Immediate8to32
            | OpKind::Immediate8to64
            | OpKind::Immediate32to64 => {}
            _ => return None,
        }
    }
    if i.has_op_mask() || i.is_broadcast() || i.mnemonic() == Mnemonic::Enter {
        return None;
    }
    let seg = match i.segment_prefix() {
        Register::None => 0,
        r => (r as u64).wrapping_sub(Register::ES as u64) + 1,
    };
    // `rep`/`repne` (`xstore`'s RCX) and `lock`, as they are.
    let prefixes = u64::from(i.has_rep_prefix())
        | u64::from(i.has_repne_prefix()) << 1
        | u64::from(i.has_lock_prefix()) << 2;
    // (Code < 2^13, 5 registers < 2^8 each: bits 0..56; the segment 1..=6: 3 bits; never
    // `u64::MAX`.)
    let key = key | (seg & 7) << 56 | (i.code_size() as u64 & 3) << 59 | prefixes << 61;
    Some((key, mem))
}

/// iced's answer for `i` (of shape `key`) as `Usage` keeps it: with an explicit memory
/// operand, only when that operand is the instruction's one memory access (its entry
/// is then the one whose displacement changes with the instruction), its displacement
/// zeroed; `None`: not kept.
fn shape_answer(
    key: (u64, u64),
    i: &Instruction,
    answer: (u16, u16, MemOps),
) -> Option<(u16, u16, MemOps)> {
    if key.1 == 0 {
        return Some(answer);
    }
    let (used, written, mem) = answer;
    match *mem {
        [m] if m.disp == i.memory_displacement64() => {
            let mut one = MemOps::default();
            one.push(MemOperand { disp: 0, ..m });
            Some((used, written, one))
        }
        _ => None,
    }
}

impl Usage {
    fn new() -> Self {
        let empty = UsageEntry {
            key: (u64::MAX, 0),
            used: 0,
            written: 0,
            mem: MemOps::default(),
        };
        Self {
            factory: InstructionInfoFactory::new(),
            cache: alloc::vec![empty; USAGE_ENTRIES],
        }
    }

    /// The GPRs `i` uses and writes (`gpr_usage`), and its memory operands
    /// (`mem_operands_of`).
    #[inline]
    pub(crate) fn of(&mut self, i: &Instruction) -> (u16, u16, MemOps) {
        let direct = |factory: &mut InstructionInfoFactory| {
            let info = factory.info(i);
            let (used, written) = gpr_usage(info);
            (used, written, mem_operands_of(info, i))
        };
        let Some(key) = usage_key(i) else {
            return direct(&mut self.factory);
        };
        let h = (key.0 ^ key.1.rotate_left(23)).wrapping_mul(0x9E37_79B9_7F4A_7C15)
            >> (64 - USAGE_ENTRIES.trailing_zeros());
        let e = &mut self.cache[h as usize];
        if e.key == key {
            if key.1 == 0 {
                return (e.used, e.written, e.mem);
            }
            let mut mem = MemOps::default();
            mem.push(MemOperand {
                disp: i.memory_displacement64(),
                ..e.mem[0]
            });
            return (e.used, e.written, mem);
        }
        let answer = direct(&mut self.factory);
        if let Some((used, written, mem)) = shape_answer(key, i, answer) {
            *e = UsageEntry {
                key,
                used,
                written,
                mem,
            };
        }
        answer
    }
}

/// The GPRs (bit = hardware number) `info` says its instruction uses, and those it writes
/// (also conditionally).
pub(crate) fn gpr_usage(info: &InstructionInfo) -> (u16, u16) {
    let (mut used, mut written) = (0u16, 0u16);
    for u in info.used_registers() {
        let r = u.register();
        if !r.is_gpr() {
            continue;
        }
        let bit = 1 << (r.full_register() as u32 - Register::RAX as u32);
        used |= bit;
        if matches!(
            u.access(),
            OpAccess::Write | OpAccess::CondWrite | OpAccess::ReadWrite | OpAccess::ReadCondWrite
        ) {
            written |= bit;
        }
    }
    (used, written)
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

/// Reusable translation state: iced's info factory, and the storage of the last traces
/// decoded and translated (returned by `recycle_trace` and `TxBuffers::recycle`), so that
/// translating a trace does not allocate once the buffers have grown.
pub(crate) struct Scratch {
    pub(crate) usage: Usage,
    pub(crate) sensitive: SensitiveKinds,
    /// The fetch buffer of the trace being decoded (`form.rs`).
    fetch: alloc::boxed::Box<[u8; form::FETCH_BYTES]>,
    insns: Vec<DecodedInsn>,
    info: Vec<InsInfo>,
    bbls: Vec<Bbl>,
    pub(crate) tx: super::mangle::TxBuffers,
    /// The storage of a trace's insertion list (the dispatcher's `instrument`).
    pub(crate) insertions: Vec<crate::instrument::Insertion>,
    /// Flags live before each instruction of the trace being translated (`flags_liveness`,
    /// computed once for the count points and the translation), or of one re-decoded for
    /// a fault's count point (`insn_count.rs`).
    pub(crate) live: Vec<u32>,
}

impl Scratch {
    /// The fetch buffer: after `decode_trace`, the trace's guest bytes from its start.
    pub(crate) fn fetch_buf(&mut self) -> &mut [u8] {
        &mut self.fetch[..]
    }

    pub(crate) fn new() -> Self {
        Self {
            usage: Usage::new(),
            sensitive: SensitiveKinds::new(),
            fetch: alloc::boxed::Box::new([0; form::FETCH_BYTES]),
            insns: Vec::with_capacity(24),
            info: Vec::with_capacity(24),
            bbls: Vec::with_capacity(4),
            tx: super::mangle::TxBuffers::default(),
            insertions: Vec::new(),
            live: Vec::new(),
        }
    }

    /// Takes back the storage of a trace the dispatcher is done with.
    pub(crate) fn recycle_trace(&mut self, t: DecodedTrace) {
        self.insns = t.insns;
        self.info = t.info;
        self.bbls = t.bbls;
    }

    /// Empty vectors for a new trace (the recycled ones).
    fn trace_vecs(&mut self) -> (Vec<DecodedInsn>, Vec<InsInfo>, Vec<Bbl>) {
        let mut v = (
            core::mem::take(&mut self.insns),
            core::mem::take(&mut self.info),
            core::mem::take(&mut self.bbls),
        );
        v.0.clear();
        v.1.clear();
        v.2.clear();
        v
    }
}

/// Status flags (OF SF ZF AF CF PF) in iced's `RflagsBits` encoding.
pub(crate) const STATUS_FLAGS: u32 = 0x3F;

/// Flags live *before* each instruction, into `live`; index `n` (trace end) is all-live.
/// A flag an instruction leaves undefined stays live across it, unless `host` says the
/// CPU writes it (`host_flags.rs`).
pub(crate) fn flags_liveness(t: &DecodedTrace, live: &mut Vec<u32>, host: HostFlags) {
    let logic_af = if host.logic_af_written {
        iced_x86::RflagsBits::AF
    } else {
        0
    };
    let n = t.insns.len();
    live.clear();
    live.resize(n + 1, STATUS_FLAGS);
    for k in (0..n).rev() {
        let d = &t.insns[k];
        let i = &d.instr;
        let mut after = live[k + 1];
        if matches!(d.class, Class::Jcc { .. } | Class::LoopLike { .. }) {
            after = STATUS_FLAGS;
        }
        // written | cleared | set, in two of iced's look-ups instead of three (one for
        // the many instructions that modify no flag).
        let modified = i.rflags_modified();
        let writes = if modified == 0 {
            0
        } else {
            let mut written_undefined = 0;
            if logic_af != 0
                && matches!(
                    i.mnemonic(),
                    Mnemonic::And | Mnemonic::Or | Mnemonic::Xor | Mnemonic::Test
                )
            {
                written_undefined = logic_af;
            }
            modified & !(i.rflags_undefined() & !written_undefined)
        };
        // (Whether they may be left alone matters only if they kill a live flag.)
        let kills = if writes & after == 0 || count_may_be_zero(i) {
            0
        } else {
            writes
        };
        live[k] = ((after & !kills) | i.rflags_read()) & STATUS_FLAGS;
    }
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

    /// Fills `bytes` from the xorshift state `x` (random instruction bytes).
    fn random_bytes(x: &mut u64, bytes: &mut [u8; 16]) {
        for b in bytes.chunks_mut(8) {
            *x ^= *x << 13;
            *x ^= *x >> 7;
            *x ^= *x << 17;
            b.copy_from_slice(&x.to_le_bytes());
        }
    }

    /// `SensitiveKinds` keeps one answer per `Code`: over random instructions (64- and
    /// 32-bit, every register and memory form they happen to hit) the answer depends on
    /// the code alone. (And iced's modified flags less the undefined ones are the
    /// written, cleared and set ones.)
    #[test]
    fn test_sensitive_kind_depends_on_the_code_alone() {
        let mut seen = alloc::collections::BTreeMap::new();
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let mut bytes = [0u8; 16];
        for n in 0..400_000 {
            random_bytes(&mut x, &mut bytes);
            // Two-byte opcodes (system instructions among them) and prefixed ones too.
            match n % 4 {
                1 => bytes[0] = 0x0F,
                2 => bytes[..2].copy_from_slice(&[0x0F, (n / 4 % 2) as u8]),
                3 => bytes[..2].copy_from_slice(&[[0x66, 0xF3, 0xF2, 0x48][n / 4 % 4], 0x0F]),
                _ => {}
            }
            for bitness in [64, 32] {
                let i = Decoder::with_ip(bitness, &bytes, 0x1000, DecoderOptions::NONE).decode();
                if i.is_invalid() {
                    continue;
                }
                let k = sensitive_kind(&i);
                assert_eq!(*seen.entry(i.code()).or_insert(k), k, "{:?}", i.code());
                // (`flags_liveness`'s flags written, cleared or set.)
                assert_eq!(
                    i.rflags_modified() & !i.rflags_undefined(),
                    i.rflags_written() | i.rflags_cleared() | i.rflags_set(),
                    "{:?}",
                    i.code()
                );
            }
        }
        assert!(seen.len() > 1500, "{} codes", seen.len());
    }

    /// `Usage` answers as iced's info factory does, and for instructions with a
    /// `usage_key`, iced's answer is the same for every instruction of that key: over
    /// random 64- and 32-bit instructions, with and without segment prefixes.
    #[test]
    fn test_usage_is_a_function_of_the_usage_key() {
        let mut usage = super::Usage::new();
        let mut factory = iced_x86::InstructionInfoFactory::new();
        let mut seen = alloc::collections::BTreeMap::new();
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let mut bytes = [0u8; 16];
        for n in 0..400_000 {
            random_bytes(&mut x, &mut bytes);
            match n % 4 {
                1 => bytes[0] = 0x0F,
                2 => bytes[0] = [0x64, 0x65, 0x2E, 0x67][n / 4 % 4],
                3 => bytes[..2].copy_from_slice(&[[0x66, 0xF3, 0xC5, 0x48][n / 4 % 4], 0x0F]),
                _ => {}
            }
            for bitness in [64, 32] {
                let i = Decoder::with_ip(bitness, &bytes, 0x1000, DecoderOptions::NONE).decode();
                if i.is_invalid() {
                    continue;
                }
                let info = factory.info(&i);
                let direct = {
                    let (u, w) = super::gpr_usage(info);
                    (u, w, super::mem_operands_of(info, &i))
                };
                assert_eq!(usage.of(&i), direct, "{:?}", i.code());
                if let Some(key) = super::usage_key(&i) {
                    let kept = super::shape_answer(key, &i, direct);
                    assert_eq!(*seen.entry(key).or_insert(kept), kept, "{:?}", i.code());
                }
            }
        }
        assert!(seen.len() > 20_000, "{} keys", seen.len());
    }

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
