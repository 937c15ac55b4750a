//! The Debian bookworm guest (issue #26): a root file system made with `mmdebstrap` from
//! Debian's packages, packed into a raw ext4 disk image, with one initrd per pinned kernel
//! made inside it by `initramfs-tools`.
//!
//! Steps (all in `out_dir/debian-bookworm/`, skipped when the stamp matches):
//! 1. the pinned kernel packages (`downloads/`, the same verified `.deb`s the kernels
//!    come from) are installed into the root file system, so `/lib/modules/<release>`
//!    matches the kernel kpin boots;
//! 2. `mmdebstrap --mode=root --variant=essential` with [`PACKAGES`] and both kernels, its
//!    essential hook (`images/debian/essential`: initramfs-tools settings before the kernels
//!    install) and customize hook (`images/debian/customize`: hostname, fstab, the workload
//!    unit, masked units, the initrds, the workload's reference md5 run in a chroot);
//! 3. the initrds copied out of `/boot`, the disk image made with `mkfs.ext4 -d` (a sparse
//!    [`DISK_SIZE`] file), then the stamp.
//!
//! Invariants: the stamp names the SHA-256 of every input ([`inputs`]: the package list,
//! the mirrors, mmdebstrap's options, every file in `images/debian/`, the data file, the
//! kernel packages' pins), so changing any of them rebuilds the image; every output is
//! written under a temporary name and renamed; the disk image is never booted in place
//! (a run boots a copy), so its stamp checks size and modification time instead of hashing
//! 2 GiB on every call. Package versions come from the live mirror: a rebuild months later
//! may pick newer point releases (`packages.txt` lists what went in).

use std::fs::{self, File};
use std::io::{BufRead, BufReader};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::cache::{self, io_error, JobLock};
use crate::command::{self, CommandError};
use crate::debian::{ensure_deb, remove_dir_if_present};
use crate::layout;
use crate::{DebianImage, GuestKernel, ImagesError};

/// Bump when this module changes what it produces.
const BUILDER_VERSION: u32 = 1;

/// The suite the root file system is made from.
pub(crate) const SUITE: &str = "bookworm";

/// Debian's mirrors, as full `deb` lines: bookworm with its updates and security updates
/// (the 6.12 kernel comes from bookworm-security; its dependencies from bookworm).
const MIRRORS: [&str; 3] = [
    "deb http://deb.debian.org/debian bookworm main",
    "deb http://deb.debian.org/debian bookworm-updates main",
    "deb http://deb.debian.org/debian-security bookworm-security main",
];

/// The packages installed on top of Debian's essential set (their dependencies follow,
/// recommends do not). `dbus` lets `systemctl poweroff` and `systemd-logind` work;
/// `initramfs-tools`, `kmod`, `linux-base` are what the kernel packages need; `lz4`
/// compresses the initrds; `e2fsprogs` is the root file system's tools.
pub(crate) const PACKAGES: [&str; 14] = [
    "systemd-sysv",
    "udev",
    "dbus",
    "util-linux",
    "procps",
    "python3",
    "gcc",
    "libc6-dev",
    "sqlite3",
    "kmod",
    "initramfs-tools",
    "linux-base",
    "lz4",
    "e2fsprogs",
];

/// `SOURCE_DATE_EPOCH` for mmdebstrap and `mkfs.ext4` (2025-05-20T00:00:00Z, the date of
/// the Debian snapshot the build host's sources name): file times in the image.
const SOURCE_DATE_EPOCH: u64 = 1_747_699_200;

/// Size of the sparse disk image: the ~600 MiB root file system and room to write.
pub(crate) const DISK_SIZE: u64 = 2 << 30;

/// File system UUID and directory-hash seed of the disk image (fixed, for determinism).
const FS_UUID: &str = "6b70696e-6465-6269-616e-000000000001";
const FS_HASH_SEED: &str = "6b70696e-6465-6269-616e-000000000002";

/// Size of `data.bin`, the file the workload's `disk` test reads after a cache drop.
const DATA_BIN_LEN: usize = 8 << 20;

