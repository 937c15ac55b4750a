//! Helpers shared by kpin's integration tests.
//!
//! Tests that need `/dev/kvm` start with [`require_kvm!`]: when it is absent they print a
//! visible `SKIPPED: no /dev/kvm (<test>)` line and return, so a run without KVM says what
//! it did not test instead of passing silently; with `KPIN_REQUIRE_KVM=1` (set by
//! `.ci/run`) they fail instead.

use std::path::{Path, PathBuf};

pub mod attach;
pub mod guest_asm;

use host_daemon::{Daemon, DaemonStats};
use vmm::{RunReport, Vm, VmConfig};

/// The environment variable that turns a missing `/dev/kvm` from a skip into a failure
/// (`.ci/run` sets it: CI must not pass by testing nothing).
pub const REQUIRE_KVM_ENV: &str = "KPIN_REQUIRE_KVM";

/// Whether `/dev/kvm` can be opened; prints `SKIPPED: no /dev/kvm (<test>)` if not, or
/// panics if [`REQUIRE_KVM_ENV`] is `1`.
pub fn kvm_available(test: &str) -> bool {
    match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
    {
        Ok(_) => true,
        Err(e) => {
            assert!(
                std::env::var(REQUIRE_KVM_ENV).as_deref() != Ok("1"),
                "no /dev/kvm ({test}): {e}; {REQUIRE_KVM_ENV}=1 makes that a failure"
            );
            println!("SKIPPED: no /dev/kvm ({test}): {e}");
            eprintln!("SKIPPED: no /dev/kvm ({test}): {e}");
            false
        }
    }
}

/// Returns from the enclosing test when `/dev/kvm` cannot be opened, after printing
/// `SKIPPED: no /dev/kvm (<test>)` with the enclosing function's name.
#[macro_export]
macro_rules! require_kvm {
    () => {
        if !$crate::kvm_available($crate::enclosing_fn_name({
            fn f() {}
            ::std::any::type_name_of_val(&f)
        })) {
            return;
        }
    };
}

