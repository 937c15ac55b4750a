//! kpin's virtual machine monitor: one KVM VM with one vCPU, guest RAM plus a stolen
//! region, COM1, an i8042 reset line, a Linux/ELF boot loader, and a guest-state dump on
//! every unexpected exit. The `kpin` binary (`src/main.rs`) is its command-line front end.
//!
//! Layout by concept (Firecracker's `vstate/` split is the model):
//! - [`vstate`]: the KVM VM and its memory slots, the vCPU run loop, CPUID, the watchdog;
//! - [`boot`]: the guest-physical layout, the kernel loader, the LINT pins;
//! - [`devices`]: the port bus and the devices on it;
//! - [`engine`]: loading and entering the guest engine (`--tool`);
//! - [`control`]: the per-run control socket (`kpin attach|detach|status`);
//! - [`diag`]: the guest-state dump, page walks and kernel symbols.
//!
//! The flat module paths other crates use (`vmm::cpuid`, `vmm::memory`, `vmm::layout`,
//! `vmm::symbols`) stay as re-exports.
#![deny(missing_docs)]

pub mod boot;
pub mod control;
pub mod devices;
pub mod diag;
pub mod engine;
pub mod error;
pub mod guests;
pub mod input_check;
pub mod vstate;
pub mod x86;

pub use boot::layout;
pub use diag::symbols;
pub use engine::EngineConfig;
pub use error::{Result, VmmError};
pub use vstate::vcpu::{ExitCounters, Outcome, RunReport};
pub use vstate::vm::{ControlConfig, Vm, VmConfig};
pub use vstate::{cpuid, memory};
