//! The output directory as a verified cache: atomic writes, stamps, and a per-job lock.
//!
//! Invariants:
//! - A file under the output directory is either absent or complete: every file is written
//!   under a hidden temporary name (embedding the writer's process id) in its final directory
//!   and renamed into place. Temporary files of dead processes are removed on the next run.
//! - A derived file is trusted only if its *stamp* (`<out>/.stamps/<relative path>.stamp`)
//!   names the same inputs and the file's current SHA-256 and size. Stamps are written after
//!   the file they describe, so an interrupted run leaves a file without a stamp, which is
//!   rebuilt. No fsync is needed for correctness: a file damaged by a crash fails the hash.
//! - The hash is taken again only if the file is not the one last hashed: a stamp's last
//!   line records the size, modification time (ns), device and inode the file had then
//!   (`seen`), and a file that still has them all keeps the recorded hash. Every file here is
//!   written under a temporary name and renamed (a new inode), and a write in place moves
//!   the modification time, so either is hashed again. (Hashing the pinned kernel's 53 MB
//!   `vmlinux`, its bzImage and System.map took ~0.1 s of every `kpin run`.)
//! - Each job (`linux`, `minikernel`) holds an exclusive `flock` on `<out>/.lock-<job>` while
//!   it works, so concurrent callers (parallel tests, two shells) wait instead of racing.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use sha2::{Digest, Sha256};

use crate::ImagesError;

/// Name of the directory (under the output directory) holding stamps.
const STAMPS_DIR: &str = ".stamps";
/// First line of every stamp; bump the version when the stamp format changes.
const STAMP_HEADER: &str = "kpin-images stamp v1";
/// Marker in the names of temporary files, so that stale ones can be recognised and removed.
const TEMP_MARKER: &str = ".kpin-tmp-";

/// Shorthand for an [`ImagesError::Io`] constructor.
pub(crate) fn io_error(action: &'static str, path: &Path) -> impl FnOnce(io::Error) -> ImagesError {
    let path = path.to_path_buf();
    move |source| ImagesError::Io {
        action,
        path,
        source,
    }
}

/// Creates `dir` and its parents.
pub(crate) fn create_dir_all(dir: &Path) -> Result<(), ImagesError> {
    fs::create_dir_all(dir).map_err(io_error("create directory", dir))
}

/// Lower-case hex of `bytes`.
pub(crate) fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        write!(out, "{b:02x}").expect("writing to a String cannot fail");
    }
    out
}

/// SHA-256 of `bytes`, as lower-case hex.
pub(crate) fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

/// SHA-256 and size of the file at `path`, streamed.
pub(crate) fn sha256_file(path: &Path) -> io::Result<(String, u64)> {
    let mut file = File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut size = 0u64;
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        size += n as u64;
    }
    Ok((hex(&hasher.finalize()), size))
}

/// A fresh temporary path next to `path`: same directory, hidden, unique in this process.
fn temp_path_for(path: &Path) -> PathBuf {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}{TEMP_MARKER}{}-{n}", std::process::id()))
}

/// Writes `bytes` to `path` atomically (temporary file in the same directory, then rename).
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), ImagesError> {
    let temp = temp_path_for(path);
    let result = File::create(&temp)
        .and_then(|mut f| f.write_all(bytes))
        .map_err(io_error("write", &temp))
        .and_then(|()| fs::rename(&temp, path).map_err(io_error("rename into place", path)));
    if result.is_err() {
        let _ = fs::remove_file(&temp);
    }
    result
}

/// Moves the complete file `from` to `to` (same file system) atomically.
pub(crate) fn install_file(from: &Path, to: &Path) -> Result<(), ImagesError> {
    fs::rename(from, to).map_err(io_error("move into place", to))
}

/// Whether `name` is a temporary file whose writer is gone: the process id it embeds is not a
/// live process (another job may be writing its own temporary file next to ours right now).
fn is_stale_temp_name(name: &str) -> bool {
    let Some((_, tail)) = name.split_once(TEMP_MARKER) else {
        return false;
    };
    match tail
        .split('-')
        .next()
        .and_then(|pid| pid.parse::<u32>().ok())
    {
        Some(pid) => !Path::new("/proc").join(pid.to_string()).exists(),
        None => true,
    }
}

