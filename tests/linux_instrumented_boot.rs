//! The pinned Debian kernel boots fully instrumented (`--tool null`): every guest
//! instruction, kernel and user, runs from the engine's code cache; the kernel reaches
//! the busybox initramfs, `/init` prints `KPIN-USERSPACE-OK`, runs the default workload,
//! prints `KPIN-WORKLOAD-DONE <md5>` with the md5 the host computes for it, and reboots
//! (an i8042 reset: the run ends as a poweroff). The console must show no kernel warning,
//! stall, lockup, unstable clocksource or MSR access the kernel had to recover from: those
//! mean the guest noticed the engine. Under `bbcount` the same boot splits its
//! instructions between kernel and user and names the hottest kernel blocks from the
//! System.map. (Natively the boot stops at `int3_selftest` here:
//! docs/linux-native-boot.md.)

use std::path::PathBuf;
use std::time::Duration;

use kpin_images::LinuxImages;
use kpin_tests::{engine_config, require_kvm, run_guest, scratch_dir};
use kpin_tool_bbcount::parse_csv;
use kpin_tool_bbcount::report::{BbcountSummary, HotBlock};
use vmm::diag::kernel_symbols::KernelSymbols;
use vmm::guests::LINUX_CMDLINE;
use vmm::{Outcome, RunReport, VmConfig};

/// The whole boot and workload take ~30 s here; the budget leaves room for a slower or
/// busier machine.
const BOOT_BUDGET: Duration = Duration::from_secs(240);

/// Boots the pinned Debian kernel with its initramfs under `tool`; returns the report,
/// the console, the tail of `engine.log` and the output directory.
fn boot_instrumented(name: &str, tool: &str) -> (RunReport, String, String, PathBuf, LinuxImages) {
    let images = kpin_images::default_out_dir();
    let linux = kpin_images::ensure_linux(&images, &mut |l| eprintln!("images: {l}"))
        .expect("fetch and build the Linux images");
    let dir = scratch_dir(name);
    let console = dir.join("console.log");
    let cfg = VmConfig {
        kernel: linux.vmlinux.clone(),
        initrd: Some(linux.initramfs.clone()),
        cmdline: LINUX_CMDLINE.into(),
        mem_mib: 256,
        timeout: Some(BOOT_BUDGET),
        console_file: Some(console.clone()),
        echo_console: false,
        system_map: Some(linux.system_map.clone()),
        engine: Some(engine_config(tool, "")),
    };
    let (report, _) = run_guest(&cfg, &dir);
    let log = std::fs::read_to_string(&console).expect("console log");
    let engine_log = std::fs::read_to_string(dir.join(host_daemon::ENGINE_LOG)).unwrap_or_default();
    let tail: String = engine_log
        .lines()
        .rev()
        .take(40)
        .collect::<Vec<_>>()
        .join("\n");
    (report, log, tail, dir, linux)
}

/// The boot reached user space, ran the workload with the right md5 and powered off,
/// and the console has no line where the guest noticed the engine
/// ([`kpin_tests::noticed_the_engine`]).
fn assert_clean_boot(report: &RunReport, log: &str, engine_tail: &str) {
    assert_eq!(
        report.outcome,
        Outcome::Poweroff,
        "console:\n{log}\nengine.log (last lines, newest first):\n{engine_tail}"
    );
    assert!(log.contains("KPIN-USERSPACE-OK"), "{log}");
    let md5 = kpin_images::workload_expected_md5();
    assert!(
        log.contains(&format!("KPIN-WORKLOAD-DONE {md5}")),
        "workload md5 {md5} expected:\n{log}"
    );
    if let Some(line) = kpin_tests::noticed_the_engine(log) {
        panic!("`{line}` on the console\n{log}");
    }
}

#[test]
fn test_linux_boots_to_userspace_and_runs_the_workload_under_the_null_tool() {
    require_kvm!();
    let (report, log, engine_tail, _, _) = boot_instrumented("linux-instrumented", "null");
    assert_clean_boot(&report, &log, &engine_tail);
    println!(
        "instrumented Linux (null): workload done; powered off after {:.1} s",
        report.wall.as_secs_f64()
    );
}

#[test]
fn test_linux_under_bbcount_splits_user_and_kernel_and_names_hot_kernel_blocks() {
    require_kvm!();
    let (report, log, engine_tail, dir, linux) =
        boot_instrumented("linux-instrumented-bbcount", "bbcount");
    assert_clean_boot(&report, &log, &engine_tail);
    let csv = std::fs::read_to_string(dir.join("bbcount.csv")).expect("bbcount.csv");
    let rows = parse_csv(&csv).unwrap_or_else(|line| panic!("bbcount.csv line {line}"));
    let symbols = KernelSymbols::load(&linux.vmlinux, Some(&linux.system_map))
        .expect("read the System.map")
        .expect("symbols");
    let summary = BbcountSummary::new(&rows, Some(&symbols), 20);
    // Both the kernel and the busybox processes ran, both substantially.
    assert!(summary.cpl0 > 100_000_000, "{}", summary.render());
    assert!(summary.cpl3 > 100_000_000, "{}", summary.render());
    // Every hot kernel block is named from the System.map.
    let kernel: Vec<&HotBlock> = summary.top.iter().filter(|b| b.cpl == 0).collect();
    assert!(!kernel.is_empty(), "{}", summary.render());
    for b in &kernel {
        let name = b.symbol.as_deref().unwrap_or("");
        assert!(
            name.contains("+0x"),
            "unnamed kernel block {b:?}\n{}",
            summary.render()
        );
    }
    println!(
        "instrumented Linux (bbcount): powered off after {:.1} s\n{}",
        report.wall.as_secs_f64(),
        summary.render()
    );
}