/// The enclosing function's name from the type name of a function item declared in it
/// (`crate::module::test_name::f`): `test_name`. For [`require_kvm!`].
pub fn enclosing_fn_name(inner_fn_type_name: &'static str) -> &'static str {
    let path = inner_fn_type_name
        .strip_suffix("::f")
        .unwrap_or(inner_fn_type_name);
    path.rsplit("::").next().unwrap_or(path)
}

/// Boots `cfg` and runs it to the end, serving its I/O ring into `out`.
pub fn run_guest(cfg: &VmConfig, out: &Path) -> (RunReport, DaemonStats) {
    let mut daemon = Daemon::new(out);
    let report = Vm::new(cfg)
        .expect("create VM")
        .run(&mut daemon)
        .expect("run VM");
    (report, daemon.finish().expect("finish output files"))
}

/// Runs the tiny guest `code` (see [`tiny_elf`]) natively (`tool` = None) or under the
/// engine with `tool`; returns the report, the console, `engine.log` (empty if none) and
/// the run's output directory.
pub fn run_tiny_guest(
    name: &str,
    code: &[u8],
    tool: Option<&str>,
) -> (RunReport, String, String, PathBuf) {
    let dir = scratch_dir(name);
    let kernel = dir.join("guest.elf");
    std::fs::write(&kernel, tiny_elf(code)).expect("write the tiny guest");
    let console = dir.join("console.txt");
    let engine = tool.map(|t| engine_config(t, ""));
    let cfg = VmConfig {
        mem_mib: 64,
        timeout: Some(std::time::Duration::from_secs(60)),
        console_file: Some(console.clone()),
        engine,
        ..VmConfig::new(kernel)
    };
    let (report, _) = run_guest(&cfg, &dir);
    let text = std::fs::read_to_string(&console).unwrap_or_default();
    let log = std::fs::read_to_string(dir.join(host_daemon::ENGINE_LOG)).unwrap_or_default();
    (report, text, log, dir)
}

/// The engine under `tool` with tool options `options` (the engine image built if
/// needed).
pub fn engine_config(tool: &str, options: &str) -> vmm::EngineConfig {
    vmm::EngineConfig {
        image: kpin_images::ensure_engine(&kpin_images::default_out_dir(), &mut |l| {
            eprintln!("images: {l}")
        })
        .expect("build the engine image"),
        tool: tool.into(),
        options: options.into(),
        host_sim: true,
        kernel_types: vmm::diag::kernel_types::Pending::ready(
            kpin_abi::attach::KernelTypes::UNKNOWN,
        ),
    }
}

/// The mini-kernel's ELF (built if needed).
pub fn minikernel_elf() -> PathBuf {
    kpin_images::ensure_minikernel(&kpin_images::default_out_dir(), &mut |l| {
        eprintln!("images: {l}")
    })
    .expect("build the mini-kernel")
}

/// The mini-kernel's expected transcript, `guests/minikernel/expected.txt`, for this host.
///
/// What the guest's CPUID reports depends on the host (the vendor and the highest basic
/// leaf are the host's, through KVM), so `expected.txt` names them `{vendor}` and
/// `{max_basic_leaf}`; they are taken from the CPUID table the VMM gives the guest on this
/// host, and `{checksum}` becomes the FNV-1a of the resulting transcript. A host without
/// `/dev/kvm` runs no mini-kernel test, so this needs KVM.
pub fn minikernel_expected() -> String {
    let template = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/guests/minikernel/expected.txt"
    ))
    .expect("expected.txt");
    let kvm = kvm_ioctls::Kvm::new().expect("open /dev/kvm");
    let cpuid = vmm::cpuid::guest_cpuid(&kvm).expect("the guest CPUID table");
    let leaf0 = cpuid
        .as_slice()
        .iter()
        .find(|e| e.function == 0)
        .expect("CPUID leaf 0");
    expected_for_cpu(&template, leaf0.eax, [leaf0.ebx, leaf0.edx, leaf0.ecx])
}

/// Fills the host-dependent fields of the transcript template: the vendor string (CPUID
/// leaf 0's EBX, EDX, ECX), the highest basic leaf (its EAX), and the checksum.
pub fn expected_for_cpu(template: &str, max_basic_leaf: u32, vendor: [u32; 3]) -> String {
    let vendor: Vec<u8> = vendor.iter().flat_map(|r| r.to_le_bytes()).collect();
    let text = template
        .replace("{vendor}", &String::from_utf8_lossy(&vendor))
        .replace("{max_basic_leaf}", &format!("{max_basic_leaf:#x}"));
    let start = text
        .find(&format!("{MINIKERNEL_START}\n"))
        .expect("START line")
        + MINIKERNEL_START.len()
        + 1;
    let done = text.find(MINIKERNEL_DONE).expect("DONE line");
    let sum = fnv1a64(&text.as_bytes()[start..done]);
    text.replace("{checksum}", &format!("{sum:016x}"))
}

/// Boots the mini-kernel (256 MiB) with `cmdline`, natively (`tool` = None) or under the
/// engine with `tool`, for at most `timeout`; returns the report, the console,
/// `engine.log` (empty if none) and the run's output directory.
pub fn run_minikernel(
    name: &str,
    cmdline: &str,
    tool: Option<&str>,
    timeout: std::time::Duration,
) -> (RunReport, String, String, PathBuf) {
    run_minikernel_with_options(name, cmdline, tool.map(|t| (t, "")), timeout)
}

/// [`run_minikernel`] with the tool's `--tool-option` words: `tool` is (name, options).
pub fn run_minikernel_with_options(
    name: &str,
    cmdline: &str,
    tool: Option<(&str, &str)>,
    timeout: std::time::Duration,
) -> (RunReport, String, String, PathBuf) {
    let engine = tool.map(|(t, options)| engine_config(t, options));
    run_minikernel_with_engine(name, cmdline, engine, timeout)
}

