//! The `kpin` command on bad input and on crashing guests: a one-line error and a
//! non-zero exit status, never a panic; a crash gives exit status 3 and a state dump.

use std::path::Path;
use std::process::{Command, Output};

use kpin_tests::{require_kvm, scratch_dir, tiny_elf};

fn kpin(args: &[&str], out: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kpin"))
        .args(args)
        .arg("--out")
        .arg(out)
        .output()
        .expect("run kpin")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Asserts a host-side failure: exit status 1, one `kpin: error:` line mentioning `what`.
fn assert_one_line_error(o: &Output, what: &str) {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(1), "stderr: {err}");
    assert!(!err.contains("panicked"), "kpin panicked: {err}");
    let lines: Vec<&str> = err
        .lines()
        .filter(|l| l.starts_with("kpin: error:"))
        .collect();
    assert_eq!(lines.len(), 1, "want one error line: {err}");
    assert!(
        lines[0].contains(what),
        "error line {:?} lacks {what:?}",
        lines[0]
    );
}

/// Asserts a command-line mistake: exit status 2, one `kpin: error:` line with `what`.
fn assert_usage_error(o: &Output, what: &str) {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(2), "stderr: {err}");
    assert!(!err.contains("panicked"), "kpin panicked: {err}");
    let lines: Vec<&str> = err
        .lines()
        .filter(|l| l.starts_with("kpin: error:"))
        .collect();
    assert_eq!(lines.len(), 1, "want one error line: {err}");
    assert!(
        lines[0].contains(what),
        "error line {:?} lacks {what:?}",
        lines[0]
    );
    assert!(!err.contains("booting"), "refused before booting: {err}");
}

/// An ELF64 x86-64 header with one PT_LOAD of 16 `hlt`s at 1 MiB, `machine` patched in.
fn elf_for(machine: u16) -> Vec<u8> {
    let mut e = tiny_elf(&[0xf4; 16]);
    e[0x12..0x14].copy_from_slice(&machine.to_le_bytes());
    e
}

/// A bzImage setup header promising `sys_bytes` of kernel, in a file of `len` bytes.
fn bzimage(sys_bytes: u32, len: usize) -> Vec<u8> {
    let mut b = vec![0u8; len];
    b[0x1f1] = 3;
    b[0x1f4..0x1f8].copy_from_slice(&(sys_bytes / 16).to_le_bytes());
    b[0x1fe..0x200].copy_from_slice(&0xaa55u16.to_le_bytes());
    b[0x202..0x206].copy_from_slice(b"HdrS");
    b[0x206..0x208].copy_from_slice(&0x20fu16.to_le_bytes());
    b[0x211] = 1;
    b[0x236..0x238].copy_from_slice(&0x7fu16.to_le_bytes());
    b[0x258..0x260].copy_from_slice(&0x100_0000u64.to_le_bytes());
    b[0x260..0x264].copy_from_slice(&0x300_0000u32.to_le_bytes());
    b
}

#[test]
fn test_unknown_tools_option_keys_and_misplaced_options_are_usage_errors() {
    let dir = scratch_dir("cli-usage");
    let kernel = dir.join("k.elf");
    std::fs::write(&kernel, tiny_elf(&[0xf4])).unwrap();
    let k = kernel.to_str().unwrap();
    let o = kpin(&["run", "--kernel", k, "--tool", "nosuch"], &dir);
    assert_usage_error(&o, "unknown tool \"nosuch\": the tools are null, bbcount");
    let o = kpin(
        &[
            "run",
            "--kernel",
            k,
            "--tool",
            "null",
            "--tool-option",
            "colour=red",
        ],
        &dir,
    );
    assert_usage_error(
        &o,
        "unknown --tool-option key \"colour\" for tool null: the known keys are bringup.checks, bringup.gates, bringup.probe, bringup.ticks, bringup.crash",
    );
    let o = kpin(&["run", "--guest", "minikernel", "--initrd", k], &dir);
    assert_usage_error(&o, "--initrd and --system-map apply only to --kernel");
}

