//! The host side (feature `host`): `cachesim.txt` in drcachesim's layout, `cachesim.json`
//! with the same numbers, and `cachesim-timeline.svg` (miss rate of each level over the
//! guest instructions executed, with the kernel's share of them beneath), from the files
//! the engine wrote ([`crate::COUNTERS_NAME`], [`crate::TIMELINE_NAME`]). As QEMU's
//! `contrib/plugins/cache.c` does, the text ends with the instructions with the most L1D
//! (data) and L1I (fetch) misses ([`crate::INSNS_NAME`]), each named `symbol+0xoff` by
//! the caller's [`BlockNames`] (the VMM passes the kernel's System.map or ELF symbols,
//! with the KASLR slide found from the addresses that ran).

extern crate std;

use alloc::format;
use alloc::string::{String, ToString};
use alloc::vec::Vec;
use core::fmt::Write;
use std::path::{Path, PathBuf};

use alloc::boxed::Box;
use kpin_tool::host::{Error as SinkError, Sink};
use kpin_tool::host_side::{
    BlockNames, HostTool, OptionFiles, RecordConsumer, Reported, RunFiles, UserNames,
};
use kpin_tool::MemRecord;
use serde::Serialize;

use crate::files::{parse_counters, parse_timeline, Counters, Timeline};
use crate::insns::{self, InsnMisses, Insns, MissKind};
use crate::profile::{self, Attributed};
use crate::sim::{Stats, KERNEL, USER};

/// The text report's name.
pub const TXT_NAME: &str = "cachesim.txt";
/// The JSON report's name.
pub const JSON_NAME: &str = "cachesim.json";
/// The timeline's name.
pub const SVG_NAME: &str = "cachesim-timeline.svg";

/// Counters of one cache for one side (kernel, user) or both.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Side {
    /// Line accesses that hit.
    pub hits: u64,
    /// Line accesses that missed.
    pub misses: u64,
    /// Misses on lines never held before.
    pub compulsory_misses: u64,
    /// `misses / (hits + misses)` (the local miss rate for levels past L1).
    pub miss_rate: f64,
    /// Levels past L1: hits in the levels below (every access reaching this cache
    /// started as a miss there).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub child_hits: Option<u64>,
    /// Levels past L1: `misses / (hits + misses + child_hits)`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub total_miss_rate: Option<f64>,
}

/// One cache.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CacheReport {
    /// `L1I`, `L1D`, `L2`, `LL`.
    pub name: String,
    /// Bytes.
    pub size: u64,
    /// Ways.
    pub assoc: u64,
    /// Both CPLs.
    pub total: Side,
    /// CPL 0.
    pub kernel: Side,
    /// CPL 3.
    pub user: Side,
    /// Whether the core accesses it directly (an L1).
    pub core: bool,
}

/// One instruction of a top-N list.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TopInsn {
    /// Guest virtual address of the instruction (`0x…`).
    pub address: String,
    /// Virtual CPL it ran at.
    pub cpl: u8,
    /// `symbol+0xoff`, if a symbol covers the address.
    pub symbol: Option<String>,
    /// Its misses of the list's kind (line accesses that missed the L1).
    pub misses: u64,
    /// `misses` over all the L1 misses of that kind (both CPLs; an L1 holding both
    /// counts its data and fetch misses apart).
    pub share: f64,
}

/// The instructions with the most misses, from [`crate::INSNS_NAME`].
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct TopInsns {
    /// Instructions listed per kind at most (option `top`).
    pub top: usize,
    /// Where the names come from (`None`: no symbols).
    pub symbols: Option<String>,
    /// Instructions with misses the engine's table held.
    pub instructions: usize,
    /// By data (L1D) misses, most first.
    pub data: Vec<TopInsn>,
    /// By fetch (L1I) misses, most first.
    pub fetch: Vec<TopInsn>,
    /// Data misses of instructions the full table could not hold.
    pub other_data_misses: u64,
    /// Fetch misses of instructions the full table could not hold.
    pub other_fetch_misses: u64,
}

