//! The initramfs' native test programs, static binaries compiled by the host's gcc from
//! C sources in `images/workloads/`:
//!
//! - `kpin-test` (`kpin-test.c`, x86-64), packed as `/bin/kpin-test`;
//! - `kpin-conform` and `kpin-conform32` (`kpin-conform.c`, `conform.h`, `conform-*.c`),
//!   the CPU-conformance corpus of issue #22, built once 64-bit and once 32-bit (`-m32`,
//!   which needs Debian's `gcc-multilib`), packed as `/bin/kpin-conform` and
//!   `/bin/kpin-conform32`; the tests also run them natively on the host
//!   ([`crate::ensure_conform_programs`]).
//!
//! Each build is cached like every other output: the stamp names every source's SHA-256,
//! the compiler's version line and the flags, so a changed source or compiler rebuilds it.
//! A static glibc binary does not depend on the host's libraries at run time, and gcc
//! writes no time stamps, so the same inputs give the same bytes (and the same initramfs).

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::cache::{self, io_error};
use crate::command;
use crate::{layout, repo_root, ImagesError};

/// A static program built from C sources kept in `images/workloads/`.
#[derive(Debug)]
pub(crate) struct Program {
    /// The binary's name: `out_dir/programs/<name>` and `/bin/<name>` in the initramfs.
    pub(crate) name: &'static str,
    /// `(file name, contents)` of its sources and headers; the `.c` files are compiled.
    pub(crate) sources: &'static [(&'static str, &'static str)],
    /// Flags after [`CFLAGS`].
    flags: &'static [&'static str],
}

/// Compiler flags of every program. `-ffp-contract=off`: every floating-point operation
/// is rounded as written (no fused multiply-add), so the host can compute the same bits.
const CFLAGS: &[&str] = &[
    "-static",
    "-O2",
    "-ffp-contract=off",
    "-Wall",
    "-Wextra",
    "-Werror",
];

/// `kpin-test`: JIT code, SIGSEGV recovery, timers, fork/exec/pipes, FPU state, the
/// isolation probe.
pub(crate) const KPIN_TEST: Program = Program {
    name: "kpin-test",
    sources: &[("kpin-test.c", include_str!("../workloads/kpin-test.c"))],
    flags: &[],
};

/// The conformance corpus' sources, shared by both builds.
const CONFORM_SOURCES: &[(&str, &str)] = &[
    ("conform.h", include_str!("../workloads/conform.h")),
    (
        "kpin-conform.c",
        include_str!("../workloads/kpin-conform.c"),
    ),
    (
        "conform-priv.c",
        include_str!("../workloads/conform-priv.c"),
    ),
    ("conform-seg.c", include_str!("../workloads/conform-seg.c")),
    (
        "conform-fault.c",
        include_str!("../workloads/conform-fault.c"),
    ),
    ("conform-io.c", include_str!("../workloads/conform-io.c")),
    (
        "conform-debug.c",
        include_str!("../workloads/conform-debug.c"),
    ),
];

/// The 64-bit corpus. `-mno-red-zone`: its inline asm pushes onto the stack, where a leaf
/// function's red zone would be.
pub(crate) const CONFORM: Program = Program {
    name: "kpin-conform",
    sources: CONFORM_SOURCES,
    flags: &["-mno-red-zone"],
};

/// The 32-bit corpus (`-m32`: IA-32 code in compatibility mode).
pub(crate) const CONFORM32: Program = Program {
    name: "kpin-conform32",
    sources: CONFORM_SOURCES,
    flags: &["-m32"],
};

/// Every program, in the order the initramfs lists them.
pub(crate) const ALL: [&Program; 3] = [&KPIN_TEST, &CONFORM, &CONFORM32];

impl Program {
    /// Whether this is a 32-bit build (its failure names `gcc-multilib`).
    fn is_32bit(&self) -> bool {
        self.flags.contains(&"-m32")
    }
}

/// Makes sure `out_dir/programs/<name>` is built from the current sources; returns its path.
pub(crate) fn ensure(
    out_dir: &Path,
    program: &Program,
    progress: &mut dyn FnMut(&str),
) -> Result<PathBuf, ImagesError> {
    let dest = layout::program(out_dir, program.name);
    let sources: Vec<String> = program
        .sources
        .iter()
        .map(|(file, text)| format!("{file} sha256:{}", cache::sha256_hex(text.as_bytes())))
        .collect();
    let inputs = format!(
        "{}: {} {} {} {}",
        program.name,
        sources.join(" "),
        command::gcc_version(|command, source| ImagesError::Programs { command, source })?,
        CFLAGS.join(" "),
        program.flags.join(" ")
    );
    if cache::fresh_sha256(out_dir, &dest, &inputs)?.is_some() {
        return Ok(dest);
    }
    let dir = dest.parent().expect("the programs path has a parent");
    cache::create_dir_all(dir)?;
    cache::remove_stale_temps(dir)?;
    // The compiled sources are the ones embedded in this crate, written to a directory of
    // their own: the stamp then describes exactly what was compiled.
    let src_dir = layout::program_sources(out_dir, program.name);
    cache::create_dir_all(&src_dir)?;
    cache::remove_stale_temps(&src_dir)?;
    let mut c_files = Vec::new();
    for (file, text) in program.sources {
        let path = src_dir.join(file);
        cache::write_atomic(&path, text.as_bytes())?;
        if file.ends_with(".c") {
            c_files.push(path);
        }
    }
    let tmp = dir.join(format!("{}.building", program.name));
    let mut cmd = Command::new("gcc");
    cmd.args(CFLAGS)
        .args(program.flags)
        .arg("-o")
        .arg(&tmp)
        .args(&c_files);
    progress(&format!(
        "building {} ({}): {}",
        program.name,
        workloads_dir().display(),
        command::describe(&cmd)
    ));
    command::run_captured(&mut cmd).map_err(|source| {
        let command = command::describe(&cmd);
        if program.is_32bit() {
            ImagesError::Programs32 { command, source }
        } else {
            ImagesError::Programs { command, source }
        }
    })?;
    std::fs::rename(&tmp, &dest).map_err(io_error("rename into place", &dest))?;
    cache::stamp_file(out_dir, &dest, &inputs)?;
    Ok(dest)
}

