//! `--tool memtrace`: every data access the guest makes, kernel and user — instruction
//! VA, data VA and PA, size, load/store, CPL — into `memtrace.bin` ([`format`]), and a
//! reader that prints it as CSV in the column order of QEMU's `mem` plugin
//! (`insn_vaddr,insn_symbol,mem_vaddr,mem_paddr,access_size,access_type`; `kpin trace`).
//!
//! Options (`kpin run --tool-option`): `cpl=0|3|all` (default `all`) keeps the accesses
//! made at that CPL; `limit=N` (default [`DEFAULT_LIMIT`]) is the most records written,
//! later ones are counted as dropped. Both end up in [`SUMMARY_NAME`] with the counts.
//!
//! The engine side asks for a record per memory operand with physical addresses
//! ([`kpin_tool::Tool::records_need_pa`]). Given a sink for the run ([`KpinTool::stream_to`],
//! the engine image's I/O ring) it streams the file in [`kpin_tool::host::CHUNK_BYTES`]
//! writes as records arrive; without one (host tests) it keeps the bytes and writes them
//! at `finish`. A read-modify-write operand is one record with both flags; the CSV prints
//! it as a load then a store, as QEMU does.
#![no_std]
#![deny(missing_docs)]

extern crate alloc;
#[cfg(feature = "host")]
extern crate std;

pub mod format;
#[cfg(feature = "host")]
pub mod reader;

use alloc::boxed::Box;
use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;
use core::fmt::{self, Write};

use kpin_tool::host::{Error, File, Sink, CHUNK_BYTES};
use kpin_tool::{
    access, Engine, HostPart, KpinTool, MemRecord, OptionSpec, Tool, ToolSpec, TraceInstrumenter,
    ValueKind,
};

use crate::format::{Record, FLAG_CPL_SHIFT, FLAG_READ, FLAG_WRITE};

/// The trace file.
pub const BIN_NAME: &str = "memtrace.bin";
/// The counts, written at the end: `records=… dropped=… unresolved=… lost=… cpl=… limit=…`.
pub const SUMMARY_NAME: &str = "memtrace-summary.txt";
/// Records written at most unless `limit=` says otherwise: 840 MB of records, inside
/// the run's default 1 GiB output cap (`--max-output-bytes`).
pub const DEFAULT_LIMIT: u64 = 30_000_000;

/// What `--tool memtrace` is (the registry's entry).
pub const SPEC: ToolSpec = ToolSpec {
    name: "memtrace",
    summary: "every data access (insn VA, data VA, PA, size, load/store, CPL) -> memtrace.bin",
    options: &[
        OptionSpec {
            key: "cpl",
            help: "keep only the accesses made at this CPL",
            default: Some("all"),
            kind: ValueKind::Choice(&["0", "3", "all"]),
        },
        OptionSpec {
            key: "limit",
            help: "most records written; later ones are counted as dropped",
            default: Some("30000000"),
            kind: ValueKind::Count,
        },
    ],
    prefixed_keys: false,
    host: Some(HostPart {
        about: "kpin trace RUN prints memtrace.bin as CSV in QEMU's mem plugin order",
        takes_records: None,
    }),
};

/// The tool for `--tool-option` words ([`Options::parse`]): the registry's constructor.
pub fn new_tool(options: &str) -> Result<Box<dyn KpinTool>, String> {
    Ok(Box::new(MemTrace::new(options)?))
}

/// The host-side part (the registry's, feature `host`): [`reader::Host`].
#[cfg(feature = "host")]
pub const HOST: reader::Host = reader::Host;

/// The options.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Options {
    /// Only accesses at this CPL (`None`: all).
    pub cpl: Option<u8>,
    /// Most records written.
    pub limit: u64,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            cpl: None,
            limit: DEFAULT_LIMIT,
        }
    }
}

impl Options {
    /// Parses `key=value` words separated by whitespace: `cpl=0|3|all`, `limit=N`. Keys
    /// the engine itself reads (`bringup.*`) are left to it.
    pub fn parse(options: &str) -> Result<Self, String> {
        let mut o = Options::default();
        for word in options.split_whitespace() {
            let (key, value) = word
                .split_once('=')
                .ok_or_else(|| format!("{word:?}: expected key=value"))?;
            match key {
                "cpl" => {
                    o.cpl = match value {
                        "0" => Some(0),
                        "3" => Some(3),
                        "all" => None,
                        _ => return Err(format!("cpl={value}: expected 0, 3 or all")),
                    }
                }
                "limit" => {
                    o.limit = value
                        .parse()
                        .map_err(|_| format!("limit={value}: expected a record count"))?
                }
                k if k.starts_with("bringup.") => {}
                _ => {
                    let known: Vec<&str> = SPEC.options.iter().map(|o| o.key).collect();
                    return Err(format!(
                        "unknown option {key:?} (memtrace knows {})",
                        known.join(", ")
                    ));
                }
            }
        }
        Ok(o)
    }

