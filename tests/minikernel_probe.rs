//! Issue #11's probe under the mini-kernel's user mode (`kpin.probe=1`, step 19
//! `user-probe`, `guests/minikernel/src/steps/probe.rs`): a ring-3 task reads and writes the
//! first address of every PML4 slot of both halves and eight targets — the engine window
//! (its start with the attach block, the engine image, the code cache), the engine's
//! physmap (guest-physical 0, the zero page, this kernel's image) and two non-canonical
//! addresses. None is mapped for user mode, so each of the 1040 accesses must fault: a #PF
//! with CR2 = the address and the U/S and W/R bits of the access (1036), or #GP(0) (4). The
//! kernel checks and counts each fault, the run powers off, and the transcript under the
//! engine equals the native one line for line.
//!
//! Natively this holds on this KVM. Under the engine it fails until the translator keeps
//! guest code out of the engine's memory (issue #11, wt/sfi): today the first access to
//! slot 256 ends the run with "shadow MMU failure ... reserved for the engine".

use std::time::Duration;

use kpin_tests::{minikernel_body, require_kvm, run_minikernel};
use vmm::guests::MINIKERNEL_NATIVE_CMDLINE;
use vmm::Outcome;

/// The probe's line when every access faulted as the architecture says: 2 × (512 + 8)
/// accesses, the 2 × 2 to non-canonical addresses #GP(0), the rest #PF.
const PROBE_LINE: &str =
    "step 19 user-probe: 1040 accesses: pf=1036 gp=4 wrong=0 not-faulted=0 all-faulted ok";

/// Boots the mini-kernel with the probe (and the native-unsafe steps skipped, so that the
/// two runs print the same steps); returns the transcript body.
fn run_probe(name: &str, tool: Option<&str>) -> String {
    let (report, console, log, _) = run_minikernel(
        name,
        &format!("{MINIKERNEL_NATIVE_CMDLINE} kpin.probe=1"),
        tool,
        Duration::from_secs(300),
    );
    let context = format!(
        "console:\n{console}\nengine log:\n{log}\ndump:\n{}",
        report.dump.clone().unwrap_or_default()
    );
    assert!(
        console.lines().any(|l| l == PROBE_LINE),
        "`{PROBE_LINE}` expected\n{context}"
    );
    assert_eq!(report.outcome, Outcome::Poweroff, "{context}");
    let (body, _) = minikernel_body(&console).unwrap_or_else(|e| panic!("{e}\n{context}"));
    body.to_string()
}

#[test]
fn test_user_mode_probe_faults_on_every_slot_natively_and_under_the_engine() {
    require_kvm!();
    let native = run_probe("minikernel-probe-native", None);
    let instrumented = run_probe("minikernel-probe-null", Some("null"));
    for (i, (n, e)) in native.lines().zip(instrumented.lines()).enumerate() {
        assert_eq!(e, n, "line {} differs under the engine", i + 1);
    }
    assert_eq!(instrumented, native);
}
