//! Hardware page faults taken by translated guest code, and instruction fetches the
//! translator could not make: what the shadow MMU says they are.
//!
//! A #PF in the code cache (a `Stop::Fault` with vector 14) is one of:
//! * a shadow miss: the shadow MMU filled the entry → re-execute the instruction;
//! * a write to a code frame (self-modifying code, through any alias): its traces are
//!   invalidated, its protection dropped → re-execute the write. If the writing
//!   instruction's own bytes are in that frame, re-executing would translate (and
//!   protect) the frame again and fault forever, so the store is emulated instead (plain
//!   `mov` stores; anything else stops the run naming it);
//! * a fault the guest itself must see → handed back for delivery.
//!
//! Invariant: the same fault (instruction, address, error code) repeating while the
//! translator did nothing else in between (no new trace, no exit but these faults) means
//! the shadow MMU is not making progress: the run stops instead of spinning
//! ([`Progress`]). A guest that keeps dropping the page again (`invlpg`, a CR3 write, a
//! write to its own code) goes through other exits or new traces in between.

use core::cell::RefCell;

use guest_engine::isolation::{classify_fault, IsolationFault};
use guest_engine::shadow_mmu::{Access, FillOutcome, GuestFault, PF_USER, PF_WRITE};
use guest_engine::{Engine, Gpr, GuestPhys, GuestVirt, Mode};
use iced_x86::{Code, Decoder, DecoderOptions, Instruction, OpKind, Register};

use crate::mm::guest_memory::{view_of, ShadowedMemory};
use crate::mm::shadow::Shadow;
use crate::run::error::RunError;
use crate::run::vcpu::Vcpu;

/// Identical faults in a row tolerated before the run stops.
const MAX_REPEATS: u32 = 3;
/// Longest x86 instruction.
pub(crate) const MAX_INSN: usize = 15;

/// What the run loop does next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Re-execute the faulting instruction.
    Retry,
    /// Continue at this address (the faulting store was emulated).
    Resume(GuestVirt),
    /// The guest takes this fault (at the faulting instruction).
    Reflect(GuestFault),
}

/// A hardware #PF raised by translated code, mapped back to the guest instruction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HwPageFault {
    /// The guest instruction that faulted (the engine's registers are the guest's before
    /// it).
    pub guest_pc: GuestVirt,
    /// The faulting address.
    pub cr2: u64,
    /// The hardware error code (taken at CPL 3: the U bit is always set).
    pub error: u32,
}

/// A #UD at a translated guest instruction, with the guest's FS and GS bases.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IsolationHit {
    /// The guest instruction (state precise before it).
    pub guest_pc: GuestVirt,
    /// The guest's FS base.
    pub fs_base: u64,
    /// The guest's GS base.
    pub gs_base: u64,
}

/// The last fault handled, to detect a fault that keeps coming back.
#[derive(Default)]
pub struct Progress {
    /// (RIP, CR2, error code) and the translator's activity then (see [`activity`]).
    last: Option<((u64, u64, u32), u64)>,
    repeats: u32,
    /// The last address [`fault_address`] derived, as (RIP, address, error code).
    derived: Option<(u64, u64, u32)>,
}

/// Traces built plus exits of every kind but FAULT: unchanged between two faults means
/// the guest did nothing but fault.
fn activity(engine: &Engine) -> u64 {
    let s = engine.stats();
    let fault = guest_engine::exit_code::EXIT_FAULT as usize;
    let exits: u64 = s
        .exits
        .iter()
        .enumerate()
        .filter(|(k, _)| *k != fault)
        .map(|(_, n)| n)
        .sum();
    s.fragments + exits
}

