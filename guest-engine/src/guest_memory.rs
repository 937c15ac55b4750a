//! The seam through which the translator fetches guest code: VA → PA → bytes.
//!
//! The host harness implements it over its own address space; the in-guest engine
//! (`image/src/mm/guest_memory.rs`) over the shadow MMU. Invariant: `translate` answers for *instruction
//! fetch* in the given mode (a user-mode fetch of a supervisor page fails).

use crate::addr::{GuestPhys, GuestVirt};

/// Translation mode of a trace: virtual CPL and anything else that changes how guest
/// code is translated. Traces are keyed by ⟨VA, PA, mode⟩.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Mode(pub u32);

impl Mode {
    /// Guest kernel code (virtual CPL 0).
    pub const KERNEL: Mode = Mode(0);
    /// Guest user code (virtual CPL 3).
    pub const USER: Mode = Mode(3);

    /// The stepping bit: the guest's RFLAGS.TF is set, so every trace is one guest
    /// instruction, nothing is linked or looked up inline, and the dispatcher stops after
    /// each instruction (`Stop::Stepped`) for the single-step #DB.
    const STEP: u32 = 4;

    /// The compatibility bit: 32-bit guest code (a CPL-3 code segment with L = 0,
    /// D = 1), decoded as 32-bit code and translated into equivalent 64-bit code.
    const COMPAT: u32 = 8;

    /// The timestamp-faulting bit: user code under CR4.TSD, whose `rdtsc`/`rdtscp` leave
    /// to the virtual CPU (which raises #GP(0)) instead of running natively.
    const TSD: u32 = 16;

    /// The virtual CPL the mode translates for (its low two bits).
    pub fn cpl(self) -> u8 {
        (self.0 & 3) as u8
    }

    /// Whether the mode single-steps ([`Mode::stepping`]).
    pub fn is_stepping(self) -> bool {
        self.0 & Self::STEP != 0
    }

    /// The same CPL, single-stepping.
    pub fn stepping(self) -> Mode {
        Mode(self.0 | Self::STEP)
    }

    /// Whether the mode translates 32-bit code ([`Mode::compat`]).
    pub fn is_compat(self) -> bool {
        self.0 & Self::COMPAT != 0
    }

    /// The same CPL, for 32-bit code.
    pub fn compat(self) -> Mode {
        Mode(self.0 | Self::COMPAT)
    }

    /// Whether `rdtsc`/`rdtscp` fault in the mode ([`Mode::timestamp_faulting`]).
    pub fn is_timestamp_faulting(self) -> bool {
        self.0 & Self::TSD != 0
    }

    /// The same mode, with `rdtsc`/`rdtscp` emulated (CR4.TSD at CPL 3).
    pub fn timestamp_faulting(self) -> Mode {
        Mode(self.0 | Self::TSD)
    }

    /// The decoder bitness of the mode's guest code: 32 or 64.
    pub fn bitness(self) -> u32 {
        if self.is_compat() {
            32
        } else {
            64
        }
    }

    /// Index of the mode's counters (`layout::MODE_SLOTS`): by CPL, so that stepping and
    /// 32-bit modes count with their CPL's; `None` for a mode the engine has no slot for
    /// (32-bit code only runs at CPL 3).
    pub fn slot(self) -> Option<usize> {
        match self.0 & !(Self::STEP | Self::TSD) {
            0 => Some(0),
            3 | 11 => Some(1),
            _ => None,
        }
    }

    /// Index of the mode's lookup tables (`layout::TABLE_SLOTS`): its counter slot; for a
    /// stepping mode the extra slot whose tables are never filled, so that every indirect
    /// branch and return leaves to the dispatcher; for 32-bit code a slot of its own (a
    /// VA may hold code run in both bitnesses).
    pub fn table_slot(self) -> Option<usize> {
        let slot = self.slot()?;
        // (Timestamp-faulting code is rare: it shares the stepping modes' empty tables.)
        Some(if self.is_stepping() || self.is_timestamp_faulting() {
            crate::layout::STEP_TABLE_SLOT
        } else if self.is_compat() {
            crate::layout::COMPAT_TABLE_SLOT
        } else {
            slot
        })
    }
}

/// Guest memory as seen by the translator.
pub trait GuestMemory {
    /// Translates `va` for instruction fetch in `mode`; `None` if the fetch would fault.
    fn translate(&mut self, va: GuestVirt, mode: Mode) -> Option<GuestPhys>;
    /// [`GuestMemory::translate`], and whether the page is global (its mapping survives
    /// a guest CR3 write: only `invlpg` or a global flush drops it, so the engine may
    /// keep what it learnt of it across `Engine::invalidate_nonglobal_mappings`). By
    /// default never global.
    fn translate_global(&mut self, va: GuestVirt, mode: Mode) -> Option<(GuestPhys, bool)> {
        self.translate(va, mode).map(|pa| (pa, false))
    }
    /// Translates `va` for a data access in `mode` (physical addresses of memory records
    /// and `IArg::MemPa`); by default as a fetch, which is wrong only for no-execute pages.
    fn translate_data(&mut self, va: GuestVirt, mode: Mode) -> Option<GuestPhys> {
        self.translate(va, mode)
    }
    /// Reads guest physical memory; `false` if any byte is not backed.
    fn read(&mut self, pa: GuestPhys, out: &mut [u8]) -> bool;
}
