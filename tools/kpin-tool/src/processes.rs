//! The per-process table of the tools' reports (feature `host`): the engine's
//! `processes.json` (`docs/processes.md`), read back as untrusted — every row's pid, comm,
//! executable and the instructions charged to it per CPL, and whether the rows add up to
//! the totals (the engine charges every instruction to exactly one row). bbcount and
//! insmix print it as it is; cachesim names its `TASK` rows from it.

extern crate std;

use alloc::format;
use alloc::string::{String, ToString};
use alloc::vec::Vec;
use core::fmt::Write;
use std::path::Path;

use serde::{Deserialize, Serialize};

/// Largest `processes.json` read (its code pages make it grow with the code that ran).
pub const MAX_PROCESSES_BYTES: u64 = 64 << 20;
/// Longest name shown (a task names itself with any bytes).
const NAME_CHARS: usize = 32;

/// The file's fields the table uses.
#[derive(Deserialize)]
struct File {
    by: String,
    user_instructions: u64,
    kernel_instructions: u64,
    processes: Vec<FileRow>,
}

#[derive(Deserialize)]
struct FileRow {
    kind: String,
    pid: Option<i64>,
    comm: Option<String>,
    #[serde(default)]
    exe: Option<String>,
    cr3: Option<String>,
    user_instructions: u64,
    kernel_instructions: u64,
}

/// One process (row of `processes.json`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ProcessRow {
    /// Its index in `processes.json`'s `processes` (what a `TASK` record's `ea` names).
    pub row: usize,
    /// `task`, `boot` (the kernel before the first process), `overflow` (tasks past the
    /// table's end) or `address_space` (a kernel without BTF: keyed by CR3).
    pub kind: String,
    /// The address space's CR3 (`0x…`), for `address_space` rows.
    pub cr3: Option<String>,
    /// Its pid (`None`: not a task: the kernel before the first process, an address space).
    pub pid: Option<i64>,
    /// What it calls itself, or what the row is (`(kernel before the first process)`).
    pub comm: String,
    /// Its executable file's name.
    pub exe: Option<String>,
    /// Instructions charged at CPL 3.
    pub user_instructions: u64,
    /// Instructions charged at CPL 0 (its syscalls and faults, and what ran after it).
    pub kernel_instructions: u64,
}

impl ProcessRow {
    fn total(&self) -> u64 {
        self.user_instructions
            .saturating_add(self.kernel_instructions)
    }
}

/// The table.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Processes {
    /// `task` or `address_space`.
    pub by: String,
    /// The engine's totals (`counters.json`'s per CPL).
    pub user_instructions: u64,
    /// …
    pub kernel_instructions: u64,
    /// Whether the rows' sums equal the totals, per CPL.
    pub rows_sum_to_totals: bool,
    /// Every row, most instructions first.
    pub rows: Vec<ProcessRow>,
}

impl Processes {
    /// Parses `processes.json`'s text.
    pub fn parse(text: &str) -> Result<Self, String> {
        let f: File = serde_json::from_str(text).map_err(|e| e.to_string())?;
        let mut rows: Vec<ProcessRow> = f
            .processes
            .into_iter()
            .enumerate()
            .map(|(row, r)| ProcessRow {
                row,
                kind: printable(&r.kind),
                cr3: r.cr3.as_deref().map(printable),
                pid: r.pid.filter(|_| r.kind == "task"),
                comm: match (r.kind.as_str(), r.comm) {
                    ("task", Some(c)) => printable(&c),
                    ("boot", _) => "(kernel before the first process)".into(),
                    ("overflow", _) => "(tasks past the table's end)".into(),
                    _ => format!(
                        "(address space {})",
                        printable(r.cr3.as_deref().unwrap_or("?"))
                    ),
                },
                exe: r.exe.as_deref().map(printable),
                user_instructions: r.user_instructions,
                kernel_instructions: r.kernel_instructions,
            })
            .collect();
        let sum = |f: fn(&ProcessRow) -> u64| rows.iter().map(f).fold(0u64, u64::saturating_add);
        let rows_sum_to_totals = sum(|r| r.user_instructions) == f.user_instructions
            && sum(|r| r.kernel_instructions) == f.kernel_instructions;
        rows.sort_by_key(|r| core::cmp::Reverse(r.total()));
        Ok(Processes {
            by: printable(&f.by),
            user_instructions: f.user_instructions,
            kernel_instructions: f.kernel_instructions,
            rows_sum_to_totals,
            rows,
        })
    }

    /// `<out>/processes.json`'s table; `Ok(None)` if the run wrote none.
    pub fn read(out: &Path) -> Result<Option<Self>, String> {
        let path = out.join(kpin_abi::output::ENGINE_PROCESSES);
        if std::fs::symlink_metadata(&path).is_err() {
            return Ok(None);
        }
        let text = host_daemon::resolve::read_output_text(&path, MAX_PROCESSES_BYTES)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        Self::parse(&text)
            .map(Some)
            .map_err(|e| format!("{}: {e}", path.display()))
    }

