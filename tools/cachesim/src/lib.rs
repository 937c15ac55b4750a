//! `--tool cachesim`: a multi-level cache simulator (drcachesim's model) fed with the
//! guest-physical address of every instruction fetch and every data access the guest
//! executes, kernel and user alike.
//!
//! * [`options`]: drcachesim's option names (`L1D_size=16K`, `replace_policy=FIFO`, …)
//!   from `kpin run --tool-option`, and the geometry rules;
//! * [`sim`]: the caches (plain Rust, host-testable);
//! * [`CacheSim`]: the engine side. It asks the engine for a fetch record per executed
//!   instruction and a record per memory operand, with physical addresses resolved before
//!   any mapping can change ([`kpin_tool::Tool::records_fetches`],
//!   [`kpin_tool::Tool::records_need_pa`]), and at the end writes [`COUNTERS_NAME`] (the
//!   totals), [`TIMELINE_NAME`] (cumulative counters every few references) and
//!   [`INSNS_NAME`] (L1D and L1I misses per instruction, see [`insns`]), and with
//!   `attribute=on` [`BLOCKS_NAME`] (Cachegrind's events per task and code block, see
//!   [`attr`]) and, with call stacks ([`stacks`]), [`CONTEXTS_NAME`] and [`STACKS_NAME`];
//! * `report` (feature `host`): turns those files into `cachesim.txt` (drcachesim's
//!   layout, ending with the instructions that missed most, named from the kernel's
//!   symbols), `cachesim.json` and `cachesim-timeline.svg`.
#![no_std]
#![deny(missing_docs)]

extern crate alloc;

pub mod attr;
pub mod config;
pub mod files;
pub mod insns;
pub mod options;
#[cfg(feature = "host")]
pub mod profile;
#[cfg(feature = "host")]
pub mod report;
pub mod sim;
pub mod stacks;

use alloc::boxed::Box;
use alloc::string::String;
use alloc::vec::Vec;
use core::fmt;

use kpin_tool::host::{Error, File, Sink};
use kpin_tool::{access, Engine, HostPart, KpinTool, MemRecord, Tool, ToolSpec, TraceInstrumenter};

use crate::attr::Attribution;
use crate::insns::{MissKind, MissTable};
use crate::options::Options;
use crate::sim::{nibble_sum, run_line_accesses, Hierarchy, Kind, KERNEL, USER};

/// What `--tool cachesim` is (the registry's entry).
pub const SPEC: ToolSpec = ToolSpec {
    name: "cachesim",
    summary: "drcachesim's cache model over every fetch and data access's guest-physical address",
    options: options::KEYS,
    prefixed_keys: true,
    host: Some(HostPart {
        about: "the simulation on a host thread when the record ring is there; cachesim.txt, cachesim.json, cachesim-timeline.svg",
        takes_records: Some("cachesim-counters.txt, cachesim-timeline.csv and cachesim-insns.csv"),
    }),
};

/// The tool for `--tool-option` words ([`Options::parse`]): the registry's constructor.
pub fn new_tool(options: &str) -> Result<alloc::boxed::Box<dyn KpinTool>, String> {
    Ok(alloc::boxed::Box::new(CacheSim::new(options)?))
}

/// The host-side part (the registry's, feature `host`): [`report::Host`].
#[cfg(feature = "host")]
pub const HOST: report::Host = report::Host;

/// The totals the engine writes (read by [`files::parse_counters`]).
pub const COUNTERS_NAME: &str = "cachesim-counters.txt";
/// The timeline the engine writes (read by [`files::parse_timeline`]).
pub const TIMELINE_NAME: &str = "cachesim-timeline.csv";
/// The misses per instruction the engine writes (read by [`insns::parse`]).
pub const INSNS_NAME: &str = "cachesim-insns.csv";
/// With `attribute=on`: the events per task and code block (read by [`attr::parse`]).
pub const BLOCKS_NAME: &str = "cachesim-blocks.csv";
/// With `attribute=on callstacks=on`: the calling contexts the blocks name (read by
/// [`attr::parse_contexts`]).
pub const CONTEXTS_NAME: &str = "cachesim-contexts.csv";
/// With `attribute=on callstacks=on`: the events per task and calling context (read by
/// [`attr::parse_stacked`]).
pub const STACKS_NAME: &str = "cachesim-stacks.csv";
/// Most timeline rows kept: when full, every other row is dropped and the sampling
/// interval doubles (rows are cumulative, so nothing is lost but resolution).
pub const TIMELINE_ROWS: usize = 2048;

