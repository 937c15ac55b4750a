//! Issue #27's first slice: which process ran, from the kernel's own types. `kpin run`
//! reads the kernel's BTF, the engine reads `current` at every entry to user mode and
//! writes `processes.json`, and `kpin` copies it into `run.json` and prints the table
//! (`docs/processes.md`). Under bbcount the pinned 6.1 kernel's workload must show its
//! programs by name, and the rows' instructions must add up to the engine's totals in
//! `counters.json` exactly, per CPL; the 6.12 kernel (where `current` is in `pcpu_hot`)
//! the same under tool null, also booted through its bzImage with KASLR (the BTF from the
//! bzImage's payload); and a kernel without BTF (the mini-kernel) gets one warning and rows
//! by address space, again summing exactly. Every task row names its executable: `busybox`
//! for busybox's applets (whose `comm` is the applet), `kpin-test` for the test program.
//! And the engine records where user code came from (`objects`, `code_pages`): busybox
//! and the test program among the files, with few failed walks of the tasks' VMAs. A
//! program with a known loop count (`kpin.workload=count`) finds it in its own row and,
//! under bbcount, in its own function.

use std::path::Path;
use std::process::Command;

use kpin_tests::{engine_counters, json_u64, kpin_bin, kpin_run, require_kvm, scratch_dir};

/// Seconds kpin may run the guest (about 30 s here for Linux).
const BUDGET_SECONDS: &str = "300";

/// The programs the default workload execs (busybox applets by their names, the test
/// programs; `busybox` is `"$BUSYBOX" expr`): each must have a row with its name.
/// (Applets busybox's shell runs without an exec, `cp` and `cmp`, keep the shell's name.)
const WORKLOAD_COMMS: &[&str] = &[
    "init",
    "busybox",
    "seq",
    "grep",
    "wc",
    "awk",
    "sort",
    "cut",
    "uniq",
    "kpin-test",
    "md5sum",
];

/// Runs `kpin run` with `args` into `out`; returns stderr, `processes.json` and `run.json`
/// after checking that the run ended cleanly.
fn run(args: &[&str], out: &Path) -> (String, serde_json::Value, serde_json::Value) {
    let mut cmd = Command::new(kpin_bin());
    cmd.arg("run")
        .args(args)
        .args(["--quiet", "--timeout", BUDGET_SECONDS, "--out"])
        .arg(out);
    let run = kpin_run(&mut cmd, out);
    assert_eq!(run.output.status.code(), Some(0), "{}", run.context);
    let read = |name: &str| -> serde_json::Value {
        let text = std::fs::read_to_string(out.join(name))
            .unwrap_or_else(|e| panic!("{name}: {e}\n{}", run.context));
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{name}: {e}\n{text}"))
    };
    let stderr = String::from_utf8_lossy(&run.output.stderr).into_owned();
    (stderr, read("processes.json"), read("run.json"))
}

/// The rows' instructions add up to `counters.json`'s totals exactly, per CPL, and
/// `run.json` holds the same rows.
fn assert_exact(out: &Path, processes: &serde_json::Value, run_json: &serde_json::Value) {
    let counters = engine_counters(out);
    let rows = processes["processes"].as_array().expect("rows");
    let sum = |key: &str| -> u64 { rows.iter().map(|r| json_u64(r, &format!("/{key}"))).sum() };
    let (user, kernel) = (
        json_u64(&counters, "/guest_instructions/cpl3"),
        json_u64(&counters, "/guest_instructions/cpl0"),
    );
    assert_eq!(
        sum("user_instructions"),
        user,
        "CPL 3: rows vs counters.json"
    );
    assert_eq!(
        sum("kernel_instructions"),
        kernel,
        "CPL 0: rows vs counters.json"
    );
    assert_eq!(json_u64(processes, "/user_instructions"), user);
    assert_eq!(json_u64(processes, "/kernel_instructions"), kernel);
    assert!(user > 0 && kernel > 0, "{counters}");
    assert_eq!(rows[0]["kind"], "boot", "the boot row comes first");
    assert_eq!(
        rows.iter().filter(|r| r["kind"] == "boot").count(),
        1,
        "one boot row"
    );
    // run.json keeps the counts and rows, not the code origins (`objects`, `code_pages`).
    let kept = run_json["processes"]
        .as_object()
        .expect("run.json's processes");
    assert!(kept.contains_key("processes") && !kept.contains_key("code_pages"));
    for (key, value) in kept {
        assert_eq!(
            *value, processes[key],
            "run.json's processes.{key} is processes.json's"
        );
    }
}