/// A file of `images/debian/`, placed in the staging directory the hooks read.
struct GuestFile {
    name: &'static str,
    text: &'static str,
    executable: bool,
}

/// Every file of `images/debian/`; the hooks install them into the image.
const FILES: [GuestFile; 11] = [
    GuestFile {
        name: "essential",
        text: include_str!("../debian/essential"),
        executable: true,
    },
    GuestFile {
        name: "customize",
        text: include_str!("../debian/customize"),
        executable: true,
    },
    GuestFile {
        name: "initramfs-hook",
        text: include_str!("../debian/initramfs-hook"),
        executable: true,
    },
    GuestFile {
        name: "initramfs.conf",
        text: include_str!("../debian/initramfs.conf"),
        executable: false,
    },
    GuestFile {
        name: "kpin-workload",
        text: include_str!("../debian/kpin-workload"),
        executable: true,
    },
    GuestFile {
        name: "kpin-workload.service",
        text: include_str!("../debian/kpin-workload.service"),
        executable: false,
    },
    GuestFile {
        name: "system.conf",
        text: include_str!("../debian/system.conf"),
        executable: false,
    },
    GuestFile {
        name: "services.conf",
        text: include_str!("../debian/services.conf"),
        executable: false,
    },
    GuestFile {
        name: "workload.py",
        text: include_str!("../debian/workload.py"),
        executable: false,
    },
    GuestFile {
        name: "workload.c",
        text: include_str!("../debian/workload.c"),
        executable: false,
    },
    GuestFile {
        name: "workload.sql",
        text: include_str!("../debian/workload.sql"),
        executable: false,
    },
];

/// mmdebstrap's options besides the packages, hooks and mirrors.
const MMDEBSTRAP_OPTIONS: [&str; 7] = [
    "--mode=root",
    "--format=directory",
    "--variant=essential",
    "--dpkgopt=path-exclude=/usr/share/doc/*",
    "--dpkgopt=path-include=/usr/share/doc/*/copyright",
    "--dpkgopt=path-exclude=/usr/share/man/*",
    "--dpkgopt=path-exclude=/usr/share/info/*",
];

/// The bytes of `data.bin`: [`DATA_BIN_LEN`] bytes of SplitMix64 output (seed "kpin"),
/// little-endian. The workload's `disk` test prints their SHA-256.
pub(crate) fn data_bin() -> Vec<u8> {
    let mut state: u64 = 0x6b70_696e;
    let mut out = Vec::with_capacity(DATA_BIN_LEN);
    while out.len() < DATA_BIN_LEN {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        out.extend_from_slice(&z.to_le_bytes());
    }
    out
}

/// The SHA-256 the workload's `disk` test must print (of [`data_bin`]).
pub fn disk_test_sha256() -> String {
    cache::sha256_hex(&data_bin())
}

/// A one-line description of everything the image is made from; its SHA-256 is the
/// stamp's input. `kernel_debs` are the SHA-256s of the pinned kernel packages.
pub(crate) fn inputs(kernel_debs: &[&str]) -> String {
    let mut text = format!(
        "debian image builder v{BUILDER_VERSION} suite {SUITE} mirrors [{}] packages [{}] \
         options [{}] epoch {SOURCE_DATE_EPOCH} disk {DISK_SIZE} uuid {FS_UUID} seed \
         {FS_HASH_SEED} kernels [{}] data.bin {}",
        MIRRORS.join(" | "),
        PACKAGES.join(" "),
        MMDEBSTRAP_OPTIONS.join(" "),
        kernel_debs.join(" "),
        disk_test_sha256(),
    );
    for file in &FILES {
        text.push_str(&format!(
            " {}:{}:{}",
            file.name,
            file.executable,
            cache::sha256_hex(file.text.as_bytes())
        ));
    }
    format!("sha256:{}", cache::sha256_hex(text.as_bytes()))
}

