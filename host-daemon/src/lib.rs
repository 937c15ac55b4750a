//! The host daemon: drains the engine's I/O ring into the run's output directory.
//!
//! Everything in the ring comes from inside the VM and is treated as hostile:
//!
//! - `Open` records create files. A name must pass
//!   [`kpin_abi::io_ring::validate_name`] (relative, `[A-Za-z0-9._-/]`, no empty, `..` or
//!   dot-file component), must not be one of kpin's own files ([`RESERVED_NAMES`], and
//!   the tools' host-side reports the VMM adds with [`Daemon::reserve`]), and is
//!   resolved beneath the output directory without following symlinks
//!   ([`resolve::OutDir`]); a name that passes through a file, a symlink, a FIFO or a
//!   hard-linked file is refused. At most [`DaemonConfig::max_open_files`] files are open
//!   at once and [`DaemonConfig::max_files`] are created per run.
//! - `Write` appends, `Close` closes. Tool files and `engine.log` together take at most
//!   [`DaemonConfig::max_output_bytes`]; past that, writes are dropped and counted.
//! - `Log` lines go to `engine.log`, with escape sequences and control characters removed
//!   ([`text::terminal_safe`]): one record is one line. Errors and warnings are also
//!   echoed to stderr, up to [`DaemonConfig::max_echoed_lines`] per run.
//!
//! A refused name, or a write past a limit, is logged and counted, and the run goes on.
//! A corrupt ring or a host I/O failure is a [`DaemonError`]; after one, [`Daemon::serve`]
//! leaves the ring alone, and the VMM ends the run with an outcome that names it. A
//! failure of the host's storage (the file system full or read-only, an I/O error: also
//! when creating a file, see [`resolve::is_host_fault`]) is kept as the run's
//! [`OutputFailure`] ([`Daemon::output_failure`]): `kpin run` exits with its own status and
//! `run.json` says the output is incomplete. The files the engine opened and never closed
//! ([`Daemon::unfinished_files`]) are listed there too: they hold what the engine wrote so
//! far, not its finished results.
//!
//! Today the VMM calls [`Daemon::serve`] on its vCPU thread, on each doorbell and at the
//! end of the run; the control socket for `kpin attach/detach` will join this crate.
#![deny(missing_docs)]

pub mod resolve;
pub mod text;

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use kpin_abi::io_ring::{validate_name, Consumer, Kind, LogLevel, Record, RingError};
use kpin_abi::output;

use crate::resolve::OutDir;
use crate::text::terminal_safe;

/// Name of the engine's log in the output directory.
pub use kpin_abi::output::ENGINE_LOG;

/// The files kpin itself writes in the output directory (the VMM and this daemon):
/// a tool cannot create, truncate or append to them. (`counters.json` is not here: the
/// engine writes it through the ring, and kpin reads it back as untrusted JSON.)
pub const RESERVED_NAMES: &[&str] = &[
    output::CONSOLE_LOG,
    output::RUN_JSON,
    output::DUMP_TXT,
    ENGINE_LOG,
    output::CONTROL_SOCKET,
    output::GUEST_DISK_COPY,
];

/// Limits of one run's output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DaemonConfig {
    /// Tool files open at once (`kpin run --max-open-files`).
    pub max_open_files: usize,
    /// Files created in the run.
    pub max_files: u64,
    /// Bytes written to tool files and `engine.log` together (`kpin run
    /// --max-output-bytes`).
    pub max_output_bytes: u64,
    /// Engine errors and warnings (and the daemon's own notes) echoed to stderr at most;
    /// the rest are only in `engine.log`.
    pub max_echoed_lines: u64,
}

impl DaemonConfig {
    /// Default [`Self::max_open_files`].
    pub const DEFAULT_MAX_OPEN_FILES: usize = 64;
    /// Default [`Self::max_files`].
    pub const DEFAULT_MAX_FILES: u64 = 4096;
    /// Default [`Self::max_output_bytes`]: 1 GiB.
    pub const DEFAULT_MAX_OUTPUT_BYTES: u64 = 1 << 30;
    /// Default [`Self::max_echoed_lines`].
    pub const DEFAULT_MAX_ECHOED_LINES: u64 = 1000;
}