/// The address of the hardware #PF with `error` that the guest instruction at
/// `guest_pc` (translated for `mode`, guest state in `engine`, FS/GS bases given) took:
/// from the instruction when the tables in the real CR3 leave one answer
/// (`guest_engine::isolation::page_fault_address`), else CR2, read at ring 0 (a trip as
/// dear as the fault's own). Also CR2 when the instruction gives the very answer it gave
/// for the last fault: handling that answer did not get the instruction past it, which
/// the real address must then do (so no derivation can keep a guest in a loop).
#[allow(clippy::too_many_arguments)]
pub fn fault_address(
    engine: &Engine,
    shadow: &RefCell<Shadow>,
    progress: &mut Progress,
    mode: Mode,
    guest_pc: GuestVirt,
    error: u32,
    fs_base: u64,
    gs_base: u64,
) -> u64 {
    let mut bytes = [0u8; MAX_INSN];
    let n = ShadowedMemory::new(shadow).peek_code(guest_pc.0, mode, &mut bytes);
    let derived = guest_engine::isolation::page_fault_address(
        mode.bitness(),
        &bytes[..n],
        guest_pc.0,
        engine.regs(),
        fs_base,
        gs_base,
        error,
        |va| shadow.borrow_mut().hardware_rights(va),
    )
    .filter(|&va| progress.derived != Some((guest_pc.0, va, error)));
    progress.derived = derived.map(|va| (guest_pc.0, va, error));
    let mut s = shadow.borrow_mut();
    match derived {
        Some(va) => {
            s.counters.fault_addresses_derived += 1;
            va
        }
        None => {
            s.counters.fault_addresses_read += 1;
            crate::ring0::gate::read_cr2()
        }
    }
}

/// Handles the hardware #PF `hw`, taken by guest code translated for `mode`.
pub fn on_page_fault(
    engine: &mut Engine,
    shadow: &RefCell<Shadow>,
    vcpu: &Vcpu<'_>,
    progress: &mut Progress,
    mode: Mode,
    hw: HwPageFault,
) -> Result<Action, RunError> {
    let HwPageFault {
        guest_pc,
        cr2,
        error,
    } = hw;
    let key = ((guest_pc.0, cr2, error), activity(engine));
    if progress.last == Some(key) {
        progress.repeats += 1;
        if progress.repeats >= MAX_REPEATS {
            return Err(RunError::NoProgress {
                rip: guest_pc.0,
                cr2,
                error,
            });
        }
    } else {
        progress.last = Some(key);
        progress.repeats = 0;
    }
    let outcome = shadow
        .borrow_mut()
        .page_fault(cr2, error)
        .map_err(|e| shadow_failure(guest_pc, e))?;
    match outcome {
        FillOutcome::Mapped { .. } => Ok(Action::Retry),
        FillOutcome::GuestFault(f) => Ok(Action::Reflect(f)),
        FillOutcome::ProtectedCode { frame, .. } => {
            // Known only now: the fault was self-modifying code, not a shadow miss.
            guest_engine::profile::switch_charging(
                crate::run::profile::SMC_FAULT,
                crate::run::profile::SMC_FAULT,
            );
            let n = engine.invalidate_code_page(frame);
            shadow
                .borrow_mut()
                .code_invalidated(frame, n)
                .map_err(|e| shadow_failure(guest_pc, e))?;
            let insn = decode_at(shadow, mode, guest_pc);
            if !in_own_frame(shadow, mode, guest_pc, &insn, frame) {
                return Ok(Action::Retry);
            }
            emulate_store(engine, shadow, vcpu, mode, guest_pc, &insn)
        }
    }
}

