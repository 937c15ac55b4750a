//! Layouts shared across the guest boundary by the VMM, the guest engine and the host
//! daemon: where things live in the stolen region, the attach block, the host I/O ring, the
//! record ring and the engine's ports; and the x86-64 architectural constants all of them
//! use (`x86`).
//! `#[repr(C)]`, fixed-width fields, no dependencies, `no_std`.
//!
//! Invariant: every change to a layout here bumps that layout's `VERSION`, and both sides
//! check magic and version before trusting a block.
#![no_std]
#![deny(missing_docs)]

pub mod attach;
pub mod attach_control;
pub mod io_ring;
pub mod mmio;
pub mod output;
pub mod pci;
pub mod ports;
pub mod record_ring;
pub mod stolen;
pub mod x86;
