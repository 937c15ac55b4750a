//! The processes the engine saw run (`processes.json`, `docs/processes.md`): read back as
//! untrusted JSON (it came from inside the guest, and a task names itself), copied into
//! `run.json`'s `processes` and shown as a short table at the end of the run.

use std::path::Path;

use kpin_abi::output;
use serde::{Deserialize, Serialize};

use crate::progress;

/// Largest `processes.json` kpin reads back: 512 rows of ~400 bytes (at most ~1550 with
/// every name byte escaped), 256 objects' paths and 16 384 code pages of ~30 bytes.
const MAX_PROCESSES_BYTES: u64 = 4 << 20;
/// Rows the end-of-run table shows.
pub(crate) const TABLE_ROWS: usize = 10;

/// `processes.json` as `run.json` keeps it.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
pub(crate) struct Processes {
    /// `task` (named from the kernel's `task_struct`) or `address_space` (by CR3).
    pub(crate) by: String,
    /// Instructions charged at CPL 3, all rows together (the engine's total).
    pub(crate) user_instructions: u64,
    /// Instructions charged at CPL 0, all rows together.
    pub(crate) kernel_instructions: u64,
    /// Entries to CPL 3 the engine looked at.
    pub(crate) user_entries: u64,
    /// Changes of the running task charged.
    pub(crate) switches: u64,
    /// Entries skipped because a read of the kernel's memory faulted.
    pub(crate) reads_failed: u64,
    /// New rows whose executable could not be read.
    #[serde(default)]
    pub(crate) exe_reads_failed: u64,
    /// TSC cycles the engine spent watching (its whole cost).
    #[serde(default)]
    pub(crate) watch_cycles: u64,
    /// The rows: the boot row first, then in the order first seen.
    pub(crate) processes: Vec<Process>,
}

/// One row.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
pub(crate) struct Process {
    /// `boot`, `task`, `address_space` or `overflow`.
    pub(crate) kind: String,
    pub(crate) pid: Option<i64>,
    pub(crate) tgid: Option<i64>,
    pub(crate) comm: Option<String>,
    /// The name of its executable file (`mm->exe_file`'s dentry).
    #[serde(default)]
    pub(crate) exe: Option<String>,
    /// Its executable's path, as far as the engine walked it up (`...` in front when cut).
    #[serde(default)]
    pub(crate) exe_path: Option<String>,
    /// The `task_struct`'s address.
    pub(crate) task: Option<String>,
    /// The address space when first seen (CR3 without PCID and the PTI bit).
    pub(crate) cr3: String,
    /// Guest instructions executed (both CPLs) when it first ran and last stopped.
    pub(crate) first_seen: u64,
    pub(crate) last_seen: u64,
    /// Times it became the running task.
    pub(crate) entries: u64,
    pub(crate) user_instructions: u64,
    pub(crate) kernel_instructions: u64,
}

impl Process {
    fn total(&self) -> u64 {
        self.user_instructions
            .saturating_add(self.kernel_instructions)
    }

    /// Its name in the table.
    fn name(&self) -> String {
        match (self.kind.as_str(), &self.comm) {
            ("task", Some(c)) => c.clone(),
            ("boot", _) => "(kernel before the first process)".into(),
            ("overflow", _) => "(tasks past the table's end)".into(),
            _ => format!("(address space {})", self.cr3),
        }
    }
}

/// The run's `processes.json` (if `finished`: the run was not stopped and the engine
/// closed the file); a file that does not parse is said and left out.
pub(crate) fn read(out: &Path, finished: bool) -> Option<Processes> {
    let path = out.join(output::ENGINE_PROCESSES);
    if !finished || std::fs::symlink_metadata(&path).is_err() {
        return None;
    }
    let parsed = host_daemon::resolve::read_output_text(&path, MAX_PROCESSES_BYTES)
        .map_err(|e| e.to_string())
        .and_then(|t| serde_json::from_str::<Processes>(&t).map_err(|e| e.to_string()));
    match parsed {
        Ok(p) => {
            progress(&format!(
                "processes ({}):\n{}",
                path.display(),
                table(&p, TABLE_ROWS)
            ));
            Some(p)
        }
        Err(e) => {
            progress(&format!("ignoring {}: {e}", path.display()));
            None
        }
    }
}

