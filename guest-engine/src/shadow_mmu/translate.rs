//! VA → PA answered from the shadow entries, for the translator (instruction fetch in a
//! view) and for physical-address arguments of instrumentation. (The engine image's
//! `GuestMemory::translate` answers with [`ShadowMmu::lookup`] and, on a miss, a fill;
//! the SoftTLB that translated code reads, `crate::softtlb`, is filled from those
//! answers.)
//!
//! Invariant: an answer is what the guest's tables say now *as far as a real TLB would
//! know*: a present shadow leaf is trusted (it is dropped whenever a real TLB entry would
//! be), permissions are checked against the guest rights the leaf records, and anything
//! else goes through a fill (a guest walk that sets A/D bits exactly as hardware would).

use super::phys::PhysMem;
use super::{pte, Access, FillOutcome, ShadowError, ShadowMmu, View};
use crate::addr::{GuestPhys, GuestVirt};

impl<M: PhysMem> ShadowMmu<M> {
    /// Translates `va` for `access` in `view`, filling the shadow on a miss. `Ok(None)`
    /// if the access would fault in the guest (the fault is counted, not delivered — use
    /// [`ShadowMmu::fill`] to get it). A write to a protected code frame translates (this
    /// is a lookup; the write itself still faults in hardware).
    pub fn translate(
        &mut self,
        va: GuestVirt,
        access: Access,
        view: View,
    ) -> Result<Option<GuestPhys>, ShadowError> {
        if let Some(pa) = self.lookup(va, access, view)? {
            return Ok(Some(pa));
        }
        Ok(match self.fill(va, access, view)? {
            FillOutcome::Mapped { pa } | FillOutcome::ProtectedCode { pa, .. } => Some(pa),
            FillOutcome::GuestFault(_) => None,
        })
    }

    /// Whether the shadow leaf mapping `va` in `view` is of a global guest page (G = 1
    /// with CR4.PGE = 1: it survives CR3 writes); `false` without a leaf.
    pub fn is_global(&mut self, va: GuestVirt, view: View) -> Result<bool, ShadowError> {
        Ok(self
            .shadow_entry(va, view)?
            .is_some_and(|e| e & pte::SW_GLOBAL != 0))
    }

    /// Answers from the shadow entry alone: `Some(pa)` if a present leaf permits `access`,
    /// `None` if a fill is needed (which may still succeed).
    pub fn lookup(
        &mut self,
        va: GuestVirt,
        access: Access,
        view: View,
    ) -> Result<Option<GuestPhys>, ShadowError> {
        let Some(e) = self.shadow_entry(va, view)? else {
            return Ok(None);
        };
        // The user view may be served by a unified kernel root: its supervisor leaves
        // (in the upper half) are not the user's.
        if view == View::User && e & pte::SW_GUEST_USER == 0 {
            return Ok(None);
        }
        let permitted = match access {
            Access::Read => true,
            Access::Write => e & pte::SW_WRITABLE != 0,
            Access::Fetch => {
                e & pte::SW_GUEST_NX == 0
                    && !(view == View::Kernel && self.control().smep && e & pte::SW_GUEST_USER != 0)
            }
        };
        Ok(permitted.then_some(GuestPhys(
            (e & pte::ADDR_MASK) | (va.0 & (pte::TABLE_BYTES - 1)),
        )))
    }
}
