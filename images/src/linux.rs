//! Producing a Linux guest: a pinned kernel's files and the busybox initramfs (and the same
//! without a `System.map` for the generic 6.12 kernel that is only benchmarked).
//!
//! Steps, each skipped when its outputs are present and their stamps match (see `cache.rs`):
//! 1. `vmlinuz` and `config` from the kernel package.
//! 2. `vmlinux` from `vmlinuz`'s payload: LZ4 decoded in-process, zstd by the host's `zstd`.
//! 3. `System.map` from the `-dbg` package, which is deleted afterwards (~300 MB); the stamp
//!    of `System.map` records the verified hash of the package it came from.
//! 4. `busybox`, built from Debian's `busybox` source package with its symbol table
//!    (`busybox_build.rs`).
//! 5. the native test programs (`kpin-test`, `kpin-conform`, `kpin-conform32`), compiled
//!    with `gcc -static` (`programs.rs`).
//! 6. `initramfs.cpio`, rebuilt in memory on every call (milliseconds) and written only when
//!    its bytes differ from the file's. It is the same for every kernel.
//!
//! Invariant: every output's stamp names the identity (package, version, SHA-256) of what it
//! was made from, so a changed pin or a changed `/init` can never be served from the cache.

use std::fs;
use std::path::{Path, PathBuf};

use crate::cache::{self, io_error, JobLock};
use crate::command;
use crate::debian::{self, Member};
use crate::layout::{self, kernel_files};
use crate::pins::{DebPin, DEBIAN_6_12_GENERIC};
use crate::{
    busybox_build, bzimage, initramfs, programs, virtio_initramfs, BenchLinuxImages, GuestKernel,
    ImagesError, LinuxImages,
};

/// Version of the vmlinux extraction; bump when `bzimage.rs` changes what it produces.
const VMLINUX_EXTRACTOR_VERSION: u32 = 1;

