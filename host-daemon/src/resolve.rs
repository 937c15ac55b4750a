//! Files beneath the run's output directory, opened without following symbolic links.
//!
//! The output directory may already hold entries when a run starts (an earlier run, or
//! someone else's symlink `console.log -> ~/.bashrc`). Nothing kpin creates there, for
//! the guest or for itself, may follow a symlink, write through a hard link, or block on
//! a FIFO:
//!
//! - [`OutDir::create_file`] (the daemon's `Open` records) resolves a relative name with
//!   `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)`, or, where
//!   the kernel has no `openat2` (`ENOSYS`, or `EPERM` from a seccomp filter), by walking
//!   the name one component at a time with `openat(O_NOFOLLOW | O_DIRECTORY)`; missing
//!   directories are made with `mkdirat` beneath directories already opened that way.
//! - [`create_output_file`] and [`read_output_file`] are kpin's own files (`console.log`,
//!   `run.json`, `dump.txt`, reports; `counters.json` and `bbcount.csv` read back):
//!   `O_NOFOLLOW` on the last component.
//!
//! Every file opened for writing must turn out to be a regular file with a single link
//! (`fstat` after `open`, which uses `O_NONBLOCK` so a FIFO cannot hang it); only then is
//! it truncated.

use std::ffi::CString;
use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// `struct open_how` of `openat2(2)` (libc's is `non_exhaustive`).
#[repr(C)]
struct OpenHow {
    flags: u64,
    mode: u64,
    resolve: u64,
}

/// Flags every write-open uses: no symlink at the end, no blocking on a FIFO, no
/// controlling terminal, nothing inherited by children.
const WRITE_FLAGS: libc::c_int = libc::O_WRONLY
    | libc::O_CREAT
    | libc::O_NOFOLLOW
    | libc::O_NONBLOCK
    | libc::O_NOCTTY
    | libc::O_CLOEXEC;
/// Mode of created files and directories (before the umask).
const FILE_MODE: libc::mode_t = 0o644;
const DIR_MODE: libc::mode_t = 0o755;

fn cstr(bytes: &[u8]) -> io::Result<CString> {
    CString::new(bytes).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in a name"))
}

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// Checks that an opened file is a regular file nobody else links to, then truncates it.
fn regular_single_link_truncated(f: File, what: &Path) -> io::Result<File> {
    let f = regular_single_link(f, what)?;
    f.set_len(0)?;
    Ok(f)
}

/// `f` if it is a regular file with one link (else an error naming `what`).
fn regular_single_link(f: File, what: &Path) -> io::Result<File> {
    let meta = f.metadata()?;
    if !meta.file_type().is_file() {
        return Err(io::Error::other(format!(
            "{} exists and is not a regular file",
            what.display()
        )));
    }
    if std::os::unix::fs::MetadataExt::nlink(&meta) > 1 {
        return Err(io::Error::other(format!(
            "{} has other hard links; refusing to overwrite it",
            what.display()
        )));
    }
    Ok(f)
}

/// Turns `ELOOP` from `O_NOFOLLOW`/`RESOLVE_NO_SYMLINKS` into a message that says so.
fn explain(e: io::Error, what: &Path) -> io::Error {
    match e.raw_os_error() {
        Some(libc::ELOOP) => io::Error::other(format!(
            "{} is (or passes through) a symbolic link; refusing to follow it",
            what.display()
        )),
        Some(libc::EXDEV) => io::Error::other(format!(
            "{} would resolve outside the output directory",
            what.display()
        )),
        _ => e,
    }
}

/// Creates (or truncates) the file at `path` for kpin's own output without following a
/// symlink at its last component, writing through a hard link or opening a FIFO or
/// device.
pub fn create_output_file(path: &Path) -> io::Result<File> {
    let c = cstr(path.as_os_str().as_bytes())?;
    // SAFETY: `c` is a NUL-terminated path; open(2) does not keep the pointer.
    let fd = cvt(unsafe { libc::open(c.as_ptr(), WRITE_FLAGS, libc::c_uint::from(FILE_MODE)) })
        .map_err(|e| explain(e, path))?;
    // SAFETY: `fd` was just returned by open(2) and is owned by nobody else.
    let f = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    regular_single_link_truncated(f, path)
}

/// Writes `contents` to `path` as [`create_output_file`] creates it.
pub fn write_output_file(path: &Path, contents: &[u8]) -> io::Result<()> {
    use std::io::Write;
    create_output_file(path)?.write_all(contents)
}

