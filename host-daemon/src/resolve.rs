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
//!   reports; `counters.json` and tool files read back): `O_NOFOLLOW` on the last
//!   component.
//! - [`write_output_file`] (`run.json`, `dump.txt`, tools' host-side reports) writes a whole
//!   file atomically: a new dot-file beside it (`O_EXCL | O_NOFOLLOW`), `fsync`, then
//!   `rename` over the name (which replaces a symlink or hard link there, never writes
//!   through it). A reader sees the old file or the whole new one, never a partial file,
//!   even when the file system fills up or kpin is killed half-way.
//!
//! Every file opened for writing must turn out to be a regular file with a single link
//! (`fstat` after `open`, which uses `O_NONBLOCK` so a FIFO cannot hang it); only then is
//! it truncated.
//!
//! [`SpaceReserve`] holds space on the output directory's file system for kpin's last
//! files (an unnamed `O_TMPFILE`, so a killed kpin leaves nothing behind), and
//! [`is_host_fault`] tells a failure of the host's storage (full, read-only, I/O error)
//! from a name the guest should not have asked for.

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

/// Writes `contents` to `path` atomically: into a new file beside it (`.<name>.kpin-tmp-<pid>`,
/// created `O_EXCL | O_NOFOLLOW`), synced, then renamed over `path`. On any failure the
/// temporary file is removed and `path` is left as it was; a symlink or hard link at
/// `path` is replaced, never written through.
pub fn write_output_file(path: &Path, contents: &[u8]) -> io::Result<()> {
    use std::io::Write;
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no file name"))?;
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(name);
    tmp_name.push(format!(".kpin-tmp-{}", std::process::id()));
    let tmp = path.with_file_name(tmp_name);
    let c = cstr(tmp.as_os_str().as_bytes())?;
    let flags = libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC;
    let open = || {
        // SAFETY: `c` is a NUL-terminated path; open(2) does not keep the pointer.
        cvt(unsafe { libc::open(c.as_ptr(), flags, libc::c_uint::from(FILE_MODE)) })
    };
    let fd = match open() {
        // Left by an earlier kpin with this pid that was killed half-way: ours to remove.
        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
            std::fs::remove_file(&tmp)?;
            open()
        }
        r => r,
    }
    .map_err(|e| explain(e, &tmp))?;
    // SAFETY: `fd` was just returned by open(2) and is owned by nobody else.
    let mut f = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    let written = f
        .write_all(contents)
        .and_then(|()| f.sync_all())
        .and_then(|()| std::fs::rename(&tmp, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// Whether `e` is a failure of the host's storage or resources rather than of the name or
/// the file asked for: the file system is full (`ENOSPC`, `EDQUOT`), read-only (`EROFS`),
/// failing (`EIO`), or kpin is out of file descriptors or memory.
pub fn is_host_fault(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(
            libc::ENOSPC
                | libc::EDQUOT
                | libc::EROFS
                | libc::EIO
                | libc::EFBIG
                | libc::EMFILE
                | libc::ENFILE
                | libc::ENOMEM
        )
    )
}

/// What a failed write says about the output file system, for messages and `run.json`:
/// "output file system full", "output file system read-only", or "cannot write to the
/// output directory".
pub fn fault_cause(e: &io::Error) -> &'static str {
    match e.raw_os_error() {
        Some(libc::ENOSPC | libc::EDQUOT) => "output file system full",
        Some(libc::EROFS) => "output file system read-only",
        _ => "cannot write to the output directory",
    }
}

/// The state of the file system holding `dir`, when it explains a write that went missing
/// without an error to show: "output file system read-only", "output file system full",
/// or `None`.
pub fn file_system_state(dir: &Path) -> Option<&'static str> {
    let c = cstr(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: an all-zero `statvfs` is a valid value to be overwritten.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path, `st` a writable `statvfs`.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    if st.f_flag & libc::ST_RDONLY != 0 {
        Some("output file system read-only")
    } else if st.f_bavail == 0 {
        Some("output file system full")
    } else {
        None
    }
}

/// Space held on a file system (an unnamed file of that size) until [`Self::release`]
/// or drop, so that kpin's last files (`run.json`, `dump.txt`) can still be written after
/// the run filled the file system. Nothing is left behind if kpin is killed: the file has
/// no name.
#[derive(Debug)]
pub struct SpaceReserve(Option<File>);

