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
//!
//! With call stacks ([`crate::stacks`]), the events are also counted per task and calling
//! context: a node of a calling-context tree ([`Context`]) whose path from the root is
//! the chain of calls the code ran under ([`Stacked`]; in the root context, per block).

use alloc::boxed::Box;
use alloc::collections::BTreeMap;
use alloc::vec;
use alloc::vec::Vec;
use core::fmt;

use crate::sim::Kind;
use crate::stacks::{Pending, Stacks};

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
/// Calling contexts the engine's heap keeps at most (past that, calls stay in their
/// caller's context).
pub const DEFAULT_CONTEXTS: usize = 4 << 10;
/// Calling contexts the host keeps at most.
pub const HOST_CONTEXTS: usize = 1 << 20;
/// Deepest calling context (calls below it stay in it).
pub const MAX_DEPTH: u32 = 64;
/// Frames a shadow call stack keeps (past that, its oldest are dropped).
pub const MAX_FRAMES: usize = 256;
/// The root context: no call seen (the code a task or mode started in).
pub const ROOT: u32 = 0;

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

/// One calling context's events for one task (with call stacks).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stacked {
    /// The `processes.json` row it ran for.
    pub task: u32,
    /// Whether it is user-mode code.
    pub user: bool,
    /// The context ([`ROOT`]: code that ran before any call its stack saw).
    pub ctx: u32,
    /// In the root context, the code block it is (as [`Block::code`]); else
    /// [`OVERFLOW`].
    pub code: u64,
    /// Counts, in [`EVENTS`] order.
    pub counts: [u64; 9],
}

/// A calling context: a call of `callee` made in context `parent`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Context {
    /// The caller's context (less than this context's number).
    pub parent: u32,
    /// Whether the call was made in user mode.
    pub user: bool,
    /// The function it entered, as a block's `code` (kernel virtual, user physical): the
    /// call's target, or where the target jumped within its first two instructions (an
    /// indirect-branch thunk, a PLT stub, a tail-calling wrapper).
    pub callee: u64,
    /// Calls from the root.
    pub depth: u32,
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
    /// With call stacks.
    stacks: Option<Box<Stacks>>,
    /// The `call` (`access::CALL`) or `ret` (`access::RET`) just fetched whose stack
    /// access has not been seen yet (its records follow its fetch's).
    awaiting: u32,
    /// Whether the stacks have nothing to do at a fetch by the mode it names, if it does
    /// not jump in the root context ([`Stacks::calm`]).
    calm: Option<bool>,
    /// Whether the current context is the root.
    at_root: bool,
}

impl Attribution {
    /// No blocks yet; at most `capacity` of them (then each task's overflow block).
    /// With `contexts` (how many at most), the events are kept per task and calling
    /// context too (at most `capacity` entries).
    pub fn new(capacity: usize, contexts: Option<usize>) -> Self {
        let mut a = Attribution {
            blocks: Vec::new(),
            index: BTreeMap::new(),
            recent: vec![(0, u64::MAX, 0); 1 << RECENT_BITS].into_boxed_slice(),
            capacity,
            task: 0,
            cur: 0,
            next_ip: u64::MAX,
            mem_seen: 0,
            stacks: contexts.map(|n| Box::new(Stacks::new(n, capacity))),
            awaiting: 0,
            calm: None,
            at_root: true,
        };
        // Records before the first fetch (none, in a whole run) count for row 0.
        a.cur = a.place(false, OVERFLOW);
        a
    }

    /// The blocks, in the order first run.
    pub fn blocks(&self) -> &[Block] {
        &self.blocks
    }

    /// The calling contexts ([`ROOT`] first), if kept.
    pub fn contexts(&self) -> Option<&[Context]> {
        self.stacks.as_deref().map(|s| &s.contexts[..])
    }

    /// The events per task and calling context, if kept.
    pub fn stacked(&self) -> Option<&[Stacked]> {
        self.stacks.as_deref().map(|s| &s.stacked[..])
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
        // The current code goes on for the new task (its data references follow), in the
        // same context: the task's user stack is taken up at its first user fetch.
        let (user, code) = (self.blocks[self.cur].user, self.blocks[self.cur].code);
        self.cur = self.place(user, code);
        if let Some(s) = self.stacks.as_deref_mut() {
            s.count_for(self.task, user, code);
            // The task's first fetch in user mode takes up its stack.
            self.calm = None;
        }
    }

    /// A fetch of `n` instructions, the `len` bytes at virtual address `ip` (physical
    /// `pa`), by user mode or not: a new block unless it is the last fetch's
    /// fall-through. `flow`: the record's [`kpin_tool::access::CALL`] or
    /// [`kpin_tool::access::RET`] bit, for the last of the instructions, whose stack
    /// access ([`Attribution::stack_access`]) may follow.
    #[inline]
    pub fn fetch(&mut self, ip: u64, len: u64, n: u32, pa: u64, user: bool, flow: u32) {
        let code = if user { pa } else { ip };
        let jumped = ip != self.next_ip;
        if jumped {
            self.cur = self.place(user, code);
        }
        self.next_ip = ip.wrapping_add(len);
        // Most fetches leave the stacks nothing to do: no call or ret pending, no frame
        // still entering, the same task and mode, and the same context (a jump within a
        // context other than the root, where the events go by block).
        let calm = self.calm == Some(user) && flow == 0 && !(jumped && self.at_root);
        if self.stacks.is_some() && !calm {
            self.fetch_stacks(ip, len, n, code, user, flow);
        }
    }

