//! kpin's virtual machine monitor: one KVM VM with one vCPU, guest RAM plus a stolen
//! region, COM1, an i8042 reset line, a Linux/ELF boot loader, and a guest-state dump on
//! every unexpected exit. The `kpin` binary (`src/main.rs`) is its command-line front end.
#![deny(missing_docs)]

pub mod acpi;
pub mod attach;
pub mod boot;
pub mod cpuid;
pub mod devices;
pub mod dump;
pub mod engine_boot;
pub mod engine_loader;
pub mod error;
pub mod guests;
pub mod layout;
pub mod memory;
pub mod paging;
pub mod report;
pub mod symbols;
pub mod vm;
pub mod watchdog;
pub mod x86;

pub use engine_boot::EngineConfig;
pub use error::{Result, VmmError};
pub use vm::{Outcome, RunReport, Vm, VmConfig};
