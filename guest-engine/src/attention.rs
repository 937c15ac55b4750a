//! The attention byte: one byte in the cache context, tested at every trace entry.
//!
//! Invariants: generated code only reads it (a `cmp`/`movzx` at every trace `entry`); the
//! embedder sets it (an interrupt stub through [`AttentionHandle::address`], a test
//! through [`AttentionHandle::set`] or [`Engine::set_attention`]) and clears it with
//! [`Engine::set_attention`]`(0)` once it has handled the stop; the engine never clears
//! it. A set byte makes the next trace entry leave the cache with the `ATTENTION` exit,
//! and the dispatcher returns `Stop::Attention` before entering any fragment, so the guest
//! state is exactly that before a trace's first instruction.

use crate::dispatch::Engine;

/// Reasons the attention byte may be set (bits of the byte).
pub mod reason {
    /// An interrupt is pending for the guest.
    pub const INTERRUPT: u8 = 1 << 0;
    /// The host harness asked for a stop (tests).
    pub const REQUEST: u8 = 1 << 3;
}

/// Lets another thread (or an interrupt handler) set the attention byte while the guest
/// runs. Valid as long as the engine lives.
#[derive(Clone, Copy, Debug)]
pub struct AttentionHandle(*mut u64);

// SAFETY: the handle only performs volatile stores of a u64 the generated code reads; the
// engine outlives its users by contract of `Engine::attention_handle`.
unsafe impl Send for AttentionHandle {}

impl AttentionHandle {
    /// Sets the attention reasons (0 clears).
    pub fn set(&self, bits: u8) {
        // SAFETY: points at `CacheContext::attention` of a live engine.
        unsafe { core::ptr::write_volatile(self.0, u64::from(bits)) };
    }

    /// The address of the attention word, for code that cannot hold the handle (e.g. an
    /// interrupt stub that ORs a reason into its low byte).
    pub fn address(&self) -> u64 {
        self.0 as u64
    }
}

impl Engine {
    /// Sets or clears attention reasons (see `attention::reason`).
    pub fn set_attention(&mut self, bits: u8) {
        self.ctx_mut().attention = u64::from(bits);
    }

    /// A handle for setting the attention byte asynchronously.
    pub fn attention_handle(&self) -> AttentionHandle {
        AttentionHandle(self.cache.ctx.attention as *mut u64)
    }
}
