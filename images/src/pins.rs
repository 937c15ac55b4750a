//! The pinned Debian packages kpin's guest images are made from: the one place that names them.
//!
//! Each guest kernel is a [`KernelPins`] made by `kernel_pins!` from its release string
//! (`uname -r`), its Debian version, and the SHA-256 sums and sizes of its image package and
//! its `-dbg` companion (take them from `apt-cache show <package>=<version>`). Package names,
//! archive member paths and the per-release output directory all derive from the release.
//! Every downloaded `.deb` is checked against its pinned SHA-256 before use. To add a kernel:
//! add a constant here, a variant to [`crate::GuestKernel`] that maps to it, and a command
//! line in `vmm/src/guests.rs` (docs/images.md walks through it).

/// A Debian package pinned to one exact version and `.deb` content.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DebPin {
    /// Binary package name.
    pub package: &'static str,
    /// Exact Debian version, epoch included.
    pub version: &'static str,
    /// Debian architecture (`amd64`, or `i386` for the 32-bit busybox).
    pub arch: &'static str,
    /// Lower-case hex SHA-256 of the `.deb` file.
    pub sha256: &'static str,
    /// Size of the `.deb` file, for progress messages.
    pub size_bytes: u64,
}

/// One pinned kernel: its image package, its debug package, and the archive members used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct KernelPins {
    /// The kernel release string (`uname -r` in the guest).
    pub release: &'static str,
    /// The kernel: contains `boot/vmlinuz-*` (bzImage) and `boot/config-*`. Its
    /// `boot/System.map-*` is an 83-byte placeholder; the real one is in [`KernelPins::dbg`].
    pub image: DebPin,
    /// The kernel's debug package; only its `System.map` is used. Deleted after extraction.
    /// Same Debian version as [`KernelPins::image`], or the map would describe another build.
    pub dbg: DebPin,
    /// Archive member of `image` holding the bzImage.
    pub vmlinuz_member: &'static str,
    /// Archive member of `image` holding the kernel configuration.
    pub config_member: &'static str,
    /// Archive member of `dbg` holding the full symbol map.
    pub system_map_member: &'static str,
}

/// Builds a [`KernelPins`] from the release string (a literal, so that `concat!` can derive
/// package names and member paths from it), the shared Debian version, and the two packages'
/// SHA-256 and size.
macro_rules! kernel_pins {
    (
        release: $release:literal,
        version: $version:literal,
        image: ($image_sha:literal, $image_size:literal),
        dbg: ($dbg_sha:literal, $dbg_size:literal) $(,)?
    ) => {
        KernelPins {
            release: $release,
            image: DebPin {
                package: concat!("linux-image-", $release),
                version: $version,
                arch: "amd64",
                sha256: $image_sha,
                size_bytes: $image_size,
            },
            dbg: DebPin {
                package: concat!("linux-image-", $release, "-dbg"),
                version: $version,
                arch: "amd64",
                sha256: $dbg_sha,
                size_bytes: $dbg_size,
            },
            vmlinuz_member: concat!("./boot/vmlinuz-", $release),
            config_member: concat!("./boot/config-", $release),
            system_map_member: concat!("./usr/lib/debug/boot/System.map-", $release),
        }
    };
}

/// Debian bookworm's 6.1 LTS cloud kernel, the default guest: LZ4-compressed bzImage.
pub(crate) const DEBIAN_6_1: KernelPins = kernel_pins! {
    release: "6.1.0-56-cloud-amd64",
    version: "6.1.192-2",
    image: ("e7d02b943971edcb8790e256c02cfab3bca6c3d37c1bf25392a57c71300615ee", 26_713_492),
    dbg: ("a835edf97e22ec84ddcd4d773596376be9eaae0c5094053b14c8e557cf9d8fb7", 283_308_068),
};

/// Debian bookworm-security's 6.12 LTS cloud kernel (the one bookworm's
/// `linux-image-6.12-cloud-amd64` pointed at when pinned): zstd-compressed, signed bzImage.
pub(crate) const DEBIAN_6_12: KernelPins = kernel_pins! {
    release: "6.12.117+deb12-cloud-amd64",
    version: "6.12.117-1~deb12u1",
    image: ("5195b288dec79e2981d6b84457f38b7ce7310a2d702930ec7d07209c7f78ce37", 34_307_256),
    dbg: ("b80ab3f407de94183b985ea37005d8e8ef4273d9083b850607cee7ab1e92a5b0", 317_861_800),
};

