//! Host instructions per record of the simulator on a deterministic program-like stream
//! (`tests/common/program.rs`) of RECORDS records, or on the records of FILE (32 bytes
//! each: ip, ea, size | access << 32, pa, little-endian, as the record ring carries
//! them), fed the way the host thread feeds them ([`RecordConsumer::feed`], 256 records a
//! call as `vmm/src/engine/host_sim.rs` does):
//! `cargo run --release -p kpin-tool-cachesim --example feed_cost [-- RECORDS|FILE [OPTIONS...]]`
//! (options as `--tool-option` takes them; by default issue #25's geometry).
//!
//! It runs itself under `valgrind --tool=callgrind`, counting only the instructions
//! executed inside the feeding (`simulate` below), and prints them per record: an exact
//! count that does not depend on the host's load, unlike time (and this host's VM has no
//! hardware counters for `perf stat`). The run prints every counter and a digest of the
//! files it would write, so two builds can be checked for equal results on the stream.

use std::process::Command;

use kpin_tool::host::{Error, Sink};
use kpin_tool::host_side::RecordConsumer;
use kpin_tool::MemRecord;
use kpin_tool_cachesim::insns::HOST_CAPACITY;
use kpin_tool_cachesim::CacheSim;

#[path = "../tests/common/program.rs"]
mod program;

/// Default stream length, and the geometry of issue #25's comparison with QEMU.
const RECORDS: usize = 4_000_000;
const OPTIONS: &str =
    "L1I_size=16K L1I_assoc=8 L1D_size=16K L1D_assoc=8 LL_size=2M LL_assoc=16 line_size=64";
/// Records per feed (`host_sim.rs`'s `FEED`).
const STRETCH: usize = 256;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().is_some_and(|a| a == "--child") {
        return child(&args[1..]);
    }
    let source = args.first().cloned().unwrap_or_else(|| RECORDS.to_string());
    let records = match source.parse::<u64>() {
        Ok(n) => n,
        Err(_) => {
            std::fs::metadata(&source)
                .expect("a record count or a file")
                .len()
                / 32
        }
    };
    let options = if args.len() > 1 {
        args[1..].to_vec()
    } else {
        vec![OPTIONS.to_string()]
    };
    let out_file = std::env::temp_dir().join(format!("feed_cost.{}.callgrind", std::process::id()));
    let out = Command::new("valgrind")
        .args(["--tool=callgrind", "--toggle-collect=*feed_cost::simulate*"])
        .arg(format!("--callgrind-out-file={}", out_file.display()))
        .arg(std::env::current_exe().expect("own path"))
        .args(["--child", &source])
        .args(&options)
        .output()
        .expect("valgrind runs");
    print!("{}", String::from_utf8_lossy(&out.stdout));
    let profile = std::fs::read_to_string(&out_file).unwrap_or_else(|e| {
        panic!(
            "no callgrind output ({e}): {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    let _ = std::fs::remove_file(&out_file);
    let total: u64 = profile
        .lines()
        .find_map(|l| l.strip_prefix("totals: "))
        .and_then(|t| t.trim().parse().ok())
        .expect("callgrind's totals line");
    println!(
        "{records} records: {total} instructions simulating them, {:.1} per record",
        total as f64 / records as f64
    );
}

/// Feeds one stretch as the host thread does.
#[inline(never)]
fn simulate(sim: &mut CacheSim, records: &[MemRecord]) {
    RecordConsumer::feed(sim, records);
}

fn child(args: &[String]) {
    // The host thread's consumer (`report::Host::record_consumer`).
    let mut sim =
        CacheSim::with_insn_capacity(&args[1..].join(" "), HOST_CAPACITY).expect("options");
    let mut buf: Vec<MemRecord> = Vec::with_capacity(2 * STRETCH);
    if let Ok(n) = args[0].parse::<usize>() {
        let mut program = program::Program::new(25);
        let mut made = 0;
        while made < n {
            program.records(STRETCH.min(n - made), &mut buf);
            buf.truncate(n - made);
            made += buf.len();
            simulate(&mut sim, &buf);
        }
    } else {
        let bytes = std::fs::read(&args[0]).expect("the records file");
        let word = |c: &[u8], k: usize| u64::from_le_bytes(c[8 * k..8 * k + 8].try_into().unwrap());
        for stretch in bytes.chunks(32 * STRETCH) {
            buf.clear();
            buf.extend(stretch.chunks_exact(32).map(|c| MemRecord {
                ip: word(c, 0),
                ea: word(c, 1),
                size: word(c, 2) as u32,
                access: (word(c, 2) >> 32) as u32,
                pa: word(c, 3),
            }));
            simulate(&mut sim, &buf);
        }
    }
    let h = sim.hierarchy();
    println!(
        "refs fetch {:?} data {:?}, unresolved {}",
        h.fetch_refs,
        h.data_refs,
        sim.unresolved()
    );
    for (name, c) in h.caches() {
        println!("{name} {:?}", c.stats);
    }
    // The files the run would write (counters, timeline, misses per instruction), hashed.
    let mut files = Files(Vec::new());
    sim.write_files(&mut files).expect("files written");
    for (name, bytes) in &files.0 {
        let digest = bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        });
        println!("{name}: {} bytes, FNV-1a {digest:#018x}", bytes.len());
    }
    let mut line = String::new();
    let _ = sim.write_summary(&mut line);
    println!("{line}");
}

/// The files written, in memory.
struct Files(Vec<(String, Vec<u8>)>);

impl Sink for Files {
    fn open(&mut self, name: &str) -> Result<u16, Error> {
        self.0.push((name.to_string(), Vec::new()));
        Ok((self.0.len() - 1) as u16)
    }

    fn write(&mut self, file: u16, data: &[u8]) -> Result<(), Error> {
        self.0[usize::from(file)].1.extend_from_slice(data);
        Ok(())
    }

    fn close(&mut self, _file: u16) -> Result<(), Error> {
        Ok(())
    }
}