    fn cpl_name(&self) -> &'static str {
        match self.cpl {
            Some(0) => "0",
            Some(_) => "3",
            None => "all",
        }
    }
}

/// The memtrace tool.
pub struct MemTrace {
    options: Options,
    /// Records written (or kept for `finish`).
    records: u64,
    /// Records past the limit.
    dropped: u64,
    /// Records whose PA did not resolve (written, with `u64::MAX`).
    unresolved: u64,
    /// Records the sink refused (a transport error ends the streaming).
    lost: u64,
    /// Bytes not yet handed to a sink (all of the file when there is no stream).
    buf: Vec<u8>,
    stream: Option<Stream>,
}

/// The file being streamed during the run.
struct Stream {
    sink: Box<dyn Sink>,
    /// Its file number, once opened.
    file: Option<u16>,
    /// The first transport error; nothing more is written after it.
    failed: Option<Error>,
}

impl MemTrace {
    /// The tool configured by `options` (see [`Options::parse`]).
    pub fn new(options: &str) -> Result<Self, String> {
        Ok(Self::with_options(Options::parse(options)?))
    }

    /// The tool for checked options.
    pub fn with_options(options: Options) -> Self {
        let mut buf = Vec::with_capacity(CHUNK_BYTES * 2);
        buf.extend_from_slice(&format::header());
        Self {
            options,
            records: 0,
            dropped: 0,
            unresolved: 0,
            lost: 0,
            buf,
            stream: None,
        }
    }

    /// The options in force.
    pub fn options(&self) -> Options {
        self.options
    }

    /// Records written.
    pub fn records(&self) -> u64 {
        self.records
    }

    /// Records past the limit.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// Feeds one engine record.
    pub fn feed(&mut self, r: &MemRecord) {
        if r.access & access::FETCH != 0 || r.access & (access::READ | access::WRITE) == 0 {
            return;
        }
        let cpl = r.cpl();
        if self.options.cpl.is_some_and(|c| c != cpl) {
            return;
        }
        if self.records >= self.options.limit {
            self.dropped += 1;
            return;
        }
        self.records += 1;
        if r.pa == u64::MAX {
            self.unresolved += 1;
        }
        let mut flags = cpl << FLAG_CPL_SHIFT;
        if r.access & access::READ != 0 {
            flags |= FLAG_READ;
        }
        if r.access & access::WRITE != 0 {
            flags |= FLAG_WRITE;
        }
        let rec = Record {
            insn_vaddr: r.ip,
            mem_vaddr: r.ea,
            mem_paddr: r.pa,
            size: u16::try_from(r.size).unwrap_or(u16::MAX),
            flags,
        };
        self.buf.extend_from_slice(&rec.encode());
        if self.buf.len() >= CHUNK_BYTES {
            self.drain(false);
        }
    }

    /// Hands whole chunks (all of the buffer when `all`) to the stream, if there is one.
    fn drain(&mut self, all: bool) {
        let Some(s) = self.stream.as_mut() else {
            return;
        };
        let mut sent = 0;
        while s.failed.is_none()
            && (self.buf.len() - sent >= CHUNK_BYTES || all && sent < self.buf.len())
        {
            let file = match s.file {
                Some(f) => f,
                None => match s.sink.open(BIN_NAME) {
                    Ok(f) => *s.file.insert(f),
                    Err(e) => {
                        s.failed = Some(e);
                        break;
                    }
                },
            };
            let n = (self.buf.len() - sent).min(CHUNK_BYTES);
            if let Err(e) = s.sink.write(file, &self.buf[sent..sent + n]) {
                s.failed = Some(e);
                break;
            }
            sent += n;
        }
        if s.failed.is_some() {
            // Whole records not delivered (the header is not a record).
            self.lost += ((self.buf.len() - sent) / format::RECORD_BYTES) as u64;
            self.buf.clear();
        } else {
            self.buf.drain(..sent);
        }
    }

    fn write_summary(&self, out: &mut dyn Write) -> fmt::Result {
        writeln!(
            out,
            "records={} dropped={} unresolved={} lost={} cpl={} limit={}",
            self.records,
            self.dropped,
            self.unresolved,
            self.lost,
            self.options.cpl_name(),
            self.options.limit
        )
    }
}

