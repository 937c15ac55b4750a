//! Emulated devices and the port-I/O bus that reaches them.
//!
//! Only what a PC guest needs to boot, talk and power off: COM1, the i8042 (keyboard
//! controller, keyboard, reset line), PCI configuration space with a host bridge, the
//! ACPI PM1 blocks and reset register, plus the engine's doorbell and failure ports. The PIC,
//! PIT and local APIC are KVM's in-kernel devices and never reach this bus.

pub mod acpi_pm;
pub mod bus;
pub mod engine_ports;
pub mod i8042;
pub mod mmio;
pub mod pci;
pub mod serial;
pub mod virtio;

/// An ISA interrupt line a device raises (an irqfd on the in-kernel 8259).
pub trait IrqLine {
    /// Pulses the line (an edge on the 8259).
    fn trigger(&self);
}

impl IrqLine for vmm_sys_util::eventfd::EventFd {
    fn trigger(&self) {
        // A full eventfd counter already means a pending pulse: nothing is lost.
        let _ = self.write(1);
    }
}
