//! The default guest's busybox, built from Debian's source package with Debian's static
//! configuration, keeping its symbol table.
//!
//! Debian's `busybox-static` is stripped and its debug symbols live on a mirror
//! (debian-debug) that is not always reachable, so user-code reports could name busybox's
//! applets (most of the workload's user instructions) by offset only. This builds the same
//! program the way `debian/rules` builds its `static` flavour: the pinned
//! [`BUSYBOX_SOURCE`] (every file checked against its SHA-256, the tarballs also against the
//! `.dsc`), Debian's patches applied in `debian/patches/series` order, the configuration
//! `debian/config/pkg/static` (which must come out of `oldconfig` unchanged, as Debian's
//! build checks), `SKIP_STRIP=y` and Debian's hardening flags, minus `-g` (no DWARF: the
//! symbol table is what the reports need, and the initramfs stays small). The result is
//! `busybox_unstripped`, which must have a `.symtab` naming the applets' functions.
//!
//! Cached like every output: the stamp names the source's pins, the compiler's version line
//! and [`RECIPE_VERSION`]; a build happens only when one of them changes. It takes a few
//! minutes of `make -j<cores>` and runs in a scratch directory removed afterwards.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use crate::cache::{self, io_error};
use crate::command;
use crate::debian::remove_dir_if_present;
use crate::pins::{SourceFile, SourcePin, BUSYBOX_SOURCE};
use crate::{layout, ImagesError};

/// Bump when the build recipe below changes (flags, steps), so cached binaries are rebuilt.
const RECIPE_VERSION: u32 = 1;

/// The Debian flavour whose configuration is used (`debian/config/pkg/<flavour>`).
const FLAVOUR: &str = "static";

/// Debian bookworm's hardening flags for amd64 (`dpkg-buildflags` with `hardening=+all`),
/// without `-O2` (busybox's own `-Os` applies, as `debian/rules` arranges) and without `-g`.
const EXTRA_CFLAGS: &str =
    "-fstack-protector-strong -Wformat -Werror=format-security -Wdate-time -D_FORTIFY_SOURCE=2";
/// Debian passes its CFLAGS to the link too (`CONFIG_EXTRA_LDFLAGS='${CFLAGS} ${LDFLAGS}'`).
const EXTRA_LDFLAGS: &str = "-fstack-protector-strong -Wl,-z,relro -Wl,-z,now";

/// A function the result must name: the applet the default workload spends most in.
const EXPECTED_FUNCTION: &str = "sort_main";

/// `(program, Debian package)` the build runs.
const TOOLS: &[(&str, &str)] = &[
    ("gcc", "gcc"),
    ("make", "make"),
    ("patch", "patch"),
    ("tar", "tar"),
    ("bzip2", "bzip2"),
    ("xz", "xz-utils"),
];