/// A #UD in translated code at the guest instruction `hit.guest_pc` (guest state
/// precise before it): the isolation check's trap when an operand would reach the
/// engine's reserved zone (`guest_engine::isolation`). Such an access gets what the
/// guest's own tables say at the virtual CPL, as a hardware #PF there would — a guest
/// fault, or (the guest maps the address itself) the access performed on the guest's
/// frame for plain `mov` loads/stores (`run::zone_access`), else an engine failure; a
/// non-canonical operand (the check's only false positives) is #GP(0); `Ok(None)`: the
/// #UD is the
/// guest's own.
pub fn on_isolation_hit(
    engine: &mut Engine,
    shadow: &RefCell<Shadow>,
    vcpu: &Vcpu<'_>,
    progress: &mut Progress,
    mode: Mode,
    hit: IsolationHit,
) -> Result<Option<Action>, RunError> {
    let guest_pc = hit.guest_pc;
    let mut bytes = [0u8; MAX_INSN];
    let n = ShadowedMemory::new(shadow).peek_code(guest_pc.0, mode, &mut bytes);
    let regs = *engine.regs();
    let (addr, access) = match classify_fault(
        mode,
        &bytes[..n],
        guest_pc.0,
        &regs,
        hit.fs_base,
        hit.gs_base,
        engine.vector_lane_checked(),
    ) {
        IsolationFault::GuestUd => return Ok(None),
        IsolationFault::NonCanonical { addr, stack } => {
            shadow.borrow_mut().counters.isolation_hits += 1;
            let vector = if stack {
                kpin_abi::x86::vector::SS
            } else {
                kpin_abi::x86::vector::GP
            };
            return Ok(Some(Action::Reflect(GuestFault {
                vector,
                error_code: 0,
                cr2: GuestVirt(addr),
            })));
        }
        IsolationFault::BaseInZone { base, addr, access } => {
            return base_in_zone(
                engine,
                shadow,
                mode,
                guest_pc,
                &bytes[..n],
                base,
                addr,
                access,
            )
        }
        IsolationFault::Zone { addr, access } => (addr, access),
    };
    shadow.borrow_mut().counters.isolation_hits += 1;
    // The guest's own mapping in the zone: the common forms run on its frame.
    let insn = Decoder::with_ip(
        mode.bitness(),
        &bytes[..n],
        guest_pc.0,
        DecoderOptions::NONE,
    )
    .decode();
    if let Some(action) =
        crate::run::zone_access::emulate(engine, shadow, mode, guest_pc, &insn, addr)?
    {
        return Ok(Some(action));
    }
    // The same path as a hardware #PF at `addr` (taken at CPL 3: U set; the view, not
    // the U bit, gives the virtual CPL).
    let mut error = PF_USER;
    if access & guest_engine::instrument::access::WRITE != 0 {
        error |= PF_WRITE;
    }
    let hw = HwPageFault {
        guest_pc,
        cr2: addr,
        error,
    };
    match on_page_fault(engine, shadow, vcpu, progress, mode, hw)? {
        Action::Reflect(f) => Ok(Some(Action::Reflect(f))),
        // A fill never maps the reserved zone; anything else is an engine bug.
        _ => Err(RunError::Shadow {
            rip: guest_pc.0,
            error: guest_engine::shadow_mmu::ShadowError::ReservedSlot(GuestVirt(addr)),
        }),
    }
}

/// An operand at `addr` (outside the zone) whose base register lies in the zone: the
/// trace's base check keeps the instruction from running natively, so it gets what the
/// guest's tables say — their fault (a process poking there gets its SIGSEGV, as on a
/// real CPU), or the `mov` forms performed on the guest's frame; any other instruction
/// through a mapping there ends the run naming it.
#[allow(clippy::too_many_arguments)]
fn base_in_zone(
    engine: &mut Engine,
    shadow: &RefCell<Shadow>,
    mode: Mode,
    guest_pc: GuestVirt,
    bytes: &[u8],
    base: u64,
    addr: u64,
    access: u32,
) -> Result<Option<Action>, RunError> {
    shadow.borrow_mut().counters.isolation_hits += 1;
    let insn = Decoder::with_ip(mode.bitness(), bytes, guest_pc.0, DecoderOptions::NONE).decode();
    if let Some(action) =
        crate::run::zone_access::emulate(engine, shadow, mode, guest_pc, &insn, addr)?
    {
        return Ok(Some(action));
    }
    let kind = if access & guest_engine::instrument::access::WRITE != 0 {
        Access::Write
    } else {
        Access::Read
    };
    let walked = shadow
        .borrow_mut()
        .translate_reserved(addr, kind, view_of(mode))
        .map_err(|error| shadow_failure(guest_pc, error))?;
    match walked {
        Err(f) => Ok(Some(Action::Reflect(f))),
        Ok(_) => Err(RunError::BaseInReservedZone {
            rip: guest_pc.0,
            base,
        }),
    }
}

