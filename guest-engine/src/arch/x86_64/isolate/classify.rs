//! What a #UD at a translated guest instruction means: an isolation check's trap (and
//! which operand), a non-canonical operand, or the guest's own #UD.

use iced_x86::{Decoder, DecoderOptions, InstructionInfoFactory, Mnemonic, Register};

use super::super::decode::{listed_memory, mem_operands};
use super::super::mangle::hw;
use super::{addressing_32, bit_offset_register, in_isolation_zone, Fence};
use crate::context::{Gpr, GuestRegs};
use crate::instrument::SegBase;

/// The sign-extended value of the 16/32/64-bit GPR `r`.
fn gpr_value(regs: &GuestRegs, r: Register) -> i64 {
    let full = Gpr::from_number(hw(r)).map_or(0, |g| regs.get(g));
    match r.size() {
        2 => i64::from(full as u16 as i16),
        4 => i64::from(full as u32 as i32),
        _ => full as i64,
    }
}

/// The linear address operand `m` of `i` accesses with the guest state `regs` before
/// `i` and the FS/GS bases (`addr32`: `i` uses 32-bit addressing, [`addressing_32`]):
/// the effective address, `xlat`'s `rbx + al`, a bit test's offset by its bit-offset
/// register, then the segment base.
pub(crate) fn linear_address(
    i: &iced_x86::Instruction,
    m: &crate::instrument::MemOperand,
    regs: &GuestRegs,
    fs_base: u64,
    gs_base: u64,
    addr32: bool,
) -> u64 {
    let seg = match m.seg {
        SegBase::Flat => 0,
        SegBase::Fs => fs_base,
        SegBase::Gs => gs_base,
    };
    let mut offset = if i.mnemonic() == Mnemonic::Xlatb {
        regs.get(Gpr::Rbx).wrapping_add(regs.get(Gpr::Rax) & 0xff)
    } else {
        m.effective_address(regs)
    };
    if let Some((r, size)) = bit_offset_register(i) {
        let v = gpr_value(regs, r);
        let bits = i64::from(size * 8);
        offset = offset.wrapping_add((v.div_euclid(bits) * i64::from(size)) as u64);
    }
    if addr32 {
        offset &= 0xffff_ffff;
    }
    offset.wrapping_add(seg)
}

/// What a #UD raised at the translation of a guest instruction means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IsolationFault {
    /// An operand's linear address lies in the reserved zone (user mode: in the upper
    /// half): the access gets what the guest's own page tables say (as a hardware #PF at
    /// `addr` would).
    Zone {
        /// The operand's linear address.
        addr: u64,
        /// `instrument::access` bits of the operand (READ, WRITE).
        access: u32,
    },
    /// An operand's address is non-canonical (the check's only false positives): #GP(0),
    /// or #SS(0) if the operand is in the stack segment.
    NonCanonical {
        /// The address.
        addr: u64,
        /// The operand references SS (a push or pop, an RSP- or RBP-based operand, an
        /// `ss:` override): the CPU raises #SS(0), as native execution did before the
        /// check's flag-free form gave way to its `cmp` form here.
        stack: bool,
    },
    /// No operand lies in the zone but a base register (plus its bias) does (a
    /// base-register check hit): the operand at `addr` (canonical, outside the fence)
    /// gets what the guest's tables say, but the trace cannot run it natively.
    BaseInZone {
        /// The base register's value (base + index * scale).
        base: u64,
        /// The operand's linear address.
        addr: u64,
        /// `instrument::access` bits of the operand (READ, WRITE).
        access: u32,
    },
    /// The #UD is the guest's own (e.g. `ud2`, or nothing the check explains).
    GuestUd,
}

