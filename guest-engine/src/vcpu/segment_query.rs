//! The segment-query family: `lar`, `lsl`, `verr`, `verw` (Intel SDM vol. 2, 64-bit
//! mode). They read a descriptor from the guest's *virtual* GDT or LDT and answer in ZF
//! (and, for `lar`/`lsl`, a register): run natively at CPL 3 they would query the
//! engine's own GDT at the engine's privilege, which the guest must never see. A kernel
//! with the default mitigations runs `verw` on every return to user space (MDS/TSA "clear
//! CPU buffers"), where only its side effect matters; the answer must still be the one
//! a CPU gives.
//!
//! Rules, for a selector that is not null and lies within its table (else ZF = 0):
//! - types: `lar` accepts code/data and the system types LDT, 64-bit TSS (available or
//!   busy) and 64-bit call gate; `lsl` the same without the gate; `verr`/`verw` only
//!   code/data. A 16-byte system descriptor must lie wholly within the table and have a
//!   zero type in its upper half.
//! - privilege: DPL ≥ CPL and DPL ≥ RPL, except for conforming code (no check).
//! - `verr`: data, or readable code; `verw`: writable data.
//! - ZF = 1 and (`lar`) the access rights `dword1 & 0x00f0ff00` (`0xff00` for a 16-bit
//!   operand) or (`lsl`) the byte-granular limit go to the destination; with ZF = 0 the
//!   destination is unchanged. No other flag changes; no accessed bit is set.
//!
//! A descriptor-table read that faults answers ZF = 0 (a CPU would raise the #PF; guest
//! kernels keep their GDT mapped).

use iced_x86::{Instruction, Mnemonic};
use kpin_abi::x86::rflags;

use super::emulate::{gpr, Flow, Step};
use super::hardware::{GuestMmu, Hardware};
use super::segments::Descriptor;
use super::Vcpu;
use crate::{GuestRegs, GuestVirt};

/// Which query.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Query {
    Lar,
    Lsl,
    Verr,
    Verw,
}

/// System-descriptor types in 64-bit mode.
const SYS_LDT: u8 = 0x2;
const SYS_TSS_AVAILABLE: u8 = 0x9;
const SYS_TSS_BUSY: u8 = 0xb;
const SYS_CALL_GATE: u8 = 0xc;
/// Code/data type bits: code (else data), conforming (code) and readable (code) /
/// writable (data).
const TYPE_CODE: u8 = 1 << 3;
const TYPE_CONFORMING: u8 = 1 << 2;
const TYPE_READABLE_OR_WRITABLE: u8 = 1 << 1;

impl<'a, H: Hardware, M: GuestMmu> Vcpu<'a, H, M> {
    /// The descriptor `sel` names if `q` accepts it at the current CPL (see the module
    /// header), else `None`.
    fn query(&mut self, q: Query, sel: u16) -> Option<Descriptor> {
        if sel & 0xfffc == 0 {
            return None;
        }
        let d = self
            .segs
            .read_descriptor(&mut self.mem, self.gdtr, sel, 8)
            .ok()?;
        let ty = d.ty();
        let ok_type = if d.s() {
            match q {
                Query::Lar | Query::Lsl => true,
                Query::Verr => ty & TYPE_CODE == 0 || ty & TYPE_READABLE_OR_WRITABLE != 0,
                Query::Verw => ty & TYPE_CODE == 0 && ty & TYPE_READABLE_OR_WRITABLE != 0,
            }
        } else {
            let system = match q {
                Query::Lar => matches!(
                    ty,
                    SYS_LDT | SYS_TSS_AVAILABLE | SYS_TSS_BUSY | SYS_CALL_GATE
                ),
                Query::Lsl => matches!(ty, SYS_LDT | SYS_TSS_AVAILABLE | SYS_TSS_BUSY),
                Query::Verr | Query::Verw => false,
            };
            // The upper half of the 16-byte descriptor: within the table, type 0.
            system
                && self
                    .segs
                    .read_descriptor(&mut self.mem, self.gdtr, sel, 16)
                    .is_ok()
                && {
                    let mut upper = [0u8; 8];
                    self.mem
                        .read(d.at.wrapping_add(8), false, &mut upper)
                        .is_ok()
                        && (u64::from_le_bytes(upper) >> 40) & 0x1f == 0
                }
        };
        let conforming_code =
            d.s() && ty & (TYPE_CODE | TYPE_CONFORMING) == TYPE_CODE | TYPE_CONFORMING;
        let rpl = (sel & 3) as u8;
        let ok_privilege = conforming_code || (d.dpl() >= self.cpl() && d.dpl() >= rpl);
        (ok_type && ok_privilege).then_some(d)
    }

    /// Sets ZF to `ok`, leaving the other flags.
    fn set_zf(regs: &mut GuestRegs, ok: bool) {
        regs.rflags = if ok {
            regs.rflags | rflags::ZF
        } else {
            regs.rflags & !rflags::ZF
        };
    }

    /// `lar`/`lsl r, r/m16`: on success the destination gets `value` (16-bit operand: its
    /// low 16 bits merged; 32/64-bit: zero-extended).
    fn load_query(
        &mut self,
        q: Query,
        i: &Instruction,
        regs: &mut GuestRegs,
        next: GuestVirt,
    ) -> Step {
        let sel = self.read_rm16(i, 1, regs)?;
        let found = self.query(q, sel);
        Self::set_zf(regs, found.is_some());
        if let Some(d) = found {
            let dst = i.op0_register();
            let value = match q {
                Query::Lar if dst.is_gpr16() => (d.raw >> 32) & 0xff00,
                Query::Lar => (d.raw >> 32) & 0x00f0_ff00,
                _ => u64::from(d.cache(sel).limit),
            };
            if let Some(n) = gpr(dst) {
                let v = if dst.is_gpr16() {
                    (regs.get(n) & !0xffff) | (value & 0xffff)
                } else {
                    value
                };
                regs.set(n, v);
            }
        }
        Ok(Flow::Continue(next))
    }

    /// `lar r, r/m16`.
    pub(super) fn lar(&mut self, i: &Instruction, regs: &mut GuestRegs, next: GuestVirt) -> Step {
        self.load_query(Query::Lar, i, regs, next)
    }

    /// `lsl r, r/m16`.
    pub(super) fn lsl(&mut self, i: &Instruction, regs: &mut GuestRegs, next: GuestVirt) -> Step {
        self.load_query(Query::Lsl, i, regs, next)
    }

    /// `verr r/m16` or `verw r/m16`.
    pub(super) fn verify(
        &mut self,
        i: &Instruction,
        regs: &mut GuestRegs,
        next: GuestVirt,
    ) -> Step {
        let q = if i.mnemonic() == Mnemonic::Verw {
            Query::Verw
        } else {
            Query::Verr
        };
        let sel = self.read_rm16(i, 0, regs)?;
        let ok = self.query(q, sel).is_some();
        Self::set_zf(regs, ok);
        Ok(Flow::Continue(next))
    }
}
