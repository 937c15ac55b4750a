//! The host daemon: drains the engine's I/O ring into the run's output directory.
//!
//! `Open` records create files (names checked with [`kpin_abi::io_ring::validate_name`]:
//! nothing can land outside the output directory), `Write` appends, `Close` closes, and
//! `Log` lines go to `engine.log` (errors and warnings are echoed to stderr). A refused
//! name is logged and counted, and writes to its file id are dropped and counted; the run
//! goes on. Host I/O failures (a full disk) are errors.
//!
//! Today the VMM calls [`Daemon::serve`] on its vCPU thread, on each doorbell and at the
//! end of the run; the control socket for `kpin attach/detach` will join this crate.
#![deny(missing_docs)]

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use kpin_abi::io_ring::{validate_name, Consumer, Kind, LogLevel, Record, RingError};

/// Name of the engine's log in the output directory.
pub const ENGINE_LOG: &str = "engine.log";

/// Failures of the daemon itself.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// The ring holds a malformed record.
    #[error("the engine's I/O ring is corrupt ({0:?})")]
    Ring(RingError),
    /// A file in the output directory could not be created or written.
    #[error("cannot write {}", .0.display())]
    Io(PathBuf, #[source] std::io::Error),
}

/// What the daemon did, for the run summary.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DaemonStats {
    /// Records handled.
    pub records: u64,
    /// Times the ring was drained.
    pub drains: u64,
    /// Files created.
    pub files_opened: u64,
    /// `Open` records refused for their name.
    pub files_refused: u64,
    /// Payload bytes written to tool files.
    pub bytes_written: u64,
    /// Writes or closes to a file id that is not open (e.g. after a refusal), dropped.
    pub writes_dropped: u64,
    /// Engine log lines.
    pub log_lines: u64,
}

/// The daemon for one run.
pub struct Daemon {
    out_dir: PathBuf,
    files: HashMap<u16, (PathBuf, BufWriter<File>)>,
    log: Option<BufWriter<File>>,
    stats: DaemonStats,
    first_error: Option<DaemonError>,
}

impl Daemon {
    /// A daemon writing into `out_dir`, which must exist.
    pub fn new(out_dir: &Path) -> Self {
        Daemon {
            out_dir: out_dir.to_owned(),
            files: HashMap::new(),
            log: None,
            stats: DaemonStats::default(),
            first_error: None,
        }
    }

    /// Writes files the engine opens from now on beneath `out_dir` (which must exist):
    /// each instrumentation window of `kpin attach` gets its own directory. Files already
    /// open stay where they are.
    pub fn set_out_dir(&mut self, out_dir: &Path) {
        self.out_dir = out_dir.to_owned();
    }

    /// Drains every record the engine has published.
    pub fn serve(&mut self, ring: &mut Consumer) -> Result<usize, DaemonError> {
        self.stats.drains += 1;
        let n = ring.drain(|r| {
            if self.first_error.is_none() {
                if let Err(e) = self.handle(r) {
                    self.first_error = Some(e);
                }
            }
        });
        if let Some(e) = self.first_error.take() {
            return Err(e);
        }
        n.map_err(DaemonError::Ring)
    }

    /// Flushes and closes everything; returns the statistics.
    pub fn finish(mut self) -> Result<DaemonStats, DaemonError> {
        for (_, (path, mut f)) in self.files.drain() {
            f.flush().map_err(|e| DaemonError::Io(path, e))?;
        }
        if let Some(mut log) = self.log.take() {
            log.flush()
                .map_err(|e| DaemonError::Io(self.out_dir.join(ENGINE_LOG), e))?;
        }
        Ok(self.stats)
    }

    fn handle(&mut self, r: Record<'_>) -> Result<(), DaemonError> {
        self.stats.records += 1;
        match r.kind {
            Kind::Pad => {}
            Kind::Open => self.open(r.file, r.payload)?,
            Kind::Write => match self.files.get_mut(&r.file) {
                Some((path, f)) => {
                    f.write_all(r.payload)
                        .map_err(|e| DaemonError::Io(path.clone(), e))?;
                    self.stats.bytes_written += r.payload.len() as u64;
                }
                None => self.stats.writes_dropped += 1,
            },
            Kind::Close => match self.files.remove(&r.file) {
                Some((path, mut f)) => f.flush().map_err(|e| DaemonError::Io(path, e))?,
                None => self.stats.writes_dropped += 1,
            },
            Kind::Log => {
                let text = String::from_utf8_lossy(r.payload);
                self.log_line(LogLevel::from_u16(r.file), &text)?;
            }
        }
        Ok(())
    }