#[test]
fn test_bad_kernel_and_initrd_files_are_refused_before_booting() {
    let dir = scratch_dir("cli-badfiles");
    let good = dir.join("k.elf");
    std::fs::write(&good, tiny_elf(&[0xf4])).unwrap();
    let g = good.to_str().unwrap();

    let arm = dir.join("arm.elf");
    std::fs::write(&arm, elf_for(183)).unwrap();
    let o = kpin(&["run", "--kernel", arm.to_str().unwrap()], &dir);
    assert_one_line_error(&o, "e_machine is 183, not x86-64 (62)");

    let bz = dir.join("truncated.bzImage");
    std::fs::write(&bz, bzimage(14 << 20, 100_000)).unwrap();
    let o = kpin(&["run", "--kernel", bz.to_str().unwrap()], &dir);
    assert_one_line_error(&o, "but the file has 100000 (truncated?)");

    let small = dir.join("small.bzImage");
    std::fs::write(&small, bzimage(0x1000, 2048 + 0x1000)).unwrap();
    let o = kpin(
        &["run", "--kernel", small.to_str().unwrap(), "--mem", "16"],
        &dir,
    );
    assert_one_line_error(
        &o,
        "needs at least 64 MiB of guest memory to load; --mem is 16",
    );

    let fifo = dir.join("fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
    let o = kpin(&["run", "--kernel", fifo.to_str().unwrap()], &dir);
    assert_one_line_error(&o, "is a FIFO, not a regular file");
    let o = kpin(&["run", "--kernel", dir.to_str().unwrap()], &dir);
    assert_one_line_error(&o, "is a directory, not a regular file");

    let o = kpin(&["run", "--kernel", g, "--initrd", "/dev/zero"], &dir);
    assert_one_line_error(&o, "initrd /dev/zero is a character device");
    let o = kpin(
        &["run", "--kernel", g, "--initrd", fifo.to_str().unwrap()],
        &dir,
    );
    assert_one_line_error(&o, "is a FIFO");
}

#[test]
fn test_symlinks_to_kpins_own_files_are_refused() {
    let dir = scratch_dir("cli-symlinked-out");
    let victim = dir.with_extension("victim");
    std::fs::write(&victim, "keep").unwrap();
    std::os::unix::fs::symlink(&victim, dir.join("console.log")).unwrap();
    let kernel = dir.with_extension("elf");
    std::fs::write(&kernel, tiny_elf(&[0x0f, 0x0b])).unwrap();
    let o = kpin(
        &["run", "--kernel", kernel.to_str().unwrap(), "--mem", "32"],
        &dir,
    );
    assert_one_line_error(
        &o,
        "console.log is a symbolic link; kpin does not write through links",
    );
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep");
}

#[test]
fn test_missing_kernel_is_one_line_error() {
    require_kvm!();
    let dir = scratch_dir("cli-missing");
    let o = kpin(&["run", "--kernel", "/nonexistent/vmlinux"], &dir);
    assert_one_line_error(&o, "cannot read /nonexistent/vmlinux");
}

#[test]
fn test_garbage_and_truncated_kernels_are_rejected() {
    require_kvm!();
    let dir = scratch_dir("cli-badkernel");
    let garbage = dir.join("garbage");
    std::fs::write(&garbage, b"this is not a kernel").unwrap();
    let o = kpin(&["run", "--kernel", garbage.to_str().unwrap()], &dir);
    assert_one_line_error(&o, "is not a kernel");

    let elf = tiny_elf(&[0x90; 64]);
    let truncated = dir.join("truncated");
    std::fs::write(&truncated, &elf[..elf.len() - 32]).unwrap();
    let o = kpin(&["run", "--kernel", truncated.to_str().unwrap()], &dir);
    assert_one_line_error(
        &o,
        "is not a loadable kernel: a segment (64 bytes at file offset 0x78) lies past the end",
    );
}

#[test]
fn test_initrd_larger_than_ram_and_bad_mem_are_rejected() {
    require_kvm!();
    let dir = scratch_dir("cli-initrd");
    let kernel = dir.join("k.elf");
    std::fs::write(&kernel, tiny_elf(&[0xf4])).unwrap();
    let initrd = dir.join("big.img");
    std::fs::File::create(&initrd)
        .unwrap()
        .set_len(64 << 20)
        .unwrap();
    let k = kernel.to_str().unwrap();
    let o = kpin(
        &[
            "run",
            "--kernel",
            k,
            "--initrd",
            initrd.to_str().unwrap(),
            "--mem",
            "32",
        ],
        &dir,
    );
    assert_one_line_error(&o, "does not fit in guest RAM");
    let o = kpin(&["run", "--kernel", k, "--mem", "1"], &dir);
    assert_one_line_error(&o, "out of range");
}

#[test]
fn test_triple_fault_exits_3_with_dump() {
    require_kvm!();
    let dir = scratch_dir("cli-triple");
    let kernel = dir.join("ud2.elf");
    std::fs::write(&kernel, tiny_elf(&[0x0f, 0x0b])).unwrap();
    let o = kpin(
        &["run", "--kernel", kernel.to_str().unwrap(), "--mem", "32"],
        &dir,
    );
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(3), "{err}");
    assert!(
        err.contains("guest-state dump: guest triple-faulted"),
        "{err}"
    );
    assert!(err.contains("ud2"), "dump decodes the code at RIP: {err}");
    let dump = std::fs::read_to_string(dir.join("dump.txt")).expect("dump.txt");
    assert!(dump.contains("RIP="));
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("run.json")).unwrap()).unwrap();
    assert_eq!(summary["clean"], false);
}

