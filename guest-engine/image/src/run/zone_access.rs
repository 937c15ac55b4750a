//! Guest accesses to the reserved zone (PML4 slots 256–259) that the guest maps itself,
//! and operands whose base register lies there.
//!
//! The engine owns those slots in every shadow root (its window, the physmap, the
//! guards), so a guest mapping of its own there can never be installed; the isolation
//! check traps the access instead (`guest_engine::isolation`). When the guest's tables
//! allow it, the access is performed on the guest's own frames (through the physmap) and
//! the guest continues after the instruction: plain `mov` loads and stores within one page
//! here in Rust; every other instruction whose one memory access is its explicit operand
//! (ALU, SSE/AVX, x87, `cmpxchg`, page-crossing accesses…) runs natively with that operand
//! redirected to engine memory (`guest_engine::redirect`), its bytes copied in from the
//! guest's frames and back for a write; `movs`/`stos`/`lods`, `push`/`pop`/`call`/`ret`/
//! `leave` with the stack there, and `call`/`jmp`/`push` through a memory operand there
//! `xlat` and `cmps`/`scas` are emulated through the guest's tables. What remains (other
//! stack operations there, gathers with an enabled lane there, `xsave`) ends the run
//! naming the slot.

use core::cell::RefCell;

use guest_engine::redirect::{redirectable, Redirected, REDIRECT_MAX_BYTES};
use guest_engine::shadow_mmu::{Access, GuestFault};
use guest_engine::{Engine, Gpr, GuestPhys, GuestRegs, GuestVirt, Mode};
use iced_x86::{Code, Instruction, InstructionInfoFactory, OpAccess, OpKind, Register};

use crate::mm::guest_memory::{view_of, ShadowedMemory};
use crate::mm::shadow::Shadow;
use crate::ring0::entry;
use crate::run::cache_page_fault::Action;
use crate::run::error::RunError;

/// A plain `mov` between memory and a register or immediate.
enum Form {
    /// Load into the register, sign-extended from the access size if set.
    Load(Register, bool),
    /// Store of the value.
    Store(u64),
}

/// Performs `i` (at `guest_pc`, guest state before it), whose memory operand lies at
/// `addr` (in the reserved zone, or reached from a base register there;
/// `isolation::classify_fault` computed it), on the guest's own frames: `Ok(Some(action))`
/// when done (or when the guest takes a fault), `Ok(None)` when `i` is not a form handled
/// here.
pub fn emulate(
    engine: &mut Engine,
    shadow: &RefCell<Shadow>,
    mode: Mode,
    guest_pc: GuestVirt,
    i: &Instruction,
    addr: u64,
) -> Result<Option<Action>, RunError> {
    let regs = *engine.regs();
    let size = i.memory_size().size();
    let page_end = (addr | 0xfff).wrapping_add(1);
    let one_page = size != 0 && (addr.wrapping_add(size as u64) <= page_end || page_end == 0);
    let form = form_of(i, &regs).filter(|_| one_page && size <= 8);
    let Some(form) = form else {
        return redirect(engine, shadow, mode, guest_pc, i, addr);
    };
    let access = match form {
        Form::Load(..) => Access::Read,
        Form::Store(_) => Access::Write,
    };
    let mut sh = shadow.borrow_mut();
    let failure = |error| RunError::Shadow {
        rip: guest_pc.0,
        error,
    };
    let (pa, ptr) = match own_frame(&mut sh, addr, size, access, mode).map_err(failure)? {
        Ok(frame) => frame,
        Err(f) => return Ok(Some(Action::Reflect(f))),
    };
    match form {
        Form::Load(r, signed) => {
            let mut b = [0u8; 8];
            // SAFETY: `ptr..ptr+size` is guest RAM in the physmap (`guest_ptr` checked it).
            unsafe { core::ptr::copy_nonoverlapping(ptr, b.as_mut_ptr(), size) };
            let mut v = u64::from_le_bytes(b);
            if signed && size < 8 {
                let shift = 64 - 8 * size as u32;
                v = (((v << shift) as i64) >> shift) as u64;
            }
            set_register(engine.regs_mut(), r, v);
        }
        Form::Store(v) => {
            write_frame(&mut sh, pa, ptr, &v.to_le_bytes()[..size]).map_err(failure)?;
        }
    }
    sh.counters.zone_emulations += 1;
    Ok(Some(Action::Resume(GuestVirt(i.next_ip()))))
}

