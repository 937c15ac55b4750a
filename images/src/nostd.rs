//! Building a no_std crate that lives outside the workspace (the mini-kernel guest, the
//! engine image) for `x86_64-unknown-none` and publishing its ELF in `out_dir`.
//!
//! Cargo runs with the crate's directory as working directory, so that the crate's own
//! `.cargo/config.toml` (target) and toolchain file apply, and with its own target
//! directory under `out_dir`, so that it never waits on the workspace's build lock.
//! Cargo's incremental build makes calling this on every run cheap. The environment is
//! passed through unchanged (`CARGO` selects the cargo binary when set).
//!
//! Invariant: the published ELF is replaced atomically and only with an x86-64 ELF.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::bzimage::is_x86_64_elf;
use crate::cache::{self, io_error, JobLock};
use crate::command::{self, CommandError};
use crate::ImagesError;

/// The target triple these crates are built for.
const TARGET: &str = "x86_64-unknown-none";

/// One no_std crate to build.
pub(crate) struct NoStdCrate<'a> {
    /// What it is, for messages ("the mini-kernel").
    pub what: &'static str,
    /// Its manifest.
    pub manifest: &'a Path,
    /// Its binary target.
    pub binary: &'static str,
    /// Job-lock name in `out_dir`.
    pub lock: &'static str,
    /// Cargo's target directory for it.
    pub target_dir: PathBuf,
    /// Where the ELF is published.
    pub dest: PathBuf,
}

/// Fragments of cargo/rustc output that mean the target's standard library is not installed.
const TARGET_MISSING_HINTS: &[&str] = &[
    "target may not be installed",
    "can't find crate for `core`",
    "can't find crate for `compiler_builtins`",
];

/// Builds `c` and publishes its ELF at `c.dest`.
pub(crate) fn build(
    c: &NoStdCrate<'_>,
    out_dir: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<PathBuf, ImagesError> {
    let what = c.what;
    if !c.manifest.is_file() {
        return Err(ImagesError::NoStdMissing {
            what,
            manifest: c.manifest.to_path_buf(),
        });
    }
    cache::create_dir_all(out_dir)?;
    let _lock = JobLock::acquire(out_dir, c.lock, progress)?;

    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.args(["build", "--release", "--target", TARGET, "--bin", c.binary])
        .arg("--manifest-path")
        .arg(c.manifest)
        .arg("--target-dir")
        .arg(&c.target_dir);
    if let Some(crate_dir) = c.manifest.parent() {
        cmd.current_dir(crate_dir);
    }
    progress(&format!("building {what}: {}", command::describe(&cmd)));
    command::run_captured(&mut cmd).map_err(|source| classify_build_failure(what, &cmd, source))?;

    let built = c.target_dir.join(TARGET).join("release").join(c.binary);
    let elf = fs::read(&built).map_err(io_error("read the build output", &built))?;
    if !is_x86_64_elf(&elf) {
        return Err(ImagesError::NoStdNotElf { what, path: built });
    }
    let unchanged = fs::read(&c.dest).is_ok_and(|current| current == elf);
    if !unchanged {
        cache::write_atomic(&c.dest, &elf)?;
        progress(&format!("{what} ELF written to {}", c.dest.display()));
    }
    Ok(c.dest.clone())
}

/// Turns a failed `cargo build` into the most helpful error.
fn classify_build_failure(what: &'static str, cmd: &Command, source: CommandError) -> ImagesError {
    let command = command::describe(cmd);
    let tail = source.stderr_tail();
    if TARGET_MISSING_HINTS.iter().any(|hint| tail.contains(hint)) {
        ImagesError::NoStdTargetMissing {
            what,
            command,
            source,
        }
    } else {
        ImagesError::NoStdBuild {
            what,
            command,
            source,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::tests::ScratchDir;

    fn failure(stderr: &str) -> CommandError {
        let status = Command::new("sh")
            .args(["-c", "exit 101"])
            .status()
            .expect("run sh");
        CommandError::Failed {
            status,
            stderr_tail: stderr.to_owned(),
        }
    }

    fn krate<'a>(manifest: &'a Path, out: &Path) -> NoStdCrate<'a> {
        NoStdCrate {
            what: "the test crate",
            manifest,
            binary: "minikernel",
            lock: "test",
            target_dir: out.join("test-target"),
            dest: out.join("minikernel.elf"),
        }
    }

    #[test]
    fn test_missing_target_is_recognised() {
        let cmd = Command::new("cargo");
        let err = classify_build_failure(
            "the mini-kernel",
            &cmd,
            failure("error[E0463]: can't find crate for `core`\n  = note: the `x86_64-unknown-none` target may not be installed"),
        );
        assert!(matches!(err, ImagesError::NoStdTargetMissing { .. }));
        assert!(err
            .to_string()
            .contains("rustup target add x86_64-unknown-none"));
    }

    #[test]
    fn test_other_build_failures_are_build_errors() {
        let cmd = Command::new("cargo");
        let err = classify_build_failure(
            "the engine image",
            &cmd,
            failure("error[E0308]: mismatched types"),
        );
        assert!(matches!(err, ImagesError::NoStdBuild { .. }));
        assert!(err.to_string().contains("the engine image"), "{err}");
    }

    #[test]
    fn test_missing_sources_are_reported() {
        let dir = ScratchDir::new("mk-missing");
        let manifest = dir.0.join("nope").join("Cargo.toml");
        let err = build(&krate(&manifest, &dir.0), &dir.0, &mut |_| {}).expect_err("no crate");
        assert!(matches!(err, ImagesError::NoStdMissing { .. }));
    }

    /// Builds a tiny no_std crate for the real target, as the mini-kernel would be.
    #[test]
    fn test_builds_and_installs_a_no_std_elf() {
        let dir = ScratchDir::new("mk-build");
        let src = dir.0.join("crate");
        std::fs::create_dir_all(src.join("src")).expect("mkdir");
        std::fs::write(
            src.join("Cargo.toml"),
            "[package]\nname = \"minikernel\"\nversion = \"0.0.0\"\nedition = \"2021\"\n\
             [workspace]\n[profile.release]\npanic = \"abort\"\n",
        )
        .expect("write manifest");
        std::fs::write(
            src.join("src").join("main.rs"),
            "#![no_std]\n#![no_main]\n\
             #[panic_handler]\nfn panic(_: &core::panic::PanicInfo) -> ! { loop {} }\n\
             #[no_mangle]\npub extern \"C\" fn _start() -> ! { loop {} }\n",
        )
        .expect("write main");
        let out = dir.0.join("out");
        let manifest = src.join("Cargo.toml");
        let c = krate(&manifest, &out);
        let mut lines = Vec::new();
        let result = build(&c, &out, &mut |l| lines.push(l.to_owned()));
        let elf = match result {
            Ok(elf) => elf,
            Err(ImagesError::NoStdTargetMissing { .. }) => {
                println!("SKIPPED: x86_64-unknown-none is not installed");
                return;
            }
            Err(err) => panic!("build failed: {err:?}"),
        };
        assert_eq!(elf, out.join("minikernel.elf"));
        assert!(is_x86_64_elf(&std::fs::read(&elf).expect("read elf")));
        assert!(
            lines[0].contains("--target x86_64-unknown-none"),
            "{lines:?}"
        );
        // A second build changes nothing and does not rewrite the ELF.
        lines.clear();
        build(&c, &out, &mut |l| lines.push(l.to_owned())).expect("rebuild");
        assert_eq!(lines.len(), 1, "{lines:?}");
    }
}