/// Makes sure `out_dir/busybox-source/busybox` is busybox built from [`BUSYBOX_SOURCE`] by
/// the current recipe and compiler; returns its path.
pub(crate) fn ensure(
    out_dir: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<PathBuf, ImagesError> {
    let binary = layout::busybox(out_dir);
    let dir = binary.parent().unwrap_or(out_dir).to_path_buf();
    cache::create_dir_all(&dir)?;
    check_tools()?;
    let inputs = format!(
        "{} flavour {FLAVOUR} recipe v{RECIPE_VERSION} compiler {}",
        BUSYBOX_SOURCE.identity(),
        command::gcc_version(|command, source| ImagesError::BusyboxBuild { command, source })?
    );
    if cache::fresh_sha256(out_dir, &binary, &inputs)?.is_some() {
        return Ok(binary);
    }

    let downloads = layout::downloads_dir(out_dir);
    cache::create_dir_all(&downloads)?;
    let mut paths = Vec::new();
    for file in BUSYBOX_SOURCE.files() {
        paths.push(ensure_source_file(
            &BUSYBOX_SOURCE,
            &file,
            &downloads,
            progress,
        )?);
    }
    let dsc = fs::read_to_string(&paths[0]).map_err(io_error("read", &paths[0]))?;
    for file in [BUSYBOX_SOURCE.orig, BUSYBOX_SOURCE.debian] {
        if !dsc_lists(&dsc, &file) {
            return Err(ImagesError::BusyboxSource {
                why: format!(
                    "{} does not list {} with SHA-256 {}",
                    BUSYBOX_SOURCE.dsc.name, file.name, file.sha256
                ),
            });
        }
    }

    let scratch = dir.join("build");
    let built = build(&scratch, &paths[1], &paths[2], progress)?;
    let bytes = fs::read(&built).map_err(io_error("read", &built))?;
    if !has_function(&bytes, EXPECTED_FUNCTION) {
        return Err(ImagesError::BusyboxSource {
            why: format!(
                "{} has no symbol table naming {EXPECTED_FUNCTION}",
                built.display()
            ),
        });
    }
    // Same file system: a rename puts the whole executable in place at once.
    cache::install_file(&built, &binary)?;
    cache::record_stamp(
        out_dir,
        &binary,
        &inputs,
        &cache::sha256_hex(&bytes),
        bytes.len() as u64,
    )?;
    remove_dir_if_present(&scratch)?;
    Ok(binary)
}

/// Fails with the missing programs (and their packages) if any of [`TOOLS`] is not on `PATH`.
fn check_tools() -> Result<(), ImagesError> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let missing: Vec<&(&str, &str)> = TOOLS
        .iter()
        .filter(|(tool, _)| !std::env::split_paths(&path).any(|d| d.join(tool).is_file()))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    let names: Vec<&str> = missing.iter().map(|(tool, _)| *tool).collect();
    let packages: Vec<&str> = missing.iter().map(|(_, package)| *package).collect();
    Err(ImagesError::BusyboxTools {
        missing: names.join(", "),
        packages: packages.join(" "),
    })
}

/// Runs `cmd`, mapping a failure to [`ImagesError::BusyboxBuild`].
fn run(cmd: &mut Command) -> Result<std::process::Output, ImagesError> {
    command::run_captured(cmd).map_err(|source| ImagesError::BusyboxBuild {
        command: command::describe(cmd),
        source,
    })
}

/// Returns the path of the verified `file` of `pin` in `download_dir`, downloading it from
/// Debian's pool with apt's own downloader (`apt-helper download-file`: apt's proxy and
/// network settings apply, no `deb-src` line is needed) unless a copy with the pinned hash
/// is already there. A file with another hash is deleted.
fn ensure_source_file(
    pin: &SourcePin,
    file: &SourceFile,
    download_dir: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<PathBuf, ImagesError> {
    let path = download_dir.join(file.name);
    match cache::sha256_file(&path) {
        Ok((sha256, _)) if sha256 == file.sha256 => return Ok(path),
        Ok(_) => fs::remove_file(&path).map_err(io_error("remove", &path))?,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_error("read", &path)(e)),
    }
    let url = pin.url(file);
    progress(&format!("downloading {url}"));
    let mut cmd = Command::new("/usr/lib/apt/apt-helper");
    cmd.arg("download-file").arg(&url).arg(&path);
    command::run_captured(&mut cmd).map_err(|source| ImagesError::SourceDownload {
        url: url.clone(),
        command: command::describe(&cmd),
        source,
    })?;
    let (sha256, _) = cache::sha256_file(&path).map_err(io_error("read", &path))?;
    if sha256 != file.sha256 {
        fs::remove_file(&path).map_err(io_error("remove", &path))?;
        return Err(ImagesError::Checksum {
            package: pin.package,
            version: pin.version,
            path,
            expected: file.sha256,
            actual: sha256,
        });
    }
    Ok(path)
}

/// Whether the `.dsc` text lists `file` with its pinned SHA-256 in `Checksums-Sha256`.
fn dsc_lists(dsc: &str, file: &SourceFile) -> bool {
    dsc.lines()
        .skip_while(|l| !l.starts_with("Checksums-Sha256:"))
        .skip(1)
        .take_while(|l| l.starts_with(' '))
        .any(|l| {
            let words: Vec<&str> = l.split_whitespace().collect();
            words.first() == Some(&file.sha256) && words.last() == Some(&file.name)
        })
}

