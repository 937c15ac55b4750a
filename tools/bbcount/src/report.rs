//! The host-side report of a `--tool bbcount` run (feature `host`): from the tool's
//! `bbcount.csv`, the guest instructions executed per virtual CPL (the user/kernel split)
//! and the hottest blocks by instructions executed (count × block length), each named
//! `symbol+0xoff` by the caller's [`BlockNames`] (the VMM passes the kernel's symbols).
//! Written as [`REPORT_NAME`] beside the CSV; its [`BbcountSummary`] also goes into
//! `run.json`.

use std::collections::HashMap;
use std::fmt::Write;
use std::path::{Path, PathBuf};

use anyhow::Context;
use kpin_tool::host_side::{HostTool, Reported, RunFiles};
use serde::Serialize;

use crate::{parse_csv, Row, CSV_NAME};

/// The report's file name in the output directory.
pub const REPORT_NAME: &str = "bbcount-report.txt";
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
    /// Virtual CPL it ran at.
    pub cpl: u8,
    /// `symbol+0xoff`, if a symbol covers the address.
    pub symbol: Option<String>,
    /// Its length in instructions.
    pub instructions: u32,
    /// Times it ran.
    pub count: u64,
    /// Guest instructions it executed: `count × instructions`.
    pub executed: u64,
}

/// What the report says, as `run.json` carries it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
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
    /// The hottest blocks, hottest first.
    pub top: Vec<HotBlock>,
}

impl BbcountSummary {
    /// Sums `rows` per CPL and picks the `top` hottest blocks. Rows of one block
    /// translated more than once (same address, CPL and length: in two traces, or again
    /// after a cache flush) are added together.
    pub fn new(rows: &[Row], symbols: Option<&dyn BlockNames>, top: usize) -> Self {
        // The CSV comes from inside the guest: sums and products saturate at u64::MAX
        // instead of wrapping (a count of 2^63 once made the report say "executed 0").
        let executed = |r: &Row| r.count.saturating_mul(u64::from(r.instructions));
        let sum = |it: &mut dyn Iterator<Item = u64>| it.fold(0u64, u64::saturating_add);
        let at = |cpl| sum(&mut rows.iter().filter(|r| r.cpl == cpl).map(executed));
        let mut merged: HashMap<(u64, u8, u32), u64> = HashMap::new();
        for r in rows {
            let c = merged
                .entry((r.address, r.cpl, r.instructions))
                .or_default();
            *c = c.saturating_add(r.count);
        }
        let mut blocks: Vec<_> = merged.into_iter().collect();
        // Hottest first; ties in address order so the report is stable.
        blocks.sort_by_key(|&((address, cpl, insns), count)| {
            (
                std::cmp::Reverse(count.saturating_mul(u64::from(insns))),
                address,
                cpl,
                insns,
            )
        });
        let top = blocks
            .into_iter()
            .take(top)
            .map(|((address, cpl, instructions), count)| HotBlock {
                address: format!("{address:#x}"),
                cpl,
                symbol: symbols.and_then(|s| s.name(address)),
                instructions,
                count,
                executed: count.saturating_mul(u64::from(instructions)),
            })
            .collect();
        BbcountSummary {
            total: sum(&mut rows.iter().map(executed)),
            cpl0: at(0),
            cpl3: at(3),
            blocks: rows.len(),
            symbols: symbols.map(|s| s.source()),
            top,
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
/// `<out>/bbcount-report.txt`. `Ok(None)` if the run wrote no CSV (another tool, or the
/// engine stopped before the tool finished).
pub fn write_report(
    out: &Path,
    symbols: Option<&dyn BlockNames>,
    top: usize,
) -> anyhow::Result<Option<(BbcountSummary, PathBuf)>> {
    let Some(rows) = read_rows(out)? else {
        return Ok(None);
    };
    let summary = BbcountSummary::new(&rows, symbols, top);
    let path = out.join(REPORT_NAME);
    host_daemon::resolve::write_output_file(&path, summary.render().as_bytes())
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(Some((summary, path)))
}

/// bbcount's host-side part (the registry's): after a run, [`REPORT_NAME`] from the CSV,
/// its blocks named from the kernel's symbols (the KASLR slide found from where the
/// kernel's blocks ran), and the [`BbcountSummary`] as `run.json`'s `bbcount`.
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
        &[REPORT_NAME]
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
        let made = kernel.and_then(|names| write_report(out, names.as_deref(), run.top));
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
                // A host fault is an OS error (`is_host_fault` reads its number).
                let failure = e
                    .chain()
                    .find_map(|c| c.downcast_ref::<std::io::Error>())
                    .filter(|io| host_daemon::resolve::is_host_fault(io))
                    .and_then(std::io::Error::raw_os_error)
                    .map(|n| (out.join(REPORT_NAME), std::io::Error::from_raw_os_error(n)));
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
        assert_eq!(Host.report_files(), &[REPORT_NAME]);
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
        }
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
        let first = text.lines().nth(5).unwrap();
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
        assert!(text.lines().nth(7).unwrap().ends_with("  ?"), "{text}");
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
            write_report(&dir, None, DEFAULT_TOP).unwrap().is_none(),
            "no CSV, no report"
        );

        std::fs::write(
            dir.join(CSV_NAME),
            "address,cpl,instructions,count\n0xffffffff81000040,0,3,7\n0x401000,3,2,5\n",
        )
        .unwrap();
        let (s, path) = write_report(&dir, Some(&TestSymbols), DEFAULT_TOP)
            .unwrap()
            .expect("a report");
        assert_eq!(path, dir.join(REPORT_NAME));
        assert_eq!((s.cpl0, s.cpl3), (21, 10));
        assert_eq!(std::fs::read_to_string(&path).unwrap(), s.render());
        assert_eq!(s.top[0].symbol.as_deref(), Some("do_syscall_64+0x40"));

        std::fs::write(dir.join(CSV_NAME), "address,instructions,count\n0x10,1,1\n").unwrap();
        let e = write_report(&dir, None, DEFAULT_TOP)
            .unwrap_err()
            .to_string();
        assert!(
            e.ends_with("bbcount.csv line 1 is not bbcount's format"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
