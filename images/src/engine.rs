//! The engine image (`guest-engine/image`, binary `kpin-engine`), built for
//! `x86_64-unknown-none` by [`crate::nostd`] and published as `out_dir/kpin-engine.elf`.
//! The VMM loads it into the stolen region for `kpin run --tool`.

use std::path::{Path, PathBuf};

use crate::nostd::{self, NoStdCrate};
use crate::{layout, repo_root, ImagesError};

/// The engine image's manifest in the repository.
pub(crate) fn manifest_path() -> PathBuf {
    repo_root()
        .join("guest-engine")
        .join("image")
        .join("Cargo.toml")
}

/// See [`crate::ensure_engine`].
pub(crate) fn ensure(
    out_dir: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<PathBuf, ImagesError> {
    let manifest = manifest_path();
    let c = NoStdCrate {
        what: "the engine image",
        manifest: &manifest,
        binary: "kpin-engine",
        lock: "engine",
        target_dir: layout::engine_target_dir(out_dir),
        dest: layout::engine_elf(out_dir),
    };
    nostd::build(&c, out_dir, progress)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_manifest_path_is_in_the_repository() {
        assert!(manifest_path().ends_with("guest-engine/image/Cargo.toml"));
    }
}
