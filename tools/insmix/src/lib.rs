//! `--tool insmix`: dynamic and static instruction counts per mnemonic, split kernel
//! (CPL 0) and user (CPL 3), like DynamoRIO's `opcode_mix`. One inline counter per basic
//! block (as bbcount), each block remembering its instructions' mnemonics; at the end of
//! the run the counts are multiplied out into `insmix.txt` (a table, most frequent first)
//! and `insmix.json`. The static count of a mnemonic is how many instructions of the
//! distinct blocks instrumented (by address, CPL and length: a block translated again
//! after a cache flush is the same block) have it, whether they ran or not. Sensitive instructions the engine emulates end their trace outside any
//! block and are reported as one line of their own (`counters.json` has them by CPL); a
//! block left early by a fault counts whole, as in bbcount.
#![no_std]
#![deny(missing_docs)]

extern crate alloc;

#[cfg(feature = "host")]
pub mod host;

use alloc::collections::BTreeMap;
use alloc::vec::Vec;
use core::fmt::{self, Write};

use kpin_tool::host::{Error, File, Sink};
use kpin_tool::{CounterId, Engine, KpinTool, Tool, ToolSpec, TraceInstrumenter};

/// What `--tool insmix` is (the registry's entry).
pub const SPEC: ToolSpec = ToolSpec {
    name: "insmix",
    summary: "dynamic and static counts per mnemonic, kernel and user -> insmix.txt, insmix.json",
    options: &[],
    prefixed_keys: false,
    host: Some(kpin_tool::HostPart {
        about: "insmix-processes.txt: the instructions each process executed, user and kernel on its behalf",
        takes_records: None,
    }),
};

/// The tool for `--tool-option` words (it has no options of its own): the registry's
/// constructor.
pub fn new_tool(_options: &str) -> Result<alloc::boxed::Box<dyn KpinTool>, alloc::string::String> {
    Ok(alloc::boxed::Box::new(InsMix::default()))
}

/// The host part (the registry's): the per-process table after the run.
#[cfg(feature = "host")]
pub const HOST: host::Host = host::Host;

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

/// One mnemonic's counts, each `[kernel, user]`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Row {
    /// The decoder's mnemonic number (see [`mnemonic_name`]).
    pub mnemonic: u16,
    /// Executions.
    pub dynamic: [u64; 2],
    /// Instructions with this mnemonic in the distinct blocks instrumented.
    pub static_: [u64; 2],
}

impl InsMix {
    /// One row per mnemonic seen, most executed first (then most seen, then by number).
    pub fn mix(&self, engine: &Engine) -> Vec<Row> {
        let mut m: BTreeMap<u16, Row> = BTreeMap::new();
        for b in &self.blocks {
            let n = engine.counter(b.counter);
            let who = usize::from(b.user);
            for &op in &b.opcodes {
                let row = m.entry(op).or_insert(Row {
                    mnemonic: op,
                    ..Row::default()
                });
                row.dynamic[who] += n;
                row.static_[who] += 1;
            }
        }
        let mut v: Vec<Row> = m.into_values().collect();
        v.sort_by_key(|r| {
            (
                core::cmp::Reverse(r.dynamic[0] + r.dynamic[1]),
                core::cmp::Reverse(r.static_[0] + r.static_[1]),
                r.mnemonic,
            )
        });
        v
    }
}

