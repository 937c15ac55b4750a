//! The rest: `cpuid` from the attach block's table (so native and instrumented runs see
//! one CPU; #GP(0) at CPL > 0 with CPUID faulting on), `wbinvd`/`invd` (caches are
//! invisible to a guest in a VM: nothing to do), `xgetbv`/`xsetbv` (#UD: CPUID hides
//! XSAVE, so CR4.OSXSAVE can never be set), `rdtscp`/`rdpid` (#UD unless the CPUID table
//! offers them; TSC_AUX from the MSR file), and `hlt` (at CPL 0 with the virtual IF = 1:
//! wait until an interrupt is pending, then deliver it with RIP after the `hlt`; with
//! IF = 0 the run ends).

use iced_x86::{Instruction, Mnemonic};
use kpin_abi::x86::cr4;

use super::emulate::{gp0, gpr, Flow, Step};
use super::events::Event;
use super::hardware::{GuestMmu, Hardware};
use super::{Vcpu, VcpuStop};
use crate::{Gpr, GuestRegs, GuestVirt};

impl<H: Hardware, M: GuestMmu> Vcpu<'_, H, M> {
    /// `cpuid`.
    pub(super) fn cpuid(
        &mut self,
        _i: &Instruction,
        regs: &mut GuestRegs,
        next: GuestVirt,
    ) -> Step {
        if self.cpl() != 0 && self.msrs.misc_features & 1 != 0 {
            return Err(gp0());
        }
        let [a, b, c, d] = self
            .block
            .cpuid(regs.get(Gpr::Rax) as u32, regs.get(Gpr::Rcx) as u32);
        regs.set(Gpr::Rax, u64::from(a));
        regs.set(Gpr::Rbx, u64::from(b));
        regs.set(Gpr::Rcx, u64::from(c));
        regs.set(Gpr::Rdx, u64::from(d));
        self.stats.cpuids += 1;
        Ok(Flow::Continue(next))
    }

    /// `wbinvd`/`invd`.
    pub(super) fn cache_control(
        &mut self,
        _i: &Instruction,
        _regs: &mut GuestRegs,
        next: GuestVirt,
    ) -> Step {
        Ok(Flow::Continue(next))
    }

    /// `xgetbv`/`xsetbv`: #UD (CR4.OSXSAVE is never set).
    pub(super) fn xcr(
        &mut self,
        _i: &Instruction,
        _regs: &mut GuestRegs,
        _next: GuestVirt,
    ) -> Step {
        Err(Event::ud())
    }

    /// `rdtsc`: EDX:EAX = TSC; #GP(0) at CPL > 0 under CR4.TSD (the only case that
    /// leaves translated code).
    pub(super) fn rdtsc(
        &mut self,
        _i: &Instruction,
        regs: &mut GuestRegs,
        next: GuestVirt,
    ) -> Step {
        if self.cpl() != 0 && self.cr4 & cr4::TSD != 0 {
            return Err(gp0());
        }
        let t = self.hw.tsc();
        regs.set(Gpr::Rax, t & 0xffff_ffff);
        regs.set(Gpr::Rdx, t >> 32);
        Ok(Flow::Continue(next))
    }

    /// `rdtscp`: EDX:EAX = TSC, ECX = TSC_AUX; #UD unless CPUID 0x8000_0001 EDX[27],
    /// #GP(0) at CPL > 0 under CR4.TSD.
    pub(super) fn rdtscp(
        &mut self,
        _i: &Instruction,
        regs: &mut GuestRegs,
        next: GuestVirt,
    ) -> Step {
        if self.block.cpuid(0x8000_0001, 0)[3] & (1 << 27) == 0 {
            return Err(Event::ud());
        }
        if self.cpl() != 0 && self.cr4 & cr4::TSD != 0 {
            return Err(gp0());
        }
        let t = self.hw.tsc();
        regs.set(Gpr::Rax, t & 0xffff_ffff);
        regs.set(Gpr::Rdx, t >> 32);
        regs.set(Gpr::Rcx, self.msrs.tsc_aux & 0xffff_ffff);
        Ok(Flow::Continue(next))
    }

    /// `rdpid r64`: TSC_AUX; #UD unless CPUID 7.ECX[22].
    pub(super) fn rdpid(&mut self, i: &Instruction, regs: &mut GuestRegs, next: GuestVirt) -> Step {
        if self.block.cpuid(7, 0)[2] & (1 << 22) == 0 {
            return Err(Event::ud());
        }
        if let Some(r) = gpr(i.op0_register()) {
            regs.set(r, self.msrs.tsc_aux & 0xffff_ffff);
        }
        Ok(Flow::Continue(next))
    }

    /// `hlt` (CPL 0 checked by the caller).
    pub(super) fn hlt(&mut self, i: &Instruction, regs: &mut GuestRegs, next: GuestVirt) -> Step {
        if !self.vif {
            return Ok(Flow::Stop(VcpuStop::Unsupported {
                mnemonic: Some(Mnemonic::Hlt),
                why: "guest halted with interrupts disabled (nothing can wake it)",
            }));
        }
        loop {
            match self.deliver_pending(regs, next.0) {
                Ok(Some(handler)) => return Ok(Flow::Continue(GuestVirt(handler))),
                // The embedder wants its run loop (a detach): continue at the `hlt`
                // itself, which the guest executes again afterwards (natively or not).
                Ok(None) if self.hw.control_requested() => {
                    return Ok(Flow::Continue(GuestVirt(next.0 - i.len() as u64)));
                }
                Ok(None) => {
                    self.stats.halts += 1;
                    self.hw.halt();
                }
                Err(t) => return Ok(Flow::Stop(VcpuStop::TripleFault(t))),
            }
        }
    }
}