/// Cumulative counters sampled every `interval` references.
#[derive(Clone, Debug)]
struct Timeline {
    interval: u64,
    since: u64,
    width: usize,
    rows: Vec<u64>,
}

/// The cache simulator tool.
#[derive(Clone, Debug)]
pub struct CacheSim {
    options: Options,
    hier: Hierarchy,
    timeline: Timeline,
    /// Records whose physical address could not be resolved (not simulated).
    unresolved: u64,
    /// L1D and L1I misses per instruction.
    insns: MissTable,
    /// With `attribute=on`: the events per task and code block.
    attr: Option<Box<Attribution>>,
}

impl CacheSim {
    /// The tool configured by `options` (`key=value` words; see [`Options::parse`]).
    pub fn new(options: &str) -> Result<Self, String> {
        let options = Options::parse(options)?;
        Ok(Self::with_options(options))
    }

    /// [`CacheSim::new`] with a per-instruction table of `insns` instructions (the
    /// engine's default is [`insns::DEFAULT_CAPACITY`]).
    pub fn with_insn_capacity(options: &str, insns: usize) -> Result<Self, String> {
        Self::with_capacities(options, insns, attr::DEFAULT_BLOCKS, attr::DEFAULT_CONTEXTS)
    }

    /// [`CacheSim::with_insn_capacity`] keeping at most `blocks` code blocks and
    /// `contexts` calling contexts when attributing (`attribute=on`; the engine's
    /// defaults are [`attr::DEFAULT_BLOCKS`] and [`attr::DEFAULT_CONTEXTS`]).
    pub fn with_capacities(
        options: &str,
        insns: usize,
        blocks: usize,
        contexts: usize,
    ) -> Result<Self, String> {
        let mut sim = Self::new(options)?;
        sim.insns = MissTable::new(insns);
        if sim.attr.is_some() {
            let contexts = sim.options.callstacks.then_some(contexts);
            sim.attr = Some(Box::new(Attribution::new(blocks, contexts)));
        }
        Ok(sim)
    }

    /// The tool for already checked options.
    pub fn with_options(options: Options) -> Self {
        let hier = Hierarchy::new(&options);
        let width = files::timeline_width(&hier);
        Self {
            timeline: Timeline {
                interval: options.interval_refs.max(1),
                since: 0,
                width,
                rows: Vec::new(),
            },
            hier,
            unresolved: 0,
            insns: MissTable::new(insns::DEFAULT_CAPACITY),
            attr: options.attribute.then(|| {
                let contexts = options.callstacks.then_some(attr::DEFAULT_CONTEXTS);
                Box::new(Attribution::new(attr::DEFAULT_BLOCKS, contexts))
            }),
            options,
        }
    }

    /// The simulated hierarchy.
    pub fn hierarchy(&self) -> &Hierarchy {
        &self.hier
    }

    /// The options in force.
    pub fn options(&self) -> &Options {
        &self.options
    }

    /// The misses per instruction counted so far.
    pub fn insns(&self) -> &MissTable {
        &self.insns
    }

    /// Records whose physical address could not be resolved.
    pub fn unresolved(&self) -> u64 {
        self.unresolved
    }

    /// The events per task and code block (`attribute=on`).
    pub fn attribution(&self) -> Option<&Attribution> {
        self.attr.as_deref()
    }

    /// Feeds memory records (as the engine delivers them). The attributing path is
    /// another instance of the same code, chosen once per batch: without
    /// `attribute=on` the simulation runs exactly as before.
    pub fn feed_all(&mut self, records: &[MemRecord]) {
        if self.attr.is_some() {
            records.iter().for_each(|r| self.feed_one::<true>(r));
        } else {
            // The common case in one loop (`Hierarchy::feed_records`, ~22 % fewer host
            // instructions per record); the record it stops at (warmup, past `sim_refs`, a
            // timeline sample inside it, a TASK record) goes through `feed_one`.
            let mut rest = records;
            while !rest.is_empty() {
                let budget = self.timeline.interval - self.timeline.since;
                let fed =
                    self.hier
                        .feed_records(rest, budget, &mut self.insns, &mut self.unresolved);
                self.timeline.since += fed.refs;
                rest = &rest[fed.records..];
                if let Some((r, later)) = rest.split_first() {
                    self.feed_one::<false>(r);
                    rest = later;
                }
            }
        }
    }

