//! The tools this image offers (`kpin run --tool NAME`), each a crate under `tools/`
//! listed in the registry (`kpin_tool_registry::TOOLS`, their names and options):
//! `null` (translation only), `bbcount` (an inline counter per basic block, written to
//! `bbcount.csv`), `cachesim` (a cache simulator fed with every fetch and data access,
//! configured by `--tool-option` in drcachesim's names) and `insmix` (dynamic counts per
//! mnemonic, `insmix.txt`/`insmix.json`) and `memtrace` (every data access into
//! `memtrace.bin`, streamed over the ring as it runs). A tool's files travel as `Open`/`Write`/`Close` records of the host I/O
//! ring ([`RingSink`]) and land in the run's output directory.
//!
//! cachesim chosen at boot, when the VMM formatted the record ring (it then runs the
//! simulation on a host thread, on another core), is [`HostCacheSim`]: the same
//! instrumentation, its records handed to the host instead of simulated here.

use core::fmt;

use kpin_abi::io_ring::Kind;
use kpin_abi::record_ring::{self, Producer};
use kpin_abi::stolen::{RECORD_RING_BYTES, RECORD_RING_OFFSET, WINDOW_VA};
use kpin_tool::host::{Error, Sink};
use kpin_tool::{Engine, KpinTool, MemRecord, Tool, TraceInstrumenter};
use kpin_tool_bbcount::BbCount;
use kpin_tool_cachesim::CacheSim;
use kpin_tool_insmix::InsMix;
use kpin_tool_memtrace::MemTrace;
use kpin_tool_null::Null;

use crate::log;
use crate::ring0::log;

/// The names `--tool` accepts in this image, for messages: the registry's, and an
/// out-of-tree crate's when the image was built with one.
pub struct ToolNames;

impl fmt::Display for ToolNames {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", kpin_tool_registry::Names)?;
        #[cfg(feature = "extra-tool")]
        write!(f, ", {}", kpin_extra_tool::SPEC.name)?;
        Ok(())
    }
}

/// A tool chosen by name.
pub enum Chosen {
    /// `null`.
    Null(Null),
    /// `bbcount`.
    BbCount(BbCount),
    /// `cachesim`.
    CacheSim(alloc::boxed::Box<CacheSim>),
    /// `cachesim`, simulating on the host.
    HostCacheSim(alloc::boxed::Box<HostCacheSim>),
    /// `insmix`.
    InsMix(InsMix),
    /// `memtrace`.
    MemTrace(alloc::boxed::Box<MemTrace>),
    /// The out-of-tree tool crate of `kpin run --tool-crate` (an image built by
    /// `kpin_images::ensure_engine_with_tool`): its `new_tool` made it.
    #[cfg(feature = "extra-tool")]
    Extra(alloc::boxed::Box<dyn KpinTool>),
}

impl Chosen {
    /// The tool the run starts with: [`Chosen::by_name`], except that cachesim simulates
    /// on the host when the VMM formatted the record ring for it.
    pub fn for_boot(name: &str, options: &str) -> Option<Self> {
        match Self::by_name(name, options)? {
            Chosen::CacheSim(sim) => Some(match HostCacheSim::attach(sim) {
                Ok(t) => Chosen::HostCacheSim(alloc::boxed::Box::new(t)),
                Err(sim) => Chosen::CacheSim(sim),
            }),
            other => Some(other),
        }
    }

