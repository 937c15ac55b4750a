//! Privilege transitions and base registers that are not delivery: `syscall`, `sysretq`,
//! `swapgs`, `rd/wr{fs,gs}base`, and keeping the hardware FS/GS bases equal to the
//! guest's virtual ones.
//!
//! Translated code executes `fs:`/`gs:` accesses verbatim at CPL 3, so whenever guest
//! code runs the real FS and GS bases must be the guest's. They are switched on every
//! change (wrmsr FS/GS_BASE, swapgs, wr{fs,gs}base, a base-changing segment load) through
//! [`Hardware::set_hw_base`] (the image: `wrfsbase`/`wrgsbase` at CPL 3 when the CPU has
//! FSGSBASE, else the gate's WRMSR).

use iced_x86::{Code, Instruction};
use kpin_abi::attach::Segment;
use kpin_abi::x86::{cr4, efer, is_canonical as canonical, rflags};

use super::emulate::{gp0, gpr, Flow, Step};
use super::events::Event;
use super::hardware::{GuestMmu, Hardware};
use super::segments::Sreg;
use super::Vcpu;
use crate::{Gpr, GuestRegs, GuestVirt};

/// A flat segment cache as `syscall`/`sysret` load it (they read no descriptor).
pub(super) fn flat(selector: u16, code: bool, dpl: u8) -> Segment {
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

/// `syscall` (64-bit): RCX = `next`, R11 = RFLAGS, RFLAGS &= !SFMASK (the virtual IF and
/// IOPL too), CS/SS from STAR[47:32], CPL 0, RIP = LSTAR. #UD if EFER.SCE is clear.
fn syscall<H: Hardware, M: GuestMmu>(
    v: &mut Vcpu<'_, H, M>,
    regs: &mut GuestRegs,
    next: u64,
) -> Result<u64, Event> {
    if v.msrs.efer & efer::SCE == 0 {
        return Err(Event::ud());
    }
    let old_cpl = v.cpl();
    // From 32-bit code `syscall` enters at CSTAR (AMD's compatibility-mode entry).
    let target = if v.bitness() == 64 {
        v.msrs.lstar
    } else {
        v.msrs.cstar
    };
    regs.set(Gpr::Rcx, next);
    regs.set(Gpr::R11, v.rflags_image(regs.rflags));
    let mask = v.msrs.sfmask;
    if mask & rflags::IF != 0 {
        v.vif = false;
    }
    v.iopl &= !((mask >> 12) & 3) as u8;
    // The single-step trap after `syscall` follows the TF it leaves (SFMASK clears it
    // for Linux): the kernel entry is not stepped into.
    if mask & rflags::TF != 0 {
        v.step_suppressed |= v.tf;
        v.tf = false;
    }
    // (AC too whatever SFMASK says: the kernel's code runs at hardware CPL 3, see
    // `events.rs`.)
    regs.rflags &= !(mask & !(rflags::IF | rflags::IOPL)) & !(rflags::RF | rflags::AC);
    let sel = ((v.msrs.star >> 32) & 0xfffc) as u16;
    v.segs.sregs[Sreg::Cs as usize] = flat(sel, true, 0);
    v.segs.sregs[Sreg::Ss as usize] = flat(sel + 8, false, 0);
    v.cpl_changed(old_cpl);
    Ok(target)
}

/// `sysretq`: #GP(0) unless at CPL 0 with a canonical RCX; CS = STAR[63:48] + 16 | 3,
/// SS = STAR[63:48] + 8 | 3, RFLAGS from R11, CPL 3, RIP = RCX. `sysretl` (`wide`
/// false) returns to 32-bit code: CS = STAR[63:48] | 3 (a 32-bit segment), EIP = ECX.
fn sysretq<H: Hardware, M: GuestMmu>(
    v: &mut Vcpu<'_, H, M>,
    regs: &mut GuestRegs,
    wide: bool,
) -> Result<u64, Event> {
    let old_cpl = v.cpl();
    let rip = if wide {
        regs.get(Gpr::Rcx)
    } else {
        regs.get(Gpr::Rcx) & 0xffff_ffff
    };
    if old_cpl != 0 || !canonical(rip) {
        return Err(gp0());
    }
    let base = ((v.msrs.star >> 48) & 0xfffc) as u16;
    v.segs.sregs[Sreg::Cs as usize] = if wide {
        flat((base + 16) | 3, true, 3)
    } else {
        let mut cs = flat(base | 3, true, 3);
        (cs.l, cs.db) = (0, 1);
        cs
    };
    v.segs.sregs[Sreg::Ss as usize] = flat((base + 8) | 3, false, 3);
    v.load_rflags(regs, regs.get(Gpr::R11), 0, false);
    v.cpl_changed(old_cpl);
    Ok(rip)
}

/// `swapgs`: exchanges GS base and KERNEL_GS_BASE (#GP(0) above CPL 0).
fn swapgs<H: Hardware, M: GuestMmu>(v: &mut Vcpu<'_, H, M>) -> Result<(), Event> {
    if v.cpl() != 0 {
        return Err(gp0());
    }
    let gs = &mut v.segs.sregs[Sreg::Gs as usize].base;
    core::mem::swap(gs, &mut v.msrs.kernel_gs_base);
    let base = *gs;
    v.hw.set_hw_base(false, base);
    Ok(())
}

/// `rdfsbase`/`rdgsbase`: #UD unless the guest set CR4.FSGSBASE.
fn read_base<H: Hardware, M: GuestMmu>(v: &Vcpu<'_, H, M>, fs: bool) -> Result<u64, Event> {
    if v.cr4 & cr4::FSGSBASE == 0 {
        return Err(Event::ud());
    }
    let r = if fs { Sreg::Fs } else { Sreg::Gs };
    Ok(v.segs.sregs[r as usize].base)
}

/// `wrfsbase`/`wrgsbase`: #UD unless CR4.FSGSBASE, #GP(0) for a non-canonical base.
fn write_base<H: Hardware, M: GuestMmu>(
    v: &mut Vcpu<'_, H, M>,
    fs: bool,
    base: u64,
) -> Result<(), Event> {
    if v.cr4 & cr4::FSGSBASE == 0 {
        return Err(Event::ud());
    }
    if !canonical(base) {
        return Err(gp0());
    }
    let r = if fs { Sreg::Fs } else { Sreg::Gs };
    v.segs.sregs[r as usize].base = base;
    v.hw.set_hw_base(fs, base);
    Ok(())
}

impl<H: Hardware, M: GuestMmu> Vcpu<'_, H, M> {
    /// `syscall`.
    pub(super) fn syscall(
        &mut self,
        _i: &Instruction,
        regs: &mut GuestRegs,
        next: GuestVirt,
    ) -> Step {
        let rip = syscall(self, regs, next.0)?;
        Ok(Flow::Continue(GuestVirt(rip)))
    }

    /// `sysretq`/`sysretl`.
    pub(super) fn sysretq(
        &mut self,
        i: &Instruction,
        regs: &mut GuestRegs,
        _next: GuestVirt,
    ) -> Step {
        let rip = sysretq(self, regs, i.code() == Code::Sysretq)?;
        Ok(Flow::Continue(GuestVirt(rip)))
    }

    /// `swapgs`.
    pub(super) fn swapgs(
        &mut self,
        _i: &Instruction,
        _regs: &mut GuestRegs,
        next: GuestVirt,
    ) -> Step {
        swapgs(self)?;
        Ok(Flow::Continue(next))
    }

    /// `rdfsbase`/`rdgsbase`.
    pub(super) fn rd_base(
        &mut self,
        i: &Instruction,
        regs: &mut GuestRegs,
        next: GuestVirt,
    ) -> Step {
        let v = read_base(self, i.code() == Code::Rdfsbase_r64)?;
        if let Some(r) = gpr(i.op0_register()) {
            regs.set(r, v);
        }
        Ok(Flow::Continue(next))
    }

    /// `wrfsbase`/`wrgsbase`.
    pub(super) fn wr_base(
        &mut self,
        i: &Instruction,
        regs: &mut GuestRegs,
        next: GuestVirt,
    ) -> Step {
        let v = gpr(i.op0_register()).map_or(0, |r| regs.get(r));
        write_base(self, i.code() == Code::Wrfsbase_r64, v)?;
        Ok(Flow::Continue(next))
    }

    /// Makes the hardware FS/GS bases the guest's (at the start of the run).
    pub(super) fn sync_hw_bases(&mut self) {
        let (fs, gs) = (
            self.segs.sregs[Sreg::Fs as usize].base,
            self.segs.sregs[Sreg::Gs as usize].base,
        );
        self.hw.set_hw_base(true, fs);
        self.hw.set_hw_base(false, gs);
    }
}
