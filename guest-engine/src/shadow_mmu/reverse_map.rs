//! Reverse map: guest frame → the shadow leaf entries that map it (4 KiB leaves by frame,
//! 2 MiB leaves by their 2 MiB-aligned base), and the set of frames protected because
//! they hold translated code.
//!
//! Invariants (kept by [`crate::shadow_mmu::ShadowMmu`], which owns the only instance):
//! * every present shadow leaf is listed exactly once, under the 4 KiB frame it maps;
//! * no shadow leaf mapping a protected frame has its hardware W bit set.
//!
//! This module is pure bookkeeping: it never touches memory.

use alloc::collections::{BTreeMap, BTreeSet};
use alloc::vec::Vec;

use crate::addr::{GuestPhys, GuestVirt};

/// One shadow leaf mapping a frame: where the entry is and which VA it maps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShadowMapping {
    /// Guest-physical address of the shadow leaf entry.
    pub slot: GuestPhys,
    /// The virtual page the entry maps.
    pub va: GuestVirt,
}

/// Frame → shadow leaves, plus the protected code frames.
#[derive(Debug, Default)]
pub struct ReverseMap {
    mappings: BTreeMap<GuestPhys, Vec<ShadowMapping>>,
    large: BTreeMap<GuestPhys, Vec<ShadowMapping>>,
    protected: BTreeSet<GuestPhys>,
}

impl ReverseMap {
    /// An empty map.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records that the shadow leaf `mapping.slot` maps `frame`. Idempotent.
    pub fn insert(&mut self, frame: GuestPhys, mapping: ShadowMapping) {
        let list = self.mappings.entry(frame.page()).or_default();
        if !list.iter().any(|m| m.slot == mapping.slot) {
            list.push(mapping);
        }
    }

    /// Forgets the shadow leaf `slot` mapping `frame`; `true` if it was listed.
    pub fn remove(&mut self, frame: GuestPhys, slot: GuestPhys) -> bool {
        remove_from(&mut self.mappings, frame.page(), slot)
    }

    /// Records that the 2 MiB shadow leaf `mapping.slot` maps the 2 MiB at `base`.
    pub fn insert_large(&mut self, base: GuestPhys, mapping: ShadowMapping) {
        let list = self.large.entry(base).or_default();
        if !list.iter().any(|m| m.slot == mapping.slot) {
            list.push(mapping);
        }
    }

    /// Forgets the 2 MiB shadow leaf `slot` mapping `base`; `true` if it was listed.
    pub fn remove_large(&mut self, base: GuestPhys, slot: GuestPhys) -> bool {
        remove_from(&mut self.large, base, slot)
    }

    /// The 2 MiB shadow leaves mapping the 2 MiB at `base`.
    pub fn large_mappings(&self, base: GuestPhys) -> &[ShadowMapping] {
        self.large.get(&base).map(Vec::as_slice).unwrap_or(&[])
    }

    /// Whether any frame in `[base, base + bytes)` is protected.
    pub fn any_protected_in(&self, base: GuestPhys, bytes: u64) -> bool {
        self.protected
            .range(base..GuestPhys(base.0 + bytes))
            .next()
            .is_some()
    }

    /// The shadow leaves mapping `frame`.
    pub fn mappings(&self, frame: GuestPhys) -> &[ShadowMapping] {
        self.mappings
            .get(&frame.page())
            .map(Vec::as_slice)
            .unwrap_or(&[])
    }

    /// Number of frames with at least one shadow leaf.
    pub fn mapped_frames(&self) -> usize {
        self.mappings.len()
    }

    /// Total number of shadow leaves listed (4 KiB and 2 MiB).
    pub fn mapping_count(&self) -> usize {
        self.mappings
            .values()
            .chain(self.large.values())
            .map(Vec::len)
            .sum()
    }

    /// Marks `frame` as holding translated code; `true` if it was not already.
    pub fn protect(&mut self, frame: GuestPhys) -> bool {
        self.protected.insert(frame.page())
    }

    /// Drops the protection of `frame`; `true` if it was protected.
    pub fn unprotect(&mut self, frame: GuestPhys) -> bool {
        self.protected.remove(&frame.page())
    }

