//! The dispatcher's front cache for fragment lookups: ⟨VA, mode⟩ → ⟨PA, fragment⟩.
//!
//! A dispatcher lookup asks the embedder to translate the VA (in the engine image: a walk
//! of the shadow tables, ~800 cycles) and then searches the fragment map (a `BTreeMap`
//! of ~100 000 keys, another ~800); a booting Linux does that millions of times (after
//! every emulated instruction, IBL miss and PA mismatch). This direct-mapped table
//! remembers the answer of both.
//!
//! Invariant: an entry is valid only while the VA → PA mapping it was made under holds
//! and its fragment is still in the map — exactly the lifetime of an IBL-table entry, so
//! the table is emptied (a generation bump, O(1)) by every `CodeCache::clear_lookups`:
//! SoftTLB replacements, `invalidate_page`, `invalidate_all_mappings`, code-page
//! invalidation and flushes; and its non-global entries (a second generation) by
//! `invalidate_nonglobal_mappings` (a guest CR3 write).

use alloc::vec;
use alloc::vec::Vec;

use crate::addr::{GuestPhys, GuestVirt};
use crate::guest_memory::Mode;

/// Entries (a power of two).
const ENTRIES: usize = 4096;

#[derive(Clone, Copy, Debug, Default)]
struct Entry {
    va: u64,
    pa: u64,
    mode: u32,
    id: u32,
    /// The table generation the entry was made in (0: never; generations start at 1):
    /// `gen` for an entry of a non-global page, `gen_global` for a global one.
    gen: u64,
    global: bool,
}

/// The front cache.
#[derive(Debug)]
pub(crate) struct FastLookup {
    entries: Vec<Entry>,
    gen: u64,
    gen_global: u64,
}

fn index(va: GuestVirt, mode: Mode) -> usize {
    let v = va.0 ^ (va.0 >> 12) ^ (u64::from(mode.0) << 7);
    (v as usize) & (ENTRIES - 1)
}

impl FastLookup {
    /// An empty table.
    pub(crate) fn new() -> Self {
        Self {
            entries: vec![Entry::default(); ENTRIES],
            gen: 1,
            gen_global: 1,
        }
    }

    /// The PA and fragment remembered for `va` in `mode`, and whether the page is global.
    #[inline]
    pub(crate) fn get(&self, va: GuestVirt, mode: Mode) -> Option<(GuestPhys, u32, bool)> {
        let e = &self.entries[index(va, mode)];
        let gen = if e.global { self.gen_global } else { self.gen };
        (e.gen == gen && e.va == va.0 && e.mode == mode.0).then_some((
            GuestPhys(e.pa),
            e.id,
            e.global,
        ))
    }

    /// Remembers that `va` in `mode` maps to `pa` now (a global page if `global`), where
    /// fragment `id` is found.
    #[inline]
    pub(crate) fn put(&mut self, va: GuestVirt, mode: Mode, pa: GuestPhys, id: u32, global: bool) {
        self.entries[index(va, mode)] = Entry {
            va: va.0,
            pa: pa.0,
            mode: mode.0,
            id,
            gen: if global { self.gen_global } else { self.gen },
            global,
        };
    }

    /// Forgets every entry.
    #[inline]
    pub(crate) fn clear(&mut self) {
        self.gen += 1;
        self.gen_global += 1;
    }

    /// Forgets the entries of non-global pages.
    #[inline]
    pub(crate) fn clear_nonglobal(&mut self) {
        self.gen += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_get_put_clear() {
        let mut f = FastLookup::new();
        let (va, k, u) = (GuestVirt(0xffff_ffff_8100_0123), Mode(0), Mode(3));
        assert_eq!(f.get(va, k), None);
        f.put(va, k, GuestPhys(0x100_0123), 7, false);
        assert_eq!(f.get(va, k), Some((GuestPhys(0x100_0123), 7, false)));
        assert_eq!(f.get(va, u), None, "another mode");
        assert_eq!(f.get(GuestVirt(va.0 + 1), k), None, "another VA");
        f.clear();
        assert_eq!(f.get(va, k), None);
        // A global page's entry survives the clear of non-global ones, not a whole clear.
        let user = GuestVirt(0x40_1000);
        f.put(va, k, GuestPhys(0x100_0123), 7, true);
        f.put(user, u, GuestPhys(0x200_0000), 8, false);
        f.clear_nonglobal();
        assert_eq!(f.get(va, k), Some((GuestPhys(0x100_0123), 7, true)));
        assert_eq!(f.get(user, u), None);
        f.clear();
        assert_eq!(f.get(va, k), None);
    }
}
