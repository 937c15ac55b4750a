//! `--disk PATH[,ro]`: the option parsed, and the image opened and checked before the
//! guest boots, so that a bad one is an error naming the file and the fix (exit status 1)
//! rather than I/O errors or a panic inside the guest: a regular file; readable, and —
//! without `ro` — writable and not read-only on disk (mode bits: root could open it for
//! writing anyway); a raw image, not qcow2, VMDK, VDI, VHD(X), QED or a compressed file
//! (kpin has no format layer, so their metadata would reach the guest as disk sectors);
//! not truncated (at least one sector, a whole number of sectors, and no smaller than the
//! ext4 file system or GPT partition table at its start says the disk is). It is locked
//! against a second kpin using it at the same time (`flock`: shared for `ro`, exclusive
//! otherwise).

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

use super::block::SECTOR_BYTES;

/// One `--disk`.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct DiskConfig {
    /// The raw image file.
    pub path: PathBuf,
    /// Attached read-only (`,ro`).
    pub read_only: bool,
}

impl DiskConfig {
    /// Parses `PATH[,ro]` (`,rw` is accepted and is the default).
    pub fn parse(arg: &str) -> Result<Self, String> {
        let (path, read_only) = match arg.rsplit_once(',') {
            Some((p, "ro")) => (p, true),
            Some((p, "rw")) => (p, false),
            Some((_, other)) => {
                return Err(format!(
                    "--disk {arg}: unknown option `{other}` (PATH or PATH,ro)"
                ))
            }
            None => (arg, false),
        };
        if path.is_empty() {
            return Err(format!("--disk {arg}: no path"));
        }
        Ok(DiskConfig {
            path: PathBuf::from(path),
            read_only,
        })
    }
}

/// An image opened for a disk.
#[derive(Debug)]
pub struct OpenDisk {
    /// The file (locked for the run).
    pub file: File,
    /// Bytes the guest sees: the file's length, a whole number of sectors.
    pub len: u64,
}

/// The fix for an image in another format.
const CONVERT: &str = "kpin takes raw images; convert with `qemu-img convert -O raw`";

/// Opens and checks `disk` (see the module's header); the error names the file and the
/// fix.
pub fn open(disk: &DiskConfig) -> Result<OpenDisk, String> {
    let p = &disk.path;
    let show = p.display();
    let meta = std::fs::metadata(p).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => format!("disk image {show}: no such file"),
        _ => format!("disk image {show}: {e}"),
    })?;
    if meta.is_dir() {
        return Err(format!(
            "disk image {show} is a directory, not a raw image file"
        ));
    }
    if !meta.is_file() {
        return Err(format!(
            "disk image {show} is not a regular file (a raw image file is needed)"
        ));
    }
    let writable_hint = format!("attach it read-only with --disk {show},ro");
    if !disk.read_only && meta.permissions().mode() & 0o222 == 0 {
        return Err(format!(
            "disk image {show} is read-only on disk (mode {:o}): {writable_hint}, or make it writable (chmod u+w)",
            meta.permissions().mode() & 0o7777
        ));
    }
    let file = OpenOptions::new()
        .read(true)
        .write(!disk.read_only)
        // A FIFO swapped in after the stat must not hang the open.
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(p)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::EACCES | libc::EPERM | libc::EROFS) if !disk.read_only => {
                format!("disk image {show} cannot be opened for writing ({e}): {writable_hint}")
            }
            _ => format!("disk image {show} cannot be opened: {e}"),
        })?;
    let meta = file
        .metadata()
        .map_err(|e| format!("disk image {show}: {e}"))?;
    if !meta.is_file() {
        return Err(format!("disk image {show} is not a regular file"));
    }
    lock(&file, disk.read_only, p)?;
    let len = meta.len();
    let mut head = vec![0u8; HEAD_BYTES.min(len) as usize];
    file.read_exact_at(&mut head, 0)
        .map_err(|e| format!("disk image {show} cannot be read: {e}"))?;
    check_contents(&head, len).map_err(|why| format!("disk image {show} {why}"))?;
    Ok(OpenDisk { file, len })
}

