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
use alloc::boxed::Box;
use alloc::vec::Vec;

/// A translated trace.
///
/// Kept small: the cache's fragment table has a fixed size (`code_cache::MAX_FRAGMENTS`,
/// 8 MiB of these), and a full table flushes the cache. The entry points are offsets from
/// `base` and the revival key is split so that the small fields share words: 120 bytes,
/// where addresses and tuples made it 168 (a generic 6.12 Linux boot, ~61 000 traces,
/// flushed once for it).
#[derive(Debug)]
pub(crate) struct Fragment {
    pub start: GuestVirt,
    pub pa: GuestPhys,
    /// The keyed hash of the guest bytes it was translated from (`crate::revive`).
    pub code_hash: u64,
    pub base: CachePc,
    pub mode: Mode,
    /// Bytes of code from `base`.
    pub len: u32,
    /// The entry points, as offsets from `base` (read through the methods below).
    pub offsets: EntryOffsets,
    /// The length of those guest bytes from `start`; 0 if it may not be revived.
    pub code_len: u16,
    /// Cache PC → guest state (`crate::recover`).
    pub pc_map: PcMap,
    pub calls: Box<[CallSpec]>,
    /// Exit records currently linked to this fragment (undone by `unlink_incoming`).
    pub incoming: Vec<u32>,
}

/// A fragment's entry points, as offsets from its `base` (`crate::arch::Translated`'s).
#[derive(Clone, Copy, Debug)]
pub(crate) struct EntryOffsets {
    pub checked_entry: u32,
    pub ret_entry: u32,
    pub entry: u32,
    pub body: u32,
    /// Where a link of the trace's own back edge enters (past its hoisted checks; never
    /// offset 0, the PA check's).
    pub loop_entry: Option<core::num::NonZeroU32>,
}

impl Fragment {
    fn at(&self, off: u32) -> CachePc {
        CachePc(self.base.0 + u64::from(off))
    }

    /// The entry past nothing: the SoftTLB's PA check first.
    pub(crate) fn checked_entry(&self) -> CachePc {
        self.at(self.offsets.checked_entry)
    }

    /// The return cache's entry.
    pub(crate) fn ret_entry(&self) -> CachePc {
        self.at(self.offsets.ret_entry)
    }

    /// The entry past the PA check.
    pub(crate) fn entry(&self) -> CachePc {
        self.at(self.offsets.entry)
    }

    /// The trace's first guest instruction.
    pub(crate) fn body(&self) -> CachePc {
        self.at(self.offsets.body)
    }

    /// Where a link of the trace's own back edge enters, if it has one.
    pub(crate) fn loop_entry(&self) -> Option<CachePc> {
        self.offsets.loop_entry.map(|o| self.at(o.get()))
    }
}

const _: () = assert!(core::mem::size_of::<Fragment>() <= 120);

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