    /// Feeds one memory record (as the engine delivers them).
    pub fn feed(&mut self, r: &MemRecord) {
        self.feed_all(core::slice::from_ref(r));
    }

    /// [`CacheSim::feed`], attributing events when `ATTR`.
    #[inline(always)]
    fn feed_one<const ATTR: bool>(&mut self, r: &MemRecord) {
        let a = r.access;
        let who = who(r);
        if ATTR && a & access::TASK != 0 {
            if let Some(at) = self.attr.as_deref_mut() {
                at.set_task(r.ea);
            }
            return;
        }
        if a & access::FETCH_RUN != 0 {
            if r.pa == u64::MAX {
                self.unresolved += 1;
                return;
            }
            return self.feed_run::<ATTR>(r, who);
        }
        // A fetch record, or an operand record carrying its instruction's fetch (its
        // physical address in `ea`), which comes before the data access.
        if a & access::FETCH != 0 {
            if ATTR {
                self.attr_fetch(r.ip, u64::from(r.size), 1, r.pa, who, a);
            }
            return self.refs::<ATTR>(Kind::Fetch, r, r.pa, r.size, 1, who);
        }
        if a & access::WITH_FETCH != 0 {
            let len = (a >> access::FETCH_LEN_SHIFT) & 0xf;
            if ATTR {
                self.attr_fetch(r.ip, u64::from(len), 1, r.ea, who, a);
            }
            self.refs::<ATTR>(Kind::Fetch, r, r.ea, len, 1, who);
        }
        // A read-modify-write operand is a read then a write, as a tracer records it
        // (both simulated alike: write-allocate). Attributed, they are two calls, so
        // that each has its own misses: the same simulation as one call of two. (A
        // `TASK` record, not attributed, has neither bit: no reference.)
        if ATTR {
            if a & access::WITH_FETCH == 0 {
                // A call's or ret's stack access names the stack and the slot (`ea`).
                if let Some(at) = self.attr.as_deref_mut() {
                    at.stack_access(r.ea, a & access::WRITE != 0);
                }
            }
            if a & access::READ != 0 {
                self.refs::<ATTR>(Kind::Read, r, r.pa, r.size, 1, who);
            }
            if a & access::WRITE != 0 {
                self.refs::<ATTR>(Kind::Write, r, r.pa, r.size, 1, who);
            }
            return;
        }
        let refs = u64::from(a & access::READ != 0) + u64::from(a & access::WRITE != 0);
        self.refs::<ATTR>(Kind::Read, r, r.pa, r.size, refs, who);
    }

    /// Attributing: a fetch of `n` instructions, `len` bytes at `ip` (physical `pa`),
    /// by a record with `access` bits (its `CALL`/`RET` bit for the shadow stacks).
    #[inline(always)]
    fn attr_fetch(&mut self, ip: u64, len: u64, n: u32, pa: u64, who: usize, access: u32) {
        if let Some(at) = self.attr.as_deref_mut() {
            let flow = access & (access::CALL | access::RET);
            at.fetch(ip, len, n, pa, who == USER, flow);
        }
    }

    /// Attributing: `refs` counted references of `kind`, `missed` of their line
    /// accesses missing the L1, for the current block (and the memory-side misses
    /// since the last L1 miss, which only an L1 miss makes).
    #[inline(always)]
    fn attr_count(&mut self, kind: Kind, refs: u64, missed: u64) {
        let Some(at) = self.attr.as_deref_mut() else {
            return;
        };
        at.count(kind, refs, missed);
        if missed > 0 {
            at.memory_misses(kind, memory_misses(&self.hier));
        }
    }

    /// The references of `kind` by `who` counted so far.
    fn counted(&self, kind: Kind, who: usize) -> u64 {
        match kind {
            Kind::Fetch => self.hier.fetch_refs[who],
            Kind::Read | Kind::Write => self.hier.data_refs[who],
        }
    }