/// `i` run natively with its operand (at `addr`, on one or two pages) redirected to a
/// copy of the guest's bytes (`guest_engine::redirect`); `Ok(None)` if `i` does not
/// qualify.
fn redirect(
    engine: &mut Engine,
    shadow: &RefCell<Shadow>,
    mode: Mode,
    guest_pc: GuestVirt,
    i: &Instruction,
    addr: u64,
) -> Result<Option<Action>, RunError> {
    let mut factory = InstructionInfoFactory::new();
    let Some(size) = redirectable(&mut factory, i) else {
        return Ok(stack_or_string(engine, shadow, mode, i, addr));
    };
    let writes = factory.info(i).used_memory().iter().any(|m| {
        matches!(
            m.access(),
            OpAccess::Write | OpAccess::CondWrite | OpAccess::ReadWrite | OpAccess::ReadCondWrite
        )
    });
    let access = if writes { Access::Write } else { Access::Read };
    let failure = |error| RunError::Shadow {
        rip: guest_pc.0,
        error,
    };
    // The operand's pieces on its (at most two) pages: (guest-physical, offset, length).
    let first = size.min((0x1000 - (addr & 0xfff)) as usize);
    let pieces = [
        (addr, 0, first),
        (addr.wrapping_add(first as u64), first, size - first),
    ];
    let mut frames = [None; 2];
    let mut data = [0u8; REDIRECT_MAX_BYTES];
    {
        let mut sh = shadow.borrow_mut();
        for (k, &(va, off, len)) in pieces.iter().enumerate().filter(|(_, p)| p.2 != 0) {
            let (pa, ptr) = match own_frame(&mut sh, va, len, access, mode).map_err(failure)? {
                Ok(frame) => frame,
                Err(f) => return Ok(Some(Action::Reflect(f))),
            };
            // SAFETY: `ptr..ptr+len` is guest RAM in the physmap (`guest_ptr` checked it).
            unsafe { core::ptr::copy_nonoverlapping(ptr, data[off..].as_mut_ptr(), len) };
            frames[k] = Some((pa, ptr, off, len));
        }
    }
    let ran = engine
        .run_redirected(i, addr, &mut data[..size])
        .map_err(|error| RunError::ZoneAccess {
            rip: guest_pc.0,
            error,
        })?;
    if ran == Redirected::Fault {
        let (vector, error) = entry::take_cache_fault();
        return Ok(Some(Action::Reflect(GuestFault {
            vector: vector as u8,
            error_code: error as u32,
            cr2: GuestVirt(addr),
        })));
    }
    let mut sh = shadow.borrow_mut();
    if writes {
        for (pa, ptr, off, len) in frames.into_iter().flatten() {
            write_frame(&mut sh, pa, ptr, &data[off..off + len]).map_err(failure)?;
        }
    }
    sh.counters.zone_emulations += 1;
    Ok(Some(Action::Resume(GuestVirt(i.next_ip()))))
}

/// The guest frame behind `va` (`len` bytes within its page) as the guest's own tables map
/// it for `access` at the virtual CPL of `mode`, and its physmap address; the guest's fault
/// if they do not allow the access (or name no RAM).
fn own_frame(
    sh: &mut Shadow,
    va: u64,
    len: usize,
    access: Access,
    mode: Mode,
) -> Result<Result<(GuestPhys, *mut u8), GuestFault>, guest_engine::shadow_mmu::ShadowError> {
    let pa = match sh.translate_reserved(va, access, view_of(mode))? {
        Ok(pa) => pa,
        Err(f) => return Ok(Err(f)),
    };
    Ok(match sh.mem().guest_ptr(pa.0, len) {
        Some(ptr) => Ok((pa, ptr)),
        None => Err(GuestFault::page_fault(GuestVirt(va), 0)),
    })
}