/// The stamp line of the disk image: the inputs plus the file's size and modification
/// time (nanoseconds).
fn disk_identity(disk: &Path) -> Option<String> {
    let meta = fs::metadata(disk).ok()?;
    Some(format!(
        "size {} mtime {}.{:09}",
        meta.len(),
        meta.mtime(),
        meta.mtime_nsec()
    ))
}

/// See [`crate::ensure_debian`].
pub(crate) fn ensure(
    kernel: GuestKernel,
    out_dir: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<DebianImage, ImagesError> {
    let linux = crate::ensure_linux_kernel(kernel, out_dir, progress)?;
    let _lock = JobLock::acquire(out_dir, "debian", progress)?;
    let dir = layout::debian_dir(out_dir);
    cache::create_dir_all(&dir)?;
    cache::remove_stale_temps(&dir)?;

    let downloads = layout::downloads_dir(out_dir);
    let mut debs = Vec::new();
    {
        // The kernel packages live in the Linux job's download directory: under its lock.
        let _linux = JobLock::acquire(out_dir, "linux", progress)?;
        for k in GuestKernel::ALL {
            debs.push(ensure_deb(&k.pins().image, &downloads, progress)?);
        }
    }
    let shas: Vec<&str> = GuestKernel::ALL
        .iter()
        .map(|k| k.pins().image.sha256)
        .collect();
    let inputs = inputs(&shas);

    let image = DebianImage {
        disk: dir.join(layout::debian_files::DISK),
        initrd: dir.join(layout::debian_files::initrd(kernel.release())),
        expected_md5: String::new(),
        linux,
    };
    let expected_path = dir.join(layout::debian_files::EXPECTED_MD5);
    if let Some(md5) = fresh(out_dir, &dir, &image.disk, &expected_path, &inputs)? {
        return Ok(DebianImage {
            expected_md5: md5,
            ..image
        });
    }

    progress(&format!(
        "building the Debian {SUITE} image in {} (mmdebstrap; takes a few minutes)",
        dir.display()
    ));
    preflight()?;
    let build = dir.join(".build");
    refuse_mounts_beneath(&build)?;
    remove_dir_if_present(&build)?;
    let files = build.join("files");
    let rootfs = build.join("rootfs");
    stage_files(&files)?;
    run_mmdebstrap(&debs, &files, &rootfs, progress)?;

    let md5_text =
        fs::read_to_string(files.join("expected-md5")).map_err(io_error("read", &files))?;
    let md5 = md5_text.trim().to_owned();
    if md5.len() != 32 || !md5.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(ImagesError::DebianImage {
            why: format!(
                "the workload run at build time (in a chroot) printed {md5_text:?}, not an md5"
            ),
        });
    }

    for k in GuestKernel::ALL {
        let from = rootfs
            .join("boot")
            .join(format!("initrd.img-{}", k.release()));
        let to = dir.join(layout::debian_files::initrd(k.release()));
        let bytes = fs::read(&from).map_err(|source| ImagesError::Io {
            action: "read the initrd initramfs-tools made,",
            path: from.clone(),
            source,
        })?;
        cache::write_atomic(&to, &bytes)?;
        cache::stamp_file(out_dir, &to, &inputs)?;
    }
    let packages = files.join("packages.txt");
    if packages.exists() {
        let to = dir.join(layout::debian_files::PACKAGES);
        let bytes = fs::read(&packages).map_err(io_error("read", &packages))?;
        cache::write_atomic(&to, &bytes)?;
    }

    progress(&format!(
        "packing the root file system into {} (mkfs.ext4 -d, {} GiB sparse)",
        image.disk.display(),
        DISK_SIZE >> 30
    ));
    make_ext4(&rootfs, &image.disk)?;
    refuse_mounts_beneath(&build)?;
    remove_dir_if_present(&build)?;

    cache::write_atomic(&expected_path, format!("{md5}\n").as_bytes())?;
    cache::stamp_file(out_dir, &expected_path, &inputs)?;
    let identity = disk_identity(&image.disk).ok_or_else(|| ImagesError::DebianImage {
        why: format!("{} vanished after it was made", image.disk.display()),
    })?;
    cache::write_atomic(
        &dir.join(layout::debian_files::STAMP),
        format!("{inputs}\n{identity}\n").as_bytes(),
    )?;
    progress(&format!("Debian image ready; the workload's md5 is {md5}"));
    Ok(DebianImage {
        expected_md5: md5,
        ..image
    })
}