/// Removes temporary files that interrupted runs left in `dir` (not recursive); temporary
/// files of live processes are left alone.
pub(crate) fn remove_stale_temps(dir: &Path) -> Result<(), ImagesError> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io_error("list directory", dir)(e)),
    };
    for entry in entries {
        let entry = entry.map_err(io_error("list directory", dir))?;
        let name = entry.file_name();
        if is_stale_temp_name(&name.to_string_lossy()) {
            let path = entry.path();
            match fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(io_error("remove stale temporary file", &path)(e)),
            }
        }
    }
    Ok(())
}

/// Where the stamp of `file` lives.
fn stamp_path(out_dir: &Path, file: &Path) -> PathBuf {
    let relative = file
        .strip_prefix(out_dir)
        .ok()
        .map(Path::to_path_buf)
        .or_else(|| file.file_name().map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from("unnamed"));
    let mut stamp = out_dir.join(STAMPS_DIR).join(relative).into_os_string();
    stamp.push(".stamp");
    PathBuf::from(stamp)
}

fn stamp_text(inputs: &str, sha256: &str, size: u64) -> String {
    // Inputs are a single line so that the format stays line-oriented.
    let inputs = inputs.replace('\n', " ");
    format!("{STAMP_HEADER}\ninputs {inputs}\nsha256 {sha256}\nsize {size}\n")
}

/// If `file` exists and its stamp records exactly `inputs` and the file's current content,
/// returns the file's SHA-256; otherwise `None` (the file must be rebuilt).
pub(crate) fn fresh_sha256(
    out_dir: &Path,
    file: &Path,
    inputs: &str,
) -> Result<Option<String>, ImagesError> {
    let stamp = match fs::read_to_string(stamp_path(out_dir, file)) {
        Ok(stamp) => stamp,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        // A stamp that cannot be read (e.g. not UTF-8) is as good as none.
        Err(_) => return Ok(None),
    };
    let meta = match fs::metadata(file) {
        Ok(meta) => meta,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_error("read", file)(e)),
    };
    let (body, seen) = match stamp.trim_end_matches('\n').rsplit_once('\n') {
        Some((body, last)) if last.starts_with(SEEN) => (format!("{body}\n"), Some(last)),
        _ => (stamp.clone(), None),
    };
    if seen == Some(seen_line(&meta).as_str()) {
        let recorded = body.lines().find_map(|l| l.strip_prefix("sha256 "));
        return Ok(recorded
            .filter(|sha| body == stamp_text(inputs, sha, meta.len()))
            .map(str::to_owned));
    }
    let (sha256, size) = match sha256_file(file) {
        Ok(found) => found,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_error("read", file)(e)),
    };
    if body != stamp_text(inputs, &sha256, size) {
        return Ok(None);
    }
    // The next check need not hash it again (best effort: the hash is the proof).
    let _ = record_stamp(out_dir, file, inputs, &sha256, size);
    Ok(Some(sha256))
}

/// First word of a stamp's `seen` line.
const SEEN: &str = "seen ";

/// The `seen` line for a file with metadata `meta`: size, modification time, device and
/// inode (an inode number is unique only on its file system). A file whose line is
/// unchanged is taken as unchanged (here, and by the VMM's cache of kernel types).
pub fn seen_line(meta: &fs::Metadata) -> String {
    use std::os::unix::fs::MetadataExt;
    format!(
        "{SEEN}{} {}.{:09} {}:{}",
        meta.len(),
        meta.mtime(),
        meta.mtime_nsec(),
        meta.dev(),
        meta.ino()
    )
}

/// Records that `file`, whose content has SHA-256 `sha256` and length `size`, was built from
/// `inputs`.
pub(crate) fn record_stamp(
    out_dir: &Path,
    file: &Path,
    inputs: &str,
    sha256: &str,
    size: u64,
) -> Result<(), ImagesError> {
    let stamp = stamp_path(out_dir, file);
    if let Some(parent) = stamp.parent() {
        create_dir_all(parent)?;
    }
    let mut text = stamp_text(inputs, sha256, size);
    // Only a file that is still the one hashed gets a `seen` line, and only once its
    // modification time is settled: file times advance in clock ticks, so a write in
    // place within the tick of the last one could keep the time (git's "racy" entries).
    let settled = |m: &fs::Metadata| {
        m.modified()
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age >= SEEN_SETTLED)
    };
    if let Some(meta) = fs::metadata(file)
        .ok()
        .filter(|m| m.len() == size && settled(m))
    {
        text.push_str(&seen_line(&meta));
        text.push('\n');
    }
    write_atomic(&stamp, text.as_bytes())
}