impl TopInsns {
    /// The top `top` of `insns` by each kind. Every counted L1 miss is in the file (an
    /// instruction's row or `other`), so the shares are of the L1D and L1I misses.
    pub fn new(insns: &Insns, top: usize, names: Option<&dyn BlockNames>) -> Self {
        let (data_misses, fetch_misses) = insns.totals();
        let list = |kind: MissKind, total: u64| -> Vec<TopInsn> {
            insns::top(&insns.rows, kind, top)
                .iter()
                .map(|r: &InsnMisses| TopInsn {
                    address: insns::hex(r.va),
                    cpl: r.cpl,
                    symbol: names.and_then(|n| n.name(r.va)),
                    misses: r.of(kind),
                    share: rate(r.of(kind), total),
                })
                .collect()
        };
        TopInsns {
            top,
            symbols: names.map(|n| n.source()),
            instructions: insns.rows.len(),
            data: list(MissKind::Data, data_misses),
            fetch: list(MissKind::Fetch, fetch_misses),
            other_data_misses: insns.other.data,
            other_fetch_misses: insns.other.fetch,
        }
    }

    /// The text: QEMU's `cache.c` layout (address, symbol, misses, share), per kind.
    pub fn text(&self) -> String {
        let mut t = String::new();
        let _ = writeln!(
            t,
            "Instructions by misses (names from {}):",
            self.symbols.as_deref().unwrap_or("nowhere (no symbols)")
        );
        for (what, list, other) in [
            ("data (L1D)", &self.data, self.other_data_misses),
            ("fetch (L1I)", &self.fetch, self.other_fetch_misses),
        ] {
            let _ = writeln!(t, "  Top {} by {what} misses:", self.top);
            let _ = writeln!(
                t,
                "    {:>3}  {:<18} {:>3} {:>14} {:>8}  symbol",
                "#", "address", "cpl", "misses", "share"
            );
            for (i, e) in list.iter().enumerate() {
                let _ = writeln!(
                    t,
                    "    {:>3}  {:<18} {:>3} {:>14} {:>7.2}%  {}",
                    i + 1,
                    e.address,
                    e.cpl,
                    group(e.misses),
                    e.share * 100.0,
                    e.symbol.as_deref().unwrap_or("?")
                );
            }
            if list.is_empty() {
                let _ = writeln!(t, "    (no misses)");
            }
            if other > 0 {
                let _ = writeln!(
                    t,
                    "    {} misses of instructions past the table's {} entries are not ranked",
                    group(other),
                    self.instructions
                );
            }
        }
        t
    }
}

/// `cachesim.json`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Report {
    /// The options in force (drcachesim's names).
    pub options: std::collections::BTreeMap<String, String>,
    /// Instruction fetches simulated (= guest instructions executed).
    pub instructions: [u64; 2],
    /// Data references simulated, `[kernel, user]`.
    pub data_references: [u64; 2],
    /// References past `sim_refs`, not simulated.
    pub skipped_references: u64,
    /// Records whose physical address did not resolve.
    pub unresolved_records: u64,
    /// L1I, L1D, [L2,] LL.
    pub caches: Vec<CacheReport>,
    /// The instructions with the most L1 misses, if the engine wrote them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_instructions: Option<TopInsns>,
    /// With `attribute=on`: the events per process (and the Cachegrind totals).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attributed: Option<Attributed>,
}

fn rate(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        part as f64 / whole as f64
    }
}

fn side(s: &Stats, who: Option<usize>, child: Option<u64>) -> Side {
    let pick = |v: [u64; 2]| who.map_or(v[0] + v[1], |w| v[w]);
    let (hits, misses) = (pick(s.hits), pick(s.misses));
    Side {
        hits,
        misses,
        compulsory_misses: pick(s.compulsory),
        miss_rate: rate(misses, hits + misses),
        child_hits: child,
        total_miss_rate: child.map(|c| rate(misses, hits + misses + c)),
    }
}

