//! The seam through which the translator fetches guest code: VA → PA → bytes.
//!
//! The host harness implements it over its own address space; the in-guest engine
//! (`image/src/guest_mem.rs`) over the shadow MMU. Invariant: `translate` answers for *instruction
//! fetch* in the given mode (a user-mode fetch of a supervisor page fails).

use crate::addr::{GuestPhys, GuestVirt};

/// Translation mode of a trace: virtual CPL and anything else that changes how guest
/// code is translated. Traces are keyed by ⟨VA, PA, mode⟩.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Mode(pub u32);

/// Guest memory as seen by the translator.
pub trait GuestMemory {
    /// Translates `va` for instruction fetch in `mode`; `None` if the fetch would fault.
    fn translate(&mut self, va: GuestVirt, mode: Mode) -> Option<GuestPhys>;
    /// Reads guest physical memory; `false` if any byte is not backed.
    fn read(&mut self, pa: GuestPhys, out: &mut [u8]) -> bool;
}