/// A kernel that kpin benchmarks against but does not run as a guest of its own: pinned
/// like a [`KernelPins`] kernel, without the `-dbg` companion, so it has no `System.map`
/// (`kpin_images::ensure_linux_generic_612`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BenchKernelPins {
    /// The kernel release string (`uname -r` in the guest).
    pub release: &'static str,
    /// The kernel: contains `boot/vmlinuz-*` (bzImage) and `boot/config-*`.
    pub image: DebPin,
    /// Archive member of `image` holding the bzImage.
    pub vmlinuz_member: &'static str,
    /// Archive member of `image` holding the kernel configuration.
    pub config_member: &'static str,
}

/// Debian bookworm-security's generic (non-cloud) 6.12 kernel, `6.12.117+deb12-amd64`: the
/// same source and Debian version as [`DEBIAN_6_12`] built with Debian's generic
/// configuration (what a distribution installs on a PC; the package carries every module,
/// hence its size). A benchmark configuration only (issue #25: "measure what users run");
/// its `-dbg` package is 1.03 GB, so its `System.map` is not fetched.
pub(crate) const DEBIAN_6_12_GENERIC: BenchKernelPins = BenchKernelPins {
    release: "6.12.117+deb12-amd64",
    image: DebPin {
        package: "linux-image-6.12.117+deb12-amd64",
        version: "6.12.117-1~deb12u1",
        arch: "amd64",
        sha256: "803d36a7cda13355ae8152122470288b2636f19f1cb58162dd9d8b408af9b1b4",
        size_bytes: 107_179_464,
    },
    vmlinuz_member: "./boot/vmlinuz-6.12.117+deb12-amd64",
    config_member: "./boot/config-6.12.117+deb12-amd64",
};

/// A file of a Debian source package in Debian's pool, pinned by its SHA-256.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SourceFile {
    /// The file name in the pool directory.
    pub name: &'static str,
    /// Lower-case hex SHA-256 of the file.
    pub sha256: &'static str,
}

/// A Debian source package pinned to one exact version: its `.dsc` and its two tarballs
/// (format `3.0 (quilt)`), fetched from Debian's pool (take the sums from
/// `apt-cache showsrc <package>`'s `Checksums-Sha256`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SourcePin {
    /// Source package name.
    pub package: &'static str,
    /// Exact Debian version, epoch included.
    pub version: &'static str,
    /// The pool directory on [`DEBIAN_MIRROR`], e.g. `pool/main/b/busybox`.
    pub pool_dir: &'static str,
    /// The source control file, which lists the tarballs' SHA-256.
    pub dsc: SourceFile,
    /// The upstream tarball.
    pub orig: SourceFile,
    /// Debian's `debian/` directory: patches, configurations, rules.
    pub debian: SourceFile,
}

/// The Debian mirror source packages are fetched from (the one apt uses here).
pub(crate) const DEBIAN_MIRROR: &str = "http://deb.debian.org/debian";

/// The source of the default guest's busybox: the source package of Debian's
/// `busybox-static` 1:1.35.0-4+deb12u1+b1 (a binNMU of this version), built by
/// `busybox_build.rs` with Debian's static configuration so that the binary keeps its
/// symbol table (Debian's package is stripped and its debug symbols are on a mirror this
/// machine cannot reach).
pub(crate) const BUSYBOX_SOURCE: SourcePin = SourcePin {
    package: "busybox",
    version: "1:1.35.0-4+deb12u1",
    pool_dir: "pool/main/b/busybox",
    dsc: SourceFile {
        name: "busybox_1.35.0-4+deb12u1.dsc",
        sha256: "9c01fe128b0eeded371c70e37d474fdb5055f71b5d0a778db44c6b0c62d3a7fa",
    },
    orig: SourceFile {
        name: "busybox_1.35.0.orig.tar.bz2",
        sha256: "faeeb244c35a348a334f4a59e44626ee870fb07b6884d68c10ae8bc19f83a694",
    },
    debian: SourceFile {
        name: "busybox_1.35.0-4+deb12u1.debian.tar.xz",
        sha256: "1cacbe095ef4880ea7879933c8e3c5075d1527cd6fbcb626a9b41e5daefd1a46",
    },
};