impl Report {
    /// The report of parsed counters.
    pub fn new(c: &Counters) -> Self {
        let mut caches = Vec::new();
        for (i, cc) in c.caches.iter().enumerate() {
            let l1 = cc.core;
            // Hits in the caches below this one (its children, theirs, …), `[kernel, user]`.
            let mut below = [0u64; 2];
            for (k, d) in c.caches.iter().enumerate().take(i) {
                let mut at = d.parent;
                while let Some(p) = at.filter(|&p| p <= i) {
                    if p == i {
                        for w in [KERNEL, USER] {
                            below[w] += c.caches[k].stats.hits[w];
                        }
                        break;
                    }
                    at = c.caches[p].parent;
                }
            }
            let child =
                |w: Option<usize>| (!l1).then(|| w.map_or(below[0] + below[1], |w| below[w]));
            caches.push(CacheReport {
                name: cc.name.clone(),
                size: cc.size,
                assoc: cc.assoc,
                total: side(&cc.stats, None, child(None)),
                kernel: side(&cc.stats, Some(KERNEL), child(Some(KERNEL))),
                user: side(&cc.stats, Some(USER), child(Some(USER))),
                core: false,
            });
            caches.last_mut().expect("pushed").core = l1;
        }
        Report {
            options: c.options.iter().cloned().collect(),
            instructions: c.fetch_refs,
            data_references: c.data_refs,
            skipped_references: c.skipped,
            unresolved_records: c.unresolved,
            caches,
            top_instructions: None,
            attributed: None,
        }
    }

    /// The `top` option the run used (10 if the counters do not say).
    pub fn top(&self) -> usize {
        self.options
            .get("top")
            .and_then(|v| v.parse().ok())
            .unwrap_or(10)
    }

    /// Adds the top-N lists from the parsed per-instruction file.
    pub fn add_top(&mut self, insns: &Insns, names: Option<&dyn BlockNames>) {
        self.top_instructions = Some(TopInsns::new(insns, self.top(), names));
    }

    /// `cachesim.txt`: drcachesim's layout, each number as total, kernel and user.
    pub fn text(&self) -> String {
        let mut t = String::new();
        let n = |v: u64| group(v);
        let p = |v: f64| format!("{:.2}%", v * 100.0);
        let _ = writeln!(
            t,
            "Cache simulation results (kpin cachesim, guest-physical addresses):"
        );
        let opts: Vec<String> = self
            .options
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        let _ = writeln!(t, "Options: {}", opts.join(" "));
        let _ = writeln!(
            t,
            "Instructions: {} (kernel {}, user {}); data references: {} (kernel {}, user {})",
            n(self.instructions[0] + self.instructions[1]),
            n(self.instructions[0]),
            n(self.instructions[1]),
            n(self.data_references[0] + self.data_references[1]),
            n(self.data_references[0]),
            n(self.data_references[1]),
        );
        if self.skipped_references > 0 || self.unresolved_records > 0 {
            let _ = writeln!(
                t,
                "Not simulated: {} references past sim_refs, {} records without a physical address",
                n(self.skipped_references),
                n(self.unresolved_records)
            );
        }
        let _ = writeln!(t, "Core #0 (1 vCPU)");
        for c in &self.caches {
            let l1 = c.core;
            let indent = if l1 { "  " } else { "" };
            let _ = writeln!(
                t,
                "{indent}{} ({} KiB, {}-way) stats:",
                c.name,
                c.size / 1024,
                c.assoc
            );
            let _ = writeln!(
                t,
                "{indent}    {:<22}{:>18}{:>18}{:>18}",
                "", "total", "kernel", "user"
            );
            let row = |t: &mut String, label: &str, f: &dyn Fn(&Side) -> String| {
                let _ = writeln!(
                    t,
                    "{indent}    {:<22}{:>18}{:>18}{:>18}",
                    label,
                    f(&c.total),
                    f(&c.kernel),
                    f(&c.user)
                );
            };
            row(&mut t, "Hits:", &|s| n(s.hits));
            row(&mut t, "Misses:", &|s| n(s.misses));
            row(&mut t, "Compulsory misses:", &|s| n(s.compulsory_misses));
            if l1 {
                row(&mut t, "Miss rate:", &|s| p(s.miss_rate));
            } else {
                row(&mut t, "Local miss rate:", &|s| p(s.miss_rate));
                row(&mut t, "Child hits:", &|s| n(s.child_hits.unwrap_or(0)));
                row(&mut t, "Total miss rate:", &|s| {
                    p(s.total_miss_rate.unwrap_or(0.0))
                });
            }
        }
        if let Some(top) = &self.top_instructions {
            t.push_str(&top.text());
        }
        if let Some(a) = &self.attributed {
            t.push_str(&a.text(self.top()));
        }
        t
    }
}

/// `1234567` as `1,234,567` (drcachesim's grouping).
pub(crate) fn group(v: u64) -> String {
    let s = v.to_string();
    let mut out = String::new();
    for (i, ch) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).checked_rem(3) == Some(0) {
            out.push(',');
        }
        out.push(ch);
    }
    out
}