/// The fault a fetch at `va` in `mode` takes (the translator's `Stop::FetchFault(va)`:
/// `va` is the instruction's address, or the next page's when its first instruction
/// straddles into it), else at the start of the next page; `None` if both translate.
pub fn fetch_fault(shadow: &RefCell<Shadow>, mode: Mode, va: GuestVirt) -> Option<GuestFault> {
    let mut sh = shadow.borrow_mut();
    let view = view_of(mode);
    if let Err(f) = sh.access(va.0, Access::Fetch, view) {
        return Some(f);
    }
    let next = (va.0 | 0xfff).wrapping_add(1);
    sh.access(next, Access::Fetch, view).err()
}

fn shadow_failure(guest_pc: GuestVirt, error: guest_engine::shadow_mmu::ShadowError) -> RunError {
    RunError::Shadow {
        rip: guest_pc.0,
        error,
    }
}

/// Whether any byte of the instruction at `pc` may lie in `frame`.
/// The guest instruction at `pc` (invalid if its bytes cannot be fetched).
fn decode_at(shadow: &RefCell<Shadow>, mode: Mode, pc: GuestVirt) -> Instruction {
    let mut bytes = [0u8; MAX_INSN];
    let n = ShadowedMemory::new(shadow).peek_code(pc.0, mode, &mut bytes);
    Decoder::with_ip(mode.bitness(), &bytes[..n], pc.0, DecoderOptions::NONE).decode()
}

/// Whether a byte of `insn` (at `pc`; all 15 possible bytes if it does not decode) lies
/// in `frame`.
fn in_own_frame(
    shadow: &RefCell<Shadow>,
    mode: Mode,
    pc: GuestVirt,
    insn: &Instruction,
    frame: GuestPhys,
) -> bool {
    let mut sh = shadow.borrow_mut();
    let view = view_of(mode);
    let len = if insn.is_invalid() {
        MAX_INSN
    } else {
        insn.len()
    };
    let last = pc.0.wrapping_add(len as u64 - 1);
    [pc.0, last].iter().any(|&va| {
        sh.access(va, Access::Fetch, view)
            .is_ok_and(|pa| pa.page() == frame)
    })
}

/// Emulates the store `i` at `guest_pc` (a plain `mov` to memory), which writes into its
/// own code frame; its traces are already invalidated.
fn emulate_store(
    engine: &mut Engine,
    shadow: &RefCell<Shadow>,
    vcpu: &Vcpu<'_>,
    mode: Mode,
    guest_pc: GuestVirt,
    i: &Instruction,
) -> Result<Action, RunError> {
    let mem = ShadowedMemory::new(shadow);
    let regs = *engine.regs();
    if let Some(r) = emulate_string(engine, &mem, mode, i) {
        if matches!(r, Action::Resume(_)) {
            shadow.borrow_mut().counters.emulated_stores += 1;
        }
        return Ok(r);
    }
    let value = match i.code() {
        Code::Mov_rm8_r8 | Code::Mov_rm16_r16 | Code::Mov_rm32_r32 | Code::Mov_rm64_r64
            if i.op0_kind() == OpKind::Memory =>
        {
            crate::run::zone_access::register_value(&regs, i.op1_register())
        }
        Code::Mov_rm8_imm8 | Code::Mov_rm16_imm16 | Code::Mov_rm32_imm32 | Code::Mov_rm64_imm32
            if i.op0_kind() == OpKind::Memory =>
        {
            Some(i.immediate(1))
        }
        _ => None,
    };
    let size = i.memory_size().size();
    let (Some(value), Some(ea)) = (value, vcpu.data_address(i, &regs)) else {
        return Err(RunError::SelfModifyingStore {
            rip: guest_pc.0,
            mnemonic: i.mnemonic(),
        });
    };
    if let Err(f) = mem.try_write_virt(ea, mode, &value.to_le_bytes()[..size]) {
        return Ok(Action::Reflect(f));
    }
    shadow.borrow_mut().counters.emulated_stores += 1;
    Ok(Action::Resume(GuestVirt(i.next_ip())))
}

