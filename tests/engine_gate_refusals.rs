//! The ring-0 gate serves only the engine's own call sites and checks its arguments
//! (issue #11; `guest-engine/image/src/ring0/gate.rs`): a call whose return address is not
//! in the engine's `.text`, a LOAD_CR3 of a root the engine did not build, port I/O on the
//! engine's own ports through a port operation, a WRMSR of an MSR the virtual CPU never
//! passes through, and a NOTIFY of a port that is not the engine's are each refused, and
//! the refusal ends the run in order: an engine failure, `engine.log` naming the refusal
//! with the operation and its arguments, and a dump — never a silent success or a hang.
//! The engine makes each call on purpose with `bringup.crash=gate-*` after bring-up, so
//! the same gate has just served the bring-up's own LOAD_CR3, NOTIFY and port calls.

use std::time::Duration;

use kpin_tests::{engine_config, require_kvm, run_guest, scratch_dir, tiny_elf};
use vmm::{Outcome, VmConfig};

/// Boots a tiny guest kernel (a `hlt`) under the engine with `options`; returns the
/// report and `engine.log`.
fn run_engine(name: &str, options: &str) -> (vmm::RunReport, String) {
    let dir = scratch_dir(name);
    let kernel = dir.join("guest.elf");
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

#[test]
fn test_gate_refuses_foreign_callers_and_bad_arguments_and_ends_the_run() {
    require_kvm!();
    for (crash, why, operation) in [
        (
            "gate-caller",
            "the caller's return address is not in the engine's .text",
            "RAX=0x0,",
        ),
        (
            "gate-cr3",
            "LOAD_CR3 of a root the engine did not build",
            "RAX=0x3,",
        ),
        (
            "gate-port",
            "port I/O on one of the engine's own ports",
            "RAX=0x2, RDI=0xf11,",
        ),
        (
            "gate-msr",
            "WRMSR of an MSR the virtual CPU never passes through",
            "RAX=0x4, RDI=0xc0000080,",
        ),
        (
            "gate-notify",
            "NOTIFY of a port that is not the engine's",
            "RAX=0xe, RDI=0x3f8, RSI=0x21,",
        ),
    ] {
        let (report, log) = run_engine(
            &format!("engine-{crash}"),
            &format!("bringup.probe=false bringup.gates=10 bringup.ticks=2 bringup.crash={crash}"),
        );
        assert_eq!(report.outcome, Outcome::EngineFailure, "{crash}: {log}");
        assert!(log.contains("faulting on purpose"), "{crash}: {log}");
        assert!(
            log.contains(&format!("the gate refused a call: {why}")),
            "{crash}: {log}"
        );
        assert!(
            log.contains(&format!("operation {operation}")),
            "{crash}: {log}"
        );
        // The refused call ends as a #GP at the gate's `int`, at CPL 3, with registers.
        assert!(
            log.contains("unexpected exception #GP (vector 13)"),
            "{crash}: {log}"
        );
        assert!(log.contains("rax=0x"), "{crash}: {log}");
        assert!(!log.contains("did not fault"), "{crash}: {log}");
        assert!(!log.contains("bring-up complete"), "{crash}: {log}");
        assert!(report.dump.is_some(), "{crash}");
    }
}
