//! A fragment is one translated trace in the code cache, with its exits.
//!
//! Invariants: a fragment's code occupies `[base, base+len)`; `checked_entry < ret_entry <
//! entry ≤ body` are addresses inside it; its exit records are contiguous in the cache's exit table.

use crate::addr::{CachePc, GuestPhys, GuestVirt};
use crate::arch::{ExitSpec, MapMark};
use crate::guest_memory::Mode;
use crate::instrument::CallSpec;
use crate::link::branch_target;
use crate::platform::SensitiveInsn;
use alloc::vec::Vec;

/// A translated trace.
#[derive(Debug)]
pub(crate) struct Fragment {
    pub start: GuestVirt,
    pub pa: GuestPhys,
    pub mode: Mode,
    pub base: CachePc,
    pub len: usize,
    pub checked_entry: CachePc,
    pub ret_entry: CachePc,
    pub entry: CachePc,
    pub body: CachePc,
    /// Where a link of the trace's own back edge enters (past its hoisted checks).
    pub loop_entry: Option<CachePc>,
    pub marks: Vec<MapMark>,
    pub calls: Vec<CallSpec>,
    /// Exit records currently linked to this fragment (undone by `unlink_incoming`).
    pub incoming: Vec<u32>,
}

/// What an exit record does when its stub is reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ExitKind {
    /// Direct branch to `target`; `patch_at` is the rel32 field linking rewrites.
    Direct {
        target: GuestVirt,
        patch_at: CachePc,
        /// The exit stub the branch reaches when unlinked.
        stub: CachePc,
        linked: bool,
    },
    /// Sensitive instruction.
    Sensitive(SensitiveInsn),
    /// Attention byte set.
    Attention,
    /// Cross-page entry with a stale PA.
    PaMismatch,
    /// Record buffer full; the last `held` records belong to the instruction about to run.
    BufferFull { resume: CachePc, held: u8 },
    /// Analysis call `call` of the fragment.
    Call { call: usize, resume: CachePc },
    /// A check hoisted to the fragment's top hit.
    HoistMiss,
}

impl ExitKind {
    /// The exit `spec` of a trace just committed, its offsets made addresses by `at`.
    pub(crate) fn committed(spec: ExitSpec, at: impl Fn(usize) -> CachePc) -> Self {
        match spec {
            ExitSpec::Direct { target, patch_off } => ExitKind::Direct {
                target: GuestVirt(target),
                patch_at: at(patch_off),
                // SAFETY: the freshly committed branch's rel32 lies in the cache and still
                // points at its stub.
                stub: unsafe { branch_target(at(patch_off)) },
                linked: false,
            },
            ExitSpec::Sensitive(s) => ExitKind::Sensitive(s),
            ExitSpec::Attention => ExitKind::Attention,
            ExitSpec::PaMismatch => ExitKind::PaMismatch,
            ExitSpec::BufferFull { resume_off, held } => ExitKind::BufferFull {
                resume: at(resume_off),
                held,
            },
            ExitSpec::Call { call, resume_off } => ExitKind::Call {
                call,
                resume: at(resume_off),
            },
            ExitSpec::HoistMiss => ExitKind::HoistMiss,
        }
    }
}

/// One exit of one fragment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ExitRecord {
    pub fragment: u32,
    pub kind: ExitKind,
}

/// The ⟨VA, PA, mode⟩ → fragment map (`CodeCache::by_key`): open addressing with linear
/// probing over a power-of-two table at most 3/4 full, deletion by backward shift. (It
/// was a `BTreeMap`: its insert was ~3 % of the translator's host instructions and its
/// search the dispatcher's lookup behind the front cache.)
#[derive(Debug, Default)]
pub(crate) struct FragmentMap {
    slots: Vec<Slot>,
    len: usize,
}

/// A slot: a key and its fragment, or empty (`id == EMPTY`).
#[derive(Clone, Copy, Debug)]
struct Slot {
    va: u64,
    pa: u64,
    mode: u32,
    id: u32,
}

const EMPTY: u32 = u32::MAX;

const EMPTY_SLOT: Slot = Slot {
    va: 0,
    pa: 0,
    mode: 0,
    id: EMPTY,
};

/// The map's key: (VA, PA, mode).
pub(crate) type Key = (u64, u64, u32);

impl Slot {
    fn key(&self) -> Key {
        (self.va, self.pa, self.mode)
    }
}

impl FragmentMap {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Keys in the map.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The home slot of `k` (the table is not empty). VA and PA share their page
    /// offset: the PA is rotated so that it does not cancel out.
    #[inline]
    fn home(&self, k: &Key) -> usize {
        let h =
            (k.0 ^ k.1.rotate_left(29) ^ u64::from(k.2) << 52).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let bits = self.slots.len().trailing_zeros();
        (h >> (64 - bits)) as usize
    }

