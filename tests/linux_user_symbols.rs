//! Issue #27's user-code names: `kpin run --guest linux --tool bbcount` names user blocks
//! by the file the guest had mapped at their physical address (`processes.json`'s code
//! pages) and that file's ELF symbols, read from the run's initramfs on the host
//! (`vmm/src/diag/user_names.rs`). bbcount's report (and its `run.json` entry) must name
//! ≥ 99 % of user instructions with a file and ≥ 95 % with a function (the bar),
//! name the test program's own functions in its user function table, and carry the
//! per-process table summing to the engine's totals.

use std::process::Command;

use kpin_tests::{
    cg_annotate_totals, engine_counters, json_u64, kpin_bin, kpin_run, require_kvm, scratch_dir,
};

/// The functions `images/workloads/kpin-test.c` defines (`static T name(…) {`).
fn kpin_test_functions() -> Vec<String> {
    let src = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../images/workloads/kpin-test.c"
    );
    let text = std::fs::read_to_string(src).expect("kpin-test.c");
    text.lines()
        .filter(|l| l.starts_with("static ") && l.trim_end().ends_with('{'))
        .filter_map(|l| {
            let head = l.split('(').next()?;
            let name = head.rsplit([' ', '*']).next()?;
            (!name.is_empty()).then(|| name.to_string())
        })
        .collect()
}

#[test]
fn test_linux_user_code_named_by_file_and_function() {
    require_kvm!();
    let out = scratch_dir("linux-user-symbols");
    let mut cmd = Command::new(kpin_bin());
    cmd.args([
        "run", "--guest", "linux", "--tool", "bbcount", "--top", "400",
    ])
    .args(["--quiet", "--timeout", "300", "--out"])
    .arg(&out);
    let run = kpin_run(&mut cmd, &out);
    assert_eq!(run.output.status.code(), Some(0), "{}", run.context);
    let run_json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("run.json")).expect("run.json"))
            .expect("run.json is JSON");
    let bb = &run_json["bbcount"];
    let report = std::fs::read_to_string(out.join("bbcount-report.txt")).expect("report");

    // The per-process table: every row, summing to the engine's totals per CPL.
    let counters = engine_counters(&out);
    let p = &bb["processes"];
    assert_eq!(p["rows_sum_to_totals"], true, "{report}");
    assert_eq!(
        json_u64(p, "/user_instructions"),
        json_u64(&counters, "/guest_instructions/cpl3")
    );
    assert_eq!(
        json_u64(p, "/kernel_instructions"),
        json_u64(&counters, "/guest_instructions/cpl0")
    );
    let rows = p["rows"].as_array().expect("rows");
    assert_eq!(
        rows.len(),
        run_json["processes"]["processes"]
            .as_array()
            .map_or(0, Vec::len),
        "every row of processes.json"
    );
    assert!(
        rows.iter()
            .any(|r| r["comm"] == "kpin-test" && json_u64(r, "/user_instructions") > 0),
        "{report}"
    );
    assert!(report.contains("the rows sum to both exactly"), "{report}");

    // User code named: the share with a file, and kpin-test's own functions.
    let object = bb["user_object_share"].as_f64().expect("a share");
    let function = bb["user_function_share"].as_f64().expect("a share");
    eprintln!("user instructions named: {object:.4} with a file, {function:.4} with a function");
    assert!(bb["user_symbols"].is_string(), "no user names:\n{report}");
    assert!(object >= 0.99, "{object} named with a file\n{report}");
    // The workload is mostly busybox's applets, built by `kpin images` from Debian's
    // source with its symbol table kept (images/src/busybox_build.rs): what stays unnamed
    // is static glibc's PLT stubs, the vDSO and the JIT's memfd (~0.25 % here).
    assert!(
        function >= 0.95 && function <= object,
        "{function} named with a function\n{report}"
    );
    let own = kpin_test_functions();
    assert!(own.len() > 20, "{own:?}");
    let named: Vec<&str> = bb["user_functions"]
        .as_array()
        .expect("user functions")
        .iter()
        .filter_map(|f| f["function"].as_str())
        .collect();
    assert!(
        named.iter().any(|f| f
            .strip_prefix("/bin/kpin-test: ")
            .is_some_and(|f| own.iter().any(|o| o == f))),
        "no kpin-test function of its own among {named:?}"
    );
    assert!(
        report.contains("/bin/kpin-test: "),
        "the report names it: {report}"
    );

    // The same counts per function as a Cachegrind file (cg_annotate's total is bbcount's)
    // and as folded stacks, whose sum is the flame graph's root.
    let total = json_u64(bb, "/total");
    if let Some(totals) = cg_annotate_totals(&out.join("cachegrind.out.bbcount")) {
        assert_eq!(totals, [total], "cg_annotate's program total");
    }
    let folded = std::fs::read_to_string(out.join("bbcount.folded")).expect("bbcount.folded");
    let sum: u64 = folded
        .lines()
        .map(|l| {
            l.rsplit_once(' ')
                .expect("`stack count`")
                .1
                .parse::<u64>()
                .expect("a count")
        })
        .sum();
    assert_eq!(sum, total, "folded stacks");
    assert!(folded.contains("/bin/kpin-test;"), "{folded:.2000}");
    let svg = std::fs::read_to_string(out.join("bbcount-flamegraph.svg")).expect("the SVG");
    assert!(svg.contains("</svg>"), "{svg:.300}");
}
