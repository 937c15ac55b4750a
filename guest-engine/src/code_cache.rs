//! The code cache: the embedder's raw region carved per `layout`, the bump allocator for
//! fragments, the ⟨VA, PA, mode⟩ fragment map, the exit table, the IBL table and the
//! SoftTLB mirror.
//!
//! Invariants: fragments are allocated in increasing address order between flushes (so a
//! cache PC maps to a fragment by binary search); a flush drops every fragment, exit, link
//! and IBL entry at once; IBL entries point at fragment `entry` points and are valid only
//! while the VA → PA mapping they were inserted under holds (the dispatcher clears the
//! table whenever the SoftTLB mirror changes a mapping).

use alloc::collections::BTreeMap;
use alloc::vec::Vec;

use crate::addr::{CachePc, GuestPhys, GuestVirt, PAGE_BYTES};
use crate::arch::{emit_gencode, CtxAddrs, Gencode, XsaveAreas};
use crate::context::CacheContext;
use crate::error::EngineError;
use crate::fragment::{ExitRecord, Fragment};
use crate::guest_memory::Mode;
use crate::layout::{
    COUNTERS_OFFSET, GENCODE_OFFSET, IBL_ENTRIES, IBL_ENTRY_BYTES, IBL_HASH_BITS, IBL_OFFSET,
    IBL_TABLE_BYTES, MAX_REGION_BYTES, MIN_REGION_BYTES, RC_BYTES, RC_ENTRIES, RC_OFFSET,
    SOFTTLB_ENTRIES, SOFTTLB_OFFSET, TRACES_OFFSET, XSAVE_GUEST_OFFSET, XSAVE_HOST_OFFSET,
};

/// Fragment map key.
pub(crate) type Key = (u64, u64, u32);

/// The carved region and its bookkeeping.
pub(crate) struct CodeCache {
    base: *mut u8,
    len: usize,
    pub ctx: CtxAddrs,
    pub gen: Gencode,
    cursor: usize,
    pub fragments: Vec<Fragment>,
    pub by_key: BTreeMap<Key, u32>,
    pub exits: Vec<ExitRecord>,
    /// Bumped by every flush.
    pub generation: u64,
}

impl CodeCache {
    /// # Safety
    /// `base..base+len` must be readable, writable and executable memory owned by the
    /// engine for its lifetime, page aligned.
    pub(crate) unsafe fn new(
        base: *mut u8,
        len: usize,
        save_xstate: bool,
    ) -> Result<Self, EngineError> {
        if !(MIN_REGION_BYTES..=MAX_REGION_BYTES).contains(&len) {
            return Err(EngineError::RegionSize(len));
        }
        if base as usize & (PAGE_BYTES as usize - 1) != 0 {
            return Err(EngineError::RegionAlignment);
        }
        // SAFETY: the region is writable for `len` bytes; the fixed part is zeroed (empty
        // IBL, empty SoftTLB, zero counters, initial XSAVE headers = init state).
        unsafe { core::ptr::write_bytes(base, 0, TRACES_OFFSET) };
        let ctx = CtxAddrs::new(base as u64);
        let xs = save_xstate.then(|| XsaveAreas {
            guest: base as u64 + XSAVE_GUEST_OFFSET as u64,
            host: base as u64 + XSAVE_HOST_OFFSET as u64,
        });
        let ibl = base as u64 + IBL_OFFSET as u64;
        // SAFETY: GENCODE_OFFSET..+GENCODE_BYTES lies in the region, which is RWX, and
        // the context and IBL table are in the same region (< 2 GiB away).
        let gen = unsafe { emit_gencode(base.add(GENCODE_OFFSET), &ctx, xs, Some(ibl)) };
        let mut c = Self {
            base,
            len,
            ctx,
            gen,
            cursor: TRACES_OFFSET,
            fragments: Vec::new(),
            by_key: BTreeMap::new(),
            exits: Vec::new(),
            generation: 0,
        };
        c.clear_softtlb();
        Ok(c)
    }

    pub(crate) fn context(&self) -> *mut CacheContext {
        self.base.cast()
    }

    pub(crate) fn addr(&self, off: usize) -> u64 {
        self.base as u64 + off as u64
    }

    pub(crate) fn ibl_table(&self) -> u64 {
        self.addr(IBL_OFFSET)
    }

    pub(crate) fn counters(&self) -> u64 {
        self.addr(COUNTERS_OFFSET)
    }

    pub(crate) fn softtlb_slot(&self, va: GuestVirt) -> u64 {
        let idx = (va.0 / PAGE_BYTES) as usize % SOFTTLB_ENTRIES;
        self.addr(SOFTTLB_OFFSET + idx * 16)
    }

    /// Next allocation address and bytes left.
    pub(crate) fn cursor(&self) -> (u64, usize) {
        (self.addr(self.cursor), self.len - self.cursor)
    }

    pub(crate) fn used_bytes(&self) -> usize {
        self.cursor - TRACES_OFFSET
    }