#[test]
fn test_guest_triple_fault_under_the_engine_exits_3_with_the_guests_state_and_last_traces() {
    require_kvm!();
    let dir = scratch_dir("cli-triple-engine");
    // A call and a return (two traces entered from the dispatcher), then ud2: #UD with
    // no IDT, #GP for the IDT limit, #DF, #GP again: a triple fault.
    let code = [
        0xe8, 0x03, 0x00, 0x00, 0x00, // call +3
        0x0f, 0x0b, // ud2
        0xf4, // (not reached)
        0xc3, // ret
    ];
    let kernel = dir.join("ud2.elf");
    std::fs::write(&kernel, tiny_elf(&code)).unwrap();
    let o = kpin(
        &[
            "run",
            "--kernel",
            kernel.to_str().unwrap(),
            "--mem",
            "64",
            "--tool",
            "null",
        ],
        &dir,
    );
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(3), "{err}");
    let dump = std::fs::read_to_string(dir.join("dump.txt")).expect("dump.txt");
    assert!(dump.contains("--- the engine's report: last "), "{dump}");
    assert!(
        dump.contains("engine: the guest triple-faulted at RIP 0x100005: #GP (vector 13, error code 0x42) while delivering #DF"),
        "{dump}"
    );
    assert!(
        dump.contains("guest state: RIP 0x0000000000100005"),
        "{dump}"
    );
    assert!(
        dump.contains("guest state: instruction at RIP: Ud2 (2 bytes)"),
        "{dump}"
    );
    assert!(
        dump.contains("traces entered from the dispatcher"),
        "{dump}"
    );
    assert!(dump.contains(" 0x0000000000100000/0"), "{dump}");
    assert!(dump.contains(" 0x0000000000100008/0"), "{dump}");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("run.json")).unwrap()).unwrap();
    assert!(
        summary["engine_counters"]["translation"]["traces"].as_u64() > Some(0),
        "{summary}"
    );
}

#[test]
fn test_a_bbcount_csv_in_a_null_run_is_not_taken_for_bbcounts_results() {
    require_kvm!();
    let dir = scratch_dir("cli-forged-bbcount");
    // What a guest could leave: a CSV in bbcount's format with a count that wraps.
    std::fs::write(
        dir.join("bbcount.csv"),
        "address,cpl,instructions,count\n0x100000,0,2,9223372036854775808\n",
    )
    .unwrap();
    let kernel = dir.join("ud2.elf");
    std::fs::write(&kernel, tiny_elf(&[0x0f, 0x0b])).unwrap();
    let o = kpin(
        &[
            "run",
            "--kernel",
            kernel.to_str().unwrap(),
            "--mem",
            "64",
            "--tool",
            "null",
        ],
        &dir,
    );
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert!(!dir.join("bbcount-report.txt").exists());
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("run.json")).unwrap()).unwrap();
    assert!(summary["bbcount"].is_null(), "{summary}");
}

