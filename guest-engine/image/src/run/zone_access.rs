//! Guest accesses to the reserved zone (PML4 slots 256–259) that the guest maps itself.
//!
//! The engine owns those slots in every shadow root (its window, the physmap, the
//! guards), so a guest mapping of its own there can never be installed; the isolation
//! check traps the access instead (`guest_engine::isolation`). When the guest's tables
//! allow the access, the common forms are performed here on the guest's own frame
//! (through the physmap) and the guest continues after the instruction: plain `mov`
//! loads and stores (register or immediate) and `movzx`/`movsx`/`movsxd` loads, within
//! one page. Anything else (other
//! instructions, an access crossing a page) still ends the run naming the slot.

use core::cell::RefCell;

use guest_engine::shadow_mmu::{Access, GuestFault};
use guest_engine::{Engine, Gpr, GuestRegs, GuestVirt, Mode};
use iced_x86::{Code, Instruction, OpKind, Register};

use crate::mm::guest_memory::view_of;
use crate::mm::shadow::Shadow;
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
/// `addr` in the reserved zone (`isolation::classify_fault` computed it: a `mov` has one
/// memory operand), on the guest's own frame: `Ok(Some(action))` when done
/// (or when the guest takes a fault), `Ok(None)` when `i` is not a form handled here.
pub fn emulate(
    engine: &mut Engine,
    shadow: &RefCell<Shadow>,
    mode: Mode,
    guest_pc: GuestVirt,
    i: &Instruction,
    addr: u64,
) -> Result<Option<Action>, RunError> {
    let regs = *engine.regs();
    let Some(form) = form_of(i, &regs) else {
        return Ok(None);
    };
    let size = i.memory_size().size();
    let page_end = (addr | 0xfff).wrapping_add(1);
    if size == 0 || size > 8 || addr.wrapping_add(size as u64) > page_end && page_end != 0 {
        return Ok(None);
    }
    let access = match form {
        Form::Load(..) => Access::Read,
        Form::Store(_) => Access::Write,
    };
    let mut sh = shadow.borrow_mut();
    let failure = |error| RunError::Shadow {
        rip: guest_pc.0,
        error,
    };
    let pa = match sh
        .translate_reserved(addr, access, view_of(mode))
        .map_err(failure)?
    {
        Ok(pa) => pa,
        Err(f) => return Ok(Some(Action::Reflect(f))),
    };
    let Some(ptr) = sh.mem().guest_ptr(pa.0, size) else {
        return Ok(Some(Action::Reflect(GuestFault::page_fault(
            GuestVirt(addr),
            0,
        ))));
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
            if sh.is_code_frame(pa) {
                sh.code_frame_written(pa).map_err(failure)?;
            }
            // SAFETY: as for the load; the frame's translations are listed for
            // invalidation before guest code runs again (`Shadow::take_work`).
            unsafe { core::ptr::copy_nonoverlapping(v.to_le_bytes().as_ptr(), ptr, size) };
        }
    }
    sh.counters.zone_emulations += 1;
    Ok(Some(Action::Resume(GuestVirt(i.next_ip()))))
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
fn register_value(regs: &GuestRegs, r: Register) -> Option<u64> {
    let (g, high) = gpr_of(r)?;
    let v = regs.get(g);
    Some(if high { v >> 8 } else { v })
}

/// Writes `v` to the register operand `r` as a `mov` does: 8/16-bit writes keep the
/// other bits, 32-bit ones zero the upper half.
fn set_register(regs: &mut GuestRegs, r: Register, v: u64) {
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
