//! A tool written outside the kpin tree runs with one command (issue #23). The test has
//! `kpin new-tool` write a tool crate into a temporary directory — `insncount`, the
//! skeleton's per-CPL instruction counter, a counter added to at every block start,
//! written to `insncount.csv` — and runs `kpin run --tool-crate DIR --tool insncount` on the
//! mini-kernel and on Linux. Its counts must agree with the engine's own per-mode count
//! (`counters.json`, an independent mechanism: the engine's count also holds the
//! instructions it emulated outside the cache, which no tool instruments, and takes back
//! what a fault cut short of a block), and no file of the kpin tree may change
//! (`git status`).

use std::path::Path;
use std::process::Command;

use kpin_tests::{json_u64, kpin_bin, kpin_run, require_kvm, scratch_dir};

/// Writes the tool crate into `dir` with `kpin new-tool` (its skeleton is the per-CPL
/// counter this test checks).
fn write_tool_crate(dir: &Path) {
    let o = Command::new(kpin_bin())
        .args(["new-tool", "--name", "insncount"])
        .arg(dir)
        .output()
        .expect("run kpin new-tool");
    assert!(
        o.status.success(),
        "kpin new-tool: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(dir.join("Cargo.toml").is_file() && dir.join("src/lib.rs").is_file());
}

/// `git status --porcelain` of the kpin tree (tracked and untracked, not ignored).
fn tree_status() -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let o = Command::new("git")
        .args(["status", "--porcelain"])
        .current_dir(root)
        .output()
        .expect("git status");
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Runs `guest` (`--guest` value) under the tool crate at `tool`; returns the CPL 0 and
/// CPL 3 counts from `insncount.csv` and the engine's counters.
fn run_under_the_tool(tool: &Path, guest: &str, out: &Path) -> (u64, u64, serde_json::Value) {
    let run = kpin_run(
        Command::new(kpin_bin())
            .args(["run", "--guest", guest, "--tool", "insncount", "--quiet"])
            .arg("--tool-crate")
            .arg(tool)
            .arg("--out")
            .arg(out),
        out,
    );
    assert!(run.output.status.success(), "{}", run.context);
    let csv = std::fs::read_to_string(out.join("insncount.csv"))
        .unwrap_or_else(|e| panic!("insncount.csv: {e}\n{}", run.context));
    let count = |cpl: &str| -> u64 {
        csv.lines()
            .find_map(|l| l.strip_prefix(&format!("{cpl},")))
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no CPL {cpl} row in\n{csv}"))
    };
    let counters: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("counters.json")).expect("counters.json"),
    )
    .expect("counters.json is JSON");
    (count("0"), count("3"), counters)
}

/// The tool's blocks and the engine's count agree (as bbcount's do).
fn assert_agrees(guest: &str, k: u64, u: u64, c: &serde_json::Value) {
    assert!(k > 0 && u > 0, "{guest} runs code at both CPLs: {k} {u}");
    let engine = json_u64(c, "/guest_instructions/cpl0") + json_u64(c, "/guest_instructions/cpl3");
    assert_eq!(
        k + u + json_u64(c, "/guest_instructions/emulated")
            - json_u64(c, "/guest_instructions/taken_back_after_faults"),
        engine,
        "{guest}: the tool's counts and the engine's disagree\n{c}"
    );
}

#[test]
fn test_a_tool_crate_outside_the_tree_runs_on_the_minikernel_and_linux() {
    require_kvm!();
    let dir = scratch_dir("out-of-tree-tool");
    let tool = dir.join("insncount");
    write_tool_crate(&tool);
    let before = tree_status();
    let (k, u, c) = run_under_the_tool(&tool, "minikernel", &dir.join("mk"));
    assert_agrees("the mini-kernel", k, u, &c);
    let (k, u, c) = run_under_the_tool(&tool, "linux", &dir.join("linux"));
    assert_agrees("Linux", k, u, &c);
    assert_eq!(tree_status(), before, "the kpin tree changed");
    println!("insncount on Linux: {k} at CPL 0, {u} at CPL 3");
}
