//! kpin's guest images: the pinned Debian kernels ([`GuestKernel`]: each as bzImage, as
//! vmlinux ELF, with its `System.map` and config), the busybox initramfs with kpin's `/init`
//! and its native test programs, and the mini-kernel.
//!
//! Everything lands in a git-ignored output directory ([`default_out_dir`]). The functions are
//! idempotent and cached: a second call with everything present and verified downloads
//! nothing. The cache is never trusted blindly: downloaded `.deb`s are checked against pinned
//! SHA-256 sums, derived files carry stamps that are re-verified on every call (and are rebuilt
//! if missing or changed), and every file is written via a temporary file and a rename.
//! Concurrent callers serialise on a lock file per job.
//!
//! Host requirements: `apt-get` (with a package index that knows the pinned versions),
//! `dpkg-deb`, `tar`, `zstd` (for kernels with a zstd payload), `gcc` with `libc6-dev`
//! and `gcc-multilib` (the initramfs' test programs are static C programs, one of them
//! also built 32-bit), `make`, `patch`, `bzip2` and `xz` (busybox is built from Debian's
//! source package), and for the mini-kernel `cargo` with the `x86_64-unknown-none`
//! target.
#![deny(missing_docs)]

mod busybox_build;
mod bzimage;
mod cache;
pub use cache::seen_line;
mod command;
mod cpio;
mod debian;
mod debian_image;
mod engine;
mod gdb;
mod initramfs;
mod layout;
mod linux;
mod lz4_legacy;
mod minikernel;
mod nostd;
mod overlay;
mod pins;
mod programs;
mod virtio_initramfs;
mod workload;

use std::io;
use std::path::{Path, PathBuf};

pub use bzimage::BzImageError;
pub use command::CommandError;
pub use cpio::CpioError;
pub use debian_image::disk_test_sha256;
pub use gdb::{ensure_gdb, gdb_overlay, GDB_BEGIN, GDB_END};
pub use linux::vmlinux_from_bzimage;
pub use lz4_legacy::Lz4Error;
pub use overlay::{ensure_busybox_i386, overlay};
pub use workload::{
    md5_hex, probe_verdict, programs_workload_expected_md5, workload_expected_md5, PROBE_ACCESSES,
    PROGRAMS,
};

/// The pinned guest kernels. Each is a Debian cloud kernel pinned by version and by the
/// SHA-256 of its packages (`images/src/pins.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GuestKernel {
    /// Debian bookworm's 6.1 LTS cloud kernel, `6.1.0-56-cloud-amd64` (6.1.192-2): the
    /// default guest; LZ4 bzImage.
    Debian61,
    /// Debian bookworm-security's 6.12 LTS cloud kernel, `6.12.117+deb12-cloud-amd64`
    /// (6.12.117-1~deb12u1); zstd bzImage.
    Debian612,
}

impl GuestKernel {
    /// Every pinned kernel, the default first.
    pub const ALL: [GuestKernel; 2] = [GuestKernel::Debian61, GuestKernel::Debian612];

    /// The kernel release (`uname -r` in the guest).
    pub fn release(self) -> &'static str {
        self.pins().release
    }

    /// The pinned packages.
    pub(crate) fn pins(self) -> &'static pins::KernelPins {
        match self {
            GuestKernel::Debian61 => &pins::DEBIAN_6_1,
            GuestKernel::Debian612 => &pins::DEBIAN_6_12,
        }
    }
}

