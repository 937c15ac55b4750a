//! `--tool insmix` on the mini-kernel (issue #13): the guest prints its whole transcript
//! and powers off, and `insmix.json`'s dynamic counts agree with the engine's own count
//! of guest instructions — the same relation as bbcount's (blocks counted by the tool, plus
//! what the engine emulated, minus what faults cut short), here per mnemonic summed — with
//! both CPLs present and a static count behind every executed mnemonic.

use std::time::Duration;

use kpin_tests::{
    compare_minikernel_transcript, engine_counters, json_u64, minikernel_expected, require_kvm,
    run_minikernel_with_options,
};
use vmm::Outcome;

#[test]
fn test_minikernel_insmix_counts_sum_to_the_engines_instruction_count() {
    require_kvm!();
    let (report, console, log, dir) = run_minikernel_with_options(
        "minikernel-insmix",
        "",
        Some(("insmix", "")),
        Duration::from_secs(300),
    );
    assert_eq!(
        report.outcome,
        Outcome::Poweroff,
        "console:\n{console}\nengine log:\n{log}\ndump:\n{}",
        report.dump.unwrap_or_default()
    );
    compare_minikernel_transcript(&console, &minikernel_expected())
        .unwrap_or_else(|e| panic!("{e}\n{console}"));

    let read = |name: &str| {
        let text = std::fs::read_to_string(dir.join(name))
            .unwrap_or_else(|e| panic!("{name}: {e}; engine log:\n{log}"));
        serde_json::from_str::<serde_json::Value>(&text)
            .unwrap_or_else(|e| panic!("{name} is not JSON ({e}):\n{text}"))
    };
    let mix = read("insmix.json");
    let engine = engine_counters(&dir);
    let rows = mix["mnemonics"].as_array().expect("a mnemonics array");
    let sum = |key: &str| {
        rows.iter()
            .map(|r| json_u64(r, &format!("/{key}")))
            .sum::<u64>()
    };
    let (kernel, user) = (sum("kernel"), sum("user"));
    assert!(
        kernel > 0 && user > 0,
        "both CPLs ran counted blocks: {mix}"
    );
    for r in rows {
        let executed = json_u64(r, "/kernel") + json_u64(r, "/user");
        let seen = json_u64(r, "/static_kernel") + json_u64(r, "/static_user");
        assert!(
            executed == 0 || seen > 0,
            "executed but never seen statically: {r}"
        );
    }
    assert_eq!(
        json_u64(&mix, "/emulated"),
        json_u64(&engine, "/guest_instructions/emulated"),
        "insmix's emulated line is the engine's"
    );
    assert_eq!(
        kernel + user + json_u64(&engine, "/guest_instructions/emulated")
            - json_u64(&engine, "/guest_instructions/taken_back_after_faults"),
        json_u64(&engine, "/guest_instructions/cpl0")
            + json_u64(&engine, "/guest_instructions/cpl3"),
        "insmix's mnemonic counts and the engine's count disagree\n{engine}"
    );
    let table = std::fs::read_to_string(dir.join("insmix.txt")).expect("insmix.txt");
    assert!(
        table.lines().any(|l| l.ends_with("  mov")),
        "no mov row in insmix.txt:\n{table}"
    );
}
