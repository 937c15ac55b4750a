//! The virtio initramfs of a pinned kernel (`linux-<release>/initramfs-virtio.cpio`): the
//! shared busybox initramfs followed by a second newc archive holding the kernel's virtio
//! modules under `/lib/modules/kpin/`, for `kpin run --guest linux[-6.12] --disk`. The
//! 6.1 kernel has `CONFIG_VIRTIO`, `VIRTIO_MMIO`, `VIRTIO_BLK` and `HW_RANDOM_VIRTIO` as
//! modules; 6.12 builds `VIRTIO` (and the ring) in and has the other three as modules.
//! The kernel unpacks concatenated archives in turn, so the first part is the default
//! initramfs byte for byte and `/init` is the same script: it loads the modules (in the
//! order of `/lib/modules/kpin/order`, dependencies first) only when the command line asks
//! for them (`kpin.modules=virtio`, or `kpin.workload=virtio`).
//!
//! The modules come from the kernel package already cached in `downloads/`, each extracted
//! once and stamped with the package's identity. The 6.12 package ships them as `.ko.xz`,
//! which busybox `insmod` cannot load (its `finit_module` passes no
//! `MODULE_INIT_COMPRESSED_FILE`, and its fallback reader has no xz), so they are
//! decompressed here on the host with the host's `xz -dc` — the same way the crate already
//! runs the host's `zstd` for 6.12's bzImage, rather than a new crate for three small
//! files — and go into the archive as plain `.ko`.
//!
//! Invariant: the archive is a pure function of the default initramfs and the modules.

use std::fs;
use std::path::{Path, PathBuf};

use crate::cache::{self, io_error};
use crate::command;
use crate::cpio::{CpioError, CpioWriter};
use crate::pins::KernelPins;
use crate::{GuestKernel, ImagesError};

/// The 6.1 kernel's modules, in load order (each after what it depends on: `virtio` needs
/// `virtio_ring`; the others need both), as paths under `lib/modules/<release>/kernel/`.
const MODULES_6_1: &[&str] = &[
    "drivers/virtio/virtio_ring.ko",
    "drivers/virtio/virtio.ko",
    "drivers/virtio/virtio_mmio.ko",
    "drivers/block/virtio_blk.ko",
    "drivers/char/hw_random/virtio-rng.ko",
];

/// The 6.12 kernel's: `virtio` and `virtio_ring` are built in, so none of these depends on
/// another (their `depends=` is empty).
const MODULES_6_12: &[&str] = &[
    "drivers/virtio/virtio_mmio.ko.xz",
    "drivers/block/virtio_blk.ko.xz",
    "drivers/char/hw_random/virtio-rng.ko.xz",
];

/// The virtio modules of `kernel`, in load order.
pub(crate) fn modules(kernel: GuestKernel) -> &'static [&'static str] {
    match kernel {
        GuestKernel::Debian61 => MODULES_6_1,
        GuestKernel::Debian612 => MODULES_6_12,
    }
}

/// Where the modules go in the guest.
pub(crate) const GUEST_DIR: &str = "lib/modules/kpin";

/// The archive member of module `path` in the kernel package of `pins`.
pub(crate) fn member(pins: &KernelPins, path: &str) -> String {
    format!("./lib/modules/{}/kernel/{path}", pins.release)
}

/// Where module `path` is kept in the output directory.
pub(crate) fn cached(kernel_dir: &Path, path: &str) -> PathBuf {
    kernel_dir.join("modules").join(file_name(path))
}

