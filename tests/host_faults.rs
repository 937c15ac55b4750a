//! Issue #24, faults on the host side: the real `kpin` binary whose output file system
//! fills up or turns read-only mid-run, or that is sent SIGTERM, SIGINT or SIGKILL. In
//! each case the exit status says what happened, `run.json` says the run is incomplete
//! (and why, when it could be written), and no file passes for a finished one: the tool
//! files the engine had not finished are listed, reports are not made from them, and
//! kpin's own files are whole or absent.
//!
//! The guests: the mini-kernel (`--tool memtrace` writes ~1.5 MB in a fraction of a
//! second; with `kpin.attach_cycles=1` under `--tool bbcount` it prints steps 00–06, then
//! spins until a window it waits for closes, which never happens), and a tiny guest that
//! stores to memory and writes port 0x80 in a loop, so that `--tool memtrace` writes
//! `memtrace.bin` steadily until stopped. Progress is waited for on the console and on
//! the files, with generous deadlines; nothing is asserted on wall time.
//!
//! The file-system cases mount a tmpfs (full) and an ext4 image on a loop device (made
//! read-only mid-run through ext4's `errors=remount-ro` and its `trigger_fs_error` knob:
//! `mount -o remount,ro` is refused with EBUSY while kpin holds files open for writing,
//! as a real disk error is not); they need root and skip visibly without it.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use kpin_tests::{kpin_bin, require_kvm, scratch_dir, tiny_elf};

/// How long a guest may take to show progress (images are built on first use).
const PROGRESS_DEADLINE: Duration = Duration::from_secs(300);
/// How long kpin may take to end after a fault or a signal.
const EXIT_DEADLINE: Duration = Duration::from_secs(120);
/// How often the files are looked at.
const POLL: Duration = Duration::from_millis(20);

/// The loop guest: `mov rax, 0x200000; 1: mov [rax], rax; out 0x80, al; jmp 1b`.
const STORE_LOOP: &[u8] = &[
    0x48, 0xc7, 0xc0, 0x00, 0x00, 0x20, 0x00, // mov rax, 0x200000
    0x48, 0x89, 0x00, // mov [rax], rax
    0xe6, 0x80, // out 0x80, al
    0xeb, 0xf9, // jmp back to the store
];

/// Whether the test runs as root; prints `SKIPPED: … (needs root)` if not.
fn require_root(test: &str) -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    println!("SKIPPED: {test} mounts a file system (needs root)");
    eprintln!("SKIPPED: {test} mounts a file system (needs root)");
    false
}

/// A file system mounted for one test, unmounted when dropped.
struct Mount(PathBuf);

impl Mount {
    /// Mounts with `mount <args> <dir>`; `None` (and why) if mount fails.
    fn new(args: &[&str], dir: &Path) -> Result<Self, String> {
        std::fs::create_dir_all(dir).expect("create the mount point");
        let o = Command::new("mount")
            .args(args)
            .arg(dir)
            .output()
            .map_err(|e| format!("cannot run mount: {e}"))?;
        if !o.status.success() {
            return Err(format!(
                "mount {args:?} failed: {}",
                String::from_utf8_lossy(&o.stderr).trim()
            ));
        }
        Ok(Mount(dir.to_owned()))
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let ok = Command::new("umount")
            .arg(&self.0)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            // Something still holds it (a kpin the test failed to reap): detach it lazily.
            let _ = Command::new("umount").arg("-l").arg(&self.0).status();
        }
    }
}

/// A `kpin run` in the background: stdout discarded, stderr to a file.
struct Kpin {
    child: Option<Child>,
    stderr: PathBuf,
    out: PathBuf,
}

impl Kpin {
    fn start(args: &[&str], out: &Path, scratch: &Path) -> Self {
        let bin = kpin_bin();
        assert!(
            bin.exists(),
            "{} is missing: build it with `cargo build --release -p vmm --bin kpin`",
            bin.display()
        );
        let stderr = scratch.join("kpin.stderr");
        let child = Command::new(&bin)
            .arg("run")
            .args(args)
            .args(["--quiet", "--timeout", "600", "--out"])
            .arg(out)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(File::create(&stderr).expect("create the stderr file"))
            .spawn()
            .expect("start kpin");
        Kpin {
            child: Some(child),
            stderr,
            out: out.to_owned(),
        }
    }

