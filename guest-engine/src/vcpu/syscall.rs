//! Privilege transitions and base registers that are not delivery: `syscall`, `sysretq`,
//! `swapgs`, `rd/wr{fs,gs}base`, and keeping the hardware FS/GS bases equal to the
//! guest's virtual ones.
//!
//! Translated code executes `fs:`/`gs:` accesses verbatim at CPL 3, so whenever guest
//! code runs the real FS and GS bases must be the guest's. They are switched on every
//! change (wrmsr FS/GS_BASE, swapgs, wr{fs,gs}base, a base-changing segment load) with
//! `wrfsbase`/`wrgsbase` at CPL 3 — `_start` enables CR4.FSGSBASE when CPUID 7.EBX[0] says
//! the CPU has it — or else the gate's WRMSR. Measured at bring-up here: 8 ns per switch
//! against ~64 µs through the gate (a guest kernel `swapgs`es on every entry from user
//! mode).

use guest_engine::{Gpr, GuestRegs};
use kpin_abi::attach::Segment;

use crate::deliver::{rflags, Event, UD};
use crate::gate;
use crate::msr::{index, EFER_SCE};
use crate::segments::{Sreg, GP};
use crate::vcpu::Vcpu;

/// CR4.FSGSBASE.
const CR4_FSGSBASE: u64 = 1 << 16;

fn canonical(v: u64) -> bool {
    ((v as i64) << 16 >> 16) as u64 == v
}

fn gp0() -> Event {
    Event::fault(GP, 0)
}

/// A flat segment cache as `syscall`/`sysret` load it (they read no descriptor).
fn flat(selector: u16, code: bool, dpl: u8) -> Segment {
    Segment {
        base: 0,
        limit: 0xffff_ffff,
        selector,
        type_: if code { 0xb } else { 0x3 },
        present: 1,
        dpl,
        db: u8::from(!code),
        s: 1,
        l: u8::from(code),
        g: 1,
        avl: 0,
        unusable: 0,
        pad: 0,
    }
}

/// Writes the hardware FS (`fs` true) or GS base: `wrfsbase`/`wrgsbase` when `_start`
/// enabled CR4.FSGSBASE, else the gate's WRMSR.
pub fn set_hw_base(fs: bool, base: u64) {
    // SAFETY: written once by `_start` at ring 0 before any CPL-3 code ran.
    if unsafe { core::ptr::read_volatile(&raw const crate::entry::kpin_fsgsbase) } != 0 {
        // SAFETY: CR4.FSGSBASE is set, so these are allowed at CPL 3; the engine uses
        // neither FS nor GS (no TLS, the ring-0 stubs never `swapgs`); `base` is
        // canonical (checked by every caller), so they cannot fault.
        unsafe {
            if fs {
                core::arch::asm!("wrfsbase {}", in(reg) base, options(nostack, preserves_flags));
            } else {
                core::arch::asm!("wrgsbase {}", in(reg) base, options(nostack, preserves_flags));
            }
        }
        return;
    }
    let i = if fs { index::FS_BASE } else { index::GS_BASE };
    // SAFETY: as above, the bases belong to the guest; a canonical value cannot fault
    // the ring-0 WRMSR.
    unsafe { gate::wrmsr(i, base) };
}

/// Makes the hardware FS/GS bases the guest's (at the start of the run).
pub fn sync_hw_bases(v: &Vcpu<'_>) {
    set_hw_base(true, v.segs.sregs[Sreg::Fs as usize].base);
    set_hw_base(false, v.segs.sregs[Sreg::Gs as usize].base);
}

/// `syscall` (64-bit): RCX = `next`, R11 = RFLAGS, RFLAGS &= !SFMASK (the virtual IF and
/// IOPL too), CS/SS from STAR[47:32], CPL 0, RIP = LSTAR. #UD if EFER.SCE is clear.
pub fn syscall(v: &mut Vcpu<'_>, regs: &mut GuestRegs, next: u64) -> Result<u64, Event> {
    if v.msrs.efer & EFER_SCE == 0 {
        return Err(Event::exception(UD));
    }
    let old_cpl = v.cpl();
    regs.set(Gpr::Rcx, next);
    regs.set(Gpr::R11, v.rflags_image(regs.rflags));
    let mask = v.msrs.sfmask;
    if mask & rflags::IF != 0 {
        v.vif = false;
    }
    v.iopl &= !((mask >> 12) & 3) as u8;
    regs.rflags &= !(mask & !(rflags::IF | rflags::IOPL)) & !rflags::RF;
    let sel = ((v.msrs.star >> 32) & 0xfffc) as u16;
    v.segs.sregs[Sreg::Cs as usize] = flat(sel, true, 0);
    v.segs.sregs[Sreg::Ss as usize] = flat(sel + 8, false, 0);
    v.cpl_changed(old_cpl);
    Ok(v.msrs.lstar)
}

/// `sysretq`: #GP(0) unless at CPL 0 with a canonical RCX; CS = STAR[63:48] + 16 | 3,
/// SS = STAR[63:48] + 8 | 3, RFLAGS from R11, CPL 3, RIP = RCX.
pub fn sysretq(v: &mut Vcpu<'_>, regs: &mut GuestRegs) -> Result<u64, Event> {
    let old_cpl = v.cpl();
    let rip = regs.get(Gpr::Rcx);
    if old_cpl != 0 || !canonical(rip) {
        return Err(gp0());
    }
    let base = ((v.msrs.star >> 48) & 0xfffc) as u16;
    v.segs.sregs[Sreg::Cs as usize] = flat((base + 16) | 3, true, 3);
    v.segs.sregs[Sreg::Ss as usize] = flat((base + 8) | 3, false, 3);
    v.load_rflags(regs, regs.get(Gpr::R11), 0, false);
    v.cpl_changed(old_cpl);
    Ok(rip)
}

/// `swapgs`: exchanges GS base and KERNEL_GS_BASE (#GP(0) above CPL 0).
pub fn swapgs(v: &mut Vcpu<'_>) -> Result<(), Event> {
    if v.cpl() != 0 {
        return Err(gp0());
    }
    let gs = &mut v.segs.sregs[Sreg::Gs as usize].base;
    core::mem::swap(gs, &mut v.msrs.kernel_gs_base);
    set_hw_base(false, *gs);
    Ok(())
}

/// `rdfsbase`/`rdgsbase`: #UD unless the guest set CR4.FSGSBASE.
pub fn read_base(v: &Vcpu<'_>, fs: bool) -> Result<u64, Event> {
    if v.cr4 & CR4_FSGSBASE == 0 {
        return Err(Event::exception(UD));
    }
    let r = if fs { Sreg::Fs } else { Sreg::Gs };
    Ok(v.segs.sregs[r as usize].base)
}

/// `wrfsbase`/`wrgsbase`: #UD unless CR4.FSGSBASE, #GP(0) for a non-canonical base.
pub fn write_base(v: &mut Vcpu<'_>, fs: bool, base: u64) -> Result<(), Event> {
    if v.cr4 & CR4_FSGSBASE == 0 {
        return Err(Event::exception(UD));
    }
    if !canonical(base) {
        return Err(gp0());
    }
    let r = if fs { Sreg::Fs } else { Sreg::Gs };
    v.segs.sregs[r as usize].base = base;
    set_hw_base(fs, base);
    Ok(())
}