/// Writes the table for `mix` (see [`InsMix::mix`]) with `emulated` instructions.
pub fn write_table(out: &mut dyn fmt::Write, mix: &[Row], emulated: u64) -> fmt::Result {
    let sum = |f: fn(&Row) -> [u64; 2]| {
        mix.iter()
            .fold([0, 0], |a, r| [a[0] + f(r)[0], a[1] + f(r)[1]])
    };
    let [k, u] = sum(|r| r.dynamic);
    let [sk, su] = sum(|r| r.static_);
    writeln!(
        out,
        "Opcode mix (kpin insmix): {} instructions executed in counted blocks (kernel {k}, user {u}); {} static instructions in the distinct blocks instrumented (kernel {sk}, user {su}); {} distinct mnemonics",
        k + u,
        sk + su,
        mix.len()
    )?;
    writeln!(
        out,
        "{:>16} {:>16} {:>16} {:>10} {:>10} {:>10}  mnemonic",
        "total", "kernel", "user", "static", "s.kernel", "s.user"
    )?;
    for r in mix {
        let (d, s) = (r.dynamic, r.static_);
        write!(
            out,
            "{:>16} {:>16} {:>16} {:>10} {:>10} {:>10}  ",
            d[0] + d[1],
            d[0],
            d[1],
            s[0] + s[1],
            s[0],
            s[1]
        )?;
        mnemonic_name(r.mnemonic, out)?;
        out.write_str("\n")?;
    }
    writeln!(
        out,
        "{emulated:>16} {:>16} {:>16} {:>10} {:>10} {:>10}  (sensitive instructions the engine emulated)",
        "-", "-", "-", "-", "-"
    )
}

/// Writes the JSON for `mix`.
pub fn write_json(out: &mut dyn fmt::Write, mix: &[Row], emulated: u64) -> fmt::Result {
    out.write_str("{\n  \"mnemonics\": [")?;
    for (i, r) in mix.iter().enumerate() {
        out.write_str(if i == 0 { "\n    " } else { ",\n    " })?;
        out.write_str("{\"mnemonic\": \"")?;
        mnemonic_name(r.mnemonic, out)?;
        write!(
            out,
            "\", \"kernel\": {}, \"user\": {}, \"static_kernel\": {}, \"static_user\": {}}}",
            r.dynamic[0], r.dynamic[1], r.static_[0], r.static_[1]
        )?;
    }
    writeln!(out, "\n  ],\n  \"emulated\": {emulated}\n}}")
}

impl KpinTool for InsMix {
    fn name(&self) -> &'static str {
        SPEC.name
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
        for r in mix.iter().take(5) {
            out.write_str(" ")?;
            mnemonic_name(r.mnemonic, out)?;
            write!(out, " {}", r.dynamic[0] + r.dynamic[1])?;
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

    fn row(m: iced_x86::Mnemonic, dynamic: [u64; 2], static_: [u64; 2]) -> Row {
        Row {
            mnemonic: m as u16,
            dynamic,
            static_,
        }
    }

    #[test]
    fn table_and_json_name_mnemonics_and_split_cpls() {
        use iced_x86::Mnemonic::{Add, Mov, Ret};
        let mix = [
            row(Mov, [10, 5], [4, 2]),
            row(Add, [3, 0], [1, 0]),
            row(Ret, [0, 1], [0, 1]),
        ];
        let mut t = String::new();
        write_table(&mut t, &mix, 7).unwrap();
        assert!(
            t.contains("19 instructions") && t.contains("kernel 13, user 6"),
            "{t}"
        );
        assert!(
            t.contains("8 static instructions") && t.contains("(kernel 5, user 3)"),
            "{t}"
        );
        let mov = t.lines().find(|l| l.ends_with("  mov")).expect(&t);
        let nums: std::vec::Vec<&str> = mov.split_whitespace().collect();
        assert_eq!(nums, ["15", "10", "5", "6", "4", "2", "mov"]);
        assert!(t.contains("  ret\n") && t.lines().last().unwrap().trim_start().starts_with('7'));
        let mut j = String::new();
        write_json(&mut j, &mix, 7).unwrap();
        assert!(
            j.contains(
                "{\"mnemonic\": \"add\", \"kernel\": 3, \"user\": 0, \"static_kernel\": 1, \"static_user\": 0}"
            ),
            "{j}"
        );
        assert!(j.contains("\"emulated\": 7"), "{j}");
        let mut bad = String::new();
        mnemonic_name(u16::MAX, &mut bad).unwrap();
        assert_eq!(bad, "mnemonic65535");
    }
}