/// [`run_minikernel`] under `engine` as given (natively if `None`).
pub fn run_minikernel_with_engine(
    name: &str,
    cmdline: &str,
    engine: Option<vmm::EngineConfig>,
    timeout: std::time::Duration,
) -> (RunReport, String, String, PathBuf) {
    let dir = scratch_dir(name);
    let console = dir.join("console.log");
    let cfg = VmConfig {
        cmdline: cmdline.into(),
        timeout: Some(timeout),
        console_file: Some(console.clone()),
        engine,
        ..VmConfig::new(minikernel_elf())
    };
    let (report, _) = run_guest(&cfg, &dir);
    let text = std::fs::read_to_string(&console).unwrap_or_default();
    let log = std::fs::read_to_string(dir.join(host_daemon::ENGINE_LOG)).unwrap_or_default();
    (report, text, log, dir)
}

/// Console text that means a Linux guest noticed something (issue #5): kernel warnings
/// and bugs, stalls and lockups, an unstable clocksource, MSR accesses the kernel
/// recovered from, or a warning from the initramfs' own checks.
pub const FORBIDDEN_CONSOLE: &[&str] = &[
    "WARNING:",
    "BUG:",
    "Oops",
    "Call Trace",
    "rcu_sched self-detected stall",
    "rcu: INFO:",
    "detected stalls",
    "soft lockup",
    "hard LOCKUP",
    "clocksource",
    "unchecked MSR access",
    "KPIN-INIT-WARNING",
];

/// A run's `counters.json` (the engine's counters).
pub fn engine_counters(dir: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(dir.join("counters.json")).expect("counters.json");
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("counters.json: {e}\n{text}"))
}

/// The number at JSON pointer `path` in `v` (e.g. `/guest_instructions/cpl0`); panics
/// naming the path when it is absent.
pub fn json_u64(v: &serde_json::Value, path: &str) -> u64 {
    v.pointer(path)
        .and_then(serde_json::Value::as_u64)
        .unwrap_or_else(|| panic!("no {path} in {v}"))
}

/// Hardware-vulnerability advisories a kernel prints from the CPU model alone, each with
/// why: a native KVM guest given the same CPUID table prints them too, so they say nothing
/// about the engine (issue #10 allows exactly these). An advisory with a host condition is
/// allowed only on a host whose own kernel reports the same state in
/// `/sys/devices/system/cpu/vulnerabilities/` (the guest's CPUID comes from the host's KVM,
/// so the guest inherits what the host lacks).
pub const HARDWARE_ADVISORIES: &[Advisory] = &[
    Advisory {
        line: "RETBleed: WARNING: Spectre v2 mitigation leaves CPU vulnerable to RETBleed attacks, data leaks possible!",
        why: "on an Intel host affected by RETBleed the default mitigations pick retpolines \
              without IBRS from the CPUID and ARCH_CAPABILITIES bits alone (seen on this \
              project's Intel machine with the default mitigations)",
        host: None,
    },
    Advisory {
        line: "Speculative Return Stack Overflow: WARNING: See https://kernel.org/doc/html/latest/admin-guide/hw-vuln/srso.html",
        why: "on an AMD host (seen on a Zen 5, family 0x1a, under nested KVM) whose CPUID \
              lacks IBPB_BRTYPE (0x80000021 EAX bit 28) the kernel finds SRSO with no \
              microcode fix (`IBPB-extending microcode not applied!`) and prints this notice; \
              the host's own kernel says `Vulnerable: Safe RET, no microcode`",
        host: Some(("spec_rstack_overflow", "no microcode")),
    },
];