    /// Whether `frame` is protected.
    pub fn is_protected(&self, frame: GuestPhys) -> bool {
        self.protected.contains(&frame.page())
    }

    /// Number of protected frames.
    pub fn protected_count(&self) -> usize {
        self.protected.len()
    }

    /// The protected frames, in order.
    pub fn protected_frames(&self) -> impl Iterator<Item = GuestPhys> + '_ {
        self.protected.iter().copied()
    }
}

/// Removes `slot` from `map[key]`, dropping the key when its list empties.
fn remove_from(
    map: &mut BTreeMap<GuestPhys, Vec<ShadowMapping>>,
    key: GuestPhys,
    slot: GuestPhys,
) -> bool {
    let Some(list) = map.get_mut(&key) else {
        return false;
    };
    let before = list.len();
    list.retain(|m| m.slot != slot);
    let removed = list.len() != before;
    if list.is_empty() {
        map.remove(&key);
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(slot: u64, va: u64) -> ShadowMapping {
        ShadowMapping {
            slot: GuestPhys(slot),
            va: GuestVirt(va),
        }
    }

    #[test]
    fn test_reverse_map_lists_every_alias_once() {
        let mut r = ReverseMap::new();
        r.insert(GuestPhys(0x5000), m(0x100, 0x1000));
        r.insert(GuestPhys(0x5123), m(0x208, 0x7000));
        r.insert(GuestPhys(0x5000), m(0x100, 0x1000));
        assert_eq!(
            r.mappings(GuestPhys(0x5000)),
            &[m(0x100, 0x1000), m(0x208, 0x7000)]
        );
        assert_eq!(r.mapped_frames(), 1);
        assert_eq!(r.mapping_count(), 2);
    }

    #[test]
    fn test_reverse_map_remove_forgets_empty_frames() {
        let mut r = ReverseMap::new();
        r.insert(GuestPhys(0x5000), m(0x100, 0x1000));
        assert!(!r.remove(GuestPhys(0x5000), GuestPhys(0x108)));
        assert!(r.remove(GuestPhys(0x5000), GuestPhys(0x100)));
        assert!(r.mappings(GuestPhys(0x5000)).is_empty());
        assert_eq!(r.mapped_frames(), 0);
        assert!(!r.remove(GuestPhys(0x9000), GuestPhys(0x100)));
    }

    #[test]
    fn test_reverse_map_protection_is_per_frame() {
        let mut r = ReverseMap::new();
        assert!(r.protect(GuestPhys(0x5008)));
        assert!(!r.protect(GuestPhys(0x5000)));
        assert!(r.is_protected(GuestPhys(0x5fff)));
        assert!(!r.is_protected(GuestPhys(0x6000)));
        assert_eq!(r.protected_count(), 1);
        assert!(r.unprotect(GuestPhys(0x5000)));
        assert!(!r.unprotect(GuestPhys(0x5000)));
        assert_eq!(r.protected_count(), 0);
    }

    #[test]
    fn test_reverse_map_large_mappings_and_protected_ranges() {
        let mut r = ReverseMap::new();
        r.insert_large(GuestPhys(0x20_0000), m(0x300, 0x4000_0000));
        r.insert(GuestPhys(0x20_0000), m(0x400, 0x1000));
        assert_eq!(
            r.large_mappings(GuestPhys(0x20_0000)),
            &[m(0x300, 0x4000_0000)]
        );
        assert_eq!(r.mapping_count(), 2);
        assert!(!r.any_protected_in(GuestPhys(0x20_0000), 0x20_0000));
        r.protect(GuestPhys(0x3f_f000));
        assert!(r.any_protected_in(GuestPhys(0x20_0000), 0x20_0000));
        assert!(!r.any_protected_in(GuestPhys(0x40_0000), 0x20_0000));
        assert!(r.remove_large(GuestPhys(0x20_0000), GuestPhys(0x300)));
        assert!(r.large_mappings(GuestPhys(0x20_0000)).is_empty());
        assert_eq!(r.mapping_count(), 1);
    }
}
