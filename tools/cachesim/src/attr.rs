//! Attribution (`attribute=on`): the simulation's events per task and code block, in
//! Cachegrind's terms, for the per-process table, the Cachegrind file and the flame graph
//! (`report`).
//!
//! A block is where the guest's fetches went without a jump: it starts at a fetch whose
//! address is not the previous instruction's fall-through (a taken branch, an interrupt,
//! a return to another mode) and takes every later fetch and data reference until the
//! next such start. Only a block's start is looked up (a direct-mapped cache of recent
//! blocks, then a B-tree): the records in between add to the current block through a
//! cursor, with no lookup. Kernel blocks are keyed by virtual address (the kernel's
//! symbols name them); user blocks by the physical address of their first instruction
//! (the same file page is the same code in every process). The task is the row of
//! `processes.json` the engine's last [`kpin_tool::access::TASK`] record named (row 0
//! before the first).
//!
//! Cachegrind's caches map onto the hierarchy as: `I1` the cache fetches start at, `D1`
//! the cache data references start at, `LL` memory: a reference's line access that went
//! past every cache (the misses of the caches whose parent is memory; with L1s → [L2 →]
//! LL, the LL's misses). Every counted reference and miss lands in exactly one block, so
//! the blocks sum to the counters of `cachesim-counters.txt`.

use alloc::boxed::Box;
use alloc::collections::BTreeMap;
use alloc::vec;
use alloc::vec::Vec;
use core::fmt;

use crate::sim::Kind;

/// Cachegrind's events, in its order: instruction fetches and their `I1`/`LL` misses,
/// data reads and their `D1`/`LL` misses, data writes and theirs.
pub const EVENTS: [&str; 9] = [
    "Ir", "I1mr", "ILmr", "Dr", "D1mr", "DLmr", "Dw", "D1mw", "DLmw",
];
/// Index of `Ir` in [`EVENTS`]: `Ir`, `I1mr`, `ILmr` for fetches, `Dr`… for reads
/// (`+ 3`), `Dw`… for writes (`+ 6`).
pub const IR: usize = 0;
/// Offset of the first-level misses from a kind's references in [`EVENTS`].
pub const L1: usize = 1;
/// Offset of the last-level misses from a kind's references in [`EVENTS`].
pub const LL: usize = 2;

/// Blocks the engine's heap keeps at most (past that, a task's new blocks share its
/// overflow block).
pub const DEFAULT_BLOCKS: usize = 16 << 10;
/// Blocks the host keeps at most (a Linux boot and workload runs ~100 000).
pub const HOST_BLOCKS: usize = 1 << 21;
/// The code address of a task's overflow block.
pub const OVERFLOW: u64 = u64::MAX;

/// The index in [`EVENTS`] of `kind`'s references.
#[inline]
fn base(kind: Kind) -> usize {
    match kind {
        Kind::Fetch => IR,
        Kind::Read => IR + 3,
        Kind::Write => IR + 6,
    }
}

/// One block's events.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Block {
    /// The `processes.json` row it ran for.
    pub task: u32,
    /// Whether it is user-mode code (CPL 3).
    pub user: bool,
    /// Kernel: the virtual address of its first instruction; user: the physical one
    /// ([`OVERFLOW`]: a task's blocks past the table's capacity).
    pub code: u64,
    /// Counts, in [`EVENTS`] order.
    pub counts: [u64; 9],
}

/// Recent blocks' places: 2^RECENT_BITS entries.
const RECENT_BITS: u32 = 14;

/// The blocks and the cursor.
#[derive(Clone, Debug)]
pub struct Attribution {
    blocks: Vec<Block>,
    /// Where each block is in `blocks`.
    index: BTreeMap<(u32, bool, u64), u32>,
    /// Direct-mapped cache in front of `index`: (code, task << 1 | user, place).
    recent: Box<[(u64, u64, u32)]>,
    capacity: usize,
    task: u32,
    /// The current block's place in `blocks`.
    cur: usize,
    /// The fall-through of the last instruction fetched (a fetch there stays in `cur`).
    next_ip: u64,
    /// The memory-side misses seen so far (the caches below memory, both CPLs).
    mem_seen: u64,
}

impl Attribution {
    /// No blocks yet; at most `capacity` of them (then each task's overflow block).
    pub fn new(capacity: usize) -> Self {
        let mut a = Attribution {
            blocks: Vec::new(),
            index: BTreeMap::new(),
            recent: vec![(0, u64::MAX, 0); 1 << RECENT_BITS].into_boxed_slice(),
            capacity,
            task: 0,
            cur: 0,
            next_ip: u64::MAX,
            mem_seen: 0,
        };
        // Records before the first fetch (none, in a whole run) count for row 0.
        a.cur = a.place(false, OVERFLOW);
        a
    }

    /// The blocks, in the order first run.
    pub fn blocks(&self) -> &[Block] {
        &self.blocks
    }

    /// The sum of every block's counts.
    pub fn totals(&self) -> [u64; 9] {
        let mut t = [0; 9];
        for b in &self.blocks {
            for (t, c) in t.iter_mut().zip(b.counts) {
                *t += c;
            }
        }
        t
    }