/// A console line [`noticed_the_engine`] lets through, and why.
#[derive(Debug)]
pub struct Advisory {
    /// Text the console line contains.
    pub line: &'static str,
    /// Why the CPU model alone makes a kernel print it.
    pub why: &'static str,
    /// `(file, text)`: allowed only when the host's
    /// `/sys/devices/system/cpu/vulnerabilities/<file>` contains `text`.
    pub host: Option<(&'static str, &'static str)>,
}

impl Advisory {
    /// Whether this host can explain the advisory (always, for one without a condition).
    pub fn applies_here(&self) -> bool {
        self.host.is_none_or(|(file, text)| {
            std::fs::read_to_string(format!("/sys/devices/system/cpu/vulnerabilities/{file}"))
                .is_ok_and(|state| state.contains(text))
        })
    }
}

/// The first console line with text from [`FORBIDDEN_CONSOLE`] (a `clocksource` line only
/// when it calls one unstable) that is not one of the [`HARDWARE_ADVISORIES`] this host
/// explains, or `None` for a clean console.
pub fn noticed_the_engine(console: &str) -> Option<&str> {
    console.lines().find(|l| {
        FORBIDDEN_CONSOLE
            .iter()
            .any(|bad| l.contains(bad) && (*bad != "clocksource" || l.contains("unstable")))
            && !HARDWARE_ADVISORIES
                .iter()
                .any(|a| l.contains(a.line) && a.applies_here())
    })
}

/// Load address of the tiny test guests.
pub const TINY_LOAD_ADDR: u64 = 0x10_0000;

/// Wraps `code` in a minimal ELF64 executable with one PT_LOAD segment at
/// [`TINY_LOAD_ADDR`] (p_paddr = p_vaddr), entered at its first byte.
pub fn tiny_elf(code: &[u8]) -> Vec<u8> {
    const EHDR: usize = 64;
    const PHDR: usize = 56;
    let mut e = Vec::new();
    e.extend_from_slice(b"\x7fELF\x02\x01\x01\x00");
    e.extend_from_slice(&[0; 8]);
    e.extend_from_slice(&2u16.to_le_bytes()); // ET_EXEC
    e.extend_from_slice(&0x3eu16.to_le_bytes()); // EM_X86_64
    e.extend_from_slice(&1u32.to_le_bytes());
    e.extend_from_slice(&TINY_LOAD_ADDR.to_le_bytes()); // e_entry
    e.extend_from_slice(&(EHDR as u64).to_le_bytes()); // e_phoff
    e.extend_from_slice(&0u64.to_le_bytes()); // e_shoff
    e.extend_from_slice(&0u32.to_le_bytes()); // e_flags
    e.extend_from_slice(&(EHDR as u16).to_le_bytes());
    e.extend_from_slice(&(PHDR as u16).to_le_bytes());
    e.extend_from_slice(&1u16.to_le_bytes()); // e_phnum
    e.extend_from_slice(&[0; 6]); // shentsize, shnum, shstrndx
    assert_eq!(e.len(), EHDR);
    let off = (EHDR + PHDR) as u64;
    e.extend_from_slice(&1u32.to_le_bytes()); // PT_LOAD
    e.extend_from_slice(&7u32.to_le_bytes()); // RWX
    e.extend_from_slice(&off.to_le_bytes());
    e.extend_from_slice(&TINY_LOAD_ADDR.to_le_bytes());
    e.extend_from_slice(&TINY_LOAD_ADDR.to_le_bytes());
    e.extend_from_slice(&(code.len() as u64).to_le_bytes());
    e.extend_from_slice(&(code.len() as u64).to_le_bytes());
    e.extend_from_slice(&0x1000u64.to_le_bytes());
    e.extend_from_slice(code);
    e
}

/// A fresh scratch directory for one test.
pub fn scratch_dir(test: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kpin-test-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("create scratch dir");
    d
}