/// The expected md5 if the disk image, every initrd and the md5 file are present and
/// stamped with `inputs`; `None` if anything must be rebuilt.
fn fresh(
    out_dir: &Path,
    dir: &Path,
    disk: &Path,
    expected: &Path,
    inputs: &str,
) -> Result<Option<String>, ImagesError> {
    let stamp = fs::read_to_string(dir.join(layout::debian_files::STAMP)).unwrap_or_default();
    let Some(identity) = disk_identity(disk) else {
        return Ok(None);
    };
    if stamp != format!("{inputs}\n{identity}\n") {
        return Ok(None);
    }
    for k in GuestKernel::ALL {
        let initrd = dir.join(layout::debian_files::initrd(k.release()));
        if cache::fresh_sha256(out_dir, &initrd, inputs)?.is_none() {
            return Ok(None);
        }
    }
    if cache::fresh_sha256(out_dir, expected, inputs)?.is_none() {
        return Ok(None);
    }
    let md5 = fs::read_to_string(expected).map_err(io_error("read", expected))?;
    Ok(Some(md5.trim().to_owned()))
}

/// An error if anything is mounted at or beneath `dir`: an mmdebstrap that was killed
/// leaves the host's `/proc`, `/sys`, `/dev` entries or the kernel packages bind-mounted
/// in its root file system, and removing the tree would then reach into the host's.
fn refuse_mounts_beneath(dir: &Path) -> Result<(), ImagesError> {
    let table = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mounted = mount_points_beneath(&table, dir);
    if mounted.is_empty() {
        return Ok(());
    }
    Err(ImagesError::DebianImage {
        why: format!(
            "an interrupted build left {} mounted beneath {} ({}); unmount them (`umount -R \
             {}`) and run again",
            mounted.len(),
            dir.display(),
            mounted.join(", "),
            dir.join("rootfs").display()
        ),
    })
}

/// The mount points of `mountinfo` (the text of `/proc/self/mountinfo`) at or beneath `dir`.
pub(crate) fn mount_points_beneath(mountinfo: &str, dir: &Path) -> Vec<String> {
    mountinfo
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(unescape_mount_point)
        .filter(|point| Path::new(point).starts_with(dir))
        .collect()
}

/// A mountinfo field with its octal escapes (`\040` for a space) decoded.
fn unescape_mount_point(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes.get(i + 1..i + 4).and_then(|d| {
            d.iter()
                .all(|b| (b'0'..=b'7').contains(b))
                .then(|| (d[0] - b'0') * 64 + (d[1] - b'0') * 8 + (d[2] - b'0'))
        });
        match (bytes[i], octal) {
            (b'\\', Some(byte)) => {
                out.push(byte);
                i += 4;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Root, `mmdebstrap` and `mkfs.ext4` are there, or a clear error saying what to do.
fn preflight() -> Result<(), ImagesError> {
    // SAFETY: geteuid has no arguments and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Err(ImagesError::DebianPrerequisite {
            why: "building it needs root (mmdebstrap --mode=root chroots and installs \
                  packages; mkfs.ext4 -d copies their owners): run `kpin images --debian` \
                  as root once; runs then use the cached image"
                .to_owned(),
        });
    }
    for (tool, package) in [("mmdebstrap", "mmdebstrap"), ("mkfs.ext4", "e2fsprogs")] {
        let found = Command::new(tool)
            .arg("--version")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok();
        if !found {
            return Err(ImagesError::DebianPrerequisite {
                why: format!(
                    "`{tool}` is not installed: `apt-get install {package}` (.ci/setup does)"
                ),
            });
        }
    }
    Ok(())
}

