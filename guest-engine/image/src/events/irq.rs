//! External interrupts for the guest. Once the guest runs it owns the PIC (its port I/O
//! passes through the gate), so the engine's interrupt stubs (entry.rs) only record each
//! vector in a 256-bit pending bitmap and set the translator's attention byte; the guest
//! sends its own EOI. The dispatcher delivers the highest pending vector at the next
//! `Stop::Attention` when the virtual IF allows it, or on wake from `hlt`.

use core::sync::atomic::{AtomicU64, Ordering};

use guest_engine::attention::reason;
use guest_engine::Engine;

use crate::ring0::entry::{kpin_attention_at, kpin_guest_irqs, kpin_irq_pending};

fn word(i: usize) -> &'static AtomicU64 {
    // SAFETY: `kpin_irq_pending` is 4 aligned u64s in the engine's .bss, written only by
    // single-instruction read-modify-writes in the ring-0 stubs (an interrupt never splits
    // an instruction), so atomic accesses from CPL 3 see a consistent word.
    unsafe { AtomicU64::from_ptr((&raw const kpin_irq_pending[i]).cast_mut()) }
}

/// Hands the interrupt vectors to the guest: from now on the stubs record them for the
/// guest and set `engine`'s attention byte instead of sending an EOI.
pub fn hand_over(engine: &Engine) {
    let at = engine.attention_handle().address();
    // SAFETY: plain stores the stubs read; the attention address (stored first) stays
    // valid for the engine's lifetime, which is the rest of the run.
    unsafe {
        core::ptr::write_volatile(&raw mut kpin_attention_at, at);
        core::ptr::write_volatile(&raw mut kpin_guest_irqs, 1);
    }
}

/// The highest pending vector, if any.
pub fn highest() -> Option<u8> {
    (0..4).rev().find_map(|i| {
        let w = word(i).load(Ordering::Relaxed);
        (w != 0).then(|| (i * 64 + 63 - w.leading_zeros() as usize) as u8)
    })
}

/// Marks `vector` delivered.
pub fn take(vector: u8) {
    word(usize::from(vector) / 64).fetch_and(!(1u64 << (vector % 64)), Ordering::Relaxed);
}

/// Sets the attention byte again if a vector is pending (after the virtual IF became 1).
pub fn rearm_if_pending() {
    if highest().is_some() {
        // SAFETY: `kpin_attention_at` was set by `hand_over` to the live engine's byte.
        let at = unsafe { core::ptr::read_volatile(&raw const kpin_attention_at) };
        if at != 0 {
            // SAFETY: the attention word of the live engine (a u64 the generated code
            // reads); the stubs only OR bits into its low byte.
            unsafe { core::ptr::write_volatile(at as *mut u64, u64::from(reason::INTERRUPT)) };
        }
    }
}
