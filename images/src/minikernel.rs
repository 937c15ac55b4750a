//! The mini-kernel guest (`tests/guests/minikernel`), built for `x86_64-unknown-none` by
//! [`crate::nostd`] and published as `out_dir/minikernel.elf`.

use std::path::{Path, PathBuf};

use crate::nostd::{self, NoStdCrate};
use crate::{layout, repo_root, ImagesError};

/// The mini-kernel's manifest in the repository.
pub(crate) fn manifest_path() -> PathBuf {
    repo_root()
        .join("tests")
        .join("guests")
        .join("minikernel")
        .join("Cargo.toml")
}

/// See [`crate::ensure_minikernel`].
pub(crate) fn ensure(
    out_dir: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<PathBuf, ImagesError> {
    let manifest = manifest_path();
    let c = NoStdCrate {
        what: "the mini-kernel",
        manifest: &manifest,
        binary: "minikernel",
        lock: "minikernel",
        target_dir: layout::minikernel_target_dir(out_dir),
        dest: layout::minikernel_elf(out_dir),
    };
    nostd::build(&c, out_dir, progress)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_manifest_path_is_in_the_repository() {
        let manifest = manifest_path();
        assert!(manifest.ends_with("tests/guests/minikernel/Cargo.toml"));
        assert!(repo_root().join("images").join("Cargo.toml").is_file());
    }
}
