//! Differential tests: random programs run natively and under translation (with and
//! without linking, with and without instrumentation and engine instruction counting);
//! registers, flags and memory must be equal.

mod common;

use common::diff::check_case;
use common::tools::Heavy;
use common::{Region, Rig};
use guest_engine::{Config, NullTool};

fn cases() -> u64 {
    std::env::var("KPIN_DIFF_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3000)
}

#[test]
fn test_random_programs_match_native() {
    let mut rig = Rig::new(Config::default());
    let block = Region::map(1 << 20, 0);
    let n = cases();
    for seed in 0..n {
        check_case(&mut rig, &block, seed, 40, &mut NullTool);
    }
    let s = rig.engine.stats();
    common::report(&format!(
        "{n} differential cases (random programs, null tool); stats {s:?}"
    ));
}

#[test]
fn test_random_programs_without_linking_match_native() {
    let cfg = Config {
        link_direct: false,
        fill_ibl: false,
        ..Config::default()
    };
    let mut rig = Rig::new(cfg);
    let block = Region::map(1 << 20, 0);
    let n = cases() / 10;
    for seed in 100_000..100_000 + n {
        check_case(&mut rig, &block, seed, 30, &mut NullTool);
    }
    common::report(&format!(
        "{n} differential cases (random programs, no linking, no IBL)"
    ));
}

#[test]
fn test_instrumented_random_programs_match_native() {
    // A small buffer so that BUFFER_FULL exits happen mid-trace.
    // With the undefined flags this CPU writes (`host_flags::probe`), as the engine image
    // runs: glue before an `and`/`test` may then clobber AF.
    let cfg = Config {
        record_buffer_records: 7,
        records_need_pa: true,
        count_insns: true,
        host_flags: guest_engine::host_flags::probe(),
        ..Config::default()
    };
    let mut rig = Rig::new(cfg);
    let block = Region::map(1 << 20, 0);
    let n = cases() / 3;
    let mut tool = Heavy::default();
    for seed in 200_000..200_000 + n {
        check_case(&mut rig, &block, seed, 40, &mut tool);
    }
    assert!(tool.calls > 0 && tool.mem.count > 0);
    let insns = rig.engine.executed_insns(guest_engine::Mode::KERNEL);
    assert!(insns > 0);
    common::report(&format!(
        "{n} differential cases (random programs, heavy instrumentation and engine instruction counts: {insns}; {:?})",
        guest_engine::host_flags::probe()
    ));
}

/// Debug aid: `KPIN_SEED=n KPIN_TOOL=bbl|mem|heavy|null cargo test ... debug_one -- --ignored`.
#[test]
#[ignore]
fn debug_one() {
    use iced_x86::Formatter;
    let seed: u64 = std::env::var("KPIN_SEED").unwrap().parse().unwrap();
    let cfg = Config {
        record_buffer_records: 7,
        ..Config::default()
    };
    let mut rig = Rig::new(cfg);
    let block = Region::map(1 << 20, 0);
    let p = common::gen::program(seed, block.addr(), 40);
    let mut d = iced_x86::Decoder::with_ip(64, &p.bytes, block.addr(), 0);
    let mut f = iced_x86::NasmFormatter::new();
    while d.can_decode() && d.ip() < p.data {
        let i = d.decode();
        let mut s = String::new();
        f.format(&i, &mut s);
        println!("{:x} {s}", i.ip() - block.addr());
    }
    let mut tool: Box<dyn guest_engine::Tool> = match std::env::var("KPIN_TOOL").as_deref() {
        Ok("bbl") => Box::new(common::tools::BblCount::default()),
        Ok("mem") => Box::new(common::tools::MemTrace::default()),
        Ok("heavy") => Box::new(Heavy::default()),
        _ => Box::new(NullTool),
    };
    check_case(&mut rig, &block, seed, 40, &mut *tool);
}
