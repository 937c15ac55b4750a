//! Lending a kernel root across a guest CR3 write ([`ShadowConfig::lend_roots`]).
//!
//! A real CR3 load is a ring-0 round trip (~6·10^4 cycles under nested KVM), and Linux
//! makes two for every instruction it patches after boot: `text_poke` switches to
//! `poking_mm`, writes through a temporary lower-half mapping and switches back to
//! `init_mm` — about 8 700 times in a uniprocessor boot, whose `alternatives_smp_unlock`
//! patches every `lock` prefix of the kernel one at a time. Both spaces share their
//! kernel half (`pgd_alloc` copies it), and `init_mm` maps nothing in the lower half.
//!
//! So: when the guest switches from space O to a space N that has no kernel root
//! cached, and O's kernel root has an empty lower half, that root is *lent* to N: it now
//! serves N (its lower half fills from N's tables on demand) and stays in the real CR3.
//! Nothing in the hardware TLB can be stale: the lower half held no leaf (every leaf
//! ever dropped from the loaded root was flushed before guest code ran again, the MMU's
//! invariant); in the upper half, non-global leaves are checked against N's tables as
//! on any CR3 write, and global ones survive the write as they do on a CPU, whatever
//! N's tables say (in Linux every space shares one kernel half: `pgd_alloc` copies it).
//! A space with a root of its own keeps using it, so a process's cached leaves are
//! never given up for a loan.
//!
//! When the guest later switches to a space that has no kernel root of its own and a
//! lent root was built for it, the root *goes home*: its lower half (the borrower's)
//! leaves it, which owes a hardware flush if the root is loaded — one real CR3 load
//! where the two switches made two. That lower half is *parked* (its few PML4 entries
//! kept with the root, the tables below them left as they are) and put back at the
//! next loan to the same space, checked against the guest's tables then as a CR3 write
//! checks any leaf: the next `text_poke`, of the same page or of another (the leaf
//! moves to the frame mapped now), needs no shadow fill. A
//! parked lower half is dropped when the root is lent elsewhere, evicted or flushed.
//! A lent root is otherwise an ordinary root of its borrower (evicted, split or
//! revalidated as any other).

use super::phys::PhysMem;
use super::walk::Rights;
use super::{pte, ShadowError, ShadowMmu, View};
use crate::addr::GuestPhys;

/// PML4 entries below this index map the lower half.
const LOWER_HALF_SLOTS: usize = pte::ENTRIES / 2;
/// Most lower-half PML4 entries a root parks; a borrower with more is dropped instead.
const PARK_SLOTS: usize = 4;

/// A borrower's lower half, taken out of a root that went home (module header).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Parked {
    /// The borrower's space, if anything is parked.
    space: Option<u64>,
    /// (PML4 index, shadow entry) of each parked subtree.
    entries: [(usize, u64); PARK_SLOTS],
    len: usize,
}

impl<M: PhysMem> ShadowMmu<M> {
    /// On a guest CR3 write from `old` to `new` (different spaces): a root lent by `new`
    /// goes home, or `old`'s kernel root is lent to `new` (module header). Returns the
    /// root lent, whose parked lower half [`ShadowMmu::unpark`] puts back once the
    /// write's revalidation is done.
    pub(super) fn lend_or_return(
        &mut self,
        old: u64,
        new: u64,
    ) -> Result<Option<GuestPhys>, ShadowError> {
        let has_own = self.kernel_root_of(new).is_some();
        if !has_own {
            if let Some(i) = self
                .roots
                .iter()
                .position(|r| r.view == View::Kernel && r.home == new && r.space != new)
            {
                let root = self.roots[i].root;
                let borrower = self.roots[i].space;
                self.park_lower_half(root, borrower)?;
                let r = &mut self.roots[i];
                r.space = new;
                r.filled = true;
                self.stats.roots_returned += 1;
                return Ok(None);
            }
        }
        let Some(i) = self
            .roots
            .iter()
            .position(|r| r.space == old && r.view == View::Kernel)
        else {
            return Ok(None);
        };
        let root = self.roots[i].root;
        if has_own || !self.lower_half_empty(root)? {
            return Ok(None);
        }
        let r = &mut self.roots[i];
        r.home = old;
        r.space = new;
        r.filled = true;
        self.stats.roots_lent += 1;
        Ok(Some(root))
    }