/// Every busybox applet's rows name `busybox` as their executable (`/bin/busybox`), and
/// the test program its own; no executable read failed.
fn assert_exes(processes: &serde_json::Value) {
    assert_eq!(processes["exe_reads_failed"], 0, "{processes}");
    let rows = processes["processes"].as_array().expect("rows");
    let exe_of = |comm: &str| -> Vec<(String, String)> {
        rows.iter()
            .filter(|r| r["comm"] == comm)
            .map(|r| {
                (
                    r["exe"].as_str().unwrap_or("(null)").to_owned(),
                    r["exe_path"].as_str().unwrap_or("(null)").to_owned(),
                )
            })
            .collect()
    };
    for applet in ["init", "seq", "awk", "sort", "md5sum"] {
        let exes = exe_of(applet);
        assert!(!exes.is_empty(), "no row for {applet}");
        assert!(
            exes.iter()
                .all(|(e, p)| e == "busybox" && p == "/bin/busybox"),
            "{applet}: {exes:?}"
        );
    }
    let test = exe_of("kpin-test");
    assert!(
        !test.is_empty()
            && test
                .iter()
                .all(|(e, p)| e == "kpin-test" && p.ends_with("/kpin-test")),
        "kpin-test: {test:?}"
    );
    // Tasks return to user mode only with an mm: every task row has an executable.
    for r in rows.iter().filter(|r| r["kind"] == "task") {
        assert!(r["exe"].is_string(), "a task without exe: {r}");
    }
    assert!(rows[0]["exe"].is_null(), "the boot row has none");
}

/// The user code's origins: `/bin/busybox` and the test program among the objects, each
/// once; every code page names one of them; few walks of the VMAs failed, none dropped.
fn assert_origins(processes: &serde_json::Value) {
    let objects: Vec<&str> = processes["objects"]
        .as_array()
        .expect("objects")
        .iter()
        .map(|o| o.as_str().expect("an object is a string"))
        .collect();
    assert!(objects.contains(&"/bin/busybox"), "{objects:?}");
    assert!(
        objects.iter().any(|o| o.ends_with("/kpin-test")),
        "{objects:?}"
    );
    let mut unique = objects.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(unique.len(), objects.len(), "each once: {objects:?}");
    let pages = processes["code_pages"].as_array().expect("code_pages");
    assert!(pages.len() > 100, "{} code pages", pages.len());
    let mut pfns = std::collections::BTreeSet::new();
    for p in pages {
        let [pfn, object, offset] = [0, 1, 2].map(|i| p[i].as_u64().expect("numbers"));
        assert!((object as usize) < objects.len(), "{p}");
        assert_eq!(offset % 4096, 0, "a page's offset: {p}");
        assert!(pfns.insert(pfn), "one entry per frame: {p}");
    }
    let busybox = objects.iter().position(|o| *o == "/bin/busybox").unwrap() as u64;
    assert!(
        pages.iter().filter(|p| p[1] == busybox).count() > 50,
        "busybox's code pages"
    );
    let walks = json_u64(processes, "/origin_walks");
    let failures = json_u64(processes, "/origin_walk_failures");
    assert!(walks >= pages.len() as u64, "{walks} walks");
    assert!(
        failures * 100 <= walks,
        "{failures} of {walks} walks failed"
    );
    assert_eq!(json_u64(processes, "/origins_dropped"), 0);
    eprintln!(
        "user code: {} objects, {} code pages, {walks} walks, {failures} failed: {objects:?}",
        objects.len(),
        pages.len()
    );
}