impl Tool for MemTrace {
    fn instrument_trace(&mut self, trace: &mut TraceInstrumenter<'_>) {
        // Code translated for another CPL makes no record this tool keeps.
        if self
            .options
            .cpl
            .is_some_and(|c| c != trace.mode().cpl() & 3)
        {
            return;
        }
        for i in 0..trace.instructions().len() {
            trace.insert_mem_records(i);
        }
    }

    fn buffer_full(&mut self, records: &[MemRecord]) {
        for r in records {
            self.feed(r);
        }
    }

    fn records_need_pa(&self) -> bool {
        true
    }
}

impl KpinTool for MemTrace {
    fn name(&self) -> &'static str {
        SPEC.name
    }

    /// Streams `memtrace.bin` into `sink` while the guest runs (the engine image's I/O
    /// ring), instead of keeping it in memory until `finish`.
    fn stream_to(&mut self, sink: Box<dyn Sink>) {
        self.stream = Some(Stream {
            sink,
            file: None,
            failed: None,
        });
    }

    fn finish(&mut self, _engine: &Engine, host: &mut dyn Sink) -> Result<(), Error> {
        let streamed = if self.stream.is_some() {
            self.drain(true);
            let s = self.stream.as_mut().expect("checked just above");
            let closed = match s.file {
                Some(f) if s.failed.is_none() => s.sink.close(f),
                _ => Ok(()),
            };
            match s.failed {
                Some(e) => Err(e),
                None => closed,
            }
        } else {
            let mut f = File::create(host, BIN_NAME)?;
            f.write_all(&self.buf)?;
            self.buf.clear();
            f.close()
        };
        let mut f = File::create(host, SUMMARY_NAME)?;
        let _ = self.write_summary(&mut f);
        f.close()?;
        streamed
    }

    fn summary(&self, _engine: &Engine, out: &mut dyn Write) -> fmt::Result {
        write!(
            out,
            "memtrace: {} records written to {BIN_NAME} ({} past limit={}, {} without a physical address",
            self.records, self.dropped, self.options.limit, self.unresolved
        )?;
        if self.lost > 0 {
            write!(out, ", {} lost to a transport error", self.lost)?;
        }
        out.write_str(")")
    }
}

#[cfg(test)]
mod tests {
    extern crate std;
    use std::vec;

    use super::format::{FormatError, Trace, HEADER_BYTES, RECORD_BYTES};
    use super::*;

    /// The SPEC and the parser agree: every declared key parses, its default to the
    /// default options, and every key the parser matches is declared.
    #[test]
    fn test_spec_lists_exactly_the_keys_the_parser_accepts() {
        for o in SPEC.options {
            let word = format!("{}={}", o.key, o.default.unwrap());
            assert_eq!(Options::parse(&word), Ok(Options::default()), "{word}");
        }
        assert_eq!(
            Options::parse("colour=red").unwrap_err(),
            "unknown option \"colour\" (memtrace knows cpl, limit)"
        );
        let src = include_str!("lib.rs");
        let parse = &src[src.find("pub fn parse(").unwrap()..];
        let parse = &parse[..parse.find("\n    }\n").unwrap()];
        let arms: Vec<&str> = parse
            .lines()
            .filter_map(|l| l.strip_prefix("                \""))
            .filter_map(|l| l.split_once("\" =>").map(|(k, _)| k))
            .collect();
        let declared: Vec<&str> = SPEC.options.iter().map(|o| o.key).collect();
        assert_eq!(arms, declared);
    }

    fn rec(ip: u64, access: u32, cpl: u32) -> MemRecord {
        MemRecord {
            ip,
            ea: ip + 0x1000,
            size: 8,
            access: access | cpl << access::CPL_SHIFT,
            pa: ip + 0x2000,
        }
    }

    #[test]
    fn test_options_parse_defaults_values_and_refusals() {
        assert_eq!(Options::parse("").unwrap(), Options::default());
        let o = Options::parse("cpl=3 limit=100 bringup.ticks=1").unwrap();
        assert_eq!(
            o,
            Options {
                cpl: Some(3),
                limit: 100
            }
        );
        assert_eq!(Options::parse("cpl=0").unwrap().cpl, Some(0));
        assert_eq!(Options::parse("cpl=all").unwrap().cpl, None);
        assert!(Options::parse("cpl=1").unwrap_err().contains("cpl=1"));
        assert!(Options::parse("limit=-3").is_err());
        assert!(Options::parse("limit=").is_err());
        assert!(Options::parse("colour=red").unwrap_err().contains("colour"));
        assert!(Options::parse("cpl").is_err());
    }