/// The built programs' paths, in the order of [`ALL`].
pub(crate) fn ensure_all(
    out_dir: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<[PathBuf; 3], ImagesError> {
    Ok([
        ensure(out_dir, ALL[0], progress)?,
        ensure(out_dir, ALL[1], progress)?,
        ensure(out_dir, ALL[2], progress)?,
    ])
}

/// Where the sources live in the repository (for messages and tests).
fn workloads_dir() -> PathBuf {
    repo_root().join("images").join("workloads")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::tests::ScratchDir;

    /// Whether the ELF `elf` (64- or 32-bit) has a `PT_INTERP` program header (a dynamic
    /// executable).
    fn has_interpreter(elf: &[u8]) -> bool {
        let u = |off: usize, len: usize| {
            elf[off..off + len]
                .iter()
                .rev()
                .fold(0usize, |acc, &b| (acc << 8) | usize::from(b))
        };
        let (phoff, phentsize, phnum) = if elf[4] == 2 {
            (u(0x20, 8), u(0x36, 2), u(0x38, 2))
        } else {
            (u(0x1c, 4), u(0x2a, 2), u(0x2c, 2))
        };
        (0..phnum).any(|i| u(phoff + i * phentsize, 4) == 3)
    }

    #[test]
    fn test_embedded_sources_are_the_repository_files() {
        for program in ALL {
            for (file, text) in program.sources {
                let on_disk = std::fs::read_to_string(workloads_dir().join(file))
                    .unwrap_or_else(|e| panic!("read {file}: {e}"));
                assert_eq!(&on_disk, text, "{file}");
            }
        }
    }

    #[test]
    fn test_every_conform_source_in_the_directory_is_compiled() {
        let mut on_disk: Vec<String> = std::fs::read_dir(workloads_dir())
            .expect("list images/workloads")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("conform") || n == "kpin-conform.c")
            .collect();
        on_disk.sort();
        let mut embedded: Vec<String> = CONFORM_SOURCES
            .iter()
            .map(|(f, _)| (*f).to_owned())
            .collect();
        embedded.sort();
        assert_eq!(on_disk, embedded);
    }

    #[test]
    fn test_builds_are_cached_static_and_of_the_right_class() {
        let dir = ScratchDir::new("programs");
        let mut lines = Vec::new();
        let built = match ensure_all(&dir.0, &mut |l| lines.push(l.to_owned())) {
            Ok(built) => built,
            Err(ImagesError::Programs {
                source: crate::CommandError::Spawn(_),
                ..
            }) => {
                println!("SKIPPED: gcc is not installed");
                return;
            }
            // A missing gcc-multilib fails here, loudly: .ci/setup installs it.
            Err(err) => panic!("build: {err} ({err:?})"),
        };
        assert_eq!(lines.len(), 3, "{lines:?}");
        for (path, class) in built.iter().zip([2u8, 2, 1]) {
            let bytes = std::fs::read(path).expect("read");
            assert_eq!(&bytes[..4], b"\x7fELF", "{}", path.display());
            assert_eq!(bytes[4], class, "ELF class of {}", path.display());
            let machine = u16::from_le_bytes([bytes[0x12], bytes[0x13]]);
            assert_eq!(
                machine,
                if class == 2 { 0x3e } else { 3 },
                "{}",
                path.display()
            );
            assert!(
                !has_interpreter(&bytes),
                "{} is not static: it has a PT_INTERP header",
                path.display()
            );
        }
        lines.clear();
        ensure_all(&dir.0, &mut |l| lines.push(l.to_owned())).expect("again");
        assert!(lines.is_empty(), "rebuilt: {lines:?}");
    }

    #[test]
    fn test_a_32bit_build_failure_names_gcc_multilib() {
        let err = ImagesError::Programs32 {
            command: "gcc -m32".into(),
            source: crate::CommandError::Spawn(std::io::Error::other("x")),
        };
        assert!(err.to_string().contains("gcc-multilib"), "{err}");
    }
}
