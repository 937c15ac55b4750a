//! The virtual CPU's segment state: guest selectors and their descriptor caches
//! (CS/DS/ES/SS/FS/GS, TR, LDTR), loaded from the guest's *virtual* GDT (or LDT), read and
//! written through the guest's page tables. The engine's own GDT is what the hardware
//! uses; nothing here touches it.
//!
//! Loads make the checks a CPU makes in 64-bit mode at CPL 0 (Intel SDM vol. 2, `MOV`,
//! `POP`, `RET`, `LTR`, `LLDT`); a load that would fault returns the exception it raises
//! (an [`Event`], the selector with RPL cleared or 0 as its error code), which the virtual
//! CPU delivers to the guest (`events.rs`).
//!
//! Instructions: `mov sreg`, `mov r/m, sreg`, `push`/`pop fs`/`gs`, same-privilege `retf`.

use iced_x86::{Code, Instruction, Register};
use kpin_abi::attach::Segment;
use kpin_abi::x86::is_canonical;
use kpin_abi::x86::vector::{GP, NP, SS as SS_FAULT};

use super::emulate::{gp0, Flow, Step};
use super::events::Event;
use super::hardware::{GuestMmu, Hardware};
use super::tables::DescriptorTable;
use super::Vcpu;
use crate::{Gpr, GuestRegs, GuestVirt};

/// #NP(sel) unless the code descriptor `d` is present.
fn present_or_np(d: &Descriptor, sel: u16) -> Result<(), Event> {
    if d.present() {
        Ok(())
    } else {
        Err(Event::fault(NP, u32::from(sel & 0xfffc)))
    }
}

fn gp(sel: u16) -> Event {
    Event::fault(GP, u32::from(sel & 0xfffc))
}

/// Which segment register (the `Sreg` encoding order).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sreg {
    /// ES.
    Es = 0,
    /// CS.
    Cs = 1,
    /// SS.
    Ss = 2,
    /// DS.
    Ds = 3,
    /// FS.
    Fs = 4,
    /// GS.
    Gs = 5,
}

/// A raw 8-byte descriptor and where it lives (linear address).
#[derive(Clone, Copy)]
pub struct Descriptor {
    /// Its 8 bytes.
    pub raw: u64,
    /// Its linear address in the guest's table.
    pub at: u64,
}

impl Descriptor {
    pub(super) fn ty(&self) -> u8 {
        ((self.raw >> 40) & 0xf) as u8
    }
    pub(super) fn s(&self) -> bool {
        self.raw & (1 << 44) != 0
    }
    pub(super) fn dpl(&self) -> u8 {
        ((self.raw >> 45) & 3) as u8
    }
    fn present(&self) -> bool {
        self.raw & (1 << 47) != 0
    }
    fn l(&self) -> bool {
        self.raw & (1 << 53) != 0
    }
    fn db(&self) -> bool {
        self.raw & (1 << 54) != 0
    }
    fn base32(&self) -> u64 {
        ((self.raw >> 16) & 0xff_ffff) | (((self.raw >> 56) & 0xff) << 24)
    }
    /// The descriptor cache it loads for `selector` (base: the low 32 bits only).
    pub fn cache(&self, selector: u16) -> Segment {
        let g = self.raw & (1 << 55) != 0;
        let raw_limit = ((self.raw & 0xffff) | (((self.raw >> 48) & 0xf) << 16)) as u32;
        Segment {
            base: self.base32(),
            limit: if g {
                (raw_limit << 12) | 0xfff
            } else {
                raw_limit
            },
            selector,
            type_: self.ty(),
            present: u8::from(self.present()),
            dpl: self.dpl(),
            db: u8::from(self.db()),
            s: u8::from(self.s()),
            l: u8::from(self.l()),
            g: u8::from(g),
            avl: u8::from(self.raw & (1 << 52) != 0),
            unusable: 0,
            pad: 0,
        }
    }
}

/// Guest segment state.
pub struct Segments {
    /// ES, CS, SS, DS, FS, GS (indexed by [`Sreg`]).
    pub sregs: [Segment; 6],
    /// TR.
    pub tr: Segment,
    /// LDTR.
    pub ldtr: Segment,
}

impl Segments {
    /// The state KVM reported at attach.
    pub fn new(s: &kpin_abi::attach::SystemRegs) -> Self {
        Self {
            sregs: [s.es, s.cs, s.ss, s.ds, s.fs, s.gs],
            tr: s.tr,
            ldtr: s.ldt,
        }
    }

    /// The selectors, in `sregs` order (ES, CS, SS, DS, FS, GS).
    pub fn selectors(&self) -> [u16; 6] {
        self.sregs.map(|s| s.selector)
    }

    /// The current privilege level (CS.RPL = CS.DPL for the loaded CS).
    pub fn cpl(&self) -> u8 {
        (self.sregs[Sreg::Cs as usize].selector & 3) as u8
    }

