//! A tool's host-side part (feature `host`): what the VMM (`kpin`) does for the tool on
//! the host, through [`HostTool`] hooks it calls for whichever tool the run chose. A tool
//! crate with a host part exports `pub const HOST` implementing [`HostTool`] under its own
//! `host` feature; the registry (`tools/registry`, feature `host`) lists every tool's
//! host part (an [`EngineOnly`] for a tool without one), so the VMM names no tool.
//!
//! The hooks, each optional:
//! * [`HostTool::engine_options`]: the option values checked before boot (a mistake is
//!   exit status 2, not a failed run), and the words the engine gets instead of the given
//!   ones (a host file an option names read here: the engine cannot read host files);
//! * [`HostTool::record_consumer`]: the tool's memory records simulated on a host thread,
//!   fed through the record ring (the engine side's [`crate::HostPart::takes_records`]);
//! * [`HostTool::report`]: reports made from the tool's files after the run, with kernel
//!   symbols ([`BlockNames`]) and an entry in `run.json` ([`HostTool::run_json_key`]);
//! * [`HostTool::trace`]: a printer for `kpin trace RUN` ([`TracePrinter`]).

extern crate std;

use alloc::boxed::Box;
use alloc::string::String;
use core::fmt;
use std::io;
use std::path::{Path, PathBuf};

use crate::host::{Error, Sink};
use crate::{MemRecord, ToolSpec};

/// How many entries a report's top list has unless `kpin run --top` says otherwise.
pub const DEFAULT_TOP: usize = 20;

/// Names for code addresses: a symbol table, and where it came from (the VMM's kernel
/// symbols, with the KASLR slide found from the addresses the run executed).
pub trait BlockNames {
    /// Where the names come from, for the report (`System.map …`, `ELF symbol table of
    /// …`).
    fn source(&self) -> String;
    /// `symbol+0xoff` for `addr`, if a symbol covers it.
    fn name(&self, addr: u64) -> Option<String>;
}

/// Where user-mode code came from: the file the guest had mapped at the code's address
/// when the engine translated it (`processes.json`'s `objects` and `code_pages`), and the
/// function the file's ELF symbols name there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UserCode {
    /// The file's path in the guest (`/bin/busybox`), or `[anon]` for code in memory no
    /// file backs (a JIT, the vDSO is `[vdso]`).
    pub object: String,
    /// The code's offset in that file.
    pub offset: u64,
    /// The symbol that covers `offset`, as `function+0xoff` (demangled C++/Rust names;
    /// [`function_of`] takes the offset off), if the file's symbols cover it.
    pub function: Option<String>,
}

/// Names for user-mode code, keyed by the code's physical address (the same file page is
/// the same code whatever process or virtual address ran it).
pub trait UserNames {
    /// Where the names come from, for the report (`processes.json + ELF files of
    /// images/out/initramfs.cpio`).
    fn source(&self) -> String;
    /// The object and function of the user-mode instruction at physical address `pa`
    /// (`None`: the engine saw no file there).
    fn name(&self, pa: u64) -> Option<UserCode>;
}

/// The function of a code name as [`BlockNames`] and [`UserCode::function`] give them:
/// `name` without a trailing `+0x…` offset (`do_syscall_64+0x40` → `do_syscall_64`).
pub fn function_of(name: &str) -> &str {
    match name.rsplit_once("+0x") {
        Some((f, off)) if !off.is_empty() && off.bytes().all(|b| b.is_ascii_hexdigit()) => f,
        _ => name,
    }
}

/// A tool's host-side part. Every hook has a default that does nothing.
pub trait HostTool: Sync {
    /// The tool's `SPEC`.
    fn spec(&self) -> &'static ToolSpec;