/// Classifies a #UD at the guest instruction `bytes` (at `pc`), translated in `mode` (its
/// bitness and its CPL's `Fence`), with the guest state `regs` before it and the FS/GS
/// bases (see the module header). `vector_lane` is the lane address the check of a
/// gather/scatter tested last (`Engine::vector_lane_checked`; ignored for other
/// instructions).
pub fn classify_fault(
    mode: crate::Mode,
    bytes: &[u8],
    pc: u64,
    regs: &GuestRegs,
    fs_base: u64,
    gs_base: u64,
    vector_lane: u64,
) -> IsolationFault {
    let fence = Fence::for_cpl(mode.cpl());
    let i = Decoder::with_ip(mode.bitness(), bytes, pc, DecoderOptions::NONE).decode();
    if i.is_invalid() || matches!(i.mnemonic(), Mnemonic::Ud0 | Mnemonic::Ud1 | Mnemonic::Ud2) {
        return IsolationFault::GuestUd;
    }
    if i.vsib().is_some() {
        let scatter = matches!(
            i.mnemonic(),
            Mnemonic::Vpscatterdd
                | Mnemonic::Vpscatterdq
                | Mnemonic::Vscatterdps
                | Mnemonic::Vscatterdpd
                | Mnemonic::Vpscatterqd
                | Mnemonic::Vpscatterqq
                | Mnemonic::Vscatterqps
                | Mnemonic::Vscatterqpd
        );
        let addr = vector_lane;
        let canonical = ((addr as i64) << 16 >> 16) as u64 == addr;
        if fence.contains(addr) && (canonical || fence == Fence::Zone) {
            let access = if scatter {
                crate::instrument::access::WRITE
            } else {
                crate::instrument::access::READ
            };
            return IsolationFault::Zone { addr, access };
        }
        // The check's false positives: non-canonical lanes with bits 56:41 = 0xffc0 (user
        // mode: any non-canonical lane).
        let zone_like = (addr >> 41) & 0xffff == 0xffc0 || fence == Fence::UpperHalf;
        if zone_like && !canonical {
            return IsolationFault::NonCanonical { addr, stack: false };
        }
        return IsolationFault::GuestUd;
    }
    let mut factory = InstructionInfoFactory::new();
    let ops = mem_operands(&mut factory, &i);
    let addr32 = addressing_32(&i);
    let mut non_canonical = None;
    // (`mem_operands` keeps only the segment *bases*: whether an operand is in SS comes
    // from iced's own list, in the same order.)
    let stack_segment: alloc::vec::Vec<bool> = listed_memory(factory.info(&i))
        .map(|u| u.segment() == Register::SS)
        .collect();
    for (k, m) in ops.iter().enumerate() {
        let addr = linear_address(&i, m, regs, fs_base, gs_base, addr32);
        let canonical = ((addr as i64) << 16 >> 16) as u64 == addr;
        if in_isolation_zone(addr) || (fence.contains(addr) && canonical) {
            return IsolationFault::Zone {
                addr,
                access: m.access,
            };
        }
        // An access that starts canonical but runs past the canonical boundary is #GP(0)
        // too (its last byte is non-canonical).
        let last = addr.wrapping_add(u64::from(m.size.max(1)) - 1);
        let last_canonical = ((last as i64) << 16 >> 16) as u64 == last;
        if !canonical || (!last_canonical && last > addr) {
            let stack = stack_segment.get(k).copied().unwrap_or(false);
            non_canonical.get_or_insert((addr, stack));
        }
    }
    if let Some((addr, stack)) = non_canonical {
        return IsolationFault::NonCanonical { addr, stack };
    }
    for m in ops.iter() {
        let addr = m.effective_address(regs);
        let base = addr.wrapping_sub(m.disp);
        // The index fast path checks the base register alone, wide.
        let wide = m
            .index
            .and(m.base)
            .map(|b| regs.get(b))
            .filter(|b| fence.base_hits(*b, true));
        if m.seg == SegBase::Flat && fence.base_hits(base, false) {
            return IsolationFault::BaseInZone {
                base,
                addr,
                access: m.access,
            };
        }
        if let (SegBase::Flat, Some(base)) = (m.seg, wide) {
            return IsolationFault::BaseInZone {
                base,
                addr,
                access: m.access,
            };
        }
    }
    IsolationFault::GuestUd
}
