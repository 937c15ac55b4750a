//! The host-side report of a `--tool bbcount` run (feature `host`): from the tool's
//! `bbcount.csv`, the guest instructions executed per virtual CPL (the user/kernel split),
//! the hottest blocks by instructions executed (count × block length) — kernel blocks
//! named `symbol+0xoff` by the caller's [`BlockNames`] (the VMM passes the kernel's
//! symbols), user blocks `object: function+0xoff` by its [`UserNames`] (from each block's
//! physical address) — the instructions per function for kernel and user code, what share
//! of user instructions is named with a file and with a function, and the per-process
//! table of `processes.json`. Written as [`REPORT_NAME`] beside the CSV; its
//! [`BbcountSummary`] also goes into `run.json`.

use std::collections::HashMap;
use std::fmt::Write;
use std::path::{Path, PathBuf};

use anyhow::Context;
use kpin_tool::host_side::{function_of, storage_failure, HostTool, Reported, RunFiles, UserNames};
use kpin_tool::profile_out::{Folded, Profile};
use serde::Serialize;

use crate::{parse_csv, Row, CSV_NAME};
pub use kpin_tool::processes::{ProcessRow, Processes};

/// The report's file name in the output directory.
pub const REPORT_NAME: &str = "bbcount-report.txt";
/// The instructions per object and function in the Cachegrind format (one event, `Ir`),
/// for `cg_annotate` and KCachegrind (`docs/profiles.md`).
pub const CACHEGRIND_NAME: &str = "cachegrind.out.bbcount";
/// The same as folded stacks, `object;function count` (`[kernel]` for the kernel's code).
pub const FOLDED_NAME: &str = "bbcount.folded";
/// The flame graph of [`FOLDED_NAME`] (inferno), its root the instructions counted.
pub const FLAME_NAME: &str = "bbcount-flamegraph.svg";
/// The object kernel code is listed under in [`CACHEGRIND_NAME`] and [`FOLDED_NAME`].
const KERNEL_OBJECT: &str = "[kernel]";
/// Largest `bbcount.csv` the report reads (the daemon's default output limit is 1 GiB).
pub const MAX_CSV_BYTES: u64 = 256 << 20;
/// Names for block addresses: a symbol table, and where it came from (the tool API's).
pub use kpin_tool::host_side::BlockNames;
/// Hottest blocks listed unless told otherwise (`kpin run --top`).
pub use kpin_tool::host_side::DEFAULT_TOP;

/// One block of the hottest list.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct HotBlock {
    /// Guest virtual address of its first instruction (`0x…`).
    pub address: String,
    /// Guest physical address of its first instruction (`0x…`; `None`: not recorded).
    pub physical: Option<String>,
    /// Virtual CPL it ran at.
    pub cpl: u8,
    /// `symbol+0xoff` (kernel), `object: function+0xoff` or `object+0xoff` (user), if
    /// anything names it.
    pub symbol: Option<String>,
    /// Its length in instructions.
    pub instructions: u32,
    /// Times it ran.
    pub count: u64,
    /// Guest instructions it executed: `count × instructions`.
    pub executed: u64,
}