impl SpaceReserve {
    /// Holds `bytes` on the file system of the directory `dir`. `Ok(None)` when that file
    /// system cannot make unnamed files (`O_TMPFILE`); `ENOSPC` (or another error) when the
    /// space is not there.
    pub fn hold(dir: &Path, bytes: u64) -> io::Result<Option<Self>> {
        let c = cstr(dir.as_os_str().as_bytes())?;
        let flags = libc::O_TMPFILE | libc::O_WRONLY | libc::O_CLOEXEC;
        // SAFETY: `c` is a NUL-terminated path; open(2) does not keep the pointer.
        let fd = match cvt(unsafe { libc::open(c.as_ptr(), flags, 0o600 as libc::c_uint) }) {
            Ok(fd) => fd,
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EOPNOTSUPP | libc::EISDIR | libc::EINVAL)
                ) =>
            {
                return Ok(None)
            }
            Err(e) => return Err(e),
        };
        // SAFETY: `fd` was just returned by open(2) and is owned by nobody else.
        let mut f = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        let len = libc::off_t::try_from(bytes).map_err(io::Error::other)?;
        // SAFETY: fallocate(2) on an fd we own; no pointers.
        if unsafe { libc::fallocate(f.as_raw_fd(), 0, 0, len) } != 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EOPNOTSUPP) {
                return Err(e);
            }
            // A file system without fallocate: the space taken by writing it.
            let zeros = vec![0u8; usize::try_from(bytes).map_err(io::Error::other)?];
            std::io::Write::write_all(&mut f, &zeros)?;
            f.sync_all()?;
        }
        Ok(Some(SpaceReserve(Some(f))))
    }

    /// Gives the space back.
    pub fn release(&mut self) {
        self.0 = None;
    }
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

    /// The dot-files `write_output_file` left in `dir` (none, after it returns).
    fn leftovers(dir: &Path) -> Vec<String> {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with('.'))
            .collect()
    }

    #[test]
    fn test_whole_files_replace_links_and_a_failed_write_leaves_the_old_file() {
        let dir = scratch("atomic");
        let out = dir.join("out");
        let victim = dir.join("victim");
        std::fs::write(&victim, "keep").unwrap();
        // A symlink and a hard link at the name are replaced, not written through.
        symlink(&victim, out.join("run.json")).unwrap();
        write_output_file(&out.join("run.json"), b"{\"complete\":true}").unwrap();
        std::fs::hard_link(&victim, out.join("dump.txt")).unwrap();
        write_output_file(&out.join("dump.txt"), b"dump").unwrap();
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep");
        assert!(!std::fs::symlink_metadata(out.join("run.json"))
            .unwrap()
            .file_type()
            .is_symlink());
        assert_eq!(
            std::fs::read_to_string(out.join("run.json")).unwrap(),
            "{\"complete\":true}"
        );
        assert_eq!(
            std::fs::read_to_string(out.join("dump.txt")).unwrap(),
            "dump"
        );
        // A rename that fails (a directory with entries at the name) leaves what was
        // there, and no temporary file.
        std::fs::create_dir_all(out.join("report.txt/inside")).unwrap();
        assert!(write_output_file(&out.join("report.txt"), b"new").is_err());
        assert!(out.join("report.txt/inside").is_dir());
        assert_eq!(leftovers(&out), Vec::<String>::new());
        // A temporary file a killed kpin of this pid left is taken over.
        let stale = out.join(format!(".run.json.kpin-tmp-{}", std::process::id()));
        std::fs::write(&stale, "stale").unwrap();
        write_output_file(&out.join("run.json"), b"{}").unwrap();
        assert_eq!(std::fs::read_to_string(out.join("run.json")).unwrap(), "{}");
        assert_eq!(leftovers(&out), Vec::<String>::new());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn test_space_reserve_holds_unnamed_space_and_host_faults_are_told_apart() {
        let dir = scratch("reserve");
        let out = dir.join("out");
        let mut r = SpaceReserve::hold(&out, 64 << 10).unwrap();
        // The reserve has no name in the directory.
        assert_eq!(std::fs::read_dir(&out).unwrap().count(), 0);
        if let Some(r) = r.as_mut() {
            r.release();
        }
        for (errno, host, cause) in [
            (libc::ENOSPC, true, "output file system full"),
            (libc::EDQUOT, true, "output file system full"),
            (libc::EROFS, true, "output file system read-only"),
            (libc::EIO, true, "cannot write to the output directory"),
            (libc::ELOOP, false, "cannot write to the output directory"),
            (libc::ENOTDIR, false, "cannot write to the output directory"),
        ] {
            let e = io::Error::from_raw_os_error(errno);
            assert_eq!(is_host_fault(&e), host, "{e}");
            assert_eq!(fault_cause(&e), cause, "{e}");
        }
        assert!(!is_host_fault(&io::Error::other("a refusal")));
        assert_eq!(file_system_state(&out), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