impl Default for DaemonConfig {
    fn default() -> Self {
        DaemonConfig {
            max_open_files: Self::DEFAULT_MAX_OPEN_FILES,
            max_files: Self::DEFAULT_MAX_FILES,
            max_output_bytes: Self::DEFAULT_MAX_OUTPUT_BYTES,
            max_echoed_lines: Self::DEFAULT_MAX_ECHOED_LINES,
        }
    }
}

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

/// The first write to the output directory that failed because of the host's storage (see
/// [`resolve::is_host_fault`]): the run's output is incomplete from there on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutputFailure {
    /// The file that could not be created or written.
    pub path: PathBuf,
    /// "output file system full", "output file system read-only", or "cannot write to
    /// the output directory" ([`resolve::fault_cause`]).
    pub cause: &'static str,
    /// The error, as the OS said it.
    pub error: String,
}

impl OutputFailure {
    /// The failure of a [`DaemonError::Io`] (`None` for a corrupt ring).
    pub fn of(e: &DaemonError) -> Option<Self> {
        match e {
            DaemonError::Io(path, io) => Some(Self::new(path, io)),
            DaemonError::Ring(_) => None,
        }
    }

    /// The failure to write `path` with `e`.
    pub fn new(path: &Path, e: &std::io::Error) -> Self {
        OutputFailure {
            path: path.to_owned(),
            cause: resolve::fault_cause(e),
            error: e.to_string(),
        }
    }

    /// One line: `output file system full: <path>`.
    pub fn reason(&self) -> String {
        format!("{}: {}", self.cause, self.path.display())
    }
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
    /// `Open` records refused (their name, or a limit).
    pub files_refused: u64,
    /// Payload bytes written to tool files.
    pub bytes_written: u64,
    /// Writes or closes to a file id that is not open (e.g. after a refusal), or writes
    /// past [`DaemonConfig::max_output_bytes`], dropped.
    pub writes_dropped: u64,
    /// Bytes of the dropped writes and log lines.
    pub bytes_dropped: u64,
    /// Engine log lines written.
    pub log_lines: u64,
    /// Engine log lines dropped past [`DaemonConfig::max_output_bytes`].
    pub log_lines_dropped: u64,
    /// Console bytes the engine batched ([`Kind::Console`]).
    pub console_bytes: u64,
}

/// The daemon for one run.
pub struct Daemon {
    out_dir: PathBuf,
    dir: Option<OutDir>,
    config: DaemonConfig,
    files: HashMap<u16, (PathBuf, BufWriter<File>)>,
    log: Option<BufWriter<File>>,
    /// Directories whose `engine.log` this daemon created.
    logs_begun: std::collections::HashSet<PathBuf>,
    stats: DaemonStats,
    /// Bytes written to tool files and `engine.log`.
    output_bytes: u64,
    echoed: u64,
    cap_noted: bool,
    first_error: Option<DaemonError>,
    /// The first storage failure (kept after `first_error` is handed out).
    output_failure: Option<OutputFailure>,
    stopped: bool,
    /// Where [`Kind::Console`] bytes go: the VMM's UART ([`Daemon::set_console`]).
    console: Option<ConsoleSink>,
    /// Names refused besides [`RESERVED_NAMES`] ([`Daemon::reserve`]).
    reserved: Vec<&'static str>,
}

/// Takes the console bytes of one [`Kind::Console`] record, in order.
pub type ConsoleSink = Box<dyn FnMut(&[u8])>;

impl Daemon {
    /// A daemon writing into `out_dir`, which must exist, with the default limits.
    pub fn new(out_dir: &Path) -> Self {
        Self::with_config(out_dir, DaemonConfig::default())
    }

    /// A daemon writing into `out_dir`, which must exist, with `config`'s limits.
    pub fn with_config(out_dir: &Path, config: DaemonConfig) -> Self {
        Daemon {
            out_dir: out_dir.to_owned(),
            dir: None,
            config,
            files: HashMap::new(),
            log: None,
            logs_begun: Default::default(),
            stats: DaemonStats::default(),
            output_bytes: 0,
            echoed: 0,
            cap_noted: false,
            first_error: None,
            output_failure: None,
            stopped: false,
            console: None,
            reserved: Vec::new(),
        }
    }

