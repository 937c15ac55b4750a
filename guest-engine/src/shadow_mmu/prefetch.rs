//! Prefetch: a 4 KiB fill also shadows the other pages of its aligned group (in the same
//! shadow page table) that the guest has already accessed, so that pages touched again
//! after a CR3 write or a flush do not fault one by one.
//!
//! Invariant: prefetch writes nothing to the guest's tables. It only installs what a TLB
//! may hold without a walk's side effects: leaves whose guest entry is present, valid
//! (no reserved bit) and already accessed (A = 1), with the rights of the walk above
//! them; writable only if already dirty; never a supervisor page in the user view, never
//! a frame the guest may not map, never over a present shadow leaf.

use super::phys::PhysMem;
use super::reverse_map::ShadowMapping;
use super::walk::GuestLeaf;
use super::{pte, ShadowError, ShadowMmu, View};
use crate::addr::{GuestPhys, GuestVirt};

impl<M: PhysMem> ShadowMmu<M> {
    /// After the 4 KiB shadow leaf at `slot` was filled for `va` (in `view`) from the
    /// guest leaf `leaf`, shadows the rest of `va`'s group.
    pub(super) fn prefetch(
        &mut self,
        leaf: &GuestLeaf,
        view: View,
        va: GuestVirt,
        slot: GuestPhys,
    ) -> Result<(), ShadowError> {
        let group = self.config.prefetch as u64;
        let own = pte::index(va.0, 1) as u64;
        let first = own & !(group - 1);
        let shadow_table = slot.0 & !(pte::TABLE_BYTES - 1);
        let region = va.0 & !(pte::LARGE_PAGE_BYTES - 1);
        for i in (first..first + group).filter(|&i| i != own) {
            let nslot = GuestPhys(shadow_table + i * pte::ENTRY_BYTES);
            if self.read(nslot)? & pte::PRESENT != 0 {
                continue;
            }
            let Some(n) = self.neighbour(leaf, i)? else {
                continue;
            };
            if (view == View::User && !n.user) || !self.mem.guest_may_map(n.frame) {
                continue;
            }
            let nva = GuestVirt(region | i << pte::PAGE_SHIFT);
            self.note_kernel_leaf(nva, n.user, view);
            let e = self.shadow_leaf(&n, view, false);
            self.write(nslot, e)?;
            self.rmap.insert(
                n.frame,
                ShadowMapping {
                    slot: nslot,
                    va: nva,
                },
            );
            self.stats.prefetched += 1;
        }
        Ok(())
    }

    /// The guest leaf of page `i` of the 2 MiB region around `leaf`'s page, if the guest
    /// has accessed it and it is valid.
    fn neighbour(&mut self, leaf: &GuestLeaf, i: u64) -> Result<Option<GuestLeaf>, ShadowError> {
        if leaf.level > 1 {
            // One large guest leaf (accessed by this walk) maps the whole region.
            let base = leaf.frame.0 & !(pte::LARGE_PAGE_BYTES - 1);
            return Ok(Some(GuestLeaf {
                frame: GuestPhys(base + (i << pte::PAGE_SHIFT)),
                ad_updates: 0,
                ..*leaf
            }));
        }
        let slot = GuestPhys((leaf.slot.0 & !(pte::TABLE_BYTES - 1)) + i * pte::ENTRY_BYTES);
        let e = self
            .mem
            .read_u64(slot)
            .ok_or(ShadowError::GuestTableUnbacked(slot))?;
        let nx_reserved = if self.control.nxe { 0 } else { pte::NO_EXECUTE };
        let reserved = pte::phys_reserved_mask(self.config.phys_addr_bits) | nx_reserved;
        let used = pte::PRESENT | pte::ACCESSED;
        if e & used != used || e & reserved != 0 {
            return Ok(None);
        }
        Ok(Some(GuestLeaf {
            frame: GuestPhys(e & pte::ADDR_MASK),
            level: 1,
            writable: leaf.upper.writable && e & pte::WRITABLE != 0,
            user: leaf.upper.user && e & pte::USER != 0,
            no_execute: leaf.upper.no_execute || (self.control.nxe && e & pte::NO_EXECUTE != 0),
            global: e & pte::GLOBAL != 0,
            dirty: e & pte::DIRTY != 0,
            cache_bits: e & (pte::PWT | pte::PCD | pte::PTE_PAT),
            ad_updates: 0,
            slot,
            upper: leaf.upper,
        }))
    }
}
