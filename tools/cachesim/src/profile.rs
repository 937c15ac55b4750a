//! The attributed reports (feature `host`, `attribute=on`): from [`crate::BLOCKS_NAME`]
//! and `processes.json`, the per-process table (in `cachesim.txt`, `cachesim.json` and
//! `run.json`'s `cachesim`), [`CACHEGRIND_NAME`] (Cachegrind's format, for `cg_annotate`
//! and KCachegrind) and folded stacks with their flame graphs (`process;object;function`,
//! by instructions and by L1D misses). Kernel blocks are named from the kernel's symbols
//! ([`BlockNames`]) and charged to the task they ran for; user blocks from the guest's
//! files ([`UserNames`]). With call stacks ([`crate::CONTEXTS_NAME`],
//! [`crate::STACKS_NAME`]), the folded stacks are `process;object;function…` per task and
//! calling context: the functions the context's calls entered, outermost first (kernel
//! and user stacks are apart: a kernel function's callers are kernel functions; code
//! that ran before any call of its stack, such as the kernel's entry code, is its own
//! frame). The Cachegrind file and the per-process table come from the blocks either
//! way.

extern crate std;

use alloc::format;
use alloc::string::{String, ToString};
use alloc::vec::Vec;
use core::fmt::Write;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kpin_tool::host_side::{function_of, BlockNames, UserNames};
use kpin_tool::processes::Processes;
use kpin_tool::profile_out::{frame_safe, Folded, Profile};
use serde::Serialize;

use crate::attr::{self, Block, Context, Stacked, EVENTS, OVERFLOW, ROOT};
use crate::files::Counters;

/// The Cachegrind file (Valgrind's `cachegrind.out.<pid>` pattern, which KCachegrind's
/// file dialog lists).
pub const CACHEGRIND_NAME: &str = "cachegrind.out.cachesim";
/// Folded stacks weighted by instructions.
pub const FOLDED_NAME: &str = "cachesim.folded";
/// Their flame graph.
pub const FLAME_NAME: &str = "cachesim-flamegraph.svg";
/// Folded stacks weighted by L1D misses (reads and writes).
pub const FOLDED_L1D_NAME: &str = "cachesim-l1d.folded";
/// Their flame graph.
pub const FLAME_L1D_NAME: &str = "cachesim-l1d-flamegraph.svg";
/// Largest blocks file read (~60 bytes a block; a Linux run has ~100 000).
pub const MAX_BLOCKS_BYTES: u64 = 256 << 20;

/// The object of kernel frames.
pub const KERNEL_OBJECT: &str = "[kernel]";
/// A function or object nothing names.
pub const UNKNOWN: &str = "[unknown]";
/// The function of a task's blocks past the table's capacity.
pub const OTHER_BLOCKS: &str = "[other blocks]";

/// A `processes.json` row, as far as the report needs it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Task {
    /// `pid` (tasks only).
    pub pid: Option<u64>,
    /// The name for a frame and the table: `comm`, or what the row is (`[boot]`,
    /// `cr3 0x…`, `[overflow]`).
    pub name: String,
}

/// Reads the rows of `processes.json` (`Ok(None)`: none in the run), indexed as the
/// engine's `TASK` records name them. The file came from the guest's side
/// ([`kpin_tool::processes`] reads it as untrusted).
pub fn read_tasks(out: &Path) -> Result<Option<Vec<Task>>, String> {
    let Some(p) = Processes::read(out)? else {
        return Ok(None);
    };
    let mut tasks = alloc::vec![Task::default(); p.rows.len()];
    for r in p.rows {
        let name = match r.kind.as_str() {
            "boot" => "[boot]".to_string(),
            "overflow" => "[overflow]".to_string(),
            "address_space" => format!("cr3 {}", r.cr3.as_deref().unwrap_or("?")),
            _ => r.comm,
        };
        if let Some(t) = tasks.get_mut(r.row) {
            *t = Task {
                pid: r.pid.and_then(|p| u64::try_from(p).ok()),
                name,
            };
        }
    }
    Ok(Some(tasks))
}

