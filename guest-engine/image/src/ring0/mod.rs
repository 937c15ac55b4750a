//! What runs at ring 0 or is the engine's own machine state: the entry code, exception
//! and interrupt stubs and the gate (`entry.rs`, asm), the CPL-3 side of the gate
//! (`gate.rs`), the engine's GDT/TSS/IDT (`engine_tables.rs`) and page tables
//! (`page_tables.rs`), the report of an exception in the engine itself (`crash.rs`), the
//! bring-up constants (`layout.rs`) and the address-space probe (`probe.rs`).
//!
//! The engine log (`log.rs`: lines and tool files into the host I/O ring, the doorbell
//! and failure ports through the gate) lives here too: everything else stands on it.
//! Nothing here imports the rest of the image: `entry.rs` enters the CPL-3 main flow
//! through the `kpin_engine_main` symbol (`run/bringup.rs`).

pub mod crash;
pub mod engine_tables;
pub mod entry;
pub mod gate;
pub mod layout;
pub mod log;
pub mod page_tables;
pub mod probe;