/// Path of the built `kpin` binary (cargo sets this for integration tests of packages that
/// depend on the binary's package only when it is in the same package, so it is found
/// relative to the test executable instead).
pub fn kpin_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let dir = exe
        .parent()
        .and_then(|p| p.parent())
        .expect("target/<profile>/deps");
    dir.join("kpin")
}

/// A finished `kpin run` (`kpin_run`): its output, the run's console and engine log,
/// and all of them as one text for assertion messages.
pub struct KpinRun {
    /// The process's status and streams.
    pub output: std::process::Output,
    /// `console.log`.
    pub console: String,
    /// `engine.log` (empty for a native run).
    pub engine_log: String,
    /// Status, stderr, console and engine log, for assertion messages.
    pub context: String,
}

/// Runs the `kpin` command `cmd` (its arguments given, `--out out` among them) and reads
/// what it left in `out`.
pub fn kpin_run(cmd: &mut std::process::Command, out: &Path) -> KpinRun {
    let output = cmd.output().expect("run kpin");
    let console = std::fs::read_to_string(out.join("console.log")).unwrap_or_default();
    let engine_log = std::fs::read_to_string(out.join("engine.log")).unwrap_or_default();
    let context = format!(
        "kpin: {:?}\nstderr:\n{}\nconsole:\n{console}\nengine.log:\n{engine_log}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    KpinRun {
        output,
        console,
        engine_log,
        context,
    }
}

/// Boots the default Linux guest's bzImage and initramfs under QEMU TCG (256 MiB, the
/// serial console on stdout, no reboot) with `LINUX_CMDLINE` and `append`, bounded by
/// `budget_seconds`; `None` (with a visible SKIPPED line naming `why`) without
/// `qemu-system-x86_64` (Debian's `qemu-system-x86`, which .ci/setup installs where it
/// can).
pub fn qemu_linux(append: &str, budget_seconds: &str, why: &str) -> Option<std::process::Output> {
    if std::process::Command::new("qemu-system-x86_64")
        .arg("--version")
        .output()
        .is_err()
    {
        println!("SKIPPED: qemu-system-x86_64 is not installed{why}");
        return None;
    }
    let images = kpin_images::default_out_dir();
    let linux = kpin_images::ensure_linux(&images, &mut |l| eprintln!("images: {l}"))
        .expect("fetch and build the Linux images");
    let output = std::process::Command::new("timeout")
        .arg(budget_seconds)
        .args([
            "qemu-system-x86_64",
            "-accel",
            "tcg",
            "-m",
            "256",
            "-nographic",
        ])
        .args([
            "-nodefaults",
            "-no-reboot",
            "-serial",
            "stdio",
            "-monitor",
            "none",
        ])
        .arg("-kernel")
        .arg(&linux.bzimage)
        .arg("-initrd")
        .arg(&linux.initramfs)
        .arg("-append")
        .arg(format!("{} {append}", vmm::guests::LINUX_CMDLINE))
        .output()
        .expect("run qemu-system-x86_64");
    Some(output)
}

/// First line of the mini-kernel's transcript.
pub const MINIKERNEL_START: &str = "MINIKERNEL-START";
/// Prefix of the mini-kernel's last line, followed by the checksum in hex.
pub const MINIKERNEL_DONE: &str = "MINIKERNEL-DONE ";
/// What a skipped step prints after its `step NN name:` prefix.
pub const SKIPPED_SUFFIX: &str = ": SKIPPED";

/// FNV-1a, 64-bit: the mini-kernel's transcript checksum.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The part of a console log from the line after `MINIKERNEL-START` up to (excluding) the
/// `MINIKERNEL-DONE` line, and the checksum that line states.
pub fn minikernel_body(console: &str) -> Result<(&str, u64), String> {
    let start = console
        .find(&format!("{MINIKERNEL_START}\n"))
        .ok_or("no MINIKERNEL-START line")?
        + MINIKERNEL_START.len()
        + 1;
    let done = console[start..]
        .find(MINIKERNEL_DONE)
        .ok_or("no MINIKERNEL-DONE line")?
        + start;
    let sum_text = console[done + MINIKERNEL_DONE.len()..]
        .lines()
        .next()
        .unwrap_or("")
        .trim();
    let sum = u64::from_str_radix(sum_text, 16)
        .map_err(|e| format!("bad checksum {sum_text:?} on the DONE line: {e}"))?;
    Ok((&console[start..done], sum))
}

