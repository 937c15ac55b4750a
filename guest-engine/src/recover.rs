//! Recovery: mapping a code-cache PC back to guest state (DynamoRIO's `translate.c`), for
//! precise faults in translated code.
//!
//! Invariants: every cache PC inside a fragment has a PC-map mark at or before it (the
//! translator marks each guest instruction, each glue sequence and each exit stub), and
//! the mark says which guest instruction the code belongs to and which guest GPRs are in
//! their spill slots there; the guest state at a faulting cache PC is the hardware
//! registers with those GPRs taken from the spill slots, and is the state before the
//! guest instruction executes (glue before an instruction never changes guest state that
//! the instruction's restart would not redo). A fault redirected by the embedder's handler
//! (`FaultRedirect`) arrives as the `FAULT` exit and stops the run with `Stop::Fault`.

use core::sync::atomic::{AtomicU64, Ordering};

use crate::addr::{CachePc, GuestVirt};
use crate::context::GuestRegs;
use crate::dispatch::{Engine, Stop};
use crate::error::EngineError;

/// What a fault handler needs to turn a fault in cache code into a `FAULT` exit: store
/// the faulting PC at `fault_pc` and resume at `exit_routine` (the fault exit, which
/// stores the exit word itself) with the faulting registers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FaultRedirect {
    /// Address of `CacheContext::fault_pc`, or of the cell given to
    /// [`Engine::take_fault_pc_from`].
    pub fault_pc: u64,
    /// The cache's fault exit.
    pub exit_routine: u64,
    /// The cache region (faults outside it are not the engine's).
    pub region: (u64, u64),
}

/// Guest state recovered at a code-cache PC (for precise exceptions).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Recovered {
    /// The guest instruction the PC belongs to.
    pub guest_pc: GuestVirt,
    /// Bit per GPR (hardware number) whose guest value lives in the context spill slot.
    pub spilled: u16,
}

impl Engine {
    /// Addresses a fault handler uses to redirect a fault in cache code.
    pub fn fault_redirect(&self) -> FaultRedirect {
        FaultRedirect {
            fault_pc: self
                .fault_pc_cell
                .map_or(self.cache.ctx.fault_pc, |c| c.as_ptr() as u64),
            exit_routine: self.cache.gen.fault_exit,
            region: self.cache.region(),
        }
    }

    /// The lane address the isolation check of a gather/scatter with 64-bit vector
    /// indices tested last (for `isolation::classify_fault`).
    pub fn vector_lane_checked(&self) -> u64 {
        self.ctx().vsib_lane
    }

    /// From now on the fault handler stores the faulting cache PC in `cell`, not in the
    /// context: a handler that has no register to spare for the context's address (the
    /// image's ring-0 #PF stub, whose every instruction KVM emulates) stores to a fixed
    /// place instead.
    pub fn take_fault_pc_from(&mut self, cell: &'static AtomicU64) {
        self.fault_pc_cell = Some(cell);
    }

    /// Maps a code-cache PC back to its guest instruction and register locations.
    pub fn recover(&self, pc: CachePc) -> Option<Recovered> {
        let f = self.cache.fragment_at(pc)?;
        let off = (pc.0 - f.base.0) as u32;
        let (guest_pc, spilled) = f.pc_map.lookup(off, f.start.0)?;
        Some(Recovered {
            guest_pc: GuestVirt(guest_pc),
            spilled,
        })
    }

    /// Guest registers at a faulting cache PC, given the hardware registers there.
    pub fn recover_regs(&self, pc: CachePc, hw: &GuestRegs) -> Option<(GuestVirt, GuestRegs)> {
        let r = self.recover(pc)?;
        let mut g = *hw;
        for n in 0..16 {
            if r.spilled & (1 << n) != 0 {
                g.gpr[n] = self.ctx().spill[n];
            }
        }
        Some((r.guest_pc, g))
    }

    /// Handles a `FAULT` exit: the guest state at the faulting cache PC becomes the
    /// engine's state (registers, RIP), the executed-instruction count forgets what the
    /// fault cut short, and the run stops with `Stop::Fault`.
    pub(crate) fn stop_at_fault(&mut self) -> Stop {
        let pc = CachePc(
            self.fault_pc_cell
                .map_or(self.ctx().fault_pc, |c| c.load(Ordering::Relaxed)),
        );
        let hw = self.ctx().regs;
        match self.recover_regs(pc, &hw) {
            Some((guest_pc, regs)) => {
                self.ctx_mut().regs = regs;
                self.rip = guest_pc;
                self.drop_records_of(guest_pc);
                self.uncount_after_fault(pc, guest_pc);
                Stop::Fault {
                    guest_pc,
                    cache_pc: pc,
                }
            }
            None => Stop::Error(EngineError::FaultOutsideFragments(pc)),
        }
    }
}
