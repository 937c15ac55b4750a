//! `run.json`: what a run's output directory holds and whether it is whole (part of the
//! `kpin` binary, not the library).
//!
//! [`RunStarted`] is written before the guest starts (`"complete": false`, `"status":
//! "running"`), so a kpin that is killed leaves a record saying the run did not end;
//! `summary::Summary` replaces it at the end, `"complete": true` or `"status": "incomplete"` with
//! the reasons. Both are written whole ([`write_run_json`]: a new file renamed over the
//! old one). While the guest runs, [`OUTPUT_RESERVE_BYTES`] are held on the output file
//! system for the last files. The fields are documented in `docs/host-input.md`
//! ("Host-side faults").

use std::path::Path;

use anyhow::Context;
use host_daemon::OutputFailure;
use serde::Serialize;
use vmm::Outcome;

use crate::{progress, stop_signals, EXIT_OUTPUT_FAILED};

/// Bytes held on the output file system while the guest runs, released just before
/// kpin's own last files (`dump.txt`, `run.json`) are written: a run that filled the file
/// system can still say so (best effort: a very large `run.json` may not fit).
pub(crate) const OUTPUT_RESERVE_BYTES: u64 = 64 << 10;

/// `run.json`'s `status` while the run goes on (and after kpin was killed).
pub(crate) const STATUS_RUNNING: &str = "running";
/// `run.json`'s `status` when the directory holds the run's whole output.
pub(crate) const STATUS_COMPLETE: &str = "complete";
/// `run.json`'s `status` when it does not (`incomplete_reason` says why).
pub(crate) const STATUS_INCOMPLETE: &str = "incomplete";

/// `run.json` from the start of the run until its end (and after a kpin that was killed
/// or failed): the run is not complete.
#[derive(Serialize)]
pub(crate) struct RunStarted<'a> {
    pub(crate) complete: bool,
    pub(crate) status: &'static str,
    pub(crate) incomplete_reason: String,
    pub(crate) pid: u32,
    pub(crate) started_unix_seconds: u64,
    pub(crate) kernel: &'a Path,
    pub(crate) initrd: Option<&'a Path>,
    pub(crate) cmdline: &'a str,
    pub(crate) mem_mib: u64,
    pub(crate) tool: Option<&'a str>,
    /// The `--disk`s: `path` and `read_only` each.
    pub(crate) disks: &'a [vmm::devices::virtio::disk::DiskConfig],
}

pub(crate) fn unix_seconds() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Writes `run.json` whole (a new file renamed over the old one).
pub(crate) fn write_run_json<T: Serialize>(out: &Path, record: &T) -> anyhow::Result<()> {
    let json = serde_json::to_string_pretty(record).context("cannot encode the run summary")?;
    let path = out.join(kpin_abi::output::RUN_JSON);
    host_daemon::resolve::write_output_file(&path, (json + "\n").as_bytes())
        .with_context(|| format!("cannot write {}", path.display()))
}

/// Why the console file lacks some of the `printed` bytes the guest sent to its console
/// (the UART drops a failed write so as not to stop the guest), or `None`.
pub(crate) fn console_shortfall(file: &Path, printed: u64) -> Option<String> {
    let have = std::fs::symlink_metadata(file).ok()?.len();
    if have >= printed {
        return None;
    }
    let why = file
        .parent()
        .and_then(host_daemon::resolve::file_system_state)
        .unwrap_or("a write failed");
    Some(format!(
        "{why}: {} holds {have} of the {printed} bytes the guest printed",
        file.display()
    ))
}

/// What the end of a run says about its output.
pub(crate) struct Verdict<'a> {
    /// How the guest's run ended.
    pub(crate) outcome: &'a Outcome,
    /// The signal that stopped it, if one did.
    pub(crate) interrupted: Option<i32>,
    /// The first file that could not be written.
    pub(crate) failure: Option<OutputFailure>,
    /// Console bytes that did not reach the console file ([`console_shortfall`]).
    pub(crate) console_short: Option<String>,
    /// The tool files the engine had not finished, relative to the output directory.
    pub(crate) unfinished: Vec<String>,
}

impl Verdict<'_> {
    /// Why the output directory does not hold the run's whole output (empty: it does).
    pub(crate) fn reasons(&self) -> Vec<String> {
        let mut reasons = Vec::new();
        if self.interrupted.is_some() {
            reasons.push(self.outcome.describe());
        }
        if let Some(f) = &self.failure {
            reasons.push(f.reason());
        }
        if let Some(short) = &self.console_short {
            reasons.push(short.clone());
        }
        if !self.unfinished.is_empty() {
            reasons.push(format!(
                "tool files left unfinished: {}",
                self.unfinished.join(", ")
            ));
        }
        reasons
    }

    /// Says how the run's output ended up once the final `run.json` was (or could not be:
    /// `written`) written; the exit status when that is not the guest's outcome's: 5 for
    /// output that could not be written, 128 + the signal for a stop.
    pub(crate) fn tell(&self, out: &Path, written: &anyhow::Result<()>) -> Option<u8> {
        let run_json = match written {
            Ok(()) if self.reasons().is_empty() => String::new(),
            Ok(()) => "; run.json says the run is incomplete and why".into(),
            Err(e) => format!(
                "; and run.json could not be rewritten ({}): it still says the run is running, incomplete",
                e.root_cause()
            ),
        };
        if let Some(f) = &self.failure {
            let what = if matches!(self.outcome, Outcome::HostDaemon(_)) {
                "the guest was stopped and its results are incomplete"
            } else {
                "the run's output is incomplete"
            };
            eprintln!(
                "kpin: error: {}: cannot write {}: {}; {what}{run_json}",
                f.cause,
                f.path.display(),
                f.error
            );
            return Some(EXIT_OUTPUT_FAILED);
        }
        if let Some(signal) = self.interrupted {
            match written {
                Err(e) => {
                    eprintln!("kpin: error: {e:#}; it still says the run is running, incomplete");
                }
                Ok(()) => progress(&format!(
                    "{}: the guest was stopped; what it produced so far is in {}{run_json}",
                    self.outcome.describe(),
                    out.display()
                )),
            }
            return Some(stop_signals::exit_status(signal));
        }
        if let Some(short) = &self.console_short {
            eprintln!("kpin: error: {short}; the console output is incomplete{run_json}");
            return Some(EXIT_OUTPUT_FAILED);
        }
        if let Err(e) = written {
            eprintln!("kpin: error: {e:#}; it still says the run is running, incomplete");
            return Some(EXIT_OUTPUT_FAILED);
        }
        None
    }
}
