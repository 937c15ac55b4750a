//! The guest workloads' expected results, computed on the host.
//!
//! The `default` workload in `images/initramfs/init` generates [`DATA_LINES`] lines
//! `"{i} {(i * MULTIPLIER) % MODULUS}\n"` with busybox awk, then runs the native test
//! programs, and prints the md5 of the data followed by the programs' lines as
//! `KPIN-WORKLOAD-DONE <md5>`. [`default_workload_data`] produces the same data; the tests
//! at the bottom run the script's workloads under the extracted busybox (when it is cached)
//! to prove that the two stay identical.
//!
//! The `programs` workload runs only the native test programs in [`PROGRAMS`]
//! (`/bin/kpin-test <name>`, see `programs.rs`) and prints the md5 of their output lines,
//! `KPIN-TEST <name> ok <checksum>`. Every checksum is computed here from the tests'
//! definitions, independently of the C source; the tests below also run the programs on the
//! host and compare.

use md5::{Digest, Md5};

use crate::cache::hex;

/// Number of lines the default workload generates.
const DATA_LINES: u64 = 20_000;
/// Multiplier of the second column.
const MULTIPLIER: u64 = 7919;
/// Modulus of the second column (prime, so values repeat with period [`MODULUS`]).
const MODULUS: u64 = 10_007;

/// The bytes of the file the default workload generates (`$WORK/data`).
pub(crate) fn default_workload_data() -> Vec<u8> {
    let mut data = Vec::new();
    for i in 1..=DATA_LINES {
        data.extend_from_slice(format!("{i} {}\n", (i * MULTIPLIER) % MODULUS).as_bytes());
    }
    data
}

/// Lower-case hex md5 of `bytes` (what the guest's `md5sum` prints after a workload).
pub fn md5_hex(bytes: &[u8]) -> String {
    hex(&Md5::digest(bytes))
}

/// The md5 (lower-case hex) that the guest's `default` workload prints after
/// `KPIN-WORKLOAD-DONE`: the md5 of the data it generates followed by the lines of the
/// native test programs ([`programs_workload_expected_md5`] hashes those alone).
pub fn workload_expected_md5() -> String {
    let mut result = default_workload_data();
    result.extend_from_slice(programs_output().as_bytes());
    md5_hex(&result)
}

/// The native test programs the `programs` workload runs, in order (`kpin-test <name>`).
pub const PROGRAMS: [&str; 5] = ["jit", "sigsegv", "timer", "forkpipe", "fpu"];

/// Accesses the isolation probe (`kpin-test probe`, the `probe` workload) makes, every one
/// of which must fault as on a real CPU: read and write at 27 named targets (engine window,
/// physmap, Linux's regions, non-canonical addresses, the top page), a jump to the 24
/// canonical ones, 3 reads through a base register 4 KiB above the target (one wrapping
/// from 0 to the top page), a read and a write in every one of the 512 PML4 slots, 6
/// accesses forging an I/O ring record, and an `in` and an `out` on 6 ports.
pub const PROBE_ACCESSES: u64 = 27 * 2 + 24 + 3 + 512 * 2 + 6 + 6 * 2;

/// The isolation probe's last line when every access faulted as expected.
pub fn probe_verdict() -> String {
    format!("KPIN-PROBE ok {PROBE_ACCESSES} accesses faulted")
}

/// FNV-1a 64 offset basis.
const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
/// FNV-1a 64 prime.
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// FNV-1a 64 of `h` extended by the eight little-endian bytes of `v`: the programs' checksum.
fn fnv(mut h: u64, v: u64) -> u64 {
    for b in v.to_le_bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(FNV_PRIME);
    }
    h
}

/// `jit`: eight rounds of 256 calls of `f(x) = x + imm(r)` for `x = r * 1000 + k`, each
/// round's code written afresh (rounds 0-3 through mprotect RW/RX, 4-7 through a memfd
/// alias); the checksum folds every result.
fn jit_checksum() -> u64 {
    let mut h = FNV_OFFSET;
    for r in 0..8u64 {
        let imm = 0x0123_4567_89ab_cdef_u64
            .wrapping_mul(r + 1)
            .wrapping_add(0x1111 * r);
        for k in 0..256 {
            h = fnv(h, (r * 1000 + k).wrapping_add(imm));
        }
    }
    h
}

/// `sigsegv`: sixteen faulting reads at `i * 4096 + i * 8` into a PROT_NONE area (their
/// offsets), sixteen fixed-up stores of `i * i + 7` (the values read back), and the number
/// of fix-ups.
fn sigsegv_checksum() -> u64 {
    let mut h = FNV_OFFSET;
    for i in 0..16u64 {
        h = fnv(h, i * 4096 + i * 8);
    }
    for i in 0..16u64 {
        h = fnv(h, i * i + 7);
    }
    fnv(h, 16)
}

