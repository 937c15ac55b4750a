//! The host-side report of a `--tool bbcount` run: from the tool's `bbcount.csv`, the
//! guest instructions executed per virtual CPL (the user/kernel split) and the hottest
//! blocks by instructions executed (count × block length), each named `symbol+0xoff`
//! from the kernel's symbols. Written as [`REPORT_NAME`] beside the CSV; its
//! [`BbcountSummary`] also goes into `run.json`.

use std::collections::HashMap;
use std::fmt::Write;
use std::path::{Path, PathBuf};

use anyhow::Context;
use kpin_tool_bbcount::{parse_csv, Row, CSV_NAME};
use serde::Serialize;

use crate::symbols::Symbols;

/// The report's file name in the output directory.
pub const REPORT_NAME: &str = "bbcount-report.txt";
/// Largest `bbcount.csv` the report reads (the daemon's default output limit is 1 GiB).
pub const MAX_CSV_BYTES: u64 = 256 << 20;
/// Hottest blocks listed unless told otherwise.
pub const DEFAULT_TOP: usize = 20;

/// A kernel's symbols and where they came from.
pub struct KernelSymbols {
    /// The table.
    pub symbols: Symbols,
    /// Where it came from, for the report (`System.map …`, `ELF symbol table of …`).
    pub source: String,
    /// The kernel ELF's segments linked at a virtual address other than their physical
    /// one: code that runs before paging is on (Linux's `startup_64` at 0x1000000 for
    /// 0xffffffff81000000) executes at the physical address.
    aliases: Vec<PhysAlias>,
}

/// A `PT_LOAD` segment whose physical range `[pa, pa + len)` is also its virtual range
/// at `va`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct PhysAlias {
    pa: u64,
    va: u64,
    len: u64,
}

/// The `PT_LOAD` segments of a little-endian ELF64 `kernel` with `p_paddr != p_vaddr`
/// (nothing for a bzImage or an unreadable file: names are a convenience). Reads only
/// the headers: a vmlinux is tens of MiB.
fn phys_aliases(kernel: &Path) -> Vec<PhysAlias> {
    use std::os::unix::fs::FileExt;
    const PT_LOAD: u32 = 1;
    let Ok(f) = std::fs::File::open(kernel) else {
        return Vec::new();
    };
    let read = |off: u64, len: usize| {
        let mut b = vec![0; len];
        f.read_exact_at(&mut b, off).ok().map(|()| b)
    };
    let le = |b: &[u8], o: usize, n: usize| {
        b[o..o + n]
            .iter()
            .rev()
            .fold(0u64, |v, &x| v << 8 | u64::from(x))
    };
    let Some(h) = read(0, 64).filter(|h| h.starts_with(b"\x7fELF\x02\x01")) else {
        return Vec::new();
    };
    let (phoff, phentsize, phnum) = (le(&h, 0x20, 8), le(&h, 0x36, 2), le(&h, 0x38, 2));
    // A real kernel has a handful of program headers; more is a corrupt file.
    if phentsize < 56 || phentsize * phnum > 1 << 16 {
        return Vec::new();
    }
    let Some(ph) = read(phoff, (phentsize * phnum) as usize) else {
        return Vec::new();
    };
    ph.chunks_exact(phentsize as usize)
        .filter(|p| le(p, 0, 4) == u64::from(PT_LOAD))
        .map(|p| PhysAlias {
            va: le(p, 0x10, 8),
            pa: le(p, 0x18, 8),
            len: le(p, 0x28, 8),
        })
        .filter(|a| a.va != a.pa)
        .collect()
}

impl KernelSymbols {
    /// The System.map if there is one, else the kernel's own ELF symbol table; `None` if
    /// neither gives symbols (a bzImage, a stripped ELF).
    pub fn load(kernel: &Path, system_map: Option<&Path>) -> anyhow::Result<Option<Self>> {
        if let Some(map) = system_map {
            let symbols =
                Symbols::load(map).with_context(|| format!("cannot read {}", map.display()))?;
            return Ok(Some(KernelSymbols {
                symbols,
                source: format!("System.map {}", map.display()),
                aliases: phys_aliases(kernel),
            }));
        }
        let elf =
            std::fs::read(kernel).with_context(|| format!("cannot read {}", kernel.display()))?;
        Ok(Symbols::from_elf(&elf).map(|symbols| KernelSymbols {
            symbols,
            source: format!("ELF symbol table of {}", kernel.display()),
            aliases: phys_aliases(kernel),
        }))
    }