fn file_name(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

/// The module's name in the guest: always the plain `.ko` (see the module's header).
fn guest_name(path: &str) -> &str {
    let name = file_name(path);
    name.strip_suffix(".xz").unwrap_or(name)
}

/// The second archive: `/lib/modules/kpin/<module>.ko` each, and `order`, one file name a
/// line.
fn modules_archive(modules: &[(&str, Vec<u8>)]) -> Result<Vec<u8>, CpioError> {
    let mut a = CpioWriter::new();
    a.dir("lib", 0o755)?;
    a.dir("lib/modules", 0o755)?;
    a.dir(GUEST_DIR, 0o755)?;
    let mut order = String::new();
    for (path, bytes) in modules {
        let name = guest_name(path);
        a.file(&format!("{GUEST_DIR}/{name}"), 0o644, bytes)?;
        order.push_str(name);
        order.push('\n');
    }
    a.file(&format!("{GUEST_DIR}/order"), 0o644, order.as_bytes())?;
    Ok(a.finish())
}

/// Writes `base` (the default initramfs) followed by the modules' archive to `dest` when
/// its bytes differ from the file's.
pub(crate) fn write(
    dest: &Path,
    base: &Path,
    modules: &[(&str, PathBuf)],
    progress: &mut dyn FnMut(&str),
) -> Result<(), ImagesError> {
    let mut archive = fs::read(base).map_err(io_error("read", base))?;
    let mut loaded = Vec::with_capacity(modules.len());
    for (path, file) in modules {
        let bytes = if path.ends_with(".xz") {
            unxz(file)?
        } else {
            fs::read(file).map_err(io_error("read", file))?
        };
        loaded.push((*path, bytes));
    }
    let extra = modules_archive(&loaded).map_err(|source| ImagesError::Initramfs { source })?;
    archive.extend_from_slice(&extra);
    let current = match cache::sha256_file(dest) {
        Ok((sha256, _)) => Some(sha256),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(io_error("read", dest)(e)),
    };
    if current.as_deref() != Some(cache::sha256_hex(&archive).as_str()) {
        progress(&format!(
            "writing {} ({} kB)",
            dest.display(),
            archive.len().div_ceil(1000)
        ));
        cache::write_atomic(dest, &archive)?;
    }
    Ok(())
}

/// The decompressed bytes of the `.ko.xz` at `file` (`xz -dc`, which checks the stream's
/// integrity check), refused unless they are an ELF file: a cached file that is not what
/// the stamp says must fail the build here, not the `insmod` in the guest.
fn unxz(file: &Path) -> Result<Vec<u8>, ImagesError> {
    let mut cmd = std::process::Command::new("xz");
    cmd.args(["-d", "-c", "-q", "--"]).arg(file);
    let out = command::run_captured(&mut cmd).map_err(|source| ImagesError::Xz {
        path: file.to_path_buf(),
        command: command::describe(&cmd),
        source,
    })?;
    if !out.stdout.starts_with(b"\x7fELF") {
        return Err(ImagesError::Xz {
            path: file.to_path_buf(),
            command: command::describe(&cmd),
            source: command::CommandError::Failed {
                status: out.status,
                stderr_tail: "the decompressed module is not an ELF file".into(),
            },
        });
    }
    Ok(out.stdout)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpio;

    #[test]
    fn test_modules_archive_holds_the_modules_and_their_order() {
        let mods = vec![
            ("drivers/virtio/virtio_ring.ko", b"ring".to_vec()),
            ("drivers/virtio/virtio.ko", b"virtio".to_vec()),
        ];
        let a = modules_archive(&mods).unwrap();
        let entries = cpio::parse(&a).unwrap();
        let find = |n: &str| entries.iter().find(|e| e.name == n).unwrap();
        assert_eq!(find("lib/modules/kpin/virtio_ring.ko").data, b"ring");
        assert_eq!(
            find("lib/modules/kpin/order").data,
            b"virtio_ring.ko\nvirtio.ko\n"
        );
        assert_eq!(a.len() % 4, 0, "the next archive starts aligned");
    }

    #[test]
    fn test_compressed_modules_go_in_as_plain_ko() {
        let mods = vec![("drivers/block/virtio_blk.ko.xz", b"blk".to_vec())];
        let a = modules_archive(&mods).unwrap();
        let entries = cpio::parse(&a).unwrap();
        assert!(entries
            .iter()
            .any(|e| e.name == "lib/modules/kpin/virtio_blk.ko" && e.data == b"blk"));
        let order = entries
            .iter()
            .find(|e| e.name == "lib/modules/kpin/order")
            .unwrap();
        assert_eq!(order.data, b"virtio_blk.ko\n");
    }

    #[test]
    fn test_unxz_decompresses_and_refuses_what_is_not_a_module() {
        let dir = std::env::temp_dir().join(format!("kpin-unxz-test-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let compress = |name: &str, data: &[u8]| {
            let plain = dir.join(name);
            fs::write(&plain, data).unwrap();
            let st = std::process::Command::new("xz")
                .args(["-z", "-f", "-q", "--"])
                .arg(&plain)
                .status()
                .expect("xz (xz-utils) on the host");
            assert!(st.success());
            dir.join(format!("{name}.xz"))
        };
        let module = b"\x7fELF\x02\x01\x01 a module".repeat(100);
        assert_eq!(unxz(&compress("m.ko", &module)).unwrap(), module);
        let e = unxz(&compress("text.ko", b"not a module")).unwrap_err();
        assert!(format!("{e:#?}").contains("not an ELF"), "{e:#?}");
        // A truncated stream: xz fails, and the error names the file.
        let good = fs::read(dir.join("m.ko.xz")).unwrap();
        let cut = dir.join("cut.ko.xz");
        fs::write(&cut, &good[..good.len() / 2]).unwrap();
        let e = unxz(&cut).unwrap_err();
        assert!(e.to_string().contains("cut.ko.xz"), "{e}");
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn test_modules_are_in_dependency_order() {
        let pos = |n: &str| MODULES_6_1.iter().position(|m| m.ends_with(n)).unwrap();
        assert!(pos("/virtio_ring.ko") < pos("/virtio.ko"));
        for m in ["/virtio_mmio.ko", "/virtio_blk.ko", "/virtio-rng.ko"] {
            assert!(pos("/virtio.ko") < pos(m));
        }
    }
}
