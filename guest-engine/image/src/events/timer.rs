//! The PIC and PIT, programmed from CPL 3 through the gate, and the tick counts the
//! ring-0 interrupt stubs keep. `_start` already remapped the PIC to vectors 0x20–0x2f
//! and masked every line.

use core::arch::x86_64::_rdtsc;

use crate::ring0::entry::{kpin_irq_at_cpl3, kpin_irq_counts};
use crate::ring0::gate;
use crate::ring0::layout::{PIC1_DATA, PIT_CH0, PIT_CMD, PIT_HZ, PIT_MODE_RATE};

/// The TSC.
pub fn tsc() -> u64 {
    // SAFETY: `rdtsc` is available at CPL 3 (CR4.TSD is clear) and has no side effects.
    unsafe { _rdtsc() }
}

/// IRQ 0 (PIT) interrupts handled so far.
pub fn pit_ticks() -> u64 {
    // SAFETY: a naturally aligned u64 written only by the ring-0 stub; volatile, since
    // interrupts change it behind the compiler's back.
    unsafe { core::ptr::read_volatile(&raw const kpin_irq_counts[0]) }
}

/// Interrupts (any line) that arrived while the CPU was at CPL 3.
pub fn irqs_at_cpl3() -> u64 {
    // SAFETY: as for `pit_ticks`.
    unsafe { core::ptr::read_volatile(&raw const kpin_irq_at_cpl3) }
}

/// Starts the PIT at `hz` on IRQ 0 and unmasks IRQ 0 only.
pub fn start_pit(hz: u64) {
    let divisor = (PIT_HZ / hz).clamp(1, 0xffff) as u16;
    gate::out8(PIT_CMD, PIT_MODE_RATE);
    gate::out8(PIT_CH0, divisor as u8);
    gate::out8(PIT_CH0, (divisor >> 8) as u8);
    gate::out8(PIC1_DATA, 0xfe);
}

/// Masks every PIC line again.
pub fn stop_pit() {
    gate::out8(PIC1_DATA, 0xff);
}
