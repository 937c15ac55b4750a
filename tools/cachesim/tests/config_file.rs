//! `config_file=PATH` in drcachesim's configuration-file format: deeper hierarchies are
//! read, simulated level by level and handed to the engine in a form that reads back the
//! same; every rule a file can break is a named error.

use kpin_tool_cachesim::files::parse_counters;
use kpin_tool_cachesim::options::{CacheKind, Options};
use kpin_tool_cachesim::sim::{Hierarchy, Kind, KERNEL, USER};

/// Four levels: split L1s, a private L2, a shared L3 and an LLC, as drcachesim's
/// documentation writes them (comments, suffixes, `{` on the name's line).
const FOUR_LEVELS: &str = "\
// A deeper hierarchy than the command-line options give.
num_cores 1
line_size 64
cpu_scheduling true
P0L1I {  // the instruction cache
  type instruction
  core 0
  size 1K
  assoc 2
  parent P0L2
}
P0L1D { type data core 0 size 1K assoc 2 parent P0L2 replace_policy FIFO }
LLC {
  size 64K
  assoc 16
  inclusive false
  parent memory
  prefetcher none
}
L3 { type unified size 16K assoc 8 parent LLC }
P0L2{ type unified size 4K assoc 4 parent L3 }
";

fn host(words: &str, file: &str) -> Result<Options, String> {
    let file = file.to_string();
    Options::parse_host(words, &mut |path| {
        assert_eq!(path, "h.conf");
        Ok(file.clone())
    })
}

#[test]
fn a_four_level_file_is_read_children_before_parents() {
    let o = host("config_file=h.conf warmup_refs=5", FOUR_LEVELS).expect("valid");
    let specs = o.specs();
    let names: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["P0L1I", "P0L1D", "P0L2", "L3", "LLC"]);
    let parents: Vec<Option<usize>> = specs.iter().map(|s| s.parent).collect();
    assert_eq!(parents, [Some(2), Some(2), Some(3), Some(4), None]);
    assert_eq!(specs[0].kind, CacheKind::Instruction);
    assert!(specs[0].core && specs[1].core && !specs[2].core);
    assert_eq!(specs[4].geometry.size, 64 << 10);
    assert_eq!(specs[1].policy.name(), "FIFO");
    assert_eq!(specs[0].policy.name(), "LRU");
    assert_eq!((o.line_size, o.warmup_refs), (64, 5));
    // What the engine gets reads back to the same options.
    let words = o.to_words();
    assert!(words.len() < 255, "{words}");
    assert_eq!(Options::parse(&words).expect("engine parses"), o);
}

#[test]
fn each_level_is_reached_only_by_the_misses_of_the_one_below() {
    let o = host("config_file=h.conf", FOUR_LEVELS).unwrap();
    let mut h = Hierarchy::new(&o);
    // 8 KiB of data read twice: it fits L3 (16K) but neither L1D (1K) nor P0L2 (4K).
    let lines = 8192 / 64;
    for round in 0..2 {
        for l in 0..lines {
            h.access(
                l * 64,
                8,
                Kind::Read,
                if round == 0 { KERNEL } else { USER },
            );
        }
    }
    let c = |h: &Hierarchy, n: &str| h.cache(n).unwrap().stats;
    assert_eq!(c(&h, "P0L1D").misses, [lines, lines]);
    assert_eq!(c(&h, "P0L2").misses, [lines, lines]);
    assert_eq!(c(&h, "L3").misses, [lines, 0]);
    assert_eq!(c(&h, "L3").hits, [0, lines]);
    assert_eq!(c(&h, "LLC").misses, [lines, 0]);
    assert_eq!(c(&h, "LLC").hits, [0, 0], "L3 caught the second round");
    assert_eq!(c(&h, "P0L1I").hits, [0, 0]);
    // A fetch goes through P0L1I, then the shared levels: the line is in L3 by now.
    h.access(0, 4, Kind::Fetch, USER);
    assert_eq!(c(&h, "P0L1I").misses, [0, 1]);
    assert_eq!(h.l1i().stats.misses, [0, 1]);
    assert_eq!(h.ll().stats.misses, [lines, 0]);
}

#[test]
fn the_default_hierarchy_written_as_a_file_simulates_the_same() {
    let file = "\
L1I { type instruction core 0 size 32K assoc 8 parent L2 }
L1D { type data core 0 size 32K assoc 8 parent L2 }
L2 { size 256K assoc 8 parent LL }
LL { size 8M assoc 16 }
";
    let a = Options::parse("L2_size=256K L2_assoc=8").unwrap();
    let b = host("config_file=h.conf", file).unwrap();
    let (mut ha, mut hb) = (Hierarchy::new(&a), Hierarchy::new(&b));
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..200_000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let addr = (x >> 8) % (4 << 20);
        let kind = [Kind::Fetch, Kind::Read, Kind::Write][(x % 3) as usize];
        let who = ((x >> 3) & 1) as usize;
        ha.access(addr, 1 + (x >> 60) as u32, kind, who);
        hb.access(addr, 1 + (x >> 60) as u32, kind, who);
    }
    let sa: Vec<_> = ha.caches().map(|(n, c)| (n.to_string(), c.stats)).collect();
    let sb: Vec<_> = hb.caches().map(|(n, c)| (n.to_string(), c.stats)).collect();
    assert_eq!(sa, sb);
    assert!(
        sa[3].1.hits.iter().sum::<u64>() > 0,
        "the stream reaches LL"
    );
}