#[test]
fn test_timeout_exits_4() {
    require_kvm!();
    let dir = scratch_dir("cli-timeout");
    let kernel = dir.join("spin.elf");
    std::fs::write(&kernel, tiny_elf(&[0xeb, 0xfe])).unwrap();
    let o = kpin(
        &[
            "run",
            "--kernel",
            kernel.to_str().unwrap(),
            "--mem",
            "32",
            "--timeout",
            "1",
        ],
        &dir,
    );
    assert_eq!(o.status.code(), Some(4), "{}", stderr(&o));
    assert!(stderr(&o).contains("timeout expired"));
}

#[test]
fn test_bad_tool_option_is_one_line_error() {
    let dir = scratch_dir("cli-tool-option");
    let o = kpin(
        &[
            "run",
            "--guest",
            "minikernel",
            "--tool",
            "null",
            "--tool-option",
            "no-equals-sign",
        ],
        &dir,
    );
    assert_usage_error(&o, "bad --tool-option \"no-equals-sign\"");
}

#[test]
fn test_bad_cachesim_config_file_is_a_usage_error_before_boot() {
    let dir = scratch_dir("cli-cachesim-config");
    let conf = dir.join("deep.conf");
    let run = |conf_text: &str, extra: &str| {
        std::fs::write(&conf, conf_text).unwrap();
        let opt = format!("config_file={}", conf.display());
        let mut args = vec!["run", "--guest", "minikernel", "--tool", "cachesim"];
        args.extend(["--tool-option", &opt]);
        if !extra.is_empty() {
            args.extend(["--tool-option", extra]);
        }
        kpin(&args, &dir)
    };
    let o = run("num_cores 2\nL1 { core 0 size 4K assoc 4 }\n", "");
    assert_usage_error(&o, "line 1: num_cores 2: num_cores must be 1");
    let o = run(
        "I { type instruction core 0 size 32K assoc 8 parent L2 }\n\
         D { type data core 0 size 32K assoc 8 parent L2 }\n\
         L2 { size 256K assoc 8 parent L3 }\nL3 { size 6M assoc 12 }\n",
        "",
    );
    assert_usage_error(
        &o,
        "L3 (size 6291456, assoc 12, line 64): size must be a nonzero power of two",
    );
    let o = run("L1 { core 0 size 4K assoc 4 }\n", "L1D_size=8K");
    assert_usage_error(&o, "L1D_size=8K: cannot be combined with config_file");
    let o = kpin(
        &[
            "run",
            "--guest",
            "minikernel",
            "--tool",
            "cachesim",
            "--tool-option",
            "config_file=/nonexistent/x.conf",
        ],
        &dir,
    );
    assert_usage_error(
        &o,
        "config_file=/nonexistent/x.conf: cannot read /nonexistent/x.conf",
    );
}

#[test]
fn test_tool_runs_the_minikernel_to_its_poweroff() {
    require_kvm!();
    let dir = scratch_dir("cli-tool");
    let o = kpin(
        &[
            "run",
            "--guest",
            "minikernel",
            "-q",
            "--timeout",
            "60",
            "--tool",
            "null",
        ],
        &dir,
    );
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    // Instrumented, no step is skipped: the default command line is empty.
    assert!(err.contains("with 256 MiB, cmdline \"\""), "{err}");
    // Every step runs from the code cache to the mini-kernel's i8042 reset (the
    // transcript itself is checked by tests/minikernel_instrumented.rs).
    let console = std::fs::read_to_string(dir.join("console.log")).unwrap();
    assert!(console.contains("MINIKERNEL-DONE "), "{console}");
    let log = std::fs::read_to_string(dir.join("engine.log")).unwrap();
    assert!(log.contains("engine: stats: "), "{log}");
    assert!(log.contains("(poweroff or reset): passing it on"), "{log}");
    // Its CR3 writes went through the shadow MMU.
    assert!(!log.contains(" guest_cr3_writes=0 "), "{log}");

    let dir = scratch_dir("cli-tool-name");
    let o = kpin(
        &["run", "--guest", "minikernel", "-q", "--tool", "no/such"],
        &dir,
    );
    assert_usage_error(&o, "unknown tool \"no/such\"");
}

