//! Descriptor-table registers: `lgdt`/`lidt`/`sgdt`/`sidt` on the virtual GDTR/IDTR
//! (the engine's own GDT and IDT are what the CPU uses), `ltr`/`lldt` (16-byte system
//! descriptors from the guest's GDT, `segments.rs`), `str`/`sldt`. `sgdt`/`sidt`/`str`/
//! `sldt` at CPL > 0 are #GP(0) with CR4.UMIP (checked in `emulate.rs`).

use iced_x86::{Code, Instruction, Mnemonic};

use super::emulate::{Flow, Step};
use super::hardware::{GuestMmu, Hardware};
use super::Vcpu;
use crate::{GuestRegs, GuestVirt};

/// A virtual GDTR or IDTR (the attach block's type: the VMM hands them over in it).
pub use kpin_abi::attach::DescriptorTable;

impl<H: Hardware, M: GuestMmu> Vcpu<'_, H, M> {
    /// `lgdt m`/`lidt m`: 2-byte limit, 8-byte base (#GP(0) for a non-canonical operand
    /// address, #PF reading it).
    pub(super) fn load_table(
        &mut self,
        i: &Instruction,
        regs: &mut GuestRegs,
        next: GuestVirt,
    ) -> Step {
        let ea = self.operand_address(i, regs)?;
        let mut bytes = [0u8; 10];
        self.read(ea, &mut bytes)?;
        let limit = u16::from_le_bytes([bytes[0], bytes[1]]);
        let mut base = [0u8; 8];
        base.copy_from_slice(&bytes[2..]);
        let table = DescriptorTable::new(u64::from_le_bytes(base), limit);
        if i.code() == Code::Lgdt_m1664 {
            self.gdtr = table;
        } else {
            self.idtr = table;
        }
        Ok(Flow::Continue(next))
    }

    /// `sgdt m`/`sidt m`.
    pub(super) fn store_table(
        &mut self,
        i: &Instruction,
        regs: &mut GuestRegs,
        next: GuestVirt,
    ) -> Step {
        let t = if i.code() == Code::Sgdt_m1664 {
            self.gdtr
        } else {
            self.idtr
        };
        let mut bytes = [0u8; 10];
        bytes[..2].copy_from_slice(&t.limit.to_le_bytes());
        bytes[2..].copy_from_slice(&t.base.to_le_bytes());
        let ea = self.operand_address(i, regs)?;
        self.write(ea, &bytes)?;
        Ok(Flow::Continue(next))
    }

    /// `str r/m16`.
    pub(super) fn str(&mut self, i: &Instruction, regs: &mut GuestRegs, next: GuestVirt) -> Step {
        let sel = self.segs.tr.selector;
        self.write_rm16(i, sel, regs)?;
        Ok(Flow::Continue(next))
    }

    /// `sldt r/m16`.
    pub(super) fn sldt(&mut self, i: &Instruction, regs: &mut GuestRegs, next: GuestVirt) -> Step {
        let sel = self.segs.ldtr.selector;
        self.write_rm16(i, sel, regs)?;
        Ok(Flow::Continue(next))
    }

    /// `ltr r/m16` / `lldt r/m16`.
    pub(super) fn load_system(
        &mut self,
        i: &Instruction,
        regs: &mut GuestRegs,
        next: GuestVirt,
    ) -> Step {
        let sel = self.read_rm16(i, 0, regs)?;
        let ldt = i.mnemonic() == Mnemonic::Lldt;
        self.segs.load_system(&mut self.mem, self.gdtr, sel, ldt)?;
        Ok(Flow::Continue(next))
    }
}
