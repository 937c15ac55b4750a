//! Keeping a space's shadow leaves across a guest CR3 write: instead of dropping every
//! non-global leaf of the space being switched to (as a real CPU's CR3 write empties its
//! TLB of them), each is checked against the guest's tables *now* and kept if they still
//! say the same thing. This is what a CPU may do right after the write — cache, without
//! a walk's side effects, a translation whose paging-structure entries are present,
//! valid and already accessed (`prefetch.rs` relies on the same rule) — so the guest
//! cannot tell; it saves the shadow-miss trip (a ring-0 round trip, ~10^5 cycles) for
//! every page a process touches again after a context switch.
//!
//! The walk runs down the shadow tables and the guest's side by side, so the guest's
//! upper levels are read once per shadow table. A leaf is kept iff every guest entry on
//! its path is present, valid (no reserved bit) and accessed, the guest leaf is a 4 KiB
//! page, and the view may see it (the user view: U/S = 1 on every level); it is
//! rewritten with the frame, rights, dirty and global state the guest entries have now
//! (a leaf *moved* to another frame only if the guest may map that frame). Anything
//! else (guest large pages included) is dropped as before. Nothing is written to the
//! guest's tables.

use super::phys::PhysMem;
use super::reverse_map::ShadowMapping;
use super::walk::{GuestLeaf, Rights};
use super::{pte, ShadowError, ShadowMmu, View, RESERVED_SLOTS};
use crate::addr::{GuestPhys, GuestVirt};

impl<M: PhysMem> ShadowMmu<M> {
    /// After the guest's CR3 became `self.cr3`: the non-global leaves under the shadow
    /// `table` (a `level` table mapping from `va_base`, of a root of `view`) that the
    /// guest's `guest_table` (same level; `None`: not reachable) still maps alike are
    /// kept, the others dropped; global leaves stay (as `zap_table` with
    /// `keep_global`). Returns (whether `table` is now empty, whether a non-global leaf
    /// is left under it).
    pub(super) fn revalidate_table(
        &mut self,
        table: GuestPhys,
        level: u8,
        va_base: u64,
        guest_table: Option<u64>,
        rights: Rights,
        view: View,
    ) -> Result<(bool, bool), ShadowError> {
        let (mut empty, mut nonglobal) = (true, false);
        let mut next = 0;
        while let Some((i, e)) = self.next_present(table, next, pte::ENTRIES)? {
            next = i + 1;
            if level == pte::LEVELS && RESERVED_SLOTS.contains(&i) {
                continue;
            }
            let slot = Self::slot_addr(table, i);
            let mut va = va_base | (i as u64) << (pte::PAGE_SHIFT + 9 * u32::from(level - 1));
            if level == pte::LEVELS && i >= 256 {
                va |= 0xffff_0000_0000_0000;
            }
            let is_leaf = level == 1 || (level == 2 && e & pte::PAGE_SIZE != 0);
            if is_leaf && e & pte::SW_GLOBAL != 0 {
                empty = false;
                continue;
            }
            if !is_leaf && e & pte::SW_NONGLOBAL_BELOW == 0 {
                empty = false; // only global leaves below
                continue;
            }
            let guest = match guest_table {
                Some(t) => self.guest_entry(t, i, level)?,
                None => None,
            };
            if is_leaf {
                let kept = match (level, guest) {
                    (1, Some(g)) => self.keep_leaf(slot, e, g, rights, va, view)?,
                    _ => false,
                };
                if kept {
                    empty = false;
                    nonglobal |= self.read(slot)? & pte::SW_GLOBAL == 0;
                } else {
                    self.unlist_leaf(slot, e, level);
                    self.write(slot, 0)?;
                    self.stats.leaves_dropped += 1;
                }
                continue;
            }
            // A table: descend along the guest's table, unless the guest maps a large page
            // (or nothing) here.
            let down = guest.filter(|g| g & pte::PAGE_SIZE == 0);
            let child_rights = down.map_or(rights, |g| Rights {
                writable: rights.writable && g & pte::WRITABLE != 0,
                user: rights.user && g & pte::USER != 0,
                no_execute: rights.no_execute || (self.control.nxe && g & pte::NO_EXECUTE != 0),
            });
            let child = GuestPhys(e & pte::ADDR_MASK);
            let (child_empty, child_nonglobal) = self.revalidate_table(
                child,
                level - 1,
                va,
                down.map(|g| g & pte::ADDR_MASK),
                child_rights,
                view,
            )?;
            if child_empty {
                self.write(slot, 0)?;
                self.free_table(child);
            } else {
                empty = false;
                nonglobal |= child_nonglobal;
                if !child_nonglobal {
                    self.write(slot, e & !pte::SW_NONGLOBAL_BELOW)?;
                }
            }
        }
        Ok((empty, nonglobal))
    }

