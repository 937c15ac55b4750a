//! Why a run must end, as the run loop and the page-fault handler report it: one enum,
//! so the loop matches on causes and the log line is written in one place.

use core::fmt;

use guest_engine::shadow_mmu::ShadowError;
use guest_engine::vcpu::Event;
use iced_x86::Mnemonic;

use crate::ring0::crash::vector_name;

/// A reason the engine cannot continue the guest.
#[derive(Clone, Debug)]
pub enum RunError {
    /// The same #PF repeats although the shadow MMU maps the page.
    NoProgress {
        /// Guest RIP of the faulting instruction.
        rip: u64,
        /// The faulting address.
        cr2: u64,
        /// The hardware error code.
        error: u32,
    },
    /// The shadow MMU failed.
    Shadow {
        /// Guest RIP where it happened.
        rip: u64,
        /// What failed.
        error: ShadowError,
    },
    /// An instruction other than a plain store writes into its own code frame.
    SelfModifyingStore {
        /// Its guest RIP.
        rip: u64,
        /// What it is.
        mnemonic: Mnemonic,
    },
    /// The guest fetches code the translator cannot decode.
    Undecodable {
        /// The fetch address.
        va: u64,
    },
    /// A memory operand lies outside the reserved zone (PML4 slots 256-259) while its
    /// base register lies inside it (or within 2 GiB below it).
    BaseInReservedZone {
        /// Guest RIP of the instruction.
        rip: u64,
        /// The base register's value.
        base: u64,
    },
    /// The guest's own access in the reserved zone could not be performed.
    ZoneAccess {
        /// Guest RIP of the instruction.
        rip: u64,
        /// Why.
        error: guest_engine::EngineError,
    },
    /// A delivery triple-faulted.
    TripleFault {
        /// Guest RIP of the first event.
        rip: u64,
        /// The event being delivered.
        first: Event,
        /// The fault raised while delivering #DF.
        last: Event,
    },
}

impl fmt::Display for RunError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RunError::NoProgress { rip, cr2, error } => write!(
                f,
                "the guest instruction at RIP {rip:#x} keeps faulting (#PF at {cr2:#x}, hardware error code {error:#x}) although the shadow MMU maps it: no progress"
            ),
            RunError::Shadow { rip, error } => {
                write!(f, "shadow MMU failure at guest RIP {rip:#x}: {error}")
            }
            RunError::SelfModifyingStore { rip, mnemonic } => write!(
                f,
                "the guest instruction at RIP {rip:#x} ({mnemonic:?}) writes into its own code frame; only plain `mov` and `movs`/`stos` stores are emulated there"
            ),
            RunError::Undecodable { va } => write!(
                f,
                "the guest fetches code at {va:#x} that the translator cannot decode"
            ),
            RunError::BaseInReservedZone { rip, base } => write!(
                f,
                "the guest instruction at RIP {rip:#x} addresses memory its own tables map from a base register ({base:#x}) in or just below PML4 slots 256-259, which the engine reserves; only instructions whose one memory access is their explicit operand are performed there"
            ),
            RunError::ZoneAccess { rip, error } => write!(
                f,
                "the guest instruction at RIP {rip:#x} accesses its own mapping in PML4 slots 256-259 (reserved by the engine), and running it on a copy of the operand failed: {error}"
            ),
            RunError::TripleFault { rip, first, last } => write!(
                f,
                "the guest triple-faulted: {} (vector {}) at RIP {rip:#x}, then {} (vector {}, error code {:#x}) while delivering #DF",
                vector_name(u64::from(first.vector)),
                first.vector,
                vector_name(u64::from(last.vector)),
                last.vector,
                last.error.unwrap_or(0)
            ),
        }
    }
}
