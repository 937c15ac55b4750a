//! `kpin run --guest debian`: the Debian bookworm image (`kpin images --debian`:
//! mmdebstrap, systemd, python3, gcc, sqlite3; images/src/debian_image.rs) boots the
//! pinned 6.1 kernel from a copy of its disk over virtio-blk, fully instrumented from the
//! first instruction, reaches `multi-user.target` with no failed unit, runs
//! `kpin-workload.service` (python3, gcc, sqlite3 with 100 000 rows, a disk read after a
//! cache drop) with the md5 its build-time run in a chroot printed, and powers off with
//! `systemctl poweroff` (ACPI): exit 0. The disk the run wrote is clean for `fsck`.
//!
//! In CI: `--tool null` on both pinned kernels (`--guest debian`, `--guest debian-6.12`;
//! about two minutes each here, plus 1–3.5 minutes to build the image on a
//! cold cache: it needs root, mmdebstrap and Debian's mirror, which `.ci/setup` gives).
//! Also in CI: a run killed with SIGKILL during the workload (after its python step, while
//! gcc and sqlite3 write), whose disk e2fsck repairs (about a minute). Long runs (`--
//! --ignored`): `--tool bbcount` (about 5 minutes here) and `--tool cachesim`, whose
//! report must attribute misses to both kernel and user. Also in CI: `--kernel` (the 6.12
//! bzImage) with `--initrd` (the image's) and `--disk disk.img,ro` mounts the image as `/`
//! (about 30 s).
//!
//! Without `/dev/kvm`, or on a host that cannot build the image (not root, no
//! `mmdebstrap`, Debian's mirror unreachable) and has none cached, each test prints
//! `SKIPPED: …` and passes; with `KPIN_REQUIRE_KVM=1` (set by `.ci/run`) both are failures,
//! so CI cannot pass by testing nothing.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kpin_images::GuestKernel;
use kpin_tests::{
    enclosing_fn_name, kpin_bin, kpin_run, noticed_the_engine, require_kvm, scratch_dir, KpinRun,
    REQUIRE_KVM_ENV,
};

