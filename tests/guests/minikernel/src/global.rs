//! [`Global`]: a `static` cell for the kernel's single CPU.
//!
//! Invariant: the mini-kernel runs on exactly one CPU, and a value is only shared between
//! straight-line kernel code and trap handlers that interrupt it. Every access is one
//! volatile read or write of a `Copy` value, so a handler never observes a torn update the
//! compiler invented, and no reference into the cell is ever held across an access.

use core::cell::UnsafeCell;
use core::ptr::{read_volatile, write_volatile};

/// A mutable global with volatile, copy-in/copy-out access.
pub struct Global<T>(UnsafeCell<T>);

// SAFETY: one CPU only (see the module invariant); accesses are whole-value volatile copies and
// never create references, so there are no overlapping borrows to race.
unsafe impl<T: Copy> Sync for Global<T> {}

impl<T: Copy> Global<T> {
    /// A cell holding `value`.
    pub const fn new(value: T) -> Self {
        Self(UnsafeCell::new(value))
    }

    /// The current value.
    pub fn get(&self) -> T {
        // SAFETY: the pointer comes from a live static cell; one CPU, no references held.
        unsafe { read_volatile(self.0.get()) }
    }

    /// Replaces the value.
    pub fn set(&self, value: T) {
        // SAFETY: as in `get`.
        unsafe { write_volatile(self.0.get(), value) }
    }

    /// Raw pointer to the value (for assembly and page-table code).
    pub const fn as_ptr(&self) -> *mut T {
        self.0.get()
    }
}