/// One process's row of the table.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ProcessRow {
    /// Its `processes.json` row.
    pub row: u32,
    /// `pid`, for a task.
    pub pid: Option<u64>,
    /// `comm` (or what the row is).
    pub comm: String,
    /// Instructions it executed (Ir), both modes.
    pub instructions: u64,
    /// Of them, kernel instructions run for it (its syscalls, faults and what ran after
    /// it until the next task: the engine's charging rule).
    pub kernel_instructions: u64,
    /// `instructions` over all.
    pub instruction_share: f64,
    /// L1D misses (D1mr + D1mw).
    pub l1d_misses: u64,
    /// `l1d_misses` over all.
    pub l1d_share: f64,
    /// Last-level misses (ILmr + DLmr + DLmw).
    pub ll_misses: u64,
    /// `ll_misses` over all.
    pub ll_share: f64,
}

/// The attributed part of the report.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Attributed {
    /// Where the kernel's names came from (`None`: none).
    pub kernel_symbols: Option<String>,
    /// Where the user code's names came from (`None`: none).
    pub user_symbols: Option<String>,
    /// Code blocks with events.
    pub blocks: usize,
    /// Cachegrind's event names.
    pub events: Vec<String>,
    /// The sums of the blocks, per event.
    pub totals: Vec<u64>,
    /// Whether the sums equal the counters of `cachesim-counters.txt` (Ir the fetches,
    /// Dr + Dw the data references, I1mr + D1mr + D1mw the L1s' misses, ILmr + DLmr +
    /// DLmw the misses of the caches below memory).
    pub totals_match_counters: bool,
    /// User-mode instructions whose code has a named object and function, and those
    /// with an object only.
    pub user_instructions_named: [u64; 2],
    /// Every process, most instructions first.
    pub processes: Vec<ProcessRow>,
}

/// What a block is: its task, object and function, and its callers.
struct Frames<'a> {
    tasks: &'a [Task],
    kernel: Option<&'a dyn BlockNames>,
    user: Option<&'a dyn UserNames>,
    /// The calling contexts (empty: no call stacks).
    contexts: &'a [Context],
    /// Per context, the functions its calls entered, outermost first, as folded
    /// frames joined by `;` (made once per context, from its parent's).
    callers: BTreeMap<u32, String>,
}

impl Frames<'_> {
    fn task(&self, row: u32) -> String {
        self.tasks
            .get(row as usize)
            .map_or(format!("row {row}"), |t| t.name.clone())
    }

    /// The code a context's call entered, as a block of `user` code at `code`.
    fn entry(user: bool, code: u64) -> Block {
        Block {
            task: 0,
            user,
            code,
            counts: [0; 9],
        }
    }

    /// The functions context `ctx`'s calls entered, outermost first, as folded frames
    /// joined by `;` (empty for the root, or a context the file does not have).
    fn callers(&mut self, ctx: u32) -> &str {
        // Made for the missing ancestors first, outermost first: parents come before
        // their children (`attr::parse_contexts`), so the walk up ends.
        let mut missing = Vec::new();
        let mut c = ctx;
        while c != ROOT && !self.callers.contains_key(&c) {
            match self.contexts.get(c as usize) {
                Some(x) => {
                    missing.push(c);
                    c = x.parent;
                }
                None => break,
            }
        }
        for &c in missing.iter().rev() {
            let x = self.contexts[c as usize];
            let name = frame_safe(&self.code(&Self::entry(x.user, x.callee)).1);
            let joined = match self.callers.get(&x.parent) {
                Some(p) if x.parent != ROOT => alloc::format!("{p};{name}"),
                _ => name,
            };
            self.callers.insert(c, joined);
        }
        self.callers.get(&ctx).map_or("", |s| s.as_str())
    }

    /// The folded stack of `e`, joined: its task, the object of the code it ran, the
    /// functions its context's calls entered and, in the root context, its block's
    /// function.
    fn stack(&mut self, e: &Stacked) -> String {
        let leaf = match self.contexts.get(e.ctx as usize) {
            Some(x) if e.ctx != ROOT => Self::entry(x.user, x.callee),
            _ => Self::entry(e.user, e.code),
        };
        let (object, function, ..) = self.code(&leaf);
        let head = alloc::format!("{};{}", frame_safe(&self.task(e.task)), frame_safe(&object));
        if e.ctx == ROOT {
            alloc::format!("{head};{}", frame_safe(&function))
        } else {
            alloc::format!("{head};{}", self.callers(e.ctx))
        }
    }

    /// (object, function, whether the object is known, whether the function is).
    fn code(&self, b: &Block) -> (String, String, bool, bool) {
        if b.code == OVERFLOW {
            let object = if b.user { UNKNOWN } else { KERNEL_OBJECT };
            return (object.to_string(), OTHER_BLOCKS.to_string(), false, false);
        }
        if !b.user {
            // `symbol+0xoff`: the function is the symbol.
            let function = self
                .kernel
                .and_then(|n| n.name(b.code))
                .map(|s| function_of(&s).to_string());
            let named = function.is_some();
            return (
                KERNEL_OBJECT.to_string(),
                function.unwrap_or_else(|| UNKNOWN.to_string()),
                true,
                named,
            );
        }
        match self.user.and_then(|n| n.name(b.code)) {
            Some(c) => {
                let named = c.function.is_some();
                (
                    c.object,
                    c.function
                        .map_or_else(|| UNKNOWN.to_string(), |f| function_of(&f).to_string()),
                    true,
                    named,
                )
            }
            None => (UNKNOWN.to_string(), UNKNOWN.to_string(), false, false),
        }
    }
}

