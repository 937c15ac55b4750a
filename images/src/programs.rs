//! The initramfs' native test programs: `images/workloads/kpin-test.c`, compiled by the
//! host's `gcc -static` into one static x86-64 binary, packed as `/bin/kpin-test`.
//!
//! The build is cached like every other output: the stamp names the source's SHA-256, the
//! compiler's version line and the flags, so a changed source or compiler rebuilds it. A
//! static glibc binary does not depend on the host's libraries at run time, and gcc writes
//! no time stamps, so the same inputs give the same bytes (and the same initramfs).

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::cache::{self, io_error};
use crate::command;
use crate::{layout, repo_root, ImagesError};

/// The source, kept as a real file in the repository.
pub(crate) const SOURCE: &str = include_str!("../workloads/kpin-test.c");

/// Compiler flags. `-ffp-contract=off`: every floating-point operation is rounded as
/// written (no fused multiply-add), so the host can compute the same bits.
const CFLAGS: &[&str] = &[
    "-static",
    "-O2",
    "-ffp-contract=off",
    "-Wall",
    "-Wextra",
    "-Werror",
];

/// The source file in the repository (for the compiler and for messages).
fn source_path() -> PathBuf {
    repo_root()
        .join("images")
        .join("workloads")
        .join("kpin-test.c")
}

/// The compiler's version line, part of the cache stamp.
fn gcc_version() -> Result<String, ImagesError> {
    let mut cmd = Command::new("gcc");
    cmd.arg("--version");
    let out = command::run_captured(&mut cmd).map_err(|source| ImagesError::Programs {
        command: command::describe(&cmd),
        source,
    })?;
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .next()
        .unwrap_or("")
        .to_owned())
}

/// Makes sure `out_dir/programs/kpin-test` is built from the current source; returns its path.
pub(crate) fn ensure(
    out_dir: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<PathBuf, ImagesError> {
    let dest = layout::programs(out_dir);
    let inputs = format!(
        "kpin-test.c sha256:{} {} {}",
        cache::sha256_hex(SOURCE.as_bytes()),
        gcc_version()?,
        CFLAGS.join(" ")
    );
    if cache::fresh_sha256(out_dir, &dest, &inputs)?.is_some() {
        return Ok(dest);
    }
    let dir = dest.parent().expect("the programs path has a parent");
    cache::create_dir_all(dir)?;
    cache::remove_stale_temps(dir)?;
    // The compiled source is the one embedded in this crate, written next to the output:
    // the stamp then describes exactly what was compiled.
    let src = dir.join("kpin-test.c");
    cache::write_atomic(&src, SOURCE.as_bytes())?;
    let tmp = dir.join("kpin-test.building");
    let mut cmd = Command::new("gcc");
    cmd.args(CFLAGS).arg("-o").arg(&tmp).arg(&src);
    progress(&format!(
        "building the test programs ({}): {}",
        source_path().display(),
        command::describe(&cmd)
    ));
    command::run_captured(&mut cmd).map_err(|source| ImagesError::Programs {
        command: command::describe(&cmd),
        source,
    })?;
    std::fs::rename(&tmp, &dest).map_err(io_error("rename into place", &dest))?;
    cache::stamp_file(out_dir, &dest, &inputs)?;
    Ok(dest)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::tests::ScratchDir;

    /// Whether the ELF64 `elf` has a `PT_INTERP` program header (a dynamic executable).
    fn has_interpreter(elf: &[u8]) -> bool {
        let u = |off: usize, len: usize| {
            elf[off..off + len]
                .iter()
                .rev()
                .fold(0usize, |acc, &b| (acc << 8) | usize::from(b))
        };
        let (phoff, phentsize, phnum) = (u(0x20, 8), u(0x36, 2), u(0x38, 2));
        (0..phnum).any(|i| u(phoff + i * phentsize, 4) == 3)
    }

    #[test]
    fn test_embedded_source_is_the_repository_file() {
        let on_disk = std::fs::read_to_string(source_path()).expect("read kpin-test.c");
        assert_eq!(on_disk, SOURCE);
    }

    #[test]
    fn test_build_is_cached_and_static() {
        let dir = ScratchDir::new("programs");
        let mut lines = Vec::new();
        let elf = match ensure(&dir.0, &mut |l| lines.push(l.to_owned())) {
            Ok(elf) => elf,
            Err(ImagesError::Programs {
                source: crate::CommandError::Spawn(_),
                ..
            }) => {
                println!("SKIPPED: gcc is not installed");
                return;
            }
            Err(err) => panic!("build: {err} ({err:?})"),
        };
        assert_eq!(lines.len(), 1, "{lines:?}");
        let bytes = std::fs::read(&elf).expect("read");
        assert!(crate::bzimage::is_x86_64_elf(&bytes));
        assert!(
            !has_interpreter(&bytes),
            "not static: it has a PT_INTERP header"
        );
        lines.clear();
        ensure(&dir.0, &mut |l| lines.push(l.to_owned())).expect("again");
        assert!(lines.is_empty(), "rebuilt: {lines:?}");
    }
}
