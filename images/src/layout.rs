//! Layout of the output directory: every path kpin-images writes, relative to `out_dir`.
//!
//! ```text
//! out_dir/
//!   linux-<release>/{vmlinuz, vmlinux, System.map, config}   each pinned kernel
//!   linux-6.1.0-56-cloud-amd64/{modules/, initramfs-virtio.cpio}  its virtio modules and
//!                                                            the initramfs carrying them
//!   linux-6.12.117+deb12-amd64/{vmlinuz, vmlinux, config}    the generic 6.12, benchmarks only
//!   debian-bookworm/{disk.img, initrd.img-<release>, expected-md5, packages.txt, stamp}
//!                                                            the Debian guest (debian_image.rs)
//!   busybox-source/busybox                                   static busybox built from Debian's
//!                                                            source, unstripped (busybox_build.rs)
//!   busybox-source/build/                                    its build tree, removed afterwards
//!   programs/{kpin-test, kpin-conform, kpin-conform32}      the initramfs' test programs
//!   programs/src-<program>/                                  the sources each was compiled from
//!   initramfs.cpio                                           newc archive, uncompressed
//!   minikernel.elf                                           the mini-kernel guest
//!   minikernel-target/                                       cargo's target dir for it
//!   kpin-engine.elf                                          the engine image
//!   engine-target/                                           cargo's target dir for it
//!   downloads/                                               verified .debs (the big -dbg one is deleted)
//!                                                            and busybox's source package
//!   .stamps/                                                 cache stamps (see cache.rs)
//!   .scratch/                                                extraction space, emptied after use
//!   .scratch-zstd/                                           a zstd payload being decompressed
//!   .lock-linux, .lock-minikernel, .lock-engine, .lock-debian  job locks
//! ```

use std::path::{Path, PathBuf};

/// Directory holding the files of the pinned kernel with release `release`.
pub(crate) fn kernel_dir(out_dir: &Path, release: &str) -> PathBuf {
    out_dir.join(format!("linux-{release}"))
}

/// Scratch space for decompressing a zstd kernel payload; removed after use.
pub(crate) fn zstd_scratch_dir(out_dir: &Path) -> PathBuf {
    out_dir.join(".scratch-zstd")
}

/// Directory of the Debian bookworm guest (`debian_image.rs`).
pub(crate) fn debian_dir(out_dir: &Path) -> PathBuf {
    out_dir.join("debian-bookworm")
}

/// The initramfs' test program `name` (a static binary; see `programs.rs`).
pub(crate) fn program(out_dir: &Path, name: &str) -> PathBuf {
    out_dir.join("programs").join(name)
}

/// The directory the sources of test program `name` are written to and compiled from.
pub(crate) fn program_sources(out_dir: &Path, name: &str) -> PathBuf {
    out_dir.join("programs").join(format!("src-{name}"))
}

/// Directory `apt-get download` runs in.
pub(crate) fn downloads_dir(out_dir: &Path) -> PathBuf {
    out_dir.join("downloads")
}

/// Scratch space for extracting packages; removed and recreated per extraction.
pub(crate) fn scratch_dir(out_dir: &Path) -> PathBuf {
    out_dir.join(".scratch")
}

/// The busybox binary built from Debian's source (`busybox_build.rs`).
pub(crate) fn busybox(out_dir: &Path) -> PathBuf {
    out_dir.join("busybox-source").join("busybox")
}

/// The initramfs archive.
pub(crate) fn initramfs(out_dir: &Path) -> PathBuf {
    out_dir.join("initramfs.cpio")
}

/// Where the mini-kernel ELF is copied.
pub(crate) fn minikernel_elf(out_dir: &Path) -> PathBuf {
    out_dir.join("minikernel.elf")
}

/// Cargo's target directory for the mini-kernel build.
pub(crate) fn minikernel_target_dir(out_dir: &Path) -> PathBuf {
    out_dir.join("minikernel-target")
}

/// Where the engine image ELF is copied.
pub(crate) fn engine_elf(out_dir: &Path) -> PathBuf {
    out_dir.join("kpin-engine.elf")
}

/// Cargo's target directory for the engine image build.
pub(crate) fn engine_target_dir(out_dir: &Path) -> PathBuf {
    out_dir.join("engine-target")
}

/// File names inside [`kernel_dir`].
pub(crate) mod kernel_files {
    /// The bzImage, as Debian ships it.
    pub(crate) const VMLINUZ: &str = "vmlinuz";
    /// The kernel ELF extracted from the bzImage's payload (symbols stripped).
    pub(crate) const VMLINUX: &str = "vmlinux";
    /// The full symbol map from the `-dbg` package.
    pub(crate) const SYSTEM_MAP: &str = "System.map";
    /// The kernel configuration.
    pub(crate) const CONFIG: &str = "config";
    /// The default kernel's virtio initramfs (`virtio_initramfs.rs`).
    pub(crate) const VIRTIO_INITRAMFS: &str = "initramfs-virtio.cpio";
}

/// File names inside [`debian_dir`].
pub(crate) mod debian_files {
    /// The raw ext4 disk image (sparse).
    pub(crate) const DISK: &str = "disk.img";
    /// The workload's md5, as the build-time run in a chroot printed it.
    pub(crate) const EXPECTED_MD5: &str = "expected-md5";
    /// `dpkg-query -W` of the image: what went in.
    pub(crate) const PACKAGES: &str = "packages.txt";
    /// The disk image's stamp: the inputs' hash, its size and modification time.
    pub(crate) const STAMP: &str = "stamp";

    /// The initrd initramfs-tools made in the image for kernel `release`.
    pub(crate) fn initrd(release: &str) -> String {
        format!("initrd.img-{release}")
    }
}