    /// Refuses the guest `names` too, as kpin's own files: the files a tool's host side
    /// writes after the run (`kpin_tool::host_side::HostTool::report_files`).
    pub fn reserve(&mut self, names: &[&'static str]) {
        self.reserved.extend_from_slice(names);
    }

    /// Sends the console bytes the engine batches to `uart` (without one they are
    /// dropped and counted).
    pub fn set_console(&mut self, uart: ConsoleSink) {
        self.console = Some(uart);
    }

    /// Writes files the engine opens from now on beneath `out_dir` (which must exist):
    /// each instrumentation window of `kpin attach` gets its own directory. Files already
    /// open stay where they are; `engine.log` is closed and continues in `out_dir` with
    /// the next log line (a new file, or the end of the one this run began there).
    pub fn set_out_dir(&mut self, out_dir: &Path) {
        if let Some(mut log) = self.log.take() {
            // A write error here would have shown on the line that failed; the lines
            // are the old window's either way.
            let _ = log.flush();
        }
        self.out_dir = out_dir.to_owned();
        self.dir = None;
    }

    /// Writes a whole file the host computed for the run (a tool whose work ran on the
    /// host, e.g. cachesim's simulation) under the same name rules, limits and output
    /// budget as the engine's files; a refusal is logged like theirs. Returns whether the
    /// file was written.
    pub fn write_host_file(&mut self, name: &str, data: &[u8]) -> bool {
        // The engine numbers its files from 1 and never uses `u16::MAX`.
        const HOST_FILE: u16 = u16::MAX;
        let written = self.open(HOST_FILE, name.as_bytes()).and_then(|()| {
            if !self.files.contains_key(&HOST_FILE) {
                return Ok(false);
            }
            let written = self.write(HOST_FILE, data)?;
            self.close(HOST_FILE)?;
            Ok(written)
        });
        match written {
            Ok(w) => w,
            Err(e) => {
                // The file may still be open after a failed write.
                self.files.remove(&HOST_FILE);
                self.note(&e);
                self.first_error.get_or_insert(e);
                false
            }
        }
    }

    /// A line the host adds to `engine.log` (charged to the output budget like the
    /// engine's own lines).
    pub fn log_host_line(&mut self, level: LogLevel, text: &str) {
        if let Err(e) = self.log_line(level, text) {
            self.note(&e);
            self.first_error.get_or_insert(e);
        }
    }

    /// Keeps the first storage failure.
    fn note(&mut self, e: &DaemonError) {
        if self.output_failure.is_none() {
            self.output_failure = OutputFailure::of(e);
        }
    }

    /// The first write to the output directory that failed, if one did: the run's tool
    /// files and `engine.log` are incomplete.
    pub fn output_failure(&self) -> Option<&OutputFailure> {
        self.output_failure.as_ref()
    }

    /// The files the engine (or the host) opened and has not closed, sorted: they hold
    /// what was written so far, not finished results (a run stopped before the tool
    /// finished, or after a failed write).
    pub fn unfinished_files(&self) -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = self.files.values().map(|(p, _)| p.clone()).collect();
        v.sort();
        v
    }

    /// Drains every record the engine has published. After an error the daemon is
    /// stopped: later calls return `Ok(0)` and leave the ring alone.
    pub fn serve(&mut self, ring: &mut Consumer) -> Result<usize, DaemonError> {
        if self.stopped {
            return Ok(0);
        }
        self.stats.drains += 1;
        let n = ring.drain(|r| {
            if self.first_error.is_none() {
                if let Err(e) = self.handle(r) {
                    self.first_error = Some(e);
                }
            }
        });
        let result = match self.first_error.take() {
            Some(e) => {
                self.note(&e);
                Err(e)
            }
            None => n.map_err(DaemonError::Ring),
        };
        self.stopped = result.is_err();
        result
    }

    /// The statistics so far.
    pub fn stats(&self) -> &DaemonStats {
        &self.stats
    }

    /// Tool files open now.
    pub fn open_files(&self) -> usize {
        self.files.len()
    }

    /// Bytes charged to [`DaemonConfig::max_output_bytes`] so far.
    pub fn output_bytes(&self) -> u64 {
        self.output_bytes
    }

    /// Flushes and closes everything, every file even after one fails; returns the
    /// statistics, or the first error.
    pub fn finish(mut self) -> Result<DaemonStats, DaemonError> {
        let mut first = None;
        let mut files: Vec<_> = self.files.drain().map(|(_, f)| f).collect();
        files.sort_by(|a, b| a.0.cmp(&b.0));
        for (path, mut f) in files {
            if let Err(e) = f.flush() {
                first.get_or_insert(DaemonError::Io(path, e));
            }
            // A BufWriter that could not flush would try again when dropped.
            let _ = f.into_parts();
        }
        if let Some(mut log) = self.log.take() {
            if let Err(e) = log.flush() {
                first.get_or_insert(DaemonError::Io(self.out_dir.join(ENGINE_LOG), e));
            }
            let _ = log.into_parts();
        }
        match first {
            Some(e) => Err(e),
            None => Ok(self.stats),
        }
    }