/// The workload printed the md5 the host expects: watching changed nothing it computed.
fn assert_workload_md5(out: &Path) {
    let console = std::fs::read_to_string(out.join("console.log")).expect("console.log");
    let md5 = kpin_images::workload_expected_md5();
    assert!(
        console.contains(&format!("KPIN-WORKLOAD-DONE {md5}")),
        "workload md5 {md5} expected"
    );
}

/// Every name of `wants` has a row in `processes`.
fn assert_rows_named(processes: &serde_json::Value, wants: &[&str]) {
    let names = comms(processes);
    for want in wants {
        assert!(
            names.iter().any(|n| n == want),
            "no row for {want:?}; rows: {names:?}"
        );
    }
}

/// The names of the task rows.
fn comms(processes: &serde_json::Value) -> Vec<String> {
    processes["processes"]
        .as_array()
        .expect("rows")
        .iter()
        .filter_map(|r| r["comm"].as_str().map(str::to_owned))
        .collect()
}

#[test]
fn test_linux_61_workload_processes_appear_by_name_and_sum_exactly() {
    require_kvm!();
    let out = scratch_dir("linux-processes-61");
    let (stderr, p, run_json) = run(&["--guest", "linux", "--tool", "bbcount"], &out);
    assert!(
        stderr.contains("processes: the running task from the BTF of")
            && stderr.contains("(current_task)"),
        "the VMM says where `current` came from:\n{stderr}"
    );
    assert!(stderr.contains("kpin: processes ("), "the table:\n{stderr}");
    assert_eq!(p["by"], "task", "{p}");
    assert_eq!(p["reads_failed"], 0, "{p}");
    assert_exact(&out, &p, &run_json);
    assert_rows_named(&p, WORKLOAD_COMMS);
    let rows = p["processes"].as_array().unwrap();
    let init = rows
        .iter()
        .find(|r| r["pid"] == 1)
        .expect("a row for pid 1");
    assert_eq!(init["comm"], "init", "{init}");
    assert_eq!(init["tgid"], 1, "{init}");
    // sort sorts 20000 lines three times: it must have run user code of its own.
    let sort: u64 = rows
        .iter()
        .filter(|r| r["comm"] == "sort")
        .map(|r| json_u64(r, "/user_instructions"))
        .sum();
    assert!(sort > 1_000_000, "sort ran {sort} user instructions");
    assert_exes(&p);
    assert_origins(&p);
    assert_workload_md5(&out);
    assert!(
        stderr.contains(" exe "),
        "the table's exe column:\n{stderr}"
    );
    eprintln!(
        "Linux 6.1 under bbcount: {} rows, {} changes of the running task",
        rows.len(),
        p["switches"]
    );
}

/// `kpin.workload=count`: `kpin-test count 50000000` renames itself `kpin-count` and runs
/// exactly 2 × 50 000 000 user instructions in its loop (`dec; jnz`,
/// images/workloads/kpin-test.c). Its own row must hold them (plus its `printf` and exit:
/// a few thousand), and bbcount must put them in `count_loop` of `/bin/kpin-test`.
#[test]
fn test_a_known_loop_count_lands_in_its_processs_row_and_function() {
    require_kvm!();
    const LOOP: u64 = 2 * 50_000_000;
    let out = scratch_dir("linux-processes-count");
    let (_, p, run_json) = run(
        &[
            "--guest",
            "linux",
            "--tool",
            "bbcount",
            "--append",
            "kpin.workload=count",
        ],
        &out,
    );
    assert_exact(&out, &p, &run_json);
    let rows = p["processes"].as_array().unwrap();
    let count: Vec<&serde_json::Value> =
        rows.iter().filter(|r| r["comm"] == "kpin-count").collect();
    assert_eq!(count.len(), 1, "one kpin-count row: {rows:?}");
    let user = json_u64(count[0], "/user_instructions");
    assert!(
        (LOOP..LOOP + 20_000).contains(&user),
        "kpin-count ran {user} user instructions, its loop {LOOP}"
    );
    let functions = run_json["bbcount"]["user_functions"]
        .as_array()
        .expect("bbcount's user functions");
    let in_loop = functions
        .iter()
        .find(|f| f["function"] == "/bin/kpin-test: count_loop")
        .unwrap_or_else(|| panic!("no count_loop among {functions:?}"));
    let executed = json_u64(in_loop, "/executed");
    assert!(
        (LOOP..LOOP + 100).contains(&executed),
        "count_loop executed {executed}"
    );
}

