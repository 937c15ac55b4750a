//! External interrupts and time: the pending-vector bitmap the ring-0 interrupt stubs
//! fill and the virtual CPU delivers from (`irq.rs`), the PIT, the PIC mask and the TSC
//! (`timer.rs`).

pub mod irq;
pub mod timer;
