//! The host side: `memtrace.bin` as CSV in the column order of QEMU's `mem` plugin,
//! `insn_vaddr,insn_symbol,mem_vaddr,mem_paddr,access_size,access_type`, addresses in
//! `0x` hex, `access_type` `load` or `store` (a read-modify-write record prints a load
//! then a store), `mem_paddr` empty when the address did not translate, `insn_symbol`
//! from the caller's lookup (empty without one).

use std::boxed::Box;
use std::io;
use std::path::Path;
use std::string::{String, ToString};

use kpin_tool::host_side::{HostTool, OptionFiles, TraceError, TracePrinter};

use crate::format::{FormatError, Trace};

/// The CSV header line (without the newline).
pub const CSV_HEADER: &str = "insn_vaddr,insn_symbol,mem_vaddr,mem_paddr,access_size,access_type";

/// Why a trace could not be printed.
#[derive(Debug)]
pub enum ReadError {
    /// Reading the file or writing the CSV failed.
    Io(io::Error),
    /// The file is not a whole memtrace.
    Format(FormatError),
}

impl std::fmt::Display for ReadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReadError::Io(e) => write!(f, "{e}"),
            ReadError::Format(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for ReadError {}

impl From<io::Error> for ReadError {
    fn from(e: io::Error) -> Self {
        ReadError::Io(e)
    }
}

/// Writes the CSV for the trace in `bytes`: at most `limit` records (`None`: all);
/// returns the records printed. `symbol` names an instruction address.
pub fn write_csv(
    bytes: &[u8],
    limit: Option<u64>,
    symbol: &dyn Fn(u64) -> Option<String>,
    out: &mut dyn io::Write,
) -> Result<u64, ReadError> {
    let trace = Trace::parse(bytes).map_err(ReadError::Format)?;
    writeln!(out, "{CSV_HEADER}")?;
    let mut n = 0;
    for r in trace.records() {
        if limit.is_some_and(|l| n >= l) {
            break;
        }
        n += 1;
        let sym = symbol(r.insn_vaddr).unwrap_or_default();
        // A symbol is the operator's (System.map); keep the CSV's columns anyway.
        let sym = sym.replace([',', '\n'], "_");
        let pa = if r.mem_paddr == u64::MAX {
            String::new()
        } else {
            std::format!("{:#x}", r.mem_paddr)
        };
        for (on, kind) in [(r.is_read(), "load"), (r.is_write(), "store")] {
            if on {
                writeln!(
                    out,
                    "{:#x},{sym},{:#x},{pa},{},{kind}",
                    r.insn_vaddr, r.mem_vaddr, r.size
                )?;
            }
        }
    }
    Ok(n)
}

/// Reads `dir/memtrace.bin` and writes its CSV (see [`write_csv`]).
pub fn print_run(
    dir: &Path,
    limit: Option<u64>,
    symbol: &dyn Fn(u64) -> Option<String>,
    out: &mut dyn io::Write,
) -> Result<u64, ReadError> {
    let bytes = std::fs::read(dir.join(crate::BIN_NAME))?;
    write_csv(&bytes, limit, symbol, out)
}

/// memtrace's host-side part (the registry's): `cpl=`/`limit=` checked before boot, and
/// [`BIN_NAME`](crate::BIN_NAME) printed by `kpin trace RUN` ([`write_csv`]).
#[derive(Clone, Copy, Debug)]
pub struct Host;

impl HostTool for Host {
    fn spec(&self) -> &'static kpin_tool::ToolSpec {
        &crate::SPEC
    }

    fn engine_options(
        &self,
        options: &str,
        _files: &mut dyn OptionFiles,
    ) -> Result<Option<String>, String> {
        crate::Options::parse(options).map(|_| None)
    }

    fn trace(&self) -> Option<&dyn TracePrinter> {
        Some(self)
    }
}

impl TracePrinter for Host {
    fn file(&self) -> &'static str {
        crate::BIN_NAME
    }

    fn code_addresses<'a>(&self, bytes: &'a [u8]) -> Option<Box<dyn Iterator<Item = u64> + 'a>> {
        let t = Trace::parse(bytes).ok()?;
        Some(Box::new(t.records().map(|r| r.insn_vaddr)))
    }

    fn print(
        &self,
        bytes: &[u8],
        limit: Option<u64>,
        name: &dyn Fn(u64) -> Option<String>,
        out: &mut dyn io::Write,
    ) -> Result<(), TraceError> {
        match write_csv(bytes, limit, name, out) {
            Ok(_) => Ok(()),
            Err(ReadError::Io(e)) => Err(TraceError::Io(e)),
            Err(e) => Err(TraceError::Format(e.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::vec::Vec;

    use super::*;
    use crate::format::{header, Record, FLAG_READ, FLAG_WRITE};

    #[test]
    fn test_csv_columns_rmw_and_unresolved_pa() {
        let mut b = header().to_vec();
        b.extend_from_slice(
            &Record {
                insn_vaddr: 0xffffffff81000010,
                mem_vaddr: 0x1000,
                mem_paddr: 0x5000,
                size: 4,
                flags: FLAG_READ | FLAG_WRITE,
            }
            .encode(),
        );
        b.extend_from_slice(
            &Record {
                insn_vaddr: 0x401000,
                mem_vaddr: 0x7ffe0000,
                mem_paddr: u64::MAX,
                size: 8,
                flags: FLAG_READ | 3 << crate::format::FLAG_CPL_SHIFT,
            }
            .encode(),
        );
        let mut out = Vec::new();
        let sym = |a: u64| (a >> 63 == 1).then(|| String::from("do_x+0x10"));
        assert_eq!(write_csv(&b, None, &sym, &mut out).unwrap(), 2);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "insn_vaddr,insn_symbol,mem_vaddr,mem_paddr,access_size,access_type\n\
             0xffffffff81000010,do_x+0x10,0x1000,0x5000,4,load\n\
             0xffffffff81000010,do_x+0x10,0x1000,0x5000,4,store\n\
             0x401000,,0x7ffe0000,,8,load\n"
        );
        let mut out = Vec::new();
        assert_eq!(write_csv(&b, Some(1), &|_| None, &mut out).unwrap(), 1);
        assert!(matches!(
            write_csv(&b[..b.len() - 3], None, &|_| None, &mut Vec::new()),
            Err(ReadError::Format(FormatError::Truncated { .. }))
        ));
        assert!(matches!(
            write_csv(b"garbage garbage garbage", None, &|_| None, &mut Vec::new()),
            Err(ReadError::Format(FormatError::BadMagic))
        ));
    }
}