/// The counters' sums in [`Attributed::totals_match_counters`]'s terms: Ir, data
/// references, L1 misses, memory-side misses.
fn counter_sums(c: &Counters) -> [u64; 4] {
    let misses = |cc: &crate::files::CacheCounters| cc.stats.misses[0] + cc.stats.misses[1];
    [
        c.fetch_refs[0] + c.fetch_refs[1],
        c.data_refs[0] + c.data_refs[1],
        c.caches.iter().filter(|cc| cc.core).map(misses).sum(),
        c.caches
            .iter()
            .filter(|cc| cc.parent.is_none())
            .map(misses)
            .sum(),
    ]
}

/// The same sums of Cachegrind's event totals.
fn event_sums(t: &[u64]) -> [u64; 4] {
    let e = |name: &str| {
        EVENTS
            .iter()
            .position(|x| *x == name)
            .and_then(|i| t.get(i).copied())
            .unwrap_or(0)
    };
    [
        e("Ir"),
        e("Dr") + e("Dw"),
        e("I1mr") + e("D1mr") + e("D1mw"),
        e("ILmr") + e("DLmr") + e("DLmw"),
    ]
}

/// The Cachegrind profile, the folded stacks (instructions, L1D misses) and the
/// per-process table of `blocks`.
pub struct Made {
    /// For the reports.
    pub attributed: Attributed,
    /// The Cachegrind profile.
    pub profile: Profile,
    /// By instructions.
    pub folded: Folded,
    /// By L1D misses.
    pub folded_l1d: Folded,
}

/// Attributes `blocks` to tasks, objects and functions.
/// With call stacks (`stacks`: the run's calling contexts and its events per task and
/// context), the folded stacks are by calling context.
pub fn attribute(
    blocks: &[Block],
    stacks: Option<(&[Context], &[Stacked])>,
    counters: &Counters,
    tasks: &[Task],
    kernel: Option<&dyn BlockNames>,
    user: Option<&dyn UserNames>,
) -> Made {
    let mut frames = Frames {
        tasks,
        kernel,
        user,
        contexts: stacks.map_or(&[], |s| s.0),
        callers: BTreeMap::new(),
    };
    let mut profile = Profile::new(&EVENTS);
    let (mut folded, mut folded_l1d) = (Folded::default(), Folded::default());
    // Per row: Ir, kernel Ir, L1D misses, LL misses.
    let mut rows: BTreeMap<u32, [u64; 4]> = BTreeMap::new();
    let mut named = [0u64; 2];
    let i = |name: &str| EVENTS.iter().position(|x| *x == name).unwrap_or(0);
    let (ir, d1mr, d1mw) = (i("Ir"), i("D1mr"), i("D1mw"));
    let ll = [i("ILmr"), i("DLmr"), i("DLmw")];
    for b in blocks {
        let (object, function, has_object, has_function) = frames.code(b);
        let task = frames.task(b.task);
        let c = &b.counts;
        profile.add(&object, &function, c);
        if stacks.is_none() {
            folded.add(&[&task, &object, &function], c[ir]);
            folded_l1d.add(&[&task, &object, &function], c[d1mr] + c[d1mw]);
        }
        let row = rows.entry(b.task).or_default();
        row[0] += c[ir];
        row[1] += if b.user { 0 } else { c[ir] };
        row[2] += c[d1mr] + c[d1mw];
        row[3] += ll.iter().map(|&k| c[k]).sum::<u64>();
        if b.user && has_object {
            named[usize::from(!has_function)] += c[ir];
        }
    }
    for e in stacks.map_or(&[][..], |s| s.1) {
        let stack = frames.stack(e);
        let c = &e.counts;
        folded.add_joined(&stack, c[ir]);
        folded_l1d.add_joined(&stack, c[d1mr] + c[d1mw]);
    }
    let totals = profile.totals();
    let all: [u64; 4] = rows.values().fold([0; 4], |mut a, r| {
        for (a, r) in a.iter_mut().zip(r) {
            *a += r;
        }
        a
    });
    let share = |part: u64, whole: u64| {
        if whole == 0 {
            0.0
        } else {
            part as f64 / whole as f64
        }
    };
    let mut processes: Vec<ProcessRow> = rows
        .iter()
        .map(|(&row, r)| {
            let t = tasks.get(row as usize);
            ProcessRow {
                row,
                pid: t.and_then(|t| t.pid),
                comm: frames.task(row),
                instructions: r[0],
                kernel_instructions: r[1],
                instruction_share: share(r[0], all[0]),
                l1d_misses: r[2],
                l1d_share: share(r[2], all[2]),
                ll_misses: r[3],
                ll_share: share(r[3], all[3]),
            }
        })
        .collect();
    processes.sort_by(|a, b| b.instructions.cmp(&a.instructions).then(a.row.cmp(&b.row)));
    Made {
        attributed: Attributed {
            kernel_symbols: kernel.map(|n| n.source()),
            user_symbols: user.map(|n| n.source()),
            blocks: blocks.len(),
            events: EVENTS.iter().map(|e| e.to_string()).collect(),
            totals_match_counters: event_sums(&totals) == counter_sums(counters),
            totals,
            user_instructions_named: named,
            processes,
        },
        profile,
        folded,
        folded_l1d,
    }
}

