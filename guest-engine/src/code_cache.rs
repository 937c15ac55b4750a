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

use alloc::collections::{BTreeMap, BTreeSet};
use alloc::vec::Vec;
use core::ops::Range;

use crate::addr::{CachePc, GuestPhys, GuestVirt, PAGE_BYTES};
use crate::arch::{emit_gencode, CtxAddrs, Gencode, XsaveAreas};
use crate::bits::Bits;
use crate::context::CacheContext;
use crate::error::EngineError;
use crate::fast_lookup::FastLookup;
use crate::fragment::{ExitKind, ExitRecord, Fragment};
use crate::guest_memory::Mode;
use crate::layout::{
    COUNTERS_OFFSET, GENCODE_OFFSET, IBL_ENTRIES, IBL_ENTRY_BYTES, IBL_HASH_BITS, IBL_OFFSET,
    IBL_STRIDE, MAX_REGION_BYTES, MIN_REGION_BYTES, RC_BYTES, RC_ENTRIES, RC_OFFSET, TABLE_SLOTS,
    TRACES_OFFSET, XSAVE_GUEST_OFFSET, XSAVE_HOST_OFFSET,
};

/// Fragment map key.
pub(crate) type Key = (u64, u64, u32);

/// Which slots of one lookup table hold an entry, and which of those were made for a
/// non-global page (a guest CR3 write empties those; entries of global pages survive it,
/// as global TLB entries do): a clear visits only what it empties.
#[derive(Debug)]
struct Occupancy {
    used: Bits,
    nonglobal: Bits,
}

impl Occupancy {
    fn new(slots: usize) -> Self {
        Occupancy {
            used: Bits::new(slots),
            nonglobal: Bits::new(slots),
        }
    }

    /// Slot `i` now holds an entry (of a global page if `global`).
    fn set(&mut self, i: usize, global: bool) {
        self.used.set(i);
        if global {
            self.nonglobal.clear(i / 64, 1 << (i % 64));
        } else {
            self.nonglobal.set(i);
        }
    }

    fn is_global(&self, i: usize) -> bool {
        !self.nonglobal.get(i)
    }

    fn unset(&mut self, i: usize) {
        self.used.clear(i / 64, 1 << (i % 64));
        self.nonglobal.clear(i / 64, 1 << (i % 64));
    }

    /// Takes the occupied slots among `words` of bits (all of them, or with
    /// `nonglobal_only` those of non-global pages), calling `empty` on each.
    fn drain(&mut self, words: Range<usize>, nonglobal_only: bool, mut empty: impl FnMut(usize)) {
        let Occupancy { used, nonglobal } = self;
        if nonglobal_only {
            nonglobal.drain(words, |i| {
                used.clear(i / 64, 1 << (i % 64));
                empty(i);
            });
        } else {
            used.drain(words, |i| {
                nonglobal.clear(i / 64, 1 << (i % 64));
                empty(i);
            });
        }
    }

    fn words(&self) -> Range<usize> {
        0..self.used.len_words()
    }
}

/// Most fragments, and exit records, one cache generation holds: 8 and 16 MiB, powers
/// of two (a buddy allocator's blocks, whole; cachesim's traces have ~4 times the exits
/// of null's). Both tables are allocated whole with the cache and never grow: a
/// doubling of either (12 MiB at a Linux boot's size) could fail in the engine image's
/// heap, and did when its flush policy let the tables grow further. A translation that
/// would pass either flushes the cache first, as a full cache does.
pub(crate) const MAX_FRAGMENTS: usize = (8 << 20) / core::mem::size_of::<Fragment>();
pub(crate) const MAX_EXITS: usize = (16 << 20) / core::mem::size_of::<ExitRecord>();

/// `CodeCache::trusted_links[TRUST_GLOBAL]`: links into global pages.
const TRUST_GLOBAL: usize = 0;
/// `CodeCache::trusted_links[TRUST_LOCAL]`: links into other pages.
const TRUST_LOCAL: usize = 1;