    /// The tool called `name`, if the engine has it, configured by `options` (the
    /// `key=value` words of `--tool-option`). Options a tool refuses end the run. Each
    /// arm is a registry tool, by its crate's `SPEC` (the VMM's tests check that every
    /// registry tool has one).
    pub fn by_name(name: &str, options: &str) -> Option<Self> {
        match name {
            _ if name == kpin_tool_null::SPEC.name => Some(Chosen::Null(Null)),
            _ if name == kpin_tool_bbcount::SPEC.name => Some(Chosen::BbCount(BbCount::default())),
            _ if name == kpin_tool_cachesim::SPEC.name => match CacheSim::new(options) {
                Ok(t) => Some(Chosen::CacheSim(alloc::boxed::Box::new(t))),
                Err(e) => {
                    log!(Error, "engine: cachesim: bad option {e}");
                    crate::ring0::log::fail();
                }
            },
            _ if name == kpin_tool_insmix::SPEC.name => Some(Chosen::InsMix(InsMix::default())),
            _ if name == kpin_tool_memtrace::SPEC.name => match MemTrace::new(options) {
                Ok(mut t) => {
                    t.stream_to(alloc::boxed::Box::new(RingSink));
                    Some(Chosen::MemTrace(alloc::boxed::Box::new(t)))
                }
                Err(e) => {
                    log!(Error, "engine: memtrace: bad option {e}");
                    crate::ring0::log::fail();
                }
            },
            #[cfg(feature = "extra-tool")]
            _ if name == kpin_extra_tool::SPEC.name => match kpin_extra_tool::new_tool(options) {
                Ok(t) => Some(Chosen::Extra(t)),
                Err(e) => {
                    log!(Error, "engine: {name}: bad option {e}");
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
            Chosen::HostCacheSim(t) => &mut **t,
            Chosen::InsMix(t) => t,
            Chosen::MemTrace(t) => &mut **t,
            #[cfg(feature = "extra-tool")]
            Chosen::Extra(t) => &mut **t,
        }
    }

    /// The tool as the translator drives it.
    pub fn as_tool(&mut self) -> &mut dyn Tool {
        match self {
            Chosen::Null(t) => t,
            Chosen::BbCount(t) => t,
            Chosen::CacheSim(t) => &mut **t,
            Chosen::HostCacheSim(t) => &mut **t,
            Chosen::InsMix(t) => t,
            Chosen::MemTrace(t) => &mut **t,
            #[cfg(feature = "extra-tool")]
            Chosen::Extra(t) => &mut **t,
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

/// cachesim whose simulation runs on the host: the instrumentation of [`CacheSim`] (the
/// same records, physical addresses resolved by the engine), the records pushed into the
/// record ring for the VMM's simulator thread, which writes the tool's files when the run
/// ends. A push waits while the ring is full, so the simulation sees every record.
pub struct HostCacheSim {
    /// Instruments traces and checked the options; its counters stay empty.
    sim: alloc::boxed::Box<CacheSim>,
    ring: Producer,
}

/// Whether the record ring's producer was taken (it has one, for the run).
static RING_TAKEN: core::sync::atomic::AtomicBool = core::sync::atomic::AtomicBool::new(false);

const _: () = assert!(core::mem::size_of::<MemRecord>() == record_ring::RECORD_BYTES);

impl HostCacheSim {
    /// `sim` feeding the host's simulator, or `sim` back if no consumer formatted the
    /// ring (or its producer was taken already).
    fn attach(sim: alloc::boxed::Box<CacheSim>) -> Result<Self, alloc::boxed::Box<CacheSim>> {
        if RING_TAKEN.swap(true, core::sync::atomic::Ordering::Relaxed) {
            return Err(sim);
        }
        let base = (WINDOW_VA + RECORD_RING_OFFSET) as *mut u8;
        // SAFETY: the window maps the whole stolen region (the bring-up checked its size
        // against the layout), `RECORD_RING_OFFSET` is 2 MiB aligned and reserved for the
        // ring, and `RING_TAKEN` makes this the ring's only producer.
        match unsafe { Producer::attach(base, RECORD_RING_BYTES as usize) } {
            Ok(ring) => Ok(Self { sim, ring }),
            Err(_) => Err(sim),
        }
    }
}

impl Tool for HostCacheSim {
    fn instrument_trace(&mut self, trace: &mut TraceInstrumenter<'_>) {
        self.sim.instrument_trace(trace);
    }

    fn buffer_full(&mut self, records: &[MemRecord]) {
        // SAFETY: `MemRecord` is `repr(C)` with only integer fields and no padding (32
        // bytes, asserted above): its bytes may be read as `u8`s.
        let bytes = unsafe {
            core::slice::from_raw_parts(
                records.as_ptr().cast::<u8>(),
                core::mem::size_of_val(records),
            )
        };
        if let Err(e) = self.ring.push(bytes) {
            log!(
                Error,
                "engine: cachesim: the host's simulator no longer takes records ({e:?})"
            );
            log::fail();
        }
    }

    fn records_fetches(&self) -> bool {
        self.sim.records_fetches()
    }

    fn fetch_runs(&self) -> bool {
        self.sim.fetch_runs()
    }

    fn records_need_pa(&self) -> bool {
        self.sim.records_need_pa()
    }
}

impl KpinTool for HostCacheSim {
    fn name(&self) -> &'static str {
        kpin_tool_cachesim::SPEC.name
    }

    fn finish(&mut self, _engine: &Engine, _host: &mut dyn Sink) -> Result<(), Error> {
        // The host's simulator writes the files once it has read every record.
        self.ring.close();
        Ok(())
    }

    fn summary(&self, _engine: &Engine, out: &mut dyn fmt::Write) -> fmt::Result {
        write!(
            out,
            "cachesim: {} records sent to the host's simulator ({} waits for room); it writes cachesim-counters.txt, cachesim-timeline.csv and cachesim-insns.csv",
            self.ring.published(),
            self.ring.waits()
        )
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