/// The `top` rows with the most instructions, one line each, and a line for the rest.
pub(crate) fn table(p: &Processes, top: usize) -> String {
    use std::fmt::Write;
    let all = p
        .user_instructions
        .saturating_add(p.kernel_instructions)
        .max(1);
    let mut rows: Vec<&Process> = p.processes.iter().collect();
    rows.sort_by_key(|r| std::cmp::Reverse(r.total()));
    let mut t = format!(
        "{:>7} {:<34} {:<16} {:>15} {:>15} {:>6}\n",
        "pid", "comm", "exe", "user insns", "kernel insns", "share"
    );
    for r in rows.iter().take(top) {
        let pid = r.pid.map_or_else(|| "-".into(), |p| p.to_string());
        // Names came from the guest: printable ASCII only, and not too long.
        let name = printable(&r.name(), 34);
        let exe = printable(r.exe.as_deref().unwrap_or("-"), 16);
        let _ = writeln!(
            t,
            "{pid:>7} {name:<34} {exe:<16} {:>15} {:>15} {:>5.1}%",
            r.user_instructions,
            r.kernel_instructions,
            r.total() as f64 * 100.0 / all as f64
        );
    }
    let rest = &rows[rows.len().min(top)..];
    if !rest.is_empty() {
        let (u, k) = rest.iter().fold((0u64, 0u64), |(u, k), r| {
            (
                u.saturating_add(r.user_instructions),
                k.saturating_add(r.kernel_instructions),
            )
        });
        let _ = writeln!(
            t,
            "{:>7} {:<34} {:<16} {u:>15} {k:>15} {:>5.1}%",
            "",
            format!("({} more rows)", rest.len()),
            "",
            u.saturating_add(k) as f64 * 100.0 / all as f64
        );
    }
    let _ = write!(
        t,
        "{} rows by {}; {} changes of the running task in {} entries to user mode, {} skipped, {} executables unreadable; {:.1} M TSC cycles spent watching",
        p.processes.len(),
        p.by,
        p.switches,
        p.user_entries,
        p.reads_failed,
        p.exe_reads_failed,
        p.watch_cycles as f64 / 1e6
    );
    t
}

/// `s` with every character but printable ASCII and space as `?`, at most `max` of them.
fn printable(s: &str, max: usize) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_graphic() || c == ' ' {
                c
            } else {
                '?'
            }
        })
        .take(max)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = r#"{"by":"task","user_instructions":30,"kernel_instructions":70,"user_entries":9,"switches":2,"reads_failed":0,"processes":[
        {"kind":"boot","pid":null,"tgid":null,"comm":null,"task":null,"cr3":"0x0","first_seen":0,"last_seen":50,"entries":1,"user_instructions":0,"kernel_instructions":50},
        {"kind":"task","pid":1,"tgid":1,"comm":"init\u0007","task":"0xffff888003dfe000","cr3":"0x566e000","first_seen":50,"last_seen":80,"entries":1,"user_instructions":10,"kernel_instructions":10},
        {"kind":"task","pid":7,"tgid":7,"comm":"sh","exe":"busybox","exe_path":"/bin/busybox","task":"0xffff888003dff000","cr3":"0x5670000","first_seen":80,"last_seen":100,"entries":1,"user_instructions":20,"kernel_instructions":10}]}"#;

    #[test]
    fn test_processes_json_parses_and_the_table_ranks_rows() {
        let p: Processes = serde_json::from_str(FILE).unwrap();
        assert_eq!(p.processes.len(), 3);
        let t = table(&p, 2);
        let lines: Vec<&str> = t.lines().collect();
        assert!(
            lines[1].contains("(kernel before the first process)"),
            "{t}"
        );
        assert!(lines[1].contains("50.0%"), "{t}");
        assert!(lines[2].contains("sh") && lines[2].contains("30.0%"), "{t}");
        assert!(lines[2].contains(" busybox "), "the exe column: {t}");
        assert!(lines[1].contains(" - "), "no exe: {t}");
        assert_eq!(p.processes[2].exe_path.as_deref(), Some("/bin/busybox"));
        assert_eq!(p.processes[1].exe, None, "a file without exe still parses");
        assert!(lines[3].contains("(1 more rows)"), "{t}");
        assert!(lines[4].starts_with("3 rows by task"), "{t}");
        // A control character in a name is not printed.
        assert!(table(&p, 3).contains("init?"), "{t}");
        // Round trip into run.json keeps every field.
        let again: Processes = serde_json::from_value(serde_json::to_value(&p).unwrap()).unwrap();
        assert_eq!(again, p);
    }

    #[test]
    fn test_a_file_that_is_not_the_engines_is_left_out() {
        let dir = std::env::temp_dir().join(format!("kpin-proc-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert!(read(&dir, true).is_none(), "no file");
        std::fs::write(dir.join(output::ENGINE_PROCESSES), b"{\"by\": 3}").unwrap();
        assert!(read(&dir, true).is_none(), "not the engine's shape");
        std::fs::write(dir.join(output::ENGINE_PROCESSES), FILE).unwrap();
        assert!(read(&dir, false).is_none(), "not finished");
        assert_eq!(read(&dir, true).unwrap().processes.len(), 3);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