    fn open(&mut self, id: u16, name: &[u8]) -> Result<(), DaemonError> {
        if let Some((path, mut old)) = self.files.remove(&id) {
            old.flush().map_err(|e| DaemonError::Io(path, e))?;
        }
        if let Err(why) = validate_name(name) {
            self.stats.files_refused += 1;
            let shown = String::from_utf8_lossy(name);
            return self.log_line(
                LogLevel::Error,
                &format!("daemon: refused to create {shown:?} ({why:?}): it must stay inside the output directory"),
            );
        }
        let rel = std::str::from_utf8(name).expect("validate_name admits ASCII only");
        let path = self.out_dir.join(rel);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|e| DaemonError::Io(parent.to_owned(), e))?;
        }
        let f = File::create(&path).map_err(|e| DaemonError::Io(path.clone(), e))?;
        self.files.insert(id, (path, BufWriter::new(f)));
        self.stats.files_opened += 1;
        Ok(())
    }

    fn log_line(&mut self, level: LogLevel, text: &str) -> Result<(), DaemonError> {
        let path = self.out_dir.join(ENGINE_LOG);
        if self.log.is_none() {
            let f = File::create(&path).map_err(|e| DaemonError::Io(path.clone(), e))?;
            self.log = Some(BufWriter::new(f));
        }
        let log = self.log.as_mut().expect("just created");
        let text = text.trim_end_matches('\n');
        writeln!(log, "[{level:?}] {text}").map_err(|e| DaemonError::Io(path, e))?;
        if level <= LogLevel::Warn {
            eprintln!("kpin: engine: [{level:?}] {text}");
        }
        self.stats.log_lines += 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use kpin_abi::io_ring::{format, Producer, HEADER_BYTES};

    use super::*;

    #[repr(C, align(64))]
    struct Mem([u8; HEADER_BYTES + 4096]);

    fn setup(test: &str) -> (Box<Mem>, Producer, Consumer, PathBuf) {
        let mut mem = Box::new(Mem([0; HEADER_BYTES + 4096]));
        let base = mem.0.as_mut_ptr();
        let len = mem.0.len();
        // SAFETY: the boxed memory outlives both handles (returned together, dropped last
        // by the test's declaration order) and is 64-byte aligned.
        unsafe { format(base, len, 1024) }.unwrap();
        // SAFETY: as above.
        let p = unsafe { Producer::attach(base, len) }.unwrap();
        // SAFETY: as above.
        let c = unsafe { Consumer::attach(base, len) }.unwrap();
        let dir = std::env::temp_dir().join(format!("kpin-daemon-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        (mem, p, c, dir)
    }

    #[test]
    fn test_tool_files_and_engine_log_land_in_output_dir() {
        let (_mem, mut p, mut c, dir) = setup("files");
        let mut d = Daemon::new(&dir);
        p.push(Kind::Open, 1, b"bbcount/blocks.csv").unwrap();
        p.push(Kind::Write, 1, b"pc,count\n").unwrap();
        p.push(Kind::Log, LogLevel::Info as u16, b"engine up")
            .unwrap();
        assert_eq!(d.serve(&mut c).unwrap(), 3);
        p.push(Kind::Write, 1, b"0x1000,7\n").unwrap();
        p.push(Kind::Close, 1, b"").unwrap();
        assert_eq!(d.serve(&mut c).unwrap(), 2);
        let stats = d.finish().unwrap();
        assert_eq!(
            std::fs::read_to_string(dir.join("bbcount/blocks.csv")).unwrap(),
            "pc,count\n0x1000,7\n"
        );
        assert_eq!(
            std::fs::read_to_string(dir.join(ENGINE_LOG)).unwrap(),
            "[Info] engine up\n"
        );
        assert_eq!(stats.files_opened, 1);
        assert_eq!(stats.bytes_written, 18);
        assert_eq!(stats.drains, 2);
    }

    #[test]
    fn test_escaping_name_is_refused_logged_and_its_writes_dropped() {
        let (_mem, mut p, mut c, dir) = setup("escape");
        let mut d = Daemon::new(&dir);
        p.push(Kind::Open, 2, b"../../escaped.txt").unwrap();
        p.push(Kind::Write, 2, b"secret").unwrap();
        p.push(Kind::Open, 3, b"/tmp/abs.txt").unwrap();
        d.serve(&mut c).unwrap();
        let stats = d.finish().unwrap();
        assert_eq!(stats.files_refused, 2);
        assert_eq!(stats.writes_dropped, 1);
        assert!(!dir.join("../../escaped.txt").exists());
        assert!(!dir.parent().unwrap().join("escaped.txt").exists());
        let log = std::fs::read_to_string(dir.join(ENGINE_LOG)).unwrap();
        assert!(
            log.contains("refused to create \"../../escaped.txt\""),
            "{log}"
        );
    }
}