impl SourcePin {
    /// The three files, `.dsc` first.
    pub(crate) fn files(&self) -> [SourceFile; 3] {
        [self.dsc, self.orig, self.debian]
    }

    /// The URL of `file` on [`DEBIAN_MIRROR`].
    pub(crate) fn url(&self, file: &SourceFile) -> String {
        format!("{DEBIAN_MIRROR}/{}/{}", self.pool_dir, file.name)
    }

    /// A one-line identity of the verified source, used as the input of cache stamps.
    pub(crate) fn identity(&self) -> String {
        let sums: Vec<String> = self
            .files()
            .iter()
            .map(|f| format!("{} sha256:{}", f.name, f.sha256))
            .collect();
        format!(
            "{} {} source {}",
            self.package,
            self.version,
            sums.join(" ")
        )
    }
}

/// Debian's statically linked busybox built for i386, with a standalone shell (applets run
/// without symlinks; needs `dpkg --add-architecture i386`, which .ci/setup does): a real
/// 32-bit program that runs the guest's whole default workload
/// as PID 1's shell (tests/linux_i386_busybox.rs).
pub(crate) const BUSYBOX_I386: DebPin = DebPin {
    package: "busybox-static",
    version: "1:1.35.0-4+deb12u1+b1",
    arch: "i386",
    sha256: "725ef9e6fbac4ab79b353165b05005e8c140d6e42177ebbc202ff1e13ded8b7c",
    size_bytes: 958_344,
};

/// Archive member of [`BUSYBOX_I386`] holding the binary.
pub(crate) const BUSYBOX_MEMBER: &str = "./bin/busybox";

impl DebPin {
    /// The argument `apt-get download` takes: `package=version`, or
    /// `package:arch=version` for a foreign architecture.
    pub(crate) fn apt_spec(&self) -> String {
        if self.arch == "amd64" {
            format!("{}={}", self.package, self.version)
        } else {
            format!("{}:{}={}", self.package, self.arch, self.version)
        }
    }

    /// The file name `apt-get download` writes: `package_version_arch.deb`, with the
    /// epoch colon URL-encoded as `%3a` as apt does.
    pub(crate) fn deb_file_name(&self) -> String {
        format!(
            "{}_{}_{}.deb",
            self.package,
            self.version.replace(':', "%3a"),
            self.arch
        )
    }

    /// The download size for humans, e.g. `27 MB`.
    pub(crate) fn size_for_humans(&self) -> String {
        const MB: u64 = 1_000_000;
        if self.size_bytes >= MB {
            format!("{} MB", (self.size_bytes + MB / 2) / MB)
        } else {
            format!("{} kB", (self.size_bytes + 500) / 1000)
        }
    }

    /// A one-line identity of the verified package, used as the input of cache stamps.
    pub(crate) fn identity(&self) -> String {
        format!("{} {} sha256:{}", self.package, self.version, self.sha256)
    }
}

/// Debian bookworm's gdb without Python (`gdb-minimal`): the debugger the guest runs in
/// tests/linux_gdb_in_guest.rs, with the host's copies of its shared libraries.
pub(crate) const GDB_MINIMAL: DebPin = DebPin {
    package: "gdb-minimal",
    version: "13.1-3",
    arch: "amd64",
    sha256: "4aabd8955f0fa362e0474ddd02b5bbed77489b11dae04bbe2c420a54ac27e8ce",
    size_bytes: 3_253_832,
};

#[cfg(test)]
mod tests {
    use super::*;

    const KERNELS: [KernelPins; 2] = [DEBIAN_6_1, DEBIAN_6_12];

    #[test]
    fn test_a_foreign_architecture_is_in_the_spec_and_the_file_name() {
        assert_eq!(
            BUSYBOX_I386.apt_spec(),
            "busybox-static:i386=1:1.35.0-4+deb12u1+b1"
        );
        assert_eq!(
            BUSYBOX_I386.deb_file_name(),
            "busybox-static_1%3a1.35.0-4+deb12u1+b1_i386.deb"
        );
        assert_eq!(GDB_MINIMAL.apt_spec(), "gdb-minimal=13.1-3");
    }

    #[test]
    fn test_deb_file_name_url_encodes_epoch() {
        assert_eq!(
            DEBIAN_6_1.image.deb_file_name(),
            "linux-image-6.1.0-56-cloud-amd64_6.1.192-2_amd64.deb"
        );
        // `+` and `~` stay as they are; only the epoch colon is encoded.
        assert_eq!(
            DEBIAN_6_12.dbg.deb_file_name(),
            "linux-image-6.12.117+deb12-cloud-amd64-dbg_6.12.117-1~deb12u1_amd64.deb"
        );
    }

