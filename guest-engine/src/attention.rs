//! The attention byte: one byte in the cache context, tested at every trace entry.
//!
//! Invariant: generated code only reads it; the engine (interrupt arrival, detach request,
//! invalidation) sets it, and the dispatcher clears it after handling the exit it causes.
//! A set byte makes the next trace entry leave the cache with the `ATTENTION` exit, with
//! the guest state exactly at that trace's first instruction.

/// Reasons the attention byte may be set (bits of the byte).
pub mod reason {
    /// An interrupt is pending for the guest.
    pub const INTERRUPT: u8 = 1 << 0;
    /// The embedder asks the engine to detach.
    pub const DETACH: u8 = 1 << 1;
    /// Translations were invalidated.
    pub const INVALIDATE: u8 = 1 << 2;
    /// The host harness asked for a stop (tests).
    pub const REQUEST: u8 = 1 << 3;
}