    /// [`Attribution::fetch`]'s part for the stacks.
    #[inline(never)]
    fn fetch_stacks(&mut self, ip: u64, len: u64, n: u32, code: u64, user: bool, flow: u32) {
        let Some(s) = self.stacks.as_deref_mut() else {
            return;
        };
        s.enter(self.task, user);
        s.arrive(ip, len, code, n);
        // In the root context the events go by block.
        s.count_for(self.task, user, self.blocks[self.cur].code);
        self.awaiting = flow;
        if flow & kpin_tool::access::CALL != 0 {
            s.cur.pending = Pending::Call {
                ret: ip.wrapping_add(len),
                slot: u64::MAX,
            };
        } else if flow & kpin_tool::access::RET != 0 {
            s.cur.pending = Pending::Ret { slot: u64::MAX };
        }
        self.calm = s.calm().then_some(user);
        self.at_root = s.cur.ctx() == ROOT;
    }

    /// A data access to virtual address `va`, writing or not: for the `call` or `ret`
    /// just fetched, its stack write or read (the return address's slot), which names the
    /// stack it runs on and unwinds it by address.
    #[inline]
    pub fn stack_access(&mut self, va: u64, write: bool) {
        let want = if write {
            kpin_tool::access::CALL
        } else {
            kpin_tool::access::RET
        };
        if self.awaiting != want {
            return;
        }
        self.awaiting = 0;
        if let Some(s) = self.stacks.as_deref_mut() {
            s.slot(va);
        }
    }

    /// `refs` counted references of `kind` by the current block, `l1_misses` of their
    /// line accesses missing its first-level cache.
    #[inline]
    pub fn count(&mut self, kind: Kind, refs: u64, l1_misses: u64) {
        let b = base(kind);
        let c = &mut self.blocks[self.cur].counts;
        c[b] += refs;
        c[b + L1] += l1_misses;
        if let Some(s) = self.stacks.as_deref_mut() {
            let c = &mut s.stacked[s.at].counts;
            c[b] += refs;
            c[b + L1] += l1_misses;
        }
    }

    /// After first-level misses of `kind`: the memory-side misses are now `mem_misses`;
    /// the new ones are the current block's last-level misses.
    #[inline]
    pub fn memory_misses(&mut self, kind: Kind, mem_misses: u64) {
        let new = mem_misses.wrapping_sub(self.mem_seen);
        self.mem_seen = mem_misses;
        self.blocks[self.cur].counts[base(kind) + LL] += new;
        if let Some(s) = self.stacks.as_deref_mut() {
            s.stacked[s.at].counts[base(kind) + LL] += new;
        }
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
        write_header(out, BLOCKS_HEADER)?;
        for b in self.blocks.iter().filter(|b| b.counts != [0; 9]) {
            let cpl = if b.user { 3 } else { 0 };
            write!(out, "{},{cpl},{:#x}", b.task, b.code)?;
            write_counts(out, &b.counts)?;
        }
        Ok(())
    }

    /// Writes [`crate::CONTEXTS_NAME`] (with call stacks): a header, then per context
    /// but the root `ctx,parent,cpl,callee` (`callee` in hex), in order.
    pub fn write_contexts(&self, out: &mut dyn fmt::Write) -> fmt::Result {
        out.write_str(CONTEXTS_HEADER)?;
        out.write_str("\n")?;
        for (i, c) in self.contexts().unwrap_or(&[]).iter().enumerate().skip(1) {
            let cpl = if c.user { 3 } else { 0 };
            writeln!(out, "{i},{},{cpl},{:#x}", c.parent, c.callee)?;
        }
        Ok(())
    }

    /// Writes [`crate::STACKS_NAME`] (with call stacks): a header, then per task and
    /// context with counts `task,cpl,ctx,code,` and the [`EVENTS`] counts (`code` in
    /// hex).
    pub fn write_stacked(&self, out: &mut dyn fmt::Write) -> fmt::Result {
        write_header(out, STACKS_HEADER)?;
        for e in self
            .stacked()
            .unwrap_or(&[])
            .iter()
            .filter(|e| e.counts != [0; 9])
        {
            let cpl = if e.user { 3 } else { 0 };
            write!(out, "{},{cpl},{},{:#x}", e.task, e.ctx, e.code)?;
            write_counts(out, &e.counts)?;
        }
        Ok(())
    }
}

/// The first fields of [`crate::BLOCKS_NAME`]'s header (the events follow).
const BLOCKS_HEADER: &str = "task,cpl,code";
/// [`crate::CONTEXTS_NAME`]'s header.
const CONTEXTS_HEADER: &str = "ctx,parent,cpl,callee";
/// The first fields of [`crate::STACKS_NAME`]'s header (the events follow).
const STACKS_HEADER: &str = "task,cpl,ctx,code";