    /// Reads the descriptor `sel` names (GDT or LDT per TI); `#GP(sel)` beyond the
    /// table's limit or unreadable.
    pub fn read_descriptor(
        &self,
        mem: &mut impl GuestMmu,
        gdtr: DescriptorTable,
        sel: u16,
        bytes: u64,
    ) -> Result<Descriptor, Event> {
        let (base, limit) = if sel & 4 != 0 {
            if self.ldtr.unusable != 0 || self.ldtr.selector & 0xfffc == 0 {
                return Err(gp(sel));
            }
            (self.ldtr.base, u64::from(self.ldtr.limit))
        } else {
            (gdtr.base, u64::from(gdtr.limit))
        };
        let off = u64::from(sel & 0xfff8);
        if off + bytes - 1 > limit {
            return Err(gp(sel));
        }
        let at = base.wrapping_add(off);
        let mut b = [0u8; 8];
        if mem.read(at, false, &mut b).is_err() {
            return Err(gp(sel));
        }
        Ok(Descriptor {
            raw: u64::from_le_bytes(b),
            at,
        })
    }

    /// The upper half of a 16-byte system descriptor: base bits 32–63.
    fn base_high(mem: &mut impl GuestMmu, d: &Descriptor, sel: u16) -> Result<u64, Event> {
        let mut b = [0u8; 4];
        if mem.read(d.at.wrapping_add(8), false, &mut b).is_err() {
            return Err(gp(sel));
        }
        Ok(u64::from(u32::from_le_bytes(b)) << 32)
    }

    /// Sets bit `bit` of the type field (accessed = 0, TSS busy = 1) in the guest table,
    /// as the CPU does.
    fn set_type_bit(
        mem: &mut impl GuestMmu,
        d: &Descriptor,
        bit: u8,
        sel: u16,
    ) -> Result<(), Event> {
        let ty = ((d.raw >> 40) & 0xff) as u8;
        if ty & (1 << bit) != 0 {
            return Ok(());
        }
        if mem
            .write(d.at.wrapping_add(5), false, &[ty | (1 << bit)])
            .is_ok()
        {
            Ok(())
        } else {
            Err(gp(sel))
        }
    }

    /// `mov`/`pop` into DS, ES, FS, GS or SS.
    pub fn load_data(
        &mut self,
        mem: &mut impl GuestMmu,
        gdtr: DescriptorTable,
        reg: Sreg,
        sel: u16,
    ) -> Result<(), Event> {
        let cpl = self.cpl();
        let rpl = (sel & 3) as u8;
        let slot = reg as usize;
        if sel & 0xfffc == 0 {
            // SS: a null selector only at CPL < 3 with RPL = CPL (64-bit mode).
            if reg == Sreg::Ss && (cpl == 3 || rpl != cpl) {
                return Err(gp(0));
            }
            // The base is left as it was (AMD without NullSelectClearsBase; the
            // virtual CPU clears FS/GS's where the vendor does, `load_sreg`); the
            // register becomes unusable.
            let s = &mut self.sregs[slot];
            s.selector = sel;
            s.unusable = 1;
            s.present = 0;
            return Ok(());
        }
        let d = self.read_descriptor(mem, gdtr, sel, 8)?;
        let code = d.ty() & 8 != 0;
        let readable_or_writable = d.ty() & 2 != 0;
        if reg == Sreg::Ss {
            if rpl != cpl || !d.s() || code || !readable_or_writable || d.dpl() != cpl {
                return Err(gp(sel));
            }
            if !d.present() {
                return Err(Event::fault(SS_FAULT, u32::from(sel & 0xfffc)));
            }
        } else {
            let conforming = code && d.ty() & 4 != 0;
            if !d.s() || (code && !readable_or_writable) {
                return Err(gp(sel));
            }
            if !conforming && (rpl > d.dpl() || cpl > d.dpl()) {
                return Err(gp(sel));
            }
            if !d.present() {
                return Err(Event::fault(NP, u32::from(sel & 0xfffc)));
            }
        }
        Self::set_type_bit(mem, &d, 0, sel)?;
        self.sregs[slot] = d.cache(sel);
        self.sregs[slot].type_ |= 1;
        Ok(())
    }