/// Unpacks, patches, configures and builds busybox in `scratch` (emptied first); returns
/// the path of the unstripped binary in it.
fn build(
    scratch: &Path,
    orig: &Path,
    debian: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<PathBuf, ImagesError> {
    remove_dir_if_present(scratch)?;
    cache::create_dir_all(scratch)?;
    progress(&format!(
        "unpacking busybox {} source into {}",
        BUSYBOX_SOURCE.version,
        scratch.display()
    ));
    let mut tar = Command::new("tar");
    tar.arg("-xjf")
        .arg(orig)
        .arg("-C")
        .arg(scratch)
        .arg("--strip-components=1");
    run(&mut tar)?;
    let mut tar = Command::new("tar");
    tar.arg("-xJf").arg(debian).arg("-C").arg(scratch);
    run(&mut tar)?;

    let series_path = scratch.join("debian/patches/series");
    let series = fs::read_to_string(&series_path).map_err(io_error("read", &series_path))?;
    let patches = series_patches(&series);
    progress(&format!(
        "applying Debian's {} patches (debian/patches/series)",
        patches.len()
    ));
    for name in patches {
        let mut patch = Command::new("patch");
        patch
            .args(["-p1", "--forward", "--batch", "--quiet", "-i"])
            .arg(Path::new("debian/patches").join(name))
            .current_dir(scratch);
        run(&mut patch)?;
    }

    let debian_config = scratch.join("debian/config/pkg").join(FLAVOUR);
    let config = scratch.join(".config");
    let wanted = fs::read(&debian_config).map_err(io_error("read", &debian_config))?;
    fs::write(&config, &wanted).map_err(io_error("write", &config))?;

    let jobs = std::thread::available_parallelism().map_or(1, |n| n.get());
    progress(&format!(
        "building busybox with Debian's {FLAVOUR} configuration (make -j{jobs}; a few minutes)"
    ));
    let started = Instant::now();
    let mut make = Command::new("make");
    make.arg(format!("-j{jobs}"))
        .arg("busybox_unstripped")
        .arg("SKIP_STRIP=y")
        .arg(format!(
            "BB_EXTRA_VERSION=Debian {}",
            BUSYBOX_SOURCE.version
        ))
        // The build directory's name stays out of the binary (`__FILE__`).
        .arg(format!(
            "CONFIG_EXTRA_CFLAGS=-ffile-prefix-map={}=. {EXTRA_CFLAGS}",
            scratch.display()
        ))
        .arg(format!("CONFIG_EXTRA_LDFLAGS={EXTRA_LDFLAGS}"))
        // No time stamp in the generated configuration, as in `debian/rules`; flags from
        // the caller's environment (cargo's jobserver, CFLAGS) stay out of the build.
        .env("KCONFIG_NOTIMESTAMP", "1")
        .env_remove("MAKEFLAGS")
        .env_remove("MFLAGS")
        .env_remove("CFLAGS")
        .env_remove("CPPFLAGS")
        .env_remove("LDFLAGS")
        .current_dir(scratch);
    run(&mut make)?;
    progress(&format!(
        "built busybox in {:.0} s",
        started.elapsed().as_secs_f64()
    ));

    // `oldconfig` must not have changed Debian's configuration (Debian's build checks the
    // same): otherwise this would be another program than Debian's.
    let got = fs::read(&config).map_err(io_error("read", &config))?;
    if got != wanted {
        return Err(ImagesError::BusyboxSource {
            why: format!(
                "the configuration changed under oldconfig: {} differs from {}",
                config.display(),
                debian_config.display()
            ),
        });
    }
    Ok(scratch.join("busybox_unstripped"))
}

/// The patch names of a quilt `series` file, in order (comments and blank lines skipped).
fn series_patches(series: &str) -> Vec<&str> {
    series
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|name| !name.starts_with('#'))
        .collect()
}

