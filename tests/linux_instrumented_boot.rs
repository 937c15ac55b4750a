//! The pinned Debian kernel boots fully instrumented (`--tool null`): every guest
//! instruction, kernel and user, runs from the engine's code cache; the kernel reaches
//! the busybox initramfs, `/init` prints `KPIN-USERSPACE-OK`, runs the default workload,
//! prints `KPIN-WORKLOAD-DONE <md5>` with the md5 the host computes for it, and reboots
//! (an i8042 reset: the run ends as a poweroff). The console must show no kernel warning
//! and no MSR access the kernel had to recover from: those mean the virtual CPU differs
//! from the CPU the native boot sees. (Natively the boot stops at `int3_selftest` here:
//! docs/linux-native-boot.md.)

use std::time::Duration;

use kpin_tests::{kvm_available, run_guest, scratch_dir};
use vmm::guests::LINUX_CMDLINE;
use vmm::{Outcome, VmConfig};

/// The whole boot and workload take ~30 s here; the budget leaves room for a slower or
/// busier machine.
const BOOT_BUDGET: Duration = Duration::from_secs(240);

#[test]
fn test_linux_boots_to_userspace_and_runs_the_workload_under_the_null_tool() {
    if !kvm_available("test_linux_boots_to_userspace_and_runs_the_workload_under_the_null_tool") {
        return;
    }
    let images = kpin_images::default_out_dir();
    let linux = kpin_images::ensure_linux(&images, &mut |l| eprintln!("images: {l}"))
        .expect("fetch and build the Linux images");
    let engine = kpin_images::ensure_engine(&images, &mut |l| eprintln!("images: {l}"))
        .expect("build the engine image");
    let dir = scratch_dir("linux-instrumented");
    let console = dir.join("console.log");
    let cfg = VmConfig {
        kernel: linux.vmlinux,
        initrd: Some(linux.initramfs),
        cmdline: LINUX_CMDLINE.into(),
        mem_mib: 256,
        timeout: Some(BOOT_BUDGET),
        console_file: Some(console.clone()),
        echo_console: false,
        system_map: Some(linux.system_map),
        engine: Some(vmm::EngineConfig {
            image: engine,
            tool: "null".into(),
            options: String::new(),
        }),
    };
    let (report, _) = run_guest(&cfg, &dir);
    let log = std::fs::read_to_string(&console).expect("console log");
    let engine_log =
        std::fs::read_to_string(dir.join(host_daemon::ENGINE_LOG)).unwrap_or_default();
    let tail = |s: &str| s.lines().rev().take(40).collect::<Vec<_>>().join("\n");
    assert_eq!(
        report.outcome,
        Outcome::Poweroff,
        "console (last lines, newest first):\n{}\nengine.log:\n{}",
        tail(&log),
        tail(&engine_log)
    );
    assert!(log.contains("KPIN-USERSPACE-OK"), "{log}");
    let md5 = kpin_images::workload_expected_md5();
    assert!(
        log.contains(&format!("KPIN-WORKLOAD-DONE {md5}")),
        "workload md5 {md5} expected:\n{log}"
    );
    for bad in ["WARNING:", "unchecked MSR access", "Call Trace", "BUG:", "KPIN-INIT-WARNING"] {
        assert!(!log.contains(bad), "`{bad}` on the console:\n{log}");
    }
    println!(
        "instrumented Linux: workload done; powered off after {:.1} s",
        report.wall.as_secs_f64()
    );
}
