//! The mini-kernel boots natively under kpin's VMM, with the steps this KVM cannot run
//! natively skipped, and prints `expected.txt` line by line (minus those steps), ending in
//! a clean poweroff.

use std::time::Duration;

use kpin_tests::{compare_minikernel_transcript, minikernel_expected, require_kvm, run_minikernel};
use vmm::guests::MINIKERNEL_NATIVE_CMDLINE;
use vmm::Outcome;

#[test]
fn test_minikernel_native_transcript_matches_expected() {
    require_kvm!();
    let (report, log, _, _) = run_minikernel(
        "minikernel-native",
        MINIKERNEL_NATIVE_CMDLINE,
        None,
        Duration::from_secs(300),
    );
    assert_eq!(
        report.outcome,
        Outcome::Poweroff,
        "console:\n{log}\ndump:\n{}",
        report.dump.unwrap_or_default()
    );
    let expected = minikernel_expected();
    match compare_minikernel_transcript(&log, &expected) {
        Ok(skipped) => println!(
            "mini-kernel native run matched expected.txt with {skipped} step(s) skipped in {:.2} s",
            report.wall.as_secs_f64()
        ),
        Err(e) => panic!("{e}\nconsole:\n{log}"),
    }
}
