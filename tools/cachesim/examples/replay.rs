//! Times the simulator alone on recorded records: a file of 32-byte records (ip, ea,
//! size | access << 32, pa; little-endian, as the record ring carries them) is read into
//! memory, then fed to [`CacheSim`] with the options given, and the references per
//! second printed. For measuring changes to the simulator on a real stream:
//! `cargo run --release -p kpin-tool-cachesim --example replay -- FILE [OPTIONS...]`.

use kpin_tool::MemRecord;
use kpin_tool_cachesim::CacheSim;

fn main() {
    let mut args = std::env::args().skip(1);
    let Some(path) = args.next() else {
        eprintln!("usage: replay RECORDS-FILE [key=value...]");
        std::process::exit(2);
    };
    let options: Vec<String> = args.collect();
    let bytes = std::fs::read(&path).unwrap_or_else(|e| {
        eprintln!("cannot read {path}: {e}");
        std::process::exit(1);
    });
    let word = |c: &[u8], k: usize| u64::from_le_bytes(c[8 * k..8 * k + 8].try_into().unwrap());
    let records: Vec<MemRecord> = bytes
        .chunks_exact(32)
        .map(|c| MemRecord {
            ip: word(c, 0),
            ea: word(c, 1),
            size: word(c, 2) as u32,
            access: (word(c, 2) >> 32) as u32,
            pa: word(c, 3),
        })
        .collect();
    drop(bytes);
    let mut sim = CacheSim::new(&options.join(" ")).unwrap_or_else(|e| {
        eprintln!("bad options: {e}");
        std::process::exit(2);
    });
    let start = std::time::Instant::now();
    for r in &records {
        sim.feed(r);
    }
    let secs = start.elapsed().as_secs_f64();
    for (name, c) in sim.hierarchy().caches() {
        println!("{name} stats {:?}", c.stats);
    }
    let mut misses: Vec<_> = sim
        .insns()
        .entries()
        .map(|e| (e.va, e.cpl, e.data, e.fetch))
        .collect();
    misses.sort_unstable();
    let digest = misses.iter().fold(0u64, |h, &(va, cpl, d, f)| {
        (h ^ va ^ u64::from(cpl) << 60 ^ d << 20 ^ f << 40).wrapping_mul(0x100_0000_01b3)
    });
    println!(
        "per-instruction misses: {} entries, digest {digest:#x}",
        misses.len()
    );
    let refs = sim.references();
    println!(
        "{} records, {refs} references in {secs:.2} s: {:.1} M refs/s, {:.1} M records/s",
        records.len(),
        refs as f64 / secs / 1e6,
        records.len() as f64 / secs / 1e6
    );
    let mut line = String::new();
    let _ = sim.write_summary(&mut line);
    println!("{line}");
}