/// `timer`: the busy loop ends after five SIGALRMs.
fn timer_checksum() -> u64 {
    fnv(FNV_OFFSET, 5)
}

/// `forkpipe`: eight exec'd children, child `c` reading 8192 bytes `j * 31 + c * 7 + j / 256`
/// (mod 256) from a pipe, replying with their FNV (and their count) and exiting with
/// `10 + c`.
fn forkpipe_checksum() -> u64 {
    const INPUT: u64 = 8192;
    let mut h = FNV_OFFSET;
    for c in 0..8u64 {
        let mut reply = FNV_OFFSET;
        for j in 0..INPUT {
            reply = fnv(reply, (j * 31 + c * 7 + (j >> 8)) & 0xff);
        }
        reply = fnv(reply, INPUT);
        h = fnv(h, reply);
        h = fnv(h, 10 + c);
    }
    h
}

/// `fpu`: 400 steps of an SSE double recurrence in one process and, in the other, of an SSE
/// float recurrence beside an exact x87 one (`z = (3z + i) mod 10^15`, below 2^63); every
/// operation is IEEE-rounded as written, so Rust gets the same bits.
fn fpu_checksum() -> u64 {
    const STEPS: u32 = 400;
    let mut x = 1.0f64;
    for i in 0..STEPS {
        x = (x * 1.0000001 + 0.5).sqrt() / 1.25 + f64::from(i) * 1e-3;
    }
    let mut y = 2.0f32;
    let mut z = 1u64;
    for i in 0..STEPS {
        // Exact in f32 below 2^24; the C code converts the same integer.
        let divisor = (i + 1) as f32;
        y = y * 0.999f32 + 0.25f32 / divisor;
        z = (z * 3 + u64::from(i)) % 1_000_000_000_000_000;
    }
    let b = (u64::from(y.to_bits()) << 32) ^ z;
    fnv(fnv(FNV_OFFSET, x.to_bits()), b)
}

/// The line test program `name` prints, or `None` for an unknown name.
pub(crate) fn program_expected_line(name: &str) -> Option<String> {
    let checksum = match name {
        "jit" => jit_checksum(),
        "sigsegv" => sigsegv_checksum(),
        "timer" => timer_checksum(),
        "forkpipe" => forkpipe_checksum(),
        "fpu" => fpu_checksum(),
        _ => return None,
    };
    Some(format!("KPIN-TEST {name} ok {checksum:016x}\n"))
}

/// What the `programs` workload collects: the line of each of [`PROGRAMS`], in order.
pub(crate) fn programs_output() -> String {
    PROGRAMS
        .iter()
        .map(|name| program_expected_line(name).expect("every listed program has a line"))
        .collect()
}

/// The md5 (lower-case hex) that the guest's `programs` workload prints after
/// `KPIN-WORKLOAD-DONE`: the md5 of the programs' output lines.
pub fn programs_workload_expected_md5() -> String {
    md5_hex(programs_output().as_bytes())
}