    /// Copies `code` to the cursor (which must be where it was translated for).
    pub(crate) fn commit(&mut self, code: &[u8]) -> CachePc {
        let at = self.addr(self.cursor);
        assert!(
            code.len() <= self.len - self.cursor,
            "commit beyond the region"
        );
        // SAFETY: the destination lies inside the RWX region (checked just above) and
        // does not overlap `code`, which lives on the heap.
        unsafe { core::ptr::copy_nonoverlapping(code.as_ptr(), at as *mut u8, code.len()) };
        self.cursor += code.len();
        CachePc(at)
    }

    /// Drops every fragment, exit, link and IBL entry.
    pub(crate) fn flush(&mut self) {
        self.fragments.clear();
        self.by_key.clear();
        self.exits.clear();
        self.cursor = TRACES_OFFSET;
        self.clear_ibl();
        self.generation += 1;
    }

    /// Empties the IBL table and the return cache.
    pub(crate) fn clear_ibl(&mut self) {
        // SAFETY: the IBL table and the return cache lie inside the region.
        unsafe {
            core::ptr::write_bytes(self.base.add(IBL_OFFSET), 0, IBL_TABLE_BYTES);
            core::ptr::write_bytes(self.base.add(RC_OFFSET), 0, RC_BYTES);
        }
    }

    pub(crate) fn xsave_guest(&self) -> u64 {
        self.addr(XSAVE_GUEST_OFFSET)
    }

    pub(crate) fn rc_table(&self) -> u64 {
        self.addr(RC_OFFSET)
    }

    /// Points the return-cache slot of `va` at a fragment's `ret_entry`.
    pub(crate) fn rc_insert(&mut self, va: GuestVirt, ret_entry: CachePc) {
        let idx = (va.0 as usize) % RC_ENTRIES;
        // SAFETY: the slot lies inside the return cache.
        unsafe { ((self.rc_table() + 8 * idx as u64) as *mut u64).write(ret_entry.0) };
    }

    fn clear_softtlb(&mut self) {
        for i in 0..SOFTTLB_ENTRIES {
            let slot = self.addr(SOFTTLB_OFFSET + i * 16) as *mut u64;
            // SAFETY: the slot lies inside the region; u64::MAX is never a page address.
            unsafe { slot.write(u64::MAX) };
        }
    }

    /// The region `[start, end)`.
    pub(crate) fn region(&self) -> (u64, u64) {
        (self.base as u64, self.base as u64 + self.len as u64)
    }

    /// Forgets the mirror entry for `va`'s page.
    pub(crate) fn invalidate_softtlb(&mut self, va: GuestVirt) {
        let slot = self.softtlb_slot(va) as *mut u64;
        // SAFETY: the slot (two u64) lies inside the region.
        unsafe {
            if slot.read() == va.page().0 {
                slot.write(u64::MAX);
                slot.add(1).write(u64::MAX);
            }
        }
    }

    /// Records `va → pa` in the SoftTLB mirror read by PA checks. Returns whether a
    /// different mapping for that VA was replaced.
    pub(crate) fn fill_softtlb(&mut self, va: GuestVirt, pa: GuestPhys) -> bool {
        let slot = self.softtlb_slot(va) as *mut u64;
        // SAFETY: the slot (two u64) lies inside the region.
        unsafe {
            let old_va = slot.read();
            let old_pa = slot.add(1).read();
            slot.write(va.page().0);
            slot.add(1).write(pa.page().0);
            old_va == va.page().0 && old_pa != pa.page().0
        }
    }

    /// Inserts `va → entry` into the IBL table (two-way bucket, first way evicted).
    pub(crate) fn ibl_insert(&mut self, va: GuestVirt, entry: CachePc) {
        let idx = (va.0 & ((1 << IBL_HASH_BITS) - 1)) as usize;
        debug_assert!(idx + 1 < IBL_ENTRIES);
        let e0 = (self.ibl_table() + (idx * IBL_ENTRY_BYTES) as u64) as *mut u64;
        let tag = va.0.wrapping_neg();
        // SAFETY: bucket idx and idx+1 lie inside the table (IBL_ENTRIES has one spare).
        unsafe {
            let e1 = e0.add(2);
            let slot = if e0.read() == 0 || e0.read() == tag {
                e0
            } else if e1.read() == 0 || e1.read() == tag {
                e1
            } else {
                e1.write(e0.read());
                e1.add(1).write(e0.add(1).read());
                e0
            };
            slot.add(1).write(entry.0);
            slot.write(tag);
        }
    }

    /// The fragment containing `pc`, if any.
    pub(crate) fn fragment_at(&self, pc: CachePc) -> Option<&Fragment> {
        let i = self.fragments.partition_point(|f| f.base.0 <= pc.0);
        let f = self.fragments.get(i.checked_sub(1)?)?;
        (pc.0 < f.base.0 + f.len as u64).then_some(f)
    }

    pub(crate) fn lookup(&self, va: GuestVirt, pa: GuestPhys, mode: Mode) -> Option<u32> {
        self.by_key.get(&(va.0, pa.0, mode.0)).copied()
    }
}
