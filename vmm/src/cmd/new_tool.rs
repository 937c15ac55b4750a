//! `kpin new-tool DIR --name NAME`: a working skeleton of an out-of-tree tool crate (a
//! per-CPL instruction counter, `vmm/templates/`), ready for `kpin run --tool-crate DIR
//! --tool NAME`.

use std::path::Path;

use anyhow::{bail, Context};
use vmm::input_check::UsageError;

const LIB_RS: &str = include_str!("../../templates/tool-lib.rs");
const CARGO_TOML: &str = include_str!("../../templates/tool-Cargo.toml");

/// Writes the skeleton into `dir`, which must not exist yet.
pub(crate) fn new_tool(dir: &Path, name: &str) -> anyhow::Result<()> {
    vmm::engine::attach::tool_name(name).map_err(|e| UsageError(e.to_string()))?;
    if kpin_tool_registry::find(name).is_some() {
        return Err(UsageError(format!(
            "{name:?} is a tool kpin already has: choose another name"
        ))
        .into());
    }
    if dir.symlink_metadata().is_ok() {
        bail!(
            "{} exists: kpin new-tool writes a new directory",
            dir.display()
        );
    }
    // The tree kpin was built from: its `images/out`'s grandparent.
    let out = kpin_images::default_out_dir();
    let kpin_tool = out
        .parent()
        .and_then(Path::parent)
        .map(|root| root.join("tools").join("kpin-tool"))
        .filter(|p| p.join("Cargo.toml").is_file())
        .context("cannot find tools/kpin-tool in the kpin tree this kpin was built from")?;
    std::fs::create_dir_all(dir.join("src"))
        .with_context(|| format!("cannot create {}", dir.display()))?;
    let manifest = CARGO_TOML
        .replace("{name}", name)
        .replace("{kpin_tool}", &kpin_tool.display().to_string());
    std::fs::write(dir.join("Cargo.toml"), manifest)
        .with_context(|| format!("cannot write {}/Cargo.toml", dir.display()))?;
    std::fs::write(dir.join("src/lib.rs"), LIB_RS.replace("{name}", name))
        .with_context(|| format!("cannot write {}/src/lib.rs", dir.display()))?;
    println!(
        "wrote the {name} tool crate in {}; run it with: kpin run --tool-crate {} --tool {name}",
        dir.display(),
        dir.display()
    );
    Ok(())
}
