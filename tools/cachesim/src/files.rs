//! The two files the engine writes at the end of a run, and their parsers (no_std, so the
//! host report and tests read exactly what the engine wrote).
//!
//! `cachesim-counters.txt`: one line per item, `kind key=value key=value …`:
//! ```text
//! options L1I_size=32768 L1I_assoc=8 … line_size=64 replace_policy=LRU warmup_refs=0 sim_refs=0 top=10
//! refs fetch_kernel=… fetch_user=… data_kernel=… data_user=… skipped=… unresolved=…
//! cache name=L1I size=32768 assoc=8 hits_kernel=… hits_user=… misses_kernel=… misses_user=… compulsory_kernel=… compulsory_user=…
//! ```
//! `cachesim-timeline.csv`: a header, then cumulative counters, one row per sample:
//! `fetch_kernel,fetch_user,data_kernel,data_user`, then per cache
//! `NAME_hits_kernel,NAME_hits_user,NAME_misses_kernel,NAME_misses_user`.

use alloc::string::{String, ToString};
use alloc::vec::Vec;
use core::fmt;

use crate::options::Options;
use crate::sim::{Hierarchy, Stats, KERNEL, USER};

/// `part / whole` as a percentage with two decimals (`0.00%` when `whole` is 0).
pub fn write_percent(out: &mut dyn fmt::Write, part: u64, whole: u64) -> fmt::Result {
    let hundredths = if whole == 0 {
        0
    } else {
        (u128::from(part) * 10_000 / u128::from(whole)) as u64
    };
    write!(out, "{}.{:02}%", hundredths / 100, hundredths % 100)
}

/// Columns of a timeline row.
pub fn timeline_width(h: &Hierarchy) -> usize {
    4 + 4 * h.caches().count()
}

/// Appends the current cumulative counters as a timeline row.
pub fn push_timeline_row(h: &Hierarchy, rows: &mut Vec<u64>) {
    rows.extend_from_slice(&[
        h.fetch_refs[KERNEL],
        h.fetch_refs[USER],
        h.data_refs[KERNEL],
        h.data_refs[USER],
    ]);
    for (_, c) in h.caches() {
        let s = c.stats;
        rows.extend_from_slice(&[
            s.hits[KERNEL],
            s.hits[USER],
            s.misses[KERNEL],
            s.misses[USER],
        ]);
    }
}

/// Writes the timeline's header and `rows` (flattened, [`timeline_width`] wide).
pub fn write_timeline(out: &mut dyn fmt::Write, h: &Hierarchy, rows: &[u64]) -> fmt::Result {
    out.write_str("fetch_kernel,fetch_user,data_kernel,data_user")?;
    for (name, _) in h.caches() {
        write!(
            out,
            ",{name}_hits_kernel,{name}_hits_user,{name}_misses_kernel,{name}_misses_user"
        )?;
    }
    out.write_str("\n")?;
    for row in rows.chunks(timeline_width(h)) {
        write_timeline_row(out, row)?;
    }
    Ok(())
}

/// Writes one timeline row.
pub fn write_timeline_row(out: &mut dyn fmt::Write, row: &[u64]) -> fmt::Result {
    for (i, v) in row.iter().enumerate() {
        if i > 0 {
            out.write_str(",")?;
        }
        write!(out, "{v}")?;
    }
    out.write_str("\n")
}

/// Writes `cachesim-counters.txt`.
pub fn write_counters(
    out: &mut dyn fmt::Write,
    o: &Options,
    h: &Hierarchy,
    unresolved: u64,
) -> fmt::Result {
    match &o.caches {
        None => {
            write!(
                out,
                "options L1I_size={} L1I_assoc={} L1D_size={} L1D_assoc={}",
                o.l1i.size, o.l1i.assoc, o.l1d.size, o.l1d.assoc
            )?;
            if let Some(l2) = o.l2 {
                write!(out, " L2_size={} L2_assoc={}", l2.size, l2.assoc)?;
            }
            write!(out, " LL_size={} LL_assoc={}", o.ll.size, o.ll.assoc)?;
        }
        Some(_) => write!(out, "options hierarchy=config_file")?,
    }
    writeln!(
        out,
        " line_size={} replace_policy={} warmup_refs={} sim_refs={} top={}{}",
        o.line_size,
        o.policy.name(),
        o.warmup_refs,
        o.sim_refs,
        o.top,
        match (o.attribute, o.callstacks) {
            (false, _) => "",
            (true, true) => " attribute=on callstacks=on",
            (true, false) => " attribute=on callstacks=off",
        }
    )?;
    writeln!(
        out,
        "refs fetch_kernel={} fetch_user={} data_kernel={} data_user={} skipped={} unresolved={}",
        h.fetch_refs[KERNEL],
        h.fetch_refs[USER],
        h.data_refs[KERNEL],
        h.data_refs[USER],
        h.skipped_refs,
        unresolved
    )?;
    let specs = o.specs();
    for (k, (name, c)) in h.caches().enumerate() {
        let g = c.geometry();
        let s = c.stats;
        let spec = &specs[k];
        let parent = spec.parent.map_or("memory", |p| specs[p].name.as_str());
        write!(
            out,
            "cache name={name} type={} core={} parent={parent} ",
            spec.kind.name(),
            if spec.core { "0" } else { "-" }
        )?;
        writeln!(
            out,
            "size={} assoc={} hits_kernel={} hits_user={} misses_kernel={} misses_user={} compulsory_kernel={} compulsory_user={}",
            g.size, g.assoc, s.hits[KERNEL], s.hits[USER], s.misses[KERNEL], s.misses[USER],
            s.compulsory[KERNEL], s.compulsory[USER]
        )?;
    }
    Ok(())
}

