//! The SoftTLB and the per-trace PA check that reads it.
//!
//! **SoftTLB.** The engine's VA → PA knowledge in a form translated code can read: a
//! direct-mapped table of [`SOFTTLB_ENTRIES`] slots `[va_page: u64, pa_page: u64]` at
//! [`SOFTTLB_OFFSET`] of the cache region, indexed by virtual page number and shared by
//! the modes (both views of a VA map to the same frame). The dispatcher fills a slot from
//! every fresh `GuestMemory::translate_global` answer it gets (in the engine image that
//! answer comes from the shadow entries, `shadow_mmu/translate.rs`); `Engine::invalidate_page`
//! empties one slot, `Engine::invalidate_all_mappings` all of them, and
//! `Engine::invalidate_nonglobal_mappings` (a guest CR3 write) those of non-global pages:
//! a global guest page keeps its mapping across CR3 writes, as its TLB entry does, so
//! Linux's kernel code keeps its SoftTLB slots, lookup-table entries and the front
//! cache's across context switches. The fragment map of
//! the code cache keys fragments by ⟨VA, PA, mode⟩ and needs no SoftTLB; the SoftTLB
//! is what code running *inside* the cache checks instead of asking the dispatcher.
//!
//! **Per-trace PA check.** Every fragment starts with a `checked_entry` that compares its
//! page's slot with the fragment's own ⟨VA page, PA page⟩ ([`emit_pa_check`]). A link
//! targets `entry` ([`link_target`]); one between fragments on different pages (VA or
//! frame) trusts its target page's mapping only as long as that page's lookups last, and
//! targets `checked_entry` from their clearing until a lookup finds the page on the same
//! frame again (`CodeCache::trusted_links`). A failed check leaves with the
//! `PA_MISMATCH` exit; the dispatcher then asks [`Engine::revalidate`] whether the
//! fragment is still what its VA maps to.
//!
//! Invariants:
//! * a slot holds either `u64::MAX` in both words (empty; never a page address) or a
//!   mapping that `GuestMemory::translate_global` returned since the last
//!   `invalidate_all_mappings` / `invalidate_page` of that VA, and since the last
//!   `invalidate_nonglobal_mappings` unless it said the page was global;
//! * whenever a fill replaces a different PA for the same VA, every mode's IBL table and
//!   return cache entries for that VA's page are cleared (they were made under the old
//!   mapping; entries of other pages were not);
//! * the emitted check reads only the slot it was translated for, flag-free (`lea` +
//!   `jrcxz`), with RCX and RDX spilled and restored, and on failure reaches its exit
//!   stub with exactly those two registers in their spill slots ([`PA_CHECK_SPILLED`]).

use crate::addr::{CachePc, GuestPhys, GuestVirt, PAGE_BYTES};
use crate::arch::x86_64::emit::{reg, Asm, Label};
use crate::bits::Bits;
use crate::dispatch::Engine;
use crate::fragment::Fragment;
use crate::guest_memory::GuestMemory;
use crate::layout::{SOFTTLB_ENTRIES, SOFTTLB_OFFSET};

/// Bytes per SoftTLB slot: `[va_page, pa_page]`.
const SLOT_BYTES: u64 = 16;
/// The value of both words of an empty slot (never a page address).
const EMPTY: u64 = u64::MAX;
/// Registers the PA check keeps in spill slots (RCX, RDX; hardware numbers as bits).
pub(crate) const PA_CHECK_SPILLED: u16 = 1 << reg::RCX | 1 << reg::RDX;

/// The SoftTLB table inside the cache region.
#[derive(Debug)]
pub(crate) struct SoftTlb {
    /// Address of slot 0.
    table: u64,
    /// The slots that hold a mapping of a non-global page.
    nonglobal: Bits,
}

impl SoftTlb {
    /// The SoftTLB of the cache region at `region_base`, emptied.
    ///
    /// # Safety
    /// `region_base` must be the start of a writable code-cache region carved per
    /// `layout` (so that `SOFTTLB_OFFSET..+SOFTTLB_BYTES` lies inside it) that outlives
    /// the returned value.
    pub(crate) unsafe fn new(region_base: u64) -> Self {
        let mut t = Self {
            table: region_base + SOFTTLB_OFFSET as u64,
            nonglobal: Bits::new(SOFTTLB_ENTRIES),
        };
        t.clear();
        t
    }