    fn dir(&mut self) -> Result<&OutDir, DaemonError> {
        if self.dir.is_none() {
            let d = OutDir::open(&self.out_dir)
                .map_err(|e| DaemonError::Io(self.out_dir.clone(), e))?;
            self.dir = Some(d);
        }
        Ok(self.dir.as_ref().expect("opened just above"))
    }

    fn handle(&mut self, r: Record<'_>) -> Result<(), DaemonError> {
        self.stats.records += 1;
        match r.kind {
            Kind::Pad => {}
            Kind::Open => self.open(r.file, r.payload)?,
            Kind::Write => {
                self.write(r.file, r.payload)?;
            }
            Kind::Close => {
                self.close(r.file)?;
            }
            Kind::Log => {
                let text = String::from_utf8_lossy(r.payload);
                self.log_line(LogLevel::from_u16(r.file), &text)?;
            }
            Kind::Console => {
                self.stats.console_bytes += r.payload.len() as u64;
                match self.console.as_mut() {
                    Some(uart) => uart(r.payload),
                    None => self.stats.bytes_dropped += r.payload.len() as u64,
                }
            }
        }
        Ok(())
    }

    /// Appends `data` to file `id`; whether it was written (not if the file is not open
    /// or the output budget is spent: counted as dropped).
    fn write(&mut self, id: u16, data: &[u8]) -> Result<bool, DaemonError> {
        let len = data.len() as u64;
        if !self.files.contains_key(&id) {
            self.stats.writes_dropped += 1;
            self.stats.bytes_dropped += len;
            return Ok(false);
        }
        if !self.take_budget(len)? {
            self.stats.writes_dropped += 1;
            return Ok(false);
        }
        let (path, f) = self.files.get_mut(&id).expect("checked above");
        f.write_all(data)
            .map_err(|e| DaemonError::Io(path.clone(), e))?;
        self.stats.bytes_written += len;
        Ok(true)
    }

    /// Closes file `id` (a close of a file not open counts as a dropped write).
    fn close(&mut self, id: u16) -> Result<(), DaemonError> {
        match self.files.remove(&id) {
            Some((path, mut f)) => f.flush().map_err(|e| DaemonError::Io(path, e)),
            None => {
                self.stats.writes_dropped += 1;
                Ok(())
            }
        }
    }

    /// Takes `len` bytes of the output budget; `false` (and a note, once) if they do not
    /// fit.
    fn take_budget(&mut self, len: u64) -> Result<bool, DaemonError> {
        let total = self.output_bytes.saturating_add(len);
        if total > self.config.max_output_bytes {
            self.stats.bytes_dropped = self.stats.bytes_dropped.saturating_add(len);
            if !self.cap_noted {
                self.cap_noted = true;
                let msg = format!(
                    "daemon: the run's output reached its limit of {} bytes (--max-output-bytes); further writes and log lines are dropped",
                    self.config.max_output_bytes
                );
                // The note itself is not charged: it is the last line the cap lets in.
                self.write_log(LogLevel::Error, &msg)?;
            }
            return Ok(false);
        }
        self.output_bytes = total;
        Ok(true)
    }

    fn refuse(&mut self, name: &[u8], why: &str) -> Result<(), DaemonError> {
        self.stats.files_refused += 1;
        let shown = String::from_utf8_lossy(name);
        self.log_line(
            LogLevel::Error,
            &format!("daemon: refused to create {shown:?}: {why}"),
        )
    }

