//! Native execution with the same context switch as the code cache: the reference side of
//! differential tests and benchmarks. Guest code ends a native run by jumping to
//! [`NativeRunner::exit_address`] (which, under translation, is simply an address the
//! guest cannot fetch from).

use crate::arch::{cache_enter, emit_gencode, CtxAddrs, Gencode, XsaveAreas};
use crate::context::{CacheContext, GuestRegs};
use crate::error::EngineError;
use crate::layout::{CONTEXT_BYTES, GENCODE_BYTES, XSAVE_GUEST_OFFSET, XSAVE_HOST_OFFSET};

/// Runs guest code natively from a register state and captures the state at the end.
pub struct NativeRunner {
    base: *mut u8,
    gen: Gencode,
}

impl NativeRunner {
    /// Bytes of region the runner needs.
    pub const REGION_BYTES: usize = CONTEXT_BYTES + GENCODE_BYTES;

    /// # Safety
    /// `base..base+REGION_BYTES` must be RWX memory owned by the runner, page aligned.
    pub unsafe fn new(
        base: *mut u8,
        len: usize,
        save_extended_state: bool,
    ) -> Result<Self, EngineError> {
        if len < Self::REGION_BYTES {
            return Err(EngineError::RegionSize(len));
        }
        // SAFETY: the region is writable for REGION_BYTES (checked).
        unsafe { core::ptr::write_bytes(base, 0, Self::REGION_BYTES) };
        let ctx = CtxAddrs::new(base as u64);
        let xs = save_extended_state.then(|| XsaveAreas {
            guest: base as u64 + XSAVE_GUEST_OFFSET as u64,
            host: base as u64 + XSAVE_HOST_OFFSET as u64,
        });
        // SAFETY: the gencode area follows the context inside the RWX region.
        let gen = unsafe { emit_gencode(base.add(CONTEXT_BYTES), &ctx, xs, None) };
        Ok(Self { base, gen })
    }

    /// The address guest code jumps to in order to end the run.
    pub fn exit_address(&self) -> u64 {
        self.gen.exit
    }

    /// Registers (input before `run`, output after).
    pub fn regs_mut(&mut self) -> &mut GuestRegs {
        // SAFETY: the context is at the start of the owned region.
        unsafe { &mut (*self.base.cast::<CacheContext>()).regs }
    }

    /// Registers.
    pub fn regs(&self) -> &GuestRegs {
        // SAFETY: as in `regs_mut`.
        unsafe { &(*self.base.cast::<CacheContext>()).regs }
    }

    /// Runs native code at `pc` until it jumps to `exit_address`.
    ///
    /// # Safety
    /// The code at `pc` must be valid, must end by jumping to `exit_address` without
    /// changing anything the caller relies on, and must be runnable with `regs()`.
    pub unsafe fn run(&mut self, pc: u64) {
        // SAFETY: forwarded caller contract; `gen` was emitted for this context.
        unsafe { cache_enter(&self.gen, self.base.cast(), pc) };
    }
}