/// The `step NN name:` key of a transcript line, if it is a step line.
fn step_key(line: &str) -> Option<&str> {
    let rest = line.strip_prefix("step ")?;
    let colon = rest.find(':')?;
    Some(&line[..5 + colon + 1])
}

/// Compares a mini-kernel console log with the expected transcript, line by line.
///
/// A step the run skipped (`step NN name: SKIPPED`) replaces every expected line of that
/// step. The DONE line's checksum must be the FNV-1a of what the run printed, and, when no
/// step was skipped, equal the expected transcript's own checksum. Returns the number of
/// skipped steps.
pub fn compare_minikernel_transcript(console: &str, expected: &str) -> Result<usize, String> {
    let (body, sum) = minikernel_body(console)?;
    let actual_sum = fnv1a64(body.as_bytes());
    if sum != actual_sum {
        return Err(format!(
            "DONE checksum {sum:x} is not the FNV-1a of the transcript ({actual_sum:x})"
        ));
    }
    let (exp_body, exp_sum) = minikernel_body(expected)?;
    let skipped: Vec<&str> = body
        .lines()
        .filter(|l| l.ends_with(SKIPPED_SUFFIX))
        .filter_map(step_key)
        .collect();
    let mut want: Vec<String> = Vec::new();
    for line in exp_body.lines() {
        match step_key(line) {
            Some(key) if skipped.contains(&key) => {
                let s = format!("{key}{}", &SKIPPED_SUFFIX[1..]);
                if want.last() != Some(&s) {
                    want.push(s);
                }
            }
            _ => want.push(line.to_string()),
        }
    }
    let got: Vec<&str> = body.lines().collect();
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        if g != w {
            return Err(format!(
                "transcript line {} differs:\n  got:      {g}\n  expected: {w}",
                i + 1
            ));
        }
    }
    if got.len() != want.len() {
        return Err(format!(
            "transcript has {} lines, expected {}",
            got.len(),
            want.len()
        ));
    }
    if skipped.is_empty() && sum != exp_sum {
        return Err(format!(
            "checksum {sum:x} differs from expected.txt's {exp_sum:x}"
        ));
    }
    Ok(skipped.len())
}