    fn open(&mut self, id: u16, name: &[u8]) -> Result<(), DaemonError> {
        if let Some((path, mut old)) = self.files.remove(&id) {
            old.flush().map_err(|e| DaemonError::Io(path, e))?;
        }
        if let Err(why) = validate_name(name) {
            return self.refuse(
                name,
                &format!(
                    "{why:?}: a name must stay inside the output directory, without dot-files"
                ),
            );
        }
        let rel = std::str::from_utf8(name).expect("validate_name admits ASCII only");
        let first = rel.split('/').next().unwrap_or(rel);
        if RESERVED_NAMES.contains(&first) || self.reserved.contains(&first) {
            return self.refuse(name, "kpin writes that file itself");
        }
        if self.files.len() >= self.config.max_open_files {
            let max = self.config.max_open_files;
            return self.refuse(
                name,
                &format!("{max} files are open already (--max-open-files)"),
            );
        }
        if self.stats.files_opened >= self.config.max_files {
            let max = self.config.max_files;
            return self.refuse(name, &format!("the run created {max} files already"));
        }
        let created = self.dir()?.create_file(rel);
        match created {
            Ok(f) => {
                self.files
                    .insert(id, (self.out_dir.join(rel), BufWriter::new(f)));
                self.stats.files_opened += 1;
                Ok(())
            }
            // The host's storage failed, not the name: the run's output is incomplete.
            Err(e) if resolve::is_host_fault(&e) => Err(DaemonError::Io(self.out_dir.join(rel), e)),
            Err(e) => self.refuse(name, &e.to_string()),
        }
    }

    /// An engine log line (charged to the output budget).
    fn log_line(&mut self, level: LogLevel, text: &str) -> Result<(), DaemonError> {
        let len = text.len() as u64 + 10;
        if !self.take_budget(len)? {
            self.stats.log_lines_dropped += 1;
            return Ok(());
        }
        self.write_log(level, text)
    }

