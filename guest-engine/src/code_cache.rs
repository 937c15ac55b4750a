//! The code cache: the embedder's raw region carved per `layout`, the bump allocator for
//! fragments, the ⟨VA, PA, mode⟩ fragment map, the exit table, and the per-mode IBL
//! tables and return caches. (The SoftTLB table in the same region is `softtlb.rs`'s.)
//!
//! Invariants: a fragment is found by the key ⟨VA, PA, mode⟩ of its first instruction
//! (PA: the full guest-physical address, so a frame mapped at two VAs, or a VA remapped
//! to another frame, gets its own fragments); fragments are allocated in increasing
//! address order between flushes (so a cache PC maps to a fragment by binary search); a
//! flush drops every fragment, exit, link and IBL entry at once; a mode's IBL table and
//! return cache only ever point at that mode's fragments (`entry` / `ret_entry`), and
//! are valid only while the VA → PA mappings they were inserted under hold (they are
//! cleared whenever the SoftTLB replaces a mapping or the embedder drops mappings). Every
//! filled slot is remembered (up to `FILLED_SLOTS_MAX` per table) so that a clear costs
//! O(fills). The dispatcher's front cache (`fast_lookup.rs`) has the IBL tables'
//! lifetime and is cleared with them.

use alloc::collections::BTreeMap;
use alloc::vec::Vec;

use crate::addr::{CachePc, GuestPhys, GuestVirt, PAGE_BYTES};
use crate::arch::{emit_gencode, CtxAddrs, Gencode, XsaveAreas};
use crate::context::CacheContext;
use crate::error::EngineError;
use crate::fast_lookup::FastLookup;
use crate::fragment::{ExitRecord, Fragment};
use crate::guest_memory::Mode;
use crate::layout::{
    COUNTERS_OFFSET, FILLED_SLOTS_MAX, GENCODE_OFFSET, IBL_ENTRIES, IBL_ENTRY_BYTES, IBL_HASH_BITS,
    IBL_OFFSET, IBL_STRIDE, IBL_TABLE_BYTES, MAX_REGION_BYTES, MIN_REGION_BYTES, MODE_SLOTS,
    RC_BYTES, RC_ENTRIES, RC_OFFSET, TRACES_OFFSET, XSAVE_GUEST_OFFSET, XSAVE_HOST_OFFSET,
};

/// Fragment map key.
pub(crate) type Key = (u64, u64, u32);

/// The slots of one lookup table filled since its last clear.
#[derive(Debug, Default)]
struct Filled {
    slots: Vec<u32>,
    /// More than `FILLED_SLOTS_MAX` fills: the next clear is a whole-table clear.
    overflow: bool,
}

