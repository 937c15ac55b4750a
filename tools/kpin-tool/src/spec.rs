//! What a tool declares about itself, in one place: [`ToolSpec`]. Each tool crate exports
//! a `pub const SPEC: ToolSpec` and a `new_tool` constructor ([`crate::NewTool`]), and
//! (feature `host`) its host-side part; the registry (`tools/registry`) lists the crates
//! once, and the VMM (`--tool` and `--tool-option` checks, `kpin tools`, the host-side
//! hooks) and the engine image (the tools it builds) read that list instead of keeping
//! their own.

/// A tool: its name, what it does, its options and whether it has a host-side part.
#[derive(Clone, Copy, Debug)]
pub struct ToolSpec {
    /// The name `--tool` selects it by (and [`crate::KpinTool::name`]).
    pub name: &'static str,
    /// What it does, in one line.
    pub summary: &'static str,
    /// The `--tool-option` keys it understands (besides the engine's own `bringup.*`).
    pub options: &'static [OptionSpec],
    /// Whether its keys are also accepted as `NAME.KEY` (e.g. `cachesim.L1D_size`).
    pub prefixed_keys: bool,
    /// Its host-side part (a report, a simulator, a reader), if it has one: the crate's
    /// `HOST` (`kpin_tool::host_side::HostTool`, feature `host`), named by the registry.
    pub host: Option<HostPart>,
}

/// What a tool's host-side part does, as the engine and `kpin tools` need to know it.
#[derive(Clone, Copy, Debug)]
pub struct HostPart {
    /// What it does, in one line (`kpin tools`, `kpin run --help`).
    pub about: &'static str,
    /// `Some(the files the host then writes)` if the tool's memory records may be
    /// simulated on the host instead of in the engine: when the VMM formatted the record
    /// ring for the run (the host part has a `RecordConsumer`), the engine hands the
    /// records over there and the host writes these files (cachesim). `None`: the tool
    /// always runs in the engine.
    pub takes_records: Option<&'static str>,
}

impl core::fmt::Display for HostPart {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(self.about)
    }
}

/// One `--tool-option` key.
#[derive(Clone, Copy, Debug)]
pub struct OptionSpec {
    /// The key.
    pub key: &'static str,
    /// What it sets, in one line.
    pub help: &'static str,
    /// The value it has when not given, as it would be written (`None`: no such value,
    /// e.g. an optional cache level or a file).
    pub default: Option<&'static str>,
    /// What its value is.
    pub kind: ValueKind,
}

/// What an option's value is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ValueKind {
    /// Bytes, with an optional `K`, `M` or `G` suffix.
    Size,
    /// A decimal count.
    Count,
    /// One of these words.
    Choice(&'static [&'static str]),
    /// A host file's path (read by the host before boot).
    Path,
}

impl ToolSpec {
    /// The option `key`, given bare or (with [`ToolSpec::prefixed_keys`]) as `NAME.KEY`.
    pub fn option(&self, key: &str) -> Option<&'static OptionSpec> {
        let own = key
            .strip_prefix(self.name)
            .and_then(|k| k.strip_prefix('.'))
            .filter(|_| self.prefixed_keys)
            .unwrap_or(key);
        self.options.iter().find(|o| o.key == own)
    }
}

impl ValueKind {
    /// How `kpin tools` shows it.
    pub fn describe(&self) -> &'static str {
        match self {
            ValueKind::Size => "size",
            ValueKind::Count => "count",
            ValueKind::Choice(_) => "choice",
            ValueKind::Path => "path",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPEC: ToolSpec = ToolSpec {
        name: "t",
        summary: "a test",
        options: &[OptionSpec {
            key: "k",
            help: "a key",
            default: None,
            kind: ValueKind::Count,
        }],
        prefixed_keys: true,
        host: None,
    };

    #[test]
    fn test_option_finds_bare_and_prefixed_keys_only_where_allowed() {
        assert_eq!(SPEC.option("k").unwrap().key, "k");
        assert_eq!(SPEC.option("t.k").unwrap().key, "k");
        assert!(SPEC.option("u.k").is_none());
        assert!(SPEC.option("t.").is_none());
        let bare = ToolSpec {
            prefixed_keys: false,
            ..SPEC
        };
        assert!(bare.option("t.k").is_none());
    }
}