/// Whether the Debian image for `kernel` is there, built now if missing (minutes on a cold
/// cache); prints `SKIPPED: … (<test>)` if this host cannot build it, or panics if
/// [`REQUIRE_KVM_ENV`] is `1`. Any other build failure fails the test.
fn debian_image_available(kernel: GuestKernel, test: &str) -> bool {
    let out = kpin_images::default_out_dir();
    match kpin_images::ensure_debian(kernel, &out, &mut |line| eprintln!("images: {line}")) {
        Ok(_) => true,
        Err(e) if e.is_debian_host_unprepared() => {
            let why = error_chain(&e);
            assert!(
                std::env::var(REQUIRE_KVM_ENV).as_deref() != Ok("1"),
                "no Debian image ({test}): {why}; {REQUIRE_KVM_ENV}=1 makes that a failure"
            );
            println!("SKIPPED: no Debian image ({test}): {why}");
            eprintln!("SKIPPED: no Debian image ({test}): {why}");
            false
        }
        Err(e) => panic!("building the Debian image: {}", error_chain(&e)),
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
    text
}

/// Returns from the enclosing test, after printing why, without `/dev/kvm` or without the
/// Debian image for `kernel` ([`debian_image_available`]).
macro_rules! require_kvm_and_debian {
    ($kernel:expr) => {
        require_kvm!();
        if !debian_image_available(
            $kernel,
            enclosing_fn_name({
                fn f() {}
                ::std::any::type_name_of_val(&f)
            }),
        ) {
            return;
        }
    };
}

/// What the Debian run must print, in order.
const MARKS: &[&str] = &[
    "KPIN-DEBIAN-MULTIUSER",
    "KPIN-FAILED-UNITS 0",
    "KPIN-WORKLOAD-DONE ",
];

/// The md5 the image's build-time workload run printed.
fn expected_md5() -> String {
    let p = kpin_images::default_out_dir().join("debian-bookworm/expected-md5");
    std::fs::read_to_string(&p)
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
        .trim()
        .to_owned()
}

fn fsck() -> PathBuf {
    ["/usr/sbin/e2fsck", "/sbin/e2fsck"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
        .expect("e2fsck (e2fsprogs, installed by .ci/setup)")
}

/// `kpin run --guest debian --tool TOOL` into `out`.
fn run_debian(out: &Path, tool: &str) -> KpinRun {
    run_guest(out, "debian", tool)
}

/// `kpin run --guest GUEST --tool TOOL` into `out`.
fn run_guest(out: &Path, guest: &str, tool: &str) -> KpinRun {
    kpin_run(
        Command::new(kpin_bin()).args([
            "run",
            "--guest",
            guest,
            "--tool",
            tool,
            "--timeout",
            "1800",
            "--quiet",
            "--out",
            out.to_str().unwrap(),
        ]),
        out,
    )
}

/// The run powered off cleanly after a clean boot and the right workload result; its
/// disk checks clean. Removes the disk copy (~0.7 GB) afterwards.
fn assert_clean_debian_run(r: &KpinRun, out: &Path) {
    assert_eq!(r.output.status.code(), Some(0), "{}", r.context);
    let mut from = 0;
    for mark in MARKS {
        let at = r.console[from..]
            .find(mark)
            .unwrap_or_else(|| panic!("no `{mark}` after the previous mark\n{}", r.context));
        from += at;
    }
    let done = r.console[from..].lines().next().unwrap_or_default();
    assert_eq!(
        done.trim_start_matches("KPIN-WORKLOAD-DONE ").trim(),
        expected_md5(),
        "{}",
        r.context
    );
    for bad in ["I/O error", "EXT4-fs error", "Failed to start"] {
        assert!(!r.console.contains(bad), "`{bad}`\n{}", r.context);
    }
    assert_eq!(noticed_the_engine(&r.console), None, "{}", r.context);
    let disk = out.join(kpin_abi::output::GUEST_DISK_COPY);
    let check = Command::new(fsck())
        .args(["-fn"])
        .arg(&disk)
        .output()
        .expect("run e2fsck");
    assert!(
        check.status.success(),
        "e2fsck -fn after a read-write run: {check:?}"
    );
    std::fs::remove_file(&disk).unwrap();
}

#[test]
fn test_debian_boots_to_multi_user_runs_the_workload_and_powers_off_under_null() {
    require_kvm_and_debian!(GuestKernel::Debian61);
    let dir = scratch_dir("debian-null");
    let out = dir.join("out");
    let r = run_debian(&out, "null");
    assert_clean_debian_run(&r, &out);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn test_debian_on_the_612_kernel_boots_to_multi_user_and_powers_off_under_null() {
    require_kvm_and_debian!(GuestKernel::Debian612);
    let dir = scratch_dir("debian-612-null");
    let out = dir.join("out");
    let r = run_guest(&out, "debian-6.12", "null");
    assert!(
        r.console.contains("KPIN-DEBIAN-MULTIUSER 6.12."),
        "{}",
        r.context
    );
    assert_clean_debian_run(&r, &out);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--disk` with `--kernel`: a user's own kernel and initrd (here the pinned 6.12 bzImage
/// and the image's initrd, which loads virtio_mmio and virtio_blk) mount the image as the
/// root file system. Read-only (`,ro`, `ro`): the cached image itself, no copy. `init=`
/// prints the mounts and exits, so the kernel panics (exit status 3) right after.
#[test]
fn test_a_user_kernel_and_initrd_mount_the_image_as_root_with_disk() {
    require_kvm_and_debian!(GuestKernel::Debian612);
    let dir = scratch_dir("debian-user-kernel");
    let out = dir.join("out");
    let images = kpin_images::default_out_dir();
    let release = GuestKernel::Debian612.release();
    let r = kpin_run(
        Command::new(kpin_bin())
            .args(["run", "--tool", "null", "--quiet", "--timeout", "900"])
            .arg("--kernel")
            .arg(images.join(format!("linux-{release}/vmlinuz")))
            .arg("--initrd")
            .arg(images.join(format!("debian-bookworm/initrd.img-{release}")))
            .arg("--disk")
            .arg(format!(
                "{},ro",
                images.join("debian-bookworm/disk.img").display()
            ))
            .args([
                "--append",
                "root=/dev/vda ro init=/usr/bin/findmnt",
                "--out",
            ])
            .arg(&out),
        &out,
    );
    let root = r
        .console
        .lines()
        .find(|l| l.starts_with("/ "))
        .unwrap_or_else(|| panic!("findmnt printed no `/` line\n{}", r.context));
    assert_eq!(
        root.split_whitespace().collect::<Vec<_>>(),
        ["/", "/dev/vda", "ext4", "ro,relatime"],
        "{}",
        r.context
    );
    assert!(
        r.console
            .contains("Attempted to kill init! exitcode=0x00000000"),
        "findmnt succeeded, then init ended\n{}",
        r.context
    );
    assert_eq!(r.output.status.code(), Some(3), "{}", r.context);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
#[ignore = "minutes: the Debian guest under bbcount (about 5 minutes here)"]
fn test_debian_under_bbcount() {
    require_kvm_and_debian!(GuestKernel::Debian61);
    let dir = scratch_dir("debian-bbcount");
    let out = dir.join("out");
    let r = run_debian(&out, "bbcount");
    assert_clean_debian_run(&r, &out);
    let report = std::fs::read_to_string(out.join("bbcount-report.txt")).expect("the report");
    assert!(report.contains("user"), "{report}");
}

#[test]
#[ignore = "minutes: the Debian guest under cachesim"]
fn test_debian_under_cachesim_attributes_misses_to_kernel_and_user() {
    require_kvm_and_debian!(GuestKernel::Debian61);
    let dir = scratch_dir("debian-cachesim");
    let out = dir.join("out");
    let r = run_debian(&out, "cachesim");
    assert_clean_debian_run(&r, &out);
    let text = std::fs::read_to_string(out.join("cachesim.json")).expect("cachesim.json");
    let json: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    let l1d = json["caches"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["name"] == "L1D"))
        .unwrap_or_else(|| panic!("no L1D in cachesim.json: {text}"));
    let misses = |cpl: &str| l1d[cpl]["misses"].as_u64().unwrap_or(0);
    assert!(misses("kernel") > 0 && misses("user") > 0, "{text}");
}

#[test]
fn test_a_run_killed_during_the_workload_leaves_a_disk_e2fsck_repairs() {
    require_kvm_and_debian!(GuestKernel::Debian61);
    let dir = scratch_dir("debian-killed");
    let out = dir.join("out");
    let mut child = Command::new(kpin_bin())
        .args([
            "run", "--guest", "debian", "--tool", "null", "--quiet", "--out",
        ])
        .arg(&out)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start kpin");
    // Wait for the guest's progress, not a time: the workload has started writing (its
    // sqlite3 step follows the python line).
    let started = Instant::now();
    loop {
        let console = std::fs::read_to_string(out.join("console.log")).unwrap_or_default();
        if console.contains("KPIN-TEST python ") {
            break;
        }
        assert!(
            child.try_wait().unwrap().is_none(),
            "kpin ended early:\n{console}"
        );
        assert!(started.elapsed() < Duration::from_secs(1800), "{console}");
        std::thread::sleep(Duration::from_millis(200));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let disk = out.join(kpin_abi::output::GUEST_DISK_COPY);
    let repair = Command::new(fsck())
        .args(["-fy"])
        .arg(&disk)
        .output()
        .expect("run e2fsck");
    // 0: clean, 1: errors corrected; 4 and up: left uncorrected.
    println!("e2fsck -fy after SIGKILL: {:?}", repair.status.code());
    assert!(
        matches!(repair.status.code(), Some(0 | 1)),
        "e2fsck -fy: {repair:?}"
    );
    let recheck = Command::new(fsck())
        .args(["-fn"])
        .arg(&disk)
        .output()
        .unwrap();
    assert!(recheck.status.success(), "after repair: {recheck:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}