/// Writes `bytes` to the guest frame `pa` at `ptr` (its physmap address, checked by
/// `guest_ptr`); a code frame's translations are listed for invalidation first.
fn write_frame(
    sh: &mut Shadow,
    pa: GuestPhys,
    ptr: *mut u8,
    bytes: &[u8],
) -> Result<(), guest_engine::shadow_mmu::ShadowError> {
    if sh.is_code_frame(pa) {
        sh.code_frame_written(pa)?;
    }
    // SAFETY: `ptr..ptr+len` is guest RAM in the physmap (`guest_ptr` checked it); the
    // frame's translations are invalidated before guest code runs again
    // (`Shadow::take_work`).
    unsafe { core::ptr::copy_nonoverlapping(bytes.as_ptr(), ptr, bytes.len()) };
    Ok(())
}

/// `movs`/`stos`/`lods` (element by element, as for a store into its own code frame) and the
/// common stack operations (`push`, `pop`, `call rel32`, `ret`) with an operand in the
/// zone, performed through the guest's tables (`Shadow::access` walks them there);
/// `None` for anything else.
fn stack_or_string(
    engine: &mut Engine,
    shadow: &RefCell<Shadow>,
    mode: Mode,
    i: &Instruction,
    addr: u64,
) -> Option<Action> {
    let mem = ShadowedMemory::new(shadow);
    let string = crate::run::cache_page_fault::emulate_string(engine, &mem, mode, i)
        .or_else(|| emulate_compare_string(engine, &mem, mode, i));
    if let Some(done) = string {
        shadow.borrow_mut().counters.zone_emulations += 1;
        return Some(done);
    }
    let regs = engine.regs_mut();
    let rsp = regs.get(Gpr::Rsp);
    let next = GuestVirt(i.next_ip());
    let push = |regs: &mut GuestRegs, v: u64, then: GuestVirt| {
        let at = rsp.wrapping_sub(8);
        match mem.try_write_virt(at, mode, &v.to_le_bytes()) {
            Ok(()) => {
                regs.set(Gpr::Rsp, at);
                Action::Resume(then)
            }
            Err(f) => Action::Reflect(f),
        }
    };
    let pop = |regs: &mut GuestRegs, extra: u64| -> Result<u64, Action> {
        let mut b = [0u8; 8];
        mem.try_read_virt(rsp, mode, &mut b)
            .map_err(Action::Reflect)?;
        regs.set(Gpr::Rsp, rsp.wrapping_add(8 + extra));
        Ok(u64::from_le_bytes(b))
    };
    let done = match i.code() {
        Code::Push_r64 => {
            let v = register_value(regs, i.op0_register())?;
            push(regs, v, next)
        }
        Code::Pushq_imm32 | Code::Pushq_imm8 => push(regs, i.immediate(0), next),
        Code::Call_rel32_64 => push(regs, next.0, GuestVirt(i.near_branch_target())),
        Code::Pop_r64 => match pop(regs, 0) {
            Ok(v) => {
                set_register(regs, i.op0_register(), v);
                Action::Resume(next)
            }
            Err(a) => a,
        },
        // Through a memory operand (a function-pointer table in the zone, or the stack
        // there): the operand is read first, as the CPU does. `addr` may be the stack's
        // address; the operand's own comes from the registers (no FS/GS: not handled).
        Code::Call_rm64 | Code::Jmp_rm64 | Code::Push_rm64 if i.op0_kind() == OpKind::Memory => {
            let at = operand_address(i, regs)?;
            let mut b = [0u8; 8];
            match mem.try_read_virt(at, mode, &mut b) {
                Err(f) => Action::Reflect(f),
                Ok(()) => {
                    let v = u64::from_le_bytes(b);
                    match i.code() {
                        Code::Jmp_rm64 => Action::Resume(GuestVirt(v)),
                        Code::Call_rm64 => push(regs, next.0, GuestVirt(v)),
                        _ => push(regs, v, next),
                    }
                }
            }
        }
        Code::Xlat_m8 => {
            // al = [rbx + al]
            let mut b = [0u8; 1];
            match mem.try_read_virt(addr, mode, &mut b) {
                Err(f) => Action::Reflect(f),
                Ok(()) => {
                    set_register(regs, Register::AL, u64::from(b[0]));
                    Action::Resume(next)
                }
            }
        }
        Code::Leaveq => {
            // mov rsp, rbp; pop rbp
            let rbp = regs.get(Gpr::Rbp);
            let mut b = [0u8; 8];
            match mem.try_read_virt(rbp, mode, &mut b) {
                Err(f) => Action::Reflect(f),
                Ok(()) => {
                    regs.set(Gpr::Rsp, rbp.wrapping_add(8));
                    regs.set(Gpr::Rbp, u64::from_le_bytes(b));
                    Action::Resume(next)
                }
            }
        }
        Code::Retnq | Code::Retnq_imm16 => {
            let extra = if i.code() == Code::Retnq_imm16 {
                u64::from(i.immediate16())
            } else {
                0
            };
            match pop(regs, extra) {
                Ok(v) => Action::Resume(GuestVirt(v)),
                Err(a) => a,
            }
        }
        _ => return None,
    };
    shadow.borrow_mut().counters.zone_emulations += 1;
    Some(done)
}

