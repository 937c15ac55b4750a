//! The tools the engine image offers (`kpin run --tool NAME`): `null` (translation only)
//! and `bbcount` (an inline counter per basic block; at the end of the run it writes
//! `bbcount.csv` — `address,instructions,count` per block, in translation order — into
//! the run's output directory through the host I/O ring).

use alloc::vec::Vec;
use core::fmt::Write;

use guest_engine::{CounterId, Engine, NullTool, Tool, TraceInstrumenter};
use kpin_abi::io_ring::Kind;

use crate::log;

/// File number of `bbcount.csv` in the ring's `Open`/`Write`/`Close` records.
const BBCOUNT_FILE: u16 = 1;
/// Bytes per `Write` record of the CSV.
const CHUNK_BYTES: usize = 2048;

/// One instrumented basic block.
struct Block {
    address: u64,
    insns: u32,
    counter: CounterId,
}

/// Counts executions of every basic block with an inline counter.
#[derive(Default)]
pub struct BbCount {
    blocks: Vec<Block>,
    /// Blocks left uncounted because the counter slots ran out.
    pub uncounted: u64,
}

impl Tool for BbCount {
    fn instrument_trace(&mut self, trace: &mut TraceInstrumenter<'_>) {
        for (i, b) in trace.bbls().to_vec().iter().enumerate() {
            match trace.alloc_counter() {
                Ok(id) => {
                    trace.insert_bbl_counter(i, id, 1);
                    self.blocks.push(Block {
                        address: b.address.0,
                        insns: b.count as u32,
                        counter: id,
                    });
                }
                Err(_) => self.uncounted += 1,
            }
        }
    }
}

impl BbCount {
    /// Guest instructions executed in counted blocks (a block that left early through a
    /// fault or a stop in its middle counts whole).
    pub fn instructions(&self, engine: &Engine) -> u64 {
        self.blocks
            .iter()
            .map(|b| engine.counter(b.counter) * u64::from(b.insns))
            .sum()
    }

    /// Block executions.
    pub fn executions(&self, engine: &Engine) -> u64 {
        self.blocks.iter().map(|b| engine.counter(b.counter)).sum()
    }

    /// Writes `bbcount.csv` through the I/O ring.
    pub fn write_csv(&self, engine: &Engine) {
        let _ = log::push(Kind::Open, BBCOUNT_FILE, b"bbcount.csv");
        let mut buf = alloc::string::String::from("address,instructions,count\n");
        for b in &self.blocks {
            let _ = writeln!(
                buf,
                "{:#x},{},{}",
                b.address,
                b.insns,
                engine.counter(b.counter)
            );
            if buf.len() >= CHUNK_BYTES {
                let _ = log::push(Kind::Write, BBCOUNT_FILE, buf.as_bytes());
                buf.clear();
            }
        }
        if !buf.is_empty() {
            let _ = log::push(Kind::Write, BBCOUNT_FILE, buf.as_bytes());
        }
        let _ = log::push(Kind::Close, BBCOUNT_FILE, b"");
    }
}

/// A tool chosen by name.
pub enum Chosen {
    /// `null`.
    Null(NullTool),
    /// `bbcount`.
    BbCount(BbCount),
}

impl Chosen {
    /// The tool called `name`, if the engine has it.
    pub fn by_name(name: &str) -> Option<Self> {
        match name {
            "null" => Some(Chosen::Null(NullTool)),
            "bbcount" => Some(Chosen::BbCount(BbCount::default())),
            _ => None,
        }
    }

    /// The tool as the engine drives it.
    pub fn as_tool(&mut self) -> &mut dyn Tool {
        match self {
            Chosen::Null(t) => t,
            Chosen::BbCount(t) => t,
        }
    }
}
