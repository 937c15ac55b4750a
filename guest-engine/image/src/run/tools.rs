//! The tools this image offers (`kpin run --tool NAME`), each a crate under `tools/`:
//! `null` (translation only), `bbcount` (an inline counter per basic block, written to
//! `bbcount.csv`), `cachesim` (a cache simulator fed with every fetch and data access,
//! configured by `--tool-option` in drcachesim's names) and `insmix` (dynamic counts per
//! mnemonic, `insmix.txt`/`insmix.json`) and `memtrace` (every data access into
//! `memtrace.bin`, streamed over the ring as it runs). A tool's files travel as `Open`/`Write`/`Close` records of the host I/O
//! ring ([`RingSink`]) and land in the run's output directory.

use core::fmt;

use kpin_abi::io_ring::Kind;
use kpin_tool::host::{Error, Sink};
use kpin_tool::{Engine, KpinTool, Tool};
use kpin_tool_bbcount::BbCount;
use kpin_tool_cachesim::CacheSim;
use kpin_tool_insmix::InsMix;
use kpin_tool_memtrace::MemTrace;
use kpin_tool_null::Null;

use crate::log;
use crate::ring0::log;

/// The names `--tool` accepts, for messages.
pub const NAMES: &str = "null, bbcount, cachesim, insmix, memtrace";

/// A tool chosen by name.
pub enum Chosen {
    /// `null`.
    Null(Null),
    /// `bbcount`.
    BbCount(BbCount),
    /// `cachesim`.
    CacheSim(alloc::boxed::Box<CacheSim>),
    /// `insmix`.
    InsMix(InsMix),
    /// `memtrace`.
    MemTrace(alloc::boxed::Box<MemTrace>),
}

impl Chosen {
    /// The tool called `name`, if the engine has it, configured by `options` (the
    /// `key=value` words of `--tool-option`). Options a tool refuses end the run.
    pub fn by_name(name: &str, options: &str) -> Option<Self> {
        match name {
            "null" => Some(Chosen::Null(Null)),
            "bbcount" => Some(Chosen::BbCount(BbCount::default())),
            "cachesim" => match CacheSim::new(options) {
                Ok(t) => Some(Chosen::CacheSim(alloc::boxed::Box::new(t))),
                Err(e) => {
                    log!(Error, "engine: cachesim: bad option {e}");
                    crate::ring0::log::fail();
                }
            },
            "insmix" => Some(Chosen::InsMix(InsMix::default())),
            "memtrace" => match MemTrace::new(options) {
                Ok(mut t) => {
                    t.stream_to(alloc::boxed::Box::new(RingSink));
                    Some(Chosen::MemTrace(alloc::boxed::Box::new(t)))
                }
                Err(e) => {
                    log!(Error, "engine: memtrace: bad option {e}");
                    crate::ring0::log::fail();
                }
            },
            _ => None,
        }
    }

    fn tool(&mut self) -> &mut dyn KpinTool {
        match self {
            Chosen::Null(t) => t,
            Chosen::BbCount(t) => t,
            Chosen::CacheSim(t) => &mut **t,
            Chosen::InsMix(t) => t,
            Chosen::MemTrace(t) => &mut **t,
        }
    }

    /// The tool as the translator drives it.
    pub fn as_tool(&mut self) -> &mut dyn Tool {
        match self {
            Chosen::Null(t) => t,
            Chosen::BbCount(t) => t,
            Chosen::CacheSim(t) => &mut **t,
            Chosen::InsMix(t) => t,
            Chosen::MemTrace(t) => &mut **t,
        }
    }

    /// Ends the tool's run: its files, then its summary line in the log.
    pub fn finish(&mut self, engine: &Engine) {
        let tool = self.tool();
        if let Err(e) = tool.finish(engine, &mut RingSink) {
            log!(
                Error,
                "engine: tool {} could not write its files: {e}",
                tool.name()
            );
        }
        let mut line = Line::default();
        if tool.summary(engine, &mut line).is_ok() && !line.0.is_empty() {
            log!(Info, "{}", line.0);
        }
    }
}

/// A summary line.
#[derive(Default)]
struct Line(alloc::string::String);

impl fmt::Write for Line {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        self.0.push_str(s);
        Ok(())
    }
}

/// Host files over the I/O ring. File numbers start at 1 (0 is no file) and are never
/// reused within a run, so the daemon can tell files apart.
#[derive(Default)]
pub struct RingSink;

/// The next file number to hand out.
static NEXT_FILE: core::sync::atomic::AtomicU16 = core::sync::atomic::AtomicU16::new(1);

impl Sink for RingSink {
    fn open(&mut self, name: &str) -> Result<u16, Error> {
        let n = NEXT_FILE.fetch_add(1, core::sync::atomic::Ordering::Relaxed);
        if n == u16::MAX {
            return Err(Error::TooManyFiles);
        }
        log::push(Kind::Open, n, name.as_bytes()).map_err(|_| Error::Transport)?;
        Ok(n)
    }

    fn write(&mut self, file: u16, data: &[u8]) -> Result<(), Error> {
        log::push(Kind::Write, file, data).map_err(|_| Error::Transport)
    }

    fn close(&mut self, file: u16) -> Result<(), Error> {
        log::push(Kind::Close, file, b"").map_err(|_| Error::Transport)
    }
}

/// Writes `contents` as `name` in the run's output directory.
pub fn write_file(name: &str, contents: &[u8]) -> Result<(), Error> {
    let mut sink = RingSink;
    let mut f = kpin_tool::host::File::create(&mut sink, name)?;
    f.write_all(contents)?;
    f.close()
}
