//! A writer for "newc" cpio archives (`070701`), the format the kernel unpacks as initramfs.
//!
//! Each entry is a 110-byte ASCII header (magic, then thirteen 8-digit hex fields), the path
//! NUL-terminated and padded to a multiple of 4 bytes (counting the header), then the data
//! padded to a multiple of 4. The archive ends with an entry named `TRAILER!!!`.
//!
//! Invariants: output is deterministic (inode numbers count up from 1, owner root, mtime 0),
//! so the same inputs always give byte-identical archives; paths are stored relative (no
//! leading `/`), and every field fits its 8 hex digits or the entry is refused.

/// Magic of the newc format (no checksums).
const NEWC_MAGIC: &str = "070701";
/// Name of the end-of-archive entry.
const TRAILER_NAME: &str = "TRAILER!!!";
/// Header length in bytes: 6 magic + 13 fields of 8 hex digits.
const HEADER_BYTES: usize = 6 + 13 * 8;

/// File type bits of `st_mode`.
const S_IFDIR: u32 = 0o040_000;
const S_IFREG: u32 = 0o100_000;
const S_IFLNK: u32 = 0o120_000;
const S_IFCHR: u32 = 0o020_000;
/// Permission bits a caller may pass in.
const PERMISSION_MASK: u32 = 0o7777;

/// Why an entry could not be added.
#[derive(Debug, thiserror::Error)]
pub enum CpioError {
    /// The path is empty, `/`, contains NUL, or uses `.`/`..` components.
    #[error("invalid archive path {path:?}")]
    InvalidPath {
        /// The rejected path.
        path: String,
    },
    /// The data is larger than the format's 32-bit size field.
    #[error("{path:?} is {len} bytes, more than a newc archive entry can hold")]
    TooLarge {
        /// The entry's path.
        path: String,
        /// Its length.
        len: usize,
    },
}

/// Builds a newc archive in memory.
#[derive(Debug)]
pub(crate) struct CpioWriter {
    out: Vec<u8>,
    next_ino: u32,
}

/// Everything a header records apart from magic, inode and name length.
struct Header {
    mode: u32,
    nlink: u32,
    rdev: (u32, u32),
}

impl CpioWriter {
    /// An empty archive.
    pub(crate) fn new() -> Self {
        CpioWriter {
            out: Vec::new(),
            next_ino: 1,
        }
    }

    /// Adds a directory with permissions `perm` (e.g. `0o755`).
    pub(crate) fn dir(&mut self, path: &str, perm: u32) -> Result<(), CpioError> {
        self.entry(path, S_IFDIR | (perm & PERMISSION_MASK), 2, (0, 0), b"")
    }

    /// Adds a regular file with permissions `perm`.
    pub(crate) fn file(&mut self, path: &str, perm: u32, data: &[u8]) -> Result<(), CpioError> {
        self.entry(path, S_IFREG | (perm & PERMISSION_MASK), 1, (0, 0), data)
    }

    /// Adds a symbolic link at `path` pointing to `target`.
    pub(crate) fn symlink(&mut self, path: &str, target: &str) -> Result<(), CpioError> {
        self.entry(path, S_IFLNK | 0o777, 1, (0, 0), target.as_bytes())
    }

    /// Adds a character device node `major:minor` with permissions `perm`.
    pub(crate) fn char_device(
        &mut self,
        path: &str,
        perm: u32,
        major: u32,
        minor: u32,
    ) -> Result<(), CpioError> {
        self.entry(
            path,
            S_IFCHR | (perm & PERMISSION_MASK),
            1,
            (major, minor),
            b"",
        )
    }

    /// Appends the trailer and returns the archive.
    pub(crate) fn finish(mut self) -> Vec<u8> {
        let header = Header {
            mode: 0,
            nlink: 1,
            rdev: (0, 0),
        };
        self.push(0, TRAILER_NAME, &header, b"");
        self.out
    }