/// Bytes of the image's start [`check_contents`] looks at: the GPT header (sector 1) and
/// the ext4 superblock (bytes 1024–2047).
const HEAD_BYTES: u64 = 2048;

/// Checks an image of `len` bytes whose first bytes are `head` (up to [`HEAD_BYTES`]):
/// raw and not truncated. The error completes "disk image PATH …".
fn check_contents(head: &[u8], len: u64) -> Result<(), String> {
    if len < SECTOR_BYTES {
        return Err(format!(
            "holds {len} bytes, less than one {SECTOR_BYTES}-byte sector: it is truncated or not a disk image"
        ));
    }
    if let Some(format) = other_format(head) {
        return Err(format!("is a {format} image, not a raw one: {CONVERT}"));
    }
    if !len.is_multiple_of(SECTOR_BYTES) {
        return Err(format!(
            "holds {len} bytes, not a whole number of {SECTOR_BYTES}-byte sectors: it is truncated (an incomplete copy or download?)"
        ));
    }
    for (what, size) in [
        ("ext4 file system", ext4_bytes(head)),
        ("GPT", gpt_bytes(head)),
    ] {
        if let Some(size) = size.filter(|&s| s > len) {
            return Err(format!(
                "is truncated: its {what} says the disk is {size} bytes, the file holds {len} (an incomplete copy or download?)"
            ));
        }
    }
    Ok(())
}

/// The format an image starting with `head` is in, if it is one of the common non-raw
/// ones (their magic numbers, as `qemu-img` probes them). No raw disk starts with these:
/// a partition table starts with boot code or zeros, ext4 with 1024 zero bytes.
fn other_format(head: &[u8]) -> Option<&'static str> {
    const AT_START: &[(&[u8], &str)] = &[
        (b"QFI\xfb", "qcow2 (or qcow)"),
        (b"QED\0", "QED"),
        (b"KDMV", "VMDK"),
        (b"# Disk DescriptorFile", "VMDK (descriptor)"),
        (b"vhdxfile", "VHDX"),
        (b"conectix", "VHD"),
        (b"\xfd7zXZ\0", "xz-compressed"),
        (b"\x1f\x8b", "gzip-compressed"),
        (b"\x28\xb5\x2f\xfd", "zstd-compressed"),
    ];
    // VDI's signature, 0xbeda107f little-endian, after its 64-byte text line.
    if head.get(0x40..0x44) == Some(&[0x7f, 0x10, 0xda, 0xbe][..]) {
        return Some("VDI");
    }
    AT_START
        .iter()
        .find(|(magic, _)| head.starts_with(magic))
        .map(|&(_, name)| name)
}

fn le32(b: &[u8], at: usize) -> Option<u64> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?).into())
}