/// One plotted point per timeline interval.
struct Interval {
    /// Instructions executed at the interval's end.
    insns: f64,
    /// Kernel share of the interval's instructions, percent.
    kernel_pct: f64,
    /// Per cache: miss rate in the interval, percent (`None` without accesses).
    rates: Vec<Option<f64>>,
}

fn intervals(t: &Timeline, names: &[String]) -> Vec<Interval> {
    let col = |n: &str| t.column(n);
    let mut out = Vec::new();
    let zero = alloc::vec![0u64; t.columns.len()];
    let mut prev: &[u64] = &zero;
    for row in &t.rows {
        let d = |i: Option<usize>| i.map_or(0, |i| row[i].saturating_sub(prev[i]));
        let (fk, fu) = (d(col("fetch_kernel")), d(col("fetch_user")));
        let rates = names
            .iter()
            .map(|n| {
                let hits = d(col(&format!("{n}_hits_kernel"))) + d(col(&format!("{n}_hits_user")));
                let misses =
                    d(col(&format!("{n}_misses_kernel"))) + d(col(&format!("{n}_misses_user")));
                (hits + misses > 0).then(|| 100.0 * misses as f64 / (hits + misses) as f64)
            })
            .collect();
        let insns =
            col("fetch_kernel").map_or(0, |i| row[i]) + col("fetch_user").map_or(0, |i| row[i]);
        out.push(Interval {
            insns: insns as f64,
            kernel_pct: if fk + fu == 0 {
                0.0
            } else {
                100.0 * fk as f64 / (fk + fu) as f64
            },
            rates,
        });
        prev = row;
    }
    out
}