/// What the report says, as `run.json` carries it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct BbcountSummary {
    /// Guest instructions executed in counted blocks, all CPLs.
    pub total: u64,
    /// … at virtual CPL 0 (kernel).
    pub cpl0: u64,
    /// … at virtual CPL 3 (user).
    pub cpl3: u64,
    /// Rows of `bbcount.csv` (translated blocks).
    pub blocks: usize,
    /// Where block names come from, if anywhere.
    pub symbols: Option<String>,
    /// Where user code's names come from, if anywhere.
    pub user_symbols: Option<String>,
    /// User instructions (CPL 3, counted blocks) whose code a file is named for.
    pub user_named_object: u64,
    /// … and a function of that file.
    pub user_named_function: u64,
    /// `user_named_object` / `cpl3` (0 without user instructions).
    pub user_object_share: f64,
    /// `user_named_function` / `cpl3`.
    pub user_function_share: f64,
    /// The hottest blocks, hottest first.
    pub top: Vec<HotBlock>,
    /// Kernel functions by instructions executed, most first (`?`: unnamed).
    pub kernel_functions: Vec<FunctionRow>,
    /// User functions (`object: function`, `object` alone, or `?`) likewise.
    pub user_functions: Vec<FunctionRow>,
    /// The engine's per-process table, if the run wrote one.
    pub processes: Option<Processes>,
    /// Rows the text's tables show (`kpin run --top`).
    #[serde(skip)]
    shown: usize,
    /// Every block's instructions per object and function: [`CACHEGRIND_NAME`].
    #[serde(skip)]
    pub cachegrind: Profile,
    /// The same as `object;function` stacks: [`FOLDED_NAME`] and [`FLAME_NAME`].
    #[serde(skip)]
    pub folded: Folded,
}

/// One function of a per-function table.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FunctionRow {
    /// Its name.
    pub function: String,
    /// Guest instructions executed in its blocks.
    pub executed: u64,
}

/// The `top` functions of `(name, executed)` pairs, by their summed instructions.
fn by_function(named: &[(Option<String>, u64)], top: usize) -> Vec<FunctionRow> {
    let mut sums: HashMap<&str, u64> = HashMap::new();
    for (name, executed) in named {
        let f = name.as_deref().map_or("?", function_of);
        let e = sums.entry(f).or_default();
        *e = e.saturating_add(*executed);
    }
    let mut rows: Vec<FunctionRow> = sums
        .into_iter()
        .map(|(f, executed)| FunctionRow {
            function: f.to_string(),
            executed,
        })
        .collect();
    rows.sort_by(|a, b| {
        b.executed
            .cmp(&a.executed)
            .then(a.function.cmp(&b.function))
    });
    rows.truncate(top);
    rows
}

impl BbcountSummary {
    /// Sums `rows` per CPL and picks the `top` hottest blocks, kernel blocks named by
    /// `symbols`. Rows of one block translated more than once (same addresses, CPL and
    /// length: in two traces, or again after a cache flush) are added together.
    pub fn new(rows: &[Row], symbols: Option<&dyn BlockNames>, top: usize) -> Self {
        Self::named(rows, symbols, None, top)
    }

