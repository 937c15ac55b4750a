//! `--disk PATH[,ro]`: the option parsed, and the image opened and checked before the
//! guest boots (a regular file; readable, and writable unless `ro`; at least one sector;
//! a length that is not a whole number of sectors is rounded down, with a note), and
//! locked against a second kpin using it at the same time (`flock`: shared for `ro`,
//! exclusive otherwise).

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
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
    /// Bytes the guest sees: the file's length rounded down to a sector.
    pub len: u64,
    /// Set when the file's length was not a whole number of sectors.
    pub note: Option<String>,
}

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
    let file = OpenOptions::new()
        .read(true)
        .write(!disk.read_only)
        // A FIFO swapped in after the stat must not hang the open.
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(p)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::EACCES | libc::EPERM | libc::EROFS) if !disk.read_only => format!(
                "disk image {show} cannot be opened for writing ({e}): attach it read-only with --disk {show},ro"
            ),
            _ => format!("disk image {show} cannot be opened: {e}"),
        })?;
    let meta = file
        .metadata()
        .map_err(|e| format!("disk image {show}: {e}"))?;
    if !meta.is_file() {
        return Err(format!("disk image {show} is not a regular file"));
    }
    lock(&file, disk.read_only, p)?;
    let bytes = meta.len();
    if bytes < SECTOR_BYTES {
        return Err(format!(
            "disk image {show} holds {bytes} bytes, less than one {SECTOR_BYTES}-byte sector"
        ));
    }
    let len = bytes - bytes % SECTOR_BYTES;
    let note = (len != bytes).then(|| {
        format!(
            "disk image {show}: {bytes} bytes is not a whole number of {SECTOR_BYTES}-byte sectors; the guest sees the first {len}"
        )
    });
    Ok(OpenDisk { file, len, note })
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
        let o = open(&DiskConfig::parse(ragged.to_str().unwrap()).unwrap()).unwrap();
        assert_eq!(o.len, 1024);
        assert!(o.note.as_deref().unwrap().contains("1500 bytes"));
        // The lock: a second writer is refused while the first holds the image.
        let e = open(&DiskConfig::parse(ragged.to_str().unwrap()).unwrap()).unwrap_err();
        assert!(e.contains("in use"), "{e}");
        drop(o);
        let _ = std::fs::remove_dir_all(&d);
    }
}