#[test]
fn test_bbcount_report_splits_user_and_kernel_and_names_known_loop_1000() {
    require_kvm!();
    let dir = scratch_dir("cli-bbcount-report");
    let o = kpin(
        &[
            "run",
            "--guest",
            "minikernel",
            "-q",
            "--timeout",
            "60",
            "--tool",
            "bbcount",
        ],
        &dir,
    );
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    let report = std::fs::read_to_string(dir.join("bbcount-report.txt")).expect("the report");
    assert!(err.contains(&report), "the report is printed too: {err}");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("run.json")).unwrap()).unwrap();
    let b = &summary["bbcount"];
    let n = |v: &serde_json::Value| v.as_u64().unwrap_or_else(|| panic!("{b}"));
    // The mini-kernel runs user programs at virtual CPL 3 (steps 10, 12, 15-18).
    let (cpl0, cpl3) = (n(&b["cpl0"]), n(&b["cpl3"]));
    assert!(cpl0 > 0 && cpl3 > 0, "{b}");
    assert_eq!(cpl0 + cpl3, n(&b["total"]), "{b}");
    // Names come from the mini-kernel's own ELF symbols (it has no System.map).
    assert!(
        b["symbols"]
            .as_str()
            .is_some_and(|s| s.starts_with("ELF symbol table of ")),
        "{b}"
    );
    let top = b["top"].as_array().expect("top");
    assert_eq!(top.len(), 20, "{b}");
    assert!(
        top.windows(2)
            .all(|w| n(&w[0]["executed"]) >= n(&w[1]["executed"])),
        "hottest first: {b}"
    );
    // known_loop_1000's body (1000 iterations) is among the hottest kernel blocks.
    let known = top
        .iter()
        .find(|t| {
            t["symbol"]
                .as_str()
                .is_some_and(|s| s.starts_with("known_loop_1000+0x"))
        })
        .unwrap_or_else(|| panic!("known_loop_1000 not among the hottest blocks:\n{report}"));
    assert_eq!(known["cpl"], 0, "{known}");
    assert!(n(&known["count"]) >= 999, "{known}");
    assert!(report.contains("  known_loop_1000+0x"), "{report}");
    assert!(report.contains("  kernel (CPL 0): "), "{report}");
    assert!(report.contains("  user   (CPL 3): "), "{report}");

    // --top picks how many blocks are listed.
    let dir = scratch_dir("cli-bbcount-report-top");
    let o = kpin(
        &[
            "run",
            "--guest",
            "minikernel",
            "-q",
            "--tool",
            "bbcount",
            "--top",
            "3",
        ],
        &dir,
    );
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let report = std::fs::read_to_string(dir.join("bbcount-report.txt")).expect("the report");
    assert!(report.contains("hottest 3 blocks "), "{report}");
}

#[test]
fn test_help_documents_exit_statuses_and_run_options() {
    let o = Command::new(env!("CARGO_BIN_EXE_kpin"))
        .arg("--help")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success());
    assert!(text.contains("Exit status"), "{text}");
    let o = Command::new(env!("CARGO_BIN_EXE_kpin"))
        .args(["run", "--help"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    for flag in [
        "--guest",
        "--kernel",
        "--initrd",
        "--append",
        "--mem",
        "--timeout",
        "--console",
        "--out",
        "--tool",
        "--top",
        "--max-output-bytes",
        "--max-open-files",
    ] {
        assert!(text.contains(flag), "run --help lacks {flag}");
    }
}

#[test]
fn test_minikernel_runs_clean_and_its_panic_exits_3() {
    require_kvm!();
    let dir = scratch_dir("cli-minikernel");
    let o = kpin(&["run", "--guest", "minikernel", "-q"], &dir);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let console = std::fs::read_to_string(dir.join("console.log")).unwrap();
    assert!(console.contains("MINIKERNEL-DONE "), "{console}");

    let dir = scratch_dir("cli-minikernel-panic");
    let o = kpin(
        &[
            "run",
            "--guest",
            "minikernel",
            "-q",
            "--append",
            "minikernel.crash=null-deref",
        ],
        &dir,
    );
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("guest kernel panicked"),
        "{}",
        stderr(&o)
    );
}
