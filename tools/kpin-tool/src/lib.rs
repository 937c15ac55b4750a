//! What a kpin tool is.
//!
//! A tool is a `no_std` crate under `tools/` that the engine image links in and selects
//! by name (`kpin run --tool NAME`). It instruments traces through
//! [`guest_engine::Tool`] (the Pin-style API: inline counters, analysis calls, memory
//! records) and, when the run ends, writes its results with [`host::File`]: the bytes go
//! through the host I/O ring and land in the run's output directory on the host.
//!
//! The same tool code runs on the host, under the translator's host harness, so tools are
//! tested without a VM ([`host_run`] with the `host-run` feature; see
//! `tools/bbcount/tests`).
//!
//! A tool crate declares everything about itself here: its [`ToolSpec`] (`pub const
//! SPEC`), its constructor ([`NewTool`], `pub fn new_tool`) and, with the `host` feature,
//! its host-side part (`host_side::HostTool`: option checks before boot, a consumer of
//! the records the engine sends to the host, the report after the run, a trace printer).
//! The registry (`tools/registry`) names the crates once; the engine image and the VMM
//! get the list from it.
#![no_std]
#![deny(missing_docs)]

extern crate alloc;

pub mod host;
#[cfg(feature = "host-run")]
pub mod host_run;
#[cfg(feature = "host")]
pub mod host_side;
#[cfg(feature = "host")]
pub mod processes;
#[cfg(feature = "host")]
pub mod profile_out;
pub mod spec;

use alloc::boxed::Box;
use alloc::string::String;
use core::fmt;

pub use guest_engine::{
    access, CounterId, Engine, IPoint, InsInfo, MemRecord, Tool, TraceInstrumenter,
};
pub use spec::{HostPart, OptionSpec, ToolSpec, ValueKind};

/// What every tool crate exports as `pub fn new_tool` beside its `SPEC`: the tool for the
/// `--tool-option` words (`key=value` separated by spaces, the engine's `bringup.*` keys
/// among them), or why they are wrong (the run then ends with status 3 and this in
/// `engine.log`). The registry lists the in-tree crates' constructors; the engine image
/// builds the chosen tool with one (`kpin run --tool-crate` an out-of-tree crate's).
pub type NewTool = fn(options: &str) -> Result<Box<dyn KpinTool>, String>;

/// A tool as the engine image drives it: instrumentation while the guest runs, then one
/// `finish` when the run ends.
pub trait KpinTool: Tool {
    /// The name `--tool` selects it by.
    fn name(&self) -> &'static str;

    /// The run ended (the guest powered off, or the engine stops it): write results.
    /// `engine` is stopped; its counters hold their final values.
    fn finish(&mut self, engine: &Engine, host: &mut dyn host::Sink) -> Result<(), host::Error>;

    /// A one-line summary for the engine log (nothing by default).
    fn summary(&self, engine: &Engine, out: &mut dyn fmt::Write) -> fmt::Result {
        let _ = (engine, out);
        Ok(())
    }

    /// The run's own sink, handed over once when the engine image builds the tool: a tool
    /// whose output grows with the run writes through it while the guest runs instead of
    /// keeping everything for `finish` (memtrace). Ignored by default.
    fn stream_to(&mut self, sink: Box<dyn host::Sink>) {
        drop(sink);
    }
}
