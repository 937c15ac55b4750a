//! The second pinned kernel, Debian's 6.12 LTS cloud kernel (`kpin_images::GuestKernel::
//! Debian612`), boots fully instrumented (`--tool null`) with its distribution command line
//! (`vmm::guests::LINUX_612_CMDLINE`: KASLR, XSAVE and the default mitigations left on):
//! it reaches the busybox initramfs, `/init` prints `KPIN-USERSPACE-OK`, runs the default
//! workload (busybox part and the native test programs) and prints `KPIN-WORKLOAD-DONE`
//! with the md5 the host computes, and the guest ends with a clean reset (exit 0).
//! Two ways in: the kernel ELF (as `kpin run --guest linux-6.12` boots it) and the
//! distribution's bzImage, whose decompressor applies KASLR.
//!
//! Issue #10. Both tests are ignored until the engine runs this kernel to the end (run
//! them with `cargo test --release -p kpin-tests --test linux_612_boots_with_its_default_cmdline
//! -- --ignored`). Measured 2026-11-23 on this host: both boots print `Run /init as init
//! process` after ~37 s of guest time (the bzImage's after its decompressor randomised the
//! kernel's address), then the engine stops at `verw` (0f 00 2d) in
//! `swapgs_restore_regs_and_return_to_usermode`, on the first return to user space: the
//! kernel clears CPU buffers there ("Transient Scheduler Attacks: Mitigation: Clear CPU
//! buffers") and the engine's virtual CPU does not emulate `verw` yet. (The end of the
//! run is not in the way: `/init`'s `reboot -f` resets the machine cleanly, as the
//! variant below shows.)
//!
//! What runs in CI meanwhile: the same bzImage (decompressor, KASLR) with the default
//! command line plus `mitigations=off`, which keeps the kernel off `verw`. That boot
//! reaches user space, passes every test program, prints the host's md5 and resets
//! cleanly (~35-50 s here), so everything but the mitigations is covered. Its console
//! still has one complaint, not asserted yet: "unchecked MSR access error: WRMSR to 0x400"
//! from `__mcheck_cpu_init_clear_banks` (the engine's virtual MSR file has no
//! machine-check bank MSRs; the 6.1 guest's console has no such line).

use std::path::PathBuf;
use std::time::Duration;

use kpin_images::{GuestKernel, LinuxImages};
use kpin_tests::{engine_config, require_kvm, run_guest, scratch_dir};
use vmm::guests::LINUX_612_CMDLINE;
use vmm::{Outcome, VmConfig};

/// The 6.1 guest's boot and workload take ~30 s here; 6.12 reaches `/init` after ~40 s
/// under the engine. The budget leaves room for a slower or busier machine.
const BOOT_BUDGET: Duration = Duration::from_secs(300);

/// Boots the 6.12 kernel (`kernel` picks vmlinux or bzImage from `linux`) with `cmdline`
/// under the null tool and checks the whole run.
fn boot_and_check(name: &str, kernel: fn(&LinuxImages) -> PathBuf, cmdline: &str) {
    let linux = kpin_images::ensure_linux_kernel(
        GuestKernel::Debian612,
        &kpin_images::default_out_dir(),
        &mut |l| eprintln!("images: {l}"),
    )
    .expect("fetch and build the 6.12 images");
    let dir = scratch_dir(name);
    let console = dir.join("console.log");
    let cfg = VmConfig {
        kernel: kernel(&linux),
        initrd: Some(linux.initramfs.clone()),
        cmdline: cmdline.into(),
        mem_mib: 256,
        timeout: Some(BOOT_BUDGET),
        console_file: Some(console.clone()),
        echo_console: false,
        system_map: Some(linux.system_map.clone()),
        engine: Some(engine_config("null", "")),
    };
    let (report, _) = run_guest(&cfg, &dir);
    let log = std::fs::read_to_string(&console).expect("console log");
    let engine_log = std::fs::read_to_string(dir.join(host_daemon::ENGINE_LOG)).unwrap_or_default();
    let engine_tail: Vec<&str> = engine_log.lines().rev().take(40).collect();
    let context = format!(
        "output in {}\nconsole:\n{log}\nengine.log (last lines, newest first):\n{}",
        dir.display(),
        engine_tail.join("\n")
    );

    assert!(
        log.contains(&format!("Linux version {}", linux.kernel_version)),
        "not the 6.12 kernel?\n{context}"
    );
    assert!(
        log.contains(&format!("Command line: {cmdline}")),
        "{context}"
    );
    assert!(
        log.contains("KPIN-USERSPACE-OK"),
        "no user space\n{context}"
    );
    for name in kpin_images::PROGRAMS {
        assert!(
            log.contains(&format!("KPIN-TEST {name} ok ")),
            "test program {name} did not pass\n{context}"
        );
    }
    let md5 = kpin_images::workload_expected_md5();
    assert!(
        log.contains(&format!("KPIN-WORKLOAD-DONE {md5}")),
        "workload md5 {md5} expected\n{context}"
    );
    assert_eq!(report.outcome, Outcome::Poweroff, "{context}");
    // Not asserted yet (issue #10): lines where the kernel noticed the engine, e.g. the
    // #GP on writes to the machine-check bank MSRs (0x400…) that the virtual MSR file
    // lacks ("unchecked MSR access error: WRMSR to 0x400"). Shown so they are not lost.
    for line in log.lines().filter(|l| {
        ["unchecked MSR access", "WARNING:", "BUG:", "Oops"]
            .iter()
            .any(|bad| l.contains(bad))
    }) {
        println!("6.12 ({name}) noticed: {line}");
    }
    println!(
        "6.12 under the null tool ({name}): workload done; powered off after {:.1} s",
        report.wall.as_secs_f64()
    );
}

#[test]
#[ignore = "issue #10: under the engine the boot reaches `Run /init` and stops at `verw` in swapgs_restore_regs_and_return_to_usermode (TSA/MDS buffer clearing), not emulated yet"]
fn test_linux_612_vmlinux_boots_to_userspace_runs_the_workload_and_powers_off() {
    require_kvm!();
    boot_and_check(
        "linux-612-vmlinux",
        |l| l.vmlinux.clone(),
        LINUX_612_CMDLINE,
    );
}

#[test]
#[ignore = "issue #10: through the decompressor (KASLR on) the boot reaches `Run /init` and stops at `verw` in swapgs_restore_regs_and_return_to_usermode, not emulated yet"]
fn test_linux_612_bzimage_with_kaslr_boots_to_userspace_runs_the_workload_and_powers_off() {
    require_kvm!();
    boot_and_check(
        "linux-612-bzimage",
        |l| l.bzimage.clone(),
        LINUX_612_CMDLINE,
    );
}

#[test]
fn test_linux_612_bzimage_with_mitigations_off_boots_to_userspace_runs_the_workload_and_powers_off()
{
    require_kvm!();
    boot_and_check(
        "linux-612-bzimage-mitigations-off",
        |l| l.bzimage.clone(),
        &format!("{LINUX_612_CMDLINE} mitigations=off"),
    );
}