/// Whether the little-endian ELF64 file `elf` has a `.symtab` naming function `name`.
/// Anything malformed is `false`.
fn has_function(elf: &[u8], name: &str) -> bool {
    const SHT_SYMTAB: u32 = 2;
    const STT_FUNC: u8 = 2;
    const SHDR_SIZE: usize = 64;
    const SYM_SIZE: usize = 24;
    let u16_at = |b: &[u8], at: usize| {
        b.get(at..at + 2)
            .map(|s| u16::from_le_bytes([s[0], s[1]]) as usize)
    };
    let u32_at = |b: &[u8], at: usize| {
        b.get(at..at + 4)
            .and_then(|s| s.try_into().ok())
            .map(u32::from_le_bytes)
    };
    let u64_at = |b: &[u8], at: usize| {
        b.get(at..at + 8)
            .and_then(|s| s.try_into().ok())
            .map(u64::from_le_bytes)
            .and_then(|v| usize::try_from(v).ok())
    };
    if elf.get(..6) != Some(b"\x7fELF\x02\x01".as_slice()) {
        return false;
    }
    let (Some(shoff), Some(shnum)) = (u64_at(elf, 0x28), u16_at(elf, 0x3c)) else {
        return false;
    };
    let section = |i: usize| elf.get(shoff + i * SHDR_SIZE..shoff + (i + 1) * SHDR_SIZE);
    let range = |sh: &[u8]| -> Option<&[u8]> {
        let (offset, size) = (u64_at(sh, 24)?, u64_at(sh, 32)?);
        elf.get(offset..offset.checked_add(size)?)
    };
    (0..shnum).filter_map(section).any(|sh| {
        if u32_at(sh, 4) != Some(SHT_SYMTAB) {
            return false;
        }
        let strtab = u32_at(sh, 40)
            .and_then(|link| section(link as usize))
            .and_then(range);
        let (Some(symbols), Some(strtab)) = (range(sh), strtab) else {
            return false;
        };
        symbols.chunks_exact(SYM_SIZE).any(|sym| {
            let start = u32_at(sym, 0).map_or(usize::MAX, |n| n as usize);
            let found = strtab
                .get(start..)
                .and_then(|s| s.split(|&b| b == 0).next());
            sym[4] & 0xf == STT_FUNC && found == Some(name.as_bytes())
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_series_patches_skips_comments_and_blank_lines() {
        let series = "# needs work\n# a.patch\n\nb.patch\nc.diff -p1\n";
        assert_eq!(series_patches(series), ["b.patch", "c.diff"]);
    }

    #[test]
    fn test_dsc_lists_only_the_pinned_sum_of_the_file() {
        let orig = BUSYBOX_SOURCE.orig;
        let dsc = format!(
            "Format: 3.0 (quilt)\nChecksums-Sha1:\n {sha} 1 {name}\nChecksums-Sha256:\n \
             {sha} 2480624 {name}\nFiles:\n x 1 y\n",
            sha = orig.sha256,
            name = orig.name
        );
        assert!(dsc_lists(&dsc, &orig));
        assert!(!dsc_lists(&dsc, &BUSYBOX_SOURCE.debian));
        // The sum must be in the SHA-256 section, not only elsewhere.
        let sha1_only = dsc.replace("Checksums-Sha256:", "Checksums-Other:");
        assert!(!dsc_lists(&sha1_only, &orig));
    }

    #[test]
    fn test_has_function_reads_an_elf_symbol_table() {
        // This test binary is an ELF with a symbol table that names `main`.
        let exe = std::env::current_exe().expect("current exe");
        let bytes = fs::read(&exe).expect("read the test binary");
        assert!(has_function(&bytes, "main"));
        assert!(!has_function(&bytes, "kpin_no_such_function"));
        assert!(!has_function(b"not an ELF file", "main"));
        assert!(!has_function(&bytes[..0x40], "main"));
    }

    #[test]
    fn test_built_busybox_names_its_applets_functions() {
        let path = layout::busybox(&crate::default_out_dir());
        let Ok(bytes) = fs::read(&path) else {
            println!(
                "SKIPPED: {} is not built; run `kpin images` first",
                path.display()
            );
            return;
        };
        for function in [
            EXPECTED_FUNCTION,
            "awk_main",
            "md5_sha1_sum_main",
            "ash_main",
        ] {
            assert!(has_function(&bytes, function), "{function}");
        }
    }
}