/// `cmps`/`scas` (byte … quadword, `repe`/`repne` or none, 64-bit addressing, no segment
/// override but DS) element by element, each comparison's flags computed as `cmp` sets
/// them; `None` for anything else.
fn emulate_compare_string(
    engine: &mut Engine,
    mem: &ShadowedMemory<'_>,
    mode: Mode,
    i: &Instruction,
) -> Option<Action> {
    let (size, cmps) = match i.code() {
        Code::Cmpsb_m8_m8 => (1, true),
        Code::Cmpsw_m16_m16 => (2, true),
        Code::Cmpsd_m32_m32 => (4, true),
        Code::Cmpsq_m64_m64 => (8, true),
        Code::Scasb_AL_m8 => (1, false),
        Code::Scasw_AX_m16 => (2, false),
        Code::Scasd_EAX_m32 => (4, false),
        Code::Scasq_RAX_m64 => (8, false),
        _ => return None,
    };
    let forms_ok = if cmps {
        i.op0_kind() == OpKind::MemorySegRSI
            && i.op1_kind() == OpKind::MemoryESRDI
            && matches!(i.segment_prefix(), Register::None | Register::DS)
    } else {
        i.op1_kind() == OpKind::MemoryESRDI
    };
    if !forms_ok {
        return None;
    }
    let (repe, repne) = (i.has_repe_prefix(), i.has_repne_prefix());
    let regs = engine.regs_mut();
    let step = if regs.rflags & (1 << 10) != 0 {
        (size as u64).wrapping_neg()
    } else {
        size as u64
    };
    let read = |va: u64| -> Result<u64, GuestFault> {
        let mut b = [0u8; 8];
        mem.try_read_virt(va, mode, &mut b[..size])?;
        Ok(u64::from_le_bytes(b))
    };
    loop {
        if (repe || repne) && regs.get(Gpr::Rcx) == 0 {
            break;
        }
        let a = if cmps {
            read(regs.get(Gpr::Rsi))
        } else {
            Ok(regs.get(Gpr::Rax))
        };
        let (a, b) = match (a, read(regs.get(Gpr::Rdi))) {
            (Ok(a), Ok(b)) => (a, b),
            (Err(f), _) | (_, Err(f)) => return Some(Action::Reflect(f)),
        };
        regs.rflags = sub_flags(regs.rflags, a, b, size);
        if cmps {
            regs.set(Gpr::Rsi, regs.get(Gpr::Rsi).wrapping_add(step));
        }
        regs.set(Gpr::Rdi, regs.get(Gpr::Rdi).wrapping_add(step));
        if !(repe || repne) {
            break;
        }
        regs.set(Gpr::Rcx, regs.get(Gpr::Rcx) - 1);
        let zf = regs.rflags & (1 << 6) != 0;
        if (repe && !zf) || (repne && zf) {
            break;
        }
    }
    Some(Action::Resume(GuestVirt(i.next_ip())))
}

/// RFLAGS with CF, PF, AF, ZF, SF and OF as `cmp` of the `size`-byte values `a` and `b`
/// sets them.
fn sub_flags(rflags: u64, a: u64, b: u64, size: usize) -> u64 {
    let bits = 8 * size as u32;
    let mask = if bits == 64 {
        u64::MAX
    } else {
        (1u64 << bits) - 1
    };
    let (a, b) = (a & mask, b & mask);
    let r = a.wrapping_sub(b) & mask;
    let sign = 1u64 << (bits - 1);
    let mut f = rflags & !0x8d5;
    for (set, bit) in [
        (a < b, 0),
        ((r as u8).count_ones().is_multiple_of(2), 2),
        ((a ^ b ^ r) & 0x10 != 0, 4),
        (r == 0, 6),
        (r & sign != 0, 7),
        ((a ^ b) & (a ^ r) & sign != 0, 11),
    ] {
        if set {
            f |= 1 << bit;
        }
    }
    f
}