/// How old a file's modification time must be before a stamp records it (`seen`).
const SEEN_SETTLED: std::time::Duration = std::time::Duration::from_secs(2);

/// Hashes `file` and records its stamp; returns the hash.
pub(crate) fn stamp_file(out_dir: &Path, file: &Path, inputs: &str) -> Result<String, ImagesError> {
    let (sha256, size) = sha256_file(file).map_err(io_error("read", file))?;
    record_stamp(out_dir, file, inputs, &sha256, size)?;
    Ok(sha256)
}

/// An exclusive advisory lock on `<out>/.lock-<job>`, released when dropped.
#[derive(Debug)]
pub(crate) struct JobLock {
    /// Closing the file releases the `flock`.
    _file: File,
}

impl JobLock {
    /// Takes the lock of `job` in `out_dir`, waiting (and saying so) if another run holds it.
    pub(crate) fn acquire(
        out_dir: &Path,
        job: &str,
        progress: &mut dyn FnMut(&str),
    ) -> Result<Self, ImagesError> {
        let path = out_dir.join(format!(".lock-{job}"));
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(io_error("open lock file", &path))?;
        if flock(&file, libc::LOCK_EX | libc::LOCK_NB).is_err() {
            progress(&format!(
                "waiting for another kpin-images run to finish ({} is locked)",
                path.display()
            ));
            flock(&file, libc::LOCK_EX).map_err(io_error("lock", &path))?;
        }
        Ok(JobLock { _file: file })
    }
}

