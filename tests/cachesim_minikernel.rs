//! `--tool cachesim` on the mini-kernel (issue #13): the guest still powers off after
//! every step, the simulated L1I sees exactly one fetch per guest instruction the engine
//! counted (`counters.json`, per CPL), every record has a physical address, a smaller L1D
//! misses more often than the default one on the same run, and the host reports
//! (`cachesim.txt`, `.json`, timeline `.svg`) are made from the tool's files, ending
//! with the instructions that missed most, named from the mini-kernel's ELF symbols.
//! The simulation runs on a host thread fed through the record ring (the default), and
//! inside the engine (`kpin run --sim-in-engine`): both hold the same invariants.

use std::path::PathBuf;
use std::time::Duration;

use kpin_tests::{engine_config, run_minikernel_with_engine};
use kpin_tool_cachesim::files::{parse_counters, Counters};
use kpin_tool_cachesim::report::TopInsn;
use vmm::diag::kernel_symbols::KernelSymbols;
use vmm::Outcome;

/// Runs the mini-kernel under cachesim with `options`, simulating on a host thread or in
/// the engine; returns the parsed counters, `counters.json` and the output directory.
fn run(name: &str, options: &str) -> (Counters, serde_json::Value, PathBuf) {
    run_where(name, options, true)
}

fn run_where(name: &str, options: &str, host_sim: bool) -> (Counters, serde_json::Value, PathBuf) {
    let engine = vmm::EngineConfig {
        host_sim,
        ..engine_config("cachesim", options)
    };
    let (report, text, log, dir) =
        run_minikernel_with_engine(name, "", Some(engine), Duration::from_secs(300));
    assert_eq!(
        report.outcome,
        Outcome::Poweroff,
        "console:\n{text}\nengine log:\n{log}\ndump:\n{}",
        report.dump.unwrap_or_default()
    );
    println!(
        "mini-kernel under cachesim {options:?} (host simulation: {host_sim}): {:.2} s",
        report.wall.as_secs_f64()
    );
    // Which side simulated: the summary line of the host's simulator (after the engine's
    // line saying where its records went), or the engine's (also when a one-core host has
    // no room for the simulator's thread).
    let host_sim = host_sim && vmm::engine::host_sim::HostSim::worthwhile();
    let line =
        |start: &str, has: &str| log.lines().any(|l| l.starts_with(start) && l.contains(has));
    assert_eq!(
        (
            line("[Info] cachesim: ", "records sent to the host's simulator"),
            line("[Info] host: cachesim: ", "references simulated"),
            line("[Info] cachesim: ", "references simulated"),
        ),
        (host_sim, host_sim, !host_sim),
        "{log}"
    );
    let counters = std::fs::read_to_string(dir.join(kpin_tool_cachesim::COUNTERS_NAME))
        .unwrap_or_else(|e| panic!("no cachesim counters ({e}); engine log:\n{log}"));
    let c = parse_counters(&counters).unwrap_or_else(|l| panic!("line {l}:\n{counters}"));
    let json = std::fs::read_to_string(dir.join("counters.json")).expect("counters.json");
    (
        c,
        serde_json::from_str(&json).expect("counters.json is JSON"),
        dir,
    )
}

/// One L1I reference per guest instruction the engine counted, at each CPL, and every
/// record with a physical address.
fn check_fetches(c: &Counters, engine: &serde_json::Value) {
    let insns = |cpl: &str| {
        engine
            .pointer(&format!("/guest_instructions/{cpl}"))
            .and_then(serde_json::Value::as_u64)
            .unwrap_or_else(|| panic!("no guest_instructions/{cpl} in {engine}"))
    };
    assert_eq!(c.unresolved, 0, "records without a PA: {c:?}");
    assert_eq!(
        c.fetch_refs,
        [insns("cpl0"), insns("cpl3")],
        "L1I references (kernel, user) vs the engine's instruction counts"
    );
}

