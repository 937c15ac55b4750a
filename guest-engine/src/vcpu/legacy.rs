//! Far transfers and the instructions 64-bit mode dropped (the translator leaves them to
//! the virtual CPU): same-privilege far `jmp`/`call` through memory or a direct pointer,
//! to 64-bit or (at CPL 3) 32-bit code, LDT selectors included; `iretd` in 32-bit code;
//! `lss`/`lfs`/`lgs`/`les`/`lds`; and, in 32-bit code, `pushad`/`popad`, `into`, `bound`,
//! the BCD adjustments (`aam`, `aad`, `daa`, `das`, `aaa`, `aas`), `salc` and `arpl` (each as its
//! page in the SDM, vol. 2, describes it; flags the SDM leaves undefined follow AL).
//!
//! Not emulated (the process's #UD at CPL 3): far transfers through call gates or to
//! another privilege level, to 16-bit code segments.

use iced_x86::{Code, Instruction, Mnemonic, OpKind};
use kpin_abi::attach::Segment;
use kpin_abi::x86::{is_canonical, rflags, vector};

use super::emulate::{gp0, gpr, Flow, Step};
use super::events::{Event, Kind};
use super::hardware::{GuestMmu, Hardware};
use super::segments::{Descriptor, Sreg};
use super::Vcpu;
use crate::{Gpr, GuestRegs, GuestVirt};

/// The eight GPRs in `pushad` order: their encoding order, EAX first.
fn pushad_order() -> &'static [Gpr] {
    &Gpr::ALL[..8]
}

/// ZF, SF and PF of a byte result (`aam`/`aad`; their other status flags are cleared).
fn byte_flags(v: u8) -> u64 {
    let mut f = 0;
    if v == 0 {
        f |= rflags::ZF;
    }
    if v & 0x80 != 0 {
        f |= 1 << 7; // SF
    }
    if v.count_ones().is_multiple_of(2) {
        f |= 1 << 2; // PF
    }
    f
}

/// Whether a code segment cache is one the engine translates at `cpl`, and if it is,
/// whether it is 32-bit.
fn code_bitness(c: &Segment, cpl: u8) -> Option<bool> {
    match (c.l, c.db) {
        (1, 0) => Some(false),
        (0, 1) if cpl == 3 => Some(true),
        _ => None,
    }
}