    #[test]
    fn test_kernel_packages_share_release_and_version() {
        for k in KERNELS {
            assert_eq!(k.image.version, k.dbg.version);
            assert_eq!(k.image.package, format!("linux-image-{}", k.release));
            assert_eq!(k.dbg.package, format!("{}-dbg", k.image.package));
            assert_eq!(k.vmlinuz_member, format!("./boot/vmlinuz-{}", k.release));
            assert_eq!(k.config_member, format!("./boot/config-{}", k.release));
            assert_eq!(
                k.system_map_member,
                format!("./usr/lib/debug/boot/System.map-{}", k.release)
            );
        }
        assert_ne!(DEBIAN_6_1.release, DEBIAN_6_12.release);
    }

    #[test]
    fn test_release_names_the_upstream_version_of_the_package() {
        // 6.1.0-56 is Debian's ABI name for upstream 6.1.192; 6.12 names the upstream
        // version itself. Either way the package version starts with the upstream one.
        assert!(DEBIAN_6_1.image.version.starts_with("6.1."));
        assert!(DEBIAN_6_12.image.version.starts_with("6.12.117-"));
        assert!(DEBIAN_6_12.release.starts_with("6.12.117+"));
    }

    #[test]
    fn test_pins_are_lowercase_sha256_and_distinct() {
        let mut all = vec![BUSYBOX_I386, GDB_MINIMAL, DEBIAN_6_12_GENERIC.image];
        for k in KERNELS {
            all.extend([k.image, k.dbg]);
        }
        for pin in &all {
            assert_eq!(pin.sha256.len(), 64, "{}", pin.package);
            assert!(pin
                .sha256
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)));
        }
        for (i, a) in all.iter().enumerate() {
            for b in &all[i + 1..] {
                assert_ne!(a.sha256, b.sha256, "{} and {}", a.package, b.package);
            }
        }
    }

    #[test]
    fn test_generic_612_names_derive_from_its_release_like_the_pinned_kernels() {
        let k = DEBIAN_6_12_GENERIC;
        assert_eq!(k.image.package, format!("linux-image-{}", k.release));
        assert_eq!(k.vmlinuz_member, format!("./boot/vmlinuz-{}", k.release));
        assert_eq!(k.config_member, format!("./boot/config-{}", k.release));
        // The same build as the pinned cloud 6.12, in the generic configuration.
        assert_eq!(k.image.version, DEBIAN_6_12.image.version);
        assert_eq!(
            k.release.replace("-amd64", "-cloud-amd64"),
            DEBIAN_6_12.release
        );
        assert_eq!(k.image.size_for_humans(), "107 MB");
    }

    #[test]
    fn test_size_for_humans_rounds() {
        assert_eq!(DEBIAN_6_1.image.size_for_humans(), "27 MB");
        assert_eq!(DEBIAN_6_1.dbg.size_for_humans(), "283 MB");
        assert_eq!(DEBIAN_6_12.dbg.size_for_humans(), "318 MB");
        assert_eq!(BUSYBOX_I386.size_for_humans(), "958 kB");
    }

    #[test]
    fn test_busybox_source_is_the_binary_packages_version_and_pinned_by_file() {
        // The i386 binary package is a binNMU (`+b1`) of exactly this source version.
        assert_eq!(
            BUSYBOX_I386.version,
            format!("{}+b1", BUSYBOX_SOURCE.version)
        );
        assert_eq!(
            BUSYBOX_SOURCE.url(&BUSYBOX_SOURCE.orig),
            "http://deb.debian.org/debian/pool/main/b/busybox/busybox_1.35.0.orig.tar.bz2"
        );
        let identity = BUSYBOX_SOURCE.identity();
        for file in BUSYBOX_SOURCE.files() {
            assert_eq!(file.sha256.len(), 64, "{}", file.name);
            assert!(identity.contains(file.sha256), "{identity}");
        }
        assert!(BUSYBOX_SOURCE.debian.name.ends_with(".debian.tar.xz"));
        assert!(BUSYBOX_SOURCE.orig.name.ends_with(".orig.tar.bz2"));
    }
}
