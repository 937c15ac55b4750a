//! `--tool insmix`: dynamic instruction counts per mnemonic, split kernel (CPL 0) and user
//! (CPL 3), like DynamoRIO's `opcode_mix`. One inline counter per basic block (as
//! bbcount), each block remembering its instructions' mnemonics; at the end of the run
//! the counts are multiplied out into `insmix.txt` (a table, most frequent first) and
//! `insmix.json`. Sensitive instructions the engine emulates end their trace outside any
//! block and are reported as one line of their own (`counters.json` has them by CPL); a
//! block left early by a fault counts whole, as in bbcount.
#![no_std]
#![deny(missing_docs)]

extern crate alloc;

use alloc::collections::BTreeMap;
use alloc::vec::Vec;
use core::fmt::{self, Write};

use kpin_tool::host::{Error, File, Sink};
use kpin_tool::{CounterId, Engine, KpinTool, Tool, TraceInstrumenter};

/// The table's name.
pub const TXT_NAME: &str = "insmix.txt";
/// The JSON's name.
pub const JSON_NAME: &str = "insmix.json";

/// One instrumented block.
#[derive(Clone, Debug)]
struct Block {
    counter: CounterId,
    user: bool,
    opcodes: Vec<u16>,
}

/// The instruction-mix tool.
#[derive(Debug, Default)]
pub struct InsMix {
    blocks: Vec<Block>,
    index: BTreeMap<(u64, u8, u32), usize>,
    uncounted: u64,
}

/// The name of mnemonic number `n` (the decoder's), lower case.
pub fn mnemonic_name(n: u16, out: &mut dyn fmt::Write) -> fmt::Result {
    let mut s = alloc::string::String::new();
    match iced_x86::Mnemonic::values().nth(usize::from(n)) {
        Some(m) => write!(s, "{m:?}")?,
        None => write!(s, "mnemonic{n}")?,
    }
    out.write_str(&s.to_ascii_lowercase())
}

impl Tool for InsMix {
    fn instrument_trace(&mut self, trace: &mut TraceInstrumenter<'_>) {
        let cpl = trace.mode().cpl();
        for i in 0..trace.bbls().len() {
            let b = trace.bbls()[i];
            let key = (b.address.0, cpl, b.count as u32);
            if let Some(&k) = self.index.get(&key) {
                trace.insert_bbl_counter(i, self.blocks[k].counter, 1);
                continue;
            }
            let Ok(counter) = trace.alloc_counter() else {
                self.uncounted += 1;
                continue;
            };
            trace.insert_bbl_counter(i, counter, 1);
            let opcodes = trace.instructions()[b.first..b.first + b.count]
                .iter()
                .map(|x| x.opcode)
                .collect();
            self.index.insert(key, self.blocks.len());
            self.blocks.push(Block {
                counter,
                user: cpl == 3,
                opcodes,
            });
        }
    }
}

impl InsMix {
    /// `(mnemonic number, [kernel, user])`, most executed first (ties by number).
    pub fn mix(&self, engine: &Engine) -> Vec<(u16, [u64; 2])> {
        let mut m: BTreeMap<u16, [u64; 2]> = BTreeMap::new();
        for b in &self.blocks {
            let n = engine.counter(b.counter);
            if n == 0 {
                continue;
            }
            for &op in &b.opcodes {
                m.entry(op).or_default()[usize::from(b.user)] += n;
            }
        }
        let mut v: Vec<(u16, [u64; 2])> = m.into_iter().collect();
        v.sort_by_key(|&(op, c)| (core::cmp::Reverse(c[0] + c[1]), op));
        v
    }
}

