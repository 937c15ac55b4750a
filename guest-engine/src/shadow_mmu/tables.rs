//! Plumbing of the shadow tables: finding and building leaf slots (4 KiB PTEs and 2 MiB
//! PDEs), dropping leaves with their reverse-map entries, freeing emptied tables, the
//! root LRU, and the hardware-flush debt.
//!
//! Invariants: a shadow PD entry is either a table pointer or a 2 MiB leaf, never both
//! for the same VA (building one kind drops the other); every dropped leaf leaves the
//! reverse map and, if it could be in the hardware TLB, the hardware-flush debt.

use super::phys::PhysMem;
use super::{pte, HwFlush, ShadowError, ShadowMmu, MAX_HW_FLUSH_PAGES, RESERVED_SLOTS};
use crate::addr::{GuestPhys, GuestVirt};

/// A present shadow leaf.
#[derive(Clone, Copy, Debug)]
pub(super) struct LeafRef {
    /// Guest-physical address of the entry.
    pub slot: GuestPhys,
    /// The entry.
    pub entry: u64,
    /// 1 = 4 KiB PTE, 2 = 2 MiB PDE.
    pub level: u8,
    /// Every entry of the walk, the leaf's included, allows writes (what the hardware
    /// combines).
    pub writable: bool,
}

impl<M: PhysMem> ShadowMmu<M> {
    pub(super) fn slot_addr(table: GuestPhys, index: usize) -> GuestPhys {
        GuestPhys(table.0 + index as u64 * pte::ENTRY_BYTES)
    }

    pub(super) fn read(&mut self, pa: GuestPhys) -> Result<u64, ShadowError> {
        self.mem
            .read_u64(pa)
            .ok_or(ShadowError::ShadowTableUnbacked(pa))
    }

    /// The first present entry of the shadow `table` at an index in `from..end`.
    pub(super) fn next_present(
        &mut self,
        table: GuestPhys,
        from: usize,
        end: usize,
    ) -> Result<Option<(usize, u64)>, ShadowError> {
        self.mem
            .next_present(table, from, end.min(pte::ENTRIES))
            .map_err(ShadowError::ShadowTableUnbacked)
    }

    pub(super) fn write(&mut self, pa: GuestPhys, value: u64) -> Result<(), ShadowError> {
        if self.mem.write_u64(pa, value) {
            Ok(())
        } else {
            Err(ShadowError::ShadowTableUnbacked(pa))
        }
    }

    pub(super) fn alloc_table(&mut self) -> Result<GuestPhys, ShadowError> {
        let t = self.mem.alloc_table().ok_or(ShadowError::OutOfTables)?;
        self.stats.tables += 1;
        Ok(t)
    }

    pub(super) fn free_table(&mut self, t: GuestPhys) {
        self.narrowed = true;
        self.mem.free_table(t);
        self.stats.tables = self.stats.tables.saturating_sub(1);
    }

    /// The present shadow leaf mapping `va` under `root`, if any.
    pub(super) fn find_leaf(
        &mut self,
        root: GuestPhys,
        va: GuestVirt,
    ) -> Result<Option<LeafRef>, ShadowError> {
        let mut table = root;
        let mut writable = true;
        for level in (1..=pte::LEVELS).rev() {
            let slot = Self::slot_addr(table, pte::index(va.0, level));
            let e = self.read(slot)?;
            if e & pte::PRESENT == 0 {
                return Ok(None);
            }
            writable &= e & pte::WRITABLE != 0;
            if level == 1 || (level == 2 && e & pte::PAGE_SIZE != 0) {
                return Ok(Some(LeafRef {
                    slot,
                    entry: e,
                    level,
                    writable,
                }));
            }
            table = GuestPhys(e & pte::ADDR_MASK);
        }
        Ok(None)
    }

    /// The slot of a `level` leaf (1 or 2) for `va` under `root`, building missing
    /// tables. A leaf of the other kind in the way is dropped (a 2 MiB leaf before a page
    /// table is built under it; a page table and its leaves before a 2 MiB leaf).
    pub(super) fn leaf_slot_alloc(
        &mut self,
        root: GuestPhys,
        va: GuestVirt,
        level: u8,
    ) -> Result<GuestPhys, ShadowError> {
        let mut table = root;
        for l in (level + 1..=pte::LEVELS).rev() {
            let slot = Self::slot_addr(table, pte::index(va.0, l));
            let mut e = self.read(slot)?;
            if l == 2 && e & pte::PRESENT != 0 && e & pte::PAGE_SIZE != 0 {
                self.forget_leaf(slot, e, 2, va)?;
                e = 0;
            }
            table = if e & pte::PRESENT != 0 {
                if e & pte::SW_NONGLOBAL_BELOW == 0 {
                    self.write(slot, e | pte::SW_NONGLOBAL_BELOW)?;
                }
                GuestPhys(e & pte::ADDR_MASK)
            } else {
                let t = self.alloc_table()?;
                let flags = pte::PRESENT | pte::WRITABLE | pte::USER | pte::SW_NONGLOBAL_BELOW;
                self.write(slot, t.0 | flags)?;
                t
            };
        }
        let slot = Self::slot_addr(table, pte::index(va.0, level));
        if level == 2 {
            let e = self.read(slot)?;
            if e & pte::PRESENT != 0 && e & pte::PAGE_SIZE == 0 {
                let child = GuestPhys(e & pte::ADDR_MASK);
                self.zap_table(child, 1, false)?;
                self.write(slot, 0)?;
                self.free_table(child);
                self.note_hw_flush(va.page());
            }
        }
        Ok(slot)
    }