    /// `n` references of `kind` in a row by `r`'s instruction to the `size` bytes at `pa`
    /// (`u64::MAX`: unresolved, not simulated), its L1 misses counted for it.
    #[inline(always)]
    fn refs<const ATTR: bool>(
        &mut self,
        kind: Kind,
        r: &MemRecord,
        pa: u64,
        size: u32,
        n: u64,
        who: usize,
    ) {
        if pa == u64::MAX {
            self.unresolved += 1;
            return;
        }
        let last = pa.wrapping_add(u64::from(sim::ref_bytes(size)) - 1);
        if self.same_line_hits(kind, pa, last, n, who) {
            if ATTR {
                self.attr_count(kind, n, 0);
            }
            return;
        }
        let missed = match self.lines_direct(kind, pa, last, n, who) {
            Some(missed) => {
                if ATTR {
                    self.attr_count(kind, n, missed);
                }
                missed
            }
            None => {
                // Warming up or counting up to `sim_refs`: the references counted are
                // what the counters say.
                let before = self.counted(kind, who);
                let missed = self.refs_each(kind, pa, size, n, who);
                if ATTR {
                    let refs = self.counted(kind, who).wrapping_sub(before);
                    self.attr_count(kind, refs, missed);
                }
                missed
            }
        };
        if missed > 0 {
            let miss_kind = match kind {
                Kind::Fetch => MissKind::Fetch,
                Kind::Read | Kind::Write => MissKind::Data,
            };
            self.insns.add(r.ip, r.cpl(), miss_kind, missed);
        }
    }

    /// While every reference is counted and no timeline sample falls among them: `refs`
    /// references of `kind` to the bytes `first..=last`, one after the other, each
    /// accessing its lines in turn; returns the L1 misses.
    #[inline]
    fn lines_direct(
        &mut self,
        kind: Kind,
        first: u64,
        last: u64,
        refs: u64,
        who: usize,
    ) -> Option<u64> {
        if !self.hier.counting_all() || self.timeline.since + refs >= self.timeline.interval {
            return None;
        }
        let shift = self.hier.line_shift();
        let (first, last) = (first >> shift, last >> shift);
        let mut missed = 0;
        for _ in 0..refs {
            let mut line = first;
            loop {
                missed += u64::from(!self.hier.access_line(kind, line, who));
                if line >= last {
                    break;
                }
                line += 1;
            }
        }
        self.hier.count_refs(kind, refs, who);
        self.timeline.since += refs;
        Some(missed)
    }

    /// [`CacheSim::refs`] one reference at a time (warming up, counting up to `sim_refs`,
    /// or a timeline sample due); returns the L1 misses.
    #[inline(never)]
    fn refs_each(&mut self, kind: Kind, pa: u64, size: u32, n: u64, who: usize) -> u64 {
        (0..n).map(|_| self.reference(pa, size, kind, who)).sum()
    }

    /// A run record: `size` instructions from `ip`, lengths in `ea`'s nibbles, fetched in
    /// order as one record each would be. Simulated line by line: each line of the run
    /// is accessed once, the other fetches counted as the hits on the line just accessed
    /// that simulating them one by one would give (one by one while warming up, up to
    /// `sim_refs`, or with a timeline sample inside the run).
    fn feed_run<const ATTR: bool>(&mut self, r: &MemRecord, who: usize) {
        let n = r.size.min(16);
        if n == 0 {
            return;
        }
        let len = |k: u32| (r.ea >> (4 * k)) & 0xf;
        // Most runs lie wholly in the line the instruction L1 saw last: `n` hits at once.
        // The run's bytes: the lengths' sum, and one more if it ends in zero-length
        // instructions (each touches the byte it starts at, as `Hierarchy::access` has it).
        let lens = if n >= 16 {
            r.ea
        } else {
            r.ea & ((1 << (4 * n)) - 1)
        };
        let bytes = nibble_sum(lens);
        if ATTR {
            self.attr_fetch(r.ip, bytes, n, r.pa, who, r.access);
        }
        let end =
            r.pa.wrapping_add(bytes)
                .wrapping_sub(u64::from(len(n - 1) != 0));
        if self.same_line_hits(Kind::Fetch, r.pa, end, u64::from(n), who) {
            if ATTR {
                self.attr_count(Kind::Fetch, u64::from(n), 0);
            }
            return;
        }
        let t = &self.timeline;
        if !self.hier.counting_all() || t.since + u64::from(n) >= t.interval {
            // Warming up, counting up to `sim_refs`, or a timeline sample inside the run:
            // one reference at a time.
            let before = self.counted(Kind::Fetch, who);
            let mut run_missed = 0;
            let mut off = 0;
            for k in 0..n {
                let missed = self.reference(r.pa + off, len(k) as u32, Kind::Fetch, who);
                if missed > 0 {
                    self.insns.add(r.ip + off, r.cpl(), MissKind::Fetch, missed);
                }
                run_missed += missed;
                off += len(k);
            }
            if ATTR {
                let refs = self.counted(Kind::Fetch, who).wrapping_sub(before);
                self.attr_count(Kind::Fetch, refs, run_missed);
            }
            return;
        }
        // Instruction `k` touches the lines from its first byte to its last; the run's
        // line accesses never go back, so each of its lines is accessed once in full
        // (the first maybe a hit on the L1's last line), and every other access repeats
        // the line just accessed: a hit that changes nothing but counters.
        let shift = self.hier.line_shift();
        let (first, last) = (r.pa >> shift, end >> shift);
        let accesses = if first == last {
            u64::from(n)
        } else {
            run_line_accesses(r.pa, r.ea, n, shift)
        };
        let mut line = first;
        let mut run_missed = 0;
        loop {
            if !self.hier.access_line(Kind::Fetch, line, who) {
                run_missed += 1;
                // The miss is the instruction's that touches the line first.
                let mut off = 0;
                for k in 0..n {
                    let end = r.pa.wrapping_add(off + len(k).max(1) - 1);
                    if end >> shift >= line {
                        break;
                    }
                    off += len(k);
                }
                self.insns.add(r.ip + off, r.cpl(), MissKind::Fetch, 1);
            }
            if line >= last {
                break;
            }
            line += 1;
        }
        self.hier.count_refs(Kind::Fetch, u64::from(n), who);
        self.hier
            .add_repeat_hits(Kind::Fetch, accesses - (last - first + 1), who);
        self.timeline.since += u64::from(n);
        if ATTR {
            self.attr_count(Kind::Fetch, u64::from(n), run_missed);
        }
    }

