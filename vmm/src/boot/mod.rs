//! Booting a guest: the guest-physical layout, loading an ELF64 or bzImage kernel with
//! linux-loader (zero page, command line, initrd, boot page tables, the vCPU's long-mode
//! entry state), the ACPI tables that give the guest poweroff and reset, the MP table that
//! ends Linux's search for one, and wiring the local APIC's LINT pins as a PC BIOS leaves
//! them.

pub mod acpi;
pub mod layout;
pub mod lint;
pub mod loader;
pub mod mptable;

pub use loader::{
    detect_format, initial_fpu, initial_regs, initial_sregs, load, BootInfo, KernelFormat, BOOT_CS,
    BOOT_DS,
};