#[test]
fn a_unified_l1_takes_fetches_and_data() {
    let o = host("config_file=h.conf", "L1 { core 0 size 4K assoc 4 }").unwrap();
    let mut h = Hierarchy::new(&o);
    h.access(0x1000, 4, Kind::Fetch, KERNEL);
    h.access(0x1000, 8, Kind::Read, KERNEL);
    let s = h.cache("L1").unwrap().stats;
    assert_eq!((s.misses, s.hits), ([1, 0], [1, 0]));
}

#[test]
fn the_counters_file_names_each_cache_and_its_parent() {
    let o = host("config_file=h.conf", FOUR_LEVELS).unwrap();
    let mut tool = kpin_tool_cachesim::CacheSim::with_options(o.clone());
    let mut text = String::new();
    tool.feed(&kpin_tool::MemRecord {
        pa: 0x2000,
        size: 8,
        access: kpin_tool::access::READ,
        ..kpin_tool::MemRecord::default()
    });
    kpin_tool_cachesim::files::write_counters(&mut text, &o, tool.hierarchy(), 0).unwrap();
    assert!(
        text.starts_with("options hierarchy=config_file line_size=64"),
        "{text}"
    );
    let c = parse_counters(&text).unwrap_or_else(|l| panic!("line {l}: {text}"));
    let names: Vec<&str> = c.caches.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["P0L1I", "P0L1D", "P0L2", "L3", "LLC"]);
    let parents: Vec<Option<usize>> = c.caches.iter().map(|c| c.parent).collect();
    assert_eq!(parents, [Some(2), Some(2), Some(3), Some(4), None]);
    assert!(c.caches[0].core && c.caches[1].core && !c.caches[4].core);
}

#[test]
fn each_rule_a_file_breaks_is_named() {
    let l1 = "I { type instruction core 0 size 1K assoc 2 } D { type data core 0 size 1K assoc 2 }";
    let cases: &[(&str, &str, &str)] = &[
        ("", "num_cores 2", "num_cores must be 1"),
        ("", "num_cores x", "not a number"),
        ("", "skip_refs 10", "skip_refs must be 0"),
        ("", "coherence true", "coherence must be false"),
        ("", "colour blue", "unknown setting \"colour\""),
        ("", "", "no caches described"),
        ("", "} I {", "without a cache name"),
        ("", "I { type instruction core 0 size 1K assoc 2", "expects a value"),
        ("", "I { core 0 size 1K assoc 2 flavour x }", "unknown parameter \"flavour\""),
        ("", "I { core 0 size 1K assoc 2 type both }", "type is instruction, data or unified"),
        ("", "I { core 1 size 1K assoc 2 }", "core must be 0"),
        ("", "I { core 0 assoc 2 }", "cache I: size is required"),
        ("", "I { core 0 size 1K }", "cache I: assoc is required"),
        ("", "I { core 0 size lots assoc 2 }", "not a size"),
        ("", "I { core 0 size 1K assoc 2 replace_policy LFU }", "LFU is not simulated"),
        ("", "I { core 0 size 1K assoc 2 inclusive true }", "inclusive must be false"),
        ("", "I { core 0 size 1K assoc 2 prefetcher nextline }", "prefetcher must be none"),
        ("", "I { core 0 size 1K assoc 2 miss_file m.txt }", "miss_file is not supported"),
        ("", "I { core 0 size 1K assoc 2 parent L9 }", "parent L9 is not a cache"),
        ("", "I { core 0 size 1K assoc 2 } I { size 2K assoc 2 }", "described twice"),
        ("", "memory { size 1K assoc 2 }", "names main memory"),
        ("", "A { size 1K assoc 2 parent B } B { size 1K assoc 2 parent A }", "form a cycle"),
        (
            "",
            "I { type instruction core 0 size 1K assoc 2 parent D } D { type data core 0 size 1K assoc 2 }",
            "a parent must be unified or of its children's type",
        ),
        ("", "I { type instruction core 0 size 1K assoc 2 }", "core 0 has 0 data caches"),
        (
            "",
            "I { type instruction core 0 size 1K assoc 2 } D { type data core 0 size 1K assoc 2 } U { core 0 size 4K assoc 4 }",
            "core 0 has 2 instruction caches",
        ),
        (
            "",
            "I { type instruction core 0 size 3K assoc 2 } D { type data core 0 size 1K assoc 2 }",
            "I (size 3072, assoc 2, line 64): size must be a nonzero power of two",
        ),
        ("", "line_size 48 U { core 0 size 1K assoc 2 }", "line_size must be a power of two"),
        ("L1D_size=16K", l1, "cannot be combined with config_file"),
        ("config_file=again", l1, "config_file given twice"),
    ];
    for &(words, file, rule) in cases {
        let e = host(&format!("config_file=h.conf {words}"), file).expect_err(file);
        assert!(e.contains(rule), "{file:?}: {e:?} does not say {rule:?}");
    }
    // The line of the mistake is named.
    let e = host(
        "config_file=h.conf",
        "// two lines\nI {\n  core 0 size 1K assoc 2 flavour x }",
    )
    .unwrap_err();
    assert!(
        e.starts_with("config_file=h.conf: line 3: cache I: unknown parameter"),
        "{e}"
    );
    // A file that cannot be read.
    let e =
        Options::parse_host("config_file=nope", &mut |_| Err("no such file".into())).unwrap_err();
    assert_eq!(e, "config_file=nope: no such file");
    // The engine never reads files itself.
    let e = Options::parse("config_file=h.conf").unwrap_err();
    assert!(e.contains("read by the host"), "{e}");
}