    /// Takes the lower half of `root` (lent to `borrower`) out of it: parked if it has
    /// at most [`PARK_SLOTS`] PML4 entries, else dropped. The caller owes the flush.
    fn park_lower_half(&mut self, root: GuestPhys, borrower: u64) -> Result<(), ShadowError> {
        self.drop_parked(root)?;
        let mut parked = Parked {
            space: Some(borrower),
            ..Parked::default()
        };
        let mut next = 0;
        while let Some((i, e)) = self.next_present(root, next, LOWER_HALF_SLOTS)? {
            next = i + 1;
            if parked.len == PARK_SLOTS {
                return self.drop_lower_half(root);
            }
            parked.entries[parked.len] = (i, e);
            parked.len += 1;
        }
        for &(i, _) in &parked.entries[..parked.len] {
            self.write(Self::slot_addr(root, i), 0)?;
        }
        // The entries just cleared were in the real CR3 if `root` is loaded.
        self.narrowed |= parked.len != 0;
        if let Some(r) = self.roots.iter_mut().find(|r| r.root == root) {
            r.parked = parked;
        }
        Ok(())
    }

    /// Puts back what `root` parked for `space` (each subtree first checked against the
    /// guest's tables of `space`, as a CR3 write checks leaves: `revalidate.rs`); drops
    /// what it parked for any other space. Nothing of it was in the real CR3 since its
    /// last load, so what this drops owes no flush: `write_cr3` calls it after deciding
    /// the flush.
    pub(super) fn unpark(&mut self, root: GuestPhys, space: u64) -> Result<(), ShadowError> {
        let Some(r) = self.roots.iter_mut().find(|r| r.root == root) else {
            return Ok(());
        };
        let parked = core::mem::take(&mut r.parked);
        if parked.space != Some(space) {
            r.parked = parked;
            return self.drop_parked(root);
        }
        let all = Rights {
            writable: true,
            user: true,
            no_execute: false,
        };
        for &(i, e) in &parked.entries[..parked.len] {
            let child = GuestPhys(e & pte::ADDR_MASK);
            let guest = self.guest_entry(space, i, pte::LEVELS)?;
            let rights = guest.map_or(all, |g| Rights {
                writable: g & pte::WRITABLE != 0,
                user: g & pte::USER != 0,
                no_execute: self.control.nxe && g & pte::NO_EXECUTE != 0,
            });
            let va = (i as u64) << (pte::PAGE_SHIFT + 9 * u32::from(pte::LEVELS - 1));
            let (empty, nonglobal) = self.revalidate_table(
                child,
                pte::LEVELS - 1,
                va,
                guest.map(|g| g & pte::ADDR_MASK),
                rights,
                View::Kernel,
            )?;
            if empty {
                self.free_table(child);
            } else {
                let e = if nonglobal {
                    e | pte::SW_NONGLOBAL_BELOW
                } else {
                    e & !pte::SW_NONGLOBAL_BELOW
                };
                self.write(Self::slot_addr(root, i), e)?;
            }
        }
        Ok(())
    }

    /// Drops the subtrees `root` parked, if any (they are in no real CR3).
    pub(super) fn drop_parked(&mut self, root: GuestPhys) -> Result<(), ShadowError> {
        let Some(r) = self.roots.iter_mut().find(|r| r.root == root) else {
            return Ok(());
        };
        let parked = core::mem::take(&mut r.parked);
        for &(_, e) in &parked.entries[..parked.len] {
            self.drop_subtree(e)?;
        }
        Ok(())
    }

    /// Drops the leaves under the lower-half PML4 entry `e` and frees its tables.
    fn drop_subtree(&mut self, e: u64) -> Result<(), ShadowError> {
        let child = GuestPhys(e & pte::ADDR_MASK);
        self.zap_table(child, pte::LEVELS - 1, false)?;
        self.free_table(child);
        Ok(())
    }

    /// Whether the shadow `root` maps nothing in the lower half.
    fn lower_half_empty(&mut self, root: GuestPhys) -> Result<bool, ShadowError> {
        Ok(self.next_present(root, 0, LOWER_HALF_SLOTS)?.is_none())
    }

    /// Drops every leaf `root` maps in the lower half and frees the tables below it.
    fn drop_lower_half(&mut self, root: GuestPhys) -> Result<(), ShadowError> {
        let mut next = 0;
        while let Some((i, e)) = self.next_present(root, next, LOWER_HALF_SLOTS)? {
            next = i + 1;
            self.write(Self::slot_addr(root, i), 0)?;
            self.drop_subtree(e)?;
        }
        Ok(())
    }
}