    /// The slot holding `k`, if any.
    #[inline]
    fn find(&self, k: &Key) -> Option<usize> {
        if self.len == 0 {
            return None;
        }
        let mask = self.slots.len() - 1;
        let mut i = self.home(k);
        loop {
            let s = &self.slots[i];
            if s.id == EMPTY {
                return None;
            }
            if s.va == k.0 && s.pa == k.1 && s.mode == k.2 {
                return Some(i);
            }
            i = (i + 1) & mask;
        }
    }

    /// The fragment of `k`.
    #[inline]
    pub(crate) fn get(&self, k: &Key) -> Option<u32> {
        self.find(k).map(|i| self.slots[i].id)
    }

    /// Maps `k` to fragment `id` (`id != u32::MAX`); returns the fragment it replaces.
    pub(crate) fn insert(&mut self, k: Key, id: u32) -> Option<u32> {
        debug_assert_ne!(id, EMPTY);
        if (self.len + 1) * 4 > self.slots.len() * 3 {
            self.grow();
        }
        let mask = self.slots.len() - 1;
        let mut i = self.home(&k);
        loop {
            let s = &mut self.slots[i];
            if s.id == EMPTY {
                *s = Slot {
                    va: k.0,
                    pa: k.1,
                    mode: k.2,
                    id,
                };
                self.len += 1;
                return None;
            }
            if s.key() == k {
                return Some(core::mem::replace(&mut s.id, id));
            }
            i = (i + 1) & mask;
        }
    }

    /// Doubles the table (64 slots at first) and re-inserts every key.
    fn grow(&mut self) {
        let cap = (self.slots.len() * 2).max(64);
        let old = core::mem::replace(&mut self.slots, alloc::vec![EMPTY_SLOT; cap]);
        self.len = 0;
        for s in old.iter().filter(|s| s.id != EMPTY) {
            self.insert(s.key(), s.id);
        }
    }

    /// Unmaps `k`; returns its fragment.
    pub(crate) fn remove(&mut self, k: &Key) -> Option<u32> {
        let mut hole = self.find(k)?;
        let id = self.slots[hole].id;
        let mask = self.slots.len() - 1;
        // Backward shift: each following key of the run moves into the hole unless its
        // home lies cyclically in (hole, j].
        let mut j = hole;
        loop {
            j = (j + 1) & mask;
            let s = self.slots[j];
            if s.id == EMPTY {
                break;
            }
            let home = self.home(&s.key());
            let stays = if hole <= j {
                hole < home && home <= j
            } else {
                hole < home || home <= j
            };
            if !stays {
                self.slots[hole] = s;
                hole = j;
            }
        }
        self.slots[hole] = EMPTY_SLOT;
        self.len -= 1;
        Some(id)
    }

    /// Unmaps every key (the table keeps its size).
    pub(crate) fn clear(&mut self) {
        if self.len != 0 {
            self.slots.fill(EMPTY_SLOT);
            self.len = 0;
        }
    }

    /// Every (key, fragment), in no particular order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (Key, u32)> + '_ {
        self.slots
            .iter()
            .filter(|s| s.id != EMPTY)
            .map(|s| (s.key(), s.id))
    }
}

#[cfg(test)]
mod tests {
    use super::FragmentMap;
    use alloc::collections::BTreeMap;

    /// Inserts, replacements and removals agree with a `BTreeMap`, over clustered keys
    /// (one page's VAs, shared page offsets, both modes) and through growth.
    #[test]
    fn test_fragment_map_agrees_with_btreemap() {
        let mut m = FragmentMap::new();
        let mut r = BTreeMap::new();
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for step in 0..200_000u32 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let off = x % 512;
            let va = 0xffff_ffff_8100_0000 + (x >> 20) % 8 * 0x1000 + off;
            let key = (va, 0x100_0000 + (va & 0xFFFF), (x >> 40) as u32 % 2 * 3);
            match x % 5 {
                0 | 1 => assert_eq!(m.remove(&key), r.remove(&key), "step {step}"),
                _ => assert_eq!(m.insert(key, step), r.insert(key, step), "step {step}"),
            }
            assert_eq!(m.len(), r.len());
            if step % 9973 == 0 {
                let mut all: alloc::vec::Vec<_> = m.iter().collect();
                all.sort_unstable();
                let want: alloc::vec::Vec<_> = r.iter().map(|(k, v)| (*k, *v)).collect();
                assert_eq!(all, want, "step {step}");
            }
        }
        for (k, v) in &r {
            assert_eq!(m.get(k), Some(*v));
        }
        m.clear();
        assert_eq!((m.len(), m.get(r.keys().next().expect("keys"))), (0, None));
    }
}