    /// Entry `i` of the guest's `level` table at `table` if it is present, valid and
    /// accessed, and the table a frame the guest may map; `None` otherwise.
    pub(super) fn guest_entry(
        &mut self,
        table: u64,
        i: usize,
        level: u8,
    ) -> Result<Option<u64>, ShadowError> {
        if !self.mem.guest_may_map(GuestPhys(table)) {
            return Ok(None);
        }
        let slot = GuestPhys(table + i as u64 * pte::ENTRY_BYTES);
        let Some(e) = self.mem.read_u64(slot) else {
            return Ok(None);
        };
        let mut reserved = pte::phys_reserved_mask(self.config.phys_addr_bits);
        if !self.control.nxe {
            reserved |= pte::NO_EXECUTE;
        }
        if level == pte::LEVELS {
            reserved |= pte::PAGE_SIZE;
        }
        let used = pte::PRESENT | pte::ACCESSED;
        Ok((e & used == used && e & reserved == 0).then_some(e))
    }

    /// The shadow leaf `e` at `slot` (for `va`) stays if `view` may see the guest PTE
    /// `g` (present, valid, accessed, under entries granting `rights`): rewritten with
    /// what `g` says now. If `g` maps another frame (one the guest may map), the leaf
    /// follows it, as a fill would after the flush: `text_poke` maps each page it
    /// patches at the same address of its own space, so the next switch there finds a
    /// new frame, and dropping the leaf cost a shadow-miss trip per patch. Returns
    /// whether a leaf stayed.
    fn keep_leaf(
        &mut self,
        slot: GuestPhys,
        e: u64,
        g: u64,
        rights: Rights,
        va: u64,
        view: View,
    ) -> Result<bool, ShadowError> {
        let frame = GuestPhys(g & pte::ADDR_MASK);
        let user = rights.user && g & pte::USER != 0;
        if view == View::User && !user {
            return Ok(false);
        }
        let old_frame = GuestPhys(e & pte::ADDR_MASK);
        let moved = frame != old_frame;
        if moved && !self.mem.guest_may_map(frame) {
            return Ok(false);
        }
        let leaf = GuestLeaf {
            frame,
            level: 1,
            writable: rights.writable && g & pte::WRITABLE != 0,
            user,
            no_execute: rights.no_execute || (self.control.nxe && g & pte::NO_EXECUTE != 0),
            global: g & pte::GLOBAL != 0,
            dirty: g & pte::DIRTY != 0,
            cache_bits: g & (pte::PWT | pte::PCD | pte::PTE_PAT),
            ad_updates: 0,
            slot: GuestPhys(0),
            upper: rights,
        };
        self.note_kernel_leaf(GuestVirt(va), user, view);
        let new = self.shadow_leaf(&leaf, view, false);
        // A and D in `e` are the hardware's, set through this very leaf: one that differs
        // only in them says what it said, and rewriting it is a store this KVM traps
        // (~3.5 k cycles: most of a parked lower half's revalidation, `lend.rs`).
        if (new ^ e) & !(pte::ACCESSED | pte::DIRTY) != 0 {
            self.narrowed = true;
            self.write(slot, new)?;
        }
        if moved {
            self.unlist_leaf(slot, e, 1);
            let va = GuestVirt(va);
            self.rmap.insert(frame, ShadowMapping { slot, va });
            self.stats.leaves_moved += 1;
        } else {
            self.stats.leaves_kept += 1;
        }
        Ok(true)
    }
}