fn le64(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

/// The bytes of the ext4 (or ext2/3) file system the image starts with, from its
/// superblock: blocks × block size. `None` without one, or for values no mkfs writes.
fn ext4_bytes(head: &[u8]) -> Option<u64> {
    let sb = head.get(1024..2048)?;
    if sb.get(0x38..0x3a)? != [0x53, 0xef] {
        return None;
    }
    let log = le32(sb, 0x18)?;
    // Block sizes are 1 KiB to 64 KiB.
    if log > 6 {
        return None;
    }
    let mut blocks = le32(sb, 0x04)?;
    // INCOMPAT_64BIT: the count's high half.
    if le32(sb, 0x60)? & 0x80 != 0 {
        blocks |= le32(sb, 0x150)? << 32;
    }
    blocks.checked_mul(1024 << log)
}

/// The bytes a GPT-partitioned image must hold: through its backup header, whose sector
/// the primary header (sector 1) names — the disk's last sector. `None` without a GPT.
fn gpt_bytes(head: &[u8]) -> Option<u64> {
    let h = head.get(512..1024)?;
    if !h.starts_with(b"EFI PART") || le64(h, 24)? != 1 {
        return None;
    }
    le64(h, 32)?.checked_add(1)?.checked_mul(SECTOR_BYTES)
}

fn lock(file: &File, shared: bool, p: &Path) -> Result<(), String> {
    let op = if shared { libc::LOCK_SH } else { libc::LOCK_EX } | libc::LOCK_NB;
    // SAFETY: flock on a file descriptor this function borrows; no memory is passed.
    if unsafe { libc::flock(file.as_raw_fd(), op) } == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
        Err(format!(
            "disk image {} is in use by another process (it holds a lock on it)",
            p.display()
        ))
    } else {
        Err(format!("disk image {}: cannot lock it: {e}", p.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("kpin-disk-test-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn test_parse_path_and_ro() {
        assert_eq!(
            DiskConfig::parse("a.img").unwrap(),
            DiskConfig {
                path: "a.img".into(),
                read_only: false
            }
        );
        assert!(DiskConfig::parse("a.img,ro").unwrap().read_only);
        assert!(!DiskConfig::parse("a,b.img,rw").unwrap().read_only);
        assert!(DiskConfig::parse("a.img,rx")
            .unwrap_err()
            .contains("unknown option"));
        assert!(DiskConfig::parse(",ro").is_err());
    }

    #[test]
    fn test_open_refuses_what_is_not_a_usable_image() {
        let d = scratch("open");
        let missing = DiskConfig::parse(d.join("nope.img").to_str().unwrap()).unwrap();
        assert!(open(&missing).unwrap_err().contains("no such file"));
        let dir = DiskConfig::parse(d.to_str().unwrap()).unwrap();
        assert!(open(&dir).unwrap_err().contains("is a directory"));
        let tiny = d.join("tiny.img");
        std::fs::write(&tiny, [0u8; 100]).unwrap();
        let e = open(&DiskConfig::parse(tiny.to_str().unwrap()).unwrap()).unwrap_err();
        assert!(e.contains("less than one"), "{e}");
        let ragged = d.join("ragged.img");
        std::fs::write(&ragged, vec![0u8; 1500]).unwrap();
        let e = open(&DiskConfig::parse(ragged.to_str().unwrap()).unwrap()).unwrap_err();
        assert!(e.contains("1500 bytes") && e.contains("truncated"), "{e}");
        let mut qcow2 = b"QFI\xfb\0\0\0\x03".to_vec();
        qcow2.resize(4096, 0);
        let q = d.join("disk.qcow2");
        std::fs::write(&q, &qcow2).unwrap();
        let e = open(&DiskConfig::parse(q.to_str().unwrap()).unwrap()).unwrap_err();
        assert!(
            e.contains("qcow2") && e.contains("qemu-img convert -O raw"),
            "{e}"
        );
        let good = d.join("good.img");
        std::fs::write(&good, vec![0u8; 4096]).unwrap();
        let o = open(&DiskConfig::parse(good.to_str().unwrap()).unwrap()).unwrap();
        assert_eq!(o.len, 4096);
        // The lock: a second writer is refused while the first holds the image.
        let e = open(&DiskConfig::parse(good.to_str().unwrap()).unwrap()).unwrap_err();
        assert!(e.contains("in use"), "{e}");
        drop(o);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn test_an_image_read_only_on_disk_needs_ro() {
        let d = scratch("mode");
        let img = d.join("ro.img");
        std::fs::write(&img, vec![0u8; 4096]).unwrap();
        std::fs::set_permissions(&img, std::fs::Permissions::from_mode(0o444)).unwrap();
        // Refused even as root, who could open it for writing.
        let e = open(&DiskConfig::parse(img.to_str().unwrap()).unwrap()).unwrap_err();
        assert!(e.contains("read-only on disk") && e.contains(",ro"), "{e}");
        let ro = DiskConfig::parse(&format!("{},ro", img.display())).unwrap();
        assert_eq!(open(&ro).unwrap().len, 4096);
        let _ = std::fs::remove_dir_all(&d);
    }

    /// An image start with `magic` at `at`, 2048 bytes.
    fn head_with(at: usize, magic: &[u8]) -> Vec<u8> {
        let mut h = vec![0u8; HEAD_BYTES as usize];
        h[at..at + magic.len()].copy_from_slice(magic);
        h
    }

    #[test]
    fn test_other_formats_are_named_and_refused() {
        for (head, name) in [
            (head_with(0, b"QFI\xfb\0\0\0\x02"), "qcow2"),
            (head_with(0, b"KDMV\x01\0\0\0"), "VMDK"),
            (head_with(0, b"# Disk DescriptorFile\n"), "VMDK"),
            (head_with(0x40, &[0x7f, 0x10, 0xda, 0xbe]), "VDI"),
            (head_with(0, b"vhdxfile"), "VHDX"),
            (head_with(0, b"conectix"), "VHD"),
            (head_with(0, b"QED\0"), "QED"),
            (head_with(0, b"\xfd7zXZ\0"), "xz"),
            (head_with(0, b"\x1f\x8b\x08"), "gzip"),
        ] {
            let e = check_contents(&head, 1 << 20).unwrap_err();
            assert!(
                e.contains(name) && e.contains("qemu-img convert -O raw"),
                "{e}"
            );
        }
        // Zeros, an MBR's boot code, ext4: raw.
        assert_eq!(check_contents(&[0u8; 2048], 1 << 20), Ok(()));
        let mut mbr = head_with(0, &[0xeb, 0x63, 0x90]);
        mbr[510..512].copy_from_slice(&[0x55, 0xaa]);
        assert_eq!(check_contents(&mbr, 1 << 20), Ok(()));
    }

    /// An ext4 superblock: `blocks` of 1024 << `log` bytes; with the 64-bit feature when
    /// `blocks` needs it.
    fn ext4_head(blocks: u64, log: u32) -> Vec<u8> {
        let mut h = head_with(1024 + 0x38, &[0x53, 0xef]);
        h[1024 + 0x04..1024 + 0x08].copy_from_slice(&(blocks as u32).to_le_bytes());
        h[1024 + 0x18..1024 + 0x1c].copy_from_slice(&log.to_le_bytes());
        if blocks >> 32 != 0 {
            h[1024 + 0x60..1024 + 0x64].copy_from_slice(&0x80u32.to_le_bytes());
            h[1024 + 0x150..1024 + 0x154].copy_from_slice(&((blocks >> 32) as u32).to_le_bytes());
        }
        h
    }

    #[test]
    fn test_truncated_images_are_refused() {
        // An ext4 file system of 1000 4-KiB blocks.
        let fs = ext4_head(1000, 2);
        assert_eq!(check_contents(&fs, 4_096_000), Ok(()));
        assert_eq!(
            check_contents(&fs, 8 << 20),
            Ok(()),
            "a larger disk is fine"
        );
        let e = check_contents(&fs, 4_096_000 - 512).unwrap_err();
        assert!(
            e.contains("truncated") && e.contains("ext4") && e.contains("4096000"),
            "{e}"
        );
        // 64-bit block counts, and values no mkfs writes (not an ext4 after all).
        let e = check_contents(&ext4_head(1 << 32, 2), 1 << 40).unwrap_err();
        assert!(e.contains("17592186044416"), "{e}");
        assert_eq!(
            check_contents(&ext4_head(u64::MAX >> 1, 2), 1 << 20),
            Ok(()),
            "a size past 2^64 bytes: no size to compare"
        );
        assert_eq!(check_contents(&ext4_head(1 << 30, 40), 1 << 20), Ok(()));
        // A GPT whose backup header is at sector 2047: the disk is 1 MiB.
        let mut gpt = head_with(512, b"EFI PART");
        gpt[512 + 24..512 + 32].copy_from_slice(&1u64.to_le_bytes());
        gpt[512 + 32..512 + 40].copy_from_slice(&2047u64.to_le_bytes());
        assert_eq!(check_contents(&gpt, 1 << 20), Ok(()));
        let e = check_contents(&gpt, (1 << 20) - 4096).unwrap_err();
        assert!(e.contains("GPT") && e.contains("1048576"), "{e}");
        gpt[512 + 32..512 + 40].copy_from_slice(&u64::MAX.to_le_bytes());
        assert_eq!(
            check_contents(&gpt, 1 << 20),
            Ok(()),
            "a sector number that overflows: no size to compare"
        );
        // Short files and ragged lengths.
        assert!(check_contents(&[0u8; 100], 100)
            .unwrap_err()
            .contains("less than one"));
        assert!(check_contents(&[0u8; 2048], 1500 * 1024 + 7)
            .unwrap_err()
            .contains("not a whole number"));
    }
}