/// The carved region and its bookkeeping.
pub(crate) struct CodeCache {
    base: *mut u8,
    len: usize,
    pub ctx: CtxAddrs,
    pub gen: Gencode,
    cursor: usize,
    pub fragments: Vec<Fragment>,
    by_key: BTreeMap<Key, u32>,
    /// The fragments of `by_key` by frame: (PA page, fragment), for the fragments a write
    /// to a frame invalidates (`on_frame`) without a walk of every fragment.
    by_frame: BTreeSet<(u64, u32)>,
    /// Fragments dropped by a write to their frame, by key, that may be revived
    /// (`crate::revive`).
    pub buried: BTreeMap<Key, u32>,
    pub exits: Vec<ExitRecord>,
    /// Bumped by every flush.
    pub generation: u64,
    ibl_used: [Occupancy; TABLE_SLOTS],
    rc_used: [Occupancy; TABLE_SLOTS],
    /// The dispatcher's front cache, emptied with the IBL tables.
    pub fast: FastLookup,
    /// Cross-page links that enter their fragment at its `entry`, past its PA check
    /// (`softtlb::link_target`), by the fragment's page: `[TRUST_GLOBAL]` those into
    /// global pages, `[TRUST_LOCAL]` the others; `(exit, fragment)` each. They trust the
    /// page's mapping as its IBL entries do, for as long: `clear_lookups_page`,
    /// `clear_lookups` and (the local ones) `clear_nonglobal_lookups` point them at the
    /// fragment's `checked_entry` and move them to `checked_links`.
    trusted_links: [BTreeMap<u64, Vec<(u32, u32)>>; 2],
    /// Links of `trusted_links` sent back to the PA check, by page, until a lookup finds
    /// that page mapped to their fragment's frame again (`trust_page`).
    checked_links: BTreeMap<u64, Vec<(u32, u32)>>,
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
            fragments: Vec::with_capacity(MAX_FRAGMENTS),
            by_key: BTreeMap::new(),
            by_frame: BTreeSet::new(),
            buried: BTreeMap::new(),
            exits: Vec::with_capacity(MAX_EXITS),
            generation: 0,
            ibl_used: core::array::from_fn(|_| Occupancy::new(IBL_ENTRIES)),
            rc_used: core::array::from_fn(|_| Occupancy::new(RC_ENTRIES)),
            fast: FastLookup::new(),
            trusted_links: [BTreeMap::new(), BTreeMap::new()],
            checked_links: BTreeMap::new(),
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
        self.by_frame.clear();
        self.buried.clear();
        self.exits.clear();
        self.trusted_links = [BTreeMap::new(), BTreeMap::new()];
        self.checked_links.clear();
        self.cursor = TRACES_OFFSET;
        self.clear_lookups();
        self.generation += 1;
    }

    /// Empties every mode's IBL table and return cache, touching only filled slots unless
    /// a table overflowed its fill list.
    pub(crate) fn clear_lookups(&mut self) {
        self.fast.clear();
        self.clear_tables(true);
        self.check_all_links(TRUST_GLOBAL);
        self.check_all_links(TRUST_LOCAL);
    }

    /// Sends every link of `trusted_links[which]` to the PA check (`check_links`).
    fn check_all_links(&mut self, which: usize) {
        for (page, links) in core::mem::take(&mut self.trusted_links[which]) {
            self.check_links(page, links);
        }
    }

    /// The exit record of link `(exit, fragment)` and its branch's field, if that exit is
    /// still linked and its branch goes to `entry(fragment)`.
    fn link_at(&self, (exit, to): (u32, u32), entry: fn(&Fragment) -> CachePc) -> Option<CachePc> {
        let dst = self.fragments.get(to as usize)?;
        match self.exits.get(exit as usize)?.kind {
            ExitKind::Direct {
                patch_at,
                linked: true,
                ..
            // SAFETY: `patch_at` is the rel32 of a branch inside the cache (its exit
            // record's).
            } if unsafe { crate::link::branch_target(patch_at) } == entry(dst) => Some(patch_at),
            _ => None,
        }
    }

    /// Points the links `(exit, fragment)` into `page` that still enter their fragment at
    /// its `entry` at its `checked_entry`, and keeps them in `checked_links` (one
    /// unlinked since, or linked again elsewhere, is left as it is and dropped).
    fn check_links(&mut self, page: u64, mut links: Vec<(u32, u32)>) {
        links.retain(|&l| {
            let Some(at) = self.link_at(l, Fragment::entry) else {
                return false;
            };
            // SAFETY: a rel32 inside the cache (`link_at`); nothing runs in the cache
            // while the dispatcher does this.
            unsafe { crate::link::patch_branch(at, self.fragments[l.1 as usize].checked_entry()) };
            true
        });
        if !links.is_empty() {
            self.checked_links
                .entry(page)
                .or_default()
                .append(&mut links);
        }
    }

    /// A lookup found `page` mapped to frame `pa` (`global`: a global page): the links
    /// into it that `check_links` sent to the PA check and whose fragment lies on that
    /// frame enter at `entry` again (back in `trusted_links`).
    pub(crate) fn trust_page(&mut self, page: GuestVirt, pa: GuestPhys, global: bool) {
        let Some(mut links) = self.checked_links.remove(&page.0) else {
            return;
        };
        links.retain(|&l| {
            let Some(at) = self.link_at(l, Fragment::checked_entry) else {
                return false;
            };
            let dst = &self.fragments[l.1 as usize];
            if dst.pa.page() != pa.page() {
                return false;
            }
            // SAFETY: as in `check_links`.
            unsafe { crate::link::patch_branch(at, dst.entry()) };
            true
        });
        if !links.is_empty() {
            self.trusted(page.0, global).append(&mut links);
        }
    }

    /// The links into `page` (`global`: a global page) that trust its mapping: a link
    /// to it that enters at `entry` belongs here (`Engine::link`).
    pub(crate) fn trusted(&mut self, page: u64, global: bool) -> &mut Vec<(u32, u32)> {
        let which = if global { TRUST_GLOBAL } else { TRUST_LOCAL };
        self.trusted_links[which].entry(page).or_default()
    }

    /// After a guest CR3 write: empties the entries made for non-global pages (and the
    /// front cache's); those of global pages stay, as global TLB entries do (they go at
    /// `invlpg`, `clear_lookups_page`, or a whole clear).
    pub(crate) fn clear_nonglobal_lookups(&mut self) {
        self.fast.clear_nonglobal();
        self.check_all_links(TRUST_LOCAL);
        self.clear_tables(false);
    }

    fn clear_tables(&mut self, global: bool) {
        for m in 0..TABLE_SLOTS {
            let ibl = self.ibl_table(m) as *mut u64;
            let used = &mut self.ibl_used[m];
            used.drain(used.words(), !global, |i| {
                // SAFETY: bucket i < IBL_ENTRIES lies inside the table; 16 bytes each.
                unsafe { core::ptr::write_bytes(ibl.add(2 * i), 0, 2) };
            });
            let rc = self.rc_table(m) as *mut u64;
            let used = &mut self.rc_used[m];
            used.drain(used.words(), !global, |i| {
                // SAFETY: i < RC_ENTRIES (a set bit is a slot).
                unsafe { rc.add(i).write(0) };
            });
        }
    }

    /// Empties what every mode's IBL table and return cache hold for the VAs of `page`
    /// (a page-aligned VA) and the front cache: both tables are indexed by the low 16
    /// bits of the VA, so a page's entries lie in one run of 4096 slots (IBL: plus the
    /// second way of its last bucket), and the IBL's tag tells which are the page's. The
    /// fill lists keep their slots (a later whole clear zeroes them again).
    pub(crate) fn clear_lookups_page(&mut self, page: GuestVirt) {
        self.fast.clear();
        for which in [TRUST_GLOBAL, TRUST_LOCAL] {
            if let Some(links) = self.trusted_links[which].remove(&page.0) {
                self.check_links(page.0, links);
            }
        }
        let span = PAGE_BYTES as usize;
        let first = (page.0 as usize) & ((1 << IBL_HASH_BITS) - 1) & !(span - 1);
        let rc_first = (page.0 as usize) % RC_ENTRIES;
        for m in 0..TABLE_SLOTS {
            let ibl = self.ibl_table(m) as *mut u64;
            let used = &mut self.ibl_used[m];
            // The page's IBL entries lie in buckets first..=first + span (the last one the
            // second way of the page's last bucket); the return cache's in its run.
            let last = (first + span).min(IBL_ENTRIES - 1);
            let mut at = first / 64;
            while let Some(w) = used.used.next_word(at..last / 64 + 1) {
                let mut bits = used.used.words[w];
                while bits != 0 {
                    let i = w * 64 + bits.trailing_zeros() as usize;
                    bits &= bits - 1;
                    // SAFETY: bucket i < IBL_ENTRIES lies inside the table; 16 bytes each.
                    let t = unsafe { ibl.add(2 * i).read() };
                    if t.wrapping_neg() & !(PAGE_BYTES - 1) == page.0 {
                        // SAFETY: as above.
                        unsafe { core::ptr::write_bytes(ibl.add(2 * i), 0, 2) };
                        used.unset(i);
                    }
                }
                at = w + 1;
            }
            let rc = self.rc_table(m) as *mut u64;
            let used = &mut self.rc_used[m];
            used.drain(rc_first / 64..(rc_first + span) / 64, false, |i| {
                // SAFETY: i < RC_ENTRIES (a set bit is a slot).
                unsafe { rc.add(i).write(0) };
            });
        }
    }

    pub(crate) fn xsave_guest(&self) -> u64 {
        self.addr(XSAVE_GUEST_OFFSET)
    }

    /// The return cache of mode slot `m`.
    pub(crate) fn rc_table(&self, m: usize) -> u64 {
        self.addr(RC_OFFSET + m * RC_BYTES)
    }

    /// Points mode slot `m`'s return-cache slot of `va` at a fragment's `ret_entry`
    /// (`global`: `va`'s page is global).
    pub(crate) fn rc_insert(&mut self, m: usize, va: GuestVirt, ret_entry: CachePc, global: bool) {
        let idx = (va.0 as usize) % RC_ENTRIES;
        self.rc_used[m].set(idx, global);
        // SAFETY: the slot lies inside the return cache.
        unsafe { ((self.rc_table(m) + 8 * idx as u64) as *mut u64).write(ret_entry.0) };
    }

    /// The region `[start, end)`.
    pub(crate) fn region(&self) -> (u64, u64) {
        (self.base as u64, self.base as u64 + self.len as u64)
    }

    /// Inserts `va → entry` into mode slot `m`'s IBL table (two-way bucket, first way
    /// evicted; `global`: `va`'s page is global).
    pub(crate) fn ibl_insert(&mut self, m: usize, va: GuestVirt, entry: CachePc, global: bool) {
        let idx = (va.0 & ((1 << IBL_HASH_BITS) - 1)) as usize;
        debug_assert!(idx + 1 < IBL_ENTRIES);
        let e0 = (self.ibl_table(m) + (idx * IBL_ENTRY_BYTES) as u64) as *mut u64;
        let used = &mut self.ibl_used[m];
        let tag = va.0.wrapping_neg();
        // SAFETY: bucket idx and idx+1 lie inside the table (IBL_ENTRIES has one spare).
        unsafe {
            let e1 = e0.add(2);
            let way = if e0.read() == 0 || e0.read() == tag {
                0
            } else if e1.read() == 0 || e1.read() == tag {
                1
            } else {
                // The first way's entry moves to the second, with its kind.
                used.set(idx + 1, used.is_global(idx));
                e1.write(e0.read());
                e1.add(1).write(e0.add(1).read());
                0
            };
            used.set(idx + way, global);
            let slot = e0.add(2 * way);
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

    /// Makes fragment `id` the one found for `key`.
    pub(crate) fn insert_key(&mut self, key: Key, id: u32) {
        let page = GuestPhys(key.1).page().0;
        if let Some(old) = self.by_key.insert(key, id) {
            self.by_frame.remove(&(page, old));
        }
        self.by_frame.insert((page, id));
    }

    /// Forgets the fragment found for `key`, if any.
    pub(crate) fn remove_key(&mut self, key: &Key) {
        if let Some(id) = self.by_key.remove(key) {
            self.by_frame.remove(&(GuestPhys(key.1).page().0, id));
        }
    }

    /// The fragments found by key whose code starts on frame `page`.
    pub(crate) fn on_frame(&self, page: GuestPhys) -> impl Iterator<Item = u32> + '_ {
        self.by_frame
            .range((page.0, 0)..=(page.0, u32::MAX))
            .map(|&(_, id)| id)
    }

    /// Fragments that lookups find.
    pub(crate) fn live_fragments(&self) -> usize {
        self.by_key.len()
    }
}
