//! The tools kpin offers, listed once: each tool crate's [`ToolSpec`] (`pub const SPEC`).
//! The VMM checks `--tool` and `--tool-option` against [`TOOLS`] and lists them in
//! `kpin tools`; the engine image names them from here. Adding a tool: its crate's
//! `SPEC`, one line in [`TOOLS`] (and a dependency in this crate's `Cargo.toml`), and its arm in the engine
//! image's `Chosen::by_name` (`guest-engine/image/src/run/tools.rs`).
#![no_std]
#![deny(missing_docs)]

use core::fmt;

pub use kpin_tool::{OptionSpec, ToolSpec, ValueKind};

/// Every tool, in the order messages and `kpin tools` list them.
pub const TOOLS: &[&ToolSpec] = &[
    &kpin_tool_null::SPEC,
    &kpin_tool_bbcount::SPEC,
    &kpin_tool_cachesim::SPEC,
    &kpin_tool_insmix::SPEC,
    &kpin_tool_memtrace::SPEC,
];

/// The tool called `name`.
pub fn find(name: &str) -> Option<&'static ToolSpec> {
    TOOLS.iter().copied().find(|t| t.name == name)
}

/// The tools' names separated by `, ` (for messages; no allocation).
#[derive(Clone, Copy, Debug, Default)]
pub struct Names;

impl fmt::Display for Names {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, t) in TOOLS.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            f.write_str(t.name)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    extern crate alloc;
    use alloc::string::ToString;
    use alloc::vec::Vec;

    use super::*;

    #[test]
    fn test_names_are_unique_and_listed_in_order() {
        assert_eq!(
            Names.to_string(),
            "null, bbcount, cachesim, insmix, memtrace"
        );
        let mut names: Vec<&str> = TOOLS.iter().map(|t| t.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), TOOLS.len());
        assert_eq!(find("cachesim").unwrap().name, "cachesim");
        assert!(find("nosuch").is_none());
    }

    #[test]
    fn test_option_keys_are_unique_per_tool_and_defaults_fit_their_kind() {
        for t in TOOLS {
            let mut keys: Vec<&str> = t.options.iter().map(|o| o.key).collect();
            keys.sort_unstable();
            keys.dedup();
            assert_eq!(keys.len(), t.options.len(), "{}", t.name);
            for o in t.options {
                let Some(d) = o.default else { continue };
                let ok = match o.kind {
                    ValueKind::Choice(words) => words.contains(&d),
                    ValueKind::Count => d.parse::<u64>().is_ok(),
                    ValueKind::Size => d.trim_end_matches(['K', 'M', 'G']).parse::<u64>().is_ok(),
                    ValueKind::Path => false,
                };
                assert!(ok, "{}: {}={d}", t.name, o.key);
            }
        }
    }
}