    fn entry(
        &mut self,
        path: &str,
        mode: u32,
        nlink: u32,
        rdev: (u32, u32),
        data: &[u8],
    ) -> Result<(), CpioError> {
        let name = normalize(path)?;
        if u32::try_from(data.len()).is_err() {
            return Err(CpioError::TooLarge {
                path: path.to_owned(),
                len: data.len(),
            });
        }
        let ino = self.next_ino;
        self.next_ino += 1;
        self.push(ino, name, &Header { mode, nlink, rdev }, data);
        Ok(())
    }

    fn push(&mut self, ino: u32, name: &str, header: &Header, data: &[u8]) {
        let namesize = name.len() + 1;
        let fields = [
            ino,
            header.mode,
            0, // uid
            0, // gid
            header.nlink,
            0, // mtime
            data.len() as u32,
            0, // devmajor
            0, // devminor
            header.rdev.0,
            header.rdev.1,
            namesize as u32,
            0, // check (unused in newc)
        ];
        let header_start = self.out.len();
        self.out.extend_from_slice(NEWC_MAGIC.as_bytes());
        for field in fields {
            self.out
                .extend_from_slice(format!("{field:08x}").as_bytes());
        }
        debug_assert_eq!(self.out.len() - header_start, HEADER_BYTES);
        self.out.extend_from_slice(name.as_bytes());
        self.out.push(0);
        pad4(&mut self.out);
        self.out.extend_from_slice(data);
        pad4(&mut self.out);
    }
}

/// Pads `out` with NULs to a multiple of 4 bytes. Every entry starts 4-aligned, so aligning
/// the whole buffer aligns relative to the entry.
fn pad4(out: &mut Vec<u8>) {
    out.resize(out.len().next_multiple_of(4), 0);
}

/// `path` without its leading `/`, if it is a valid relative archive path.
fn normalize(path: &str) -> Result<&str, CpioError> {
    let relative = path.trim_start_matches('/');
    let valid = !relative.is_empty()
        && !relative.contains('\0')
        && relative != TRAILER_NAME
        && relative
            .split('/')
            .all(|c| !c.is_empty() && c != "." && c != "..");
    if valid && relative.len() < u32::MAX as usize {
        Ok(relative)
    } else {
        Err(CpioError::InvalidPath {
            path: path.to_owned(),
        })
    }
}

/// A parsed archive entry (tests only).
#[cfg(test)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Entry {
    pub name: String,
    pub ino: u32,
    pub mode: u32,
    pub nlink: u32,
    pub rdev: (u32, u32),
    pub data: Vec<u8>,
}

