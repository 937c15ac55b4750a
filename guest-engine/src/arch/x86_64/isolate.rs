//! Software fault isolation of translated memory operands: no guest access reaches the
//! engine's reserved zone unchecked.
//!
//! The engine shares the address space with the guest code it translates (both run at
//! hardware CPL 3), so the engine window (PML4 slot 257) and the physmap (258) are
//! reachable by any guest access. The **reserved zone** Z is PML4 slots 256–259,
//! `[ISOLATION_ZONE_START, ISOLATION_ZONE_END)`: 2 TiB aligned to 2^41, so an address is
//! in Z iff its bits 63:41 are `0x7f_ffc0`. Slots 256 and 259 hold nothing of the
//! engine and are never present in any shadow root: a hardware access there always
//! faults into the engine, which resolves it against the guest's own tables. They are
//! the guards that make the elisions below sound.
//!
//! Before every translated instruction, each memory operand whose linear address may lie
//! in Z gets a flag-free check on its *first* byte:
//!
//! ```text
//! mov [spill.rcx], rcx
//! lea rcx, [ea]              ; + rdfsbase/rdgsbase for fs:/gs: operands
//! rorx rcx, rcx, 41          ; bits 63:41 to 22:0 (BMI2, no flags)
//! movzx ecx, cx              ; bits 56:41: 0xffc0 for Z (also for some non-canonical)
//! lea ecx, [rcx - 0xffc0]    ; zero iff a hit
//! jrcxz hit
//! jmp short ok
//! hit: ud2                   ; #UD in the cache: `Stop::Fault`, RCX restored by the PC map
//! ok: mov rcx, [spill.rcx]
//! ```
//!
//! A hit costs no exit record (the engine's tables grow with exits, and a Linux boot
//! translates ~10^5 traces): the embedder that sees #UD at a translated instruction asks
//! [`classify_fault`] whether an operand lies in Z (then it resolves the access against
//! the guest's own tables, as for a hardware #PF there), or is non-canonical (a false
//! positive of the check: #GP(0)), or else the #UD is the guest's own.
//!
//! Invariants that make checking only the first byte enough: below Z lies the
//! non-canonical hole, so an access (or an upward `rep` string) that starts below Z
//! faults before reaching it; an access starting above Z never reaches it upward, and a
//! downward `rep` string from above Z meets slot 259 first, which always faults into the
//! engine. Elisions: absolute (and RIP-relative, already absolute here) operands are
//! decided at translation time; 32-bit-addressed flat operands are below 4 GiB;
//! `[rsp+disp32]` (push, pop, call, ret included) is checked through RSP once per trace
//! before its first use and again after each explicit RSP write (a trace's implicit RSP
//! drift is at most `MAX_TRACE_INSNS` × 8 bytes, and a displacement at most 2 GiB: with
//! RSP outside Z, such an access lands at most in the slot-259 guard or the hole).
//! A hit leaves the guest state exactly that before the instruction (the check comes
//! before the instruction's instrumentation and translation).

use iced_x86::{Mnemonic, OpAccess, OpKind, Register};

use iced_x86::{Decoder, DecoderOptions, InstructionInfoFactory};

use super::decode::{mem_operands, DecodedInsn};
use super::emit::reg;
use super::mangle::Tx;
use crate::context::{Gpr, GuestRegs};
use crate::error::EngineError;
use crate::instrument::{MemOperand, SegBase};

/// First address of the reserved zone (PML4 slot 256).
pub const ISOLATION_ZONE_START: u64 = 0xffff_8000_0000_0000;
/// End (exclusive) of the reserved zone (PML4 slot 260).
pub const ISOLATION_ZONE_END: u64 = 0xffff_8200_0000_0000;

/// Whether `va` lies in the reserved zone.
pub const fn in_isolation_zone(va: u64) -> bool {
    va >= ISOLATION_ZONE_START && va < ISOLATION_ZONE_END
}

/// Per-trace state of the RSP elision.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct RspState {
    /// RSP was checked in this trace and not explicitly written since.
    pub checked: bool,
}

/// Whether `d` writes RSP other than by the implicit adjustment of a push/pop/call/ret.
fn writes_rsp_explicitly(tx: &mut Tx<'_>, d: &DecodedInsn) -> bool {
    let i = &d.instr;
    let writes = tx.factory.info(i).used_registers().iter().any(|u| {
        u.register().full_register() == Register::RSP
            && matches!(
                u.access(),
                OpAccess::Write
                    | OpAccess::CondWrite
                    | OpAccess::ReadWrite
                    | OpAccess::ReadCondWrite
            )
    });
    if !writes {
        return false;
    }
    if i.stack_pointer_increment() == 0 || matches!(i.mnemonic(), Mnemonic::Leave | Mnemonic::Enter)
    {
        return true;
    }
    (0..i.op_count()).any(|k| {
        i.op_kind(k) == OpKind::Register && i.op_register(k).full_register() == Register::RSP
    })
}

/// Whether `i`'s memory operands use 32-bit addressing (a `0x67` prefix).
fn addressing_32(i: &iced_x86::Instruction) -> bool {
    i.memory_base().is_gpr32()
        || i.memory_index().is_gpr32()
        || (0..i.op_count()).any(|k| {
            matches!(
                i.op_kind(k),
                OpKind::MemorySegESI | OpKind::MemorySegEDI | OpKind::MemoryESEDI
            )
        })
}

