//! The guest workloads' expected results, computed on the host.
//!
//! The `default` workload in `images/initramfs/init` generates [`DATA_LINES`] lines
//! `"{i} {(i * MULTIPLIER) % MODULUS}\n"` with busybox awk and prints the md5 of that file as
//! `KPIN-WORKLOAD-DONE <md5>`. [`default_workload_data`] produces the same bytes; the tests
//! at the bottom run the script's workloads under the extracted busybox (when it is cached)
//! to prove that the two stay identical.

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

/// Lower-case hex md5 of `bytes`.
fn md5_hex(bytes: &[u8]) -> String {
    hex(&Md5::digest(bytes))
}

/// The md5 (lower-case hex) that the guest's `default` workload prints after
/// `KPIN-WORKLOAD-DONE`: the md5 of the file it generates.
pub fn workload_expected_md5() -> String {
    md5_hex(&default_workload_data())
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

    /// Sources `/init` as a library under `busybox sh` and runs `commands`, with the work
    /// directory in `work` and only busybox applet links on PATH.
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
        let output = run_init_functions(&busybox, &dir.0, "run_workload default");
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert_eq!(
            stdout,
            format!("KPIN-WORKLOAD-DONE {}\n", workload_expected_md5()),
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
        assert!(host_md5.starts_with(&workload_expected_md5()), "{host_md5}");
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
