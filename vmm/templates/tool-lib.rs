//! The {name} tool for kpin: executed guest instructions by CPL, counted with one
//! counter per CPL added to at every block start, written to {name}.csv when the run
//! ends. A skeleton `kpin new-tool` wrote: change `instrument_trace` and `finish`, keep
//! `SPEC` and `new_tool` (docs/writing-a-tool.md). Run it with
//! `kpin run --tool-crate DIR --tool {name}`.
#![no_std]
extern crate alloc;

use alloc::boxed::Box;
use alloc::string::String;
use core::fmt::Write;

use kpin_tool::host::{Error, File, Sink};
use kpin_tool::{CounterId, Engine, KpinTool, Tool, ToolSpec, TraceInstrumenter};

pub const SPEC: ToolSpec = ToolSpec {
    name: "{name}",
    summary: "executed instructions by CPL, counted at block starts -> {name}.csv",
    options: &[],
    prefixed_keys: false,
    host: None,
};

/// The constructor `kpin run --tool-crate` looks for.
pub fn new_tool(options: &str) -> Result<Box<dyn KpinTool>, String> {
    if !options.trim().is_empty() {
        return Err(String::from("{name} takes no options"));
    }
    Ok(Box::new(PerCplCount::default()))
}

#[derive(Default)]
struct PerCplCount {
    /// Counters for CPL 0 and CPL 3, allocated with the first trace.
    counters: Option<[CounterId; 2]>,
}

impl Tool for PerCplCount {
    fn instrument_trace(&mut self, trace: &mut TraceInstrumenter<'_>) {
        let counters = match self.counters {
            Some(c) => c,
            None => match (trace.alloc_counter(), trace.alloc_counter()) {
                (Ok(a), Ok(b)) => *self.counters.insert([a, b]),
                _ => return,
            },
        };
        let counter = counters[usize::from(trace.mode().cpl() == 3)];
        for i in 0..trace.bbls().len() {
            let n = trace.bbls()[i].count as i32;
            trace.insert_bbl_counter(i, counter, n);
        }
    }
}

impl KpinTool for PerCplCount {
    fn name(&self) -> &'static str {
        SPEC.name
    }

    fn finish(&mut self, engine: &Engine, host: &mut dyn Sink) -> Result<(), Error> {
        let [k, u] = self.counters.map_or([0, 0], |c| c.map(|id| engine.counter(id)));
        let mut f = File::create(host, "{name}.csv")?;
        let _ = write!(f, "cpl,count\n0,{k}\n3,{u}\n");
        f.close()
    }
}