impl Tx<'_> {
    /// The checks for instruction `d` with memory operands `ops` (see the module header),
    /// emitted at the instruction's start; updates `rsp` for the instruction's effect.
    pub(super) fn emit_isolation_checks(
        &mut self,
        d: &DecodedInsn,
        ops: &[MemOperand],
        rsp: &mut RspState,
    ) -> Result<(), EngineError> {
        let pc = d.instr.ip();
        let addr32 = addressing_32(&d.instr);
        for (k, m) in ops.iter().enumerate() {
            if ops[..k].contains(m) {
                continue;
            }
            match (m.base, m.index, m.seg) {
                (None, None, SegBase::Flat) => {
                    if in_isolation_zone(m.disp) {
                        self.a.bytes(&[0x0F, 0x0B]); // ud2
                    }
                }
                (_, _, SegBase::Flat) if addr32 => {}
                (Some(Gpr::Rsp), None, SegBase::Flat) => {
                    if !rsp.checked {
                        let at_rsp = MemOperand {
                            base: Some(Gpr::Rsp),
                            index: None,
                            scale: 1,
                            disp: 0,
                            ..*m
                        };
                        self.emit_zone_check(&at_rsp, pc)?;
                        rsp.checked = true;
                    }
                }
                _ => self.emit_zone_check(m, pc)?,
            }
        }
        if writes_rsp_explicitly(self, d) {
            rsp.checked = false;
        }
        Ok(())
    }

    /// The inline check of `checked`'s address.
    fn emit_zone_check(&mut self, checked: &MemOperand, pc: u64) -> Result<(), EngineError> {
        let seg = checked.seg != SegBase::Flat;
        self.a.emit_spill(reg::RCX);
        if seg {
            self.a.emit_spill(reg::RAX);
        }
        self.emit_ea_rcx(checked, pc)?;
        if seg {
            self.a.emit_unspill(reg::RAX);
        }
        self.a.bytes(&[0xC4, 0xE3, 0xFB, 0xF0, 0xC9, 0x29]); // rorx rcx, rcx, 41
        self.a.bytes(&[0x0F, 0xB7, 0xC9]); // movzx ecx, cx
        self.a.bytes(&[0x8D, 0x89, 0x40, 0x00, 0xFF, 0xFF]); // lea ecx, [rcx - 0xffc0]
        self.a.bytes(&[0xE3, 0x02]); // jrcxz hit
        self.a.bytes(&[0xEB, 0x02]); // jmp short ok
        self.a.bytes(&[0x0F, 0x0B]); // hit: ud2
        self.a.emit_unspill(reg::RCX); // ok:
        Ok(())
    }
}

/// What a #UD raised at the translation of a guest instruction means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IsolationFault {
    /// An operand's linear address lies in the reserved zone: the access gets what the
    /// guest's own page tables say (as a hardware #PF at `addr` would).
    Zone {
        /// The operand's linear address.
        addr: u64,
        /// `instrument::access` bits of the operand (READ, WRITE).
        access: u32,
    },
    /// An operand's address is non-canonical (the check's only false positives): #GP(0).
    NonCanonical {
        /// The address.
        addr: u64,
    },
    /// No operand lies in the zone but RSP does (the RSP check hit): not supported.
    StackInZone {
        /// The guest's RSP.
        rsp: u64,
    },
    /// The #UD is the guest's own (e.g. `ud2`, or nothing the check explains).
    GuestUd,
}

/// Classifies a #UD at the guest instruction `bytes` (at `pc`) with the guest state
/// `regs` before it and the FS/GS bases (see the module header).
pub fn classify_fault(
    bytes: &[u8],
    pc: u64,
    regs: &GuestRegs,
    fs_base: u64,
    gs_base: u64,
) -> IsolationFault {
    let i = Decoder::with_ip(64, bytes, pc, DecoderOptions::NONE).decode();
    if i.is_invalid() || matches!(i.mnemonic(), Mnemonic::Ud0 | Mnemonic::Ud1 | Mnemonic::Ud2) {
        return IsolationFault::GuestUd;
    }
    let mut factory = InstructionInfoFactory::new();
    let ops = mem_operands(&mut factory, &i);
    let mut non_canonical = None;
    for m in ops.iter() {
        let seg = match m.seg {
            SegBase::Flat => 0,
            SegBase::Fs => fs_base,
            SegBase::Gs => gs_base,
        };
        let addr = m.effective_address(regs).wrapping_add(seg);
        if in_isolation_zone(addr) {
            return IsolationFault::Zone {
                addr,
                access: m.access,
            };
        }
        if ((addr as i64) << 16 >> 16) as u64 != addr {
            non_canonical.get_or_insert(addr);
        }
    }
    if let Some(addr) = non_canonical {
        return IsolationFault::NonCanonical { addr };
    }
    let rsp = regs.get(Gpr::Rsp);
    if in_isolation_zone(rsp) && ops.iter().any(|m| m.base == Some(Gpr::Rsp)) {
        return IsolationFault::StackInZone { rsp };
    }
    IsolationFault::GuestUd
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_zone_is_slots_256_to_259() {
        assert!(in_isolation_zone(0xffff_8000_0000_0000));
        assert!(in_isolation_zone(0xffff_8080_0000_0000));
        assert!(in_isolation_zone(0xffff_8100_0000_0000));
        assert!(in_isolation_zone(0xffff_81ff_ffff_ffff));
        assert!(!in_isolation_zone(0xffff_8200_0000_0000));
        assert!(!in_isolation_zone(0x0000_7fff_ffff_ffff));
        assert!(!in_isolation_zone(0xffff_ffff_8000_0000));
        assert_eq!(ISOLATION_ZONE_START >> 41, 0x7f_ffc0);
        assert_eq!((ISOLATION_ZONE_END - 1) >> 41, 0x7f_ffc0);
    }
}