    /// [`BbcountSummary::new`] with user blocks named by `user` from their physical
    /// addresses, and user functions' table and named shares.
    pub fn named(
        rows: &[Row],
        symbols: Option<&dyn BlockNames>,
        user: Option<&dyn UserNames>,
        top: usize,
    ) -> Self {
        // The CSV comes from inside the guest: sums and products saturate at u64::MAX
        // instead of wrapping (a count of 2^63 once made the report say "executed 0").
        let executed = |r: &Row| r.count.saturating_mul(u64::from(r.instructions));
        let sum = |it: &mut dyn Iterator<Item = u64>| it.fold(0u64, u64::saturating_add);
        let at = |cpl| sum(&mut rows.iter().filter(|r| r.cpl == cpl).map(executed));
        let mut merged: HashMap<(u64, u64, u8, u32), u64> = HashMap::new();
        for r in rows {
            let c = merged
                .entry((r.address, r.physical, r.cpl, r.instructions))
                .or_default();
            *c = c.saturating_add(r.count);
        }
        let mut blocks: Vec<_> = merged.into_iter().collect();
        // Hottest first; ties in address order so the report is stable.
        blocks.sort_by_key(|&((address, physical, cpl, insns), count)| {
            (
                std::cmp::Reverse(count.saturating_mul(u64::from(insns))),
                address,
                physical,
                cpl,
                insns,
            )
        });
        // Every block named once: its function for the tables, the top list's names.
        let (mut kernel_named, mut user_named) = (Vec::new(), Vec::new());
        let (mut user_named_object, mut user_named_function) = (0u64, 0u64);
        let mut names = Vec::with_capacity(blocks.len());
        let mut cachegrind = Profile::new(&["Ir"]);
        let mut folded = Folded::default();
        let mut profile = |object: &str, function: Option<&str>, executed: u64| {
            let function = function.map_or("?", function_of);
            cachegrind.add(object, function, &[executed]);
            folded.add(&[object, function], executed);
        };
        for &((address, physical, cpl, insns), count) in &blocks {
            let executed = count.saturating_mul(u64::from(insns));
            let name = if cpl == 3 {
                let code = user.and_then(|u| (physical != 0).then(|| u.name(physical)).flatten());
                match &code {
                    Some(c) => profile(&c.object, c.function.as_deref(), executed),
                    None => profile("[user]", None, executed),
                }
                let object = code.as_ref().filter(|c| c.object != "[anon]");
                if object.is_some() {
                    user_named_object = user_named_object.saturating_add(executed);
                }
                if object.is_some_and(|c| c.function.is_some()) {
                    user_named_function = user_named_function.saturating_add(executed);
                }
                let name = code.map(|c| match c.function {
                    Some(f) => format!("{}: {f}", c.object),
                    None => format!("{}+{:#x}", c.object, c.offset),
                });
                user_named.push((name.clone(), executed));
                name
            } else {
                let name = symbols.and_then(|s| s.name(address));
                profile(KERNEL_OBJECT, name.as_deref(), executed);
                kernel_named.push((name.clone(), executed));
                name
            };
            names.push(name);
        }
        let top_blocks = blocks
            .into_iter()
            .zip(names)
            .take(top)
            .map(
                |(((address, physical, cpl, instructions), count), symbol)| HotBlock {
                    address: format!("{address:#x}"),
                    physical: (physical != 0).then(|| format!("{physical:#x}")),
                    cpl,
                    symbol,
                    instructions,
                    count,
                    executed: count.saturating_mul(u64::from(instructions)),
                },
            )
            .collect();
        let cpl3 = at(3);
        let share = |n: u64| {
            if cpl3 == 0 {
                0.0
            } else {
                n as f64 / cpl3 as f64
            }
        };
        BbcountSummary {
            total: sum(&mut rows.iter().map(executed)),
            cpl0: at(0),
            cpl3,
            blocks: rows.len(),
            symbols: symbols.map(|s| s.source()),
            user_symbols: user.map(|u| u.source()),
            user_named_object,
            user_named_function,
            user_object_share: share(user_named_object),
            user_function_share: share(user_named_function),
            top: top_blocks,
            kernel_functions: match symbols {
                Some(_) => by_function(&kernel_named, top),
                None => Vec::new(),
            },
            // An object's bare offset is not a function: the object is its own line.
            user_functions: match user {
                Some(_) => by_function(&user_named, top),
                None => Vec::new(),
            },
            processes: None,
            shown: top,
            cachegrind,
            folded,
        }
    }