/// Emulates `movs`/`stos`/`lods` (byte … quadword, with or without `rep`, 64-bit
/// addressing, no segment override but DS) element by element as the CPU does:
/// RSI/RDI/RCX advance per element, and a fault leaves them at the faulting element (the
/// guest's handler sees a restartable `rep`). `None` if `i` is not one of them. (Linux's
/// `text_poke` copies with `memcpy`'s `rep movsb`, which may lie in the very frame it
/// patches; the guest's own mappings of the reserved zone use it too.)
pub(crate) fn emulate_string(
    engine: &mut Engine,
    mem: &ShadowedMemory<'_>,
    mode: Mode,
    i: &Instruction,
) -> Option<Action> {
    #[derive(PartialEq)]
    enum Op {
        Movs,
        Stos,
        Lods(Register),
    }
    let (size, op) = match i.code() {
        Code::Movsb_m8_m8 => (1, Op::Movs),
        Code::Movsw_m16_m16 => (2, Op::Movs),
        Code::Movsd_m32_m32 => (4, Op::Movs),
        Code::Movsq_m64_m64 => (8, Op::Movs),
        Code::Stosb_m8_AL => (1, Op::Stos),
        Code::Stosw_m16_AX => (2, Op::Stos),
        Code::Stosd_m32_EAX => (4, Op::Stos),
        Code::Stosq_m64_RAX => (8, Op::Stos),
        Code::Lodsb_AL_m8 => (1, Op::Lods(Register::AL)),
        Code::Lodsw_AX_m16 => (2, Op::Lods(Register::AX)),
        Code::Lodsd_EAX_m32 => (4, Op::Lods(Register::EAX)),
        Code::Lodsq_RAX_m64 => (8, Op::Lods(Register::RAX)),
        _ => return None,
    };
    let (reads, writes) = (op != Op::Stos, !matches!(op, Op::Lods(_)));
    let forms_ok = if writes {
        i.op0_kind() == OpKind::MemoryESRDI
    } else {
        i.op1_kind() == OpKind::MemorySegRSI
    };
    if i.memory_size().size() != size
        || !forms_ok
        || i.has_repne_prefix()
        || (reads && !matches!(i.segment_prefix(), Register::None | Register::DS))
    {
        return None;
    }
    let rep = i.has_rep_prefix();
    let regs = engine.regs_mut();
    let step = if regs.rflags & (1 << 10) != 0 {
        (size as u64).wrapping_neg()
    } else {
        size as u64
    };
    loop {
        if rep && regs.get(Gpr::Rcx) == 0 {
            break;
        }
        let mut b = regs.get(Gpr::Rax).to_le_bytes();
        if reads {
            if let Err(f) = mem.try_read_virt(regs.get(Gpr::Rsi), mode, &mut b[..size]) {
                return Some(Action::Reflect(f));
            }
            regs.set(Gpr::Rsi, regs.get(Gpr::Rsi).wrapping_add(step));
        }
        match op {
            Op::Lods(r) => crate::run::zone_access::set_register(regs, r, u64::from_le_bytes(b)),
            _ => {
                if let Err(f) = mem.try_write_virt(regs.get(Gpr::Rdi), mode, &b[..size]) {
                    if reads {
                        regs.set(Gpr::Rsi, regs.get(Gpr::Rsi).wrapping_sub(step));
                    }
                    return Some(Action::Reflect(f));
                }
                regs.set(Gpr::Rdi, regs.get(Gpr::Rdi).wrapping_add(step));
            }
        }
        if !rep {
            break;
        }
        regs.set(Gpr::Rcx, regs.get(Gpr::Rcx) - 1);
    }
    Some(Action::Resume(GuestVirt(i.next_ip())))
}