    /// Checks the `--tool-option` words (`key=value` separated by spaces, the engine's
    /// `bringup.*` among them; the keys were checked against the SPEC already) before
    /// boot. `Ok(Some(words))`: the engine gets these words instead of the tool's own
    /// (the VMM adds the `bringup.*` words); `Ok(None)`: the words as given. The error is
    /// said as `bad NAME options: ERROR`, exit status 2.
    fn engine_options(
        &self,
        options: &str,
        files: &mut dyn OptionFiles,
    ) -> Result<Option<String>, String> {
        let _ = (options, files);
        Ok(None)
    }

    /// A simulator for the tool's memory records on a host thread, fed from the record
    /// ring while the guest runs (`None`: the tool has none, or refuses `options`; the
    /// engine then runs the tool itself). Only for a tool whose SPEC says
    /// [`crate::HostPart::takes_records`].
    fn record_consumer(&self, options: &str) -> Option<Box<dyn RecordConsumer>> {
        let _ = options;
        None
    }

    /// The key of the tool's entry in `run.json`, if it has one: present in every run's
    /// `run.json` (`null` unless [`HostTool::report`] gave a value).
    fn run_json_key(&self) -> Option<&'static str> {
        None
    }

    /// The tool's reports, made after a run that used it and finished its files (not
    /// after a stop or a failed write). Files that cannot be used are said
    /// ([`RunFiles::say`]) and left out: they came from inside the guest.
    fn report(&self, run: &mut RunFiles<'_>) -> Reported {
        let _ = run;
        Reported::default()
    }

    /// The files [`HostTool::report`] writes in the output directory: the guest may not
    /// create them (the record ring's daemon refuses them, as kpin's own files).
    fn report_files(&self) -> &'static [&'static str] {
        &[]
    }

    /// The printer `kpin trace RUN` uses, if the tool leaves a trace.
    fn trace(&self) -> Option<&dyn TracePrinter> {
        None
    }
}

/// The host part of a tool that has none: every hook its default.
#[derive(Clone, Copy, Debug)]
pub struct EngineOnly(pub &'static ToolSpec);

impl HostTool for EngineOnly {
    fn spec(&self) -> &'static ToolSpec {
        self.0
    }
}

/// Host files an option names, read for [`HostTool::engine_options`] the way the VMM
/// reads its inputs (never blocking on a FIFO or a device).
pub trait OptionFiles {
    /// The length of the regular file at `path` (following symlinks: the operator chose
    /// it), without opening it; `what` names it in the error (`cannot read PATH (WHAT):
    /// …`, `WHAT PATH is a FIFO, not a regular file`).
    fn len(&mut self, path: &str, what: &str) -> Result<u64, String>;
    /// The file's text.
    fn read(&mut self, path: &str) -> Result<String, String>;
}

/// The records the engine sends to the host, simulated there.
pub trait RecordConsumer: Send {
    /// The next records, in the order the guest made them.
    fn feed(&mut self, records: &[MemRecord]);
    /// The run (or the tool's window) ended in order: the tool's files.
    fn write_files(&self, sink: &mut dyn Sink) -> Result<(), Error>;
    /// One line for `engine.log` (after `host: `).
    fn summary(&self, out: &mut dyn fmt::Write) -> fmt::Result;
}

/// What a report gets from the VMM.
pub struct RunFiles<'a> {
    /// The run's output directory.
    pub dir: &'a Path,
    /// The files the engine opened and had not closed when the run ended, relative to
    /// `dir`: not results.
    pub unfinished: &'a [PathBuf],
    /// `kpin run --top`: how many entries a top list has.
    pub top: usize,
    /// The guest kernel's symbols (`None`: it has none), their KASLR slide found from
    /// the kernel addresses the run `executed`.
    #[allow(clippy::type_complexity)]
    pub kernel_names: &'a mut dyn FnMut(
        &mut dyn Iterator<Item = u64>,
    ) -> anyhow::Result<Option<Box<dyn BlockNames>>>,
    /// Names for the user-mode code the run executed (`None`: the engine recorded no
    /// code origins, e.g. a kernel without BTF, or the guest's files are not on the host).
    #[allow(clippy::type_complexity)]
    pub user_names: &'a mut dyn FnMut() -> anyhow::Result<Option<Box<dyn UserNames>>>,
    /// Says a line of `kpin`'s progress.
    pub say: &'a mut dyn FnMut(&str),
}