/// Draws the timeline as SVG text: the L1 miss rates on the left axis, the local miss
/// rates of the later levels on the right one (they are of another magnitude), intervals
/// where the kernel ran most instructions shaded, and the kernel/user split beneath.
pub fn timeline_svg(t: &Timeline, names: &[String], core: &[bool]) -> Result<String, String> {
    use plotters::prelude::*;
    let iv = intervals(t, names);
    let err = |e: &dyn core::fmt::Display| e.to_string();
    let shade = RGBColor(255, 238, 220);
    let colors = [
        RGBColor(31, 119, 180),
        RGBColor(44, 160, 44),
        RGBColor(148, 103, 189),
        RGBColor(214, 39, 40),
    ];
    let is_l1 = |k: usize| core.get(k).copied().unwrap_or(false);
    let l1: Vec<usize> = (0..names.len()).filter(|&k| is_l1(k)).collect();
    let outer: Vec<usize> = (0..names.len()).filter(|&k| !is_l1(k)).collect();
    let max_of = |ks: &[usize]| {
        iv.iter()
            .flat_map(|i| ks.iter().filter_map(|&k| i.rates[k]))
            .fold(0.5f64, f64::max)
            .min(100.0)
            * 1.1
    };
    let (y1, y2) = (max_of(&l1), max_of(&outer).clamp(10.0, 105.0));
    // Each interval as a step from its start to its end.
    let starts: Vec<f64> = core::iter::once(0.0)
        .chain(iv.iter().map(|i| i.insns))
        .collect();
    let steps = |f: &dyn Fn(&Interval) -> Option<f64>| -> Vec<(f64, f64)> {
        iv.iter()
            .zip(&starts)
            .filter_map(|(i, &s)| f(i).map(|v| [(s, v), (i.insns, v)]))
            .flatten()
            .collect()
    };
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (1100, 640)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(&e))?;
        let (top, bottom) = root.split_vertically(470);
        let x_max = iv.last().map_or(1.0, |i| i.insns).max(1.0);
        let mut chart = ChartBuilder::on(&top)
            .caption(
                "cachesim: miss rates over the guest instructions executed",
                ("sans-serif", 22),
            )
            .margin(14)
            .x_label_area_size(36)
            .y_label_area_size(64)
            .right_y_label_area_size(64)
            .build_cartesian_2d(0f64..x_max, 0f64..y1)
            .map_err(|e| err(&e))?
            .set_secondary_coord(0f64..x_max, 0f64..y2);
        // Shade the intervals where the kernel ran most of the instructions.
        for (i, &s) in iv.iter().zip(&starts) {
            if i.kernel_pct >= 50.0 {
                chart
                    .draw_series(core::iter::once(Rectangle::new(
                        [(s, 0.0), (i.insns, y1)],
                        shade.filled(),
                    )))
                    .map_err(|e| err(&e))?;
            }
        }
        chart
            .configure_mesh()
            .x_desc("guest instructions executed")
            .y_desc("L1 miss rate (%)")
            .x_label_formatter(&|x| human(*x))
            .y_label_formatter(&|y| format!("{y:.1}%"))
            .light_line_style(RGBColor(230, 230, 230).mix(0.6))
            .draw()
            .map_err(|e| err(&e))?;
        chart
            .configure_secondary_axes()
            .y_desc("local miss rate of L2/LL (%)")
            .y_label_formatter(&|y| format!("{y:.0}%"))
            .draw()
            .map_err(|e| err(&e))?;
        for &k in &l1 {
            let color = colors[k % colors.len()];
            chart
                .draw_series(LineSeries::new(
                    steps(&|i: &Interval| i.rates[k]),
                    color.stroke_width(2),
                ))
                .map_err(|e| err(&e))?
                .label(format!("{} miss rate (left)", names[k]))
                .legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 18, y)], color.stroke_width(3))
                });
        }
        for &k in &outer {
            let color = colors[k % colors.len()];
            chart
                .draw_secondary_series(LineSeries::new(
                    steps(&|i: &Interval| i.rates[k]),
                    color.stroke_width(2),
                ))
                .map_err(|e| err(&e))?
                .label(format!("{} local miss rate (right)", names[k]))
                .legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 18, y)], color.stroke_width(3))
                });
        }
        chart
            .draw_series(core::iter::once(Rectangle::new(
                [(0.0, 0.0), (0.0, 0.0)],
                shade.filled(),
            )))
            .map_err(|e| err(&e))?
            .label("kernel ran most instructions")
            .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 18, y + 6)], shade.filled()));
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.9))
            .border_style(RGBColor(180, 180, 180))
            .draw()
            .map_err(|e| err(&e))?;

        let mut share = ChartBuilder::on(&bottom)
            .margin(14)
            .x_label_area_size(30)
            .y_label_area_size(64)
            .right_y_label_area_size(64)
            .build_cartesian_2d(0f64..x_max, 0f64..100f64)
            .map_err(|e| err(&e))?;
        share
            .configure_mesh()
            .y_desc("instructions (%)")
            .x_label_formatter(&|x| human(*x))
            .y_label_formatter(&|y| format!("{y:.0}%"))
            .y_labels(3)
            .light_line_style(RGBColor(230, 230, 230).mix(0.6))
            .draw()
            .map_err(|e| err(&e))?;
        let user = RGBColor(158, 202, 225);
        let kernel = RGBColor(253, 174, 107);
        share
            .draw_series(AreaSeries::new(steps(&|_| Some(100.0)), 0.0, user.filled()))
            .map_err(|e| err(&e))?
            .label("user (CPL 3)")
            .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 18, y + 6)], user.filled()));
        share
            .draw_series(AreaSeries::new(
                steps(&|i: &Interval| Some(i.kernel_pct)),
                0.0,
                kernel.filled(),
            ))
            .map_err(|e| err(&e))?
            .label("kernel (CPL 0)")
            .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 18, y + 6)], kernel.filled()));
        share
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.9))
            .border_style(RGBColor(180, 180, 180))
            .draw()
            .map_err(|e| err(&e))?;
        root.present().map_err(|e| err(&e))?;
    }
    Ok(svg)
}

/// `12_300_000` as `12.3M`, `500_000_000` as `500M`.
fn human(v: f64) -> String {
    let a = v.abs();
    let (x, suffix) = if a >= 1e9 {
        (v / 1e9, "G")
    } else if a >= 1e6 {
        (v / 1e6, "M")
    } else if a >= 1e3 {
        (v / 1e3, "K")
    } else {
        (v, "")
    };
    let s = format!("{x:.1}");
    format!("{}{suffix}", s.strip_suffix(".0").unwrap_or(&s))
}

/// Largest per-instruction file read (the engine's table writes well under 1 MiB).
pub const MAX_INSNS_BYTES: u64 = 16 << 20;