/// Opens the regular file at `path` for reading without following a symlink at its last
/// component and without blocking on a FIFO; anything but a regular file is an error.
fn open_regular_for_reading(path: &Path) -> io::Result<(File, std::fs::Metadata)> {
    let c = cstr(path.as_os_str().as_bytes())?;
    let flags = libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC;
    // SAFETY: `c` is a NUL-terminated path; open(2) does not keep the pointer.
    let fd = cvt(unsafe { libc::open(c.as_ptr(), flags) }).map_err(|e| explain(e, path))?;
    // SAFETY: `fd` was just returned by open(2) and is owned by nobody else.
    let f = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    let meta = f.metadata()?;
    if !meta.file_type().is_file() {
        return Err(io::Error::other(format!(
            "{} is not a regular file",
            path.display()
        )));
    }
    Ok((f, meta))
}

/// Reads at most `max_bytes` of the regular file at `path` without following a symlink
/// at its last component (a file the guest wrote, read back by kpin). Longer files are an
/// error, not a truncated read.
pub fn read_output_file(path: &Path, max_bytes: u64) -> io::Result<Vec<u8>> {
    let (f, meta) = open_regular_for_reading(path)?;
    if meta.len() > max_bytes {
        return Err(io::Error::other(format!(
            "{} is {} bytes, more than the {max_bytes} kpin reads",
            path.display(),
            meta.len()
        )));
    }
    let mut data = Vec::new();
    f.take(max_bytes + 1).read_to_end(&mut data)?;
    if data.len() as u64 > max_bytes {
        return Err(io::Error::other(format!(
            "{} grew past {max_bytes} bytes while being read",
            path.display()
        )));
    }
    Ok(data)
}

/// The last `max_bytes` (at most) of the regular file at `path`, opened as
/// [`read_output_file`] opens it: for the tail of a log that may be large.
pub fn read_output_tail(path: &Path, max_bytes: u64) -> io::Result<Vec<u8>> {
    use std::os::unix::fs::FileExt;
    let (f, meta) = open_regular_for_reading(path)?;
    let start = meta.len().saturating_sub(max_bytes);
    let mut data = vec![0; usize::try_from(meta.len() - start).map_err(io::Error::other)?];
    let mut got = 0;
    while got < data.len() {
        match f.read_at(&mut data[got..], start + got as u64)? {
            0 => break,
            n => got += n,
        }
    }
    data.truncate(got);
    Ok(data)
}

/// [`read_output_file`] as UTF-8 text.
pub fn read_output_text(path: &Path, max_bytes: u64) -> io::Result<String> {
    String::from_utf8(read_output_file(path, max_bytes)?).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{} is not UTF-8", path.display()),
        )
    })
}

/// The run's output directory, held open so names resolve beneath it.
#[derive(Debug)]
pub struct OutDir {
    fd: OwnedFd,
    path: PathBuf,
}

impl OutDir {
    /// Opens the existing directory `path` (which the operator chose: it may itself be
    /// reached through a symlink).
    pub fn open(path: &Path) -> io::Result<Self> {
        let c = cstr(path.as_os_str().as_bytes())?;
        let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC;
        // SAFETY: `c` is a NUL-terminated path; open(2) does not keep the pointer.
        let fd = cvt(unsafe { libc::open(c.as_ptr(), flags) })?;
        Ok(OutDir {
            // SAFETY: `fd` was just returned by open(2) and is owned by nobody else.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
            path: path.to_owned(),
        })
    }

    /// The directory's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Creates (or truncates) `rel`, a name [`kpin_abi::io_ring::validate_name`] admits,
    /// beneath the directory: missing parent directories are made, and no component may
    /// be a symlink. The file must turn out to be a regular file with one link.
    pub fn create_file(&self, rel: &str) -> io::Result<File> {
        self.create_file_with(rel, true)
    }

    /// [`OutDir::create_file`], but an existing file is kept and written at its end.
    pub fn append_file(&self, rel: &str) -> io::Result<File> {
        let f = self.open_file_with(rel, true)?;
        let mut f = regular_single_link(f, &self.path.join(rel))?;
        std::io::Seek::seek(&mut f, std::io::SeekFrom::End(0))?;
        Ok(f)
    }