    /// The report's text.
    pub fn render(&self) -> String {
        let pct = |n: u64| {
            if self.total == 0 {
                0.0
            } else {
                100.0 * n as f64 / self.total as f64
            }
        };
        let mut t = String::new();
        let _ = writeln!(
            t,
            "bbcount: {} guest instructions executed in counted blocks ({} blocks translated)",
            self.total, self.blocks
        );
        let _ = writeln!(
            t,
            "  kernel (CPL 0): {:>14} {:6.2}%",
            self.cpl0,
            pct(self.cpl0)
        );
        let _ = writeln!(
            t,
            "  user   (CPL 3): {:>14} {:6.2}%",
            self.cpl3,
            pct(self.cpl3)
        );
        let _ = writeln!(
            t,
            "  user code named: {:.2}% of user instructions with a file, {:.2}% with a function ({})",
            100.0 * self.user_object_share,
            100.0 * self.user_function_share,
            self.user_symbols.as_deref().unwrap_or("no user names")
        );
        let _ = writeln!(
            t,
            "hottest {} blocks by instructions executed (count x length); names from {}:",
            self.top.len(),
            self.symbols.as_deref().unwrap_or("nowhere (no symbols)")
        );
        let _ = writeln!(
            t,
            "  {:>3}  {:<18} {:>3} {:>12} {:>7} {:>10} {:>5}  symbol",
            "#", "address", "cpl", "executed", "%", "count", "insns"
        );
        for (i, b) in self.top.iter().enumerate() {
            let _ = writeln!(
                t,
                "  {:>3}  {:<18} {:>3} {:>12} {:>6.2}% {:>10} {:>5}  {}",
                i + 1,
                b.address,
                b.cpl,
                b.executed,
                pct(b.executed),
                b.count,
                b.instructions,
                b.symbol.as_deref().unwrap_or("?")
            );
        }
        for (what, rows) in [
            ("kernel", &self.kernel_functions),
            ("user", &self.user_functions),
        ] {
            if rows.is_empty() {
                continue;
            }
            let _ = writeln!(t, "{what} functions by instructions executed:");
            for (i, f) in rows.iter().enumerate() {
                let _ = writeln!(
                    t,
                    "  {:>3}  {:>12} {:>6.2}%  {}",
                    i + 1,
                    f.executed,
                    pct(f.executed),
                    f.function
                );
            }
        }
        if let Some(p) = &self.processes {
            t.push_str(&p.render(self.shown));
        }
        let _ = writeln!(
            t,
            "per function, kernel and user: {CACHEGRIND_NAME} (cg_annotate), {FOLDED_NAME}, {FLAME_NAME}"
        );
        t
    }
}

/// `<out>/bbcount.csv`'s rows; `Ok(None)` if the run wrote no CSV. (Also what a
/// [`BlockNames`] can calibrate on: the addresses that ran, e.g. to find a KASLR slide.)
pub fn read_rows(out: &Path) -> anyhow::Result<Option<Vec<Row>>> {
    let csv_path = out.join(CSV_NAME);
    if std::fs::symlink_metadata(&csv_path).is_err() {
        return Ok(None);
    }
    // Not through a symlink, and not without bound.
    let csv = host_daemon::resolve::read_output_text(&csv_path, MAX_CSV_BYTES)
        .with_context(|| format!("cannot read {}", csv_path.display()))?;
    let rows = parse_csv(&csv).map_err(|line| {
        anyhow::anyhow!("{} line {line} is not bbcount's format", csv_path.display())
    })?;
    Ok(Some(rows))
}

/// After a `--tool bbcount` run: reads `<out>/bbcount.csv` and writes
/// `<out>/bbcount-report.txt`, kernel blocks named by `symbols`, user blocks by `user`,
/// with the run's `processes` table. `Ok(None)` if the run wrote no CSV (another tool,
/// or the engine stopped before the tool finished).
pub fn write_report(
    out: &Path,
    symbols: Option<&dyn BlockNames>,
    user: Option<&dyn UserNames>,
    processes: Option<Processes>,
    top: usize,
) -> anyhow::Result<Option<(BbcountSummary, PathBuf)>> {
    let Some(rows) = read_rows(out)? else {
        return Ok(None);
    };
    let mut summary = BbcountSummary::named(&rows, symbols, user, top);
    summary.processes = processes;
    let write = |name: &str, bytes: &[u8]| {
        let path = out.join(name);
        host_daemon::resolve::write_output_file(&path, bytes)
            .with_context(|| format!("cannot write {}", path.display()))
    };
    let mut cachegrind = Vec::new();
    let desc = [String::from(
        "kpin bbcount: guest instructions executed per function, kernel and user",
    )];
    summary
        .cachegrind
        .write_cachegrind(&mut cachegrind, &desc, "kpin run --tool bbcount")?;
    write(CACHEGRIND_NAME, &cachegrind)?;
    let mut folded = Vec::new();
    summary.folded.write(&mut folded)?;
    write(FOLDED_NAME, &folded)?;
    let svg = summary
        .folded
        .flame_graph_svg("kpin bbcount: guest instructions", "instructions")?;
    write(FLAME_NAME, &svg)?;
    let path = out.join(REPORT_NAME);
    write(REPORT_NAME, summary.render().as_bytes())?;
    Ok(Some((summary, path)))
}

