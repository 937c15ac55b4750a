//! `kpin run`'s post-processing: what the run's files say once the guest has stopped —
//! the engine log's tail for an engine failure's dump, the engine's counters, and the
//! tool's host-side report (its registry host part's `report` hook, e.g. bbcount's and
//! cachesim's). Everything read here came from inside the guest: a file that cannot be
//! used is said and left out.

use std::path::{Path, PathBuf};

use host_daemon::OutputFailure;
use kpin_abi::output;
use kpin_tool::host_side::{BlockNames, RunFiles, RunJson, UserNames};
use vmm::diag::kernel_symbols::KernelSymbols;
use vmm::diag::user_names::UserSymbolizer;

use crate::progress;

/// Lines of `engine.log` an engine failure's dump ends with: the engine's report (what
/// stopped it, the guest's virtual state, the recent traces) comes last in the log.
const ENGINE_LOG_TAIL_LINES: usize = 80;
/// Bytes of `engine.log` read for its tail (80 lines of at most 1 KiB).
const ENGINE_LOG_TAIL_BYTES: u64 = 96 << 10;
/// Largest `counters.json` kpin reads back.
const MAX_COUNTERS_BYTES: u64 = 16 << 20;

/// Appends the tail of the engine's log to a dump (the VMM's own dump shows the engine's
/// vCPU; the engine's report says where the guest was).
pub(crate) fn append_engine_log_tail(dump: &mut String, log: &Path) {
    use std::fmt::Write;
    let Ok(bytes) = host_daemon::resolve::read_output_tail(log, ENGINE_LOG_TAIL_BYTES) else {
        let _ = writeln!(dump, "\n(no engine log at {})", log.display());
        return;
    };
    // The daemon wrote the log without control characters; the tail may start mid-line.
    let text = String::from_utf8_lossy(&bytes);
    let mut lines: Vec<&str> = text.lines().collect();
    if bytes.len() as u64 == ENGINE_LOG_TAIL_BYTES && lines.len() > 1 {
        lines.remove(0);
    }
    let tail = &lines[lines.len().saturating_sub(ENGINE_LOG_TAIL_LINES)..];
    let _ = writeln!(
        dump,
        "\n--- the engine's report: last {} lines of {} ---",
        tail.len(),
        log.display()
    );
    for l in tail {
        let _ = writeln!(dump, "{l}");
    }
}

/// The engine's counters, if it wrote them; a file that does not parse is reported and
/// left out (it came from inside the guest).
pub(crate) fn read_engine_counters(out: &Path) -> Option<serde_json::Value> {
    let path = out.join(output::ENGINE_COUNTERS);
    std::fs::symlink_metadata(&path).ok()?;
    let text = match host_daemon::resolve::read_output_text(&path, MAX_COUNTERS_BYTES) {
        Ok(t) => t,
        Err(e) => {
            progress(&format!("ignoring {}: {e}", path.display()));
            return None;
        }
    };
    match serde_json::from_str(&text) {
        Ok(v) => Some(v),
        Err(e) => {
            progress(&format!("ignoring {}: not JSON ({e})", path.display()));
            None
        }
    }
}

/// The tools' entries in `run.json`: every registry tool's host part that has a key
/// ([`kpin_tool::host_side::HostTool::run_json_key`]), in the registry's order, `null`
/// unless the run's tool reported a value.
#[derive(Default)]
pub(crate) struct ToolEntries(Vec<(&'static str, Option<RunJson>)>);

impl ToolEntries {
    /// Every key, each `null`.
    pub(crate) fn none() -> Self {
        ToolEntries(
            kpin_tool_registry::host::HOST_TOOLS
                .iter()
                .filter_map(|h| h.run_json_key())
                .map(|k| (k, None))
                .collect(),
        )
    }

    /// Sets `key`'s value.
    fn set(&mut self, key: &'static str, value: RunJson) {
        if let Some(e) = self.0.iter_mut().find(|(k, _)| *k == key) {
            e.1 = Some(value);
        }
    }
}

impl serde::Serialize for ToolEntries {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            m.serialize_entry(k, v)?;
        }
        m.end()
    }
}

/// The guest's files a report names code from.
pub(crate) struct GuestSources<'a> {
    /// The kernel (its symbols, or its BTF's payload's).
    pub(crate) kernel: &'a Path,
    /// Its `System.map`, if the run has one.
    pub(crate) system_map: Option<&'a Path>,
    /// The initramfs (user programs' files).
    pub(crate) initrd: Option<&'a Path>,
    /// The raw disks, the guest's root first (user programs' files on ext4).
    pub(crate) disks: Vec<PathBuf>,
}

/// The run's tool's host-side report (its registry host part's `report` hook), from the
/// files the run finished (the caller calls it only when the run was not stopped and no
/// write failed), and only for the tool the run used (another tool's run may leave a file
/// of the same name, which is the guest's, not a result). A report the host's storage
/// could not take is the run's output `failure`.
pub(crate) fn tool_reports(
    tool: Option<&str>,
    top: usize,
    out: &Path,
    unfinished: &[PathBuf],
    guest: &GuestSources<'_>,
    failure: &mut Option<OutputFailure>,
) -> ToolEntries {
    let mut entries = ToolEntries::none();
    let Some(host) = tool.and_then(kpin_tool_registry::host::find) else {
        return entries;
    };
    let unfinished: Vec<PathBuf> = unfinished
        .iter()
        .map(|p| p.strip_prefix(out).unwrap_or(p).to_path_buf())
        .collect();
    let mut kernel_names = |executed: &mut dyn Iterator<Item = u64>| {
        KernelSymbols::load(guest.kernel, guest.system_map).map(|symbols| {
            symbols.map(|mut s| {
                // Where the kernel's code ran tells a KASLR slide (a bzImage boot).
                s.find_slide(executed);
                Box::new(s) as Box<dyn BlockNames>
            })
        })
    };
    // Only a tool that names user code reads processes.json's code pages and the files.
    let mut user_names = || {
        let (disks, initrd) = (guest.disks.clone(), guest.initrd.map(Path::to_path_buf));
        let say = Box::new(|line: &str| progress(line));
        UserSymbolizer::load(out, disks, initrd, say)
            .map(|names| names.map(|n| Box::new(n) as Box<dyn UserNames>))
    };
    let mut say = |line: &str| progress(line);
    let mut run = RunFiles {
        dir: out,
        unfinished: &unfinished,
        top,
        kernel_names: &mut kernel_names,
        user_names: &mut user_names,
        say: &mut say,
    };
    let made = host.report(&mut run);
    if let Some((path, io)) = made.failure {
        failure.get_or_insert_with(|| OutputFailure::new(&path, &io));
    }
    if let (Some(key), Some(value)) = (host.run_json_key(), made.run_json) {
        entries.set(key, value);
    }
    entries
}
