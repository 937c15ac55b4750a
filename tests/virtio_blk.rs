//! `kpin run --disk`: the pinned 6.1 kernel with the virtio initramfs (`--guest linux`
//! with a disk) finds its virtio-blk disk and virtio-rng over virtio-mmio, under the
//! engine (`--tool null`, `--tool bbcount`: translated code's register accesses reach the
//! VMM's device models). The workload (`kpin.workload=virtio`, images/initramfs/init)
//! reads the whole disk, mounts it, prints the md5 of `/kpin-in`, writes `/kpin-out`,
//! syncs, unmounts and reads `/dev/hwrng`; the host then checks the image with debugfs and
//! `fsck.ext4 -n`. A `,ro` disk refuses the write and stays byte for byte the same.
//!
//! Natively the pinned kernel does not reach user space on this host (its KVM emulates
//! guest ring 0 and stops at the first instruction it cannot emulate:
//! docs/linux-native-boot.md), so the native device path is the same VMM code these runs
//! exercise (a CPL-3 access from translated code is a normal MMIO exit) plus the device
//! models' unit tests (`vmm/src/devices/virtio/`).
//!
//! Needs e2fsprogs (`mkfs.ext4 -d`, `debugfs`, `fsck.ext4`; `.ci/setup` installs it).

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use kpin_tests::{kpin_bin, kpin_run, require_kvm, scratch_dir, KpinRun};

/// An e2fsprogs program, from PATH or /sbin; `None` (the test prints SKIPPED) without it.
fn e2fs(name: &str) -> Option<PathBuf> {
    for dir in ["/usr/sbin", "/sbin", "/usr/bin", "/bin"] {
        let p = Path::new(dir).join(name);
        if p.exists() {
            return Some(p);
        }
    }
    println!("SKIPPED: {name} (e2fsprogs) is not installed");
    None
}

/// A 32 MiB ext4 image in `dir` holding `/kpin-in` (3 MB of a fixed pattern); its md5.
fn make_image(dir: &Path) -> Option<(PathBuf, String)> {
    let mkfs = e2fs("mkfs.ext4")?;
    let src = dir.join("src");
    std::fs::create_dir_all(&src).unwrap();
    let data: Vec<u8> = (0u32..3_000_000)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
        .collect();
    std::fs::write(src.join("kpin-in"), &data).unwrap();
    let img = dir.join("disk.ext4");
    let f = std::fs::File::create(&img).unwrap();
    f.set_len(32 << 20).unwrap();
    drop(f);
    let out = Command::new(mkfs)
        .args(["-q", "-F", "-d"])
        .arg(&src)
        .arg(&img)
        .output()
        .expect("run mkfs.ext4");
    assert!(out.status.success(), "mkfs.ext4: {out:?}");
    let md5 = Command::new("md5sum")
        .arg(src.join("kpin-in"))
        .output()
        .expect("md5sum");
    let md5 = String::from_utf8_lossy(&md5.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_string();
    Some((img, md5))
}

/// Runs the virtio workload with `disk` (`PATH` or `PATH,ro`) under `tool`.
fn run(dir: &Path, disk: &str, tool: &str) -> KpinRun {
    let out = dir.join(format!("out-{tool}"));
    let r = kpin_run(
        Command::new(kpin_bin()).args([
            "run",
            "--guest",
            "linux",
            "--tool",
            tool,
            "--disk",
            disk,
            "--append",
            "kpin.workload=virtio",
            "--timeout",
            "120",
            "--quiet",
            "--out",
            out.to_str().unwrap(),
        ]),
        &out,
    );
    assert_eq!(r.output.status.code(), Some(0), "{}", r.context);
    for bad in [
        "I/O error",
        "EXT4-fs error",
        "KPIN-WORKLOAD-ERROR",
        "KPIN-INIT-WARNING",
    ] {
        assert!(
            !r.console.contains(bad),
            "`{bad}` on the console\n{}",
            r.context
        );
    }
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("run.json")).unwrap()).unwrap();
    let devices = json["devices"].as_array().expect("run.json devices");
    assert_eq!(devices.len(), 2, "a disk and the rng: {json}");
    assert_eq!(devices[0]["kind"], "virtio-blk");
    assert_eq!(devices[0]["base"], "0xd0000000");
    assert_eq!(devices[1]["kind"], "virtio-rng");
    assert!(devices[0]["block"]["reads"].as_u64().unwrap() > 0);
    r
}

fn line<'a>(console: &'a str, mark: &str) -> &'a str {
    console
        .lines()
        .find_map(|l| l.strip_prefix(mark))
        .unwrap_or_else(|| panic!("no `{mark}` line on the console:\n{console}"))
        .trim()
}