impl Filled {
    fn note(&mut self, slot: usize) {
        if self.overflow {
            return;
        }
        if self.slots.len() == FILLED_SLOTS_MAX {
            self.overflow = true;
            self.slots = Vec::new();
        } else {
            self.slots.push(slot as u32);
        }
    }
}

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
    ibl_filled: [Filled; MODE_SLOTS],
    rc_filled: [Filled; MODE_SLOTS],
    /// The dispatcher's front cache, emptied with the IBL tables.
    pub fast: FastLookup,
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
        // IBL tables and return caches, zero counters, initial XSAVE headers = init
        // state; the SoftTLB empties its own table).
        unsafe { core::ptr::write_bytes(base, 0, TRACES_OFFSET) };
        // SAFETY: the context lies at the region's start (just zeroed, writable).
        unsafe { (*base.cast::<CacheContext>()).zone_bounds = crate::arch::zone_bounds() };
        let ctx = CtxAddrs::new(base as u64);
        let xs = save_xstate.then(|| XsaveAreas {
            guest: base as u64 + XSAVE_GUEST_OFFSET as u64,
            host: base as u64 + XSAVE_HOST_OFFSET as u64,
        });
        let ibl = core::array::from_fn(|m| (base as usize + IBL_OFFSET + m * IBL_STRIDE) as u64);
        // SAFETY: GENCODE_OFFSET..+GENCODE_BYTES lies in the region, which is RWX, and
        // the context and IBL tables are in the same region (< 2 GiB away).
        let gen = unsafe { emit_gencode(base.add(GENCODE_OFFSET), &ctx, xs, Some(ibl)) };
        Ok(Self {
            base,
            len,
            ctx,
            gen,
            cursor: TRACES_OFFSET,
            fragments: Vec::new(),
            by_key: BTreeMap::new(),
            exits: Vec::new(),
            generation: 0,
            ibl_filled: Default::default(),
            rc_filled: Default::default(),
            fast: FastLookup::new(),
        })
    }

    pub(crate) fn context(&self) -> *mut CacheContext {
        self.base.cast()
    }

    pub(crate) fn addr(&self, off: usize) -> u64 {
        self.base as u64 + off as u64
    }

    /// The IBL table of mode slot `m`.
    pub(crate) fn ibl_table(&self, m: usize) -> u64 {
        self.addr(IBL_OFFSET + m * IBL_STRIDE)
    }

    pub(crate) fn counters(&self) -> u64 {
        self.addr(COUNTERS_OFFSET)
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
        self.clear_lookups();
        self.generation += 1;
    }

    /// Empties every mode's IBL table and return cache, touching only filled slots unless
    /// a table overflowed its fill list.
    pub(crate) fn clear_lookups(&mut self) {
        self.fast.clear();
        for m in 0..MODE_SLOTS {
            let ibl = self.ibl_table(m) as *mut u8;
            let f = &mut self.ibl_filled[m];
            if f.overflow {
                // SAFETY: the table lies inside the region.
                unsafe { core::ptr::write_bytes(ibl, 0, IBL_TABLE_BYTES) };
            } else {
                for &i in &f.slots {
                    // SAFETY: a fill wrote bucket i or i+1, both inside the table (it has
                    // one spare bucket).
                    unsafe {
                        core::ptr::write_bytes(
                            ibl.add(i as usize * IBL_ENTRY_BYTES),
                            0,
                            2 * IBL_ENTRY_BYTES,
                        )
                    };
                }
            }
            *f = Filled::default();
            let rc = self.rc_table(m) as *mut u64;
            let f = &mut self.rc_filled[m];
            if f.overflow {
                // SAFETY: the return cache lies inside the region.
                unsafe { core::ptr::write_bytes(rc, 0, RC_ENTRIES) };
            } else {
                for &i in &f.slots {
                    // SAFETY: i < RC_ENTRIES (it was a slot index when filled).
                    unsafe { rc.add(i as usize).write(0) };
                }
            }
            *f = Filled::default();
        }
    }

    /// Empties what every mode's IBL table and return cache hold for the VAs of `page`
    /// (a page-aligned VA) and the front cache: both tables are indexed by the low 16
    /// bits of the VA, so a page's entries lie in one run of 4096 slots (IBL: plus the
    /// second way of its last bucket), and the IBL's tag tells which are the page's. The
    /// fill lists keep their slots (a later whole clear zeroes them again).
    pub(crate) fn clear_lookups_page(&mut self, page: GuestVirt) {
        self.fast.clear();
        let span = PAGE_BYTES as usize;
        let first = (page.0 as usize) & ((1 << IBL_HASH_BITS) - 1) & !(span - 1);
        let rc_first = (page.0 as usize) % RC_ENTRIES;
        for m in 0..MODE_SLOTS {
            let ibl = self.ibl_table(m) as *mut u64;
            let clear_bucket = |i: usize| {
                // SAFETY: bucket i < IBL_ENTRIES lies inside the table; 16 bytes each.
                unsafe {
                    let tag = ibl.add(2 * i);
                    let t = tag.read();
                    if t != 0 && t.wrapping_neg() & !(PAGE_BYTES - 1) == page.0 {
                        tag.write(0);
                        tag.add(1).write(0);
                    }
                }
            };
            let last = (first + span).min(IBL_ENTRIES - 1);
            let f = &self.ibl_filled[m];
            if !f.overflow && f.slots.len() < span {
                // Fewer fills than the page has slots: visit those (a fill wrote bucket
                // i or i + 1).
                for &i in &f.slots {
                    let i = i as usize;
                    if (first..=last).contains(&i) {
                        clear_bucket(i);
                    }
                    if (first..=last).contains(&(i + 1)) {
                        clear_bucket(i + 1);
                    }
                }
            } else {
                (first..=last).for_each(clear_bucket);
            }
            let rc = self.rc_table(m) as *mut u64;
            let f = &self.rc_filled[m];
            if !f.overflow && f.slots.len() < span {
                for &i in &f.slots {
                    let i = i as usize;
                    if (rc_first..rc_first + span).contains(&i) {
                        // SAFETY: i < RC_ENTRIES (it was a slot index when filled).
                        unsafe { rc.add(i).write(0) };
                    }
                }
            } else {
                // SAFETY: RC_ENTRIES is a multiple of the page size, so the run of `span`
                // slots from a page-aligned index stays inside the return cache.
                unsafe { core::ptr::write_bytes(rc.add(rc_first), 0, span) };
            }
        }
    }

    pub(crate) fn xsave_guest(&self) -> u64 {
        self.addr(XSAVE_GUEST_OFFSET)
    }

    /// The return cache of mode slot `m`.
    pub(crate) fn rc_table(&self, m: usize) -> u64 {
        self.addr(RC_OFFSET + m * RC_BYTES)
    }

    /// Points mode slot `m`'s return-cache slot of `va` at a fragment's `ret_entry`.
    pub(crate) fn rc_insert(&mut self, m: usize, va: GuestVirt, ret_entry: CachePc) {
        let idx = (va.0 as usize) % RC_ENTRIES;
        self.rc_filled[m].note(idx);
        // SAFETY: the slot lies inside the return cache.
        unsafe { ((self.rc_table(m) + 8 * idx as u64) as *mut u64).write(ret_entry.0) };
    }

    /// The region `[start, end)`.
    pub(crate) fn region(&self) -> (u64, u64) {
        (self.base as u64, self.base as u64 + self.len as u64)
    }

    /// Inserts `va → entry` into mode slot `m`'s IBL table (two-way bucket, first way
    /// evicted).
    pub(crate) fn ibl_insert(&mut self, m: usize, va: GuestVirt, entry: CachePc) {
        let idx = (va.0 & ((1 << IBL_HASH_BITS) - 1)) as usize;
        debug_assert!(idx + 1 < IBL_ENTRIES);
        self.ibl_filled[m].note(idx);
        let e0 = (self.ibl_table(m) + (idx * IBL_ENTRY_BYTES) as u64) as *mut u64;
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
