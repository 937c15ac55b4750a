//! Reviving traces whose guest bytes did not change.
//!
//! A write to a code frame drops every trace translated from it (`Engine::
//! invalidate_code_page`): the write fault comes before the write, which the engine
//! cannot yet judge. Most of those traces do not cover the bytes written — Linux's boot
//! patches its text a few bytes at a time (`text_poke_early`, ~1 700 writes to frames
//! holding traces, ~17 000 traces dropped) — and ran again soon after, each retranslated
//! (~9·10³ cycles).
//!
//! So a dropped trace is *buried*, not forgotten: its code stays in the cache (until the
//! next flush), and a later miss on the same (VA, PA, mode) first compares the guest
//! bytes now there with those it was translated from. Equal: the trace is looked up
//! again as it was, its frame protected again by the read (`GuestMemory::read`), with no
//! decoding, instrumentation or emission. Its links were undone when it was dropped and
//! are made again as its exits are taken.
//!
//! The comparison is by a keyed hash of the trace's bytes (`Fragment::code`: from its
//! start to the end of its last instruction, all within its page; a trace whose last
//! instruction reaches into the next page is never buried), taken at translation from
//! the very bytes decoded: SipHash-2-4 with a key the embedder draws at start
//! (`Config::code_hash_key`), so that a guest cannot construct bytes that collide.

use core::hash::Hasher;

use crate::addr::{GuestPhys, GuestVirt};
use crate::dispatch::Engine;
use crate::guest_memory::GuestMemory;

/// Most buried traces kept; one more and every burial so far is forgotten.
pub(crate) const MAX_BURIED: usize = 1 << 14;

/// The keyed hash of guest code bytes `bytes`.
pub(crate) fn code_hash(key: [u64; 2], bytes: &[u8]) -> u64 {
    // SipHash-2-4 (`core::hash::SipHasher`: deprecated as a default hasher, not as a
    // keyed one).
    #[allow(deprecated)]
    let mut h = core::hash::SipHasher::new_with_keys(key[0], key[1]);
    h.write(bytes);
    h.finish()
}

impl Engine {
    /// The trace buried for `va` (at `pa`) in the current mode, looked up again if its
    /// guest bytes are still those it was translated from.
    pub(crate) fn revive(
        &mut self,
        mem: &mut dyn GuestMemory,
        va: GuestVirt,
        pa: GuestPhys,
    ) -> Option<u32> {
        let key = (va.0, pa.0, self.mode.0);
        let id = self.cache.buried.remove(&key)?;
        let f = &self.cache.fragments[id as usize];
        let (len, hash) = (usize::from(f.code_len), f.code_hash);
        let buf = &mut self.scratch.fetch_buf()[..len];
        if !mem.read(pa, buf) || code_hash(self.config.code_hash_key, buf) != hash {
            return None;
        }
        self.cache.insert_key(key, id);
        self.cache
            .fast
            .put(va, self.mode, pa, id, self.lookup_global);
        self.stats.revived += 1;
        Some(id)
    }
}
