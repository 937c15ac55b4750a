//! The virtual RFLAGS.IF, IOPL and TF: `cli`/`sti` (#GP(0) when CPL > IOPL), `pushfq`
//! (the guest's image of RFLAGS), `popfq` (IOPL only at CPL 0, IF only at CPL ≤ IOPL, as
//! hardware silently ignores them otherwise; TF at any CPL). The real IF stays 1 and the
//! real IOPL 0 while guest code runs; TF is never set in the real RFLAGS: a virtual TF
//! makes the translation mode a stepping one ([`super::Vcpu::mode`]), in which the engine
//! runs one guest instruction at a time and the run loop raises the single-step #DB.

use iced_x86::Instruction;
use kpin_abi::x86::rflags;

use super::emulate::{gp0, Flow, Step};
use super::hardware::{GuestMmu, Hardware};
use super::Vcpu;
use crate::{Gpr, GuestRegs, GuestVirt};

impl<H: Hardware, M: GuestMmu> Vcpu<'_, H, M> {
    /// The RFLAGS the guest sees: the real arithmetic flags with the virtual IF, IOPL and
    /// TF (RF and VM clear).
    pub fn rflags_image(&self, real: u64) -> u64 {
        (real & !(rflags::IF | rflags::IOPL | rflags::RF | rflags::VM | rflags::TF))
            | (u64::from(self.vif) << 9)
            | (u64::from(self.tf) << 8)
            | (u64::from(self.iopl) << 12)
    }

    /// Loads RFLAGS from a guest value (`popfq`, `iretq`, `sysretq`) as an instruction
    /// executed at `cpl` may: IOPL only at CPL 0, IF at CPL ≤ IOPL. Re-arms the attention
    /// byte if IF became 1 with an interrupt pending. (`iret` is true for `iretq`, which
    /// also loads RF.)
    pub fn load_rflags(&mut self, regs: &mut GuestRegs, value: u64, cpl: u8, iret: bool) {
        let was = self.vif;
        if cpl == 0 {
            self.iopl = ((value & rflags::IOPL) >> 12) as u8;
        }
        if cpl <= self.iopl {
            self.vif = value & rflags::IF != 0;
        }
        self.tf = value & rflags::TF != 0;
        let keep = rflags::LOADABLE & !(rflags::IF | rflags::IOPL | rflags::TF);
        let rf = if iret { value & rflags::RF } else { 0 };
        regs.rflags = (value & keep) | rf | rflags::FIXED | rflags::IF;
        if self.vif && !was {
            self.hw.rearm_attention();
        }
    }

    /// `cli`.
    pub(super) fn cli(&mut self, _i: &Instruction, _regs: &mut GuestRegs, next: GuestVirt) -> Step {
        if self.cpl() > self.iopl {
            return Err(gp0());
        }
        self.vif = false;
        Ok(Flow::Continue(next))
    }

    /// `sti`. The interrupt shadow, approximated: `sti; hlt` delivers from the `hlt` (RIP
    /// after it, as hardware does); any other instruction after `sti` may see the
    /// interrupt before it runs (no one-instruction shadow).
    pub(super) fn sti(&mut self, _i: &Instruction, _regs: &mut GuestRegs, next: GuestVirt) -> Step {
        if self.cpl() > self.iopl {
            return Err(gp0());
        }
        let was = self.vif;
        self.vif = true;
        self.sti_next = Some(next.0);
        let mut b = [0u8; 1];
        let user = self.cpl() == 3;
        let hlt_next = self.mem.read(next.0, user, &mut b).is_ok() && b[0] == 0xf4;
        if !was && !hlt_next {
            self.hw.rearm_attention();
        }
        Ok(Flow::Continue(next))
    }

    /// `pushfq`/`pushfd` (8 or 4 bytes of the guest's RFLAGS image).
    pub(super) fn pushfq(
        &mut self,
        i: &Instruction,
        regs: &mut GuestRegs,
        next: GuestVirt,
    ) -> Step {
        let image = self.rflags_image(regs.rflags).to_le_bytes();
        let size = i.stack_pointer_increment().unsigned_abs() as usize;
        self.push_bytes(regs, &image[..size])?;
        Ok(Flow::Continue(next))
    }

    /// `popfq`/`popfd`.
    pub(super) fn popfq(&mut self, i: &Instruction, regs: &mut GuestRegs, next: GuestVirt) -> Step {
        let size = i.stack_pointer_increment().unsigned_abs() as usize;
        let mut b = [0u8; 8];
        let rsp = self.peek_stack(regs, &mut b[..size])?;
        let cpl = self.cpl();
        // A 32-bit popfd keeps the upper half of RFLAGS (all zero).
        self.load_rflags(regs, u64::from_le_bytes(b), cpl, false);
        regs.set(Gpr::Rsp, rsp);
        Ok(Flow::Continue(next))
    }
}