impl<H: Hardware, M: GuestMmu> Vcpu<'_, H, M> {
    /// Checks a same-privilege transfer to `sel:offset`: the code segment to load and
    /// the new RIP, `None` for what is not emulated (a call gate, 16-bit code).
    fn far_target(
        &mut self,
        sel: u16,
        offset: u64,
    ) -> Result<Option<(Descriptor, Segment, u64)>, Event> {
        let Some((d, c)) = self.segs.check_far_jump_cs(&mut self.mem, self.gdtr, sel)? else {
            return Ok(None);
        };
        let Some(compat) = code_bitness(&c, self.cpl()) else {
            return Ok(None);
        };
        let rip = if compat { offset & 0xffff_ffff } else { offset };
        if !is_canonical(rip) || (compat && rip > u64::from(c.limit)) {
            return Err(gp0());
        }
        Ok(Some((d, c, rip)))
    }

    /// The far pointer of a far `jmp`/`call`: selector, offset and the offset's size.
    fn far_pointer(
        &mut self,
        i: &Instruction,
        regs: &GuestRegs,
    ) -> Result<(u16, u64, usize), Event> {
        match i.op0_kind() {
            OpKind::FarBranch16 => Ok((i.far_branch_selector(), u64::from(i.far_branch16()), 2)),
            OpKind::FarBranch32 => Ok((i.far_branch_selector(), u64::from(i.far_branch32()), 4)),
            _ => {
                let size = match i.code() {
                    Code::Jmp_m1616 | Code::Call_m1616 => 2,
                    Code::Jmp_m1632 | Code::Call_m1632 => 4,
                    _ => 8,
                };
                let ea = self.operand_address(i, regs)?;
                let mut b = [0u8; 10];
                self.read(ea, &mut b[..size + 2])?;
                let mut off = [0u8; 8];
                off[..size].copy_from_slice(&b[..size]);
                let sel = u16::from_le_bytes([b[size], b[size + 1]]);
                Ok((sel, u64::from_le_bytes(off), size))
            }
        }
    }

    /// Far `jmp` (same privilege).
    pub(super) fn far_jmp(&mut self, i: &Instruction, regs: &mut GuestRegs, _n: GuestVirt) -> Step {
        let (sel, offset, _) = self.far_pointer(i, regs)?;
        let Some((d, c, rip)) = self.far_target(sel, offset)? else {
            return Ok(Flow::unsupported(
                i,
                "a far jump through a gate or to 16-bit code",
            ));
        };
        self.segs.commit_cs(&mut self.mem, &d, c)?;
        Ok(Flow::Continue(GuestVirt(rip)))
    }

    /// Far `call` (same privilege): CS, then the return offset, pushed at the pointer's
    /// offset size.
    pub(super) fn far_call(
        &mut self,
        i: &Instruction,
        regs: &mut GuestRegs,
        next: GuestVirt,
    ) -> Step {
        let (sel, offset, size) = self.far_pointer(i, regs)?;
        let Some((d, c, rip)) = self.far_target(sel, offset)? else {
            return Ok(Flow::unsupported(
                i,
                "a far call through a gate or to 16-bit code",
            ));
        };
        let cs = u64::from(self.segs.sregs[Sreg::Cs as usize].selector);
        let mut frame = [0u8; 16];
        frame[..size].copy_from_slice(&next.0.to_le_bytes()[..size]);
        frame[size..2 * size].copy_from_slice(&cs.to_le_bytes()[..size]);
        self.push_bytes(regs, &frame[..2 * size])?;
        self.segs.commit_cs(&mut self.mem, &d, c)?;
        Ok(Flow::Continue(GuestVirt(rip)))
    }

    /// `iretd` in 32-bit code, to the same privilege level: pops EIP, CS and EFLAGS only
    /// (SS:ESP are not popped outside 64-bit mode).
    pub(super) fn iretd(&mut self, i: &Instruction, regs: &mut GuestRegs, _n: GuestVirt) -> Step {
        if self.bitness() == 64 {
            return Ok(Flow::unsupported(i, "a 32-bit iret in 64-bit code"));
        }
        let mut b = [0u8; 12];
        let esp = self.peek_stack(regs, &mut b)?;
        let word = |k: usize| u64::from(u32::from_le_bytes([b[k], b[k + 1], b[k + 2], b[k + 3]]));
        let sel = word(4) as u16;
        let (d, c) = match self.segs.check_far_return_cs(&mut self.mem, self.gdtr, sel) {
            Ok(Some(dc)) => dc,
            Ok(None) => return Ok(Flow::unsupported(i, "an iretd to another privilege level")),
            Err(f) => return Err(f),
        };
        let Some(compat) = code_bitness(&c, self.cpl()) else {
            return Ok(Flow::unsupported(i, "an iretd to 16-bit code"));
        };
        let rip = word(0);
        if compat && rip > u64::from(c.limit) {
            return Err(gp0());
        }
        self.segs.commit_cs(&mut self.mem, &d, c)?;
        let cpl = self.cpl();
        self.load_rflags(regs, (regs.rflags & !0xffff_ffff) | word(8), cpl, true);
        regs.set(Gpr::Rsp, esp);
        Ok(Flow::Continue(GuestVirt(rip)))
    }

    /// `lss`/`lfs`/`lgs`/`les`/`lds r, m16:x`: the selector loaded with its checks, then
    /// the offset into the register.
    pub(super) fn load_far_pointer(
        &mut self,
        i: &Instruction,
        regs: &mut GuestRegs,
        next: GuestVirt,
    ) -> Step {
        let sreg = match i.mnemonic() {
            Mnemonic::Lss => Sreg::Ss,
            Mnemonic::Lfs => Sreg::Fs,
            Mnemonic::Lgs => Sreg::Gs,
            Mnemonic::Les => Sreg::Es,
            _ => Sreg::Ds,
        };
        let r = i.op0_register();
        let size = r.size();
        let ea = self.operand_address(i, regs)?;
        let mut b = [0u8; 10];
        self.read(ea, &mut b[..size + 2])?;
        self.load_sreg(sreg, u16::from_le_bytes([b[size], b[size + 1]]))?;
        let mut off = [0u8; 8];
        off[..size].copy_from_slice(&b[..size]);
        let v = u64::from_le_bytes(off);
        if let Some(g) = gpr(r) {
            let merged = if size == 2 {
                (regs.get(g) & !0xffff) | v
            } else {
                v
            };
            regs.set(g, merged);
        }
        Ok(Flow::Continue(next))
    }

    /// `pushad`/`popad` (32-bit code): the eight GPRs at ESP (`popad` skips ESP).
    pub(super) fn push_pop_all(
        &mut self,
        i: &Instruction,
        regs: &mut GuestRegs,
        next: GuestVirt,
    ) -> Step {
        let mut b = [0u8; 32];
        if i.code() == Code::Pushad {
            // Highest address first: EAX at ESP - 4 … EDI at ESP - 32.
            for (k, g) in pushad_order().iter().enumerate() {
                let v = regs.get(*g) as u32;
                b[28 - 4 * k..32 - 4 * k].copy_from_slice(&v.to_le_bytes());
            }
            let esp = regs.get(Gpr::Rsp).wrapping_sub(32) & 0xffff_ffff;
            self.write(esp, &b[..16])?;
            self.write(esp + 16, &b[16..])?;
            regs.set(Gpr::Rsp, esp);
        } else {
            let esp = self.peek_stack(regs, &mut b)?;
            for (k, g) in pushad_order().iter().enumerate() {
                if *g != Gpr::Rsp {
                    let at = 28 - 4 * k;
                    let v = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
                    regs.set(*g, u64::from(v));
                }
            }
            regs.set(Gpr::Rsp, esp);
        }
        Ok(Flow::Continue(next))
    }

    /// `into`: #OF (a trap, checked against the gate's DPL) if OF is set.
    pub(super) fn into(&mut self, _i: &Instruction, regs: &mut GuestRegs, next: GuestVirt) -> Step {
        if regs.rflags & (1 << 11) != 0 {
            return Err(Event {
                vector: vector::OF,
                error: None,
                kind: Kind::SoftException,
            });
        }
        Ok(Flow::Continue(next))
    }

    /// `bound r32, m32&32` (or r16): #BR unless lower ≤ index ≤ upper (signed).
    pub(super) fn bound(&mut self, i: &Instruction, regs: &mut GuestRegs, next: GuestVirt) -> Step {
        let r = i.op0_register();
        let wide = r.size() == 4;
        let raw = gpr(r).map_or(0, |g| regs.get(g));
        let index = if wide {
            i64::from(raw as i32)
        } else {
            i64::from(raw as i16)
        };
        let ea = self.operand_address(i, regs)?;
        let mut b = [0u8; 8];
        let n = if wide { 8 } else { 4 };
        self.read(ea, &mut b[..n])?;
        let (lo, hi) = if wide {
            (
                i64::from(i32::from_le_bytes([b[0], b[1], b[2], b[3]])),
                i64::from(i32::from_le_bytes([b[4], b[5], b[6], b[7]])),
            )
        } else {
            (
                i64::from(i16::from_le_bytes([b[0], b[1]])),
                i64::from(i16::from_le_bytes([b[2], b[3]])),
            )
        };
        if index < lo || index > hi {
            return Err(Event::exception(vector::BR));
        }
        Ok(Flow::Continue(next))
    }

    /// `aam imm8` (#DE for 0) and `aad imm8`.
    pub(super) fn ascii_adjust(
        &mut self,
        i: &Instruction,
        regs: &mut GuestRegs,
        next: GuestVirt,
    ) -> Step {
        let base = i.immediate8();
        let ax = regs.get(Gpr::Rax);
        let (al, ah) = (ax as u8, (ax >> 8) as u8);
        let (new_al, new_ah) = if i.mnemonic() == Mnemonic::Aam {
            if base == 0 {
                return Err(Event::exception(vector::DE));
            }
            (al % base, al / base)
        } else {
            (al.wrapping_add(ah.wrapping_mul(base)), 0)
        };
        regs.set(
            Gpr::Rax,
            (ax & !0xffff) | u64::from(new_ah) << 8 | u64::from(new_al),
        );
        regs.rflags = (regs.rflags & !rflags::STATUS) | byte_flags(new_al);
        Ok(Flow::Continue(next))
    }

    /// `daa`/`das`/`aaa`/`aas`: the decimal adjustments of AL (AH too for the ASCII
    /// ones) after an addition or subtraction.
    pub(super) fn decimal_adjust(
        &mut self,
        i: &Instruction,
        regs: &mut GuestRegs,
        next: GuestVirt,
    ) -> Step {
        const CF: u64 = 1;
        const AF: u64 = 1 << 4;
        let ax = regs.get(Gpr::Rax);
        let (mut al, mut ah) = (ax as u8, (ax >> 8) as u8);
        let (cf, af) = (regs.rflags & CF != 0, regs.rflags & AF != 0);
        let low_adjust = al & 0xf > 9 || af;
        let (mut new_cf, mut new_af) = (false, false);
        match i.mnemonic() {
            Mnemonic::Daa | Mnemonic::Das => {
                let old_al = al;
                if low_adjust {
                    let (v, carry) = if i.mnemonic() == Mnemonic::Daa {
                        al.overflowing_add(6)
                    } else {
                        al.overflowing_sub(6)
                    };
                    al = v;
                    new_cf = cf || carry;
                    new_af = true;
                }
                if old_al > 0x99 || cf {
                    al = if i.mnemonic() == Mnemonic::Daa {
                        al.wrapping_add(0x60)
                    } else {
                        al.wrapping_sub(0x60)
                    };
                    new_cf = true;
                } else if i.mnemonic() == Mnemonic::Daa {
                    new_cf = false;
                }
            }
            _ => {
                if low_adjust {
                    if i.mnemonic() == Mnemonic::Aaa {
                        let v = u16::from_le_bytes([al, ah]).wrapping_add(0x106);
                        [al, ah] = v.to_le_bytes();
                    } else {
                        al = al.wrapping_sub(6);
                        ah = ah.wrapping_sub(1);
                    }
                    new_cf = true;
                    new_af = true;
                }
                al &= 0xf;
            }
        }
        regs.set(
            Gpr::Rax,
            (ax & !0xffff) | u64::from(ah) << 8 | u64::from(al),
        );
        regs.rflags = (regs.rflags & !rflags::STATUS)
            | byte_flags(al)
            | if new_cf { CF } else { 0 }
            | if new_af { AF } else { 0 };
        Ok(Flow::Continue(next))
    }

    /// `salc`: AL = CF ? 0xff : 0, flags unchanged.
    pub(super) fn salc(&mut self, _i: &Instruction, regs: &mut GuestRegs, next: GuestVirt) -> Step {
        let al = if regs.rflags & 1 != 0 { 0xff } else { 0 };
        regs.set(Gpr::Rax, (regs.get(Gpr::Rax) & !0xff) | al);
        Ok(Flow::Continue(next))
    }

    /// `arpl r/m16, r16` (32-bit code): raises the destination selector's RPL to the
    /// source's, ZF = 1 if it did.
    pub(super) fn arpl(&mut self, i: &Instruction, regs: &mut GuestRegs, next: GuestVirt) -> Step {
        let src = gpr(i.op1_register()).map_or(0, |g| regs.get(g)) as u16;
        let dest = self.read_rm16(i, 0, regs)?;
        if dest & 3 < src & 3 {
            self.write_rm16(i, (dest & !3) | (src & 3), regs)?;
            regs.rflags |= rflags::ZF;
        } else {
            regs.rflags &= !rflags::ZF;
        }
        Ok(Flow::Continue(next))
    }
}
