//! The tools kpin offers, listed once: the [`registry!`] call below names each tool
//! crate, and everything else is derived from that list — [`TOOLS`] (each crate's
//! [`ToolSpec`], `pub const SPEC`: names, summaries, options), [`ENTRIES`] (with each
//! crate's constructor, `pub fn new_tool`, which the engine image builds the chosen tool
//! with) and, with the `host` feature, [`host::HOST_TOOLS`] (each crate's host-side part,
//! `pub const HOST`, whose hooks the VMM calls). The VMM checks `--tool` and
//! `--tool-option` against this list, prints it in `kpin tools` and `kpin run --help`,
//! and runs the chosen tool's host part; the engine image offers exactly these tools.
//! Neither names a tool.
//!
//! Adding a tool: its crate in the workspace's `members`, a dependency here (and its
//! `host` feature in this crate's `host` feature if it has a host part), and one line in
//! the [`registry!`] call (`kpin_tool_NAME` or `kpin_tool_NAME: host`); then `kpin images`
//! rebuilds the engine image with it. Removing one is the reverse: it is gone from
//! `kpin tools`, `--tool`'s help and checks, the VMM's host hooks and the image.
#![no_std]
#![deny(missing_docs)]

#[cfg(feature = "host")]
extern crate std;

use core::fmt;

pub use kpin_tool::{HostPart, NewTool, OptionSpec, ToolSpec, ValueKind};

/// A registered tool: what it is and how the engine image builds it.
#[derive(Clone, Copy)]
pub struct Entry {
    /// The crate's `SPEC`.
    pub spec: &'static ToolSpec,
    /// The crate's `new_tool`.
    pub new_tool: NewTool,
}

/// Declares the registry from one list of tool crates: `crate_name` for a tool that runs
/// only in the engine, `crate_name: host` for one with a host-side part (`HOST`).
macro_rules! registry {
    ($($krate:ident $(: $host:ident)?),* $(,)?) => {
        /// Every tool, in the order messages and `kpin tools` list them.
        pub const TOOLS: &[&ToolSpec] = &[$(&$krate::SPEC),*];

        /// Every tool with its constructor, in [`TOOLS`]' order (the engine image's table).
        pub const ENTRIES: &[Entry] = &[$(Entry {
            spec: &$krate::SPEC,
            new_tool: $krate::new_tool,
        }),*];

        /// The tools' host-side parts (feature `host`: the VMM's).
        #[cfg(feature = "host")]
        pub mod host {
            use kpin_tool::host_side::HostTool;

            /// Every tool's host-side part, in [`TOOLS`](crate::TOOLS)' order: the crate's
            /// `HOST`, or an `EngineOnly` that does nothing.
            pub const HOST_TOOLS: &[&dyn HostTool] = &[$(registry!(@host $krate $($host)?)),*];

            /// The host-side part of the tool called `name`.
            pub fn find(name: &str) -> Option<&'static dyn HostTool> {
                HOST_TOOLS.iter().copied().find(|t| t.spec().name == name)
            }
        }
    };
    (@host $krate:ident host) => { &$krate::HOST };
    (@host $krate:ident) => { &kpin_tool::host_side::EngineOnly(&$krate::SPEC) };
}

registry! {
    kpin_tool_null,
    kpin_tool_bbcount: host,
    kpin_tool_cachesim: host,
    kpin_tool_insmix: host,
    kpin_tool_memtrace: host,
}

/// The tool a resident engine runs (`kpin run --resident`, a window closed with
/// `detach --resident`): translation only, no instrumentation.
pub const RESIDENT: &ToolSpec = &kpin_tool_null::SPEC;

/// The tool called `name`.
pub fn find(name: &str) -> Option<&'static ToolSpec> {
    TOOLS.iter().copied().find(|t| t.name == name)
}

/// The registered tool called `name`, with its constructor.
pub fn entry(name: &str) -> Option<&'static Entry> {
    ENTRIES.iter().find(|e| e.spec.name == name)
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

    /// One list: the engine image's table (`ENTRIES`, each tool built by its crate's
    /// constructor) and the VMM's host parts (`host::HOST_TOOLS`) are `TOOLS`, same names
    /// in the same order, so a tool taken out of the `registry!` call is gone from all
    /// three (`kpin tools`, `--tool`'s help and checks, the image, the host hooks).
    #[test]
    fn test_the_engine_and_host_tables_are_the_tools_list() {
        let names: Vec<&str> = TOOLS.iter().map(|t| t.name).collect();
        let engine: Vec<&str> = ENTRIES.iter().map(|e| e.spec.name).collect();
        let host: Vec<&str> = host::HOST_TOOLS.iter().map(|h| h.spec().name).collect();
        assert_eq!(engine, names);
        assert_eq!(host, names);
        for e in ENTRIES {
            let tool = (e.new_tool)("").unwrap_or_else(|err| panic!("{}: {err}", e.spec.name));
            assert_eq!(
                tool.name(),
                e.spec.name,
                "the constructor builds its own tool"
            );
            assert_eq!(entry(e.spec.name).unwrap().spec.name, e.spec.name);
        }
        assert!(entry("nosuch").is_none() && host::find("nosuch").is_none());
        assert!(find(RESIDENT.name).is_some());
    }

    /// A SPEC that lets its records go to the host has a host part that takes them, and
    /// only such a SPEC; a tool with host hooks says what they do in its SPEC.
    #[test]
    fn test_host_parts_agree_with_their_specs() {
        for h in host::HOST_TOOLS {
            let spec = h.spec();
            let takes = spec.host.is_some_and(|p| p.takes_records.is_some());
            assert_eq!(h.record_consumer("").is_some(), takes, "{}", spec.name);
            let hooks = takes || h.run_json_key().is_some() || h.trace().is_some();
            assert!(!hooks || spec.host.is_some(), "{}", spec.name);
        }
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