    fn child(&mut self) -> &mut Child {
        self.child.as_mut().expect("kpin not reaped yet")
    }

    fn pid(&mut self) -> libc::pid_t {
        libc::pid_t::try_from(self.child().id()).expect("a pid")
    }

    /// kpin's stderr so far, with the console for context.
    /// Waits for kpin to end with exit status 5 (its output could not be written), no
    /// panic and exactly one `kpin: error:` line; returns the context and that line.
    fn exit_5_with_one_error(&mut self) -> (String, String) {
        let status = self.wait_exit();
        let context = self.context();
        assert_eq!(status.code(), Some(5), "{context}");
        let stderr = std::fs::read_to_string(&self.stderr).unwrap();
        assert!(!stderr.contains("panicked"), "{context}");
        let errors = error_lines(&stderr);
        assert_eq!(errors.len(), 1, "{context}");
        let error = errors[0].to_owned();
        (context, error)
    }

    fn context(&self) -> String {
        format!(
            "stderr:\n{}\nconsole:\n{}\nfiles: {:?}",
            std::fs::read_to_string(&self.stderr).unwrap_or_default(),
            std::fs::read_to_string(self.out.join("console.log")).unwrap_or_default(),
            std::fs::read_dir(&self.out).map(|d| d
                .filter_map(Result::ok)
                .map(|e| e.file_name())
                .collect::<Vec<_>>())
        )
    }

    /// Waits until `ready()` holds; panics if kpin ends first or the deadline passes.
    fn wait_for(&mut self, what: &str, mut ready: impl FnMut(&Path) -> bool) {
        let start = Instant::now();
        loop {
            if ready(&self.out) {
                return;
            }
            if let Some(status) = self.child().try_wait().expect("poll kpin") {
                self.child = None;
                panic!("kpin ended ({status}) before {what}\n{}", self.context());
            }
            assert!(
                start.elapsed() < PROGRESS_DEADLINE,
                "no {what} after {PROGRESS_DEADLINE:?}\n{}",
                self.context()
            );
            std::thread::sleep(POLL);
        }
    }

    /// Sends `signal` to kpin.
    fn signal(&mut self, signal: libc::c_int) {
        let pid = self.pid();
        // SAFETY: kill(2) on our own child, which has not been reaped yet.
        assert_eq!(unsafe { libc::kill(pid, signal) }, 0, "kill {pid}");
    }

    /// Waits for kpin to end; panics (after killing it) past the deadline.
    fn wait_exit(&mut self) -> ExitStatus {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child().try_wait().expect("poll kpin") {
                self.child = None;
                return status;
            }
            if start.elapsed() > EXIT_DEADLINE {
                let _ = self.child().kill();
                let _ = self.child().wait();
                self.child = None;
                panic!(
                    "kpin did not end within {EXIT_DEADLINE:?}\n{}",
                    self.context()
                );
            }
            std::thread::sleep(POLL);
        }
    }
}

