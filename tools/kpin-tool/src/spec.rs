//! What a tool declares about itself, in one place: [`ToolSpec`]. Each tool crate exports
//! a `pub const SPEC: ToolSpec`; the registry (`tools/registry`) lists them, and the VMM
//! (`--tool` and `--tool-option` checks, `kpin tools`) and the engine image (the names it
//! offers) read that list instead of keeping their own.

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
    /// What its host-side part does (a report, a simulator, a reader), if it has one.
    pub host: Option<&'static str>,
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