/// The misses of cache `name` at CPL 0. The kernel's work is the same in every run; the
/// user programs spin until timer ticks arrive, so their share (mostly hits) moves with
/// timing and would blur a comparison of rates between two runs.
fn kernel_misses(c: &Counters, name: &str) -> u64 {
    c.caches
        .iter()
        .find(|x| x.name == name)
        .unwrap_or_else(|| panic!("no {name}"))
        .stats
        .misses[0]
}

fn miss_rate(c: &Counters, name: &str) -> f64 {
    let s = c
        .caches
        .iter()
        .find(|x| x.name == name)
        .unwrap_or_else(|| panic!("no {name}"))
        .stats;
    let misses = (s.misses[0] + s.misses[1]) as f64;
    misses / (misses + (s.hits[0] + s.hits[1]) as f64)
}

#[test]
fn test_minikernel_cachesim_fetches_equal_engine_instructions_and_small_l1d_misses_more() {
    kpin_tests::require_kvm!();
    let (c, engine, dir) = run("minikernel-cachesim", "");
    check_fetches(&c, &engine);
    assert!(
        c.fetch_refs[1] > 0 && c.data_refs[0] > 0 && c.data_refs[1] > 0,
        "{c:?}"
    );
    let l1i = &c.caches[0];
    assert_eq!(l1i.name, "L1I");
    // Every fetch touches one line, two when the instruction crosses a line boundary.
    let line_accesses: u64 = l1i.stats.hits.iter().chain(&l1i.stats.misses).sum();
    let fetches: u64 = c.fetch_refs.iter().sum();
    assert!(line_accesses >= fetches && line_accesses < fetches + fetches / 4);

    // The mini-kernel waits for timer ticks, so the two runs differ in length a little;
    // the same code and data either way.
    // The second run simulates inside the engine: the same invariants hold.
    let (small, engine, _) = run_where(
        "minikernel-cachesim-small-l1d",
        "L1D_size=1K L1D_assoc=2",
        false,
    );
    check_fetches(&small, &engine);
    let (big, tiny) = (miss_rate(&c, "L1D"), miss_rate(&small, "L1D"));
    let (big_k, tiny_k) = (kernel_misses(&c, "L1D"), kernel_misses(&small, "L1D"));
    println!(
        "L1D miss rate: 32K 8-way {big:.4}, 1K 2-way {tiny:.4}; kernel misses {big_k} vs {tiny_k}"
    );
    assert!(
        tiny_k > big_k + big_k / 4,
        "1K L1D kernel misses {tiny_k} not clearly above 32K L1D's {big_k}"
    );

    let (report, files) = kpin_tool_cachesim::report::write_reports(&dir)
        .expect("reports")
        .expect("cachesim files present");
    assert_eq!(files.len(), 3, "{files:?}");
    let svg = std::fs::read_to_string(dir.join(kpin_tool_cachesim::report::SVG_NAME)).unwrap();
    assert!(
        svg.starts_with("<svg") && svg.contains("L1D miss rate"),
        "{svg:.300}"
    );
    let txt = report.text();
    assert!(
        txt.contains("L1I") && txt.contains("Total miss rate:"),
        "{txt}"
    );
    println!("{txt}");
    check_top(&c, &dir);
}