/// Parses a newc archive up to its trailer; `None` if it is malformed (tests only).
#[cfg(test)]
pub(crate) fn parse(archive: &[u8]) -> Option<Vec<Entry>> {
    let align = |n: usize| n.div_ceil(4) * 4;
    let mut pos = 0;
    let mut entries = Vec::new();
    loop {
        let header = archive.get(pos..pos + HEADER_BYTES)?;
        if &header[..6] != NEWC_MAGIC.as_bytes() {
            return None;
        }
        let field = |i: usize| {
            let text = std::str::from_utf8(&header[6 + 8 * i..6 + 8 * (i + 1)]).ok()?;
            u32::from_str_radix(text, 16).ok()
        };
        let filesize = field(6)? as usize;
        let namesize = field(11)? as usize;
        let name_start = pos + HEADER_BYTES;
        let name_bytes = archive.get(name_start..name_start + namesize)?;
        let (name, nul) = name_bytes.split_at(namesize.checked_sub(1)?);
        if nul != [0] {
            return None;
        }
        let name = String::from_utf8(name.to_vec()).ok()?;
        let data_start = align(name_start + namesize);
        let data = archive.get(data_start..data_start + filesize)?.to_vec();
        pos = align(data_start + filesize);
        if name == TRAILER_NAME {
            return (pos == archive.len()).then_some(entries);
        }
        entries.push(Entry {
            name,
            ino: field(0)?,
            mode: field(1)?,
            nlink: field(4)?,
            rdev: (field(9)?, field(10)?),
            data,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_round_trip_all_entry_kinds() {
        let mut w = CpioWriter::new();
        w.dir("/bin", 0o755).expect("dir");
        w.file("/bin/busybox", 0o755, b"\x7fELF...").expect("file");
        w.symlink("bin/sh", "busybox").expect("symlink");
        w.dir("dev", 0o755).expect("dir");
        w.char_device("/dev/console", 0o600, 5, 1).expect("node");
        w.file("init", 0o755, b"#!/bin/busybox sh\n").expect("file");
        let archive = w.finish();
        assert_eq!(archive.len() % 4, 0);

        let entries = parse(&archive).expect("well-formed");
        let names: Vec<_> = entries.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(
            names,
            ["bin", "bin/busybox", "bin/sh", "dev", "dev/console", "init"]
        );
        assert_eq!(entries[0].mode, 0o040_755);
        assert_eq!(entries[0].nlink, 2);
        assert_eq!(entries[1].mode, 0o100_755);
        assert_eq!(entries[1].data, b"\x7fELF...");
        assert_eq!(entries[2].mode, 0o120_777);
        assert_eq!(entries[2].data, b"busybox");
        assert_eq!(entries[4].mode, 0o020_600);
        assert_eq!(entries[4].rdev, (5, 1));
        let inodes: Vec<_> = entries.iter().map(|e| e.ino).collect();
        assert_eq!(inodes, [1, 2, 3, 4, 5, 6]);
    }

    #[test]
    fn test_header_layout_matches_newc() {
        let mut w = CpioWriter::new();
        w.file("a", 0o644, b"xyz").expect("file");
        let archive = w.finish();
        let expected_header = concat!(
            "070701", "00000001", "000081a4", "00000000", "00000000", "00000001", "00000000",
            "00000003", "00000000", "00000000", "00000000", "00000000", "00000002", "00000000"
        );
        assert_eq!(&archive[..HEADER_BYTES], expected_header.as_bytes());
        // 110 header + "a\0" = 112 (aligned), then "xyz" + 1 pad byte.
        assert_eq!(&archive[110..112], b"a\0");
        assert_eq!(&archive[112..116], b"xyz\0");
        assert_eq!(&archive[116..122], b"070701");
    }

    #[test]
    fn test_output_is_deterministic() {
        let build = || {
            let mut w = CpioWriter::new();
            w.dir("tmp", 0o1777).expect("dir");
            w.file("f", 0o600, &[1, 2, 3, 4, 5]).expect("file");
            w.finish()
        };
        assert_eq!(build(), build());
    }

    #[test]
    fn test_rejects_invalid_paths() {
        let mut w = CpioWriter::new();
        for bad in ["", "/", "a//b", "a/../b", "./a", "a\0b", "TRAILER!!!"] {
            assert!(
                matches!(w.dir(bad, 0o755), Err(CpioError::InvalidPath { .. })),
                "{bad:?} accepted"
            );
        }
        assert_eq!(parse(&w.finish()).expect("well-formed"), vec![]);
    }

    #[test]
    fn test_system_cpio_lists_archive() {
        let mut w = CpioWriter::new();
        w.dir("etc", 0o755).expect("dir");
        w.file("etc/hostname", 0o644, b"kpin\n").expect("file");
        let archive = w.finish();
        let child = std::process::Command::new("cpio")
            .args(["-t", "--quiet"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn();
        let Ok(mut child) = child else {
            println!("SKIPPED: no `cpio` on this host to cross-check the archive");
            return;
        };
        use std::io::Write;
        child
            .stdin
            .take()
            .expect("piped")
            .write_all(&archive)
            .expect("write");
        let output = child.wait_with_output().expect("wait");
        assert!(output.status.success());
        assert_eq!(
            String::from_utf8_lossy(&output.stdout),
            "etc\netc/hostname\n"
        );
    }
}