    /// `symbol+0xoff` for `addr`; an address only a physical alias covers is named by
    /// its link address with ` (physical)` after it.
    pub fn describe(&self, addr: u64) -> Option<String> {
        self.symbols.describe(addr).or_else(|| {
            let a = self
                .aliases
                .iter()
                .find(|a| addr.wrapping_sub(a.pa) < a.len)?;
            let name = self.symbols.describe(a.va + (addr - a.pa))?;
            Some(format!("{name} (physical)"))
        })
    }
}

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
    pub fn new(rows: &[Row], symbols: Option<&KernelSymbols>, top: usize) -> Self {
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
                symbol: symbols.and_then(|s| s.describe(address)),
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
            symbols: symbols.map(|s| s.source.clone()),
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

/// After a `--tool bbcount` run: reads `<out>/bbcount.csv` and writes
/// `<out>/bbcount-report.txt`. `Ok(None)` if the run wrote no CSV (another tool, or the
/// engine stopped before the tool finished).
pub fn write_report(
    out: &Path,
    symbols: Option<&KernelSymbols>,
    top: usize,
) -> anyhow::Result<Option<(BbcountSummary, PathBuf)>> {
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
    let summary = BbcountSummary::new(&rows, symbols, top);
    let path = out.join(REPORT_NAME);
    host_daemon::resolve::write_output_file(&path, summary.render().as_bytes())
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(Some((summary, path)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(address: u64, cpl: u8, instructions: u32, count: u64) -> Row {
        Row {
            address,
            cpl,
            instructions,
            count,
        }
    }

    fn kernel_symbols() -> KernelSymbols {
        KernelSymbols {
            symbols: Symbols::parse(
                "ffffffff81000000 T do_syscall_64\n\
                 ffffffff81000100 T entry_SYSCALL_64\n",
            ),
            source: "System.map test".into(),
            aliases: vec![PhysAlias {
                pa: 0x100_0000,
                va: 0xffff_ffff_8100_0000,
                len: 0x1000,
            }],
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
        let syms = kernel_symbols();
        let s = BbcountSummary::new(&rows, Some(&syms), 3);
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
    fn test_code_run_at_its_physical_address_is_named_by_its_link_address() {
        let s = kernel_symbols();
        assert_eq!(
            s.describe(0x100_0045).as_deref(),
            Some("do_syscall_64+0x45 (physical)")
        );
        assert_eq!(s.describe(0x100_1000), None, "past the segment");
        assert_eq!(
            s.describe(0xffff_ffff_8100_0045).as_deref(),
            Some("do_syscall_64+0x45")
        );
    }

    #[test]
    fn test_phys_aliases_come_from_the_elf_program_headers() {
        // ELF header, then two PT_LOADs: one linked high and loaded low, one identity.
        let mut elf = vec![0u8; 64];
        elf[..6].copy_from_slice(b"\x7fELF\x02\x01");
        elf[0x20..0x28].copy_from_slice(&64u64.to_le_bytes());
        elf[0x36..0x38].copy_from_slice(&56u16.to_le_bytes());
        elf[0x38..0x3a].copy_from_slice(&2u16.to_le_bytes());
        for (va, pa, len) in [
            (0xffff_ffff_8100_0000u64, 0x100_0000u64, 0x2000u64),
            (0x10_0000, 0x10_0000, 0x1000),
        ] {
            let mut ph = [0u8; 56];
            ph[..4].copy_from_slice(&1u32.to_le_bytes());
            ph[0x10..0x18].copy_from_slice(&va.to_le_bytes());
            ph[0x18..0x20].copy_from_slice(&pa.to_le_bytes());
            ph[0x28..0x30].copy_from_slice(&len.to_le_bytes());
            elf.extend_from_slice(&ph);
        }
        let path = std::env::temp_dir().join(format!("kpin-report-phdrs-{}", std::process::id()));
        std::fs::write(&path, &elf).unwrap();
        assert_eq!(
            phys_aliases(&path),
            [PhysAlias {
                pa: 0x100_0000,
                va: 0xffff_ffff_8100_0000,
                len: 0x2000
            }]
        );
        std::fs::write(&path, &elf[..100]).unwrap();
        assert!(phys_aliases(&path).is_empty(), "truncated headers");
        std::fs::remove_file(&path).unwrap();
        assert!(phys_aliases(Path::new("/nonexistent")).is_empty());
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
        let syms = kernel_symbols();
        let (s, path) = write_report(&dir, Some(&syms), DEFAULT_TOP)
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
