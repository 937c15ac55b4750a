//! `--tool bbcount`: an inline counter per basic block (one `add` to a counter slot in the
//! code cache, no call), and at the end of the run `bbcount.csv` in the output directory:
//! `address,cpl,instructions,count,physical` per block, in translation order, where `cpl`
//! is the virtual CPL the block was translated for (0 kernel, 3 user) and `physical` the
//! guest physical address of its first instruction (what names user code: the same
//! virtual address is other code in another process). A block translated again (in
//! another trace, after a cache flush or a code change) keeps its row and counter; a
//! block of the same address at another physical address, CPL or length has its own row.
//!
//! With the `host` feature (the VMM's; never the engine image's) the crate also has the
//! host-side [`report`] of a run: the user/kernel split and the hottest blocks, named.
#![cfg_attr(not(feature = "host"), no_std)]
#![deny(missing_docs)]

extern crate alloc;

#[cfg(feature = "host")]
pub mod report;

use alloc::boxed::Box;
use alloc::collections::BTreeMap;
use alloc::string::String;
use alloc::vec::Vec;
use core::fmt::{self, Write};

use kpin_tool::host::{Error, File, Sink};
use kpin_tool::{CounterId, Engine, HostPart, KpinTool, Tool, ToolSpec, TraceInstrumenter};

/// What `--tool bbcount` is (the registry's entry).
pub const SPEC: ToolSpec = ToolSpec {
    name: "bbcount",
    summary: "an inline counter per basic block and CPL -> bbcount.csv",
    options: &[],
    prefixed_keys: false,
    host: Some(HostPart {
        about: "bbcount-report.txt: the user/kernel split, the hottest blocks and functions named from the kernel's symbols and the guest's ELF files, the per-process table; cachegrind.out.bbcount, bbcount.folded, bbcount-flamegraph.svg",
        takes_records: None,
    }),
};

/// The tool for `--tool-option` words (it has no options of its own; the engine's
/// `bringup.*` are not its business): the registry's constructor.
pub fn new_tool(_options: &str) -> Result<Box<dyn KpinTool>, String> {
    Ok(Box::new(BbCount::default()))
}

/// The host-side part (the registry's, feature `host`): [`report::Host`].
#[cfg(feature = "host")]
pub const HOST: report::Host = report::Host;

/// The output file's name.
pub const CSV_NAME: &str = "bbcount.csv";
/// The CSV's header line.
pub const CSV_HEADER: &str = "address,cpl,instructions,count,physical";

