//! The tools this image offers (`kpin run --tool NAME`): the registry's
//! (`kpin_tool_registry::ENTRIES`, each tool crate's `SPEC` and `new_tool`), and an
//! out-of-tree crate's when the image was built with one (feature `extra-tool`). This
//! file names no tool: [`Chosen`] is whichever the name selects, built by its crate's
//! constructor. A tool's files travel as `Open`/`Write`/`Close` records of the host I/O
//! ring ([`RingSink`]) and land in the run's output directory; a tool that writes during
//! the run gets a [`RingSink`] of its own (`KpinTool::stream_to`).
//!
//! A tool whose SPEC says its records may be simulated on the host
//! (`HostPart::takes_records`: cachesim), chosen at boot when the VMM formatted the record
//! ring (it then runs the simulation on a host thread, on another core), is wrapped in
//! [`ToHost`]: the same instrumentation, its records handed to the host instead of
//! processed here.

use alloc::boxed::Box;
use core::fmt;

use kpin_abi::io_ring::Kind;
use kpin_abi::ports::{DOORBELL_PORT, DOORBELL_RECORD_ROOM};
use kpin_abi::record_ring::{self, Producer};
use kpin_abi::stolen::{RECORD_RING_BYTES, RECORD_RING_OFFSET, WINDOW_VA};
use kpin_tool::host::{Error, Sink};
use kpin_tool::{Engine, KpinTool, MemRecord, NewTool, Tool, ToolSpec, TraceInstrumenter};

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

/// The tool called `name` in this image: its SPEC and constructor (a registry tool first,
/// then the out-of-tree crate's).
fn lookup(name: &str) -> Option<(&'static ToolSpec, NewTool)> {
    let found = kpin_tool_registry::entry(name).map(|e| (e.spec, e.new_tool));
    #[cfg(feature = "extra-tool")]
    let found = found.or_else(|| {
        (name == kpin_extra_tool::SPEC.name)
            .then_some((&kpin_extra_tool::SPEC, kpin_extra_tool::new_tool as NewTool))
    });
    found
}

/// The tool the run uses: a registry tool (or the out-of-tree crate's of
/// `kpin run --tool-crate`, an image built by `kpin_images::ensure_engine_with_tool`),
/// made by its crate's `new_tool`. The translator drives it through `dyn Tool`, as it
/// always did: the hooks run at translation time, and what runs per instruction is the
/// code they inserted.
pub struct Chosen(Box<dyn KpinTool>);

impl Chosen {
    /// The tool the run starts with: [`Chosen::by_name`], its records handed to the
    /// host's simulator ([`ToHost`]) when its SPEC allows it and the VMM formatted the
    /// record ring for it.
    pub fn for_boot(name: &str, options: &str) -> Option<Self> {
        let (spec, new_tool) = lookup(name)?;
        let tool = Self::build(name, new_tool, options);
        Some(match spec.host.and_then(|h| h.takes_records) {
            Some(writes) => match ToHost::attach(tool.0, writes) {
                Ok(t) => Chosen(Box::new(t)),
                Err(tool) => Chosen(tool),
            },
            None => tool,
        })
    }

    /// The tool called `name`, if the engine has it, configured by `options` (the
    /// `key=value` words of `--tool-option`). Options a tool refuses end the run.
    pub fn by_name(name: &str, options: &str) -> Option<Self> {
        let (_, new_tool) = lookup(name)?;
        Some(Self::build(name, new_tool, options))
    }

    /// The tool a resident engine runs (no instrumentation): the registry's
    /// `RESIDENT`.
    pub fn resident() -> Self {
        let spec = kpin_tool_registry::RESIDENT;
        match Self::by_name(spec.name, "") {
            Some(t) => t,
            None => {
                log!(Error, "engine: no resident tool {}", spec.name);
                log::fail();
            }
        }
    }

    fn build(name: &str, new_tool: NewTool, options: &str) -> Self {
        match new_tool(options) {
            Ok(mut t) => {
                t.stream_to(Box::new(RingSink));
                Chosen(t)
            }
            Err(e) => {
                log!(Error, "engine: {name}: bad option {e}");
                log::fail();
            }
        }
    }