impl Attributed {
    /// The per-process table: the `top` rows with the most instructions, the rest
    /// summed.
    pub fn text(&self, top: usize) -> String {
        let mut t = String::new();
        let n = crate::report::group;
        let _ = writeln!(
            t,
            "Processes ({} blocks; kernel names from {}, user names from {}):",
            n(self.blocks as u64),
            self.kernel_symbols.as_deref().unwrap_or("nowhere"),
            self.user_symbols.as_deref().unwrap_or("nowhere"),
        );
        let _ = writeln!(
            t,
            "  {:>7} {:<18} {:>16} {:>7} {:>16} {:>14} {:>7} {:>12} {:>7}",
            "pid",
            "comm",
            "instructions",
            "share",
            "kernel part",
            "L1D misses",
            "share",
            "LL misses",
            "share"
        );
        let p = |v: f64| format!("{:.2}%", v * 100.0);
        let line = |t: &mut String, pid: &str, comm: &str, r: [u64; 4], s: [f64; 3]| {
            let _ = writeln!(
                t,
                "  {:>7} {:<18} {:>16} {:>7} {:>16} {:>14} {:>7} {:>12} {:>7}",
                pid,
                comm,
                n(r[0]),
                p(s[0]),
                n(r[1]),
                n(r[2]),
                p(s[1]),
                n(r[3]),
                p(s[2])
            );
        };
        for r in self.processes.iter().take(top) {
            line(
                &mut t,
                &r.pid.map_or("-".to_string(), |p| p.to_string()),
                &r.comm,
                [
                    r.instructions,
                    r.kernel_instructions,
                    r.l1d_misses,
                    r.ll_misses,
                ],
                [r.instruction_share, r.l1d_share, r.ll_share],
            );
        }
        let rest = &self.processes[self.processes.len().min(top)..];
        if !rest.is_empty() {
            let sum = |f: &dyn Fn(&ProcessRow) -> u64| rest.iter().map(f).sum::<u64>();
            let sumf = |f: &dyn Fn(&ProcessRow) -> f64| rest.iter().map(f).sum::<f64>();
            line(
                &mut t,
                "",
                &format!("({} more rows)", rest.len()),
                [
                    sum(&|r| r.instructions),
                    sum(&|r| r.kernel_instructions),
                    sum(&|r| r.l1d_misses),
                    sum(&|r| r.ll_misses),
                ],
                [
                    sumf(&|r| r.instruction_share),
                    sumf(&|r| r.l1d_share),
                    sumf(&|r| r.ll_share),
                ],
            );
        }
        let _ = writeln!(
            t,
            "  Cachegrind totals {} the simulation's counters; files {CACHEGRIND_NAME}, {FOLDED_NAME}, {FLAME_NAME}, {FOLDED_L1D_NAME}, {FLAME_L1D_NAME}",
            if self.totals_match_counters { "equal" } else { "DIFFER FROM" }
        );
        t
    }
}

