//! The engine's error type. Guest events (exits, faults the guest should see) are
//! values ([`crate::dispatch::Stop`]), not errors; errors are engine failures.

use crate::addr::GuestVirt;

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
