//! The engine image boots in the stolen region (issue #4, bring-up slice): the VMM boots
//! the guest as natively, captures that state into the attach block and enters the
//! engine, which logs the guest's RIP/CR3 as it read them, measures the ring-0 gate and
//! takes PIT ticks at CPL 3 through its ring-0 stubs, switches to page tables of its own
//! (whose physmap reads the guest's zero page), then runs the guest (here a `hlt` with
//! interrupts off, which it reports as unsupported; `engine_runs_guest_code.rs` tests
//! running guest code). A deliberate engine fault (#PF, #UD, #GP at CPL 3 or in a
//! ring-0 stub, #DF on its IST stack)
//! ends the run as an engine failure with the fault report in `engine.log` — never a hang.

use std::time::Duration;

use kpin_tests::{engine_config, require_kvm, run_guest, scratch_dir, tiny_elf, TINY_LOAD_ADDR};
use vmm::layout::BOOT_PML4_START;
use vmm::{Outcome, VmConfig};

/// Boots a tiny guest kernel under the engine with `options`; returns the outcome, the
/// dump and `engine.log`.
fn run_engine(name: &str, options: &str) -> (vmm::RunReport, String) {
    let dir = scratch_dir(name);
    let kernel = dir.join("guest.elf");
    // The guest's first instruction, `hlt` with interrupts off, stops the engine.
    std::fs::write(&kernel, tiny_elf(&[0xf4; 16])).unwrap();
    let cfg = VmConfig {
        mem_mib: 64,
        timeout: Some(Duration::from_secs(60)),
        engine: Some(engine_config("null", options)),
        ..VmConfig::new(kernel)
    };
    let (report, _) = run_guest(&cfg, &dir);
    let log = std::fs::read_to_string(dir.join(host_daemon::ENGINE_LOG)).unwrap_or_default();
    (report, log)
}

/// The number just before `marker` in `text` (`"... 17 of"` → 17 for `" of"`).
fn number_before(text: &str, marker: &str) -> Option<u64> {
    let end = text.find(marker)?;
    let start = text[..end].rfind(|c: char| !c.is_ascii_digit())? + 1;
    text[start..end].parse().ok()
}

#[test]
fn test_engine_boots_measures_gate_and_timer_then_stops_cleanly() {
    require_kvm!();
    let (report, log) = run_engine("engine-boot", "bringup.gates=500 bringup.ticks=10");
    assert_eq!(
        report.outcome,
        Outcome::EngineFailure,
        "{log}\n{:?}",
        report.dump
    );
    // The attach block carries the guest's native entry state.
    assert!(
        log.contains(&format!(
            "guest RIP={TINY_LOAD_ADDR:#x} RSP=0x8ff0 RSI=0x7000"
        )),
        "{log}"
    );
    assert!(
        log.contains(&format!(" CR3={BOOT_PML4_START:#x} ")),
        "{log}"
    );
    assert!(log.contains("EFER=0x500 CS=0x10 (L=1)"), "{log}");
    assert!(log.contains("tool \"null\""), "{log}");
    // The gate works, N round trips of it.
    assert!(log.contains("gate: 500 NOP round trips in "), "{log}");
    assert!(log.contains("KERNEL_GS_BASE round-trips"), "{log}");
    // The guest's GS base switched the engine's way (wrgsbase or the gate) reads back.
    assert!(log.contains("fsgsbase: CR4.FSGSBASE "), "{log}");
    assert!(log.contains("RDMSR reads it back"), "{log}");
    // Timer ticks interrupted CPL 3 and came back through the ring-0 stub.
    let ticks_line = log
        .lines()
        .find(|l| l.contains("timer: ") && l.contains("PIT ticks"))
        .unwrap_or_else(|| panic!("no timer line: {log}"));
    // At least the 10 asked for: under host load two ticks can land between two polls.
    let ticks = number_before(ticks_line, " PIT ticks").expect("tick count");
    assert!(ticks >= 10, "{ticks_line}");
    let at_cpl3 = number_before(ticks_line, " of ").expect("CPL-3 count");
    assert!(at_cpl3 >= ticks, "{ticks_line}");
    assert!(log.contains("3 HLT gates woke"), "{log}");
    // The address-space probe ran; reading through the window's own slot works.
    assert!(
        log.contains(
            "probe: PML4 slots 257-257 (0xffff808000000000-0xffff80ffffffffff): CPL-3 reads work"
        ),
        "{log}"
    );
    // The engine switched to page tables of its own; its physmap reaches guest RAM.
    assert!(
        log.contains("paging: running on the engine's own page tables"),
        "{log}"
    );
    assert!(
        log.contains("the guest's zero page at 0x7000: header magic \"HdrS\""),
        "{log}"
    );
    assert!(log.contains("engine: bring-up took "), "{log}");
    assert!(
        log.contains("[Info] engine: bring-up complete (tool null)"),
        "{log}"
    );
    assert!(
        log.contains("[Error] engine: unsupported sensitive instruction `hlt` (Halt) at guest RIP 0x100000: guest halted with interrupts disabled"),
        "{log}"
    );
    assert!(report.dump.is_some());
}