/// The top-N lists: every counted L1 miss is in the per-instruction file, the lists hold
/// at most `top` instructions whose misses sum to at most the L1's, most first, and the
/// first of each is a mini-kernel instruction its ELF symbols name.
fn check_top(c: &Counters, dir: &std::path::Path) {
    let insns = kpin_tool_cachesim::report::read_insns(dir)
        .expect("a valid file")
        .expect("cachesim-insns.csv written");
    let misses = |name: &str| {
        let s = c.caches.iter().find(|x| x.name == name).unwrap().stats;
        s.misses[0] + s.misses[1]
    };
    let (l1d, l1i) = (misses("L1D"), misses("L1I"));
    assert_eq!(
        insns.totals(),
        (l1d, l1i),
        "per-instruction misses vs the L1D and L1I totals"
    );
    let symbols = KernelSymbols::load(&kpin_tests::minikernel_elf(), None)
        .expect("the mini-kernel reads")
        .expect("the mini-kernel ELF has symbols");
    let (report, _) = kpin_tool_cachesim::report::write_reports_named(dir, Some(&symbols))
        .expect("reports")
        .expect("cachesim files present");
    let top = report.top_instructions.as_ref().expect("top lists");
    assert_eq!(top.top, 10, "the default");
    for (list, total) in [(&top.data, l1d), (&top.fetch, l1i)] {
        assert!(!list.is_empty() && list.len() <= 10, "{list:?}");
        let sum: u64 = list.iter().map(|e| e.misses).sum();
        assert!(sum <= total, "top-N misses {sum} > L1 misses {total}");
        assert!(
            list.windows(2).all(|w| w[0].misses >= w[1].misses),
            "{list:?}"
        );
        let first: &TopInsn = &list[0];
        let va = u64::from_str_radix(first.address.trim_start_matches("0x"), 16).unwrap();
        assert_eq!(
            first.symbol,
            symbols.describe(va),
            "the report names {} as the ELF symbols do",
            first.address
        );
        assert!(
            first.symbol.is_some(),
            "{} is not a mini-kernel instruction",
            first.address
        );
    }
    let txt = std::fs::read_to_string(dir.join(kpin_tool_cachesim::report::TXT_NAME)).unwrap();
    assert!(
        txt.contains("Top 10 by data (L1D) misses:")
            && txt.contains("Top 10 by fetch (L1I) misses:")
            && txt.contains(top.data[0].symbol.as_deref().unwrap()),
        "{txt}"
    );
    println!("{}", top.text());
    let json = std::fs::read_to_string(dir.join(kpin_tool_cachesim::report::JSON_NAME)).unwrap();
    let json: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(
        json.pointer("/top_instructions/fetch/0/address")
            .and_then(serde_json::Value::as_str),
        Some(top.fetch[0].address.as_str()),
        "{json}"
    );
}

/// A four-level hierarchy from a drcachesim configuration file: the host expands it into
/// the engine's options, the engine simulates it level by level, and the report names
/// each cache with its child hits.
#[test]
fn test_minikernel_cachesim_four_level_config_file() {
    kpin_tests::require_kvm!();
    let conf = kpin_tests::scratch_dir("minikernel-cachesim-conf-file").join("deep.conf");
    std::fs::write(
        &conf,
        "// split L1s, a private L2, a shared L3, an LLC\n\
         num_cores 1\nline_size 64\n\
         P0L1I { type instruction core 0 size 16K assoc 8 parent P0L2 }\n\
         P0L1D { type data core 0 size 16K assoc 8 parent P0L2 }\n\
         P0L2 { type unified size 128K assoc 8 parent L3 }\n\
         L3 { size 1M assoc 16 parent LLC }\n\
         LLC { size 8M assoc 16 parent memory }\n",
    )
    .unwrap();
    let options =
        vmm::input_check::engine_options("cachesim", &[format!("config_file={}", conf.display())])
            .expect("a valid file");
    let (c, engine, dir) = run("minikernel-cachesim-config-file", &options);
    check_fetches(&c, &engine);
    let names: Vec<&str> = c.caches.iter().map(|x| x.name.as_str()).collect();
    assert_eq!(names, ["P0L1I", "P0L1D", "P0L2", "L3", "LLC"]);
    // Each level sees exactly the misses of the levels below it.
    let s = |k: usize| c.caches[k].stats;
    let total = |v: [u64; 2]| v[0] + v[1];
    assert_eq!(
        total(s(2).hits) + total(s(2).misses),
        total(s(0).misses) + total(s(1).misses)
    );
    assert_eq!(total(s(3).hits) + total(s(3).misses), total(s(2).misses));
    assert_eq!(total(s(4).hits) + total(s(4).misses), total(s(3).misses));
    let (report, _) = kpin_tool_cachesim::report::write_reports(&dir)
        .expect("reports")
        .expect("cachesim files present");
    let llc = report.caches.last().unwrap();
    assert_eq!(
        llc.total.child_hits,
        Some(total(s(0).hits) + total(s(1).hits) + total(s(2).hits) + total(s(3).hits))
    );
    println!("{}", report.text());
}