/// Writes `images/debian/`'s files and `data.bin` into `files`.
fn stage_files(files: &Path) -> Result<(), ImagesError> {
    cache::create_dir_all(files)?;
    for file in &FILES {
        let path = files.join(file.name);
        cache::write_atomic(&path, file.text.as_bytes())?;
        let mode = if file.executable { 0o755 } else { 0o644 };
        fs::set_permissions(&path, fs::Permissions::from_mode(mode))
            .map_err(io_error("set the mode of", &path))?;
    }
    cache::write_atomic(&files.join("data.bin"), &data_bin())
}

/// The mmdebstrap command line.
fn mmdebstrap_command(debs: &[PathBuf], files: &Path, rootfs: &Path) -> Command {
    let mut cmd = Command::new("mmdebstrap");
    cmd.args(MMDEBSTRAP_OPTIONS)
        .arg(format!("--include={}", PACKAGES.join(",")));
    for deb in debs {
        cmd.arg(format!("--include={}", deb.display()));
    }
    cmd.arg("--hook-dir=/usr/share/mmdebstrap/hooks/file-mirror-automount")
        .arg(format!(
            "--essential-hook={}",
            files.join("essential").display()
        ))
        .arg(format!(
            "--customize-hook={}",
            files.join("customize").display()
        ))
        .arg(SUITE)
        .arg(rootfs)
        .args(MIRRORS)
        .env("SOURCE_DATE_EPOCH", SOURCE_DATE_EPOCH.to_string())
        .env("KPIN_DEBIAN_FILES", files);
    cmd
}

/// Runs mmdebstrap, forwarding its `I:` lines to `progress`; its whole output goes to
/// `files/../mmdebstrap.log`.
fn run_mmdebstrap(
    debs: &[PathBuf],
    files: &Path,
    rootfs: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<(), ImagesError> {
    let mut cmd = mmdebstrap_command(debs, files, rootfs);
    let described = command::describe(&cmd);
    let log_path = files.with_file_name("mmdebstrap.log");
    let log = File::create(&log_path).map_err(io_error("create", &log_path))?;
    let log_for_stdout = log.try_clone().map_err(io_error("open", &log_path))?;
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(log_for_stdout)
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| ImagesError::DebianBuild {
            command: described.clone(),
            log: log_path.clone(),
            source: CommandError::Spawn(source),
        })?;
    let stderr = child.stderr.take().expect("stderr was configured as piped");
    let mut all = Vec::new();
    let mut log = log;
    for line in BufReader::new(stderr).split(b'\n') {
        let line = line.map_err(|e| ImagesError::DebianBuild {
            command: described.clone(),
            log: log_path.clone(),
            source: CommandError::Wait(e),
        })?;
        use std::io::Write as _;
        let _ = log.write_all(&line);
        let _ = log.write_all(b"\n");
        let text = String::from_utf8_lossy(&line);
        if let Some(info) = text.strip_prefix("I: ") {
            progress(&format!("mmdebstrap: {info}"));
        }
        all.extend_from_slice(&line);
        all.push(b'\n');
    }
    let status = child.wait().map_err(|e| ImagesError::DebianBuild {
        command: described.clone(),
        log: log_path.clone(),
        source: CommandError::Wait(e),
    })?;
    command::check_status(status, &all).map_err(|source| {
        let text = String::from_utf8_lossy(&all);
        if mirror_unreachable(&text) {
            ImagesError::DebianMirror {
                command: described.clone(),
                source,
            }
        } else {
            ImagesError::DebianBuild {
                command: described.clone(),
                log: log_path.clone(),
                source,
            }
        }
    })
}

/// Whether mmdebstrap's output says the mirror could not be reached.
pub(crate) fn mirror_unreachable(output: &str) -> bool {
    [
        "Temporary failure resolving",
        "Could not resolve",
        "Could not connect",
        "Unable to connect",
        "Failed to fetch",
        "Connection timed out",
        "Network is unreachable",
    ]
    .iter()
    .any(|needle| output.contains(needle))
}