/// `cg_annotate`'s program totals for `file` (`None`, said, where it is not installed).
pub fn cg_annotate_totals(file: &std::path::Path) -> Option<Vec<u64>> {
    let Ok(out) = std::process::Command::new("cg_annotate").arg(file).output() else {
        eprintln!("SKIPPED: cg_annotate is not installed (Debian's valgrind package)");
        return None;
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "cg_annotate failed: {stderr}");
    assert!(!stderr.contains("WARNING"), "{stderr}");
    let line = stdout
        .lines()
        .find(|l| l.contains("PROGRAM TOTALS"))
        .unwrap_or_else(|| panic!("no program totals:\n{stdout}"));
    // `1,234 (100.0%) 5 (100.0%) … PROGRAM TOTALS`
    Some(
        line.split_whitespace()
            .filter(|w| w.chars().all(|c| c.is_ascii_digit() || c == ','))
            .map(|w| w.replace(',', "").parse().expect("a count"))
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn log(body: &str) -> String {
        format!(
            "boot noise\n{MINIKERNEL_START}\n{body}{MINIKERNEL_DONE}{:x}\n",
            fnv1a64(body.as_bytes())
        )
    }

    #[test]
    fn test_require_kvm_names_the_enclosing_test() {
        let name = enclosing_fn_name({
            fn f() {}
            std::any::type_name_of_val(&f)
        });
        assert_eq!(name, "test_require_kvm_names_the_enclosing_test");
        assert_eq!(enclosing_fn_name("f"), "f");
    }

    #[test]
    fn test_noticed_the_engine_finds_warnings_and_unstable_clocksources_only() {
        let clean = "[    1.0] clocksource: Switched to clocksource kvm-clock\nKPIN-USERSPACE-OK\n";
        assert_eq!(noticed_the_engine(clean), None);
        let msr = "x\n[ 2.0] unchecked MSR access error: WRMSR to 0x400\ny\n";
        assert_eq!(
            noticed_the_engine(msr),
            Some("[ 2.0] unchecked MSR access error: WRMSR to 0x400")
        );
        let unstable =
            "[ 3.0] clocksource: timekeeping watchdog: Marking clocksource 'tsc' as unstable\n";
        assert!(noticed_the_engine(unstable).is_some());
        let advisory = format!("[ 1.5] {}\n", HARDWARE_ADVISORIES[0].line);
        assert_eq!(noticed_the_engine(&advisory), None);
        let other_warning = "[ 1.6] WARNING: CPU: 0 PID: 1 at kernel/foo.c:12\n";
        assert!(noticed_the_engine(other_warning).is_some());
    }

    #[test]
    fn test_advisory_with_a_host_condition_needs_the_host_to_report_it() {
        let unexplained = Advisory {
            line: "x",
            why: "test",
            host: Some(("no-such-vulnerability-file", "anything")),
        };
        assert!(!unexplained.applies_here());
        let unconditional = Advisory {
            host: None,
            ..unexplained
        };
        assert!(unconditional.applies_here());
    }

    #[test]
    fn test_identical_transcripts_match() {
        let t = log("step 01 a: x\nstep 02 b: y\n");
        assert_eq!(compare_minikernel_transcript(&t, &t), Ok(0));
    }

    #[test]
    fn test_skipped_step_replaces_all_its_lines() {
        let exp = log("step 01 a: x\nstep 02 b: y\nstep 02 b: z\nstep 03 c: w\n");
        let got = log("step 01 a: x\nstep 02 b: SKIPPED\nstep 03 c: w\n");
        assert_eq!(compare_minikernel_transcript(&got, &exp), Ok(1));
    }

    #[test]
    fn test_expected_transcript_takes_vendor_and_leaf_from_the_cpu() {
        let template = format!(
            "{MINIKERNEL_START}\nstep 01 cpuid: vendor={{vendor}} max-basic-leaf={{max_basic_leaf}}\n{MINIKERNEL_DONE}{{checksum}}\n"
        );
        // "AuthenticAMD" in EBX, EDX, ECX order.
        let amd = expected_for_cpu(&template, 0x10, [0x6874_7541, 0x6974_6e65, 0x444d_4163]);
        let console = log("step 01 cpuid: vendor=AuthenticAMD max-basic-leaf=0x10\n");
        assert_eq!(compare_minikernel_transcript(&console, &amd), Ok(0));
        let intel = expected_for_cpu(&template, 0x1c, [0x756e_6547, 0x4965_6e69, 0x6c65_746e]);
        assert!(intel.contains("vendor=GenuineIntel max-basic-leaf=0x1c\n"));
    }

    #[test]
    fn test_mismatch_and_bad_checksum_are_reported() {
        let exp = log("step 01 a: x\n");
        let got = log("step 01 a: X\n");
        assert!(compare_minikernel_transcript(&got, &exp)
            .unwrap_err()
            .contains("line 1"));
        let forged = format!("{MINIKERNEL_START}\nstep 01 a: x\n{MINIKERNEL_DONE}1234\n");
        assert!(compare_minikernel_transcript(&forged, &exp)
            .unwrap_err()
            .contains("FNV"));
        assert!(compare_minikernel_transcript("nothing", &exp).is_err());
    }
}