/// The `desc:` lines: each cache as Cachegrind describes its own.
fn desc(c: &Counters) -> Vec<String> {
    let line = c
        .options
        .iter()
        .find(|(k, _)| k == "line_size")
        .map_or("?", |(_, v)| v.as_str());
    c.caches
        .iter()
        .map(|cc| {
            format!(
                "{} cache: {} B, {line} B, {}-way associative",
                cc.name, cc.size, cc.assoc
            )
        })
        .collect()
}

/// Reads [`crate::BLOCKS_NAME`] in `out` (`Ok(None)`: the run did not attribute).
pub fn read_blocks(out: &Path) -> Result<Option<Vec<Block>>, String> {
    let path = out.join(crate::BLOCKS_NAME);
    if std::fs::symlink_metadata(&path).is_err() {
        return Ok(None);
    }
    let text = host_daemon::resolve::read_output_text(&path, MAX_BLOCKS_BYTES)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    attr::parse(&text)
        .map(Some)
        .map_err(|l| format!("{}: line {l} is not what cachesim writes", path.display()))
}

/// A run's calling contexts and its events per task and context.
pub type Stacks = (Vec<Context>, Vec<Stacked>);

/// Reads [`crate::CONTEXTS_NAME`] and [`crate::STACKS_NAME`] in `out` (`Ok(None)`: the
/// run kept no call stacks).
pub fn read_stacks(out: &Path) -> Result<Option<Stacks>, String> {
    let read = |name: &str| {
        let path = out.join(name);
        if std::fs::symlink_metadata(&path).is_err() {
            return Ok(None);
        }
        host_daemon::resolve::read_output_text(&path, MAX_BLOCKS_BYTES)
            .map(|t| Some((path.clone(), t)))
            .map_err(|e| format!("{}: {e}", path.display()))
    };
    let (Some((cpath, ctext)), Some((spath, stext))) =
        (read(crate::CONTEXTS_NAME)?, read(crate::STACKS_NAME)?)
    else {
        return Ok(None);
    };
    let bad = |p: &Path, l: usize| format!("{}: line {l} is not what cachesim writes", p.display());
    let contexts = attr::parse_contexts(&ctext).map_err(|l| bad(&cpath, l))?;
    let stacked = attr::parse_stacked(&stext, contexts.len()).map_err(|l| bad(&spath, l))?;
    Ok(Some((contexts, stacked)))
}

/// Writes the Cachegrind file, the folded stacks and the flame graphs of `made` in
/// `out`; returns the files written.
pub fn write_files(made: &Made, counters: &Counters, out: &Path) -> Result<Vec<PathBuf>, String> {
    let mut written = Vec::new();
    let mut write = |name: &str, data: &[u8]| {
        let p = out.join(name);
        host_daemon::resolve::write_output_file(&p, data)
            .map_err(|e| format!("{}: {e}", p.display()))?;
        written.push(p);
        Ok::<(), String>(())
    };
    let opts: Vec<String> = counters
        .options
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    let mut cg = Vec::new();
    made.profile
        .write_cachegrind(
            &mut cg,
            &desc(counters),
            &format!(
                "kpin run --tool cachesim (the whole guest; {})",
                opts.join(" ")
            ),
        )
        .map_err(|e| e.to_string())?;
    write(CACHEGRIND_NAME, &cg)?;
    for (folded, folded_name, svg_name, title, count) in [
        (
            &made.folded,
            FOLDED_NAME,
            FLAME_NAME,
            "cachesim: instructions by process, object, callers and function",
            "instructions",
        ),
        (
            &made.folded_l1d,
            FOLDED_L1D_NAME,
            FLAME_L1D_NAME,
            "cachesim: L1D misses by process, object, callers and function",
            "L1D misses",
        ),
    ] {
        let mut text = Vec::new();
        folded.write(&mut text).map_err(|e| e.to_string())?;
        write(folded_name, &text)?;
        if folded.stacks.is_empty() {
            // Nothing to draw (no L1D miss): inferno draws only an error.
            continue;
        }
        let svg = folded
            .flame_graph_svg(title, count)
            .map_err(|e| format!("{svg_name}: {e}"))?;
        write(svg_name, &svg)?;
    }
    Ok(written)
}
