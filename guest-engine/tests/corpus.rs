//! Differential tests over compiled functions: each runs natively and under translation
//! from the same state; all registers, flags and the work buffer must match.

mod common;

use common::corpus::{corpus, Harness};
use common::Rig;
use guest_engine::{Config, NullTool, Tool};

pub fn check_corpus(h: &mut Harness, tool: &mut dyn Tool, seeds: u64) -> u64 {
    let mut cases = 0;
    for (name, f) in corpus() {
        for seed in 0..seeds {
            let n = 64 + (seed * 97) % 1500;
            let ((nr, nb), (tr, tb)) = h.run(f, seed + 1, n, tool);
            assert_eq!(nr, tr, "{name} seed {seed}: registers differ");
            assert!(nb == tb, "{name} seed {seed}: buffer differs");
            cases += 1;
        }
    }
    cases
}

#[test]
fn test_compiled_corpus_matches_native() {
    let mut h = Harness::new(Config::default());
    let cases = check_corpus(&mut h, &mut NullTool, 6);
    common::report(&format!(
        "{cases} differential cases (compiled corpus); stats {:?}",
        h.rig.engine.stats()
    ));
}

#[test]
fn test_instrumented_compiled_corpus_matches_native() {
    let cfg = Config {
        record_buffer_records: 100,
        count_insns: true,
        ..Config::default()
    };
    let mut h = Harness {
        rig: Rig::new(cfg),
        ..Harness::new(Config::default())
    };
    let mut tool = common::tools::Heavy::default();
    let cases = check_corpus(&mut h, &mut tool, 2);
    common::report(&format!(
        "{cases} differential cases (compiled corpus, heavy instrumentation)"
    ));
}

#[test]
fn test_compiled_corpus_with_tiny_cache_flushes_and_matches() {
    let mut h = Harness {
        rig: Rig::with_cache_bytes(Config::default(), guest_engine::layout::MIN_REGION_BYTES),
        ..Harness::new(Config::default())
    };
    let cases = check_corpus(&mut h, &mut NullTool, 2);
    let s = h.rig.engine.stats();
    assert!(s.flushes > 0, "the tiny cache never filled: {s:?}");
    common::report(&format!(
        "{cases} differential cases (compiled corpus, tiny cache, {} flushes)",
        s.flushes
    ));
}
