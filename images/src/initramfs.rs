//! The busybox initramfs: layout of the guest's root file system, packed as newc cpio.
//!
//! Contents: `/bin/busybox` (built from Debian's source with its symbols,
//! `busybox_build.rs`) with a symlink per applet in [`APPLETS`] (Debian's static
//! configuration has a standalone shell, so the links are for humans and for other shells, not required by
//! `/init`), the mount points `/proc /sys /dev /tmp`, `/root` and `/etc`, a `/dev/console`
//! node (5,1) so that the kernel can open the console for `/init` before devtmpfs is mounted,
//! the native test programs (`programs.rs`: `/bin/kpin-test`, `/bin/kpin-conform`,
//! `/bin/kpin-conform32`), and `/init` itself, the script in `images/initramfs/init`.
//!
//! Invariant: the archive is a pure function of the busybox binary, the test programs'
//! binaries and the script (see [`crate::cpio`]), so rebuilding it and comparing hashes is
//! how the cache is checked.

use crate::cpio::{CpioError, CpioWriter};

/// The `/init` script, kept as a real file in the repository.
pub(crate) const INIT_SCRIPT: &str = include_str!("../initramfs/init");

/// Applets linked into `/bin`: everything `/init` runs, plus a few for interactive debugging.
pub(crate) const APPLETS: &[&str] = &[
    "awk", "cat", "cmp", "cp", "cut", "dd", "dmesg", "echo", "expr", "grep", "insmod", "ls",
    "md5sum", "mkdir", "mount", "poweroff", "reboot", "rm", "sed", "seq", "sh", "sleep", "sort",
    "sync", "umount", "uname", "uniq", "wc",
];

/// Empty directories of the root file system, with their permissions.
const DIRECTORIES: &[(&str, u32)] = &[
    ("bin", 0o755),
    ("dev", 0o755),
    ("etc", 0o755),
    ("proc", 0o555),
    ("root", 0o700),
    ("sys", 0o555),
    ("tmp", 0o1777),
];

/// Major and minor number of `/dev/console` (TTYAUX_MAJOR, 1).
const CONSOLE_DEVICE: (u32, u32) = (5, 1);

/// Builds the initramfs archive around the given busybox binary and the test programs,
/// `(name, binary)` each, packed as `/bin/<name>` in the order given.
pub(crate) fn build(busybox: &[u8], programs: &[(&str, &[u8])]) -> Result<Vec<u8>, CpioError> {
    let mut archive = CpioWriter::new();
    for &(dir, perm) in DIRECTORIES {
        archive.dir(dir, perm)?;
    }
    archive.char_device("dev/console", 0o600, CONSOLE_DEVICE.0, CONSOLE_DEVICE.1)?;
    archive.file("bin/busybox", 0o755, busybox)?;
    for applet in APPLETS {
        archive.symlink(&format!("bin/{applet}"), "busybox")?;
    }
    for (name, binary) in programs {
        archive.file(&format!("bin/{name}"), 0o755, binary)?;
    }
    archive.file("init", 0o755, INIT_SCRIPT.as_bytes())?;
    Ok(archive.finish())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpio;

    #[test]
    fn test_archive_has_init_console_and_applets() {
        let programs: [(&str, &[u8]); 3] = [
            ("kpin-test", b"fake kpin-test"),
            ("kpin-conform", b"fake conform"),
            ("kpin-conform32", b"fake conform32"),
        ];
        let archive = build(b"fake busybox", &programs).expect("build");
        let entries = cpio::parse(&archive).expect("well-formed");
        let find = |name: &str| {
            entries
                .iter()
                .find(|e| e.name == name)
                .unwrap_or_else(|| panic!("{name} missing"))
        };
        let init = find("init");
        assert_eq!(init.mode, 0o100_755);
        assert!(init.data.starts_with(b"#!/bin/busybox sh\n"));
        assert_eq!(find("dev/console").rdev, (5, 1));
        assert_eq!(find("dev/console").mode, 0o020_600);
        assert_eq!(find("bin/busybox").data, b"fake busybox");
        assert_eq!(find("bin/sh").data, b"busybox");
        assert_eq!(find("bin/kpin-test").data, b"fake kpin-test");
        assert_eq!(find("bin/kpin-test").mode, 0o100_755);
        assert_eq!(find("bin/kpin-conform").data, b"fake conform");
        assert_eq!(find("bin/kpin-conform32").data, b"fake conform32");
        assert_eq!(find("bin/kpin-conform32").mode, 0o100_755);
        for dir in ["proc", "sys", "dev", "tmp", "root", "etc"] {
            assert_eq!(find(dir).mode & 0o170_000, 0o040_000, "{dir}");
        }
        // Parents precede children, as the kernel's unpacker requires.
        let pos = |name: &str| entries.iter().position(|e| e.name == name);
        assert!(pos("dev") < pos("dev/console"));
        assert!(pos("bin") < pos("bin/busybox"));
    }

    #[test]
    fn test_init_script_emits_the_documented_markers() {
        for marker in [
            "KPIN-USERSPACE-OK",
            "KPIN-WORKLOAD-DONE",
            "KPIN-WORKLOAD-ERROR unknown workload $1",
            "kpin.workload=",
            "reboot -f",
            "poweroff -f",
            "mount_fs devtmpfs /dev",
            "mount_fs tmpfs /tmp",
        ] {
            assert!(INIT_SCRIPT.contains(marker), "{marker}");
        }
    }

    #[test]
    fn test_archive_is_a_pure_function_of_its_inputs() {
        let programs: [(&str, &[u8]); 2] = [("kpin-test", b"t"), ("kpin-conform", b"c")];
        let a = build(b"bb", &programs).expect("build");
        assert_eq!(a, build(b"bb", &programs).expect("again"));
        let changed: [(&str, &[u8]); 2] = [("kpin-test", b"t"), ("kpin-conform", b"C")];
        assert_ne!(a, build(b"bb", &changed).expect("changed"));
    }

    #[test]
    fn test_applets_are_sorted_and_unique() {
        let mut sorted = APPLETS.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted, APPLETS);
    }
}
