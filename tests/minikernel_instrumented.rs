//! The mini-kernel runs fully instrumented (issue #4): under `--tool null` it prints
//! `expected.txt` exactly — every step, including those this KVM cannot run natively
//! (`syscall` at CPL 3, selector reads at CPL 3) — and powers off; the engine's
//! `counters.json` reports work at both virtual CPLs and a cycle profile; under `--tool bbcount` the per-block
//! counts, with the instructions the engine emulated outside the cache, sum to the
//! engine's own instruction count and the body of `known_loop_1000`
//! runs exactly 1000 times.

use std::path::PathBuf;
use std::time::Duration;

use kpin_tests::attach::known_loop_runs;
use kpin_tests::{
    compare_minikernel_transcript, engine_counters, json_u64, minikernel_expected, require_kvm,
    run_minikernel,
};
use kpin_tool_bbcount::parse_csv;
use vmm::{Outcome, RunReport};

/// Runs the mini-kernel under `tool` with no step skipped; returns the report, the
/// console, `engine.log` and the output directory.
fn run_instrumented(name: &str, tool: &str) -> (RunReport, String, String, PathBuf) {
    run_minikernel(name, "", Some(tool), Duration::from_secs(300))
}

#[test]
fn test_minikernel_under_null_tool_prints_every_step_of_expected_txt() {
    require_kvm!();
    let (report, console, log, dir) = run_instrumented("minikernel-null", "null");
    assert_eq!(
        report.outcome,
        Outcome::Poweroff,
        "console:\n{console}\nengine log:\n{log}\ndump:\n{}",
        report.dump.unwrap_or_default()
    );
    match compare_minikernel_transcript(&console, &minikernel_expected()) {
        Ok(0) => {}
        Ok(n) => panic!("{n} step(s) skipped under the engine\n{console}"),
        Err(e) => panic!("{e}\nconsole:\n{console}\nengine log:\n{log}"),
    }
    let c = engine_counters(&dir);
    println!(
        "mini-kernel under --tool null: {:.2} s\n{}",
        report.wall.as_secs_f64(),
        serde_json::to_string_pretty(&c).unwrap()
    );
    // Steps 10, 12, 15-18 run code at virtual CPL 3; everything else at CPL 0.
    assert!(json_u64(&c, "/guest_instructions/cpl0") > 0, "{c}");
    assert!(json_u64(&c, "/guest_instructions/cpl3") > 0, "{c}");
    // Step 08 (10 ticks), 14 (1) and 16 (3 at CPL 3) take timer interrupts.
    assert!(json_u64(&c, "/events/interrupts_delivered") >= 14, "{c}");
    // Steps 03-06, 12 and 15 take exceptions (#DE, #UD, 2 #GP, #PF, user #PF x2, 4 #GP).
    assert!(json_u64(&c, "/events/exceptions_delivered") >= 10, "{c}");
    // Step 13 patches code it has run through an alias.
    assert!(json_u64(&c, "/smc/frames_invalidated") >= 1, "{c}");
    assert!(json_u64(&c, "/shadow/fills") > 0, "{c}");
    assert!(json_u64(&c, "/gate_calls") > 0, "{c}");
    // The cycle profile: exclusive activities that add up to its total, with entries
    // that match the counters they mirror.
    let total = json_u64(&c, "/profile/total_cycles");
    let rows = c["profile"].as_object().expect("profile object");
    let sum: u64 = rows
        .values()
        .filter_map(|v| v.get("cycles").and_then(serde_json::Value::as_u64))
        .sum();
    assert_eq!(sum, total, "{c}");
    assert!(json_u64(&c, "/profile/translated_code/cycles") > 0, "{c}");
    assert!(json_u64(&c, "/profile/emulate_port_i_o/count") > 0, "{c}");
    assert_eq!(
        json_u64(&c, "/profile/page_fault_write_to_a_code_frame_smc/count"),
        json_u64(&c, "/shadow/write_protect_faults"),
        "{c}"
    );
    let table = std::fs::read_to_string(dir.join("profile.txt")).expect("profile.txt");
    assert!(table.contains("translated code"), "{table}");
}

#[test]
fn test_minikernel_bbcount_sums_to_engine_count_and_counts_known_loop_exactly() {
    require_kvm!();
    let (report, console, log, dir) = run_instrumented("minikernel-bbcount", "bbcount");
    assert_eq!(
        report.outcome,
        Outcome::Poweroff,
        "console:\n{console}\nengine log:\n{log}\ndump:\n{}",
        report.dump.unwrap_or_default()
    );
    compare_minikernel_transcript(&console, &minikernel_expected())
        .unwrap_or_else(|e| panic!("{e}\n{console}"));

    let csv = std::fs::read_to_string(dir.join("bbcount.csv")).expect("bbcount.csv");
    let rows = parse_csv(&csv).unwrap_or_else(|line| panic!("bbcount.csv line {line}:\n{csv}"));
    // Two counting mechanisms agree: bbcount's block counters (inserted by the tool)
    // and the engine's own per-mode count, which also counts the sensitive instructions
    // it emulated and takes back what a fault cut short of a counted block.
    let c = engine_counters(&dir);
    let blocks: u64 = rows
        .iter()
        .map(|r| u64::from(r.instructions) * r.count)
        .sum();
    let engine =
        json_u64(&c, "/guest_instructions/cpl0") + json_u64(&c, "/guest_instructions/cpl3");
    assert!(blocks > 0, "{c}");
    // Both virtual CPLs have counted blocks (steps 10, 12, 15-18 run user code).
    for cpl in [0, 3] {
        assert!(
            rows.iter().any(|r| r.cpl == cpl && r.count > 0),
            "no CPL {cpl} block ran"
        );
    }
    assert_eq!(
        blocks + json_u64(&c, "/guest_instructions/emulated")
            - json_u64(&c, "/guest_instructions/taken_back_after_faults"),
        engine,
        "bbcount's blocks and the engine's count disagree\n{c}"
    );

    // Every executed block that covers the loop body's first instruction (the target of
    // the function's only backward branch).
    assert_eq!(known_loop_runs(&rows), 1000, "rows: {rows:?}");
}