/// See [`crate::ensure_linux_kernel`].
pub(crate) fn ensure(
    kernel: GuestKernel,
    out_dir: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<LinuxImages, ImagesError> {
    let pins = kernel.pins();
    cache::create_dir_all(out_dir)?;
    let _lock = JobLock::acquire(out_dir, "linux", progress)?;
    let kernel_dir = prepare_dirs(out_dir, pins.release)?;

    // 1. and 2.
    let files = ensure_kernel_files(
        out_dir,
        &kernel_dir,
        &pins.image,
        pins.vmlinuz_member,
        pins.config_member,
        false,
        progress,
    )?;

    // 3. System.map.
    let system_map = kernel_dir.join(kernel_files::SYSTEM_MAP);
    ensure_from_deb(
        out_dir,
        &pins.dbg,
        &[(pins.system_map_member, &system_map)],
        true,
        progress,
    )?;

    // 4. to 6.
    let initramfs = ensure_initramfs(out_dir, progress)?;

    Ok(LinuxImages {
        kernel,
        bzimage: files.bzimage,
        vmlinux: files.vmlinux,
        system_map,
        config: files.config,
        initramfs,
        kernel_version: pins.release,
    })
}

/// See [`crate::ensure_linux_virtio`]: `kernel`'s files with the virtio initramfs
/// (`virtio_initramfs.rs`) in place of the shared one.
pub(crate) fn ensure_virtio(
    kernel: GuestKernel,
    out_dir: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<LinuxImages, ImagesError> {
    let mut images = ensure(kernel, out_dir, progress)?;
    let pins = kernel.pins();
    let _lock = JobLock::acquire(out_dir, "linux", progress)?;
    let kernel_dir = layout::kernel_dir(out_dir, pins.release);
    cache::create_dir_all(&kernel_dir.join("modules"))?;
    let members: Vec<(String, PathBuf)> = virtio_initramfs::modules(kernel)
        .iter()
        .map(|m| {
            (
                virtio_initramfs::member(pins, m),
                virtio_initramfs::cached(&kernel_dir, m),
            )
        })
        .collect();
    let list: Vec<(&str, &PathBuf)> = members.iter().map(|(m, d)| (m.as_str(), d)).collect();
    ensure_from_deb(out_dir, &pins.image, &list, false, progress)?;
    let modules: Vec<(&str, PathBuf)> = virtio_initramfs::modules(kernel)
        .iter()
        .zip(&members)
        .map(|(m, (_, d))| (*m, d.clone()))
        .collect();
    let dest = kernel_dir.join(kernel_files::VIRTIO_INITRAMFS);
    virtio_initramfs::write(&dest, &images.initramfs, &modules, progress)?;
    images.initramfs = dest;
    Ok(images)
}

/// See [`crate::ensure_linux_generic_612`]: steps 1, 2 and 4 to 6, no `System.map`. The
/// kernel package (107 MB, mostly modules) is deleted once its two files are extracted and
/// stamped: this kernel is only benchmarked, and the stamps keep the cache honest.
pub(crate) fn ensure_generic_612(
    out_dir: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<BenchLinuxImages, ImagesError> {
    let pins = &DEBIAN_6_12_GENERIC;
    cache::create_dir_all(out_dir)?;
    let _lock = JobLock::acquire(out_dir, "linux", progress)?;
    let kernel_dir = prepare_dirs(out_dir, pins.release)?;
    let files = ensure_kernel_files(
        out_dir,
        &kernel_dir,
        &pins.image,
        pins.vmlinuz_member,
        pins.config_member,
        true,
        progress,
    )?;
    let initramfs = ensure_initramfs(out_dir, progress)?;
    Ok(BenchLinuxImages {
        bzimage: files.bzimage,
        vmlinux: files.vmlinux,
        config: files.config,
        initramfs,
        kernel_version: pins.release,
    })
}

/// Creates the directories a Linux guest's files go to (the kernel's, busybox's) and removes
/// stale temporary files a killed run left in them; returns the kernel's directory.
fn prepare_dirs(out_dir: &Path, release: &str) -> Result<PathBuf, ImagesError> {
    let kernel_dir = layout::kernel_dir(out_dir, release);
    let busybox_path = layout::busybox(out_dir);
    let busybox_dir = busybox_path
        .parent()
        .expect("the busybox path has a parent")
        .to_path_buf();
    for dir in [&kernel_dir, &busybox_dir] {
        cache::create_dir_all(dir)?;
    }
    for dir in [
        out_dir,
        &kernel_dir,
        &busybox_dir,
        &layout::downloads_dir(out_dir),
    ] {
        cache::remove_stale_temps(dir)?;
    }
    Ok(kernel_dir)
}

/// A kernel's files in its directory: the bzImage, the ELF from its payload, its config.
struct KernelFiles {
    bzimage: PathBuf,
    vmlinux: PathBuf,
    config: PathBuf,
}

/// Steps 1 and 2: `vmlinuz` and `config` from the kernel package `image` (deleted afterwards
/// with `delete_deb`), `vmlinux` from `vmlinuz`'s payload.
fn ensure_kernel_files(
    out_dir: &Path,
    kernel_dir: &Path,
    image: &DebPin,
    vmlinuz_member: &str,
    config_member: &str,
    delete_deb: bool,
    progress: &mut dyn FnMut(&str),
) -> Result<KernelFiles, ImagesError> {
    let files = KernelFiles {
        bzimage: kernel_dir.join(kernel_files::VMLINUZ),
        vmlinux: kernel_dir.join(kernel_files::VMLINUX),
        config: kernel_dir.join(kernel_files::CONFIG),
    };

    // 1. vmlinuz and config.
    let vmlinuz_sha = ensure_from_deb(
        out_dir,
        image,
        &[
            (vmlinuz_member, &files.bzimage),
            (config_member, &files.config),
        ],
        delete_deb,
        progress,
    )?
    .into_iter()
    .next()
    .expect("one hash per member");

    // 2. vmlinux.
    let vmlinux_inputs =
        format!("vmlinux extractor v{VMLINUX_EXTRACTOR_VERSION} from vmlinuz sha256:{vmlinuz_sha}");
    if cache::fresh_sha256(out_dir, &files.vmlinux, &vmlinux_inputs)?.is_none() {
        let bytes = fs::read(&files.bzimage).map_err(io_error("read", &files.bzimage))?;
        let elf = extract_vmlinux(out_dir, &files.bzimage, &bytes, progress)?;
        cache::write_atomic(&files.vmlinux, &elf)?;
        cache::record_stamp(
            out_dir,
            &files.vmlinux,
            &vmlinux_inputs,
            &cache::sha256_hex(&elf),
            elf.len() as u64,
        )?;
    }
    Ok(files)
}

/// Steps 4 to 6: busybox, the test programs and the initramfs (the same for every kernel);
/// returns the initramfs' path.
fn ensure_initramfs(
    out_dir: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<PathBuf, ImagesError> {
    let initramfs_path = layout::initramfs(out_dir);

    // 4. busybox, built from Debian's source with its symbol table.
    let busybox_path = busybox_build::ensure(out_dir, progress)?;

    // 5. the test programs.
    let program_paths = programs::ensure_all(out_dir, progress)?;

    // 6. initramfs.
    let busybox = fs::read(&busybox_path).map_err(io_error("read", &busybox_path))?;
    let mut binaries = Vec::with_capacity(program_paths.len());
    for path in &program_paths {
        binaries.push(fs::read(path).map_err(io_error("read", path))?);
    }
    let named: Vec<(&str, &[u8])> = programs::ALL
        .iter()
        .zip(&binaries)
        .map(|(p, bytes)| (p.name, bytes.as_slice()))
        .collect();
    let archive =
        initramfs::build(&busybox, &named).map_err(|source| ImagesError::Initramfs { source })?;
    let current = match cache::sha256_file(&initramfs_path) {
        Ok((sha256, _)) => Some(sha256),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(io_error("read", &initramfs_path)(e)),
    };
    if current.as_deref() != Some(cache::sha256_hex(&archive).as_str()) {
        progress(&format!(
            "writing {} ({} kB)",
            initramfs_path.display(),
            archive.len().div_ceil(1000)
        ));
        cache::write_atomic(&initramfs_path, &archive)?;
    }
    Ok(initramfs_path)
}

/// The kernel ELF (`vmlinux`, symbols stripped, sections such as `.BTF` kept) inside the
/// bzImage at `path`: an LZ4 payload is decoded here, a zstd payload by the host's `zstd`
/// in a scratch directory under `scratch_parent` (made and removed here; callers that may
/// run at the same time pass directories of their own). For the VMM's BTF reader.
pub fn vmlinux_from_bzimage(path: &Path, scratch_parent: &Path) -> Result<Vec<u8>, ImagesError> {
    let bytes = fs::read(path).map_err(io_error("read", path))?;
    extract_vmlinux(scratch_parent, path, &bytes, &mut |_| {})
}

/// The kernel ELF inside the bzImage `image` (read from `path`): an LZ4 payload is decoded
/// here, a zstd payload by the host's `zstd` in a scratch directory under `out_dir`.
fn extract_vmlinux(
    out_dir: &Path,
    path: &Path,
    image: &[u8],
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<u8>, ImagesError> {
    let vmlinux_error = |source| ImagesError::Vmlinux {
        path: path.to_path_buf(),
        source,
    };
    let Some(zstd) = bzimage::zstd_payload(image).map_err(vmlinux_error)? else {
        progress("extracting vmlinux from the bzImage's LZ4 payload");
        return bzimage::extract_vmlinux(image).map_err(vmlinux_error);
    };
    progress("extracting vmlinux from the bzImage's zstd payload (zstd -d)");
    let scratch = layout::zstd_scratch_dir(out_dir);
    debian::remove_dir_if_present(&scratch)?;
    cache::create_dir_all(&scratch)?;
    let frame = scratch.join("payload.zst");
    fs::write(&frame, zstd.frame).map_err(io_error("write", &frame))?;
    let mut cmd = std::process::Command::new("zstd");
    cmd.args(["-d", "-q", "-c", "--"]).arg(&frame);
    let output = command::run_captured(&mut cmd).map_err(|source| ImagesError::Zstd {
        path: path.to_path_buf(),
        command: command::describe(&cmd),
        source,
    });
    debian::remove_dir_if_present(&scratch)?;
    bzimage::check_zstd_output(&zstd, output?.stdout).map_err(vmlinux_error)
}

/// Makes sure every `(member, dest)` of `pin` is in place with a matching stamp, fetching and
/// extracting the package if any is not. With `delete_deb`, the `.deb` is removed after a
/// successful extraction. Returns the SHA-256 of each destination, in order.
fn ensure_from_deb(
    out_dir: &Path,
    pin: &DebPin,
    members: &[(&str, &PathBuf)],
    delete_deb: bool,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<String>, ImagesError> {
    let inputs = pin.identity();
    let mut hashes = Vec::with_capacity(members.len());
    for (_, dest) in members {
        match cache::fresh_sha256(out_dir, dest, &inputs)? {
            Some(sha256) => hashes.push(sha256),
            None => break,
        }
    }
    if hashes.len() == members.len() {
        return Ok(hashes);
    }

    let deb = debian::ensure_deb(pin, &layout::downloads_dir(out_dir), progress)?;
    let names: Vec<&str> = members
        .iter()
        .map(|(_, dest)| {
            dest.file_name()
                .and_then(|n| n.to_str())
                .unwrap_or("member")
        })
        .collect();
    progress(&format!(
        "extracting {} from {}",
        names.join(" and "),
        pin.package
    ));
    let list: Vec<Member<'_>> = members
        .iter()
        .map(|&(name, dest)| Member { name, dest })
        .collect();
    debian::extract_members(&deb, &list, &layout::scratch_dir(out_dir))?;
    let hashes = members
        .iter()
        .map(|(_, dest)| cache::stamp_file(out_dir, dest, &inputs))
        .collect::<Result<Vec<_>, _>>()?;
    if delete_deb {
        progress(&format!("deleting {} (no longer needed)", deb.display()));
        fs::remove_file(&deb).map_err(io_error("remove", &deb))?;
    }
    Ok(hashes)
}