    /// The tool as the translator drives it.
    pub fn as_tool(&mut self) -> &mut dyn Tool {
        &mut *self.0
    }

    /// Ends the tool's run: its files, then its summary line in the log.
    pub fn finish(&mut self, engine: &Engine) {
        let tool = &mut *self.0;
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

/// A tool whose simulation runs on the host: its instrumentation (the same records,
/// physical addresses resolved by the engine), the records pushed into the record ring
/// for the VMM's simulator thread, which writes the tool's files when the run ends. A
/// push waits while the ring is full (asleep in the VMM), so the simulation sees every
/// record.
pub struct ToHost {
    /// Instruments traces and checked the options; it is fed nothing.
    tool: Box<dyn KpinTool>,
    ring: Producer,
    /// The files the host's simulator writes (the SPEC's `takes_records`).
    writes: &'static str,
}

/// Whether the record ring's producer was taken (it has one, for the run).
static RING_TAKEN: core::sync::atomic::AtomicBool = core::sync::atomic::AtomicBool::new(false);

const _: () = assert!(core::mem::size_of::<MemRecord>() == record_ring::RECORD_BYTES);

impl ToHost {
    /// `tool` feeding the host's simulator, or `tool` back if no consumer formatted the
    /// ring (or its producer was taken already).
    fn attach(tool: Box<dyn KpinTool>, writes: &'static str) -> Result<Self, Box<dyn KpinTool>> {
        if RING_TAKEN.swap(true, core::sync::atomic::Ordering::Relaxed) {
            return Err(tool);
        }
        let base = (WINDOW_VA + RECORD_RING_OFFSET) as *mut u8;
        // SAFETY: the window maps the whole stolen region (the bring-up checked its size
        // against the layout), `RECORD_RING_OFFSET` is 2 MiB aligned and reserved for the
        // ring, and `RING_TAKEN` makes this the ring's only producer.
        match unsafe { Producer::attach(base, RECORD_RING_BYTES as usize) } {
            Ok(ring) => Ok(Self { tool, ring, writes }),
            Err(_) => Err(tool),
        }
    }
}

impl Tool for ToHost {
    fn instrument_trace(&mut self, trace: &mut TraceInstrumenter<'_>) {
        self.tool.instrument_trace(trace);
    }

    fn analyze(&mut self, routine: u32, args: &[u64]) {
        self.tool.analyze(routine, args);
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
        // A full ring: the VMM holds the vCPU until the simulator has made room, so the
        // wait costs the host no spinning core.
        let mut wait = || crate::ring0::gate::notify(DOORBELL_PORT, DOORBELL_RECORD_ROOM);
        if let Err(e) = self.ring.push_waiting(bytes, &mut wait) {
            log!(
                Error,
                "engine: {}: the host's simulator no longer takes records ({e:?})",
                self.tool.name()
            );
            log::fail();
        }
    }

    fn records_fetches(&self) -> bool {
        self.tool.records_fetches()
    }

    fn fetch_runs(&self) -> bool {
        self.tool.fetch_runs()
    }

    fn records_need_pa(&self) -> bool {
        self.tool.records_need_pa()
    }

    fn call_stack_records(&self) -> bool {
        self.tool.call_stack_records()
    }

    fn task_records(&self) -> bool {
        // The host's simulator sees only records: the task changes come among them.
        true
    }
}

impl KpinTool for ToHost {
    fn name(&self) -> &'static str {
        self.tool.name()
    }

    fn finish(&mut self, _engine: &Engine, _host: &mut dyn Sink) -> Result<(), Error> {
        // The host's simulator writes the files once it has read every record.
        self.ring.close();
        Ok(())
    }

    fn summary(&self, _engine: &Engine, out: &mut dyn fmt::Write) -> fmt::Result {
        write!(
            out,
            "{}: {} records sent to the host's simulator ({} waits for room); it writes {}",
            self.tool.name(),
            self.ring.published(),
            self.ring.waits(),
            self.writes
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