    /// [`Hierarchy::same_line_hits`] short of the timeline's next sample.
    #[inline]
    fn same_line_hits(&mut self, kind: Kind, first: u64, last: u64, n: u64, who: usize) -> bool {
        let t = &self.timeline;
        if t.since + n >= t.interval || !self.hier.same_line_hits(kind, first, last, n, who) {
            return false;
        }
        self.timeline.since += n;
        true
    }

    /// Simulates one reference; returns its counted misses in the L1 it started at.
    #[inline]
    fn reference(&mut self, pa: u64, size: u32, kind: Kind, who: usize) -> u64 {
        let measuring = self.hier.measuring();
        let missed = self.hier.access(pa, size, kind, who);
        if !measuring {
            // The warmup just ended (the counters were reset) or goes on.
            self.timeline.rows.clear();
            self.timeline.since = 0;
            if let Some(at) = self.attr.as_deref_mut() {
                at.rebase(memory_misses(&self.hier));
            }
            return missed;
        }
        let t = &mut self.timeline;
        t.since += 1;
        if t.since >= t.interval {
            t.since = 0;
            files::push_timeline_row(&self.hier, &mut t.rows);
            if t.rows.len() >= TIMELINE_ROWS * t.width {
                // Keep the rows at even multiples of the interval; double it.
                let w = t.width;
                let kept: Vec<u64> = t
                    .rows
                    .chunks(w)
                    .skip(1)
                    .step_by(2)
                    .flatten()
                    .copied()
                    .collect();
                t.rows = kept;
                t.interval *= 2;
            }
        }
        missed
    }

    /// Writes [`COUNTERS_NAME`], [`TIMELINE_NAME`] and [`INSNS_NAME`] through `host` (the
    /// engine's I/O ring, or the host's output directory when the simulation ran there).
    pub fn write_files(&self, host: &mut dyn Sink) -> Result<(), Error> {
        let mut f = File::create(host, COUNTERS_NAME)?;
        // A failed write is kept by `File` and returned by `close`.
        let _ = files::write_counters(&mut f, &self.options, &self.hier, self.unresolved);
        f.close()?;
        let mut f = File::create(host, TIMELINE_NAME)?;
        let _ = files::write_timeline(&mut f, &self.hier, &self.timeline.rows);
        // The last sample: the totals, so the timeline ends where the run did.
        let mut last = Vec::new();
        files::push_timeline_row(&self.hier, &mut last);
        if self.timeline.rows.len() < last.len()
            || self.timeline.rows[self.timeline.rows.len() - last.len()..] != last[..]
        {
            let _ = files::write_timeline_row(&mut f, &last);
        }
        f.close()?;
        let mut f = File::create(host, INSNS_NAME)?;
        let _ = insns::write(&mut f, &self.insns);
        f.close()?;
        if let Some(at) = &self.attr {
            let mut f = File::create(host, BLOCKS_NAME)?;
            let _ = at.write(&mut f);
            f.close()?;
            if at.contexts().is_some() {
                let mut f = File::create(host, CONTEXTS_NAME)?;
                let _ = at.write_contexts(&mut f);
                f.close()?;
                let mut f = File::create(host, STACKS_NAME)?;
                let _ = at.write_stacked(&mut f);
                f.close()?;
            }
        }
        Ok(())
    }