/// `mkfs.ext4 -d rootfs` into a sparse [`DISK_SIZE`] file, renamed to `disk` when done.
fn make_ext4(rootfs: &Path, disk: &Path) -> Result<(), ImagesError> {
    let temp = disk.with_file_name(format!(".disk.img.kpin-tmp-{}-0", std::process::id()));
    let _ = fs::remove_file(&temp);
    let file = File::create(&temp).map_err(io_error("create", &temp))?;
    file.set_len(DISK_SIZE)
        .map_err(io_error("set the size of", &temp))?;
    drop(file);
    let mut cmd = Command::new("mkfs.ext4");
    cmd.args(["-q", "-F", "-L", "kpin-debian", "-U", FS_UUID, "-E"])
        .arg(format!("hash_seed={FS_HASH_SEED},root_owner=0:0"))
        .arg("-d")
        .arg(rootfs)
        .arg(&temp)
        .env("E2FSPROGS_FAKE_TIME", SOURCE_DATE_EPOCH.to_string());
    let result = command::run_captured(&mut cmd).map_err(|source| ImagesError::DebianMkfs {
        command: command::describe(&cmd),
        source,
    });
    if let Err(e) = result {
        let _ = fs::remove_file(&temp);
        return Err(e);
    }
    cache::install_file(&temp, disk)
}

/// See [`crate::copy_disk`].
pub(crate) fn copy_disk(from: &Path, to: &Path) -> Result<(), ImagesError> {
    use std::os::fd::AsRawFd;
    let src = File::open(from).map_err(io_error("open", from))?;
    let len = src.metadata().map_err(io_error("stat", from))?.len();
    let temp = to.with_file_name(format!(
        ".{}.kpin-tmp-{}-0",
        to.file_name()
            .map(|n| n.to_string_lossy())
            .unwrap_or_default(),
        std::process::id()
    ));
    let dst = File::create(&temp).map_err(io_error("create", &temp))?;
    // A reflink where the file system has them (btrfs, XFS): instant, no space.
    // SAFETY: FICLONE reads the source descriptor argument only; both descriptors are
    // owned by `src` and `dst`, which outlive the call.
    let cloned = unsafe { libc::ioctl(dst.as_raw_fd(), libc::FICLONE, src.as_raw_fd()) } == 0;
    let result = if cloned {
        Ok(())
    } else {
        copy_data_ranges(&src, &dst, len).map_err(io_error("copy the disk image to", &temp))
    };
    let result = result.and_then(|()| dst.set_len(len).map_err(io_error("set the size of", &temp)));
    drop(dst);
    if let Err(e) = result {
        let _ = fs::remove_file(&temp);
        return Err(e);
    }
    cache::install_file(&temp, to)
}

/// Copies the data ranges of `src` (`SEEK_DATA`/`SEEK_HOLE`) to the same offsets in `dst`,
/// leaving the holes unwritten: the copy is as sparse as the source. Each range is copied
/// in the kernel ([`kernel_copy`]) where it can, else read and written here.
fn copy_data_ranges(src: &File, dst: &File, len: u64) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::FileExt;
    let fd = src.as_raw_fd();
    let mut buf = vec![0u8; 1 << 20];
    let mut offset: u64 = 0;
    while offset < len {
        let seek = |from: u64, whence: libc::c_int| -> std::io::Result<Option<u64>> {
            let start = libc::off_t::try_from(from).map_err(std::io::Error::other)?;
            // SAFETY: lseek only reads its integer arguments; `fd` is open for the call.
            let at = unsafe { libc::lseek(fd, start, whence) };
            if at < 0 {
                let err = std::io::Error::last_os_error();
                // ENXIO: no data at or after `from`.
                return if err.raw_os_error() == Some(libc::ENXIO) {
                    Ok(None)
                } else {
                    Err(err)
                };
            }
            Ok(Some(at as u64))
        };
        let Some(data) = seek(offset, libc::SEEK_DATA)? else {
            break;
        };
        let end = seek(data, libc::SEEK_HOLE)?.unwrap_or(len).min(len);
        let mut at = kernel_copy(src, dst, data, end)?;
        while at < end {
            let want = usize::try_from((end - at).min(buf.len() as u64)).unwrap_or(buf.len());
            let n = src.read_at(&mut buf[..want], at)?;
            if n == 0 {
                break;
            }
            dst.write_all_at(&buf[..n], at)?;
            at += n as u64;
        }
        offset = end;
    }
    Ok(())
}