/// `<out>/cachesim-insns.csv` parsed; `Ok(None)` if the run wrote none. (Also what a
/// [`BlockNames`] can calibrate on: the kernel addresses that ran, for a KASLR slide.)
pub fn read_insns(out: &Path) -> Result<Option<Insns>, String> {
    let path = out.join(crate::INSNS_NAME);
    if std::fs::symlink_metadata(&path).is_err() {
        return Ok(None);
    }
    let text = host_daemon::resolve::read_output_text(&path, MAX_INSNS_BYTES)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    insns::parse(&text)
        .map(Some)
        .map_err(|l| format!("{}: line {l} is not what the engine writes", path.display()))
}

/// [`write_reports_named`] without symbols.
pub fn write_reports(out: &Path) -> Result<Option<(Report, Vec<PathBuf>)>, String> {
    write_reports_named(out, None)
}

/// [`write_reports_attributed`] without user-code names.
pub fn write_reports_named(
    out: &Path,
    names: Option<&dyn BlockNames>,
) -> Result<Option<(Report, Vec<PathBuf>)>, String> {
    write_reports_attributed(out, names, None)
}

/// Reads the engine's files in `out` and writes `cachesim.txt`, `cachesim.json` and
/// `cachesim-timeline.svg` there, instructions named by `names`; with
/// [`crate::BLOCKS_NAME`] (`attribute=on`) also the per-process table and the files of
/// [`profile`], user code named by `user`. `Ok(None)` if the run left no cachesim files;
/// an error names the file that is not what the engine writes (it came from inside the
/// guest).
pub fn write_reports_attributed(
    out: &Path,
    names: Option<&dyn BlockNames>,
    user: Option<&dyn UserNames>,
) -> Result<Option<(Report, Vec<PathBuf>)>, String> {
    let counters_path = out.join(crate::COUNTERS_NAME);
    if !counters_path.exists() {
        return Ok(None);
    }
    let read = |p: &Path| std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()));
    let counters = parse_counters(&read(&counters_path)?).map_err(|l| {
        format!(
            "{}: line {l} is not what the engine writes",
            counters_path.display()
        )
    })?;
    let mut report = Report::new(&counters);
    if let Some(insns) = read_insns(out)? {
        report.add_top(&insns, names);
    }
    let mut written = Vec::new();
    if let Some(blocks) = profile::read_blocks(out)? {
        let tasks = profile::read_tasks(out)?.unwrap_or_default();
        let stacks = profile::read_stacks(out)?;
        let stacks = stacks.as_ref().map(|(c, s)| (&c[..], &s[..]));
        let made = profile::attribute(&blocks, stacks, &counters, &tasks, names, user);
        written.extend(profile::write_files(&made, &counters, out)?);
        report.attributed = Some(made.attributed);
    }
    let write = |name: &str, data: &str, written: &mut Vec<PathBuf>| {
        let p = out.join(name);
        std::fs::write(&p, data).map_err(|e| format!("{}: {e}", p.display()))?;
        written.push(p);
        Ok::<(), String>(())
    };
    write(TXT_NAME, &report.text(), &mut written)?;
    let json = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
    write(JSON_NAME, &(json + "\n"), &mut written)?;
    let timeline_path = out.join(crate::TIMELINE_NAME);
    if timeline_path.exists() {
        let t = parse_timeline(&read(&timeline_path)?).map_err(|l| {
            format!(
                "{}: line {l} is not what the engine writes",
                timeline_path.display()
            )
        })?;
        let names: Vec<String> = counters.caches.iter().map(|c| c.name.clone()).collect();
        let core: Vec<bool> = counters.caches.iter().map(|c| c.core).collect();
        write(SVG_NAME, &timeline_svg(&t, &names, &core)?, &mut written)?;
    }
    Ok(Some((report, written)))
}

/// Largest `config_file` read (a hierarchy is a few hundred bytes).
pub const MAX_CONFIG_FILE: u64 = 64 << 10;

/// cachesim's host-side part (the registry's): the options checked before boot and
/// handed to the engine in one canonical form with a `config_file` expanded; the
/// simulation on a host thread ([`CacheSim`] as a [`RecordConsumer`], with a larger
/// per-instruction table than the engine's heap affords); and after the run
/// [`TXT_NAME`], [`JSON_NAME`] and [`SVG_NAME`], the top instructions named from the
/// kernel's symbols (the KASLR slide found from the kernel instructions that missed).
#[derive(Clone, Copy, Debug)]
pub struct Host;

