//! kpin's guest engine: an x86-64 trace JIT with a Pin-style instrumentation API.
//!
//! `no_std` + `alloc`. The embedder provides a raw RWX region (the code cache), a
//! [`GuestMemory`] to fetch guest code and a [`Platform`] to emulate sensitive
//! instructions; tools implement [`Tool`]. See `guest-engine/README.md` for the register
//! convention, exit codes, trace layout and a tool example.
#![no_std]
#![deny(missing_docs)]

extern crate alloc;

pub mod addr;
mod arch;
pub mod attention;
mod bits;
mod code_cache;
pub mod context;
pub mod dispatch;
pub mod error;
mod fast_lookup;
mod fragment;
pub mod guest_memory;
pub mod host_flags;
mod insn_count;
pub mod instrument;
pub mod layout;
mod link;
pub mod native;
mod pc_map;
pub mod platform;
pub mod profile;
mod records;
pub mod recover;
pub mod redirect;
mod revive;
pub mod shadow_mmu;
mod softtlb;
pub mod tasks;
mod tool_switch;
pub mod vcpu;
pub mod vflags;

pub use addr::{CachePc, GuestPhys, GuestVirt};
pub use attention::AttentionHandle;
pub use context::{Gpr, GuestRegs};
pub use dispatch::{Config, Engine, Stats, Stop};
pub use error::EngineError;
pub use guest_memory::{GuestMemory, Mode};
pub use host_flags::HostFlags;
pub use instrument::{
    access, CounterId, IArg, IPoint, InsInfo, InsKind, MemOperand, MemRecord, NullTool, SegBase,
    Tool, TraceInstrumenter,
};
pub use platform::{Emulation, Platform, SensitiveInsn, SensitiveKind, StopPlatform};
pub use recover::{FaultRedirect, Recovered};

/// Exit codes of the cache (see the header of `arch/x86_64/entry.rs`).
pub mod exit_code {
    pub use crate::arch::x86_64::entry::{
        exit_word, EXIT_ANALYSIS_CALL, EXIT_ATTENTION, EXIT_BUFFER_FULL, EXIT_DIRECT, EXIT_FAULT,
        EXIT_HOIST_MISS, EXIT_IBL_MISS, EXIT_KINDS, EXIT_PA_MISMATCH, EXIT_SENSITIVE,
    };
}

/// The reserved zone that translated memory operands are checked against.
pub mod isolation {
    pub use crate::arch::x86_64::isolate::{
        classify_fault, in_isolation_zone, page_fault_address, Fence, IsolationFault, PageRights,
        ISOLATION_ZONE_END, ISOLATION_ZONE_START,
    };
}