/// The linear address of `i`'s explicit memory operand 0 from the guest registers, if it
/// has no FS/GS segment base.
fn operand_address(i: &Instruction, regs: &GuestRegs) -> Option<u64> {
    i.virtual_address(0, 0, |r, _, _| match r {
        Register::ES | Register::CS | Register::SS | Register::DS => Some(0),
        r if r.is_gpr() => {
            let bits = 8 * r.size() as u32;
            register_value(regs, r).map(|v| v & (u64::MAX >> (64 - bits)))
        }
        _ => None,
    })
}

/// The handled form of `i`, if any.
fn form_of(i: &Instruction, regs: &GuestRegs) -> Option<Form> {
    match i.code() {
        Code::Mov_r8_rm8 | Code::Mov_r16_rm16 | Code::Mov_r32_rm32 | Code::Mov_r64_rm64
            if i.op1_kind() == OpKind::Memory =>
        {
            Some(Form::Load(i.op0_register(), false))
        }
        Code::Movzx_r16_rm8
        | Code::Movzx_r32_rm8
        | Code::Movzx_r64_rm8
        | Code::Movzx_r16_rm16
        | Code::Movzx_r32_rm16
        | Code::Movzx_r64_rm16
            if i.op1_kind() == OpKind::Memory =>
        {
            Some(Form::Load(i.op0_register(), false))
        }
        Code::Movsx_r16_rm8
        | Code::Movsx_r32_rm8
        | Code::Movsx_r64_rm8
        | Code::Movsx_r16_rm16
        | Code::Movsx_r32_rm16
        | Code::Movsx_r64_rm16
        | Code::Movsxd_r64_rm32
            if i.op1_kind() == OpKind::Memory =>
        {
            Some(Form::Load(i.op0_register(), true))
        }
        Code::Mov_rm8_r8 | Code::Mov_rm16_r16 | Code::Mov_rm32_r32 | Code::Mov_rm64_r64
            if i.op0_kind() == OpKind::Memory =>
        {
            register_value(regs, i.op1_register()).map(Form::Store)
        }
        Code::Mov_rm8_imm8 | Code::Mov_rm16_imm16 | Code::Mov_rm32_imm32 | Code::Mov_rm64_imm32
            if i.op0_kind() == OpKind::Memory =>
        {
            Some(Form::Store(i.immediate(1)))
        }
        _ => None,
    }
}

/// The full GPR behind `r` and where `r` lies in it (AH…BH: bits 15:8).
fn gpr_of(r: Register) -> Option<(Gpr, bool)> {
    let full = r.full_register();
    let g = Gpr::from_number(full.number() as u8).filter(|_| full.is_gpr64())?;
    let high = matches!(r, Register::AH | Register::CH | Register::DH | Register::BH);
    Some((g, high))
}

/// The value of a general-purpose register operand.
pub(crate) fn register_value(regs: &GuestRegs, r: Register) -> Option<u64> {
    let (g, high) = gpr_of(r)?;
    let v = regs.get(g);
    Some(if high { v >> 8 } else { v })
}

/// Writes `v` to the register operand `r` as a `mov` does: 8/16-bit writes keep the
/// other bits, 32-bit ones zero the upper half.
pub(crate) fn set_register(regs: &mut GuestRegs, r: Register, v: u64) {
    let Some((g, high)) = gpr_of(r) else {
        return;
    };
    let old = regs.get(g);
    let new = match (r.size(), high) {
        (1, true) => (old & !0xff00) | ((v & 0xff) << 8),
        (1, false) => (old & !0xff) | (v & 0xff),
        (2, _) => (old & !0xffff) | (v & 0xffff),
        (4, _) => v & 0xffff_ffff,
        _ => v,
    };
    regs.set(g, new);
}
