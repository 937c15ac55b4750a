//! Issue #27, cachesim's profiles (`docs/profiles.md`): the Linux boot and workload under
//! `--tool cachesim --tool-option attribute=on` through `kpin run`. `cg_annotate` reads
//! the Cachegrind file without error and prints the simulation's counters as its totals;
//! the folded stacks sum to the instruction count, which is the flame graph's root; the
//! per-process table's rows sum to it too, and the workload's programs are in it by name;
//! the folded stacks are call stacks (user and kernel) from cachesim's shadow stacks.
//! One boot (~1–3 min here).

use std::process::Command;

use kpin_tests::{cg_annotate_totals, kpin_bin, kpin_run, require_kvm, scratch_dir};

/// Seconds kpin may run the guest.
const BUDGET_SECONDS: &str = "600";

#[test]
fn test_linux_cachesim_profiles_sum_to_the_counters() {
    require_kvm!();
    let out = scratch_dir("linux-profiles");
    let mut cmd = Command::new(kpin_bin());
    cmd.args(["run", "--guest", "linux", "--tool", "cachesim"])
        .args(["--tool-option", "attribute=on"])
        .args(["--quiet", "--timeout", BUDGET_SECONDS, "--out"])
        .arg(&out);
    let run = kpin_run(&mut cmd, &out);
    assert_eq!(run.output.status.code(), Some(0), "{}", run.context);

    let text = std::fs::read_to_string(out.join(kpin_tool_cachesim::COUNTERS_NAME))
        .expect("cachesim counters");
    let c = kpin_tool_cachesim::files::parse_counters(&text).expect("counters");
    let misses =
        |cc: &kpin_tool_cachesim::files::CacheCounters| cc.stats.misses[0] + cc.stats.misses[1];
    let l1: u64 = c.caches.iter().filter(|cc| cc.core).map(misses).sum();
    let ll: u64 = c
        .caches
        .iter()
        .filter(|cc| cc.parent.is_none())
        .map(misses)
        .sum();
    let ir = c.fetch_refs[0] + c.fetch_refs[1];
    let data = c.data_refs[0] + c.data_refs[1];
    assert!(ir > 100_000_000, "{text}");

    let cg = out.join(kpin_tool_cachesim::profile::CACHEGRIND_NAME);
    let cg_text = std::fs::read_to_string(&cg).expect("the Cachegrind file");
    let summary: Vec<u64> = cg_text
        .lines()
        .find_map(|l| l.strip_prefix("summary: "))
        .expect("summary line")
        .split(' ')
        .map(|n| n.parse().expect("a count"))
        .collect();
    let sums = |t: &[u64]| [t[0], t[3] + t[6], t[1] + t[4] + t[7], t[2] + t[5] + t[8]];
    assert_eq!(sums(&summary), [ir, data, l1, ll], "summary vs counters");
    if let Some(totals) = cg_annotate_totals(&cg) {
        assert_eq!(totals, summary, "cg_annotate's totals");
        eprintln!("cg_annotate totals {totals:?}; counters Ir {ir} D {data} L1 {l1} LL {ll}");
    }

    let folded = std::fs::read_to_string(out.join(kpin_tool_cachesim::profile::FOLDED_NAME))
        .expect("folded stacks");
    let folded_sum: u64 = folded
        .lines()
        .map(|l| {
            l.rsplit_once(' ')
                .expect("stack count")
                .1
                .parse::<u64>()
                .unwrap()
        })
        .sum();
    assert_eq!(folded_sum, ir, "folded stacks vs instructions");
    assert!(folded.contains(";[kernel];"), "kernel frames");
    // Call stacks (callstacks=on by default): the workload's programs under their
    // callers, and the kernel's syscalls under the system call entry.
    let frames = |prefix: &str, inner: &str| {
        folded
            .lines()
            .filter(|l| l.starts_with(prefix) && l.contains(inner))
            .map(|l| l.rsplit_once(' ').unwrap().0.split(';').count())
            .max()
            .unwrap_or(0)
    };
    assert!(
        frames("sort;/bin/busybox;", ";sort_main;") >= 6,
        "sort's stacks: {:.3000}",
        folded
    );
    assert!(
        frames("kpin-test;/bin/kpin-test;", ";main") >= 4,
        "kpin-test's main under its caller"
    );
    assert!(
        frames("", ";[kernel];") >= 8 && frames("", ";do_syscall_64;") >= 5,
        "kernel call stacks"
    );
    let stacks = kpin_tool_cachesim::profile::read_stacks(&out)
        .expect("the contexts and stacks files")
        .expect("call stacks kept");
    assert!(stacks.0.len() > 1000 && !stacks.1.is_empty(), "contexts");
    let svg = std::fs::read_to_string(out.join(kpin_tool_cachesim::profile::FLAME_NAME))
        .expect("flame graph");
    assert!(svg.contains(&format!("total_samples=\"{ir}\"")), "the root");

    let json: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join(kpin_tool_cachesim::report::JSON_NAME)).unwrap(),
    )
    .unwrap();
    let a = &json["attributed"];
    assert_eq!(a["totals_match_counters"], true, "{a}");
    let rows = a["processes"].as_array().expect("rows");
    let row_sum: u64 = rows
        .iter()
        .map(|r| r["instructions"].as_u64().unwrap())
        .sum();
    assert_eq!(row_sum, ir, "per-process instructions");
    for comm in ["init", "sort", "awk", "kpin-test"] {
        assert!(
            rows.iter()
                .any(|r| r["comm"] == comm && r["instructions"].as_u64() > Some(0)),
            "{comm} missing: {a}"
        );
    }
}