    /// The one-line summary of the simulation for the log.
    pub fn write_summary(&self, out: &mut dyn fmt::Write) -> fmt::Result {
        let h = &self.hier;
        write!(
            out,
            "cachesim: {} references simulated ({} instruction fetches: CPL 0 {}, CPL 3 {}; {} data)",
            self.references(),
            h.fetch_refs[KERNEL] + h.fetch_refs[USER],
            h.fetch_refs[KERNEL],
            h.fetch_refs[USER],
            h.data_refs[KERNEL] + h.data_refs[USER],
        )?;
        for (name, c) in h.caches() {
            let s = c.stats;
            let total = s.hits[0] + s.hits[1] + s.misses[0] + s.misses[1];
            let misses = s.misses[0] + s.misses[1];
            write!(out, "; {name} miss rate ")?;
            files::write_percent(out, misses, total)?;
        }
        if self.unresolved > 0 {
            write!(
                out,
                "; {} records without a physical address",
                self.unresolved
            )?;
        }
        if self.insns.other != insns::InsnMisses::default() {
            write!(
                out,
                "; the per-instruction table ({} entries) was full: {} data and {} fetch misses counted as other",
                self.insns.capacity(),
                self.insns.other.data,
                self.insns.other.fetch
            )?;
        }
        out.write_str(
            "; cachesim-counters.txt, cachesim-timeline.csv and cachesim-insns.csv written",
        )?;
        match &self.attr {
            Some(at) => {
                write!(out, "; {BLOCKS_NAME} ({} blocks)", at.blocks().len())?;
                match (at.contexts(), at.stacked()) {
                    (Some(c), Some(s)) => write!(
                        out,
                        "; {CONTEXTS_NAME} ({} calling contexts), {STACKS_NAME} ({} task and context pairs)",
                        c.len(),
                        s.len()
                    ),
                    _ => Ok(()),
                }
            }
            None => Ok(()),
        }
    }

    /// References simulated, fetches and data, both CPLs.
    pub fn references(&self) -> u64 {
        self.hier
            .fetch_refs
            .iter()
            .chain(&self.hier.data_refs)
            .sum()
    }
}

/// The misses of the caches whose parent is memory (both CPLs): the line accesses that
/// went to memory, Cachegrind's `LL` misses.
fn memory_misses(h: &Hierarchy) -> u64 {
    h.caches()
        .zip(h.parents())
        .filter(|(_, p)| p.is_none())
        .map(|((_, c), _)| c.stats.misses[KERNEL] + c.stats.misses[USER])
        .sum()
}

/// [`USER`] for a record of CPL 3, else [`KERNEL`].
#[inline]
fn who(r: &MemRecord) -> usize {
    const _: () = assert!(USER == 1 && KERNEL == 0);
    usize::from(r.access >> access::CPL_SHIFT & 3 == 3)
}

impl Tool for CacheSim {
    fn instrument_trace(&mut self, trace: &mut TraceInstrumenter<'_>) {
        for i in 0..trace.instructions().len() {
            trace.insert_mem_records(i);
        }
    }

    fn buffer_full(&mut self, records: &[MemRecord]) {
        self.feed_all(records);
    }

    fn records_fetches(&self) -> bool {
        true
    }

    fn fetch_runs(&self) -> bool {
        true
    }

    fn records_need_pa(&self) -> bool {
        true
    }

    fn call_stack_records(&self) -> bool {
        // The shadow stacks want each call's and ret's stack slot by virtual address.
        self.attr.as_ref().is_some_and(|a| a.contexts().is_some())
    }
}

impl KpinTool for CacheSim {
    fn name(&self) -> &'static str {
        SPEC.name
    }

    fn finish(&mut self, _engine: &Engine, host: &mut dyn Sink) -> Result<(), Error> {
        self.write_files(host)
    }

    fn summary(&self, _engine: &Engine, out: &mut dyn fmt::Write) -> fmt::Result {
        self.write_summary(out)
    }
}