/// The files of a pinned Linux guest, all inside the output directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinuxImages {
    /// Which kernel these are.
    pub kernel: GuestKernel,
    /// The distribution's bzImage (`vmlinuz`), relocatable, as Debian ships it (6.1: LZ4
    /// payload; 6.12: zstd payload, signed). Booting it runs its decompressor, which also
    /// applies KASLR unless the command line says `nokaslr`: the distribution's behaviour.
    pub bzimage: PathBuf,
    /// The kernel ELF taken from the bzImage's payload: boots without the decompressor.
    /// Symbols are stripped; use [`LinuxImages::system_map`] for them.
    pub vmlinux: PathBuf,
    /// The full `System.map` of this build (from the `-dbg` package).
    pub system_map: PathBuf,
    /// The kernel's `.config`.
    pub config: PathBuf,
    /// The busybox initramfs (uncompressed newc cpio) whose `/init` runs a workload; the
    /// same file for every kernel.
    pub initramfs: PathBuf,
    /// The kernel release (`uname -r`), e.g. `6.1.0-56-cloud-amd64`.
    pub kernel_version: &'static str,
}

/// The files of a Debian kernel that kpin benchmarks against but does not pin as a guest
/// ([`ensure_linux_generic_612`]): like [`LinuxImages`] without a `System.map`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BenchLinuxImages {
    /// The distribution's bzImage (`vmlinuz`), as Debian ships it.
    pub bzimage: PathBuf,
    /// The kernel ELF taken from the bzImage's payload (symbols stripped).
    pub vmlinux: PathBuf,
    /// The kernel's `.config`.
    pub config: PathBuf,
    /// The busybox initramfs, the same file as every pinned kernel's.
    pub initramfs: PathBuf,
    /// The kernel release (`uname -r`), e.g. `6.12.117+deb12-amd64`.
    pub kernel_version: &'static str,
}

/// The Debian bookworm guest (`kpin images --debian`, `kpin run --guest debian`; built by
/// [`ensure_debian`] into `out_dir/debian-bookworm/`): a raw ext4 disk image holding both
/// pinned kernels' modules, and the initrd initramfs-tools made in it for this kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DebianImage {
    /// The raw ext4 disk image (2 GiB, sparse): the guest's `/dev/vda`, its root file
    /// system. Boot a copy: a run writes to its disk.
    pub disk: PathBuf,
    /// The initrd for [`DebianImage::linux`]'s kernel (loads virtio_mmio and virtio_blk).
    pub initrd: PathBuf,
    /// The md5 `kpin-workload` prints after `KPIN-WORKLOAD-DONE`, from its run in a chroot
    /// of the image at build time.
    pub expected_md5: String,
    /// The kernel's files (its own busybox initramfs is not used).
    pub linux: LinuxImages,
}