#[test]
fn test_engine_faults_are_reported_with_vector_rip_cr2_and_never_hang() {
    require_kvm!();
    for (crash, want) in [
        (
            "pf",
            "unexpected exception #PF (vector 14) in the engine: error code 0x4",
        ),
        ("ud", "unexpected exception #UD (vector 6)"),
        ("gp", "unexpected exception #GP (vector 13)"),
        ("df", "unexpected exception #DF (vector 8)"),
        (
            "ring0",
            "unexpected exception #GP (vector 13) in the engine: error code 0x0",
        ),
    ] {
        let (report, log) = run_engine(
            &format!("engine-crash-{crash}"),
            &format!("bringup.gates=10 bringup.ticks=2 bringup.probe=false bringup.crash={crash}"),
        );
        assert_eq!(report.outcome, Outcome::EngineFailure, "{crash}: {log}");
        assert!(log.contains(want), "{crash}: {log}");
        assert!(log.contains("RIP 0xffff8080002"), "{crash}: {log}");
        assert!(log.contains("rax=0x"), "{crash}: registers missing: {log}");
        assert!(!log.contains("bring-up complete"), "{crash}: {log}");
        assert!(report.dump.is_some());
        if crash == "pf" {
            assert!(log.contains("CR2 0x1000"), "{log}");
            assert!(
                log.contains("not-present page on a read access from CPL 3"),
                "{log}"
            );
        }
        if crash == "ring0" {
            assert!(log.contains("CS 0x8 (CPL 0)"), "{log}");
        }
        if crash == "df" {
            assert!(log.contains("#DF taken on its IST stack"), "{log}");
        }
    }
}

#[test]
fn test_fault_while_reporting_a_fault_ends_the_run_from_ring_0() {
    require_kvm!();
    let (report, log) = run_engine(
        "engine-crash-nested",
        "bringup.gates=10 bringup.ticks=2 bringup.probe=false bringup.crash=nested",
    );
    assert_eq!(report.outcome, Outcome::EngineFailure, "{log}");
    assert!(log.contains("faulting on purpose"), "{log}");
    assert!(!log.contains("unexpected exception"), "{log}");
    let dump = report.dump.expect("a dump");
    // The vCPU stopped in the ring-0 nested-fault path (CPL 0), not in a loop at CPL 3.
    assert!(dump.contains("CS  sel=0008"), "{dump}");
}

#[test]
fn test_bad_bringup_option_is_reported_by_the_engine() {
    require_kvm!();
    let (report, log) = run_engine("engine-badopt", "bringup.nonsense=1");
    assert_eq!(report.outcome, Outcome::EngineFailure);
    assert!(
        log.contains("bad bring-up option \"bringup.nonsense=1\""),
        "{log}"
    );
}