#[test]
fn test_linux_612_finds_current_in_pcpu_hot() {
    require_kvm!();
    let out = scratch_dir("linux-processes-612");
    let (stderr, p, run_json) = run(&["--guest", "linux-6.12", "--tool", "null"], &out);
    assert!(
        stderr.contains("(pcpu_hot.current_task)"),
        "6.12 keeps `current` in pcpu_hot:\n{stderr}"
    );
    assert_eq!(p["by"], "task", "{p}");
    assert_eq!(p["reads_failed"], 0, "{p}");
    assert_exact(&out, &p, &run_json);
    assert_rows_named(&p, &["init", "sort", "kpin-test"]);
    assert_origins(&p);
    assert_workload_md5(&out);
}

#[test]
fn test_linux_612_bzimage_with_kaslr_names_processes_from_its_payloads_btf() {
    require_kvm!();
    let images = kpin_images::default_out_dir();
    let dir = images.join("linux-6.12.117+deb12-cloud-amd64");
    let (bzimage, initrd) = (dir.join("vmlinuz"), images.join("initramfs.cpio"));
    if !bzimage.is_file() || !initrd.is_file() {
        eprintln!(
            "SKIPPED: no {} or {} (run `kpin images`)",
            bzimage.display(),
            initrd.display()
        );
        return;
    }
    assert!(!vmm::guests::LINUX_612_CMDLINE.contains("nokaslr"));
    let out = scratch_dir("linux-processes-612-bzimage");
    let (stderr, p, run_json) = run(
        &[
            "--kernel",
            bzimage.to_str().unwrap(),
            "--initrd",
            initrd.to_str().unwrap(),
            "--cmdline",
            vmm::guests::LINUX_612_CMDLINE,
            "--tool",
            "null",
        ],
        &out,
    );
    assert!(
        stderr.contains("vmlinuz's payload (pcpu_hot.current_task)"),
        "the types come from the bzImage's payload:\n{stderr}"
    );
    // KASLR on: the per-CPU offset of `current` is not moved, so no entry is skipped.
    assert_eq!(p["by"], "task", "{p}");
    assert_eq!(p["reads_failed"], 0, "{p}");
    assert_exact(&out, &p, &run_json);
    assert_rows_named(&p, WORKLOAD_COMMS);
    assert_exes(&p);
    assert_origins(&p);
    assert_workload_md5(&out);
}

#[test]
fn test_a_kernel_without_btf_is_reported_by_address_space() {
    require_kvm!();
    let out = scratch_dir("minikernel-processes");
    let (stderr, p, run_json) = run(&["--guest", "minikernel", "--tool", "null"], &out);
    let warnings: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("processes are reported by address space"))
        .collect();
    assert_eq!(warnings.len(), 1, "one warning line:\n{stderr}");
    assert!(warnings[0].contains("no .BTF section"), "{}", warnings[0]);
    assert_eq!(p["by"], "address_space", "{p}");
    assert_exact(&out, &p, &run_json);
    // No types, no VMAs: no origins, and no second warning about them.
    assert_eq!(p["objects"], serde_json::json!([]), "{p}");
    assert_eq!(p["code_pages"], serde_json::json!([]), "{p}");
    assert!(!stderr.contains("user code is not attributed"), "{stderr}");
}
