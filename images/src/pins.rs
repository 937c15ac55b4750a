//! The pinned Debian packages kpin's guest images are made from: the one place that names them.
//!
//! To move to another kernel, change `kernel_release!`, [`KERNEL_PACKAGE_VERSION`] and the two
//! kernel SHA-256 sums and sizes below (take them from `apt-cache show <package>=<version>`).
//! Package names, archive member paths and the per-version output directory all derive from
//! this table. Every downloaded `.deb` is checked against its pinned SHA-256 before use.

/// The kernel release string (`uname -r`) of the pinned kernel; a macro so that `concat!` can
/// build package names and member paths from it at compile time.
macro_rules! kernel_release {
    () => {
        "6.1.0-56-cloud-amd64"
    };
}

/// The kernel release string of the pinned kernel (`uname -r` in the guest).
pub(crate) const KERNEL_RELEASE: &str = kernel_release!();

/// Debian version shared by the kernel image package and its `-dbg` companion; they must match
/// or the `System.map` would describe a different build.
const KERNEL_PACKAGE_VERSION: &str = "6.1.192-2";

/// A Debian package pinned to one exact version and `.deb` content.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DebPin {
    /// Binary package name.
    pub package: &'static str,
    /// Exact Debian version, epoch included.
    pub version: &'static str,
    /// Lower-case hex SHA-256 of the `.deb` file.
    pub sha256: &'static str,
    /// Size of the `.deb` file, for progress messages.
    pub size_bytes: u64,
}

/// The kernel: contains `boot/vmlinuz-*` (bzImage, LZ4 payload) and `boot/config-*`. Its
/// `boot/System.map-*` is an 83-byte placeholder; the real one is in [`KERNEL_DBG`].
pub(crate) const KERNEL_IMAGE: DebPin = DebPin {
    package: concat!("linux-image-", kernel_release!()),
    version: KERNEL_PACKAGE_VERSION,
    sha256: "e7d02b943971edcb8790e256c02cfab3bca6c3d37c1bf25392a57c71300615ee",
    size_bytes: 26_713_492,
};

/// The kernel's debug package; only its `System.map` is used. Deleted after extraction.
pub(crate) const KERNEL_DBG: DebPin = DebPin {
    package: concat!("linux-image-", kernel_release!(), "-dbg"),
    version: KERNEL_PACKAGE_VERSION,
    sha256: "a835edf97e22ec84ddcd4d773596376be9eaae0c5094053b14c8e557cf9d8fb7",
    size_bytes: 283_308_068,
};

/// Statically linked busybox with a standalone shell (applets run without symlinks).
pub(crate) const BUSYBOX: DebPin = DebPin {
    package: "busybox-static",
    version: "1:1.35.0-4+deb12u1+b1",
    sha256: "3d3fdbe91d4660c873e14b092c213fe81c1da6362daa236eb25d0171eb108744",
    size_bytes: 928_188,
};

/// Archive member of [`KERNEL_IMAGE`] holding the bzImage.
pub(crate) const VMLINUZ_MEMBER: &str = concat!("./boot/vmlinuz-", kernel_release!());
/// Archive member of [`KERNEL_IMAGE`] holding the kernel configuration.
pub(crate) const CONFIG_MEMBER: &str = concat!("./boot/config-", kernel_release!());
/// Archive member of [`KERNEL_DBG`] holding the full symbol map.
pub(crate) const SYSTEM_MAP_MEMBER: &str =
    concat!("./usr/lib/debug/boot/System.map-", kernel_release!());
/// Archive member of [`BUSYBOX`] holding the binary.
pub(crate) const BUSYBOX_MEMBER: &str = "./bin/busybox";

impl DebPin {
    /// The argument `apt-get download` takes: `package=version`.
    pub(crate) fn apt_spec(&self) -> String {
        format!("{}={}", self.package, self.version)
    }

    /// The file name `apt-get download` writes: `package_version_amd64.deb`, with the epoch
    /// colon URL-encoded as `%3a` as apt does.
    pub(crate) fn deb_file_name(&self) -> String {
        format!(
            "{}_{}_amd64.deb",
            self.package,
            self.version.replace(':', "%3a")
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_deb_file_name_url_encodes_epoch() {
        assert_eq!(
            BUSYBOX.deb_file_name(),
            "busybox-static_1%3a1.35.0-4+deb12u1+b1_amd64.deb"
        );
        assert_eq!(
            KERNEL_IMAGE.deb_file_name(),
            "linux-image-6.1.0-56-cloud-amd64_6.1.192-2_amd64.deb"
        );
    }

    #[test]
    fn test_kernel_packages_share_release_and_version() {
        assert_eq!(KERNEL_IMAGE.version, KERNEL_DBG.version);
        assert!(KERNEL_IMAGE.package.ends_with(KERNEL_RELEASE));
        assert_eq!(KERNEL_DBG.package, format!("{}-dbg", KERNEL_IMAGE.package));
        assert!(VMLINUZ_MEMBER.ends_with(KERNEL_RELEASE));
        assert!(SYSTEM_MAP_MEMBER.ends_with(KERNEL_RELEASE));
    }

    #[test]
    fn test_pins_are_lowercase_sha256() {
        for pin in [KERNEL_IMAGE, KERNEL_DBG, BUSYBOX] {
            assert_eq!(pin.sha256.len(), 64, "{}", pin.package);
            assert!(pin
                .sha256
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)));
        }
    }

    #[test]
    fn test_size_for_humans_rounds() {
        assert_eq!(KERNEL_IMAGE.size_for_humans(), "27 MB");
        assert_eq!(KERNEL_DBG.size_for_humans(), "283 MB");
        assert_eq!(BUSYBOX.size_for_humans(), "928 kB");
    }
}