/// Copies `[from, end)` of `src` to the same offsets in `dst` inside the kernel
/// (`copy_file_range`: no trip through a user-space buffer); returns where it stopped —
/// `end`, or earlier if the file systems cannot (`EXDEV`, `EINVAL`, `ENOSYS`,
/// `EOPNOTSUPP`: the caller copies the rest by reading and writing).
fn kernel_copy(src: &File, dst: &File, from: u64, end: u64) -> std::io::Result<u64> {
    use std::os::fd::AsRawFd;
    let mut at = from;
    while at < end {
        let (Ok(mut off_in), Ok(mut off_out)) =
            (libc::loff_t::try_from(at), libc::loff_t::try_from(at))
        else {
            return Ok(at);
        };
        let want = usize::try_from(end - at).unwrap_or(usize::MAX).min(1 << 30);
        // SAFETY: both descriptors are open for the call (borrowed from `src` and `dst`);
        // the offsets are locals the kernel reads and updates.
        let n = unsafe {
            libc::copy_file_range(
                src.as_raw_fd(),
                &mut off_in,
                dst.as_raw_fd(),
                &mut off_out,
                want,
                0,
            )
        };
        if n < 0 {
            let err = std::io::Error::last_os_error();
            return match err.raw_os_error() {
                Some(libc::EXDEV | libc::EINVAL | libc::ENOSYS | libc::EOPNOTSUPP) => Ok(at),
                _ => Err(err),
            };
        }
        if n == 0 {
            // The source is shorter than its data range said: stop as a read would.
            return Ok(end);
        }
        at += n as u64;
    }
    Ok(at)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_data_bin_is_splitmix64_of_kpin() {
        let data = data_bin();
        assert_eq!(data.len(), DATA_BIN_LEN);
        // The first output of SplitMix64 seeded with 0x6b70696e, and the file's hash as
        // the guest's sha256sum prints it (cross-checked with a Python reimplementation).
        assert_eq!(
            disk_test_sha256(),
            "0908eb03b1f2eaba69781848e0e38f4edf6cc397a0f674285d096b80a4a1d38f"
        );
    }

    #[test]
    fn test_inputs_change_with_every_input() {
        let base = inputs(&["a", "b"]);
        assert!(base.starts_with("sha256:"));
        assert_eq!(
            base,
            inputs(&["a", "b"]),
            "the stamp input is deterministic"
        );
        assert_ne!(base, inputs(&["a", "c"]), "a kernel package changed");
    }

    #[test]
    fn test_every_file_of_images_debian_is_staged() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("debian");
        let mut on_disk: Vec<String> = fs::read_dir(&dir)
            .expect("images/debian exists")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        on_disk.sort();
        let mut staged: Vec<String> = FILES.iter().map(|f| f.name.to_owned()).collect();
        staged.sort();
        assert_eq!(on_disk, staged, "a file of images/debian/ is not in FILES");
        for file in &FILES {
            let mode = fs::metadata(dir.join(file.name))
                .expect("stat")
                .permissions()
                .mode();
            assert_eq!(mode & 0o100 != 0, file.executable, "{}", file.name);
        }
    }

    #[test]
    fn test_workload_unit_runs_after_multi_user_and_is_wanted_by_it() {
        let unit = FILES
            .iter()
            .find(|f| f.name == "kpin-workload.service")
            .expect("the unit is staged")
            .text;
        let line = |key: &str| {
            unit.lines()
                .find(|l| l.starts_with(key))
                .unwrap_or_else(|| panic!("no {key} line"))
                .to_owned()
        };
        assert_eq!(line("After="), "After=multi-user.target");
        assert_eq!(line("WantedBy="), "WantedBy=multi-user.target");
        assert_eq!(line("Type="), "Type=oneshot");
        assert_eq!(
            line("ExecStart="),
            "ExecStart=/usr/local/bin/kpin-workload boot"
        );
        assert_eq!(line("TTYPath="), "TTYPath=/dev/console");
    }

    #[test]
    fn test_mmdebstrap_command_names_packages_kernels_hooks_and_mirrors() {
        let debs = [PathBuf::from("/o/downloads/linux-image-x.deb")];
        let cmd = mmdebstrap_command(&debs, Path::new("/o/files"), Path::new("/o/rootfs"));
        let line = command::describe(&cmd);
        assert!(line.starts_with("mmdebstrap --mode=root"), "{line}");
        assert!(line.contains("--include=systemd-sysv,udev,dbus,"), "{line}");
        assert!(
            line.contains("--include=/o/downloads/linux-image-x.deb"),
            "{line}"
        );
        assert!(
            line.contains("--essential-hook=/o/files/essential"),
            "{line}"
        );
        assert!(
            line.contains("--customize-hook=/o/files/customize"),
            "{line}"
        );
        assert!(
            line.ends_with(
                "bookworm /o/rootfs 'deb http://deb.debian.org/debian bookworm main' \
                 'deb http://deb.debian.org/debian bookworm-updates main' \
                 'deb http://deb.debian.org/debian-security bookworm-security main'"
            ),
            "{line}"
        );
    }

    #[test]
    fn test_copy_disk_keeps_content_and_holes() {
        let dir = crate::cache::tests::ScratchDir::new("copy-disk");
        let from = dir.0.join("from.img");
        let file = File::create(&from).expect("create");
        file.set_len(64 << 20).expect("size");
        use std::os::unix::fs::FileExt;
        file.write_all_at(b"start", 0).expect("write");
        file.write_all_at(b"middle", 20 << 20).expect("write");
        file.write_all_at(b"end", (64 << 20) - 3).expect("write");
        drop(file);
        let to = dir.0.join("to.img");
        copy_disk(&from, &to).expect("copy");
        assert_eq!(
            fs::read(&from).expect("read"),
            fs::read(&to).expect("read"),
            "the copy differs"
        );
        let blocks = fs::metadata(&to).expect("stat").blocks();
        assert!(
            blocks * 512 < 8 << 20,
            "the copy is not sparse: {blocks} blocks"
        );
    }

    #[test]
    fn test_mount_points_beneath_finds_leftover_mounts_only() {
        let table = "22 1 0:21 / /proc rw - proc proc rw\n\
                     90 1 0:21 / /o/debian-bookworm/.build/rootfs/proc rw - proc proc rw\n\
                     91 1 8:1 /x /o/debian-bookworm/.build/rootfs/a\\040b rw - ext4 /dev/vda rw\n\
                     92 1 8:1 / /o/debian-bookworm/.builder rw - ext4 /dev/vda rw\n";
        assert_eq!(
            mount_points_beneath(table, Path::new("/o/debian-bookworm/.build")),
            vec![
                "/o/debian-bookworm/.build/rootfs/proc".to_owned(),
                "/o/debian-bookworm/.build/rootfs/a b".to_owned()
            ]
        );
        assert!(refuse_mounts_beneath(Path::new("/nonexistent/kpin/.build")).is_ok());
    }

    #[test]
    fn test_mirror_unreachable_recognises_apt_errors() {
        assert!(mirror_unreachable(
            "E: Failed to fetch http://deb.debian.org/debian/dists/bookworm/InRelease  \
             Temporary failure resolving 'deb.debian.org'"
        ));
        assert!(!mirror_unreachable("E: Unable to locate package nosuch"));
    }
}
