//! `--tool memtrace` on the mini-kernel (issue #13): the guest still powers off,
//! `memtrace.bin` parses, it holds accesses at CPL 0 and CPL 3, every one with a physical
//! address, `cpl=3` keeps only user accesses, `limit=100` writes exactly 100 records and
//! counts the rest as dropped, and `memtrace-summary.txt` agrees with the file.

use std::path::PathBuf;
use std::time::Duration;

use kpin_tests::run_minikernel_with_options;
use kpin_tool_memtrace::format::{Record, Trace};
use vmm::Outcome;

/// The summary's `key=value` counts.
fn summary_value(summary: &str, key: &str) -> u64 {
    summary
        .split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {key} in {summary:?}"))
}

/// Runs the mini-kernel under memtrace with `options`; returns the records, the summary
/// and the output directory.
fn run(name: &str, options: &str) -> (Vec<Record>, String, PathBuf) {
    let (report, text, log, dir) = run_minikernel_with_options(
        name,
        "",
        Some(("memtrace", options)),
        Duration::from_secs(300),
    );
    assert_eq!(
        report.outcome,
        Outcome::Poweroff,
        "console:\n{text}\nengine log:\n{log}\ndump:\n{}",
        report.dump.unwrap_or_default()
    );
    let bytes = std::fs::read(dir.join(kpin_tool_memtrace::BIN_NAME))
        .unwrap_or_else(|e| panic!("no memtrace.bin ({e}); engine log:\n{log}"));
    let trace = Trace::parse(&bytes).unwrap_or_else(|e| panic!("memtrace.bin: {e}"));
    let records: Vec<Record> = trace.records().collect();
    let summary = std::fs::read_to_string(dir.join(kpin_tool_memtrace::SUMMARY_NAME))
        .unwrap_or_else(|e| panic!("no summary ({e}); engine log:\n{log}"));
    println!(
        "mini-kernel under memtrace {options:?}: {:.2} s, {} records ({} bytes); {summary}",
        report.wall.as_secs_f64(),
        records.len(),
        bytes.len()
    );
    assert_eq!(summary_value(&summary, "records"), records.len() as u64);
    assert_eq!(summary_value(&summary, "lost"), 0, "{summary}");
    (records, summary, dir)
}

#[test]
fn test_minikernel_memtrace_records_both_cpls_with_pas_and_honours_cpl_and_limit() {
    kpin_tests::require_kvm!();
    let (all, summary, dir) = run("minikernel-memtrace", "");
    assert_eq!(summary_value(&summary, "dropped"), 0);
    let kernel = all.iter().filter(|r| r.cpl() == 0).count();
    let user = all.iter().filter(|r| r.cpl() == 3).count();
    assert!(kernel > 0 && user > 0, "kernel {kernel}, user {user}");
    assert_eq!(kernel + user, all.len(), "records at CPL 1 or 2");
    let no_pa = all.iter().filter(|r| r.mem_paddr == u64::MAX).count();
    assert_eq!(no_pa, 0, "records without a physical address");
    assert!(all.iter().any(|r| r.is_read()) && all.iter().any(|r| r.is_write()));
    assert!(all
        .iter()
        .all(|r| r.size > 0 && (r.is_read() || r.is_write())));
    // The reader prints it, one CSV line per load and per store.
    let mut csv = Vec::new();
    let n =
        kpin_tool_memtrace::reader::print_run(&dir, Some(1000), &|_| None, &mut csv).expect("CSV");
    assert_eq!(n, 1000.min(all.len() as u64));
    let csv = String::from_utf8(csv).unwrap();
    assert!(csv.starts_with(kpin_tool_memtrace::reader::CSV_HEADER));
    println!("{}", csv.lines().take(4).collect::<Vec<_>>().join("\n"));

    let (user_only, summary, _) = run("minikernel-memtrace-cpl3", "cpl=3");
    assert!(!user_only.is_empty());
    assert!(
        user_only.iter().all(|r| r.cpl() == 3),
        "cpl=3 kept a kernel access"
    );
    assert_eq!(summary_value(&summary, "dropped"), 0);

    let (limited, summary, _) = run("minikernel-memtrace-limit", "limit=100");
    assert_eq!(limited.len(), 100);
    assert!(summary_value(&summary, "dropped") > 0, "{summary}");
}