    #[test]
    fn test_record_round_trip_and_flags() {
        let r = Record {
            insn_vaddr: 0xffff_ffff_8100_0000,
            mem_vaddr: 0x7fff_1234,
            mem_paddr: u64::MAX,
            size: 512,
            flags: FLAG_READ | FLAG_WRITE | 3 << FLAG_CPL_SHIFT,
        };
        assert_eq!(Record::decode(&r.encode()), r);
        assert!(r.is_read() && r.is_write());
        assert_eq!(r.cpl(), 3);
    }

    #[test]
    fn test_feed_filters_limits_and_encodes_what_the_reader_reads() {
        let mut t = MemTrace::new("cpl=3 limit=2").unwrap();
        t.feed(&rec(0x10, access::READ, 0)); // other CPL
        t.feed(&rec(0x20, access::FETCH, 3)); // a fetch, not data
        t.feed(&rec(0x30, access::WRITE, 3));
        t.feed(&rec(0x40, access::READ | access::WRITE, 3));
        t.feed(&rec(0x50, access::READ, 3)); // past the limit
        assert_eq!((t.records(), t.dropped()), (2, 1));
        let trace = Trace::parse(&t.buf).unwrap();
        let got: Vec<Record> = trace.records().collect();
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].insn_vaddr, 0x30);
        assert_eq!(got[0].mem_vaddr, 0x1030);
        assert_eq!(got[0].mem_paddr, 0x2030);
        assert!(got[0].is_write() && !got[0].is_read());
        assert!(got[1].is_write() && got[1].is_read());
        assert!(got.iter().all(|r| r.cpl() == 3 && r.size == 8));
    }

    #[test]
    fn test_parse_refuses_garbage_and_truncated_files() {
        let mut t = MemTrace::new("").unwrap();
        for i in 0..3 {
            t.feed(&rec(i, access::READ, 0));
        }
        let good = t.buf.clone();
        assert_eq!(Trace::parse(&good).unwrap().len(), 3);
        assert_eq!(Trace::parse(&good[..HEADER_BYTES]).unwrap().len(), 0);
        assert_eq!(
            Trace::parse(&good[..good.len() - 1]).unwrap_err(),
            FormatError::Truncated {
                extra: RECORD_BYTES - 1
            }
        );
        assert_eq!(Trace::parse(&good[..5]).unwrap_err(), FormatError::NoHeader);
        assert_eq!(Trace::parse(b"").unwrap_err(), FormatError::NoHeader);
        let mut bad = good.clone();
        bad[0] ^= 1;
        assert_eq!(Trace::parse(&bad).unwrap_err(), FormatError::BadMagic);
        let mut bad = good.clone();
        bad[8] = 9;
        assert!(matches!(
            Trace::parse(&bad),
            Err(FormatError::BadVersion { version: 9, .. })
        ));
        assert_eq!(
            Trace::parse(&vec![0xa5; 1000]).unwrap_err(),
            FormatError::BadMagic
        );
    }

    /// A sink that keeps one file's bytes and counts writes.
    #[derive(Default)]
    struct Mem {
        bytes: Vec<u8>,
        writes: usize,
        closed: bool,
    }

    struct Shared(std::rc::Rc<core::cell::RefCell<Mem>>);

    impl Sink for Shared {
        fn open(&mut self, name: &str) -> Result<u16, Error> {
            assert_eq!(name, BIN_NAME);
            Ok(7)
        }
        fn write(&mut self, file: u16, data: &[u8]) -> Result<(), Error> {
            assert!(file == 7 && data.len() <= CHUNK_BYTES);
            let mut m = self.0.borrow_mut();
            m.bytes.extend_from_slice(data);
            m.writes += 1;
            Ok(())
        }
        fn close(&mut self, _file: u16) -> Result<(), Error> {
            self.0.borrow_mut().closed = true;
            Ok(())
        }
    }

    #[test]
    fn test_streaming_batches_writes_into_chunks() {
        let mem = std::rc::Rc::new(core::cell::RefCell::new(Mem::default()));
        let mut t = MemTrace::new("").unwrap();
        t.stream_to(Box::new(Shared(mem.clone())));
        for i in 0..1000 {
            t.feed(&rec(i, access::READ, (i % 2 * 3) as u32));
        }
        t.drain(true);
        let m = mem.borrow();
        let trace = Trace::parse(&m.bytes).unwrap();
        assert_eq!(trace.len(), 1000);
        assert!(trace
            .records()
            .enumerate()
            .all(|(i, r)| r.insn_vaddr == i as u64));
        // 16 + 28000 bytes in 2 KiB writes.
        assert_eq!(
            m.writes,
            (HEADER_BYTES + 1000 * RECORD_BYTES).div_ceil(CHUNK_BYTES)
        );
    }
}