/// bbcount's host-side part (the registry's): after a run, [`REPORT_NAME`] from the CSV,
/// its kernel blocks named from the kernel's symbols (the KASLR slide found from where the
/// kernel's blocks ran), its user blocks from the guest's files, the per-process table
/// from `processes.json`, and the [`BbcountSummary`] as `run.json`'s `bbcount`.
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
        &[REPORT_NAME, CACHEGRIND_NAME, FOLDED_NAME, FLAME_NAME]
    }

    fn report(&self, run: &mut RunFiles<'_>) -> Reported {
        // Only a finished CSV is a result.
        if run.is_unfinished(CSV_NAME) || !run.dir.join(CSV_NAME).exists() {
            return Reported::default();
        }
        let out = run.dir;
        let kernel = match read_rows(out) {
            Ok(Some(rows)) => run.names(rows.iter().filter(|r| r.cpl == 0).map(|r| r.address)),
            _ => run.names(core::iter::empty()),
        };
        // Without user names or processes the report is still made: said, left out.
        let user = run.user_code().unwrap_or_else(|e| {
            run.say(&format!("bbcount: user code unnamed: {e:#}"));
            None
        });
        let processes = if run.is_unfinished(kpin_abi::output::ENGINE_PROCESSES) {
            None
        } else {
            Processes::read(out).unwrap_or_else(|e| {
                run.say(&format!("bbcount: no per-process table: {e}"));
                None
            })
        };
        let made = kernel.and_then(|names| {
            write_report(out, names.as_deref(), user.as_deref(), processes, run.top)
        });
        match made {
            Ok(Some((summary, path))) => {
                run.say(&format!("{}:\n{}", path.display(), summary.render()));
                Reported {
                    run_json: Some(Box::new(summary)),
                    failure: None,
                }
            }
            Ok(None) => Reported::default(),
            Err(e) => {
                run.say(&format!("no bbcount report: {e:#}"));
                let failure = e
                    .chain()
                    .find_map(|c| c.downcast_ref::<std::io::Error>())
                    .and_then(|io| storage_failure(&out.join(REPORT_NAME), io));
                Reported {
                    run_json: None,
                    failure,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The report the VMM writes after a bbcount run is declared, so that the daemon
    /// refuses it to the guest.
    #[test]
    fn test_the_report_file_is_declared_for_the_daemon_to_reserve() {
        assert_eq!(
            Host.report_files(),
            &[REPORT_NAME, CACHEGRIND_NAME, FOLDED_NAME, FLAME_NAME]
        );
        let dir = std::env::temp_dir().join(format!("kpin-bbcount-reserve-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut d = host_daemon::Daemon::new(&dir);
        d.reserve(Host.report_files());
        assert!(!d.write_host_file(REPORT_NAME, b"x"), "refused");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn row(address: u64, cpl: u8, instructions: u32, count: u64) -> Row {
        Row {
            address,
            cpl,
            instructions,
            count,
            physical: 0,
        }
    }

    /// User code: frame 0x5000 holds page 0x2000 of /bin/prog, whose `main` covers file
    /// offsets 0x2000..0x2100 and `helper` 0x2100..0x2200; frame 0x6000 is a stripped
    /// /lib/libx.so; frame 0x7000 anonymous memory.
    struct TestUserNames;

    impl UserNames for TestUserNames {
        fn source(&self) -> String {
            "test objects".into()
        }
        fn name(&self, pa: u64) -> Option<kpin_tool::host_side::UserCode> {
            let (object, offset) = match pa & !0xfff {
                0x5000 => ("/bin/prog", 0x2000 + (pa & 0xfff)),
                0x6000 => ("/lib/libx.so", 0x9000 + (pa & 0xfff)),
                0x7000 => ("[anon]", 0),
                _ => return None,
            };
            let function = (object == "/bin/prog").then(|| match offset {
                o if o < 0x2100 => format!("main+{:#x}", o - 0x2000),
                o => format!("helper+{:#x}", o - 0x2100),
            });
            Some(kpin_tool::host_side::UserCode {
                object: object.into(),
                offset,
                function,
            })
        }
    }

    #[test]
    fn test_user_blocks_named_by_physical_address_with_shares_and_tables() {
        let user = |va: u64, pa: u64, insns: u32, count: u64| Row {
            physical: pa,
            ..row(va, 3, insns, count)
        };
        let rows = [
            user(0x40_1010, 0x5010, 10, 60),  // 600 main
            user(0x40_1120, 0x5120, 5, 40),   // 200 helper
            user(0x40_1010, 0x8010, 10, 10),  // 100 the same VA, other code: no origin
            user(0x7f00_0000, 0x6040, 2, 25), // 50 libx (no function)
            user(0x7f10_0000, 0x7000, 1, 50), // 50 anonymous
            row(0xffff_ffff_8100_0004, 0, 1, 1000),
        ];
        let s = BbcountSummary::named(&rows, Some(&TestSymbols), Some(&TestUserNames), 10);
        assert_eq!(
            (s.cpl3, s.user_named_object, s.user_named_function),
            (1000, 850, 800)
        );
        assert_eq!((s.user_object_share, s.user_function_share), (0.85, 0.8));
        let named: Vec<(&str, Option<&str>, Option<&str>)> = s
            .top
            .iter()
            .map(|b| {
                (
                    b.address.as_str(),
                    b.physical.as_deref(),
                    b.symbol.as_deref(),
                )
            })
            .collect();
        assert_eq!(
            &named[..4],
            [
                ("0xffffffff81000004", None, Some("do_syscall_64+0x4")),
                ("0x401010", Some("0x5010"), Some("/bin/prog: main+0x10")),
                ("0x401120", Some("0x5120"), Some("/bin/prog: helper+0x20")),
                ("0x401010", Some("0x8010"), None),
            ]
        );
        assert!(named.contains(&("0x7f000000", Some("0x6040"), Some("/lib/libx.so+0x9040"))));
        let table: Vec<(&str, u64)> = s
            .user_functions
            .iter()
            .map(|f| (f.function.as_str(), f.executed))
            .collect();
        assert_eq!(
            table,
            [
                ("/bin/prog: main", 600),
                ("/bin/prog: helper", 200),
                ("?", 100),
                ("/lib/libx.so", 50),
                ("[anon]", 50),
            ]
        );
        assert_eq!(s.kernel_functions[0].function, "do_syscall_64");
        let text = s.render();
        assert!(
            text.contains("  user code named: 85.00% of user instructions with a file, 80.00% with a function (test objects)\n"),
            "{text}"
        );
        assert!(text.contains("user functions by instructions executed:\n    1           600  30.00%  /bin/prog: main\n"), "{text}");
        assert!(
            text.contains("kernel functions by instructions executed:\n"),
            "{text}"
        );
        // run.json carries the same.
        let json = serde_json::to_value(&s).unwrap();
        assert_eq!(json["user_function_share"], 0.8);
        assert_eq!(json["user_functions"][0]["function"], "/bin/prog: main");
        assert_eq!(json["top"][1]["physical"], "0x5010");
    }

    #[test]
    fn test_the_process_table_goes_into_the_report_and_run_json() {
        let dir = std::env::temp_dir().join(format!("kpin-report-proc-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join(CSV_NAME),
            format!("{}\n0x401000,3,2,5,0x5000\n", crate::CSV_HEADER),
        )
        .unwrap();
        std::fs::write(
            dir.join(kpin_abi::output::ENGINE_PROCESSES),
            r#"{"by":"task","user_instructions":10,"kernel_instructions":4,"processes":[
            {"kind":"boot","pid":null,"comm":null,"cr3":"0x0","user_instructions":0,"kernel_instructions":4},
            {"kind":"task","pid":1,"comm":"init","exe":"busybox","cr3":"0x1000","user_instructions":10,"kernel_instructions":0}]}"#,
        )
        .unwrap();
        let processes = Processes::read(&dir).unwrap();
        let (s, path) = write_report(&dir, None, Some(&TestUserNames), processes, 5)
            .unwrap()
            .unwrap();
        let text = std::fs::read_to_string(path).unwrap();
        assert!(text.contains("processes (processes.json, by task): 2 rows; 10 user + 4 kernel instructions, the rows sum to both exactly\n"), "{text}");
        assert!(text.contains("/bin/prog: main+0x0"), "{text}");
        let json = serde_json::to_value(&s).unwrap();
        assert_eq!(json["processes"]["rows"][0]["comm"], "init");
        assert_eq!(json["processes"]["rows"][0]["user_instructions"], 10);
        assert_eq!(json["processes"]["rows_sum_to_totals"], true);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Kernel symbols at 0xffffffff81000000 and 0xffffffff81000100, each naming the
    /// addresses from it up to the next.
    struct TestSymbols;

    impl BlockNames for TestSymbols {
        fn source(&self) -> String {
            "System.map test".into()
        }
        fn name(&self, addr: u64) -> Option<String> {
            [
                (0xffff_ffff_8100_0100, "entry_SYSCALL_64"),
                (0xffff_ffff_8100_0000, "do_syscall_64"),
            ]
            .into_iter()
            .find(|&(start, _)| start <= addr)
            .map(|(start, name)| format!("{name}+{:#x}", addr - start))
        }
    }

    #[test]
    fn test_split_and_hottest_blocks_named_from_symbols() {
        let rows = [
            row(0xffff_ffff_8100_003a, 0, 4, 1000), // 4000
            row(0x40_1000, 3, 10, 150),             // 1500 (user: no kernel symbol)
            row(0xffff_ffff_8100_0100, 0, 2, 400),  // 800 + 800 below: 1600
            row(0xffff_ffff_8100_0100, 0, 2, 400),  // retranslated
            row(0xffff_ffff_8100_0100, 0, 3, 10),   // a longer block at that address: 30
            row(0x40_2000, 3, 1, 0),                // never ran
        ];
        let s = BbcountSummary::new(&rows, Some(&TestSymbols), 3);
        assert_eq!((s.total, s.cpl0, s.cpl3, s.blocks), (7130, 5630, 1500, 6));
        assert_eq!(s.symbols.as_deref(), Some("System.map test"));
        let top: Vec<_> = s
            .top
            .iter()
            .map(|b| {
                (
                    b.address.as_str(),
                    b.cpl,
                    b.symbol.as_deref(),
                    b.count,
                    b.executed,
                )
            })
            .collect();
        assert_eq!(
            top,
            [
                (
                    "0xffffffff8100003a",
                    0,
                    Some("do_syscall_64+0x3a"),
                    1000,
                    4000
                ),
                (
                    "0xffffffff81000100",
                    0,
                    Some("entry_SYSCALL_64+0x0"),
                    800,
                    1600
                ),
                ("0x401000", 3, None, 150, 1500),
            ]
        );

        let text = s.render();
        assert!(
            text.starts_with(
                "bbcount: 7130 guest instructions executed in counted blocks (6 blocks translated)\n"
            ),
            "{text}"
        );
        assert!(
            text.contains("  kernel (CPL 0):           5630  78.96%\n"),
            "{text}"
        );
        assert!(
            text.contains("  user   (CPL 3):           1500  21.04%\n"),
            "{text}"
        );
        assert!(
            text.contains("hottest 3 blocks by instructions executed (count x length); names from System.map test:"),
            "{text}"
        );
        assert!(
            text.contains("  user code named: 0.00% of user instructions with a file, 0.00% with a function (no user names)\n"),
            "{text}"
        );
        let first = text.lines().nth(6).unwrap();
        assert_eq!(
            first.split_whitespace().collect::<Vec<_>>(),
            [
                "1",
                "0xffffffff8100003a",
                "0",
                "4000",
                "56.10%",
                "1000",
                "4",
                "do_syscall_64+0x3a"
            ],
            "{text}"
        );
        assert!(text.lines().nth(8).unwrap().ends_with("  ?"), "{text}");
        let kernel: Vec<(&str, u64)> = s
            .kernel_functions
            .iter()
            .map(|f| (f.function.as_str(), f.executed))
            .collect();
        assert_eq!(
            kernel,
            [("do_syscall_64", 4000), ("entry_SYSCALL_64", 1630)]
        );
        assert!(s.user_functions.is_empty(), "no user names");
    }

    #[test]
    fn test_forged_huge_counts_saturate_instead_of_wrapping() {
        let rows = [
            row(0x1000, 0, 2, 1 << 63),
            row(0x1000, 0, 2, 1 << 63),
            row(0x2000, 3, 1, 5),
        ];
        let s = BbcountSummary::new(&rows, None, 2);
        assert_eq!((s.total, s.cpl0, s.cpl3), (u64::MAX, u64::MAX, 5));
        assert_eq!((s.top[0].count, s.top[0].executed), (u64::MAX, u64::MAX));
        assert!(s.render().contains(&u64::MAX.to_string()));
    }

    #[test]
    fn test_empty_csv_and_no_symbols() {
        let s = BbcountSummary::new(&[], None, DEFAULT_TOP);
        assert_eq!((s.total, s.cpl0, s.cpl3, s.blocks), (0, 0, 0, 0));
        assert!(s.top.is_empty());
        let text = s.render();
        assert!(
            text.contains("  kernel (CPL 0):              0   0.00%"),
            "{text}"
        );
        assert!(text.contains("names from nowhere (no symbols)"), "{text}");
    }

    #[test]
    fn test_write_report_reads_the_csv_and_writes_the_file() {
        let dir = std::env::temp_dir().join(format!("kpin-report-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert!(
            write_report(&dir, None, None, None, DEFAULT_TOP)
                .unwrap()
                .is_none(),
            "no CSV, no report"
        );

        std::fs::write(
            dir.join(CSV_NAME),
            "address,cpl,instructions,count,physical\n0xffffffff81000040,0,3,7,0x1000040\n0x401000,3,2,5,0x5000\n",
        )
        .unwrap();
        let (s, path) = write_report(&dir, Some(&TestSymbols), None, None, DEFAULT_TOP)
            .unwrap()
            .expect("a report");
        assert_eq!(path, dir.join(REPORT_NAME));
        assert_eq!((s.cpl0, s.cpl3), (21, 10));
        assert_eq!(std::fs::read_to_string(&path).unwrap(), s.render());
        assert_eq!(s.top[0].symbol.as_deref(), Some("do_syscall_64+0x40"));
        // The profiles: every instruction once, under its function (the kernel's) or `?`.
        assert_eq!(
            std::fs::read_to_string(dir.join(CACHEGRIND_NAME)).unwrap(),
            "desc: kpin bbcount: guest instructions executed per function, kernel and user\n\
             cmd: kpin run --tool bbcount\nevents: Ir\nfl=[kernel]\nfn=do_syscall_64\n0 21\n\
             fl=[user]\nfn=?\n0 10\nsummary: 31\n"
        );
        assert_eq!(
            std::fs::read_to_string(dir.join(FOLDED_NAME)).unwrap(),
            "[kernel];do_syscall_64 21\n[user];? 10\n"
        );
        let svg = std::fs::read_to_string(dir.join(FLAME_NAME)).unwrap();
        assert!(
            svg.starts_with("<?xml") && svg.contains("do_syscall_64"),
            "{svg:.200}"
        );

        std::fs::write(dir.join(CSV_NAME), "address,instructions,count\n0x10,1,1\n").unwrap();
        let e = write_report(&dir, None, None, None, DEFAULT_TOP)
            .unwrap_err()
            .to_string();
        assert!(
            e.ends_with("bbcount.csv line 1 is not bbcount's format"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