/// The guest read the image, wrote `/kpin-out`, read the rng; the image is clean.
fn read_write_under(tool: &str) {
    let dir = scratch_dir(&format!("virtio-blk-{tool}"));
    let Some((img, md5)) = make_image(&dir) else {
        return;
    };
    let (Some(debugfs), Some(fsck)) = (e2fs("debugfs"), e2fs("fsck.ext4")) else {
        return;
    };
    let r = run(&dir, img.to_str().unwrap(), tool);
    // `<bytes> <centiseconds>`: the whole disk, read through the page cache's readahead.
    let dd: Vec<u64> = line(&r.console, "KPIN-VIRTIO-DD ")
        .split_whitespace()
        .map(|w| w.parse().unwrap())
        .collect();
    assert_eq!(dd[0], 32 << 20, "{}", r.context);
    println!(
        "--tool {tool}: read the 32 MiB disk in {} cs of guest time ({:.1} MB/s)",
        dd[1],
        (32u64 << 20) as f64 / 1e6 / (dd[1].max(1) as f64 / 100.0)
    );
    assert_eq!(line(&r.console, "KPIN-VIRTIO-READ "), md5, "{}", r.context);
    assert_eq!(
        line(&r.console, "KPIN-VIRTIO-WRITE "),
        "ok",
        "{}",
        r.context
    );
    assert_eq!(line(&r.console, "KPIN-VIRTIO-RNG "), "32", "{}", r.context);
    let cat = Command::new(debugfs)
        .args(["-R", "cat /kpin-out"])
        .arg(&img)
        .output()
        .expect("debugfs");
    assert_eq!(
        String::from_utf8_lossy(&cat.stdout),
        "kpin wrote this\n",
        "{cat:?}"
    );
    let check = Command::new(fsck)
        .arg("-n")
        .arg(&img)
        .output()
        .expect("fsck");
    assert!(check.status.success(), "fsck.ext4 -n: {check:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn test_virtio_disk_read_write_under_tool_null() {
    require_kvm!();
    read_write_under("null");
}

#[test]
fn test_virtio_disk_read_write_under_tool_bbcount() {
    require_kvm!();
    read_write_under("bbcount");
}

#[test]
fn test_a_read_only_disk_refuses_the_write_and_stays_unchanged() {
    require_kvm!();
    let dir = scratch_dir("virtio-blk-ro");
    let Some((img, md5)) = make_image(&dir) else {
        return;
    };
    let before = std::fs::read(&img).unwrap();
    let r = run(&dir, &format!("{},ro", img.display()), "null");
    assert_eq!(line(&r.console, "KPIN-VIRTIO-READ "), md5, "{}", r.context);
    assert_eq!(
        line(&r.console, "KPIN-VIRTIO-WRITE "),
        "refused",
        "{}",
        r.context
    );
    assert!(std::fs::read(&img).unwrap() == before, "the image changed");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn test_bad_disks_are_refused_before_the_guest_boots() {
    let dir = scratch_dir("virtio-blk-bad");
    let kpin = |disk: &str| {
        Command::new(kpin_bin())
            .args([
                "run", "--guest", "linux", "--quiet", "--disk", disk, "--out",
            ])
            .arg(dir.join("out"))
            .output()
            .expect("run kpin")
    };
    let missing = dir.join("missing.img");
    let o = kpin(missing.to_str().unwrap());
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("no such file"),
        "{o:?}"
    );
    let o = kpin(dir.to_str().unwrap());
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("is a directory"),
        "{o:?}"
    );
    let o = kpin(&format!("{},rx", missing.display()));
    assert_eq!(o.status.code(), Some(2), "{o:?}");
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("unknown option"),
        "{o:?}"
    );
    // Exit status 1 and the fix, for images that exist but cannot be used as they are.
    let refused = |disk: &str, says: &[&str]| {
        let o = kpin(disk);
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{disk}: {o:?}");
        for s in says {
            assert!(stderr.contains(s), "{disk}: no `{s}` in {stderr}");
        }
    };
    let mut qcow2 = b"QFI\xfb\0\0\0\x03".to_vec();
    qcow2.resize(1 << 16, 0);
    let q = dir.join("disk.qcow2");
    std::fs::write(&q, &qcow2).unwrap();
    refused(q.to_str().unwrap(), &["qcow2", "qemu-img convert -O raw"]);
    refused(&format!("{},ro", q.display()), &["qcow2"]);
    let ragged = dir.join("ragged.img");
    std::fs::write(&ragged, vec![0u8; 5000]).unwrap();
    refused(ragged.to_str().unwrap(), &["5000 bytes", "truncated"]);
    let read_only = dir.join("read-only.img");
    std::fs::write(&read_only, vec![0u8; 1 << 16]).unwrap();
    std::fs::set_permissions(&read_only, std::fs::Permissions::from_mode(0o444)).unwrap();
    refused(read_only.to_str().unwrap(), &["read-only on disk", ",ro"]);
    if let Some(mkfs) = e2fs("mkfs.ext4") {
        // A real ext4 image cut short, as an interrupted copy leaves it.
        let cut = dir.join("cut.ext4");
        std::fs::File::create(&cut)
            .unwrap()
            .set_len(8 << 20)
            .unwrap();
        let out = Command::new(mkfs)
            .args(["-q", "-F"])
            .arg(&cut)
            .output()
            .expect("run mkfs.ext4");
        assert!(out.status.success(), "mkfs.ext4: {out:?}");
        std::fs::OpenOptions::new()
            .write(true)
            .open(&cut)
            .unwrap()
            .set_len(4 << 20)
            .unwrap();
        refused(
            &format!("{},ro", cut.display()),
            &[
                "truncated",
                "ext4 file system says the disk is 8388608 bytes",
            ],
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