impl RunFiles<'_> {
    /// Whether the engine left `name` (relative to the run's directory) unfinished.
    pub fn is_unfinished(&self, name: &str) -> bool {
        self.unfinished.iter().any(|p| p == Path::new(name))
    }

    /// Says `line` as `kpin`'s progress.
    pub fn say(&mut self, line: &str) {
        (self.say)(line);
    }

    /// See [`RunFiles::user_names`].
    pub fn user_code(&mut self) -> anyhow::Result<Option<Box<dyn UserNames>>> {
        (self.user_names)()
    }

    /// See [`RunFiles::kernel_names`].
    pub fn names(
        &mut self,
        executed: impl IntoIterator<Item = u64>,
    ) -> anyhow::Result<Option<Box<dyn BlockNames>>> {
        (self.kernel_names)(&mut executed.into_iter())
    }
}

/// A value for `run.json`: any serde value, serialised as it is (fields in their order).
pub type RunJson = Box<dyn erased_serde::Serialize>;

/// [`Reported::failure`] for an error writing `path`: `Some` only if the host's storage
/// failed (`host_daemon::resolve::is_host_fault`: full, read-only, failing), with the
/// error's OS number kept; anything else is the report's own problem, said, not a failure.
pub fn storage_failure(path: &Path, e: &io::Error) -> Option<(PathBuf, io::Error)> {
    if !host_daemon::resolve::is_host_fault(e) {
        return None;
    }
    e.raw_os_error()
        .map(|n| (path.to_path_buf(), io::Error::from_raw_os_error(n)))
}

/// What a report made.
#[derive(Default)]
pub struct Reported {
    /// The value of the tool's `run.json` entry ([`HostTool::run_json_key`]).
    pub run_json: Option<RunJson>,
    /// A report the host's storage could not take (the file, the error): the run's
    /// output is then incomplete (exit status 5).
    pub failure: Option<(PathBuf, io::Error)>,
}

/// A trace a tool left in the run's directory, printed by `kpin trace RUN`.
pub trait TracePrinter: Sync {
    /// The file it reads, in the run's directory.
    fn file(&self) -> &'static str;
    /// The instruction addresses of the trace in `bytes` (for the KASLR slide), `None`
    /// if it is not a whole trace.
    fn code_addresses<'a>(&self, bytes: &'a [u8]) -> Option<Box<dyn Iterator<Item = u64> + 'a>>;
    /// Writes the trace as text: at most `limit` records (`None`: all), instruction
    /// addresses named by `name`.
    fn print(
        &self,
        bytes: &[u8],
        limit: Option<u64>,
        name: &dyn Fn(u64) -> Option<String>,
        out: &mut dyn io::Write,
    ) -> Result<(), TraceError>;
}

/// Why a trace could not be printed.
#[derive(Debug)]
pub enum TraceError {
    /// Writing the text failed (a closed pipe is not an error for `kpin trace`).
    Io(io::Error),
    /// The file is not a whole trace: why.
    Format(String),
}

impl fmt::Display for TraceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TraceError::Io(e) => write!(f, "{e}"),
            TraceError::Format(e) => f.write_str(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn storage_failure_is_the_hosts_storage_only() {
        let path = Path::new("/out/report.txt");
        // ENOSPC on Linux.
        let full = io::Error::from_raw_os_error(28);
        let (p, e) = storage_failure(path, &full).expect("a full disk is a failure");
        assert_eq!((p.as_path(), e.raw_os_error()), (path, full.raw_os_error()));
        let missing = io::Error::from(io::ErrorKind::NotFound);
        assert!(storage_failure(path, &missing).is_none());
    }
}