    /// Checks the CS a same-privilege far return loads: `Ok(Some(cache))` to load,
    /// `Ok(None)` for a privilege change (not emulated), or the fault.
    pub fn check_far_return_cs(
        &self,
        mem: &mut impl GuestMmu,
        gdtr: DescriptorTable,
        sel: u16,
    ) -> Result<Option<(Descriptor, Segment)>, Event> {
        if sel & 0xfffc == 0 {
            return Err(gp(0));
        }
        let cpl = self.cpl();
        let rpl = (sel & 3) as u8;
        let d = self.read_descriptor(mem, gdtr, sel, 8)?;
        if rpl < cpl || !d.s() || d.ty() & 8 == 0 {
            return Err(gp(sel));
        }
        let conforming = d.ty() & 4 != 0;
        if (conforming && d.dpl() > rpl) || (!conforming && d.dpl() != rpl) {
            return Err(gp(sel));
        }
        present_or_np(&d, sel)?;
        if rpl > cpl {
            return Ok(None);
        }
        let mut c = d.cache(sel);
        c.type_ |= 1;
        Ok(Some((d, c)))
    }

    /// Checks the code segment a same-privilege far `jmp`/`call` loads: a code
    /// descriptor (non-conforming: RPL ≤ CPL and DPL = CPL; conforming: DPL ≤ CPL),
    /// present; `Ok(None)` for a system descriptor (a call gate: not emulated). The
    /// cache's RPL is the CPL.
    pub fn check_far_jump_cs(
        &self,
        mem: &mut impl GuestMmu,
        gdtr: DescriptorTable,
        sel: u16,
    ) -> Result<Option<(Descriptor, Segment)>, Event> {
        if sel & 0xfffc == 0 {
            return Err(gp(0));
        }
        let cpl = self.cpl();
        let d = self.read_descriptor(mem, gdtr, sel, 8)?;
        if !d.s() {
            return Ok(None);
        }
        let conforming = d.ty() & 4 != 0;
        let rpl = (sel & 3) as u8;
        let allowed = if conforming {
            d.dpl() <= cpl
        } else {
            rpl <= cpl && d.dpl() == cpl
        };
        if d.ty() & 8 == 0 || !allowed {
            return Err(gp(sel));
        }
        present_or_np(&d, sel)?;
        let mut c = d.cache((sel & !3) | u16::from(cpl));
        c.type_ |= 1;
        Ok(Some((d, c)))
    }

    /// Commits a checked CS load (sets the accessed bit in the guest table).
    pub fn commit_cs(
        &mut self,
        mem: &mut impl GuestMmu,
        d: &Descriptor,
        c: Segment,
    ) -> Result<(), Event> {
        Self::set_type_bit(mem, d, 0, c.selector)?;
        self.sregs[Sreg::Cs as usize] = c;
        Ok(())
    }

    /// `ltr` (`lldt` with `ldt`): a 16-byte system descriptor from the GDT; `ltr` marks
    /// the TSS busy in the guest's GDT.
    pub fn load_system(
        &mut self,
        mem: &mut impl GuestMmu,
        gdtr: DescriptorTable,
        sel: u16,
        ldt: bool,
    ) -> Result<(), Event> {
        if sel & 0xfffc == 0 {
            if ldt {
                self.ldtr.selector = sel;
                self.ldtr.unusable = 1;
                self.ldtr.present = 0;
                return Ok(());
            }
            return Err(gp(0));
        }
        if sel & 4 != 0 {
            return Err(gp(sel));
        }
        let d = self.read_descriptor(mem, gdtr, sel, 16)?;
        let want = if ldt { 2 } else { 9 };
        if d.s() || d.ty() != want {
            return Err(gp(sel));
        }
        if !d.present() {
            return Err(Event::fault(NP, u32::from(sel & 0xfffc)));
        }
        let hi = Self::base_high(mem, &d, sel)?;
        let mut c = d.cache(sel);
        c.base |= hi;
        if ldt {
            self.ldtr = c;
        } else {
            Self::set_type_bit(mem, &d, 1, sel)?;
            c.type_ |= 2;
            self.tr = c;
        }
        Ok(())
    }
}

/// The segment register `r` names.
pub(crate) fn sreg_of(r: Register) -> Option<Sreg> {
    Some(match r {
        Register::ES => Sreg::Es,
        Register::CS => Sreg::Cs,
        Register::SS => Sreg::Ss,
        Register::DS => Sreg::Ds,
        Register::FS => Sreg::Fs,
        Register::GS => Sreg::Gs,
        _ => return None,
    })
}

