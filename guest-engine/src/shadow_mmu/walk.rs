//! The guest page walk, done as hardware does it: 4 levels from the guest CR3, present
//! and reserved-bit checks at every level, 2 MiB and 1 GiB leaves, permissions combined
//! over all levels (R/W and U/S ANDed, XD ORed), then the access check for the *virtual*
//! CPL with CR0.WP, EFER.NXE and CR4.SMEP semantics, and the page-fault error code a real
//! CPU would push.
//!
//! Every paging structure the guest names must be a frame the guest may map
//! ([`PhysMem::guest_may_map`]): the A/D updates write into them.
//!
//! A/D policy (invariant): Accessed bits are set on every level and Dirty on the leaf
//! (for a write) only when the translation succeeds; a faulting walk writes nothing. Bits
//! already set are not rewritten.

use super::phys::PhysMem;
use super::pte;
use super::{Access, GuestFault, PagingControl, ShadowError, View};
use crate::addr::{GuestPhys, GuestVirt};

/// The #PF error-code bits and vector, under the names the shadow MMU uses (defined in
/// `kpin_abi::x86`). The fetch bit is reported only when EFER.NXE or CR4.SMEP is set, as
/// Intel CPUs do.
pub use kpin_abi::x86::pf::{
    FETCH as PF_FETCH, PRESENT as PF_PRESENT, RSVD as PF_RESERVED, USER as PF_USER,
    WRITE as PF_WRITE,
};
pub use kpin_abi::x86::vector::PF as PF_VECTOR;

/// Rights granted by paging-structure entries: R/W and U/S ANDed, XD ORed (with NXE).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rights {
    /// R/W = 1 on every entry.
    pub writable: bool,
    /// U/S = 1 on every entry.
    pub user: bool,
    /// XD = 1 on some entry (and EFER.NXE = 1).
    pub no_execute: bool,
}

/// The result of a successful guest walk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GuestLeaf {
    /// The 4 KiB guest frame containing the address (inside a large page if `level` > 1).
    pub frame: GuestPhys,
    /// Level of the guest leaf: 1 = 4 KiB, 2 = 2 MiB, 3 = 1 GiB.
    pub level: u8,
    /// R/W = 1 on every level.
    pub writable: bool,
    /// U/S = 1 on every level.
    pub user: bool,
    /// XD = 1 on some level (and EFER.NXE = 1).
    pub no_execute: bool,
    /// The leaf's G bit.
    pub global: bool,
    /// The leaf's D bit after this walk (set by it for a write).
    pub dirty: bool,
    /// PWT, PCD and PAT of the leaf, positioned as in a 4 KiB PTE.
    pub cache_bits: u64,
    /// Number of guest entries whose A or D bit this walk set.
    pub ad_updates: u32,
    /// Guest-physical address of the guest's leaf entry.
    pub slot: GuestPhys,
    /// The rights of the entries above the leaf (shared by every leaf of its table).
    pub upper: Rights,
}

