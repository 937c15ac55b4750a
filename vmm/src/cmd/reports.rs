//! `kpin run`'s post-processing: what the run's files say once the guest has stopped —
//! the engine log's tail for an engine failure's dump, the engine's counters, and the
//! tools' host-side reports (bbcount's, cachesim's). Everything read here came from
//! inside the guest: a file that cannot be used is said and left out.

use std::path::Path;

use host_daemon::OutputFailure;
use kpin_abi::output;
use kpin_tool_bbcount::report::{self, BbcountSummary, BlockNames};
use vmm::diag::kernel_symbols::KernelSymbols;

use crate::progress;

/// Lines of `engine.log` an engine failure's dump ends with: the engine's report (what
/// stopped it, the guest's virtual state, the recent traces) comes last in the log.
const ENGINE_LOG_TAIL_LINES: usize = 80;
/// Bytes of `engine.log` read for its tail (80 lines of at most 1 KiB).
const ENGINE_LOG_TAIL_BYTES: u64 = 96 << 10;
/// Largest `counters.json` kpin reads back.
const MAX_COUNTERS_BYTES: u64 = 16 << 20;
/// The tool whose results `bbcount-report.txt` summarises.
pub(crate) const BBCOUNT: &str = kpin_tool_bbcount::SPEC.name;
/// The tool whose host-side files `cachesim_report` summarises.
pub(crate) const CACHESIM: &str = kpin_tool_cachesim::SPEC.name;

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

/// Writes and prints the bbcount report if the run left a `bbcount.csv`; a report that
/// cannot be made is said and left out (the CSV came from inside the guest), and one that
/// cannot be written because of the host's storage is the run's output `failure`.
pub(crate) fn bbcount_report(
    out: &Path,
    kernel: &Path,
    system_map: Option<&Path>,
    top: usize,
    failure: &mut Option<OutputFailure>,
) -> Option<BbcountSummary> {
    if !out.join(kpin_tool_bbcount::CSV_NAME).exists() {
        return None;
    }
    let made = KernelSymbols::load(kernel, system_map).and_then(|mut symbols| {
        // Where the kernel's blocks ran tells a KASLR slide (a bzImage boot).
        if let (Some(s), Ok(Some(rows))) = (symbols.as_mut(), report::read_rows(out)) {
            s.find_slide(rows.iter().filter(|r| r.cpl == 0).map(|r| r.address));
        }
        let names = symbols.as_ref().map(|s| s as &dyn BlockNames);
        report::write_report(out, names, top)
    });
    match made {
        Ok(Some((summary, path))) => {
            progress(&format!("{}:\n{}", path.display(), summary.render()));
            Some(summary)
        }
        Ok(None) => None,
        Err(e) => {
            progress(&format!("no bbcount report: {e:#}"));
            let io = e.chain().find_map(|c| c.downcast_ref::<std::io::Error>());
            if let Some(io) = io.filter(|io| host_daemon::resolve::is_host_fault(io)) {
                let path = out.join(report::REPORT_NAME);
                failure.get_or_insert_with(|| OutputFailure::new(&path, io));
            }
            None
        }
    }
}

/// Writes and prints cachesim's reports, its top-N instructions named from the kernel's
/// symbols (with the KASLR slide found from the kernel instructions that missed); a
/// report that cannot be made is said (the files came from inside the guest).
pub(crate) fn cachesim_report(out: &Path, kernel: &Path, system_map: Option<&Path>) {
    use kpin_tool_cachesim::report as cs;
    let symbols = match KernelSymbols::load(kernel, system_map) {
        Ok(s) => s,
        Err(e) => {
            progress(&format!("cachesim's instructions left unnamed: {e:#}"));
            None
        }
    };
    let symbols = symbols.map(|mut s| {
        if let Ok(Some(insns)) = cs::read_insns(out) {
            s.find_slide(insns.rows.iter().filter(|r| r.cpl == 0).map(|r| r.va));
        }
        s
    });
    let names = symbols.as_ref().map(|s| s as &dyn BlockNames);
    match cs::write_reports_named(out, names) {
        Ok(Some((r, files))) => progress(&format!("{}\ncachesim: {files:?}", r.text())),
        Ok(None) => {}
        Err(e) => progress(&format!("no cachesim report: {e}")),
    }
}
