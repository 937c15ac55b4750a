//! Direct trace linking: `patch_*` rewrites the rel32 of a branch in one fragment so that
//! it jumps straight to another fragment's entry instead of its exit stub.
//!
//! `Engine::link` makes a link when the dispatcher resolves a direct exit, and records it
//! in the target's `incoming` list; `Engine::unlink_incoming` undoes them all.
//!
//! Invariants: links only join fragments of the same mode; which entry a link targets is
//! the PA check's decision (`softtlb::link_target`: `entry`; a cross-page link is in
//! `CodeCache::trusted_links` until its page's lookups are cleared, which points it at
//! the `checked_entry`). Every linked exit is in its target's `incoming` list
//! and marked `linked`, so `unpatch_*` can point it back at its exit stub (when the target
//! is invalidated or failed its PA check); a whole-cache flush drops everything. The
//! patched field lies inside the cache region.

use crate::addr::CachePc;
use crate::dispatch::Engine;
use crate::fragment::{ExitKind, Fragment};
use crate::softtlb::link_target;

/// Rewrites the rel32 at `at` so the branch ending at `at+4` reaches `target`.
///
/// # Safety
/// `at..at+4` must be a rel32 field of a branch inside the writable code cache, and no
/// thread may be executing that instruction while it is rewritten.
pub(crate) unsafe fn patch_branch(at: CachePc, target: CachePc) {
    let rel = target.0.wrapping_sub(at.0 + 4) as u32;
    // SAFETY: the caller guarantees the four bytes are a writable rel32 field.
    unsafe { core::ptr::write_unaligned(at.0 as *mut [u8; 4], rel.to_le_bytes()) };
}

/// Where the rel32 branch whose displacement is at `at` currently goes.
///
/// # Safety
/// `at..at+4` must be a rel32 field inside the code cache.
pub(crate) unsafe fn branch_target(at: CachePc) -> CachePc {
    // SAFETY: the caller guarantees the four bytes are a readable rel32 field.
    let rel = unsafe { core::ptr::read_unaligned(at.0 as *const i32) };
    CachePc((at.0 + 4).wrapping_add(rel as i64 as u64))
}

/// Points a linked branch back at its exit stub.
///
/// # Safety
/// As for [`patch_branch`].
pub(crate) unsafe fn unpatch_branch(at: CachePc, stub: CachePc) {
    // SAFETY: forwarded contract.
    unsafe { patch_branch(at, stub) };
}

impl Engine {
    /// Links direct exit `exit` of fragment `from` to fragment `to` (same mode only;
    /// `global`: `to`'s page is a global page, as its lookup just said, whose links a CR3
    /// write keeps trusting).
    pub(crate) fn link(&mut self, exit: u32, from: u32, to: u32, patch_at: CachePc, global: bool) {
        let (src, dst): (&Fragment, &Fragment) = (
            &self.cache.fragments[from as usize],
            &self.cache.fragments[to as usize],
        );
        if src.mode != dst.mode {
            return;
        }
        let (target, trusted) = link_target(src, dst);
        if trusted {
            let page = dst.start.page().0;
            self.cache.trusted(page, global).push((exit, to));
        }
        // SAFETY: `patch_at` is the rel32 of a branch of fragment `from`, inside the
        // cache; nothing executes in the cache while the dispatcher runs.
        unsafe { patch_branch(patch_at, target) };
        if let Some(r) = self.cache.exits.get_mut(exit as usize) {
            if let ExitKind::Direct { linked, .. } = &mut r.kind {
                *linked = true;
            }
        }
        self.cache.fragments[to as usize].incoming.push(exit);
        self.stats.links += 1;
    }

    /// Points every branch linked to fragment `id` back at its exit stub.
    pub(crate) fn unlink_incoming(&mut self, id: u32) {
        let incoming = core::mem::take(&mut self.cache.fragments[id as usize].incoming);
        for e in incoming {
            if let Some(r) = self.cache.exits.get_mut(e as usize) {
                if let ExitKind::Direct {
                    patch_at,
                    stub,
                    linked,
                    ..
                } = &mut r.kind
                {
                    if *linked {
                        // SAFETY: `patch_at` is a rel32 inside the cache; the cache is not
                        // running while the dispatcher does this.
                        unsafe { unpatch_branch(*patch_at, *stub) };
                        *linked = false;
                    }
                }
            }
        }
    }
}