/// Why an image could not be produced. Messages name what failed; the cause is chained as
/// the error's `source`.
#[derive(Debug, thiserror::Error)]
pub enum ImagesError {
    /// A file-system operation failed.
    #[error("could not {action} {}", path.display())]
    Io {
        /// What was being done, e.g. `"read"`.
        action: &'static str,
        /// The file or directory concerned.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// A tool crate given to [`ensure_engine_with_tool`] cannot be used.
    #[error("tool crate {}: {why}", path.display())]
    ToolCrate {
        /// The crate's directory.
        path: PathBuf,
        /// What is wrong with it.
        why: String,
    },
    /// `apt-get download` failed.
    #[error(
        "could not download {package} {version}: `{command}` failed (if apt cannot locate the \
         package or version, its package index may be stale: run `apt-get update`)"
    )]
    Download {
        /// The package.
        package: &'static str,
        /// Its pinned version.
        version: &'static str,
        /// The exact command that failed.
        command: String,
        /// How it failed.
        #[source]
        source: CommandError,
    },
    /// `apt-get download` succeeded but the expected file is not there.
    #[error("`{command}` succeeded but did not produce {} for {package}", path.display())]
    DownloadMissing {
        /// The package.
        package: &'static str,
        /// The command that ran.
        command: String,
        /// The file that was expected.
        path: PathBuf,
    },
    /// A downloaded package does not have its pinned SHA-256.
    #[error(
        "{} has SHA-256 {actual}, but {package} {version} is pinned to {expected}; the file was deleted",
        path.display()
    )]
    Checksum {
        /// The package.
        package: &'static str,
        /// Its pinned version.
        version: &'static str,
        /// The downloaded file.
        path: PathBuf,
        /// The pinned hash.
        expected: &'static str,
        /// The hash found.
        actual: String,
    },
    /// Extracting files from a package failed.
    #[error("could not extract {members} from {}: `{command}` failed", deb.display())]
    Extract {
        /// The package file.
        deb: PathBuf,
        /// The archive members wanted.
        members: String,
        /// The exact pipeline that failed.
        command: String,
        /// How it failed.
        #[source]
        source: CommandError,
    },
    /// The kernel ELF could not be recovered from the bzImage.
    #[error("could not extract vmlinux from {}", path.display())]
    Vmlinux {
        /// The bzImage.
        path: PathBuf,
        /// What was wrong with it.
        #[source]
        source: BzImageError,
    },
    /// A kernel's zstd payload could not be decompressed with the host's `zstd`.
    #[error("could not decompress the zstd payload of {}: `{command}` failed (is `zstd` installed?)", path.display())]
    Zstd {
        /// The bzImage.
        path: PathBuf,
        /// The exact command that failed.
        command: String,
        /// How it failed.
        #[source]
        source: CommandError,
    },
    /// A kernel module (`.ko.xz`) could not be decompressed with the host's `xz`.
    #[error("could not decompress the kernel module {}: `{command}` failed (is `xz` installed? `apt-get install xz-utils`)", path.display())]
    Xz {
        /// The compressed module.
        path: PathBuf,
        /// The exact command that failed.
        command: String,
        /// How it failed.
        #[source]
        source: CommandError,
    },
    /// The initramfs' test programs could not be compiled.
    #[error(
        "could not build the initramfs test programs: `{command}` failed (they need `gcc` \
         and `libc6-dev`: `apt-get install gcc libc6-dev`)"
    )]
    Programs {
        /// The exact command that failed.
        command: String,
        /// How it failed.
        #[source]
        source: CommandError,
    },
    /// The 32-bit build of a test program failed (usually: no 32-bit C library).
    #[error(
        "could not build the initramfs' 32-bit test program: `{command}` failed (`gcc -m32` \
         needs Debian's `gcc-multilib`: `apt-get install gcc-multilib`, which .ci/setup \
         installs)"
    )]
    Programs32 {
        /// The exact command that failed.
        command: String,
        /// How it failed.
        #[source]
        source: CommandError,
    },
    /// A file of a pinned Debian source package could not be downloaded.
    #[error(
        "could not download {url}: `{command}` failed (Debian's mirror must be reachable; \
         apt's proxy settings apply)"
    )]
    SourceDownload {
        /// The file's URL.
        url: String,
        /// The exact command that failed.
        command: String,
        /// How it failed.
        #[source]
        source: CommandError,
    },
    /// The host lacks tools that building busybox from source needs.
    #[error(
        "building busybox from Debian's source needs {missing}, which the host does not \
         have: `apt-get install {packages}` (.ci/setup does)"
    )]
    BusyboxTools {
        /// The missing programs.
        missing: String,
        /// The Debian packages that provide them.
        packages: String,
    },
    /// A step of the busybox build failed.
    #[error(
        "could not build busybox from Debian's source: `{command}` failed (it needs gcc, \
         libc6-dev, make, patch, bzip2 and xz, which .ci/setup installs)"
    )]
    BusyboxBuild {
        /// The exact command that failed.
        command: String,
        /// How it failed.
        #[source]
        source: CommandError,
    },
    /// The busybox source or build is not what kpin expects.
    #[error("could not build busybox from Debian's source: {why}")]
    BusyboxSource {
        /// What is wrong.
        why: String,
    },
    /// gdb's shared libraries could not be listed.
    #[error("could not list gdb's shared libraries: `{command}` failed")]
    GdbLibraries {
        /// The exact command that failed.
        command: String,
        /// How it failed.
        #[source]
        source: CommandError,
    },
    /// The host lacks shared libraries gdb-minimal needs.
    #[error(
        "gdb-minimal needs {missing}, which the host does not have (`apt-get install` \
         gdb-minimal's dependencies, as .ci/setup does)"
    )]
    GdbMissingLibraries {
        /// The missing libraries, as `ldd` names them.
        missing: String,
    },
    /// The initramfs archive could not be built.
    #[error("could not build the initramfs")]
    Initramfs {
        /// The rejected entry.
        #[source]
        source: CpioError,
    },
    /// The Debian image cannot be built (no root, a tool missing, a bad result).
    #[error("could not build the Debian image: {why}")]
    DebianImage {
        /// What is wrong, and what to do.
        why: String,
    },
    /// This host cannot build the Debian image: not root, or a tool missing.
    #[error("could not build the Debian image: {why}")]
    DebianPrerequisite {
        /// What is missing, and what to do.
        why: String,
    },
    /// mmdebstrap could not reach Debian's mirror.
    #[error(
        "could not build the Debian image: mmdebstrap could not reach Debian's mirror \
         (deb.debian.org; check the network, a proxy in /etc/apt/apt.conf.d, or \
         `apt-get update`): `{command}` failed"
    )]
    DebianMirror {
        /// The exact command that failed.
        command: String,
        /// How it failed.
        #[source]
        source: CommandError,
    },
    /// mmdebstrap failed.
    #[error("could not build the Debian image: `{command}` failed (its output: {})", log.display())]
    DebianBuild {
        /// The exact command that failed.
        command: String,
        /// The file holding its whole output.
        log: PathBuf,
        /// How it failed.
        #[source]
        source: CommandError,
    },
    /// mkfs.ext4 could not pack the root file system.
    #[error("could not pack the Debian image: `{command}` failed")]
    DebianMkfs {
        /// The exact command that failed.
        command: String,
        /// How it failed.
        #[source]
        source: CommandError,
    },
    /// A no_std crate (the mini-kernel, the engine image) is not in the repository.
    #[error("the sources of {what} are missing: {} does not exist", manifest.display())]
    NoStdMissing {
        /// Which crate.
        what: &'static str,
        /// Where its manifest should be.
        manifest: PathBuf,
    },
    /// A no_std crate cannot be built because the Rust target is not installed.
    #[error(
        "the Rust target x86_64-unknown-none is not installed: run \
         `rustup target add x86_64-unknown-none` (`{command}` failed)"
    )]
    NoStdTargetMissing {
        /// Which crate.
        what: &'static str,
        /// The build command.
        command: String,
        /// How it failed.
        #[source]
        source: CommandError,
    },
    /// Building a no_std crate failed.
    #[error("could not build {what}: `{command}` failed")]
    NoStdBuild {
        /// Which crate.
        what: &'static str,
        /// The build command.
        command: String,
        /// How it failed.
        #[source]
        source: CommandError,
    },
    /// A no_std build produced something that is not an x86-64 ELF.
    #[error("the build output of {what}, {}, is not an x86-64 ELF file", path.display())]
    NoStdNotElf {
        /// Which crate.
        what: &'static str,
        /// The build output.
        path: PathBuf,
    },
}

