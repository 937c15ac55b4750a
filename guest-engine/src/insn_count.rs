//! Engine-side instruction counting (`Config::count_insns`): the engine counts the guest
//! instructions it executes, per mode, with ordinary inline counters.
//!
//! Invariants: a mode's count is the sum of its `INSN_COUNTER_SPREAD` counter slots (the
//! first `MODE_SLOTS × INSN_COUNTER_SPREAD` slots of the counter area, allocated before
//! any tool's); each basic block adds its instruction count at its start, before any tool
//! insertion there; an emulated sensitive instruction adds one in the mode it ran in; a
//! precise fault takes back the faulting instruction and the rest of its block. Without
//! `Config::count_insns` nothing here emits code or touches a counter.

use alloc::vec::Vec;

use crate::addr::{CachePc, GuestVirt};
use crate::arch::decode_trace;
use crate::dispatch::Engine;
use crate::guest_memory::{GuestMemory, Mode};
use crate::instrument::{Action, Bbl, CounterId, IPoint, Insertion};
use crate::layout::INSN_COUNTER_SPREAD;

/// Counter `h` of mode slot `m`'s instruction counters (`base`: the first of them). A
/// mode's count is spread over `INSN_COUNTER_SPREAD` slots chosen by block address, so
/// that consecutive blocks do not serialize on one memory location (each increment is a
/// load-add-store through store forwarding).
fn insn_counter(base: Option<CounterId>, m: usize, h: usize) -> Option<CounterId> {
    Some(CounterId(base?.0 + (m * INSN_COUNTER_SPREAD + h) as u32))
}

impl Engine {
    /// Guest instructions executed in `mode` so far (0 unless `Config::count_insns`):
    /// translated instructions counted per basic block, plus sensitive instructions the
    /// platform emulated (`Continue`/`Switch`), minus the not-executed rest of a block a
    /// fault left (`Stop::Fault`). A `rep` string instruction counts once.
    pub fn executed_insns(&self, mode: Mode) -> u64 {
        match mode.slot() {
            Some(m) => (0..INSN_COUNTER_SPREAD)
                .filter_map(|h| insn_counter(self.insn_counters, m, h))
                .fold(0, |sum, id| sum.wrapping_add(self.counter(id))),
            None => 0,
        }
    }

    /// The block-count insertions for a trace's blocks in the current mode (none without
    /// `Config::count_insns`). They go before the tool's insertions: insertions at one
    /// instruction are emitted in order, so the engine's counter comes first at each block
    /// start, like a tool's block counter. Appended to `insertions`.
    pub(crate) fn block_count_insertions(&self, bbls: &[Bbl], insertions: &mut Vec<Insertion>) {
        for b in bbls {
            let h = (b.address.0 ^ b.address.0 >> 8) as usize % INSN_COUNTER_SPREAD;
            if let Some(id) = insn_counter(self.insn_counters, self.slot, h) {
                insertions.push(Insertion {
                    ins: b.first,
                    point: IPoint::Before,
                    action: Action::Counter {
                        id,
                        amount: b.count as i32,
                    },
                });
            }
        }
    }

    /// The embedder completed the sensitive instruction the platform stopped on
    /// (`Emulation::Stop`: a CR3 write or `invlpg` whose shadow work only the run loop
    /// can hand to the translator): it counts as executed, in the mode it ran in, and a
    /// tool that records fetches gets its fetch record. Call before the mode or RIP
    /// changes. (Without this, the ~21 000 CR3 writes and `invlpg`s of a Linux boot were
    /// counted nowhere, by the engine or by cachesim.)
    pub fn complete_stopped_emulation(&mut self, tool: &mut dyn crate::instrument::Tool) {
        Self::deliver_fetch(tool, self.held_fetch.take());
        self.count_emulated();
    }

    /// Counts one emulated sensitive instruction in the current mode.
    pub(crate) fn count_emulated(&mut self) {
        if self.insn_counters.is_some() {
            self.stats.emulated_insns += 1;
            self.add_insns(self.slot, 1);
        }
    }

    /// Adds `n` (two's complement) to mode slot `m`'s instruction count.
    fn add_insns(&mut self, m: usize, n: u64) {
        if let Some(id) = insn_counter(self.insn_counters, m, 0) {
            let slot = (self.cache.counters() + 8 * u64::from(id.0)) as *mut u64;
            // SAFETY: the slot lies in the counter area; the cache is not running.
            unsafe { slot.write(slot.read().wrapping_add(n)) };
        }
    }

    /// A fault at guest instruction `guest_pc` (cache PC `pc`) left the rest of its basic
    /// block unexecuted, but the block's instruction count was added at its start: take
    /// back the faulting instruction and those after it in the block. The block structure
    /// is re-derived by decoding the fragment's trace again (faults are rare; storing it
    /// per fragment would cost memory for every trace).
    pub(crate) fn uncount_after_fault(
        &mut self,
        mem: &mut dyn GuestMemory,
        pc: CachePc,
        guest_pc: GuestVirt,
    ) {
        if self.insn_counters.is_none() {
            return;
        }
        let Some(f) = self.cache.fragment_at(pc) else {
            return;
        };
        let (start, pa, mode) = (f.start, f.pa, f.mode);
        let (Some(m), Ok(t)) = (
            mode.slot(),
            decode_trace(
                mem,
                start,
                pa,
                mode,
                self.config.inline_virtual_flags,
                &mut self.scratch,
            ),
        ) else {
            return;
        };
        let Some(k) = t.info.iter().position(|i| i.address == guest_pc) else {
            return;
        };
        if let Some(b) = t
            .bbls
            .iter()
            .find(|b| (b.first..b.first + b.count).contains(&k))
        {
            let n = (b.first + b.count - k) as u64;
            self.stats.insns_taken_back += n;
            self.add_insns(m, n.wrapping_neg());
        }
    }
}
