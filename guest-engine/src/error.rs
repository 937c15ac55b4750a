//! The engine's error type. Guest events (exits, faults the guest should see) are
//! values ([`crate::dispatch::Stop`]), not errors; errors are engine failures.

use crate::addr::{CachePc, GuestVirt};

/// Failures of the engine itself.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum EngineError {
    /// The region handed to the engine is too small or too large (must be < 2 GiB).
    #[error("code cache region has an unusable size ({0} bytes)")]
    RegionSize(usize),
    /// The code cache region is not aligned to a page.
    #[error("code cache region is not page aligned")]
    RegionAlignment,
    /// A single trace does not fit even in an empty cache.
    #[error("trace at {0:?} does not fit in an empty code cache")]
    TraceTooLarge(GuestVirt),
    /// An emitted label was never bound (translator bug).
    #[error("internal: unbound label")]
    UnboundLabel,
    /// A `FAULT` exit named a cache PC that no fragment's PC map covers, so the guest
    /// state there cannot be recovered.
    #[error("fault at cache PC {0:?} outside every translated fragment")]
    FaultOutsideFragments(CachePc),
    /// An exit word named an exit record that does not exist (translator or cache bug).
    #[error("internal: exit code {kind} names missing exit record {index}")]
    MissingExitRecord {
        /// The exit code (kind) of the word.
        kind: u32,
        /// The record index of the word.
        index: u32,
    },
    /// An exit word's code does not match its exit record's kind (translator bug).
    #[error("internal: exit code {kind} does not match exit record {index}")]
    ExitKindMismatch {
        /// The exit code (kind) of the word.
        kind: u32,
        /// The record index of the word.
        index: u32,
    },
    /// A short branch could not reach its label (translator bug).
    #[error("internal: branch out of range")]
    BranchOutOfRange,
    /// iced-x86 refused to re-encode an instruction.
    #[error("cannot re-encode the instruction at {0:?}")]
    Encode(GuestVirt),
    /// An instruction the translator does not support (e.g. 16-bit indirect jump).
    #[error("unsupported instruction at {0:?}")]
    Unsupported(GuestVirt),
    /// A translation mode the engine has no lookup tables for (`Mode::slot`).
    #[error("unknown translation mode {0}")]
    UnknownMode(u32),
    /// The instrumentation counter area is exhausted.
    #[error("out of inline counter slots")]
    CountersExhausted,
}
