//! Additions tests append to the busybox initramfs (the kernel unpacks concatenated newc
//! archives in order, later files replacing earlier ones): [`overlay`] builds such an
//! archive, and the pinned packages it carries are extracted here — the i386 busybox
//! ([`ensure_busybox_i386`]) and gdb-minimal (`gdb.rs`).

use std::path::{Path, PathBuf};

use crate::cache;
use crate::cpio::CpioWriter;
use crate::debian::{self, Member};
use crate::pins::{DebPin, BUSYBOX_I386, BUSYBOX_MEMBER};
use crate::ImagesError;

/// A newc archive holding `files` (path relative to `/`, content, permission bits), with
/// directory entries for their parents first.
pub fn overlay(files: &[(&str, &[u8], u32)]) -> Result<Vec<u8>, ImagesError> {
    let initramfs_error = |source| ImagesError::Initramfs { source };
    let mut dirs: Vec<&str> = Vec::new();
    for (path, _, _) in files {
        let mut at = 0;
        while let Some(slash) = path[at..].find('/') {
            let dir = &path[..at + slash];
            if !dirs.contains(&dir) {
                dirs.push(dir);
            }
            at += slash + 1;
        }
    }
    let mut archive = CpioWriter::new();
    for d in dirs {
        archive.dir(d, 0o755).map_err(initramfs_error)?;
    }
    for (path, data, perm) in files {
        archive.file(path, *perm, data).map_err(initramfs_error)?;
    }
    Ok(archive.finish())
}

/// Makes sure `out_dir/<dir>/<name>` holds `member` of the pinned, verified package
/// `pin` (cached with a stamp); returns its path.
pub(crate) fn ensure_member(
    out_dir: &Path,
    pin: &DebPin,
    member: &str,
    dir: &str,
    name: &str,
    progress: &mut dyn FnMut(&str),
) -> Result<PathBuf, ImagesError> {
    let dir = out_dir.join(dir);
    let dest = dir.join(name);
    let inputs = format!("{} {member}", pin.identity());
    if cache::fresh_sha256(out_dir, &dest, &inputs)?.is_some() {
        return Ok(dest);
    }
    cache::create_dir_all(&dir)?;
    let deb = debian::ensure_deb(pin, &dir, progress)?;
    progress(&format!("extracting {member} from {}", deb.display()));
    debian::extract_members(
        &deb,
        &[Member {
            name: member,
            dest: &dest,
        }],
        &dir.join("extract"),
    )?;
    cache::stamp_file(out_dir, &dest, &inputs)?;
    Ok(dest)
}

/// Makes sure the i386 build of the initramfs' busybox is in `out_dir/busybox-i386/`;
/// returns its path.
pub fn ensure_busybox_i386(
    out_dir: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<PathBuf, ImagesError> {
    ensure_member(
        out_dir,
        &BUSYBOX_I386,
        BUSYBOX_MEMBER,
        "busybox-i386",
        "busybox",
        progress,
    )
}
