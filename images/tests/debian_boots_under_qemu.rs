//! The Debian guest image (issue #26) boots under QEMU TCG with each pinned kernel: a
//! microvm (virtio-mmio, as kpin's VMM declares its disks), ACPI on so that `systemctl
//! poweroff` ends the machine, a copy of the cached disk image as virtio-blk.
//!
//! Checks, per kernel: `multi-user.target` reached with no failed unit, every workload
//! test ok, the disk test's hash equal to the host's, `KPIN-WORKLOAD-DONE` with the md5 the
//! build-time run printed, a clean ACPI power-off (QEMU exits 0), and a console without
//! kernel warnings, `I/O error` or `EXT4-fs error`.
//!
//! Ignored by default: building the image needs root, mmdebstrap and Debian's mirror
//! (minutes), and each boot takes about a minute of TCG. Run it with
//! `cargo test --release -p kpin-images --test debian_boots_under_qemu -- --ignored --nocapture`.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kpin_images::GuestKernel;

/// How long one boot may take before it counts as hung.
const BOOT_TIMEOUT: Duration = Duration::from_secs(900);

/// Console text that must not appear.
const FORBIDDEN: [&str; 7] = [
    "WARNING:",
    "Call Trace",
    "BUG:",
    "I/O error",
    "EXT4-fs error",
    "Kernel panic",
    "Failed to start",
];

fn boot(kernel: GuestKernel) {
    if Command::new("qemu-system-x86_64")
        .arg("--version")
        .stdout(Stdio::null())
        .status()
        .is_err()
    {
        println!("SKIPPED: qemu-system-x86_64 is not installed");
        return;
    }
    let out_dir = kpin_images::default_out_dir();
    let mut progress = |line: &str| println!("images: {line}");
    let image = kpin_images::ensure_debian(kernel, &out_dir, &mut progress).unwrap_or_else(|e| {
        panic!(
            "the Debian image: {e} ({:?})",
            std::error::Error::source(&e)
        )
    });

    // Boot a copy: the guest writes to its disk.
    let scratch = std::env::temp_dir().join(format!(
        "kpin-debian-qemu-{}-{}",
        kernel.release(),
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch).expect("scratch dir");
    let disk = scratch.join("disk.img");
    let status = Command::new("cp")
        .args(["--sparse=always", "--reflink=auto"])
        .arg(&image.disk)
        .arg(&disk)
        .status()
        .expect("cp");
    assert!(status.success(), "copying the disk image failed");

    let console = run_qemu(&image.linux.bzimage, &image.initrd, &disk);
    let _ = std::fs::remove_dir_all(&scratch);
    let log = out_dir
        .join("debian-bookworm")
        .join(format!("qemu-console-{}.log", kernel.release()));
    std::fs::write(&log, console.text.as_bytes()).expect("write the console log");
    println!("console: {}", log.display());

    let text = &console.text;
    let multiuser = format!("KPIN-DEBIAN-MULTIUSER {}", kernel.release());
    assert!(text.contains(&multiuser), "no `{multiuser}` line");
    assert!(
        text.contains("KPIN-FAILED-UNITS 0"),
        "failed units: {:?}",
        lines_with(text, "KPIN-FAILED-UNIT")
    );
    for test in ["python", "gcc", "sqlite", "disk"] {
        let prefix = format!("KPIN-TEST {test} ok ");
        assert!(
            text.contains(&prefix),
            "{test} did not pass: {:?}",
            lines_with(text, "KPIN-TEST")
        );
    }
    let disk_line = format!("KPIN-TEST disk ok {}", kpin_images::disk_test_sha256());
    assert!(
        text.contains(&disk_line),
        "the disk test's hash differs from the host's"
    );
    let done = format!("KPIN-WORKLOAD-DONE {}", image.expected_md5);
    assert!(
        text.contains(&done),
        "expected `{done}`, got {:?}",
        lines_with(text, "KPIN-WORKLOAD-DONE")
    );
    assert!(text.contains("reboot: Power down"), "no ACPI power-off");
    assert!(console.exit_ok, "QEMU did not exit with status 0");
    for bad in FORBIDDEN {
        assert!(
            !text.contains(bad),
            "the console contains {bad:?}: {:?}",
            lines_with(text, bad)
        );
    }
    println!(
        "{}: multi-user after {:.1} s, workload done after {:.1} s, powered off after {:.1} s, md5 {}",
        kernel.release(),
        console.multiuser_at.map_or(f64::NAN, |d| d.as_secs_f64()),
        console.done_at.map_or(f64::NAN, |d| d.as_secs_f64()),
        console.total.as_secs_f64(),
        image.expected_md5
    );
}

fn lines_with<'a>(text: &'a str, needle: &str) -> Vec<&'a str> {
    text.lines().filter(|l| l.contains(needle)).collect()
}

struct Console {
    text: String,
    exit_ok: bool,
    multiuser_at: Option<Duration>,
    done_at: Option<Duration>,
    total: Duration,
}

fn run_qemu(kernel: &Path, initrd: &Path, disk: &Path) -> Console {
    let start = Instant::now();
    let mut child = Command::new("qemu-system-x86_64")
        .args([
            "-accel",
            "tcg",
            "-M",
            "microvm,acpi=on,pit=on,pic=on,rtc=on",
        ])
        .args(["-m", "1024", "-smp", "1", "-nographic", "-no-reboot"])
        .arg("-kernel")
        .arg(kernel)
        .arg("-initrd")
        .arg(initrd)
        // TCG offers no way to calibrate the TSC on a microvm (no PIT reference, no HPET):
        // without a stated frequency the 6.1 kernel waits forever.
        .args([
            "-append",
            "root=/dev/vda rw console=ttyS0 panic=-1 tsc_early_khz=2000000",
        ])
        .arg("-drive")
        .arg(format!("id=d0,file={},format=raw,if=none", disk.display()))
        .args(["-device", "virtio-blk-device,drive=d0"])
        .args(["-device", "virtio-rng-device"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start qemu-system-x86_64");
    let stdout = child.stdout.take().expect("piped");
    let (tx, rx) = mpsc::channel();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(stdout).split(b'\n') {
            let Ok(line) = line else { break };
            if tx
                .send((start.elapsed(), String::from_utf8_lossy(&line).into_owned()))
                .is_err()
            {
                break;
            }
        }
    });
    let mut text = String::new();
    let mut multiuser_at = None;
    let mut done_at = None;
    loop {
        match rx.recv_timeout(Duration::from_secs(5)) {
            Ok((at, line)) => {
                if line.contains("KPIN-DEBIAN-MULTIUSER") {
                    multiuser_at = Some(at);
                }
                if line.contains("KPIN-WORKLOAD-DONE") {
                    done_at = Some(at);
                }
                text.push_str(&line);
                text.push('\n');
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if start.elapsed() > BOOT_TIMEOUT {
                    let _ = child.kill();
                    panic!("the boot hung; console so far:\n{text}");
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    let _ = reader.join();
    let status = child.wait().expect("wait for QEMU");
    Console {
        text,
        exit_ok: status.success(),
        multiuser_at,
        done_at,
        total: start.elapsed(),
    }
}

#[test]
#[ignore = "builds the Debian image (root, mmdebstrap, Debian's mirror) and boots it under TCG"]
fn test_debian_image_boots_6_1_under_qemu() {
    boot(GuestKernel::Debian61);
}

#[test]
#[ignore = "builds the Debian image (root, mmdebstrap, Debian's mirror) and boots it under TCG"]
fn test_debian_image_boots_6_12_under_qemu() {
    boot(GuestKernel::Debian612);
}