impl Drop for Kpin {
    fn drop(&mut self) {
        // A failed test must not leave a guest running (or a file system busy).
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The loop guest's ELF, written into `dir`.
fn store_loop_guest(dir: &Path) -> PathBuf {
    let elf = dir.join("store-loop.elf");
    std::fs::write(&elf, tiny_elf(STORE_LOOP)).expect("write the loop guest");
    elf
}

/// The size of `out/name` (0 if absent).
fn size(out: &Path, name: &str) -> u64 {
    std::fs::metadata(out.join(name)).map_or(0, |m| m.len())
}

/// `run.json`, parsed.
fn run_json(out: &Path, context: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(out.join("run.json"))
        .unwrap_or_else(|e| panic!("run.json: {e}\n{context}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("run.json is not JSON: {e}\n{text}"))
}

/// The `kpin: error:` lines of `stderr`.
fn error_lines(stderr: &str) -> Vec<&str> {
    stderr
        .lines()
        .filter(|l| l.starts_with("kpin: error:"))
        .collect()
}

/// What every faulted run must show: `run.json` says the run is not complete; the tool
/// files on disk that the engine had not finished are listed as unfinished (when the
/// final `run.json` was written); no report was made; `dump.txt` is whole if there; no
/// temporary file is left.
fn assert_nothing_claims_completeness(out: &Path, run: &serde_json::Value, context: &str) {
    assert_eq!(run["complete"], false, "{run:#}\n{context}");
    assert_ne!(run["status"], "complete", "{run:#}\n{context}");
    for report in [
        "bbcount-report.txt",
        "memtrace-summary.txt",
        "cachesim.txt",
        "insmix.txt",
    ] {
        assert!(
            !out.join(report).exists(),
            "{report} from an unfinished run\n{context}"
        );
    }
    if run["status"] == "incomplete" {
        let unfinished: Vec<&str> = run["unfinished_files"]
            .as_array()
            .unwrap_or_else(|| panic!("no unfinished_files: {run:#}"))
            .iter()
            .filter_map(serde_json::Value::as_str)
            .collect();
        for tool_file in ["memtrace.bin", "bbcount.csv"] {
            if out.join(tool_file).exists() {
                assert!(
                    unfinished.contains(&tool_file),
                    "{tool_file} is not listed as unfinished: {run:#}\n{context}"
                );
            }
        }
        assert!(
            run["incomplete_reason"]
                .as_str()
                .is_some_and(|r| !r.is_empty()),
            "{run:#}"
        );
    }
    if let Ok(dump) = std::fs::read_to_string(out.join("dump.txt")) {
        assert!(
            dump.trim_end().ends_with("==== end of dump ===="),
            "a partial dump.txt:\n{dump}"
        );
    }
    let leftovers: Vec<String> = std::fs::read_dir(out)
        .expect("read the output directory")
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(leftovers.is_empty(), "left behind: {leftovers:?}");
}

/// Starts `kpin run` of the store-loop guest under memtrace (its `memtrace.bin` grows
/// steadily) writing to `out`, and waits for its first batch of records.
fn start_store_loop_under_memtrace(dir: &Path, out: &Path) -> Kpin {
    let guest = store_loop_guest(dir);
    let mut kpin = Kpin::start(
        &[
            "--kernel",
            guest.to_str().unwrap(),
            "--mem",
            "64",
            "--tool",
            "memtrace",
        ],
        out,
        dir,
    );
    kpin.wait_for("a first batch of memtrace.bin", |out| {
        size(out, "memtrace.bin") > 0
    });
    kpin
}

#[test]
fn test_a_full_output_file_system_stops_the_run_with_status_5_and_says_so() {
    require_kvm!();
    if !require_root("test_a_full_output_file_system_stops_the_run_with_status_5_and_says_so") {
        return;
    }
    let dir = scratch_dir("host-faults-enospc");

    // Too small even for the space kpin keeps for its own last files: refused before
    // booting, with nothing written.
    let tiny = Mount::new(
        &["-t", "tmpfs", "-o", "size=32k", "tmpfs"],
        &dir.join("tiny"),
    )
    .expect("mount a tmpfs");
    let o = Command::new(kpin_bin())
        .args([
            "run",
            "--guest",
            "minikernel",
            "--tool",
            "memtrace",
            "-q",
            "--out",
        ])
        .arg(&tiny.0)
        .output()
        .expect("run kpin");
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{stderr}");
    assert_eq!(error_lines(&stderr).len(), 1, "{stderr}");
    assert!(stderr.contains("lacks 64 KiB"), "{stderr}");
    assert!(!stderr.contains("booting"), "{stderr}");
    assert!(!tiny.0.join("run.json").exists());
    drop(tiny);

    // Room for a few pages of memtrace.bin: the daemon's write fails, the run stops.
    let mnt = Mount::new(
        &["-t", "tmpfs", "-o", "size=256k", "tmpfs"],
        &dir.join("mnt"),
    )
    .expect("mount a tmpfs");
    let out = mnt.0.join("run");
    let mut kpin = Kpin::start(&["--guest", "minikernel", "--tool", "memtrace"], &out, &dir);
    let (context, error) = kpin.exit_5_with_one_error();
    assert!(
        error.starts_with("kpin: error: output file system full: cannot write "),
        "{context}"
    );
    assert!(
        error.contains("run.json says the run is incomplete"),
        "{context}"
    );
    // The space kept back let the final run.json say why.
    let run = run_json(&out, &context);
    assert_eq!(run["status"], "incomplete", "{run:#}");
    let reason = run["incomplete_reason"].as_str().unwrap_or_default();
    assert!(
        reason.starts_with(&format!("output file system full: {}", out.display())),
        "{run:#}"
    );
    assert!(size(&out, "memtrace.bin") > 0, "{context}");
    assert_nothing_claims_completeness(&out, &run, &context);
    drop(kpin);
    drop(mnt);

    // A native run writes only console.log, whose failed writes the UART drops so the
    // guest goes on: room for the first run.json and the space kept, no more. kpin finds
    // the console file short at the end.
    let mnt = Mount::new(
        &["-t", "tmpfs", "-o", "size=68k", "tmpfs"],
        &dir.join("mnt2"),
    )
    .expect("mount a tmpfs");
    let out = mnt.0.join("run");
    let mut kpin = Kpin::start(&["--guest", "minikernel"], &out, &dir);
    let (context, error) = kpin.exit_5_with_one_error();
    assert!(
        error.starts_with("kpin: error: output file system full: ")
            && error.contains("console.log holds "),
        "{context}"
    );
    let run = run_json(&out, &context);
    assert_eq!(run["status"], "incomplete", "{run:#}");
    assert_eq!(run["outcome"], "guest powered off", "{run:#}");
    assert!(
        run["incomplete_reason"]
            .as_str()
            .is_some_and(|r| r.contains("console.log holds ")),
        "{run:#}"
    );
    assert_nothing_claims_completeness(&out, &run, &context);
}

#[test]
fn test_an_output_file_system_turning_read_only_mid_run_stops_the_run_with_status_5() {
    let test = "test_an_output_file_system_turning_read_only_mid_run_stops_the_run_with_status_5";
    require_kvm!();
    if !require_root(test) {
        return;
    }
    let dir = scratch_dir("host-faults-erofs");
    let image = dir.join("ext4.img");
    File::create(&image)
        .and_then(|f| f.set_len(64 << 20))
        .expect("make a sparse image");
    let mkfs = Command::new("mkfs.ext4")
        .args(["-q", "-F"])
        .arg(&image)
        .output();
    if !mkfs.as_ref().is_ok_and(|o| o.status.success()) {
        println!("SKIPPED: {test}: mkfs.ext4 is not usable here: {mkfs:?}");
        return;
    }
    let mnt = match Mount::new(
        &["-o", "loop,errors=remount-ro", image.to_str().unwrap()],
        &dir.join("mnt"),
    ) {
        Ok(m) => m,
        Err(e) => {
            println!("SKIPPED: {test}: cannot mount an ext4 image on a loop device: {e}");
            return;
        }
    };
    let source = Command::new("findmnt")
        .args(["-n", "-o", "SOURCE"])
        .arg(&mnt.0)
        .output()
        .expect("findmnt");
    let device = String::from_utf8_lossy(&source.stdout).trim().to_owned();
    let trigger = Path::new("/sys/fs/ext4")
        .join(Path::new(&device).file_name().unwrap_or_default())
        .join("trigger_fs_error");
    if !trigger.exists() {
        println!("SKIPPED: {test}: no {} on this kernel", trigger.display());
        return;
    }

    let out = mnt.0.join("run");
    let guest = store_loop_guest(&dir);
    let mut kpin = Kpin::start(
        &[
            "--kernel",
            guest.to_str().unwrap(),
            "--mem",
            "64",
            "--tool",
            "memtrace",
        ],
        &out,
        &dir,
    );
    kpin.wait_for("64 KiB of memtrace.bin", |out| {
        size(out, "memtrace.bin") >= 64 << 10
    });
    // ext4's own reaction to a disk error: the file system becomes read-only at once,
    // whatever is open on it.
    std::fs::write(&trigger, "kpin host-faults test").expect("trigger an ext4 error");
    let (context, error) = kpin.exit_5_with_one_error();
    assert!(
        error.starts_with("kpin: error: output file system read-only: cannot write "),
        "{context}"
    );
    // Nothing can be written any more, so run.json is still the one from the start, and
    // the message says so.
    assert!(
        error.contains("run.json could not be rewritten")
            && error.contains("still says the run is running"),
        "{context}"
    );
    let run = run_json(&out, &context);
    assert_eq!(run["status"], "running", "{run:#}");
    assert_nothing_claims_completeness(&out, &run, &context);
}

#[test]
fn test_sigterm_stops_the_guest_keeps_its_files_and_exits_143() {
    require_kvm!();
    let dir = scratch_dir("host-faults-sigterm");
    let out = dir.join("out");
    let mut kpin = start_store_loop_under_memtrace(&dir, &out);
    let before = size(&out, "memtrace.bin");
    kpin.signal(libc::SIGTERM);
    let status = kpin.wait_exit();
    let context = kpin.context();
    assert_eq!(status.code(), Some(143), "{context}");
    let stderr = std::fs::read_to_string(&kpin.stderr).unwrap();
    assert!(error_lines(&stderr).is_empty(), "{context}");
    assert!(
        stderr.contains("kpin: SIGTERM: stopping the guest"),
        "{context}"
    );
    let run = run_json(&out, &context);
    assert_eq!(run["status"], "incomplete", "{run:#}");
    assert_eq!(run["outcome"], "interrupted by SIGTERM", "{run:#}");
    assert!(
        run["incomplete_reason"]
            .as_str()
            .is_some_and(|r| r.starts_with("interrupted by SIGTERM")),
        "{run:#}"
    );
    assert_eq!(run["unfinished_files"], serde_json::json!(["memtrace.bin"]));
    // What the engine had handed over was written, not dropped.
    assert!(size(&out, "memtrace.bin") >= before, "{context}");
    assert_nothing_claims_completeness(&out, &run, &context);
}

#[test]
fn test_sigint_stops_a_bbcount_run_without_a_report_and_exits_130() {
    require_kvm!();
    let dir = scratch_dir("host-faults-sigint");
    let out = dir.join("out");
    // bbcount writes bbcount.csv when the guest ends: a stopped run has none, and no
    // report may be made.
    let mut kpin = Kpin::start(
        &[
            "--guest",
            "minikernel",
            "--tool",
            "bbcount",
            "--append",
            "kpin.attach_cycles=1",
        ],
        &out,
        &dir,
    );
    kpin.wait_for("step 06 on the console", |out| {
        std::fs::read_to_string(out.join("console.log")).is_ok_and(|c| c.contains("step 06 "))
    });
    kpin.signal(libc::SIGINT);
    let status = kpin.wait_exit();
    let context = kpin.context();
    assert_eq!(status.code(), Some(130), "{context}");
    let run = run_json(&out, &context);
    assert_eq!(run["status"], "incomplete", "{run:#}");
    assert_eq!(run["outcome"], "interrupted by SIGINT", "{run:#}");
    assert_eq!(run["bbcount"], serde_json::Value::Null, "{run:#}");
    assert_nothing_claims_completeness(&out, &run, &context);
    // The console so far is all there.
    let console = std::fs::read_to_string(out.join("console.log")).unwrap();
    assert_eq!(
        run["console_bytes"].as_u64(),
        Some(console.len() as u64),
        "{run:#}"
    );
}

#[test]
fn test_sigkill_leaves_run_json_saying_the_run_is_incomplete() {
    require_kvm!();
    let dir = scratch_dir("host-faults-sigkill");
    let out = dir.join("out");
    let mut kpin = start_store_loop_under_memtrace(&dir, &out);
    kpin.signal(libc::SIGKILL);
    let status = kpin.wait_exit();
    let context = kpin.context();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(libc::SIGKILL),
        "{context}"
    );
    let run = run_json(&out, &context);
    assert_eq!(run["status"], "running", "{run:#}");
    assert_eq!(run["tool"], "memtrace", "{run:#}");
    assert!(
        run["incomplete_reason"]
            .as_str()
            .is_some_and(|r| r.contains("killed")),
        "{run:#}"
    );
    assert_nothing_claims_completeness(&out, &run, &context);
}