    /// Drops the present leaf `e` at `slot` (a `level` leaf mapping `va`).
    pub(super) fn forget_leaf(
        &mut self,
        slot: GuestPhys,
        e: u64,
        level: u8,
        va: GuestVirt,
    ) -> Result<(), ShadowError> {
        if e & pte::PRESENT == 0 {
            return Ok(());
        }
        self.unlist_leaf(slot, e, level);
        self.write(slot, 0)?;
        self.stats.leaves_dropped += 1;
        self.note_hw_flush(va.page());
        Ok(())
    }

    /// Removes the present leaf `e` at `slot` from the reverse map.
    pub(super) fn unlist_leaf(&mut self, slot: GuestPhys, e: u64, level: u8) {
        self.narrowed = true;
        let base = GuestPhys(pte::leaf_base(e, level));
        if level == 2 {
            self.rmap.remove_large(base, slot);
        } else {
            self.rmap.remove(base, slot);
        }
    }

    /// Drops the leaves under `table` (a `level` table), keeping global ones if
    /// `keep_global`; frees emptied sub-tables. Returns whether `table` is now empty.
    /// At the root, the reserved slots are skipped (and the engine slots kept).
    /// With `keep_global`, subtrees whose entry lacks `pte::SW_NONGLOBAL_BELOW` are
    /// skipped (they hold only global leaves) and the mark is cleared where only global
    /// leaves remain.
    pub(super) fn zap_table(
        &mut self,
        table: GuestPhys,
        level: u8,
        keep_global: bool,
    ) -> Result<bool, ShadowError> {
        let mut empty = true;
        let mut next = 0;
        while let Some((i, e)) = self.next_present(table, next, pte::ENTRIES)? {
            next = i + 1;
            if level == pte::LEVELS && RESERVED_SLOTS.contains(&i) {
                continue;
            }
            let slot = Self::slot_addr(table, i);
            if level == 1 || (level == 2 && e & pte::PAGE_SIZE != 0) {
                if keep_global && e & pte::SW_GLOBAL != 0 {
                    empty = false;
                } else {
                    self.unlist_leaf(slot, e, level);
                    self.write(slot, 0)?;
                    self.stats.leaves_dropped += 1;
                }
            } else if keep_global && e & pte::SW_NONGLOBAL_BELOW == 0 {
                // Only global leaves below (see `pte::SW_NONGLOBAL_BELOW`).
                empty = false;
            } else {
                let child = GuestPhys(e & pte::ADDR_MASK);
                if self.zap_table(child, level - 1, keep_global)? {
                    self.write(slot, 0)?;
                    self.free_table(child);
                } else {
                    empty = false;
                    if keep_global {
                        // What is left below is global.
                        self.write(slot, e & !pte::SW_NONGLOBAL_BELOW)?;
                    }
                }
            }
        }
        Ok(empty)
    }

    /// Evicts the least recently used root outside `keep_space`, or the oldest at all.
    pub(super) fn evict_lru(&mut self, keep_space: u64) -> Result<(), ShadowError> {
        let pick = self
            .roots
            .iter()
            .enumerate()
            .filter(|(_, r)| r.space != keep_space)
            .min_by_key(|(_, r)| r.last_use)
            .or_else(|| {
                self.roots
                    .iter()
                    .enumerate()
                    .min_by_key(|(_, r)| r.last_use)
            })
            .map(|(i, _)| i);
        let Some(i) = pick else {
            return Ok(());
        };
        let victim = self.roots[i].root;
        self.drop_parked(victim)?;
        let victim = self.roots.swap_remove(i);
        self.zap_table(victim.root, pte::LEVELS, false)?;
        self.free_table(victim.root);
        self.stats.roots_evicted += 1;
        self.hw_flush = HwFlush::All;
        Ok(())
    }

    /// Records that the hardware TLB may hold a stale entry for `va`.
    pub(super) fn note_hw_flush(&mut self, va: GuestVirt) {
        match &mut self.hw_flush {
            HwFlush::All => {}
            HwFlush::None => self.hw_flush = HwFlush::Pages(alloc::vec![va]),
            HwFlush::Pages(pages) => {
                if pages.len() >= MAX_HW_FLUSH_PAGES {
                    self.hw_flush = HwFlush::All;
                } else if !pages.contains(&va) {
                    pages.push(va);
                }
            }
        }
    }
}