    /// The address of `va`'s slot (what the PA check of a trace on `va`'s page reads).
    pub(crate) fn slot(&self, va: GuestVirt) -> u64 {
        self.table + index(va) as u64 * SLOT_BYTES
    }

    /// Forgets every mapping.
    pub(crate) fn clear(&mut self) {
        let words = 0..self.nonglobal.len_words();
        self.nonglobal.drain(words, |_| {});
        for i in 0..SOFTTLB_ENTRIES {
            empty(self.table, i);
        }
    }

    /// Forgets the mappings of non-global pages (a guest CR3 write).
    pub(crate) fn clear_nonglobal(&mut self) {
        let (table, words) = (self.table, 0..self.nonglobal.len_words());
        self.nonglobal.drain(words, |i| empty(table, i));
    }

    /// Forgets the mapping of `va`'s page, if its slot holds that page.
    pub(crate) fn invalidate(&mut self, va: GuestVirt) {
        let slot = self.slot(va) as *mut u64;
        // SAFETY: the slot (two u64) lies inside the table (contract of `new`).
        if unsafe { slot.read() } == va.page().0 {
            empty(self.table, index(va));
        }
    }

    /// Records `va → pa` (pages; `global`: a global guest page). Returns whether a
    /// different mapping for that VA page was replaced.
    pub(crate) fn fill(&mut self, va: GuestVirt, pa: GuestPhys, global: bool) -> bool {
        let i = index(va);
        if global {
            self.nonglobal.clear(i / 64, 1 << (i % 64));
        } else {
            self.nonglobal.set(i);
        }
        let slot = self.slot(va) as *mut u64;
        // SAFETY: the slot (two u64) lies inside the table (contract of `new`).
        unsafe {
            let old_va = slot.read();
            let old_pa = slot.add(1).read();
            slot.write(va.page().0);
            slot.add(1).write(pa.page().0);
            old_va == va.page().0 && old_pa != pa.page().0
        }
    }
}

/// The slot index of `va`'s page.
fn index(va: GuestVirt) -> usize {
    ((va.0 / PAGE_BYTES) % SOFTTLB_ENTRIES as u64) as usize
}

/// Empties slot `i` of the table at `table`.
fn empty(table: u64, i: usize) {
    let slot = (table + (i as u64) * SLOT_BYTES) as *mut u64;
    // SAFETY: slot i < SOFTTLB_ENTRIES (two u64) lies inside the table (contract of
    // `SoftTlb::new`, whose table this is).
    unsafe {
        slot.write(EMPTY);
        slot.add(1).write(EMPTY);
    }
}

/// Emits the body of a trace's `checked_entry`: spill RCX and RDX, compare the SoftTLB
/// slot at `slot` with `[va_page, pa_page]` flag-free, jump to `fail` (an exit stub that
/// restores [`PA_CHECK_SPILLED`]) on a mismatch, else restore RCX and RDX and fall through.
pub(crate) fn emit_pa_check(
    a: &mut Asm,
    slot: u64,
    va_page: u64,
    pa_page: u64,
    guest_pc: u64,
    fail: Label,
) {
    a.mark_guest(guest_pc);
    a.emit_spill(reg::RCX);
    a.emit_spill(reg::RDX);
    // Both comparisons assembled on the stack and appended at once (the trace head's
    // most frequent glue), each:
    //   mov rcx, [rip+word]; mov rdx, -expect; lea rcx, [rcx+rdx]; jrcxz ok; jmp fail; ok:
    let start = a.offset();
    let pc = a.pc();
    let mut b = [0u8; 64];
    let mut n = 0;
    let mut jmps = [0usize; 2];
    for (k, (word, expect)) in [(slot, va_page), (slot + 8, pa_page)]
        .into_iter()
        .enumerate()
    {
        let end = pc + (n + 7) as u64;
        b[n..n + 3].copy_from_slice(&[0x48, 0x8B, 0x0D]);
        b[n + 3..n + 7].copy_from_slice(&(word.wrapping_sub(end) as u32).to_le_bytes());
        n += 7;
        let neg = expect.wrapping_neg();
        if let Ok(v) = u32::try_from(neg) {
            b[n] = 0xBA;
            b[n + 1..n + 5].copy_from_slice(&v.to_le_bytes());
            n += 5;
        } else {
            b[n..n + 2].copy_from_slice(&[0x48, 0xBA]);
            b[n + 2..n + 10].copy_from_slice(&neg.to_le_bytes());
            n += 10;
        }
        b[n..n + 8].copy_from_slice(&[0x48, 0x8D, 0x0C, 0x11, 0xE3, 0x05, 0xE9, 0]);
        jmps[k] = n + 7;
        n += 11;
    }
    a.bytes_of(&b, n);
    for at in jmps {
        a.fixup_rel32_at(start + at, fail);
    }
    a.emit_unspill(reg::RCX);
    a.emit_unspill(reg::RDX);
}

