//! Engine-side instruction counting (`Config::count_insns`): the engine counts the guest
//! instructions it executes, per mode, with ordinary inline counters.
//!
//! Invariants: a mode's count is the sum of its `INSN_COUNTER_SPREAD` counter slots (the
//! first `MODE_SLOTS × INSN_COUNTER_SPREAD` slots of the counter area, allocated before
//! any tool's); each basic block adds its instruction count once, at its *count point*
//! ([`count_point`]: its first instruction before which no status flag is live, else
//! its first instruction), before any tool insertion there; an emulated sensitive
//! instruction adds one in the mode it ran in; a precise fault leaves the count at the
//! instructions executed before it. Without `Config::count_insns` nothing here emits
//! code or touches a counter.
//!
//! Why the count point: where a flag is live, the add must not touch the flags and takes
//! five instructions (spill, load, `lea`, store, reload) instead of one `add` to memory;
//! at a block's start a flag is live two times in three (often only AF, which `test`,
//! `and` and the like leave undefined rather than write), while most blocks reach a
//! `cmp` or an arithmetic instruction that writes every flag a little further on.

use alloc::vec::Vec;

use crate::addr::{CachePc, GuestVirt};
use crate::arch::{decode_trace, flags_liveness};
use crate::dispatch::Engine;
use crate::guest_memory::{GuestMemory, Mode};
use crate::instrument::{Action, Bbl, CounterId, IPoint, Insertion};
use crate::layout::{INSN_COUNTER_SPREAD, MODE_SLOTS};

/// Where block `b` adds its instruction count: its first instruction before which no
/// status flag is live (`live`: flags live before each instruction of the trace), else
/// its first instruction. The translator and the fault path derive it alike.
pub(crate) fn count_point(b: &Bbl, live: &[u32]) -> usize {
    (b.first..b.first + b.count)
        .find(|&k| live.get(k) == Some(&0))
        .unwrap_or(b.first)
}

/// Counter slots the engine allocates for itself with `Config::count_insns`, before any
/// tool's: each mode's `INSN_COUNTER_SPREAD`, then one for the sensitive instructions the
/// translation ran inline (an `iretq` of virtual CPL 0, `Tx::emit_inline_iretq`).
pub(crate) const ENGINE_COUNTER_SLOTS: u32 = (MODE_SLOTS * INSN_COUNTER_SPREAD) as u32 + 1;

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

    /// The block-count insertions for a trace's blocks `bbls` (`live`: its flags
    /// liveness) in the current mode (none without `Config::count_insns`), each at its
    /// block's [`count_point`]. They go before the tool's insertions: insertions at one
    /// instruction are emitted in order, so the engine's counter comes first there.
    /// Appended to `insertions`.
    pub(crate) fn block_count_insertions(
        &self,
        bbls: &[Bbl],
        live: &[u32],
        insertions: &mut Vec<Insertion>,
    ) {
        for b in bbls {
            let h = (b.address.0 ^ b.address.0 >> 8) as usize % INSN_COUNTER_SPREAD;
            if let Some(id) = insn_counter(self.insn_counters, self.slot, h) {
                insertions.push(Insertion {
                    ins: count_point(b, live),
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

    /// The addresses of the counters an inline `iretq` of the current mode adds one to:
    /// the mode's instruction count and the inline emulations (`None` without
    /// `Config::count_insns`).
    pub(crate) fn inline_iret_counters(&self) -> Option<(u64, u64)> {
        let base = self.cache.counters();
        let mode = insn_counter(self.insn_counters, self.slot, 0)?;
        let inline = CounterId(self.insn_counters?.0 + ENGINE_COUNTER_SLOTS - 1);
        Some((base + 8 * u64::from(mode.0), base + 8 * u64::from(inline.0)))
    }

    /// Sensitive instructions the translation ran inline so far.
    pub(crate) fn inline_emulated(&self) -> u64 {
        self.insn_counters.map_or(0, |c| {
            self.counter(CounterId(c.0 + ENGINE_COUNTER_SLOTS - 1))
        })
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
    /// block unexecuted: if the block's count point was passed, take back the faulting
    /// instruction and those after it in the block, else add those before it. (The
    /// statistic `insns_taken_back` counts the former either way: what a count at the
    /// block's start, as a tool's, takes back.) The block structure and count point are
    /// re-derived by decoding the fragment's trace again (faults are rare; storing them
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
        let Some(b) = t
            .bbls
            .iter()
            .find(|b| (b.first..b.first + b.count).contains(&k))
            .copied()
        else {
            return;
        };
        let mut live = core::mem::take(&mut self.scratch.live);
        flags_liveness(&t, &mut live, self.config.host_flags);
        let counted = k >= count_point(&b, &live);
        self.scratch.live = live;
        let rest = (b.first + b.count - k) as u64;
        self.stats.insns_taken_back += rest;
        if counted {
            self.add_insns(m, rest.wrapping_neg());
        } else {
            self.add_insns(m, (k - b.first) as u64);
        }
    }
}
