//! Issue #22's "must show": gdb inside the guest. Debian's `gdb-minimal` (pinned, run with
//! the host's copies of its libraries: `kpin_images::gdb_overlay`) debugs a static program
//! (`tests/programs/gdb_target.c`) with a script of `break`, `run`, `stepi`, `watch`,
//! `hbreak` and `continue` — software breakpoints, RFLAGS.TF single steps through ptrace,
//! a hardware watchpoint and a hardware breakpoint through the debug registers. The
//! transcript inside the fully instrumented 6.1 guest (`--tool null`) must be the one the
//! same gdb and program give natively on the host, line for line (process ids aside).

use std::path::Path;
use std::process::Command;

use kpin_tests::{kpin_bin, kpin_run, require_kvm, scratch_dir, KpinRun};
use vmm::guests::LINUX_CMDLINE;

/// The gdb script: every debugging mechanism once, ending with the program's exit.
const SCRIPT: &str = "set pagination off
set confirm off
break work
run
stepi
stepi
x/i $pc
watch counter
continue
continue
delete
hbreak finish_up
continue
info registers rip
continue
";

/// Seconds kpin may run the guest.
const BUDGET_SECONDS: &str = "300";

/// The transcript with process ids replaced (they differ between runs).
fn normalized(text: &str) -> Vec<String> {
    text.lines()
        .map(|l| {
            let mut out = String::new();
            let mut rest = l;
            while let Some(at) = rest.find("process ") {
                out.push_str(&rest[..at + "process ".len()]);
                rest = &rest[at + "process ".len()..];
                let digits = rest.chars().take_while(char::is_ascii_digit).count();
                if digits > 0 {
                    out.push('N');
                }
                rest = &rest[digits..];
            }
            out.push_str(rest);
            out
        })
        .collect()
}

/// Builds the target statically with debug information in `dir`, from a copy of its
/// source that is then removed, so that neither the host's gdb nor the guest's finds the
/// source (both print the same "No such file" lines).
fn build_target(dir: &Path) -> std::path::PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("programs/gdb_target.c");
    let copy = dir.join("gdb_target.c");
    std::fs::copy(&src, &copy).expect("copy the target's source");
    let bin = dir.join("prog");
    let out = Command::new("gcc")
        .args(["-static", "-O1", "-g", "-o"])
        .arg(&bin)
        .arg(&copy)
        .output()
        .expect("run gcc");
    assert!(
        out.status.success(),
        "gcc: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::remove_file(&copy).expect("remove the source copy");
    bin
}

#[test]
fn test_scripted_gdb_in_the_guest_gives_the_hosts_transcript() {
    require_kvm!();
    let out_dir = kpin_images::default_out_dir();
    let mut progress = |line: &str| eprintln!("images: {line}");
    let linux = kpin_images::ensure_linux(&out_dir, &mut progress).expect("Linux images");
    let gdb = kpin_images::ensure_gdb(&out_dir, &mut progress).expect("gdb-minimal");
    let dir = scratch_dir("linux-gdb-in-guest");
    let prog = build_target(&dir);
    std::fs::write(dir.join("gdb.cmd"), SCRIPT).expect("write the script");

    // The reference: the same gdb and program natively on the host.
    // (stderr into the same pipe, as in the guest, so that the lines keep their order)
    let native = Command::new("/bin/sh")
        .arg("-c")
        .arg("exec \"$0\" -nx -batch -x gdb.cmd prog 2>&1")
        .arg(&gdb)
        .current_dir(&dir)
        .env("SHELL", "/bin/sh")
        .output()
        .expect("run gdb on the host");
    let native_text = String::from_utf8_lossy(&native.stdout).into_owned();
    assert!(
        native_text.contains("Hardware watchpoint 2: counter")
            && native_text.contains("exited normally"),
        "the host's own gdb run did not go as scripted:\n{native_text}"
    );

    // The guest: the busybox initramfs with the overlay appended.
    let mut initrd = std::fs::read(&linux.initramfs).expect("read the initramfs");
    initrd.extend(kpin_images::gdb_overlay(&gdb, &prog, SCRIPT).expect("the gdb overlay"));
    let rd = dir.join("gdb.cpio");
    std::fs::write(&rd, &initrd).expect("write the initrd");
    let out = dir.join("out");
    let KpinRun {
        output: run,
        console,
        context,
        ..
    } = kpin_run(
        Command::new(kpin_bin())
            .args(["run", "--tool", "null", "--quiet", "--mem", "512"])
            .arg("--kernel")
            .arg(&linux.vmlinux)
            .arg("--initrd")
            .arg(&rd)
            .args(["--cmdline", LINUX_CMDLINE, "--timeout", BUDGET_SECONDS])
            .arg("--out")
            .arg(&out),
        &out,
    );
    assert_eq!(run.status.code(), Some(0), "{context}");
    let begin = console
        .find(kpin_images::GDB_BEGIN)
        .unwrap_or_else(|| panic!("no {} on the console\n{context}", kpin_images::GDB_BEGIN));
    let after = &console[begin + kpin_images::GDB_BEGIN.len()..];
    let end = after
        .find(kpin_images::GDB_END)
        .unwrap_or_else(|| panic!("no {} on the console\n{context}", kpin_images::GDB_END));
    // Kernel messages interleaved on the console start with a timestamp (`[    3.61] `).
    let kernel_message = |l: &str| {
        l.strip_prefix('[')
            .and_then(|r| r.split_once(']'))
            .is_some_and(|(t, _)| {
                !t.trim().is_empty() && t.trim().chars().all(|c| c.is_ascii_digit() || c == '.')
            })
    };
    let guest_text: String = after[..end]
        .lines()
        .filter(|l| !kernel_message(l))
        .map(|l| format!("{}\n", l.trim_end_matches('\r')))
        .collect();
    let status = after[end + kpin_images::GDB_END.len()..]
        .split_whitespace()
        .next()
        .unwrap_or("?");
    assert_eq!(
        status,
        native.status.code().unwrap_or(-1).to_string(),
        "{context}"
    );
    let (want, got) = (
        normalized(&native_text),
        normalized(guest_text.trim_start()),
    );
    assert_eq!(
        got, want,
        "the guest's gdb transcript differs from the host's\nhost:\n{native_text}\nguest:\n{guest_text}"
    );
    eprintln!(
        "gdb transcript: {} lines, identical on host and guest",
        want.len()
    );
}
