//! The pinned Debian kernel, booted natively (uninstrumented) under kpin's VMM, gets at
//! least as far as its version banner on COM1.
//!
//! It cannot get much further here: this host's KVM runs guest ring-0 code through its
//! instruction emulator, slowly, and stops at the first instruction it cannot emulate
//! (see docs/linux-native-boot.md). The run is cut off by a timeout well after the banner.

use std::time::Duration;

use kpin_tests::{require_kvm, run_guest, scratch_dir};
use vmm::guests::LINUX_CMDLINE;
use vmm::VmConfig;

/// The banner appears after ~11 s here; the timeout leaves room for a slower machine.
const BOOT_BUDGET: Duration = Duration::from_secs(45);

#[test]
fn test_linux_native_boot_prints_version_banner() {
    require_kvm!();
    let images = kpin_images::default_out_dir();
    let linux = kpin_images::ensure_linux(&images, &mut |l| eprintln!("images: {l}"))
        .expect("fetch and build the Linux images");
    let dir = scratch_dir("linux-native");
    let console = dir.join("console.log");
    let cfg = VmConfig {
        initrd: Some(linux.initramfs),
        cmdline: LINUX_CMDLINE.into(),
        timeout: Some(BOOT_BUDGET),
        console_file: Some(console.clone()),
        system_map: Some(linux.system_map),
        ..VmConfig::new(linux.vmlinux)
    };
    let (report, _) = run_guest(&cfg, &dir);
    let log = std::fs::read_to_string(&console).expect("console log");
    let banner = format!("Linux version {}", linux.kernel_version);
    assert!(
        log.contains(&banner),
        "no `{banner}` on the console; outcome {:?}\nconsole:\n{log}\ndump:\n{}",
        report.outcome,
        report.dump.unwrap_or_default()
    );
    assert!(
        log.contains(&format!("Command line: {LINUX_CMDLINE}")),
        "{log}"
    );
    println!(
        "native Linux: banner seen; run ended with `{}` after {:.1} s, {} console bytes",
        report.outcome.describe(),
        report.wall.as_secs_f64(),
        report.console_bytes
    );
}
