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
#![no_std]
#![deny(missing_docs)]

extern crate alloc;

pub mod host;
#[cfg(feature = "host-run")]
pub mod host_run;
pub mod spec;

use core::fmt;

pub use guest_engine::{
    access, CounterId, Engine, IPoint, InsInfo, MemRecord, Tool, TraceInstrumenter,
};
pub use spec::{OptionSpec, ToolSpec, ValueKind};

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
}