impl ImagesError {
    /// Whether the host is not set up to build the Debian image at all — not root,
    /// `mmdebstrap` or `mkfs.ext4` missing, Debian's mirror unreachable — rather than a
    /// build that went wrong: the tests that need the image skip on it.
    pub fn is_debian_host_unprepared(&self) -> bool {
        matches!(
            self,
            ImagesError::DebianPrerequisite { .. } | ImagesError::DebianMirror { .. }
        )
    }
}

/// The repository root (the parent of this crate's directory).
pub(crate) fn repo_root() -> PathBuf {
    let manifest_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest_dir
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| manifest_dir.join(".."))
}

/// The default output directory, `<repo>/images/out` (git-ignored).
pub fn default_out_dir() -> PathBuf {
    repo_root().join("images").join("out")
}

/// Makes sure the default Linux guest ([`GuestKernel::Debian61`]) is complete in `out_dir`
/// and returns its files; see [`ensure_linux_kernel`].
pub fn ensure_linux(
    out_dir: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<LinuxImages, ImagesError> {
    linux::ensure(GuestKernel::Debian61, out_dir, progress)
}

/// Makes sure the Linux guest with `kernel` is complete in `out_dir` and returns its files.
///
/// Downloads (with `apt-get download`) and verifies what is missing, extracts the kernel,
/// its ELF and its symbol map, builds the test programs and the initramfs. `progress`
/// receives one line per step that does work; a warm call does no downloads and reports
/// nothing or little.
pub fn ensure_linux_kernel(
    kernel: GuestKernel,
    out_dir: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<LinuxImages, ImagesError> {
    linux::ensure(kernel, out_dir, progress)
}

/// Makes sure the pinned Linux guest `kernel` is complete in `out_dir`
/// ([`ensure_linux_kernel`]) with the virtio initramfs in `initramfs`: the shared one
/// followed by the kernel's virtio modules (6.1: `virtio_ring`, `virtio`, `virtio_mmio`,
/// `virtio_blk`, `virtio-rng`; 6.12: the last three, decompressed) under
/// `/lib/modules/kpin/`, which `/init` loads when the command line says
/// `kpin.modules=virtio` (or `kpin.workload=virtio`), for `kpin run --disk`.
pub fn ensure_linux_virtio(
    kernel: GuestKernel,
    out_dir: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<LinuxImages, ImagesError> {
    linux::ensure_virtio(kernel, out_dir, progress)
}

/// Makes sure Debian's generic (non-cloud) 6.12 kernel, `6.12.117+deb12-amd64`, is in
/// `out_dir/linux-6.12.117+deb12-amd64/` with the shared initramfs, and returns its files.
///
/// The same source and Debian version as [`GuestKernel::Debian612`] in the configuration a
/// distribution installs on a PC: a benchmark configuration (`tests/bench/side_by_side.py
/// --kernels 6.12-generic`, issue #25), not a guest kpin's tests rely on, so it is fetched
/// only by this call. Pinned and cached like the guest kernels (the package's SHA-256 is
/// checked, the extracted files are stamped); the 107 MB package is deleted after
/// extraction and its 1.03 GB `-dbg` companion is never fetched, so there is no
/// `System.map` (`kpin run --kernel` works without one; reports name blocks by address).
pub fn ensure_linux_generic_612(
    out_dir: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<BenchLinuxImages, ImagesError> {
    linux::ensure_generic_612(out_dir, progress)
}

/// The host paths of the CPU-conformance corpus (issue #22): the same static binaries the
/// initramfs carries as `/bin/kpin-conform` and `/bin/kpin-conform32`, to run natively on
/// the host as the reference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConformPrograms {
    /// The 64-bit build, `out_dir/programs/kpin-conform`.
    pub bin64: PathBuf,
    /// The 32-bit build (`gcc -m32`), `out_dir/programs/kpin-conform32`.
    pub bin32: PathBuf,
}

/// Builds (or finds cached) the conformance corpus' two binaries in `out_dir` and returns
/// their paths. Fails with [`ImagesError::Programs32`] when `gcc -m32` cannot build (no
/// `gcc-multilib`).
pub fn ensure_conform_programs(
    out_dir: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<ConformPrograms, ImagesError> {
    Ok(ConformPrograms {
        bin64: programs::ensure(out_dir, &programs::CONFORM, progress)?,
        bin32: programs::ensure(out_dir, &programs::CONFORM32, progress)?,
    })
}

/// Makes sure the Debian bookworm guest is complete in `out_dir/debian-bookworm/` for
/// `kernel` and returns its files (the kernel's too).
///
/// A cold build takes minutes and needs root, `mmdebstrap` and Debian's mirror: the root
/// file system from Debian's packages with both pinned kernels installed (their verified
/// packages from `out_dir/downloads/`), the workload unit, an initrd per kernel, the raw
/// ext4 image (`images/src/debian_image.rs`, docs/images.md). `progress` gets a line per
/// step, and mmdebstrap's own `I:` lines. A warm call checks the stamps and returns.
pub fn ensure_debian(
    kernel: GuestKernel,
    out_dir: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<DebianImage, ImagesError> {
    debian_image::ensure(kernel, out_dir, progress)
}

/// Copies a disk image (the Debian guest's [`DebianImage::disk`]) to `to` for one run, as
/// a reflink where the file system has them, else as a sparse copy of its data ranges
/// (~0.7 GB of the 2 GiB image; a second or two): a run writes to its disk, and the cached
/// image must stay as built. Written under a temporary name and renamed.
pub fn copy_disk(from: &Path, to: &Path) -> Result<(), ImagesError> {
    debian_image::copy_disk(from, to)
}

/// Builds the mini-kernel guest (`tests/guests/minikernel`) and returns the path of its ELF,
/// `out_dir/minikernel.elf`. Cheap when nothing changed (cargo's incremental build).
pub fn ensure_minikernel(
    out_dir: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<PathBuf, ImagesError> {
    minikernel::ensure(out_dir, progress)
}

/// Builds the engine image (`guest-engine/image`, for `x86_64-unknown-none`, linked at
/// its window address) and returns the path of its ELF, `out_dir/kpin-engine.elf`. Cheap
/// when nothing changed (cargo's incremental build).
pub fn ensure_engine(
    out_dir: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<PathBuf, ImagesError> {
    engine::ensure(out_dir, progress)
}

/// The engine image with an out-of-tree tool crate linked in as well (`kpin run
/// --tool-crate DIR`): built from a manifest generated under `out_dir/tool-builds/<its
/// package name>/` (the engine image's own, with the crate as a dependency and its
/// `extra-tool` feature on), published there as `kpin-engine.elf`. Nothing in the kpin
/// tree changes. The crate must export `pub const SPEC: kpin_tool::ToolSpec` and
/// `pub fn new_tool(options: &str) -> Result<Box<dyn kpin_tool::KpinTool>, String>`
/// (docs/writing-a-tool.md).
pub fn ensure_engine_with_tool(
    out_dir: &Path,
    tool_crate: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<PathBuf, ImagesError> {
    engine::ensure_with_tool(out_dir, tool_crate, progress)
}

#[cfg(test)]
mod tests {
    use std::error::Error;

    use super::*;

    #[test]
    fn test_only_a_host_without_root_tools_or_mirror_is_unprepared_for_debian() {
        let unprepared = [
            ImagesError::DebianPrerequisite {
                why: "building it needs root".into(),
            },
            ImagesError::DebianMirror {
                command: "mmdebstrap".into(),
                source: CommandError::Spawn(io::Error::other("x")),
            },
        ];
        assert!(unprepared.iter().all(|e| e.is_debian_host_unprepared()));
        // A build that went wrong is a failure, not a skip.
        let failed = [
            ImagesError::DebianImage {
                why: "the workload printed no md5".into(),
            },
            ImagesError::DebianBuild {
                command: "mmdebstrap".into(),
                log: PathBuf::from("/x/log"),
                source: CommandError::Spawn(io::Error::other("x")),
            },
        ];
        assert!(failed.iter().all(|e| !e.is_debian_host_unprepared()));
    }

    #[test]
    fn test_default_out_dir_is_images_out_in_repo() {
        let out = default_out_dir();
        assert!(out.ends_with("images/out"));
        assert!(out
            .parent()
            .expect("has parent")
            .join("Cargo.toml")
            .is_file());
    }

    #[test]
    fn test_error_messages_chain_causes_instead_of_embedding_them() {
        let err = ImagesError::Io {
            action: "read",
            path: PathBuf::from("/x/vmlinuz"),
            source: io::Error::new(io::ErrorKind::NotFound, "gone"),
        };
        assert_eq!(err.to_string(), "could not read /x/vmlinuz");
        assert_eq!(err.source().expect("chained").to_string(), "gone");
    }
}
