//! The virtio initramfs of the default kernel (`linux-<release>/initramfs-virtio.cpio`):
//! the shared busybox initramfs followed by a second newc archive holding the kernel's
//! virtio modules under `/lib/modules/kpin/`, for `kpin run --disk` with the pinned 6.1
//! kernel, where `CONFIG_VIRTIO`, `VIRTIO_MMIO`, `VIRTIO_BLK` and `HW_RANDOM_VIRTIO` are
//! modules. The kernel unpacks concatenated archives in turn, so the first part is the
//! default initramfs byte for byte and `/init` is the same script: it loads the modules
//! (in the order of `/lib/modules/kpin/order`, dependencies first) only when the command
//! line asks for them (`kpin.modules=virtio`, or `kpin.workload=virtio`).
//!
//! The modules come from the kernel package already cached in `downloads/` (`.ko`,
//! uncompressed in the 6.1 package: busybox `insmod` cannot read `.ko.xz`), each extracted
//! once and stamped with the package's identity.
//!
//! Invariant: the archive is a pure function of the default initramfs and the modules.

use std::fs;
use std::path::{Path, PathBuf};

use crate::cache::{self, io_error};
use crate::cpio::{CpioError, CpioWriter};
use crate::pins::KernelPins;
use crate::ImagesError;

/// The modules, in load order (each after what it depends on: `virtio` needs
/// `virtio_ring`; the others need both), as paths under `lib/modules/<release>/kernel/`.
pub(crate) const MODULES: &[&str] = &[
    "drivers/virtio/virtio_ring.ko",
    "drivers/virtio/virtio.ko",
    "drivers/virtio/virtio_mmio.ko",
    "drivers/block/virtio_blk.ko",
    "drivers/char/hw_random/virtio-rng.ko",
];

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

/// The second archive: `/lib/modules/kpin/<module>.ko` each, and `order`, one file name a
/// line.
pub(crate) fn modules_archive(modules: &[(&str, Vec<u8>)]) -> Result<Vec<u8>, CpioError> {
    let mut a = CpioWriter::new();
    a.dir("lib", 0o755)?;
    a.dir("lib/modules", 0o755)?;
    a.dir(GUEST_DIR, 0o755)?;
    let mut order = String::new();
    for (path, bytes) in modules {
        let name = file_name(path);
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
        loaded.push((*path, fs::read(file).map_err(io_error("read", file))?));
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
    fn test_modules_are_in_dependency_order() {
        let pos = |n: &str| MODULES.iter().position(|m| m.ends_with(n)).unwrap();
        assert!(pos("/virtio_ring.ko") < pos("/virtio.ko"));
        for m in ["/virtio_mmio.ko", "/virtio_blk.ko", "/virtio-rng.ko"] {
            assert!(pos("/virtio.ko") < pos(m));
        }
    }
}
