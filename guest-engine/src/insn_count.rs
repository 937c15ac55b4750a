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
use crate::dispatch::Engine;
use crate::guest_memory::Mode;
use crate::instrument::{Action, Bbl, CounterId, IPoint, Insertion};
use crate::layout::{INSN_COUNTER_SPREAD, MODE_SLOTS};

/// Where block `b` adds its instruction count: its first instruction before which no
/// status flag is live (`live`: flags live before each instruction of the trace), else
/// its first instruction. The translator derives it, and keeps it for the fault path
/// ([`encode_block_counts`]).
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
    /// block's start, as a tool's, takes back.) Where the instruction stands in its block
    /// comes from the block counts the translator kept in the fragment's PC map
    /// ([`encode_block_counts`]).
    pub(crate) fn uncount_after_fault(&mut self, pc: CachePc, guest_pc: GuestVirt) {
        if self.insn_counters.is_none() {
            return;
        }
        let Some(f) = self.cache.fragment_at(pc) else {
            return;
        };
        let (Some(m), Some(at)) = (
            f.mode.slot(),
            block_position(f.pc_map.block_counts(), f.start.0, guest_pc.0),
        ) else {
            return;
        };
        self.stats.insns_taken_back += at.rest as u64;
        if at.counted {
            self.add_insns(m, (at.rest as u64).wrapping_neg());
        } else {
            self.add_insns(m, at.before as u64);
        }
    }
}

/// Where an instruction stands in its basic block, for the fault path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BlockPosition {
    /// Instructions of the block before it.
    pub before: usize,
    /// It and the instructions after it in the block.
    pub rest: usize,
    /// The block's count point is at or before it: the block's count was added.
    pub counted: bool,
}

/// Appends to `out` what the fault path needs of a trace's blocks `bbls` (`info`: its
/// instructions, `live`: its flags liveness, `start`: its first instruction's address)
/// to place a faulting instruction in its block without decoding the trace again (which
/// cost ~12 000 cycles a fault: 2 % of a Linux boot). Per block: the zigzag varint of
/// its address less where the block before it ended (the trace's start for the first;
/// not 0 after a followed jump), its instruction count, its count point's index in it,
/// then its instructions' lengths, two 4-bit lengths a byte (a block's instructions are
/// contiguous: a followed jump ends one). ~12 bytes a trace.
pub(crate) fn encode_block_counts(
    bbls: &[Bbl],
    info: &[crate::instrument::InsInfo],
    live: &[u32],
    start: u64,
    out: &mut Vec<u8>,
) {
    let mut end = start;
    for b in bbls {
        let d = b.address.0.wrapping_sub(end) as i64;
        crate::pc_map::put_varint(out, ((d << 1) ^ (d >> 63)) as u64);
        // Both fit: a trace has at most `MAX_TRACE_INSNS` (96) instructions.
        out.push(b.count as u8);
        out.push((count_point(b, live) - b.first) as u8);
        let lens = &info[b.first..b.first + b.count];
        for pair in lens.chunks(2) {
            out.push(pair[0].len | pair.get(1).map_or(0, |i| i.len << 4));
        }
        end = b
            .address
            .0
            .wrapping_add(lens.iter().map(|i| u64::from(i.len)).sum::<u64>());
    }
}

/// The position of the instruction at `guest_pc` in its block, from a trace's
/// [`encode_block_counts`] (`start`: the trace's first address); `None` if no
/// instruction of the trace starts there.
pub(crate) fn block_position(enc: &[u8], start: u64, guest_pc: u64) -> Option<BlockPosition> {
    let (mut at, mut end) = (0usize, start);
    while at < enc.len() {
        let z = crate::pc_map::get_varint(enc, &mut at)?;
        let mut pc = end.wrapping_add((z >> 1) ^ (z & 1).wrapping_neg());
        let count = usize::from(*enc.get(at)?);
        let point = usize::from(*enc.get(at + 1)?);
        at += 2;
        for i in 0..count {
            if pc == guest_pc {
                return Some(BlockPosition {
                    before: i,
                    rest: count - i,
                    counted: i >= point,
                });
            }
            let pair = *enc.get(at + i / 2)?;
            pc = pc.wrapping_add(u64::from(if i % 2 == 0 { pair & 0xF } else { pair >> 4 }));
        }
        at += count.div_ceil(2);
        end = pc;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::instrument::{InsInfo, InsKind, MemOps};

    fn insn(address: u64, len: u8) -> InsInfo {
        InsInfo {
            address: GuestVirt(address),
            len,
            kind: InsKind::Plain,
            mem: MemOps::default(),
            rep: false,
            opcode: 0,
        }
    }

    #[test]
    fn test_block_position_answers_as_the_blocks_say() {
        // Three blocks: 0x1000.. (3 instructions, count point at its second), a followed
        // jump back to 0x0ff0 (2 instructions, the longest and shortest lengths), then
        // 0x2000.. (1 instruction), the next block after a jump forward.
        let start = 0x1000;
        let info = [
            insn(0x1000, 3),
            insn(0x1003, 4),
            insn(0x1007, 2),
            insn(0x0ff0, 15),
            insn(0x0fff, 1),
            insn(0x2000, 5),
        ];
        let bbls = [
            Bbl {
                first: 0,
                count: 3,
                address: GuestVirt(0x1000),
            },
            Bbl {
                first: 3,
                count: 2,
                address: GuestVirt(0x0ff0),
            },
            Bbl {
                first: 5,
                count: 1,
                address: GuestVirt(0x2000),
            },
        ];
        // Flags live before instruction 0, dead before 1; live throughout block 2 (its
        // count point is its first instruction); dead at block 3.
        let live = [1, 0, 0, 1, 1, 0, 1];
        let mut enc = Vec::new();
        encode_block_counts(&bbls, &info, &live, start, &mut enc);
        let at = |pc| block_position(&enc, start, pc);
        let pos = |before, rest, counted| {
            Some(BlockPosition {
                before,
                rest,
                counted,
            })
        };
        assert_eq!(at(0x1000), pos(0, 3, false));
        assert_eq!(at(0x1003), pos(1, 2, true));
        assert_eq!(at(0x1007), pos(2, 1, true));
        assert_eq!(at(0x0ff0), pos(0, 2, true));
        assert_eq!(at(0x0fff), pos(1, 1, true));
        assert_eq!(at(0x2000), pos(0, 1, true));
        // Not an instruction's start, or past the trace.
        for pc in [0x1001, 0x1009, 0x0ff1, 0x2005, 0] {
            assert_eq!(at(pc), None, "{pc:#x}");
        }
        assert_eq!(block_position(&[], start, 0x1000), None);
        // Truncated encodings answer None, never panic.
        for n in 0..enc.len() {
            let _ = block_position(&enc[..n], start, 0x2000);
        }
    }
}