/// One row of `bbcount.csv`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Row {
    /// Guest virtual address of the block's first instruction.
    pub address: u64,
    /// Virtual CPL the block ran at (0 kernel, 3 user).
    pub cpl: u8,
    /// Instructions in the block.
    pub instructions: u32,
    /// Times the block ran.
    pub count: u64,
    /// Guest physical address of the block's first instruction.
    pub physical: u64,
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
                let cpl = f.next()?.parse().ok().filter(|c| *c <= 3)?;
                let instructions = f.next()?.parse().ok()?;
                let count = f.next()?.parse().ok()?;
                let physical = u64::from_str_radix(f.next()?.strip_prefix("0x")?, 16).ok()?;
                f.next().is_none().then_some(Row {
                    address,
                    cpl,
                    instructions,
                    count,
                    physical,
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
    physical: u64,
    cpl: u8,
    insns: u32,
    counter: CounterId,
}

/// Counts executions of every basic block.
#[derive(Debug, Default)]
pub struct BbCount {
    blocks: Vec<Block>,
    /// Index in `blocks` by ⟨address, physical address, CPL, length⟩: a block translated
    /// again (in another trace, after a cache flush or a code change) adds to the same
    /// counter, so counter slots — a fixed number in the code cache — are spent once per
    /// distinct block.
    index: BTreeMap<(u64, u64, u8, u32), usize>,
    /// Blocks left uncounted because the engine's counter slots ran out.
    uncounted: u64,
}

impl Tool for BbCount {
    fn instrument_trace(&mut self, trace: &mut TraceInstrumenter<'_>) {
        let cpl = trace.mode().cpl();
        // Every instruction of a trace starts on the trace's first page.
        let page = trace.physical().0.wrapping_sub(trace.address().0);
        for i in 0..trace.bbls().len() {
            let b = trace.bbls()[i];
            let physical = page.wrapping_add(b.address.0);
            let key = (b.address.0, physical, cpl, b.count as u32);
            if let Some(&k) = self.index.get(&key) {
                trace.insert_bbl_counter(i, self.blocks[k].counter, 1);
                continue;
            }
            match trace.alloc_counter() {
                Ok(counter) => {
                    trace.insert_bbl_counter(i, counter, 1);
                    self.index.insert(key, self.blocks.len());
                    self.blocks.push(Block {
                        address: b.address.0,
                        physical,
                        cpl,
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

    /// Guest instructions executed in counted blocks at virtual CPL `cpl`.
    pub fn instructions_at(&self, engine: &Engine, cpl: u8) -> u64 {
        self.blocks
            .iter()
            .filter(|b| b.cpl == cpl)
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

    /// The row of every counted block, in translation order.
    pub fn rows<'a>(&'a self, engine: &'a Engine) -> impl Iterator<Item = Row> + 'a {
        self.blocks.iter().map(|b| Row {
            address: b.address,
            cpl: b.cpl,
            instructions: b.insns,
            count: engine.counter(b.counter),
            physical: b.physical,
        })
    }
}

impl KpinTool for BbCount {
    fn name(&self) -> &'static str {
        SPEC.name
    }

    fn finish(&mut self, engine: &Engine, host: &mut dyn Sink) -> Result<(), Error> {
        let mut f = File::create(host, CSV_NAME)?;
        f.write_all(CSV_HEADER.as_bytes())?;
        f.write_all(b"\n")?;
        for r in self.rows(engine) {
            // A failed write is kept by `File` and returned by `close`.
            let _ = writeln!(
                f,
                "{:#x},{},{},{},{:#x}",
                r.address, r.cpl, r.instructions, r.count, r.physical
            );
        }
        f.close()
    }

    fn summary(&self, engine: &Engine, out: &mut dyn fmt::Write) -> fmt::Result {
        write!(
            out,
            "bbcount: {} guest instructions executed (CPL 0: {}, CPL 3: {}) in {} block executions of {} blocks; {CSV_NAME} written",
            self.instructions(engine),
            self.instructions_at(engine, 0),
            self.instructions_at(engine, 3),
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
    use alloc::format;

    #[test]
    fn parse_csv_reads_rows_and_names_the_first_bad_line() {
        let rows = parse_csv(
            "address,cpl,instructions,count,physical\n0x401000,3,3,99,0x5123000\n0xffffffff81000000,0,1,0,0x1000000\n",
        )
        .unwrap();
        assert_eq!(
            rows,
            [
                Row {
                    address: 0x40_1000,
                    cpl: 3,
                    instructions: 3,
                    count: 99,
                    physical: 0x512_3000
                },
                Row {
                    address: 0xffff_ffff_8100_0000,
                    cpl: 0,
                    instructions: 1,
                    count: 0,
                    physical: 0x100_0000
                }
            ]
        );
        assert_eq!(parse_csv("nope\n"), Err(1));
        // The old headers, without `cpl` or `physical`, are not this format.
        assert_eq!(parse_csv("address,instructions,count\n0x10,1,2\n"), Err(1));
        assert_eq!(
            parse_csv("address,cpl,instructions,count\n0x10,0,1,2\n"),
            Err(1)
        );
        let bad = |row: &str| parse_csv(&format!("{CSV_HEADER}\n0x10,0,1,2,0x10\n{row}\n"));
        assert_eq!(bad("16,0,1,2,0x10"), Err(3), "address without 0x");
        assert_eq!(bad("0x10,0,1,2,16"), Err(3), "physical address without 0x");
        assert_eq!(bad("0x10,0,1,2,0x10,3"), Err(3), "a sixth field");
        assert_eq!(bad("0x10,0,1,2"), Err(3), "a missing field");
        assert_eq!(bad("0x10,4,1,2,0x10"), Err(3), "no CPL 4");
    }
}
