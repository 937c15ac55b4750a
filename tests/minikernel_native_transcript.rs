//! The mini-kernel boots natively under kpin's VMM, with the steps this KVM cannot run
//! natively skipped, and prints `expected.txt` line by line (minus those steps), ending in
//! a clean poweroff.

use std::time::Duration;

use kpin_tests::{compare_minikernel_transcript, kvm_available, run_guest, scratch_dir};
use vmm::guests::MINIKERNEL_NATIVE_CMDLINE;
use vmm::{Outcome, VmConfig};

#[test]
fn test_minikernel_native_transcript_matches_expected() {
    if !kvm_available("test_minikernel_native_transcript_matches_expected") {
        return;
    }
    let images = kpin_images::default_out_dir();
    let kernel = kpin_images::ensure_minikernel(&images, &mut |l| eprintln!("images: {l}"))
        .expect("build the mini-kernel");
    let dir = scratch_dir("minikernel-native");
    let console = dir.join("console.log");
    let cfg = VmConfig {
        kernel,
        initrd: None,
        cmdline: MINIKERNEL_NATIVE_CMDLINE.into(),
        mem_mib: 256,
        timeout: Some(Duration::from_secs(300)),
        console_file: Some(console.clone()),
        echo_console: false,
        system_map: None,
        engine: None,
    };
    let (report, _) = run_guest(&cfg, &dir);
    let log = std::fs::read_to_string(&console).expect("console log");
    assert_eq!(
        report.outcome,
        Outcome::Poweroff,
        "console:\n{log}\ndump:\n{}",
        report.dump.unwrap_or_default()
    );
    let expected = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/guests/minikernel/expected.txt"
    ))
    .expect("expected.txt");
    match compare_minikernel_transcript(&log, &expected) {
        Ok(skipped) => println!(
            "mini-kernel native run matched expected.txt with {skipped} step(s) skipped in {:.2} s",
            report.wall.as_secs_f64()
        ),
        Err(e) => panic!("{e}\nconsole:\n{log}"),
    }
}