impl HostTool for Host {
    fn spec(&self) -> &'static kpin_tool::ToolSpec {
        &crate::SPEC
    }

    fn run_json_key(&self) -> Option<&'static str> {
        Some(crate::SPEC.name)
    }

    fn report_files(&self) -> &'static [&'static str] {
        &[
            TXT_NAME,
            JSON_NAME,
            SVG_NAME,
            profile::CACHEGRIND_NAME,
            profile::FOLDED_NAME,
            profile::FLAME_NAME,
            profile::FOLDED_L1D_NAME,
            profile::FLAME_L1D_NAME,
        ]
    }

    fn engine_options(
        &self,
        options: &str,
        files: &mut dyn OptionFiles,
    ) -> Result<Option<String>, String> {
        let mut read = |path: &str| -> Result<String, String> {
            let len = files.len(path, "cachesim config_file")?;
            if len > MAX_CONFIG_FILE {
                return Err(format!(
                    "{len} bytes: a cache configuration is at most {MAX_CONFIG_FILE} bytes"
                ));
            }
            files.read(path)
        };
        let o = crate::options::Options::parse_host(options, &mut read)?;
        Ok(Some(o.to_words()))
    }

    fn record_consumer(&self, options: &str) -> Option<Box<dyn RecordConsumer>> {
        let sim = crate::CacheSim::with_capacities(
            options,
            insns::HOST_CAPACITY,
            crate::attr::HOST_BLOCKS,
            crate::attr::HOST_CONTEXTS,
        )
        .ok()?;
        Some(Box::new(sim))
    }

    fn report(&self, run: &mut RunFiles<'_>) -> Reported {
        // Not from files the engine left unfinished.
        if run
            .unfinished
            .iter()
            .any(|p| p.to_str().is_some_and(|p| p.starts_with(crate::SPEC.name)))
        {
            return Reported::default();
        }
        let out = run.dir;
        let mut executed: Vec<u64> = match read_insns(out) {
            Ok(Some(insns)) => insns
                .rows
                .iter()
                .filter(|r| r.cpl == 0)
                .map(|r| r.va)
                .collect(),
            _ => Vec::new(),
        };
        // The blocks' kernel addresses ran too (a bad file is said below).
        let blocks = profile::read_blocks(out).ok().flatten();
        executed.extend(
            blocks
                .iter()
                .flatten()
                .filter(|b| !b.user && b.code != crate::attr::OVERFLOW)
                .map(|b| b.code),
        );
        let names = match run.names(executed) {
            Ok(n) => n,
            Err(e) => {
                run.say(&format!("cachesim's instructions left unnamed: {e:#}"));
                None
            }
        };
        let user = match blocks {
            Some(_) => run.user_code().unwrap_or_else(|e| {
                run.say(&format!("cachesim's user code left unnamed: {e:#}"));
                None
            }),
            None => None,
        };
        match write_reports_attributed(out, names.as_deref(), user.as_deref()) {
            Ok(Some((r, files))) => {
                run.say(&format!("{}\ncachesim: {files:?}", r.text()));
                Reported {
                    run_json: r.attributed.map(|a| Box::new(a) as _),
                    failure: None,
                }
            }
            Ok(None) => Reported::default(),
            Err(e) => {
                run.say(&format!("no cachesim report: {e}"));
                Reported::default()
            }
        }
    }
}

impl RecordConsumer for crate::CacheSim {
    fn feed(&mut self, records: &[MemRecord]) {
        self.feed_all(records);
    }

    fn write_files(&self, sink: &mut dyn Sink) -> Result<(), SinkError> {
        crate::CacheSim::write_files(self, sink)
    }

    fn summary(&self, out: &mut dyn core::fmt::Write) -> core::fmt::Result {
        self.write_summary(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn axis_numbers_and_grouping_read_well() {
        assert_eq!(human(500e6), "500M");
        assert_eq!(human(1.5e9), "1.5G");
        assert_eq!(human(12_345.0), "12.3K");
        assert_eq!(human(0.0), "0");
        assert_eq!(group(1_234_567), "1,234,567");
        assert_eq!(group(12), "12");
    }
}