/// The md5 the `smoke` workload prints: that of `"kpin smoke\n"`.
#[cfg(test)]
fn smoke_expected_md5() -> String {
    md5_hex(b"kpin smoke\n")
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};
    use std::process::{Command, Output};

    use super::*;
    use crate::cache::tests::ScratchDir;
    use crate::initramfs::{APPLETS, INIT_SCRIPT};

    #[test]
    fn test_md5_known_vectors() {
        assert_eq!(md5_hex(b""), "d41d8cd98f00b204e9800998ecf8427e");
        assert_eq!(md5_hex(b"abc"), "900150983cd24fb0d6963f7d28e17f72");
        assert_eq!(
            md5_hex(b"The quick brown fox jumps over the lazy dog"),
            "9e107d9d372bb6826bd81d3542a419d6"
        );
    }

    #[test]
    fn test_default_data_shape() {
        let data = default_workload_data();
        let text = String::from_utf8(data).expect("ascii");
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 20_000);
        assert_eq!(lines[0], "1 7919");
        assert_eq!(lines[10_006], "10007 0");
        assert_eq!(lines[19_999], format!("20000 {}", 20_000 * 7919 % 10_007));
        assert_eq!(workload_expected_md5().len(), 32);
    }

    /// The cached busybox from a previous `ensure_linux`, or `None` (with a visible message).
    fn cached_busybox() -> Option<PathBuf> {
        let path = crate::layout::busybox(&crate::default_out_dir());
        if path.exists() {
            Some(path)
        } else {
            println!(
                "SKIPPED: {} is not cached; run `kpin images` (or ensure_linux) first",
                path.display()
            );
            None
        }
    }

    /// The test programs, built into `dir` (`None`, with a visible message, without gcc).
    fn built_programs(dir: &Path) -> Option<PathBuf> {
        match crate::programs::ensure(dir, &crate::programs::KPIN_TEST, &mut |_| {}) {
            Ok(path) => Some(path),
            Err(crate::ImagesError::Programs {
                source: crate::CommandError::Spawn(_),
                ..
            }) => {
                println!("SKIPPED: gcc is not installed");
                None
            }
            Err(err) => panic!("build the test programs: {err} ({err:?})"),
        }
    }

    /// Sources `/init` as a library under `busybox sh` and runs `commands`, with the work
    /// directory in `work`, only busybox applet links on PATH, and `work/kpin-test` as the
    /// test programs.
    fn run_init_functions(busybox: &Path, work: &Path, commands: &str) -> Output {
        let bin = work.join("bin");
        std::fs::create_dir_all(&bin).expect("mkdir");
        for applet in APPLETS {
            let _ = std::os::unix::fs::symlink(busybox, bin.join(applet));
        }
        let init = work.join("init");
        std::fs::write(&init, INIT_SCRIPT).expect("write init");
        let output = Command::new(busybox)
            .arg("sh")
            .arg("-c")
            .arg(format!(". {}; {commands}", init.display()))
            .env_clear()
            .env("PATH", &bin)
            .env("KPIN_INIT_LIBRARY", "1")
            .env("KPIN_BUSYBOX", busybox)
            .env("KPIN_WORKDIR", work.join("work"))
            .env("KPIN_TEST", work.join("kpin-test"))
            .env("KPIN_CONFORM", work.join("kpin-conform"))
            .env("KPIN_CONFORM32", work.join("kpin-conform32"))
            .env("KPIN_CMDLINE", work.join("cmdline"))
            .env("KPIN_PRINTK", work.join("printk"))
            .output()
            .expect("run busybox");
        assert!(output.status.success(), "{output:?}");
        output
    }

    #[test]
    fn test_default_workload_on_host_busybox_prints_expected_md5() {
        let Some(busybox) = cached_busybox() else {
            return;
        };
        let dir = ScratchDir::new("workload");
        let Some(kpin_test) = built_programs(&dir.0.join("out")) else {
            return;
        };
        std::fs::copy(&kpin_test, dir.0.join("kpin-test")).expect("copy kpin-test");
        let output = run_init_functions(&busybox, &dir.0, "run_workload default");
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert_eq!(
            stdout,
            format!(
                "{}KPIN-WORKLOAD-DONE {}\n",
                programs_output(),
                workload_expected_md5()
            ),
            "stderr: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        // The generated file itself, checked by the host's md5sum and byte for byte.
        let data_path = dir.0.join("work").join("data");
        let data = std::fs::read(&data_path).expect("generated data");
        assert_eq!(data, default_workload_data());
        let md5sum = Command::new("md5sum")
            .arg(&data_path)
            .output()
            .expect("md5sum");
        let host_md5 = String::from_utf8_lossy(&md5sum.stdout);
        assert!(host_md5.starts_with(&md5_hex(&data)), "{host_md5}");
        // What the md5 covers: the data, then the programs' lines.
        let result = std::fs::read(dir.0.join("work").join("result")).expect("result");
        assert_eq!(result.len(), data.len() + programs_output().len());
        assert_eq!(md5_hex(&result), workload_expected_md5());
    }

    #[test]
    fn test_checksums_fold_what_the_tests_define() {
        // Hand-checkable pieces of the definitions: the FNV-1a of one zero byte, and the
        // timer line (five ticks).
        assert_eq!(fnv(FNV_OFFSET, 0), {
            let mut h = FNV_OFFSET;
            for _ in 0..8 {
                h = h.wrapping_mul(FNV_PRIME);
            }
            h
        });
        // The constants are FNV-1a 64's: its published value for "a".
        assert_eq!(
            (FNV_OFFSET ^ 0x61).wrapping_mul(FNV_PRIME),
            0xaf63_dc4c_8601_ec8c
        );
        let lines = programs_output();
        assert_eq!(lines.lines().count(), PROGRAMS.len());
        for (line, name) in lines.lines().zip(PROGRAMS) {
            let rest = line
                .strip_prefix(&format!("KPIN-TEST {name} ok "))
                .unwrap_or_else(|| panic!("{line}"));
            assert_eq!(rest.len(), 16, "{line}");
            assert!(rest.bytes().all(|b| b.is_ascii_hexdigit()), "{line}");
        }
        assert_eq!(program_expected_line("nope"), None);
        assert_eq!(programs_workload_expected_md5(), md5_hex(lines.as_bytes()));
    }

    /// Every test program, run natively on the host, prints the line computed here.
    #[test]
    fn test_programs_on_the_host_print_the_expected_lines() {
        let dir = ScratchDir::new("programs-host");
        let Some(kpin_test) = built_programs(&dir.0) else {
            return;
        };
        for name in PROGRAMS {
            let output = Command::new(&kpin_test).arg(name).output().expect("run");
            assert!(output.status.success(), "{name}: {output:?}");
            assert_eq!(
                String::from_utf8_lossy(&output.stdout),
                program_expected_line(name).expect("listed"),
                "{name}: stderr {}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        let bad = Command::new(&kpin_test).arg("nope").output().expect("run");
        assert_eq!(bad.status.code(), Some(2));
    }

    /// The isolation probe, run on the host (dropping to uid 65534 when run as root):
    /// the host's kernel is a real one, so every access faults and the verdict is the one
    /// the guest must print.
    #[test]
    fn test_probe_on_the_host_faults_on_every_access() {
        let dir = ScratchDir::new("probe-host");
        let Some(kpin_test) = built_programs(&dir.0) else {
            return;
        };
        let output = Command::new(&kpin_test).arg("probe").output().expect("run");
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(output.status.success(), "{output:?}\n{stdout}");
        assert_eq!(
            stdout.lines().last(),
            Some(probe_verdict().as_str()),
            "{stdout}"
        );
        assert!(!stdout.contains("UNEXPECTED"), "{stdout}");
        // The `probe` workload of /init prints the same lines, then their md5.
        let Some(busybox) = cached_busybox() else {
            return;
        };
        std::fs::copy(&kpin_test, dir.0.join("kpin-test")).expect("copy kpin-test");
        let output = run_init_functions(&busybox, &dir.0, "run_workload probe");
        assert_eq!(
            String::from_utf8_lossy(&output.stdout),
            format!(
                "{stdout}KPIN-WORKLOAD-DONE {}\n",
                md5_hex(stdout.as_bytes())
            ),
            "stderr: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }

    #[test]
    fn test_programs_workload_on_host_busybox_prints_expected_md5() {
        let Some(busybox) = cached_busybox() else {
            return;
        };
        let dir = ScratchDir::new("programs-workload");
        let Some(kpin_test) = built_programs(&dir.0.join("out")) else {
            return;
        };
        std::fs::copy(&kpin_test, dir.0.join("kpin-test")).expect("copy kpin-test");
        let output = run_init_functions(&busybox, &dir.0, "run_workload programs");
        assert_eq!(
            String::from_utf8_lossy(&output.stdout),
            format!(
                "{}KPIN-WORKLOAD-DONE {}\n",
                programs_output(),
                programs_workload_expected_md5()
            ),
            "stderr: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }

    #[test]
    fn test_programs_workload_reports_a_failing_program() {
        let Some(busybox) = cached_busybox() else {
            return;
        };
        let dir = ScratchDir::new("programs-fail");
        // A stand-in that fails the second program.
        let fake = dir.0.join("kpin-test");
        std::fs::write(
            &fake,
            "#!/bin/sh\nif [ \"$1\" = sigsegv ]; then echo \"KPIN-TEST $1 FAIL x\"; exit 1; fi\n\
             echo \"KPIN-TEST $1 ok 0\"\n",
        )
        .expect("write");
        let mut perms = std::fs::metadata(&fake).expect("stat").permissions();
        std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
        std::fs::set_permissions(&fake, perms).expect("chmod");
        let output = run_init_functions(&busybox, &dir.0, "run_workload programs; true");
        assert_eq!(
            String::from_utf8_lossy(&output.stdout),
            "KPIN-TEST jit ok 0\nKPIN-TEST sigsegv FAIL x\n\
             KPIN-WORKLOAD-ERROR programs: sigsegv exited with 1\n"
        );
    }

    /// Writes an executable shell script to `path`.
    fn write_script(path: &Path, text: &str) {
        std::fs::write(path, text).expect("write");
        let mut perms = std::fs::metadata(path).expect("stat").permissions();
        std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
        std::fs::set_permissions(path, perms).expect("chmod");
    }

    /// The conform workload runs both builds as root and as 65534 with the skip patterns
    /// of kpin.conform.skip (not globbed by the shell), prints the lines, then their md5.
    #[test]
    fn test_conform_workload_runs_both_builds_as_both_users() {
        let Some(busybox) = cached_busybox() else {
            return;
        };
        let dir = ScratchDir::new("conform-workload");
        for (name, bits) in [("kpin-conform", 64), ("kpin-conform32", 32)] {
            write_script(
                &dir.0.join(name),
                &format!(
                    "#!/bin/sh
uid=0
[ \"$1\" = --uid ] && uid=$2
                     echo \"KPIN-CONFORM {bits} $uid args $*\"
"
                ),
            );
        }
        std::fs::write(
            dir.0.join("cmdline"),
            "console=ttyS0 kpin.conform.skip=tf-*,hlt kpin.conform.cases=t*,h*\n",
        )
        .expect("write cmdline");
        std::fs::write(dir.0.join("printk"), "7\t4\t1\t7\n").expect("write printk");
        let output = run_init_functions(&busybox, &dir.0, "run_workload conform");
        // The console's level comes back after the lines.
        assert_eq!(
            std::fs::read_to_string(dir.0.join("printk")).expect("printk"),
            "7\n"
        );
        let lines = "KPIN-CONFORM 64 0 args --skip tf-* --skip hlt t* h*\n\
                     KPIN-CONFORM 64 65534 args --uid 65534 --skip tf-* --skip hlt t* h*\n\
                     KPIN-CONFORM 32 0 args --skip tf-* --skip hlt t* h*\n\
                     KPIN-CONFORM 32 65534 args --uid 65534 --skip tf-* --skip hlt t* h*\n";
        assert_eq!(
            String::from_utf8_lossy(&output.stdout),
            format!("{lines}KPIN-WORKLOAD-DONE {}\n", md5_hex(lines.as_bytes())),
            "stderr: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }

    /// A build that fails as a whole (a 32-bit program the CPU cannot run) adds a
    /// `program exit` line for each run and the workload still ends with DONE.
    #[test]
    fn test_conform_workload_reports_a_failing_build() {
        let Some(busybox) = cached_busybox() else {
            return;
        };
        let dir = ScratchDir::new("conform-fail");
        write_script(
            &dir.0.join("kpin-conform"),
            "#!/bin/sh\necho \"KPIN-CONFORM 64 x\"\n",
        );
        write_script(&dir.0.join("kpin-conform32"), "#!/bin/sh\nexit 139\n");
        std::fs::write(dir.0.join("cmdline"), "console=ttyS0\n").expect("write cmdline");
        std::fs::write(dir.0.join("printk"), "4\t4\t1\t7\n").expect("write printk");
        let output = run_init_functions(&busybox, &dir.0, "run_workload conform");
        let lines = "KPIN-CONFORM 64 x\nKPIN-CONFORM 64 x\n\
                     KPIN-CONFORM 32 0 program exit 139\n\
                     KPIN-CONFORM 32 65534 program exit 139\n";
        assert_eq!(
            String::from_utf8_lossy(&output.stdout),
            format!("{lines}KPIN-WORKLOAD-DONE {}\n", md5_hex(lines.as_bytes()))
        );
    }

    #[test]
    fn test_smoke_and_unknown_workloads_on_host_busybox() {
        let Some(busybox) = cached_busybox() else {
            return;
        };
        let dir = ScratchDir::new("smoke");
        let output =
            run_init_functions(&busybox, &dir.0, "run_workload smoke; run_workload no-such");
        assert_eq!(
            String::from_utf8_lossy(&output.stdout),
            format!(
                "KPIN-WORKLOAD-DONE {}\nKPIN-WORKLOAD-ERROR unknown workload no-such\n",
                smoke_expected_md5()
            )
        );
    }

    #[test]
    fn test_every_applet_the_init_script_runs_is_linked() {
        let Some(busybox) = cached_busybox() else {
            return;
        };
        let list = Command::new(&busybox).arg("--list").output().expect("list");
        let applets = String::from_utf8_lossy(&list.stdout).into_owned();
        let applets: Vec<&str> = applets.lines().collect();
        // The binary itself, and shell builtins that are also applet names.
        let not_commands = ["busybox", "printf", "set", "test", "true", "false", "kill"];
        let mut missing = Vec::new();
        for line in INIT_SCRIPT.lines() {
            let code = line.trim_start();
            if code.starts_with('#') {
                continue;
            }
            for word in code.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
                if applets.contains(&word)
                    && !APPLETS.contains(&word)
                    && !not_commands.contains(&word)
                    && !missing.contains(&word)
                {
                    missing.push(word);
                }
            }
        }
        assert!(
            missing.is_empty(),
            "applets used by /init without a /bin link: {missing:?}"
        );
    }
}