    /// A `TASK` record: the records from here on run for row `row` (a row past `u32`
    /// is the engine's mistake: kept apart as the last row).
    pub fn set_task(&mut self, row: u64) {
        self.task = u32::try_from(row).unwrap_or(u32::MAX);
        // The current code goes on for the new task (its data references follow).
        let (user, code) = (self.blocks[self.cur].user, self.blocks[self.cur].code);
        self.cur = self.place(user, code);
    }

    /// A fetch of the `len` bytes of instructions at virtual address `ip` (physical `pa`)
    /// by user mode or not: a new block unless it is the last fetch's fall-through.
    #[inline]
    pub fn fetch(&mut self, ip: u64, len: u64, pa: u64, user: bool) {
        if ip != self.next_ip {
            self.cur = self.place(user, if user { pa } else { ip });
        }
        self.next_ip = ip.wrapping_add(len);
    }

    /// `refs` counted references of `kind` by the current block, `l1_misses` of their
    /// line accesses missing its first-level cache.
    #[inline]
    pub fn count(&mut self, kind: Kind, refs: u64, l1_misses: u64) {
        let b = base(kind);
        let c = &mut self.blocks[self.cur].counts;
        c[b] += refs;
        c[b + L1] += l1_misses;
    }

    /// After first-level misses of `kind`: the memory-side misses are now `mem_misses`;
    /// the new ones are the current block's last-level misses.
    #[inline]
    pub fn memory_misses(&mut self, kind: Kind, mem_misses: u64) {
        let new = mem_misses.wrapping_sub(self.mem_seen);
        self.mem_seen = mem_misses;
        self.blocks[self.cur].counts[base(kind) + LL] += new;
    }

    /// The counters were reset or are not kept yet (the warmup): the memory-side misses
    /// are now `mem_misses`, none of them a block's.
    pub fn rebase(&mut self, mem_misses: u64) {
        self.mem_seen = mem_misses;
    }

    /// The place of the block (the task's, `user`, `code`), made if new.
    #[inline(never)]
    fn place(&mut self, user: bool, code: u64) -> usize {
        let tag = u64::from(self.task) << 1 | u64::from(user);
        let h =
            (code ^ tag.rotate_right(7)).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> (64 - RECENT_BITS);
        let slot = &mut self.recent[h as usize];
        if slot.0 == code && slot.1 == tag {
            return slot.2 as usize;
        }
        let mut key = (self.task, user, code);
        let at = match self.index.get(&key) {
            Some(&at) => at,
            None => {
                if self.blocks.len() >= self.capacity {
                    key.2 = OVERFLOW;
                }
                let next = self.blocks.len() as u32;
                let at = *self.index.entry(key).or_insert(next);
                if at == next {
                    self.blocks.push(Block {
                        task: key.0,
                        user,
                        code: key.2,
                        counts: [0; 9],
                    });
                }
                at
            }
        };
        if key.2 == code {
            self.recent[h as usize] = (code, tag, at);
        }
        at as usize
    }

    /// Writes [`crate::BLOCKS_NAME`]: a header, then per block with counts
    /// `task,cpl,code,` and the [`EVENTS`] counts (`code` in hex).
    pub fn write(&self, out: &mut dyn fmt::Write) -> fmt::Result {
        out.write_str("task,cpl,code")?;
        for e in EVENTS {
            write!(out, ",{e}")?;
        }
        out.write_str("\n")?;
        for b in self.blocks.iter().filter(|b| b.counts != [0; 9]) {
            write!(
                out,
                "{},{},{:#x}",
                b.task,
                if b.user { 3 } else { 0 },
                b.code
            )?;
            for c in b.counts {
                write!(out, ",{c}")?;
            }
            out.write_str("\n")?;
        }
        Ok(())
    }
}

/// Parses [`crate::BLOCKS_NAME`]; the error is the first line that is not what
/// [`Attribution::write`] writes (the file came from inside the guest when the engine
/// ran the simulation).
pub fn parse(text: &str) -> Result<Vec<Block>, usize> {
    let mut lines = text.lines();
    let header = lines.next().ok_or(1usize)?;
    let mut want = alloc::string::String::from("task,cpl,code");
    for e in EVENTS {
        want.push(',');
        want.push_str(e);
    }
    if header != want {
        return Err(1);
    }
    let mut blocks = Vec::new();
    for (i, l) in lines.enumerate() {
        let bad = i + 2;
        let f: Vec<&str> = l.split(',').collect();
        if f.len() != 3 + EVENTS.len() {
            return Err(bad);
        }
        let user = match f[1] {
            "0" => false,
            "3" => true,
            _ => return Err(bad),
        };
        let code = f[2]
            .strip_prefix("0x")
            .and_then(|h| u64::from_str_radix(h, 16).ok())
            .ok_or(bad)?;
        let mut counts = [0u64; 9];
        for (c, t) in counts.iter_mut().zip(&f[3..]) {
            *c = t.parse().map_err(|_| bad)?;
        }
        blocks.push(Block {
            task: f[0].parse().map_err(|_| bad)?,
            user,
            code,
            counts,
        });
    }
    Ok(blocks)
}