    /// The table's text: the `top` rows with the most instructions and a line for the
    /// rest.
    pub fn render(&self, top: usize) -> String {
        let all = self
            .user_instructions
            .saturating_add(self.kernel_instructions);
        let pct = |n: u64| {
            if all == 0 {
                0.0
            } else {
                100.0 * n as f64 / all as f64
            }
        };
        let mut t = String::new();
        let _ = writeln!(
            t,
            "processes (processes.json, by {}): {} rows; {} user + {} kernel instructions, {}",
            self.by,
            self.rows.len(),
            self.user_instructions,
            self.kernel_instructions,
            if self.rows_sum_to_totals {
                "the rows sum to both exactly"
            } else {
                "THE ROWS DO NOT SUM TO THEM"
            }
        );
        let _ = writeln!(
            t,
            "  {:>7} {:<32} {:<16} {:>14} {:>14} {:>7}",
            "pid", "comm", "exe", "user insns", "kernel insns", "share"
        );
        for r in self.rows.iter().take(top) {
            let pid = r.pid.map_or_else(|| "-".into(), |p| p.to_string());
            let _ = writeln!(
                t,
                "  {pid:>7} {:<32} {:<16} {:>14} {:>14} {:>6.2}%",
                r.comm,
                r.exe.as_deref().unwrap_or("-"),
                r.user_instructions,
                r.kernel_instructions,
                pct(r.total())
            );
        }
        let rest = &self.rows[self.rows.len().min(top)..];
        if !rest.is_empty() {
            let (u, k) = rest.iter().fold((0u64, 0u64), |(u, k), r| {
                (
                    u.saturating_add(r.user_instructions),
                    k.saturating_add(r.kernel_instructions),
                )
            });
            let more = format!("({} more rows)", rest.len());
            let _ = writeln!(
                t,
                "  {:>7} {more:<32} {:<16} {u:>14} {k:>14} {:>6.2}%",
                "",
                "",
                pct(u.saturating_add(k))
            );
        }
        t
    }
}

/// `s` as printable ASCII (`?` for anything else), at most [`NAME_CHARS`] characters: a
/// name the guest made, safe to print.
pub fn printable(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_graphic() || c == ' ' {
                c
            } else {
                '?'
            }
        })
        .take(NAME_CHARS)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = r#"{"by":"task","user_instructions":300,"kernel_instructions":700,"objects":["/bin/busybox"],"code_pages":[[1,0,0]],"processes":[
        {"kind":"boot","pid":null,"tgid":null,"comm":null,"task":null,"cr3":"0x0","user_instructions":0,"kernel_instructions":500},
        {"kind":"task","pid":1,"tgid":1,"comm":"init\u0007","exe":"busybox","cr3":"0x566e000","user_instructions":100,"kernel_instructions":100},
        {"kind":"task","pid":7,"tgid":7,"comm":"sort","exe":"busybox","cr3":"0x5670000","user_instructions":150,"kernel_instructions":50},
        {"kind":"address_space","pid":null,"tgid":null,"comm":null,"cr3":"0x1000","user_instructions":50,"kernel_instructions":50}]}"#;

    #[test]
    fn test_rows_ranked_their_sums_checked_and_names_made_printable() {
        let p = Processes::parse(FILE).unwrap();
        assert!(p.rows_sum_to_totals);
        let order: Vec<(Option<i64>, &str)> =
            p.rows.iter().map(|r| (r.pid, r.comm.as_str())).collect();
        assert_eq!(
            order,
            [
                (None, "(kernel before the first process)"),
                (Some(1), "init?"),
                (Some(7), "sort"),
                (None, "(address space 0x1000)")
            ]
        );
        // Ranked, each row keeps its index in the file (a TASK record's `ea`) and kind.
        let at: Vec<(usize, &str, Option<&str>)> = p
            .rows
            .iter()
            .map(|r| (r.row, r.kind.as_str(), r.cr3.as_deref()))
            .collect();
        assert_eq!(
            at,
            [
                (0, "boot", Some("0x0")),
                (1, "task", Some("0x566e000")),
                (2, "task", Some("0x5670000")),
                (3, "address_space", Some("0x1000"))
            ]
        );
        let t = p.render(2);
        assert!(t.starts_with("processes (processes.json, by task): 4 rows; 300 user + 700 kernel instructions, the rows sum to both exactly\n"), "{t}");
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(
            lines[2].split_whitespace().collect::<Vec<_>>(),
            ["-", "(kernel", "before", "the", "first", "process)", "-", "0", "500", "50.00%"]
        );
        assert_eq!(
            lines[3].split_whitespace().collect::<Vec<_>>(),
            ["1", "init?", "busybox", "100", "100", "20.00%"]
        );
        assert_eq!(
            lines[4].split_whitespace().collect::<Vec<_>>(),
            ["(2", "more", "rows)", "200", "100", "30.00%"]
        );

        let off = FILE.replace("\"user_instructions\":300", "\"user_instructions\":301");
        let p = Processes::parse(&off).unwrap();
        assert!(!p.rows_sum_to_totals);
        assert!(p.render(1).contains("THE ROWS DO NOT SUM TO THEM"));
        assert!(Processes::parse("{\"by\":3}").is_err());
    }
}
