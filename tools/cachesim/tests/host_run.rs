//! cachesim on the host: a loop that stores and reloads 100 quadwords, run by the
//! translator in this test process (no VM) as kernel code and then as user code; the
//! simulator must see one fetch per instruction the engine counted, per CPL, and the data
//! references and misses the loop must cause.

use guest_engine::Mode;
use kpin_tool::host_run::{run_store_reload_loop, Files, STORE_RELOAD_ITERATIONS};
use kpin_tool::KpinTool;
use kpin_tool_cachesim::files::parse_counters;
use kpin_tool_cachesim::{insns, CacheSim, COUNTERS_NAME, INSNS_NAME, TIMELINE_NAME};

#[test]
fn fetches_equal_engine_instructions_and_data_misses_are_the_loops() {
    const ITERATIONS: u64 = STORE_RELOAD_ITERATIONS;
    let mut tool = CacheSim::new("").expect("default options");
    // Kept whole: the engine runs in the mappings the run owns.
    let run = run_store_reload_loop(&mut tool);
    let (engine, base) = (&run.engine, run.base);
    let h = tool.hierarchy();
    let per_mode = 1 + 4 * ITERATIONS + 1;
    assert_eq!(engine.executed_insns(Mode::KERNEL), per_mode);
    assert_eq!(engine.executed_insns(Mode::USER), per_mode);
    assert_eq!(h.fetch_refs, [per_mode, per_mode]);
    // Two per iteration, and the `jmp [rip]`'s load of its target.
    let data = 2 * ITERATIONS + 1;
    assert_eq!(h.data_refs, [data, data]);
    assert_eq!(tool.unresolved(), 0);
    // The code (25 bytes from a page boundary) is one line: one compulsory L1I miss, at
    // CPL 0; the user run fetches the same physical line.
    assert_eq!(h.l1i().stats.misses, [1, 0]);
    assert_eq!(h.l1i().stats.hits, [per_mode - 1, per_mode]);
    // The data: bytes 8..808 of the next page, lines 0..=12, and the jump's target in the
    // code line: 14 compulsory misses.
    assert_eq!(h.l1d().stats.misses, [14, 0]);
    assert_eq!(h.l1d().stats.compulsory, [14, 0]);
    assert_eq!(h.l1d().stats.hits, [data - 14, data]);
    // The last level: the code line (its L1D miss then hits) and the 13 data lines.
    assert_eq!(h.ll().stats.misses, [14, 0]);
    let l1d = h.l1d().stats;

    let mut files = Files::default();
    tool.finish(engine, &mut files).expect("finish");
    let names: Vec<&str> = files.0.iter().map(|f| f.0.as_str()).collect();
    assert_eq!(names, [COUNTERS_NAME, TIMELINE_NAME, INSNS_NAME]);
    assert!(files.0.iter().all(|f| f.2), "every file closed");
    let c = parse_counters(std::str::from_utf8(&files.0[0].1).unwrap()).expect("parses");
    assert_eq!(c.fetch_refs, [per_mode, per_mode]);
    assert_eq!(c.caches[1].stats, l1d);
    // Misses per instruction: every L1 miss on an instruction of the code, the one L1I
    // miss on the first (CPL 0), the 14 L1D misses on kernel instructions only.
    let per = insns::parse(std::str::from_utf8(&files.0[2].1).unwrap()).expect("parses");
    assert_eq!(per.totals(), (14, 1));
    assert_eq!(per.other, insns::InsnMisses::default());
    let fetch = insns::top(&per.rows, insns::MissKind::Fetch, 10);
    assert_eq!((fetch.len(), fetch[0].va, fetch[0].cpl), (1, base, 0));
    assert!(per
        .rows
        .iter()
        .all(|r| r.cpl == 0 && r.va >= base && r.va < base + 25));
}
