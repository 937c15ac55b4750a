//! `--tool bbcount`: an inline counter per basic block (one `add` to a counter slot in the
//! code cache, no call), and at the end of the run `bbcount.csv` in the output directory:
//! `address,instructions,count` per block, in translation order. A block translated twice
//! (in two traces, or again after its code changed) has two rows.
#![no_std]
#![deny(missing_docs)]

extern crate alloc;

use alloc::vec::Vec;
use core::fmt::{self, Write};

use kpin_tool::host::{Error, File, Sink};
use kpin_tool::{CounterId, Engine, KpinTool, Tool, TraceInstrumenter};

/// The output file's name.
pub const CSV_NAME: &str = "bbcount.csv";
/// The CSV's header line.
pub const CSV_HEADER: &str = "address,instructions,count";

/// One row of `bbcount.csv`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Row {
    /// Guest virtual address of the block's first instruction.
    pub address: u64,
    /// Instructions in the block.
    pub instructions: u32,
    /// Times the block ran.
    pub count: u64,
}

/// Parses `bbcount.csv` (for host-side readers: tests, reports); the error is the number
/// of the first line that is not what the tool writes.
pub fn parse_csv(text: &str) -> Result<Vec<Row>, usize> {
    let mut lines = text.lines().enumerate();
    if lines.next().map(|(_, l)| l) != Some(CSV_HEADER) {
        return Err(1);
    }
    lines
        .map(|(i, l)| {
            let mut f = l.split(',');
            let row = (|| {
                let address = u64::from_str_radix(f.next()?.strip_prefix("0x")?, 16).ok()?;
                let instructions = f.next()?.parse().ok()?;
                let count = f.next()?.parse().ok()?;
                f.next().is_none().then_some(Row {
                    address,
                    instructions,
                    count,
                })
            })();
            row.ok_or(i + 1)
        })
        .collect()
}

/// One instrumented basic block.
#[derive(Clone, Copy, Debug)]
struct Block {
    address: u64,
    insns: u32,
    counter: CounterId,
}

/// Counts executions of every basic block.
#[derive(Debug, Default)]
pub struct BbCount {
    blocks: Vec<Block>,
    /// Blocks left uncounted because the engine's counter slots ran out.
    uncounted: u64,
}

impl Tool for BbCount {
    fn instrument_trace(&mut self, trace: &mut TraceInstrumenter<'_>) {
        for i in 0..trace.bbls().len() {
            let b = trace.bbls()[i];
            match trace.alloc_counter() {
                Ok(counter) => {
                    trace.insert_bbl_counter(i, counter, 1);
                    self.blocks.push(Block {
                        address: b.address.0,
                        insns: b.count as u32,
                        counter,
                    });
                }
                Err(_) => self.uncounted += 1,
            }
        }
    }
}

impl BbCount {
    /// Guest instructions executed in counted blocks (a block left early through a fault
    /// or an emulated instruction in its middle counts whole).
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

    /// Blocks left uncounted because the counter slots ran out.
    pub fn uncounted(&self) -> u64 {
        self.uncounted
    }

    /// `(address, instructions, count)` of every counted block, in translation order.
    pub fn rows<'a>(&'a self, engine: &'a Engine) -> impl Iterator<Item = (u64, u32, u64)> + 'a {
        self.blocks
            .iter()
            .map(|b| (b.address, b.insns, engine.counter(b.counter)))
    }
}

impl KpinTool for BbCount {
    fn name(&self) -> &'static str {
        "bbcount"
    }

    fn finish(&mut self, engine: &Engine, host: &mut dyn Sink) -> Result<(), Error> {
        let mut f = File::create(host, CSV_NAME)?;
        f.write_all(CSV_HEADER.as_bytes())?;
        f.write_all(b"\n")?;
        for (address, insns, count) in self.rows(engine) {
            // A failed write is kept by `File` and returned by `close`.
            let _ = writeln!(f, "{address:#x},{insns},{count}");
        }
        f.close()
    }

    fn summary(&self, engine: &Engine, out: &mut dyn fmt::Write) -> fmt::Result {
        write!(
            out,
            "bbcount: {} guest instructions executed in {} block executions of {} blocks; {CSV_NAME} written",
            self.instructions(engine),
            self.executions(engine),
            self.blocks.len()
        )?;
        if self.uncounted > 0 {
            write!(
                out,
                " ({} blocks uncounted: counter slots exhausted)",
                self.uncounted
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_csv_reads_rows_and_names_the_first_bad_line() {
        let rows =
            parse_csv("address,instructions,count\n0x1000,3,99\n0xffffffff81000000,1,0\n").unwrap();
        assert_eq!(
            rows,
            [
                Row {
                    address: 0x1000,
                    instructions: 3,
                    count: 99
                },
                Row {
                    address: 0xffff_ffff_8100_0000,
                    instructions: 1,
                    count: 0
                }
            ]
        );
        assert_eq!(parse_csv("nope\n"), Err(1));
        assert_eq!(
            parse_csv("address,instructions,count\n0x10,1,2\n16,1,2\n"),
            Err(3)
        );
        assert_eq!(
            parse_csv("address,instructions,count\n0x10,1,2,3\n"),
            Err(2)
        );
        assert_eq!(parse_csv("address,instructions,count\n0x10,1\n"), Err(2));
    }
}