/// Where a link from `src` to `dst` enters `dst`, and whether it skips the PA check of a
/// page on another VA page or frame: its `loop_entry` for its own back edge if it has
/// one (past the checks hoisted to its top); else its `entry` (a fragment that runs
/// proves its page's mapping, so a target on the same VA page and frame holds too; a
/// target on another page had its mapping just looked up, and the link trusts it for as
/// long as that page's IBL entries do: `CodeCache::trusted_links`).
pub(crate) fn link_target(src: &Fragment, dst: &Fragment) -> (CachePc, bool) {
    if src.base == dst.base {
        if let Some(l) = dst.loop_entry() {
            return (l, false);
        }
    }
    let same_page = src.start.page() == dst.start.page() && src.pa.page() == dst.pa.page();
    (dst.entry(), !same_page)
}

impl Engine {
    /// Records a fresh translation `va → pa` (`global`: of a global page) in the SoftTLB;
    /// if it replaced a different mapping of that VA, lookups made under the old one are
    /// stale and that page's entries in every IBL table and return cache are cleared. The
    /// page's links sent back to the PA check skip it again (`CodeCache::trust_page`).
    pub(crate) fn note_mapping(&mut self, va: GuestVirt, pa: GuestPhys, global: bool) {
        if self.softtlb.fill(va, pa, global) {
            self.cache.clear_lookups_page(va.page());
        }
        self.cache.trust_page(va.page(), pa, global);
    }

    /// After fragment `id` failed its PA check: whether it may run. It may if it is still
    /// what a lookup of its VA finds (its VA maps to its PA now, and it was not
    /// invalidated): then only the SoftTLB slot was gone (a CR3 write, a slot conflict),
    /// the SoftTLB learns the mapping and the links stay. Otherwise the links into it are
    /// stale and undone, so that they reach the dispatcher and get relinked to the right
    /// fragment.
    pub(crate) fn revalidate(&mut self, mem: &mut dyn GuestMemory, id: u32) -> bool {
        let f = &self.cache.fragments[id as usize];
        let (va, pa, mode) = (f.start, f.pa, f.mode);
        if let Some((fpa, fid, global)) = self.cache.fast.get(va, mode) {
            if (fpa, fid) == (pa, id) {
                self.note_mapping(va, pa, global);
                return true;
            }
        }
        let now = mem.translate_global(va.page(), mode);
        if now.map(|(p, _)| p) == Some(pa.page()) && self.cache.lookup(va, pa, mode) == Some(id) {
            let global = now.is_some_and(|(_, g)| g);
            self.note_mapping(va, pa, global);
            self.cache.fast.put(va, mode, pa, id, global);
            true
        } else {
            self.unlink_incoming(id);
            false
        }
    }

    /// The guest changed (or may have changed) the mapping of `va`'s page: drop it from
    /// the SoftTLB so that cross-page entries re-validate, and drop the IBL and
    /// return-cache entries of that page (those of other pages stay valid).
    pub fn invalidate_page(&mut self, va: GuestVirt) {
        self.softtlb.invalidate(va);
        self.cache.clear_lookups_page(va.page());
    }

    /// Every VA → PA mapping may have changed (guest CR3 write): the SoftTLB and every
    /// mode's IBL table and return cache are emptied; fragments stay (they are keyed by PA
    /// and found again by the next lookups). Costs O(lookup slots filled since the last
    /// clear), not a 3 MiB clear. Links stay too: a same-page link leaves a fragment that
    /// was itself entered under the current mappings (README, "Modes and mappings").
    pub fn invalidate_all_mappings(&mut self) {
        self.softtlb.clear();
        self.cache.clear_lookups();
    }

    /// A guest CR3 write with global pages enabled (CR4.PGE = 1): as
    /// [`Engine::invalidate_all_mappings`], except that what was learnt of global pages
    /// stays (their guest TLB entries survive the write too; `invalidate_page` and
    /// `invalidate_all_mappings` still drop them).
    pub fn invalidate_nonglobal_mappings(&mut self) {
        self.softtlb.clear_nonglobal();
        self.cache.clear_nonglobal_lookups();
    }
}