fn write_header(out: &mut dyn fmt::Write, first: &str) -> fmt::Result {
    out.write_str(first)?;
    for e in EVENTS {
        write!(out, ",{e}")?;
    }
    out.write_str("\n")
}

fn write_counts(out: &mut dyn fmt::Write, counts: &[u64; 9]) -> fmt::Result {
    for c in counts {
        write!(out, ",{c}")?;
    }
    out.write_str("\n")
}

/// A line of the blocks or stacks file: its first fields, its CPL's user bit, its
/// counts.
type Line<'t> = (Vec<&'t str>, bool, [u64; 9]);

/// The lines of a file whose header is `first` and the events: per line, its first
/// fields (`fields` of them, the CPL second), its CPL's user bit and its counts; the
/// error is the number of the first line that is not so (the file came from inside the
/// guest when the engine ran the simulation).
fn parse_lines<'t>(text: &'t str, first: &str, fields: usize) -> Result<Vec<Line<'t>>, usize> {
    let mut lines = text.lines();
    let header = lines.next().ok_or(1usize)?;
    let mut want = alloc::string::String::from(first);
    for e in EVENTS {
        want.push(',');
        want.push_str(e);
    }
    if header != want {
        return Err(1);
    }
    let mut out = Vec::new();
    for (i, l) in lines.enumerate() {
        let bad = i + 2;
        let f: Vec<&str> = l.split(',').collect();
        if f.len() != fields + EVENTS.len() {
            return Err(bad);
        }
        let user = user_cpl(f[1]).ok_or(bad)?;
        let mut counts = [0u64; 9];
        for (c, t) in counts.iter_mut().zip(&f[fields..]) {
            *c = t.parse().map_err(|_| bad)?;
        }
        out.push((f[..fields].to_vec(), user, counts));
    }
    Ok(out)
}

/// A CPL field: whether it is user mode (`3`) or the kernel (`0`).
fn user_cpl(t: &str) -> Option<bool> {
    match t {
        "0" => Some(false),
        "3" => Some(true),
        _ => None,
    }
}

fn hex(t: &str) -> Option<u64> {
    t.strip_prefix("0x")
        .and_then(|h| u64::from_str_radix(h, 16).ok())
}

/// Parses [`crate::BLOCKS_NAME`]; the error is the first line that is not what
/// [`Attribution::write`] writes (the file came from inside the guest when the engine
/// ran the simulation).
pub fn parse(text: &str) -> Result<Vec<Block>, usize> {
    let lines = parse_lines(text, BLOCKS_HEADER, 3)?;
    let mut blocks = Vec::with_capacity(lines.len());
    for (i, (f, user, counts)) in lines.into_iter().enumerate() {
        let bad = i + 2;
        blocks.push(Block {
            task: f[0].parse().map_err(|_| bad)?,
            user,
            code: hex(f[2]).ok_or(bad)?,
            counts,
        });
    }
    Ok(blocks)
}

/// Parses [`crate::STACKS_NAME`] as [`parse`] does [`crate::BLOCKS_NAME`]; a context
/// past `contexts` (the number of them) is an error too.
pub fn parse_stacked(text: &str, contexts: usize) -> Result<Vec<Stacked>, usize> {
    let lines = parse_lines(text, STACKS_HEADER, 4)?;
    let mut out = Vec::with_capacity(lines.len());
    for (i, (f, user, counts)) in lines.into_iter().enumerate() {
        let bad = i + 2;
        let ctx: u32 = f[2].parse().map_err(|_| bad)?;
        if ctx as usize >= contexts {
            return Err(bad);
        }
        out.push(Stacked {
            task: f[0].parse().map_err(|_| bad)?,
            user,
            ctx,
            code: hex(f[3]).ok_or(bad)?,
            counts,
        });
    }
    Ok(out)
}

/// Parses [`crate::CONTEXTS_NAME`] into the contexts, the root first; the error is the
/// first line that is not what [`Attribution::write_contexts`] writes (the file came
/// from inside the guest when the engine ran the simulation): contexts in order, each
/// parent before its child.
pub fn parse_contexts(text: &str) -> Result<Vec<Context>, usize> {
    let mut lines = text.lines();
    if lines.next() != Some(CONTEXTS_HEADER) {
        return Err(1);
    }
    let mut out = alloc::vec![Context {
        parent: ROOT,
        user: false,
        callee: OVERFLOW,
        depth: 0,
    }];
    for (i, l) in lines.enumerate() {
        let bad = i + 2;
        let f: Vec<&str> = l.split(',').collect();
        let [id, parent, cpl, callee] = f[..] else {
            return Err(bad);
        };
        let parent: u32 = parent.parse().map_err(|_| bad)?;
        if id.parse::<usize>() != Ok(out.len()) || parent as usize >= out.len() {
            return Err(bad);
        }
        let user = user_cpl(cpl).ok_or(bad)?;
        let callee = hex(callee).ok_or(bad)?;
        let depth = out[parent as usize].depth + 1;
        out.push(Context {
            parent,
            user,
            callee,
            depth,
        });
    }
    Ok(out)
}