/// Writes the table for `mix` (see [`InsMix::mix`]) with `emulated` instructions.
pub fn write_table(
    out: &mut dyn fmt::Write,
    mix: &[(u16, [u64; 2])],
    emulated: u64,
) -> fmt::Result {
    let (k, u) = mix
        .iter()
        .fold((0, 0), |(k, u), (_, c)| (k + c[0], u + c[1]));
    writeln!(
        out,
        "Opcode mix (kpin insmix): {} instructions executed in counted blocks (kernel {k}, user {u}); {} distinct mnemonics",
        k + u,
        mix.len()
    )?;
    writeln!(
        out,
        "{:>16} {:>16} {:>16}  mnemonic",
        "total", "kernel", "user"
    )?;
    for (op, c) in mix {
        write!(out, "{:>16} {:>16} {:>16}  ", c[0] + c[1], c[0], c[1])?;
        mnemonic_name(*op, out)?;
        out.write_str("\n")?;
    }
    writeln!(
        out,
        "{emulated:>16} {:>16} {:>16}  (sensitive instructions the engine emulated)",
        "-", "-"
    )
}

/// Writes the JSON for `mix`.
pub fn write_json(out: &mut dyn fmt::Write, mix: &[(u16, [u64; 2])], emulated: u64) -> fmt::Result {
    out.write_str("{\n  \"mnemonics\": [")?;
    for (i, (op, c)) in mix.iter().enumerate() {
        out.write_str(if i == 0 { "\n    " } else { ",\n    " })?;
        out.write_str("{\"mnemonic\": \"")?;
        mnemonic_name(*op, out)?;
        write!(out, "\", \"kernel\": {}, \"user\": {}}}", c[0], c[1])?;
    }
    writeln!(out, "\n  ],\n  \"emulated\": {emulated}\n}}")
}

impl KpinTool for InsMix {
    fn name(&self) -> &'static str {
        "insmix"
    }

    fn finish(&mut self, engine: &Engine, host: &mut dyn Sink) -> Result<(), Error> {
        let mix = self.mix(engine);
        let emulated = engine.stats().emulated_insns;
        let mut f = File::create(host, TXT_NAME)?;
        // A failed write is kept by `File` and returned by `close`.
        let _ = write_table(&mut f, &mix, emulated);
        f.close()?;
        let mut f = File::create(host, JSON_NAME)?;
        let _ = write_json(&mut f, &mix, emulated);
        f.close()
    }

    fn summary(&self, engine: &Engine, out: &mut dyn fmt::Write) -> fmt::Result {
        let mix = self.mix(engine);
        write!(out, "insmix: {} distinct mnemonics; top:", mix.len())?;
        for (op, c) in mix.iter().take(5) {
            out.write_str(" ")?;
            mnemonic_name(*op, out)?;
            write!(out, " {}", c[0] + c[1])?;
        }
        if self.uncounted > 0 {
            write!(
                out,
                " ({} blocks uncounted: counter slots exhausted)",
                self.uncounted
            )?;
        }
        write!(out, "; {TXT_NAME} and {JSON_NAME} written")
    }
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use alloc::string::String;

    fn op(m: iced_x86::Mnemonic) -> u16 {
        m as u16
    }

    #[test]
    fn table_and_json_name_mnemonics_and_split_cpls() {
        use iced_x86::Mnemonic::{Add, Mov, Ret};
        let mix = [(op(Mov), [10, 5]), (op(Add), [3, 0]), (op(Ret), [0, 1])];
        let mut t = String::new();
        write_table(&mut t, &mix, 7).unwrap();
        assert!(
            t.contains("19 instructions") && t.contains("kernel 13, user 6"),
            "{t}"
        );
        let mov = t.lines().find(|l| l.ends_with("  mov")).expect(&t);
        let nums: std::vec::Vec<&str> = mov.split_whitespace().collect();
        assert_eq!(nums, ["15", "10", "5", "mov"]);
        assert!(t.contains("  ret\n") && t.lines().last().unwrap().trim_start().starts_with('7'));
        let mut j = String::new();
        write_json(&mut j, &mix, 7).unwrap();
        assert!(
            j.contains("{\"mnemonic\": \"add\", \"kernel\": 3, \"user\": 0}"),
            "{j}"
        );
        assert!(j.contains("\"emulated\": 7"), "{j}");
        let mut bad = String::new();
        mnemonic_name(u16::MAX, &mut bad).unwrap();
        assert_eq!(bad, "mnemonic65535");
    }
}