/// One cache's line of `cachesim-counters.txt`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheCounters {
    /// `L1I`, `L1D`, `L2`, `LL` or a `config_file`'s name.
    pub name: String,
    /// Whether the core accesses it directly (an L1).
    pub core: bool,
    /// Index of its parent in [`Counters::caches`] (`None`: memory).
    pub parent: Option<usize>,
    /// Bytes.
    pub size: u64,
    /// Ways.
    pub assoc: u64,
    /// Counters, `[kernel, user]`.
    pub stats: Stats,
}

/// `cachesim-counters.txt`, parsed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// The `options` line's pairs, in order.
    pub options: Vec<(String, String)>,
    /// Instruction fetches simulated, `[kernel, user]`.
    pub fetch_refs: [u64; 2],
    /// Data references simulated, `[kernel, user]`.
    pub data_refs: [u64; 2],
    /// References past `sim_refs`.
    pub skipped: u64,
    /// Records without a physical address.
    pub unresolved: u64,
    /// The caches, L1s first, the last level last.
    pub caches: Vec<CacheCounters>,
}

/// Parses `cachesim-counters.txt`; the error is the first line number that is not what
/// the engine writes (the file came from inside the guest).
pub fn parse_counters(text: &str) -> Result<Counters, usize> {
    let mut c = Counters::default();
    let mut saw_refs = false;
    let mut parents: Vec<String> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let bad = i + 1;
        let mut words = line.split(' ');
        let kind = words.next().ok_or(bad)?;
        let mut pairs = Vec::new();
        for w in words {
            let (k, v) = w.split_once('=').ok_or(bad)?;
            pairs.push((k.to_string(), v.to_string()));
        }
        let num = |key: &str| -> Result<u64, usize> {
            pairs
                .iter()
                .find(|(k, _)| k == key)
                .and_then(|(_, v)| v.parse().ok())
                .ok_or(bad)
        };
        match kind {
            "options" => c.options = pairs.clone(),
            "refs" => {
                c.fetch_refs = [num("fetch_kernel")?, num("fetch_user")?];
                c.data_refs = [num("data_kernel")?, num("data_user")?];
                c.skipped = num("skipped")?;
                c.unresolved = num("unresolved")?;
                saw_refs = true;
            }
            "cache" => {
                let text = |key: &str| {
                    pairs
                        .iter()
                        .find(|(k, _)| k == key)
                        .map(|(_, v)| v.clone())
                        .filter(|n| {
                            !n.is_empty()
                                && n.len() <= crate::config::MAX_NAME
                                && n.bytes()
                                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
                        })
                        .ok_or(bad)
                };
                let name = text("name")?;
                parents.push(text("parent")?);
                c.caches.push(CacheCounters {
                    core: text("core")? == "0",
                    parent: None,
                    name,
                    size: num("size")?,
                    assoc: num("assoc")?,
                    stats: Stats {
                        hits: [num("hits_kernel")?, num("hits_user")?],
                        misses: [num("misses_kernel")?, num("misses_user")?],
                        compulsory: [num("compulsory_kernel")?, num("compulsory_user")?],
                    },
                });
            }
            _ => return Err(bad),
        }
    }
    let end = text.lines().count() + 1;
    if !saw_refs || c.caches.len() < 2 {
        return Err(end);
    }
    // Parents by name, always after their children (as the engine writes them).
    for (k, p) in parents.iter().enumerate() {
        if p != "memory" {
            let at = c.caches.iter().position(|x| x.name == *p);
            c.caches[k].parent = Some(at.filter(|&at| at > k).ok_or(end)?);
        }
    }
    Ok(c)
}

/// `cachesim-timeline.csv`, parsed: column names and rows of cumulative counters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Timeline {
    /// Header fields.
    pub columns: Vec<String>,
    /// Rows, each `columns.len()` wide.
    pub rows: Vec<Vec<u64>>,
}

impl Timeline {
    /// Index of column `name`.
    pub fn column(&self, name: &str) -> Option<usize> {
        self.columns.iter().position(|c| c == name)
    }
}

/// Parses `cachesim-timeline.csv`; the error is the first bad line's number.
pub fn parse_timeline(text: &str) -> Result<Timeline, usize> {
    let mut lines = text.lines();
    let header = lines.next().ok_or(1usize)?;
    let columns: Vec<String> = header.split(',').map(|s| s.to_string()).collect();
    if columns.len() < 4
        || columns[0] != "fetch_kernel"
        || (columns.len() - 4).checked_rem(4) != Some(0)
    {
        return Err(1);
    }
    let mut rows = Vec::new();
    for (i, l) in lines.enumerate() {
        let row: Vec<u64> = l
            .split(',')
            .map(|f| f.parse().ok())
            .collect::<Option<_>>()
            .ok_or(i + 2)?;
        if row.len() != columns.len() {
            return Err(i + 2);
        }
        rows.push(row);
    }
    Ok(Timeline { columns, rows })
}