    fn write_log(&mut self, level: LogLevel, text: &str) -> Result<(), DaemonError> {
        let path = self.out_dir.join(ENGINE_LOG);
        if self.log.is_none() {
            // A directory whose log this run began already (window 0's `<out>/`, written
            // to again once the last window closes) gets the new lines at its end.
            let again = !self.logs_begun.insert(self.out_dir.clone());
            let dir = self.dir()?;
            let f = if again {
                dir.append_file(ENGINE_LOG)
            } else {
                dir.create_file(ENGINE_LOG)
            };
            self.log = Some(BufWriter::new(
                f.map_err(|e| DaemonError::Io(path.clone(), e))?,
            ));
        }
        let log = self.log.as_mut().expect("just created");
        let text = terminal_safe(text.trim_end_matches('\n'));
        writeln!(log, "[{level:?}] {text}").map_err(|e| DaemonError::Io(path, e))?;
        if level <= LogLevel::Warn {
            self.echoed += 1;
            let max = self.config.max_echoed_lines;
            if self.echoed <= max {
                eprintln!("kpin: engine: [{level:?}] {text}");
            } else if self.echoed == max + 1 {
                eprintln!(
                    "kpin: engine: more than {max} errors and warnings; the rest are only in {}",
                    self.out_dir.join(ENGINE_LOG).display()
                );
            }
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

    /// A test's output directory under the system's temporary directory, removed with
    /// everything in it when the test ends (pass or fail).
    struct Scratch(PathBuf);

    impl std::ops::Deref for Scratch {
        type Target = Path;
        fn deref(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn setup(test: &str) -> (Box<Mem>, Producer, Consumer, Scratch) {
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
        (mem, p, c, Scratch(dir))
    }

    #[test]
    fn test_console_records_reach_the_uart_in_order_or_are_counted_as_dropped() {
        let (_mem, mut p, mut c, dir) = setup("console");
        let mut d = Daemon::new(&dir);
        p.push(Kind::Console, 0, b"lost").unwrap();
        d.serve(&mut c).unwrap();
        assert_eq!(d.stats().bytes_dropped, 4, "no UART yet");
        let seen = std::rc::Rc::new(std::cell::RefCell::new(Vec::new()));
        let uart = seen.clone();
        d.set_console(Box::new(move |b: &[u8]| {
            uart.borrow_mut().extend_from_slice(b)
        }));
        p.push(Kind::Console, 0, b"[ 0.1] hello\n").unwrap();
        p.push(Kind::Log, LogLevel::Info as u16, b"between")
            .unwrap();
        p.push(Kind::Console, 0, b"[ 0.2] world\n").unwrap();
        d.serve(&mut c).unwrap();
        assert_eq!(&seen.borrow()[..], b"[ 0.1] hello\n[ 0.2] world\n");
        assert_eq!(d.stats().console_bytes, 4 + 26);
        assert!(
            !dir.join("console.log").exists(),
            "the daemon writes no file for the console: the VMM's UART does"
        );
    }

    #[test]
    fn test_host_files_follow_the_rules_of_the_engines_files() {
        let (_mem, _p, _c, dir) = setup("host-files");
        let mut d = Daemon::with_config(
            &dir,
            DaemonConfig {
                max_output_bytes: 1000,
                ..Default::default()
            },
        );
        assert!(d.write_host_file("cachesim-counters.txt", b"refs 1\n"));
        assert!(!d.write_host_file("run.json", b"{}"), "kpin's own file");
        assert!(
            !d.write_host_file("../outside", b"x"),
            "outside the directory"
        );
        assert!(
            !d.write_host_file("big", &[b'x'; 2000]),
            "over the output budget"
        );
        let stats = d.finish().unwrap();
        assert_eq!(
            std::fs::read_to_string(dir.join("cachesim-counters.txt")).unwrap(),
            "refs 1\n"
        );
        assert!(!dir.join("run.json").exists());
        // As for the engine's files: created, the write past the budget dropped (and
        // the log says the output reached its limit).
        assert_eq!(std::fs::read(dir.join("big")).unwrap().len(), 0);
        assert!(!dir.parent().unwrap().join("outside").exists());
        assert_eq!(stats.files_refused, 2);
        let log = std::fs::read_to_string(dir.join(ENGINE_LOG)).unwrap();
        assert!(log.contains("reached its limit"), "{log}");
    }

    #[test]
    fn test_a_directory_the_log_returns_to_keeps_its_earlier_lines() {
        let (_mem, mut p, mut c, dir) = setup("log-return");
        let window = dir.join("attach-1");
        std::fs::create_dir_all(&window).unwrap();
        let mut d = Daemon::new(&dir);
        for (at, line) in [
            (&*dir, "window 0"),
            (&*window, "window 1"),
            (&*dir, "resident"),
        ] {
            d.set_out_dir(at);
            p.push(Kind::Log, LogLevel::Info as u16, line.as_bytes())
                .unwrap();
            d.serve(&mut c).unwrap();
        }
        d.finish().unwrap();
        assert_eq!(
            std::fs::read_to_string(dir.join(ENGINE_LOG)).unwrap(),
            "[Info] window 0\n[Info] resident\n"
        );
        assert_eq!(
            std::fs::read_to_string(window.join(ENGINE_LOG)).unwrap(),
            "[Info] window 1\n"
        );
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

    #[test]
    fn test_reserved_dotfile_symlinked_and_below_a_file_names_are_refused_and_the_run_goes_on() {
        let (_mem, mut p, mut c, dir) = setup("refused");
        let victim = dir.with_extension("victim");
        std::fs::write(&victim, "keep").unwrap();
        std::os::unix::fs::symlink(&victim, dir.join("tool.csv")).unwrap();
        let mut d = Daemon::new(&dir);
        // A tool's host-side report, reserved by the VMM.
        d.reserve(&["tool-report.txt"]);
        p.push(Kind::Open, 1, b"plain").unwrap();
        for (id, name) in (2..).zip([
            &b"run.json"[..],
            b"console.log",
            b"engine.log",
            b"dump.txt",
            b"tool-report.txt",
            b"run.json/x",
            b".bashrc",
            b"sub/.hidden",
            b"tool.csv",
            b"plain/below",
        ]) {
            p.push(Kind::Open, id, name).unwrap();
            p.push(Kind::Write, id, b"forged").unwrap();
        }
        d.serve(&mut c).unwrap();
        let stats = d.finish().unwrap();
        assert_eq!((stats.files_opened, stats.files_refused), (1, 10));
        assert_eq!(stats.writes_dropped, 10);
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep");
        for kpin_file in [
            "run.json",
            "console.log",
            "dump.txt",
            "tool-report.txt",
            ".bashrc",
        ] {
            assert!(!dir.join(kpin_file).exists(), "{kpin_file}");
        }
        let log = std::fs::read_to_string(dir.join(ENGINE_LOG)).unwrap();
        assert_eq!(log.lines().count(), 10, "{log}");
        assert!(!log.contains("forged"), "{log}");
        assert!(
            log.contains("\"run.json\": kpin writes that file itself"),
            "{log}"
        );
        assert!(log.contains("symbolic link"), "{log}");
        assert!(log.contains("not a directory"), "{log}");
        std::fs::remove_file(&victim).unwrap();
    }

    #[test]
    fn test_open_files_and_output_bytes_are_capped() {
        let (_mem, mut p, mut c, dir) = setup("caps");
        let cfg = DaemonConfig {
            max_open_files: 2,
            max_files: 3,
            max_output_bytes: 100,
            max_echoed_lines: 0,
        };
        let mut d = Daemon::with_config(&dir, cfg);
        for id in 1..=3 {
            p.push(Kind::Open, id, format!("f{id}").as_bytes()).unwrap();
        }
        d.serve(&mut c).unwrap();
        assert_eq!((d.stats().files_opened, d.stats().files_refused), (2, 1));
        p.push(Kind::Close, 1, b"").unwrap();
        p.push(Kind::Open, 4, b"f4").unwrap();
        p.push(Kind::Close, 4, b"").unwrap();
        p.push(Kind::Open, 5, b"f5").unwrap();
        d.serve(&mut c).unwrap();
        assert_eq!(d.stats().files_opened, 3, "max_files");
        assert!(!dir.join("f5").exists());
        // 100 bytes of budget, minus the log lines above (each charged).
        for _ in 0..10 {
            p.push(Kind::Write, 2, &[b'x'; 40]).unwrap();
            d.serve(&mut c).unwrap();
        }
        let stats = d.finish().unwrap();
        let written = std::fs::metadata(dir.join("f2")).unwrap().len();
        let log_len = std::fs::metadata(dir.join(ENGINE_LOG)).unwrap().len();
        assert_eq!(written, stats.bytes_written);
        assert!(stats.bytes_written <= 100, "{stats:?}");
        assert!(stats.writes_dropped >= 8, "{stats:?}");
        let log = std::fs::read_to_string(dir.join(ENGINE_LOG)).unwrap();
        assert!(log.contains("reached its limit of 100 bytes"), "{log}");
        assert!(log_len < 400, "{log}");
    }

    #[test]
    fn test_log_text_cannot_forge_lines_or_reach_the_terminal_raw() {
        let (_mem, mut p, mut c, dir) = setup("logtext");
        let mut d = Daemon::new(&dir);
        p.push(
            Kind::Log,
            LogLevel::Info as u16,
            b"ok\n[Error] forged \x1b[2J\x1b]0;pwned\x07end\r",
        )
        .unwrap();
        d.serve(&mut c).unwrap();
        d.finish().unwrap();
        let log = std::fs::read_to_string(dir.join(ENGINE_LOG)).unwrap();
        assert_eq!(log, "[Info] ok [Error] forged end \n");
    }

    #[test]
    fn test_files_left_open_are_unfinished_and_storage_failures_are_told_from_a_corrupt_ring() {
        let (_mem, mut p, mut c, dir) = setup("unfinished");
        let mut d = Daemon::new(&dir);
        p.push(Kind::Open, 1, b"done.csv").unwrap();
        p.push(Kind::Open, 2, b"sub/partial.bin").unwrap();
        p.push(Kind::Open, 3, b"also.bin").unwrap();
        p.push(Kind::Write, 2, b"half a rec").unwrap();
        p.push(Kind::Close, 1, b"").unwrap();
        d.serve(&mut c).unwrap();
        assert_eq!(
            d.unfinished_files(),
            vec![dir.join("also.bin"), dir.join("sub/partial.bin")]
        );
        assert_eq!(d.output_failure(), None);
        let full = DaemonError::Io(
            dir.join("x"),
            std::io::Error::from_raw_os_error(libc::ENOSPC),
        );
        let failure = OutputFailure::of(&full).unwrap();
        assert_eq!(
            failure.reason(),
            format!("output file system full: {}", dir.join("x").display())
        );
        assert_eq!(
            OutputFailure::of(&DaemonError::Ring(RingError::Corrupt)),
            None
        );
        d.finish().unwrap();
        assert_eq!(
            std::fs::read(dir.join("sub/partial.bin")).unwrap(),
            b"half a rec"
        );
    }

    #[test]
    fn test_corrupt_ring_is_an_error_once_then_the_daemon_stops() {
        let (mut mem, mut p, mut c, dir) = setup("corrupt");
        let mut d = Daemon::new(&dir);
        p.push(Kind::Write, 1, b"x").unwrap();
        mem.0[HEADER_BYTES] = 77; // unknown kind
        assert!(matches!(
            d.serve(&mut c),
            Err(DaemonError::Ring(RingError::Corrupt))
        ));
        assert_eq!(d.serve(&mut c).unwrap(), 0, "stopped");
        d.finish().unwrap();
    }
}
