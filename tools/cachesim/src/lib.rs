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
//!   [`INSNS_NAME`] (L1D and L1I misses per instruction, see [`insns`]);
//! * `report` (feature `host`): turns those files into `cachesim.txt` (drcachesim's
//!   layout, ending with the instructions that missed most, named from the kernel's
//!   symbols), `cachesim.json` and `cachesim-timeline.svg`.
#![no_std]
#![deny(missing_docs)]

extern crate alloc;

pub mod config;
pub mod files;
pub mod insns;
pub mod options;
#[cfg(feature = "host")]
pub mod report;
pub mod sim;

use alloc::string::String;
use alloc::vec::Vec;
use core::fmt;

use kpin_tool::host::{Error, File, Sink};
use kpin_tool::{access, Engine, KpinTool, MemRecord, Tool, TraceInstrumenter};

use crate::insns::{MissKind, MissTable};
use crate::options::Options;
use crate::sim::{Hierarchy, Kind, KERNEL, USER};

/// The totals the engine writes (read by [`files::parse_counters`]).
pub const COUNTERS_NAME: &str = "cachesim-counters.txt";
/// The timeline the engine writes (read by [`files::parse_timeline`]).
pub const TIMELINE_NAME: &str = "cachesim-timeline.csv";
/// The misses per instruction the engine writes (read by [`insns::parse`]).
pub const INSNS_NAME: &str = "cachesim-insns.csv";
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
}

impl CacheSim {
    /// The tool configured by `options` (`key=value` words; see [`Options::parse`]).
    pub fn new(options: &str) -> Result<Self, String> {
        let options = Options::parse(options)?;
        Ok(Self::with_options(options))
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
            options,
            hier,
            unresolved: 0,
            insns: MissTable::new(insns::DEFAULT_CAPACITY),
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

    /// Feeds one memory record (as the engine delivers them).
    pub fn feed(&mut self, r: &MemRecord) {
        if r.pa == u64::MAX {
            self.unresolved += 1;
            return;
        }
        let who = if r.cpl() == 3 { USER } else { KERNEL };
        if r.access & access::FETCH_RUN != 0 {
            return self.feed_run(r, who);
        }
        if r.access & access::FETCH != 0 {
            let missed = self.reference(r.pa, r.size, Kind::Fetch, who);
            self.insns.add(r.ip, r.cpl(), MissKind::Fetch, missed);
            return;
        }
        // A read-modify-write operand is a read then a write, as a tracer records it.
        let mut missed = 0;
        if r.access & access::READ != 0 {
            missed += self.reference(r.pa, r.size, Kind::Read, who);
        }
        if r.access & access::WRITE != 0 {
            missed += self.reference(r.pa, r.size, Kind::Write, who);
        }
        self.insns.add(r.ip, r.cpl(), MissKind::Data, missed);
    }

    /// A run record: `size` instructions from `ip`, lengths in `ea`'s nibbles, fetched in
    /// order as one record each would be — except that the fetches wholly within the line
    /// the instruction L1 saw last are counted as its hits in one step (what the
    /// simulation of each would do), short of the timeline's next sample.
    fn feed_run(&mut self, r: &MemRecord, who: usize) {
        let n = r.size.min(16);
        let len = |k: u32| (r.ea >> (4 * k)) & 0xf;
        let (mut k, mut off) = (0, 0u64);
        while k < n {
            let missed = self.reference(r.pa + off, len(k) as u32, Kind::Fetch, who);
            self.insns.add(r.ip + off, r.cpl(), MissKind::Fetch, missed);
            off += len(k);
            k += 1;
            let Some(line) = self.hier.fetch_line() else {
                continue;
            };
            let shift = self.hier.line_shift();
            let t = &self.timeline;
            let room = t.interval - 1 - t.since.min(t.interval - 1);
            let mut same = 0;
            while k < n && same < room {
                let (first, last) = (r.pa + off, r.pa + off + len(k).max(1) - 1);
                if first >> shift != line || last >> shift != line {
                    break;
                }
                off += len(k);
                k += 1;
                same += 1;
            }
            if same > 0 {
                self.hier.add_fetch_hits(same, who);
                self.timeline.since += same;
            }
        }
    }

    /// Simulates one reference; returns its counted misses in the L1 it started at.
    fn reference(&mut self, pa: u64, size: u32, kind: Kind, who: usize) -> u64 {
        let measuring = self.hier.measuring();
        let missed = self.hier.access(pa, size, kind, who);
        if !measuring {
            // The warmup just ended (the counters were reset) or goes on.
            self.timeline.rows.clear();
            self.timeline.since = 0;
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

    /// References simulated, fetches and data, both CPLs.
    pub fn references(&self) -> u64 {
        self.hier
            .fetch_refs
            .iter()
            .chain(&self.hier.data_refs)
            .sum()
    }
}

impl Tool for CacheSim {
    fn instrument_trace(&mut self, trace: &mut TraceInstrumenter<'_>) {
        for i in 0..trace.instructions().len() {
            trace.insert_mem_records(i);
        }
    }

    fn buffer_full(&mut self, records: &[MemRecord]) {
        for r in records {
            self.feed(r);
        }
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
}

impl KpinTool for CacheSim {
    fn name(&self) -> &'static str {
        "cachesim"
    }

    fn finish(&mut self, _engine: &Engine, host: &mut dyn Sink) -> Result<(), Error> {
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
        f.close()
    }

    fn summary(&self, _engine: &Engine, out: &mut dyn fmt::Write) -> fmt::Result {
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
        )
    }
}