/// `flock(2)` on `file`, retried on `EINTR`.
fn flock(file: &File, operation: libc::c_int) -> io::Result<()> {
    loop {
        // SAFETY: `flock` only reads its two integer arguments; the descriptor is owned by
        // `file`, which outlives the call, and no memory is passed.
        let rc = unsafe { libc::flock(file.as_raw_fd(), operation) };
        if rc == 0 {
            return Ok(());
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A unique, empty scratch directory for one test, removed on drop.
    pub(crate) struct ScratchDir(pub PathBuf);

    impl ScratchDir {
        pub(crate) fn new(name: &str) -> Self {
            static COUNTER: AtomicU64 = AtomicU64::new(0);
            let n = COUNTER.fetch_add(1, Ordering::Relaxed);
            let dir = std::env::temp_dir().join(format!(
                "kpin-images-test-{name}-{}-{n}",
                std::process::id()
            ));
            let _ = fs::remove_dir_all(&dir);
            fs::create_dir_all(&dir).expect("create scratch dir");
            ScratchDir(dir)
        }
    }

    impl Drop for ScratchDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn test_sha256_of_known_vector() {
        assert_eq!(
            sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn test_write_atomic_leaves_no_temp_file() {
        let dir = ScratchDir::new("atomic");
        let path = dir.0.join("file");
        write_atomic(&path, b"one").expect("write");
        write_atomic(&path, b"two").expect("overwrite");
        assert_eq!(fs::read(&path).expect("read"), b"two");
        let names: Vec<_> = fs::read_dir(&dir.0)
            .expect("list")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("file")]);
    }

    #[test]
    fn test_remove_stale_temps_removes_only_dead_writers_temps() {
        let dir = ScratchDir::new("stale");
        let keep = dir.0.join("vmlinux");
        let live = temp_path_for(&keep);
        // Process ids never exceed 2^22 on Linux, so this writer cannot be alive.
        let stale = dir.0.join(format!(".vmlinux{TEMP_MARKER}{}-0", u32::MAX));
        fs::write(&keep, b"k").expect("write");
        fs::write(&live, b"l").expect("write");
        fs::write(&stale, b"s").expect("write");
        remove_stale_temps(&dir.0).expect("clean");
        assert!(keep.exists());
        assert!(
            live.exists(),
            "the temp file of this live process was removed"
        );
        assert!(!stale.exists());
        remove_stale_temps(&dir.0.join("missing")).expect("missing dir is fine");
    }

    #[test]
    fn test_stamp_detects_changed_inputs_and_content() {
        let dir = ScratchDir::new("stamp");
        let file = dir.0.join("sub").join("data");
        create_dir_all(file.parent().expect("has parent")).expect("mkdir");
        assert_eq!(fresh_sha256(&dir.0, &file, "in").expect("check"), None);
        fs::write(&file, b"hello").expect("write");
        assert_eq!(fresh_sha256(&dir.0, &file, "in").expect("check"), None);
        let sha = stamp_file(&dir.0, &file, "in").expect("stamp");
        assert_eq!(sha, sha256_hex(b"hello"));
        assert_eq!(fresh_sha256(&dir.0, &file, "in").expect("check"), Some(sha));
        assert_eq!(fresh_sha256(&dir.0, &file, "other").expect("check"), None);
        fs::write(&file, b"hellO").expect("corrupt");
        assert_eq!(fresh_sha256(&dir.0, &file, "in").expect("check"), None);
        // Written back as stamped (a new modification time): hashed again, and trusted.
        fs::write(&file, b"hello").expect("restore");
        assert_eq!(
            fresh_sha256(&dir.0, &file, "in").expect("check"),
            Some(sha256_hex(b"hello"))
        );
        fs::remove_file(&file).expect("remove");
        assert_eq!(fresh_sha256(&dir.0, &file, "in").expect("check"), None);
    }

    #[test]
    fn test_stamp_trusts_the_file_it_last_hashed_and_rehashes_any_other() {
        let dir = ScratchDir::new("seen");
        let file = dir.0.join("data");
        fs::write(&file, b"hello").expect("write");
        // A time not settled (here: in the future, so that no clock decides): no `seen`.
        let age = |t: std::time::SystemTime| {
            File::options()
                .write(true)
                .open(&file)
                .and_then(|f| f.set_modified(t))
                .expect("set the file's time");
        };
        age(std::time::SystemTime::now() + std::time::Duration::from_secs(3600));
        stamp_file(&dir.0, &file, "in").expect("stamp");
        let stamp = fs::read_to_string(stamp_path(&dir.0, &file)).expect("stamp text");
        assert!(!stamp.contains(SEEN), "{stamp}");
        age(std::time::SystemTime::now() - std::time::Duration::from_secs(60));
        let sha = stamp_file(&dir.0, &file, "in").expect("stamp");
        let stamp = fs::read_to_string(stamp_path(&dir.0, &file)).expect("stamp text");
        assert!(
            stamp.lines().last().is_some_and(|l| l.starts_with(SEEN)),
            "{stamp}"
        );
        // A stamp without the line (an older kpin's) is checked by hashing, then gains it.
        let body = stamp_text("in", &sha, 5);
        fs::write(stamp_path(&dir.0, &file), &body).expect("old stamp");
        assert_eq!(
            fresh_sha256(&dir.0, &file, "in").expect("check"),
            Some(sha.clone())
        );
        let upgraded = fs::read_to_string(stamp_path(&dir.0, &file)).expect("stamp text");
        assert_eq!(upgraded, stamp);
        // The recorded hash is what a trusted file answers, for its own inputs only.
        assert_eq!(fresh_sha256(&dir.0, &file, "in").expect("check"), Some(sha));
        assert_eq!(fresh_sha256(&dir.0, &file, "other").expect("check"), None);
        // Replaced by another file of the same size (a new inode): hashed, refused.
        let other = dir.0.join("other");
        fs::write(&other, b"HELLO").expect("write");
        fs::rename(&other, &file).expect("rename");
        assert_eq!(fresh_sha256(&dir.0, &file, "in").expect("check"), None);
    }

    #[test]
    fn test_job_lock_excludes_second_holder() {
        let dir = ScratchDir::new("lock");
        let _held = JobLock::acquire(&dir.0, "job", &mut |_| {}).expect("first lock");
        let second = OpenOptions::new()
            .write(true)
            .open(dir.0.join(".lock-job"))
            .expect("open");
        assert!(flock(&second, libc::LOCK_EX | libc::LOCK_NB).is_err());
        drop(_held);
        flock(&second, libc::LOCK_EX | libc::LOCK_NB).expect("free after drop");
    }
}
