//! Building the mini-kernel guest (`tests/guests/minikernel`, a no_std crate outside the
//! workspace) for `x86_64-unknown-none` and publishing its ELF as `out_dir/minikernel.elf`.
//!
//! Cargo runs with the mini-kernel's directory as working directory, so that the crate's own
//! `.cargo/config.toml` (linker script, rustflags) and toolchain file apply, and with its own
//! target directory under `out_dir`, so that it never waits on the workspace's build lock.
//! Cargo's incremental build makes calling this on every run cheap. The environment is passed
//! through unchanged (`CARGO` selects the cargo binary when set).
//!
//! Invariant: `minikernel.elf` is replaced atomically and only with an x86-64 ELF.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::bzimage::is_x86_64_elf;
use crate::cache::{self, io_error, JobLock};
use crate::command::{self, CommandError};
use crate::{layout, repo_root, ImagesError};

/// The target triple the mini-kernel is built for.
const TARGET: &str = "x86_64-unknown-none";
/// Name of the mini-kernel's binary target.
const BINARY: &str = "minikernel";

/// Fragments of cargo/rustc output that mean the target's standard library is not installed.
const TARGET_MISSING_HINTS: &[&str] = &[
    "target may not be installed",
    "can't find crate for `core`",
    "can't find crate for `compiler_builtins`",
];

/// The mini-kernel's manifest in the repository.
pub(crate) fn manifest_path() -> PathBuf {
    repo_root()
        .join("tests")
        .join("guests")
        .join("minikernel")
        .join("Cargo.toml")
}

/// See [`crate::ensure_minikernel`].
pub(crate) fn ensure(
    out_dir: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<PathBuf, ImagesError> {
    build(&manifest_path(), out_dir, progress)
}

/// Builds the crate at `manifest` (binary [`BINARY`]) and installs its ELF in `out_dir`.
fn build(
    manifest: &Path,
    out_dir: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<PathBuf, ImagesError> {
    if !manifest.is_file() {
        return Err(ImagesError::MinikernelMissing {
            manifest: manifest.to_path_buf(),
        });
    }
    cache::create_dir_all(out_dir)?;
    let _lock = JobLock::acquire(out_dir, "minikernel", progress)?;
    let target_dir = layout::minikernel_target_dir(out_dir);

    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.args(["build", "--release", "--target", TARGET, "--bin", BINARY])
        .arg("--manifest-path")
        .arg(manifest)
        .arg("--target-dir")
        .arg(&target_dir);
    if let Some(crate_dir) = manifest.parent() {
        cmd.current_dir(crate_dir);
    }
    progress(&format!(
        "building the mini-kernel: {}",
        command::describe(&cmd)
    ));
    command::run_captured(&mut cmd).map_err(|source| classify_build_failure(&cmd, source))?;

    let built = target_dir.join(TARGET).join("release").join(BINARY);
    let elf = fs::read(&built).map_err(io_error("read the mini-kernel build output", &built))?;
    if !is_x86_64_elf(&elf) {
        return Err(ImagesError::MinikernelNotElf { path: built });
    }
    let dest = layout::minikernel_elf(out_dir);
    let unchanged = fs::read(&dest).is_ok_and(|current| current == elf);
    if !unchanged {
        cache::write_atomic(&dest, &elf)?;
        progress(&format!("mini-kernel ELF written to {}", dest.display()));
    }
    Ok(dest)
}

/// Turns a failed `cargo build` into the most helpful error.
fn classify_build_failure(cmd: &Command, source: CommandError) -> ImagesError {
    let command = command::describe(cmd);
    let tail = source.stderr_tail();
    if TARGET_MISSING_HINTS.iter().any(|hint| tail.contains(hint)) {
        ImagesError::MinikernelTargetMissing { command, source }
    } else {
        ImagesError::MinikernelBuild { command, source }
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

    #[test]
    fn test_missing_target_is_recognised() {
        let cmd = Command::new("cargo");
        let err = classify_build_failure(
            &cmd,
            failure("error[E0463]: can't find crate for `core`\n  = note: the `x86_64-unknown-none` target may not be installed"),
        );
        assert!(matches!(err, ImagesError::MinikernelTargetMissing { .. }));
        assert!(err
            .to_string()
            .contains("rustup target add x86_64-unknown-none"));
    }

    #[test]
    fn test_other_build_failures_are_build_errors() {
        let cmd = Command::new("cargo");
        let err = classify_build_failure(&cmd, failure("error[E0308]: mismatched types"));
        assert!(matches!(err, ImagesError::MinikernelBuild { .. }));
    }

    #[test]
    fn test_missing_sources_are_reported() {
        let dir = ScratchDir::new("mk-missing");
        let manifest = dir.0.join("nope").join("Cargo.toml");
        let err = build(&manifest, &dir.0, &mut |_| {}).expect_err("no crate");
        assert!(matches!(err, ImagesError::MinikernelMissing { .. }));
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
        let mut lines = Vec::new();
        let result = build(&src.join("Cargo.toml"), &out, &mut |l| {
            lines.push(l.to_owned())
        });
        let elf = match result {
            Ok(elf) => elf,
            Err(ImagesError::MinikernelTargetMissing { .. }) => {
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
        build(&src.join("Cargo.toml"), &out, &mut |l| {
            lines.push(l.to_owned())
        })
        .expect("rebuild");
        assert_eq!(lines.len(), 1, "{lines:?}");
    }

    #[test]
    fn test_manifest_path_is_in_the_repository() {
        let manifest = manifest_path();
        assert!(manifest.ends_with("tests/guests/minikernel/Cargo.toml"));
        assert!(repo_root().join("images").join("Cargo.toml").is_file());
    }
}