/// Walks the guest tables rooted at `cr3` for `access` to `va` in `view`.
///
/// `Ok(Err(fault))` is a fault the guest must see; `Err` is an engine failure.
pub fn walk<M: PhysMem>(
    mem: &mut M,
    control: &PagingControl,
    phys_addr_bits: u32,
    cr3: u64,
    va: GuestVirt,
    access: Access,
    view: View,
) -> Result<Result<GuestLeaf, GuestFault>, ShadowError> {
    let fault =
        |extra: u32| GuestFault::page_fault(va, access_error_bits(control, access, view) | extra);
    let phys_rsvd = pte::phys_reserved_mask(phys_addr_bits);
    let nx_rsvd = if control.nxe { 0 } else { pte::NO_EXECUTE };

    let mut entries = [GuestPhys(0); pte::LEVELS as usize];
    let mut used = 0usize;
    let mut table = cr3 & pte::ADDR_MASK;
    let (mut writable, mut user, mut no_execute) = (true, true, false);
    let mut upper: Rights;
    let mut level = pte::LEVELS;
    let leaf = loop {
        if !mem.guest_may_map(GuestPhys(table)) {
            return Err(ShadowError::ForbiddenTable(GuestPhys(table)));
        }
        let slot = GuestPhys(table + pte::index(va.0, level) as u64 * pte::ENTRY_BYTES);
        let e = mem
            .read_u64(slot)
            .ok_or(ShadowError::GuestTableUnbacked(slot))?;
        if e & pte::PRESENT == 0 {
            return Ok(Err(fault(0)));
        }
        let is_leaf = level == 1 || (level <= 3 && e & pte::PAGE_SIZE != 0);
        let mut rsvd = phys_rsvd | nx_rsvd;
        match (level, is_leaf) {
            (4, _) => rsvd |= pte::PAGE_SIZE,
            (3, true) => rsvd |= pte::LARGE_1G_RESERVED,
            (2, true) => rsvd |= pte::LARGE_2M_RESERVED,
            _ => {}
        }
        if e & rsvd != 0 {
            return Ok(Err(fault(PF_PRESENT | PF_RESERVED)));
        }
        upper = Rights {
            writable,
            user,
            no_execute,
        };
        writable &= e & pte::WRITABLE != 0;
        user &= e & pte::USER != 0;
        no_execute |= control.nxe && e & pte::NO_EXECUTE != 0;
        entries[used] = slot;
        used += 1;
        if is_leaf {
            break e;
        }
        table = e & pte::ADDR_MASK;
        level -= 1;
    };

    let permitted = match (view, access) {
        (View::User, _) if !user => false,
        (View::User, Access::Write) => writable,
        (View::Kernel, Access::Write) => writable || !control.wp,
        (View::User, Access::Fetch) => !no_execute,
        (View::Kernel, Access::Fetch) => !no_execute && (!user || !control.smep),
        (_, Access::Read) => true,
    };
    if !permitted {
        return Ok(Err(fault(PF_PRESENT)));
    }

    let mut ad_updates = 0;
    for (k, slot) in entries[..used].iter().enumerate() {
        let e = mem
            .read_u64(*slot)
            .ok_or(ShadowError::GuestTableUnbacked(*slot))?;
        let mut bits = pte::ACCESSED;
        if k + 1 == used && access == Access::Write {
            bits |= pte::DIRTY;
        }
        if e & bits != bits {
            if !mem.or_u64(*slot, bits) {
                return Err(ShadowError::GuestTableUnbacked(*slot));
            }
            ad_updates += 1;
        }
    }

    let page_bytes = pte::level_page_bytes(level);
    let base = if level == 1 {
        leaf & pte::ADDR_MASK
    } else {
        leaf & pte::ADDR_MASK & !(page_bytes - 1)
    };
    let frame = GuestPhys(base + (va.0 & (page_bytes - 1) & !(pte::TABLE_BYTES - 1)));
    let pat = if level == 1 {
        leaf & pte::PTE_PAT
    } else if leaf & pte::LARGE_PAT != 0 {
        pte::PTE_PAT
    } else {
        0
    };
    Ok(Ok(GuestLeaf {
        frame,
        level,
        writable,
        user,
        no_execute,
        global: leaf & pte::GLOBAL != 0,
        dirty: leaf & pte::DIRTY != 0 || access == Access::Write,
        cache_bits: (leaf & (pte::PWT | pte::PCD)) | pat,
        ad_updates,
        slot: entries[used - 1],
        upper,
    }))
}

/// The W/R, U/S and I/D bits of a page-fault error code for `access` in `view`.
fn access_error_bits(control: &PagingControl, access: Access, view: View) -> u32 {
    let mut code = 0;
    if access == Access::Write {
        code |= PF_WRITE;
    }
    if view == View::User {
        code |= PF_USER;
    }
    if access == Access::Fetch && (control.nxe || control.smep) {
        code |= PF_FETCH;
    }
    code
}