    /// [`Self::create_file`], with `openat2` or (`use_openat2 == false`, `ENOSYS`, `EPERM`) the
    /// component walk alone.
    pub(crate) fn create_file_with(&self, rel: &str, use_openat2: bool) -> io::Result<File> {
        let f = self.open_file_with(rel, use_openat2)?;
        regular_single_link_truncated(f, &self.path.join(rel))
    }

    /// Opens (creating) `rel` for writing beneath the directory, as
    /// [`OutDir::create_file`] describes, without checking or truncating the file.
    fn open_file_with(&self, rel: &str, use_openat2: bool) -> io::Result<File> {
        let what = self.path.join(rel);
        let comps: Vec<&str> = rel.split('/').collect();
        let (last, parents) = comps
            .split_last()
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "empty name"))?;
        if comps
            .iter()
            .any(|c| c.is_empty() || *c == "." || *c == "..")
            || rel.starts_with('/')
        {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a name must be relative, without empty, . or .. components",
            ));
        }
        // Walk (and make) the parents: each opened O_NOFOLLOW | O_DIRECTORY beneath the
        // one before, so a symlinked or non-directory component fails here.
        let mut held: Option<OwnedFd> = None;
        for comp in parents {
            let at = held
                .as_ref()
                .map_or(self.fd.as_raw_fd(), AsRawFd::as_raw_fd);
            let c = cstr(comp.as_bytes())?;
            // SAFETY: `at` is an open directory fd, `c` a NUL-terminated name.
            let made = unsafe { libc::mkdirat(at, c.as_ptr(), DIR_MODE) };
            if made < 0 {
                let e = io::Error::last_os_error();
                if e.raw_os_error() != Some(libc::EEXIST) {
                    return Err(explain(e, &what));
                }
            }
            let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC;
            // SAFETY: as above.
            let fd = cvt(unsafe { libc::openat(at, c.as_ptr(), flags) }).map_err(|e| {
                if e.raw_os_error() != Some(libc::ENOTDIR) {
                    return explain(e, &what);
                }
                // O_NOFOLLOW | O_DIRECTORY fails the same way for a symlink and a file.
                // SAFETY: an all-zero `stat` is a valid value to be overwritten.
                let mut st: libc::stat = unsafe { std::mem::zeroed() };
                // SAFETY: `at` is an open directory fd, `c` a NUL-terminated name, `st`
                // a writable `stat`.
                let r =
                    unsafe { libc::fstatat(at, c.as_ptr(), &mut st, libc::AT_SYMLINK_NOFOLLOW) };
                if r == 0 && st.st_mode & libc::S_IFMT == libc::S_IFLNK {
                    explain(io::Error::from_raw_os_error(libc::ELOOP), &what)
                } else {
                    io::Error::other(format!("{}: {comp:?} is not a directory", what.display()))
                }
            })?;
            // SAFETY: `fd` was just returned by openat(2) and is owned by nobody else.
            held = Some(unsafe { OwnedFd::from_raw_fd(fd) });
        }
        let fd = match use_openat2.then(|| self.openat2(rel)) {
            Some(Ok(fd)) => fd,
            // ENOSYS: no openat2 on this kernel; EPERM: a seccomp filter that forbids it.
            // The walk is as strict, so either falls back to it.
            Some(Err(e)) if !matches!(e.raw_os_error(), Some(libc::ENOSYS | libc::EPERM)) => {
                return Err(explain(e, &what))
            }
            // The last component beneath the walked parent.
            _ => {
                let at = held
                    .as_ref()
                    .map_or(self.fd.as_raw_fd(), AsRawFd::as_raw_fd);
                let c = cstr(last.as_bytes())?;
                // SAFETY: `at` is an open directory fd, `c` a NUL-terminated name.
                let fd = cvt(unsafe {
                    libc::openat(at, c.as_ptr(), WRITE_FLAGS, libc::c_uint::from(FILE_MODE))
                })
                .map_err(|e| explain(e, &what))?;
                // SAFETY: `fd` was just returned by openat(2) and is owned by nobody else.
                unsafe { OwnedFd::from_raw_fd(fd) }
            }
        };
        Ok(File::from(fd))
    }

    fn openat2(&self, rel: &str) -> io::Result<OwnedFd> {
        let c = cstr(rel.as_bytes())?;
        let how = OpenHow {
            flags: WRITE_FLAGS as u64,
            mode: u64::from(FILE_MODE),
            resolve: libc::RESOLVE_BENEATH
                | libc::RESOLVE_NO_SYMLINKS
                | libc::RESOLVE_NO_MAGICLINKS,
        };
        let dirfd: RawFd = self.fd.as_raw_fd();
        // SAFETY: openat2(2) with an open directory fd, a NUL-terminated name and a
        // `struct open_how` of the size passed; the kernel keeps no pointer.
        let r = unsafe {
            libc::syscall(
                libc::SYS_openat2,
                dirfd,
                c.as_ptr(),
                &raw const how,
                std::mem::size_of::<OpenHow>(),
            )
        };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        let fd = RawFd::try_from(r).map_err(|_| io::Error::other("openat2 returned a bad fd"))?;
        // SAFETY: `fd` was just returned by openat2(2) and is owned by nobody else.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;

    use super::*;

    fn scratch(test: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kpin-resolve-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("out")).unwrap();
        dir
    }

    #[test]
    fn test_beneath_creates_parents_and_refuses_symlinks_both_ways() {
        for use_openat2 in [true, false] {
            let dir = scratch(&format!("beneath-{use_openat2}"));
            let out = OutDir::open(&dir.join("out")).unwrap();
            let outside = dir.join("victim");
            std::fs::write(&outside, "keep").unwrap();
            std::fs::create_dir(dir.join("elsewhere")).unwrap();

            use std::io::Write;
            let mut f = out.create_file_with("a/b/c.csv", use_openat2).unwrap();
            f.write_all(b"x").unwrap();
            assert_eq!(std::fs::read(dir.join("out/a/b/c.csv")).unwrap(), b"x");

            // A symlink as the last component, and as a directory on the way.
            symlink(&outside, dir.join("out/link.txt")).unwrap();
            symlink(dir.join("elsewhere"), dir.join("out/d")).unwrap();
            for name in ["link.txt", "d/new.txt"] {
                let e = out.create_file_with(name, use_openat2).unwrap_err();
                assert!(e.to_string().contains("symbolic link"), "{name}: {e}");
            }
            assert_eq!(std::fs::read_to_string(&outside).unwrap(), "keep");
            assert!(!dir.join("elsewhere/new.txt").exists());

            // A name below an existing file, a directory, a hard link, a FIFO.
            std::fs::write(dir.join("out/file"), "f").unwrap();
            let e = out.create_file_with("file/below", use_openat2).unwrap_err();
            assert!(e.to_string().contains("not a directory"), "{e}");
            assert!(out.create_file_with("a", use_openat2).is_err());
            std::fs::hard_link(&outside, dir.join("out/hard")).unwrap();
            let e = out.create_file_with("hard", use_openat2).unwrap_err();
            assert!(e.to_string().contains("hard links"), "{e}");
            let fifo = CString::new(dir.join("out/fifo").as_os_str().as_bytes()).unwrap();
            // SAFETY: a NUL-terminated path.
            assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o644) }, 0);
            assert!(out.create_file_with("fifo", use_openat2).is_err());
            assert_eq!(std::fs::read_to_string(&outside).unwrap(), "keep");
            for bad in ["../victim", "/abs", "a//b", "./x", ""] {
                assert!(out.create_file_with(bad, use_openat2).is_err(), "{bad}");
            }
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }

    #[test]
    fn test_own_output_files_do_not_follow_symlinks() {
        let dir = scratch("own");
        let victim = dir.join("victim");
        std::fs::write(&victim, "keep").unwrap();
        let link = dir.join("out/console.log");
        symlink(&victim, &link).unwrap();
        let e = create_output_file(&link).unwrap_err();
        assert!(e.to_string().contains("symbolic link"), "{e}");
        let e = read_output_file(&link, 100).unwrap_err();
        assert!(e.to_string().contains("symbolic link"), "{e}");
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep");

        let run = dir.join("out/run.json");
        std::fs::write(&run, "old contents, longer").unwrap();
        write_output_file(&run, b"{}").unwrap();
        assert_eq!(read_output_text(&run, 2).unwrap(), "{}");
        let e = read_output_file(&run, 1).unwrap_err();
        assert!(e.to_string().contains("more than the 1"), "{e}");
        assert!(read_output_file(Path::new("/dev/zero"), 100).is_err());
        std::fs::write(&run, b"0123456789").unwrap();
        assert_eq!(read_output_tail(&run, 4).unwrap(), b"6789");
        assert_eq!(read_output_tail(&run, 40).unwrap(), b"0123456789");
        assert!(read_output_tail(&link, 4).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
