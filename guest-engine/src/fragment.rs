//! A fragment is one translated trace in the code cache, with its exits.
//!
//! Invariants: a fragment's code occupies `[base, base+len)`; `checked_entry < ret_entry <
//! entry ≤ body` are addresses inside it; its exit records are contiguous in the cache's exit table.

use crate::addr::{CachePc, GuestPhys, GuestVirt};
use crate::arch::ExitSpec;
use crate::guest_memory::Mode;
use crate::instrument::CallSpec;
use crate::link::branch_target;
use crate::pc_map::PcMap;
use crate::platform::SensitiveInsn;
use alloc::vec::Vec;

/// A translated trace.
#[derive(Debug)]
pub(crate) struct Fragment {
    pub start: GuestVirt,
    pub pa: GuestPhys,
    pub mode: Mode,
    /// The guest bytes it was translated from: their length from `start` and their keyed
    /// hash (`crate::revive`); length 0 if it may not be revived.
    pub code: (u16, u64),
    pub base: CachePc,
    pub len: usize,
    pub checked_entry: CachePc,
    pub ret_entry: CachePc,
    pub entry: CachePc,
    pub body: CachePc,
    /// Where a link of the trace's own back edge enters (past its hoisted checks).
    pub loop_entry: Option<CachePc>,
    /// Cache PC → guest state (`crate::recover`).
    pub pc_map: PcMap,
    pub calls: Vec<CallSpec>,
    /// Exit records currently linked to this fragment (undone by `unlink_incoming`).
    pub incoming: Vec<u32>,
}

/// What an exit record does when its stub is reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ExitKind {
    /// Direct branch to `target`; `patch_at` is the rel32 field linking rewrites.
    Direct {
        target: GuestVirt,
        patch_at: CachePc,
        /// The exit stub the branch reaches when unlinked.
        stub: CachePc,
        linked: bool,
    },
    /// Sensitive instruction.
    Sensitive(SensitiveInsn),
    /// Attention byte set.
    Attention,
    /// Cross-page entry with a stale PA.
    PaMismatch,
    /// Record buffer full; the last `held` records belong to the instruction about to run.
    BufferFull { resume: CachePc, held: u8 },
    /// Analysis call `call` of the fragment.
    Call { call: usize, resume: CachePc },
    /// A check hoisted to the fragment's top hit.
    HoistMiss,
}

impl ExitKind {
    /// The exit `spec` of a trace just committed, its offsets made addresses by `at`.
    pub(crate) fn committed(spec: ExitSpec, at: impl Fn(usize) -> CachePc) -> Self {
        match spec {
            ExitSpec::Direct { target, patch_off } => ExitKind::Direct {
                target: GuestVirt(target),
                patch_at: at(patch_off),
                // SAFETY: the freshly committed branch's rel32 lies in the cache and still
                // points at its stub.
                stub: unsafe { branch_target(at(patch_off)) },
                linked: false,
            },
            ExitSpec::Sensitive(s) => ExitKind::Sensitive(s),
            ExitSpec::Attention => ExitKind::Attention,
            ExitSpec::PaMismatch => ExitKind::PaMismatch,
            ExitSpec::BufferFull { resume_off, held } => ExitKind::BufferFull {
                resume: at(resume_off),
                held,
            },
            ExitSpec::Call { call, resume_off } => ExitKind::Call {
                call,
                resume: at(resume_off),
            },
            ExitSpec::HoistMiss => ExitKind::HoistMiss,
        }
    }
}

/// One exit of one fragment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ExitRecord {
    pub fragment: u32,
    pub kind: ExitKind,
}