impl<H: Hardware, M: GuestMmu> Vcpu<'_, H, M> {
    /// Loads DS/ES/SS/FS/GS with `sel` (the checks in [`Segments::load_data`]); an FS/GS
    /// base change goes to the hardware base too.
    pub(super) fn load_sreg(&mut self, reg: Sreg, sel: u16) -> Result<(), Event> {
        let old_base = self.segs.sregs[reg as usize].base;
        self.segs.load_data(&mut self.mem, self.gdtr, reg, sel)?;
        if sel & 0xfffc == 0 && matches!(reg, Sreg::Fs | Sreg::Gs) && self.null_clears_base() {
            self.segs.sregs[reg as usize].base = 0;
        }
        let base = self.segs.sregs[reg as usize].base;
        if matches!(reg, Sreg::Fs | Sreg::Gs) && base != old_base {
            self.hw.set_hw_base(reg == Sreg::Fs, base);
        }
        Ok(())
    }

    /// `mov sreg, r/m16` (not CS: #UD).
    pub(super) fn mov_to_sreg(
        &mut self,
        i: &Instruction,
        regs: &mut GuestRegs,
        next: GuestVirt,
    ) -> Step {
        let Some(reg) = sreg_of(i.op0_register()).filter(|&r| r != Sreg::Cs) else {
            return Err(Event::ud());
        };
        let sel = self.read_rm16(i, 1, regs)?;
        self.load_sreg(reg, sel)?;
        Ok(Flow::Continue(next))
    }

    /// `mov r/m16, sreg`.
    pub(super) fn mov_from_sreg(
        &mut self,
        i: &Instruction,
        regs: &mut GuestRegs,
        next: GuestVirt,
    ) -> Step {
        let Some(reg) = sreg_of(i.op1_register()) else {
            return Err(Event::ud());
        };
        let sel = self.segs.sregs[reg as usize].selector;
        self.write_rm16(i, sel, regs)?;
        Ok(Flow::Continue(next))
    }

    /// `push` of a segment register (16, 32 or 64-bit operand size).
    pub(super) fn push_sreg(
        &mut self,
        i: &Instruction,
        regs: &mut GuestRegs,
        next: GuestVirt,
    ) -> Step {
        let Some(reg) = sreg_of(i.op0_register()) else {
            return Err(Event::ud());
        };
        let size = i.stack_pointer_increment().unsigned_abs() as usize;
        // A 32- or 64-bit push writes the selector zero-extended.
        let v = u64::from(self.segs.sregs[reg as usize].selector).to_le_bytes();
        self.push_bytes(regs, &v[..size])?;
        Ok(Flow::Continue(next))
    }

    /// `pop` into a segment register (16, 32 or 64-bit operand size; CS is #UD).
    pub(super) fn pop_sreg(
        &mut self,
        i: &Instruction,
        regs: &mut GuestRegs,
        next: GuestVirt,
    ) -> Step {
        let Some(reg) = sreg_of(i.op0_register()).filter(|&r| r != Sreg::Cs) else {
            return Err(Event::ud());
        };
        let size = i.stack_pointer_increment().unsigned_abs() as usize;
        let mut b = [0u8; 8];
        let rsp = self.peek_stack(regs, &mut b[..size])?;
        self.load_sreg(reg, u16::from_le_bytes([b[0], b[1]]))?;
        regs.set(Gpr::Rsp, rsp);
        Ok(Flow::Continue(next))
    }

    /// `retf` (16/32/64-bit operand size, optional immediate): same privilege only.
    pub(super) fn far_return(
        &mut self,
        i: &Instruction,
        regs: &mut GuestRegs,
        _next: GuestVirt,
    ) -> Step {
        let size: u64 = match i.code() {
            Code::Retfw | Code::Retfw_imm16 => 2,
            Code::Retfd | Code::Retfd_imm16 => 4,
            _ => 8,
        };
        let mask = self.stack_mask();
        let rsp = regs.get(Gpr::Rsp) & mask;
        let mut b = [0u8; 16];
        let sz = size as usize;
        self.read(rsp, &mut b[..2 * sz])?;
        let mut ip = [0u8; 8];
        ip[..sz].copy_from_slice(&b[..sz]);
        let rip = u64::from_le_bytes(ip);
        let sel = u16::from_le_bytes([b[sz], b[sz + 1]]);
        let (d, c) = match self.segs.check_far_return_cs(&mut self.mem, self.gdtr, sel) {
            Ok(Some(dc)) => dc,
            Ok(None) => {
                return Ok(Flow::unsupported(
                    i,
                    "a far return to an outer privilege level is not emulated yet",
                ))
            }
            Err(f) => return Err(f),
        };
        // 64-bit code, or 32-bit code at CPL 3 (translated as compatibility mode).
        let compat = c.l == 0 && c.db != 0 && self.cpl() == 3;
        if (c.l == 0 && !compat) || (c.l != 0 && c.db != 0) {
            return Ok(Flow::unsupported(
                i,
                "a far return to a 16-bit code segment (not translated)",
            ));
        }
        if !is_canonical(rip) || (compat && rip > u64::from(c.limit)) {
            return Err(gp0());
        }
        self.segs.commit_cs(&mut self.mem, &d, c)?;
        let imm = if i.op_count() > 0 {
            u64::from(i.immediate16())
        } else {
            0
        };
        regs.set(Gpr::Rsp, rsp.wrapping_add(2 * size + imm) & mask);
        Ok(Flow::Continue(GuestVirt(rip)))
    }
}
