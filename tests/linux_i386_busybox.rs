//! Issue #22's "must show": a real i386 program runs the default workload's checks.
//! Debian's busybox-static built for i386 (pinned, `kpin_images::ensure_busybox_i386`)
//! replaces `/bin/busybox` in the initramfs, so that `/init` itself, every shell
//! pipeline, awk, sort, md5sum and the 64 fork/execs of the default workload run as 32-bit
//! code (compatibility mode, translated by the engine); only `/bin/kpin-test` stays
//! 64-bit. The workload's md5 must be the one the host computes, the run must power off
//! cleanly, and no 32-bit instruction may have been refused (`user_unsupported_ud`).

use std::process::Command;

use kpin_tests::{kpin_bin, kpin_run, require_kvm, scratch_dir};
use vmm::guests::LINUX_CMDLINE;

/// Seconds kpin may run the guest (about 4 s here).
const BUDGET_SECONDS: &str = "240";

#[test]
fn test_the_default_workload_runs_under_an_i386_busybox() {
    require_kvm!();
    let out_dir = kpin_images::default_out_dir();
    let mut progress = |line: &str| eprintln!("images: {line}");
    let linux = kpin_images::ensure_linux(&out_dir, &mut progress).expect("Linux images");
    let busybox = kpin_images::ensure_busybox_i386(&out_dir, &mut progress)
        .expect("the i386 busybox (.ci/setup adds the i386 architecture to apt)");
    let elf = std::fs::read(&busybox).expect("read the i386 busybox");
    assert_eq!(elf.get(4), Some(&1), "ELFCLASS32: a 32-bit program");
    let dir = scratch_dir("linux-i386-busybox");
    let mut initrd = std::fs::read(&linux.initramfs).expect("read the initramfs");
    initrd.extend(kpin_images::overlay(&[("bin/busybox", &elf, 0o755)]).expect("overlay"));
    let rd = dir.join("i386.cpio");
    std::fs::write(&rd, &initrd).expect("write the initrd");
    for tool in ["null", "memtrace"] {
        let out = dir.join(tool);
        let mut cmd = Command::new(kpin_bin());
        cmd.args(["run", "--tool", tool, "--quiet"])
            .arg("--kernel")
            .arg(&linux.vmlinux)
            .arg("--initrd")
            .arg(&rd)
            .args(["--cmdline", LINUX_CMDLINE, "--timeout", BUDGET_SECONDS])
            .arg("--out")
            .arg(&out);
        if tool == "memtrace" {
            // (the records themselves are not the point: a bounded trace)
            cmd.args(["--tool-option", "limit=100000"]);
        }
        let run = kpin_run(&mut cmd, &out);
        let (console, context) = (&run.console, format!("{tool}: {}", run.context));
        assert_eq!(run.output.status.code(), Some(0), "{context}");
        let want = format!(
            "KPIN-WORKLOAD-DONE {}",
            kpin_images::workload_expected_md5()
        );
        assert!(
            console.lines().any(|l| l == want),
            "`{want}` expected\n{context}"
        );
        let counters: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(out.join("counters.json")).expect("counters.json"),
        )
        .expect("counters.json is JSON");
        assert_eq!(
            counters["events"]["user_unsupported_ud"], 0,
            "{tool}: a 32-bit instruction was refused\n{context}"
        );
        assert!(
            counters["guest_instructions"]["cpl3"].as_u64().unwrap_or(0) > 10_000_000,
            "{tool}: the workload's user code ran under the engine: {counters:#}"
        );
    }
}
