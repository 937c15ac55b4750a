//! `kpin tools`: the tools `--tool` selects, from the registry (`tools/registry`), each
//! with its summary, its host-side part and its `--tool-option` keys (help, default).

use std::fmt::Write;

use kpin_tool::{ToolSpec, ValueKind};
use vmm::input_check::{ENGINE_OPTIONS, TOOLS};

/// The listing `kpin tools` prints.
pub fn render() -> String {
    let mut out = String::new();
    for t in TOOLS {
        tool(&mut out, t);
    }
    let _ = writeln!(
        out,
        "Every tool also takes the engine's own options: {}",
        ENGINE_OPTIONS.join(", ")
    );
    out
}

fn tool(out: &mut String, t: &ToolSpec) {
    let _ = writeln!(out, "{}\n    {}", t.name, t.summary);
    if let Some(host) = t.host {
        let _ = writeln!(out, "    host side: {host}");
    }
    if t.options.is_empty() {
        let _ = writeln!(out, "    options: none\n");
        return;
    }
    let prefix = if t.prefixed_keys {
        format!("; each also as {}.KEY", t.name)
    } else {
        String::new()
    };
    let _ = writeln!(out, "    options (--tool-option KEY=VALUE{prefix}):");
    for o in t.options {
        let value = match o.kind {
            ValueKind::Choice(words) => words.join("|"),
            kind => kind.describe().to_uppercase(),
        };
        let default = o
            .default
            .map(|d| format!(" [default: {d}]"))
            .unwrap_or_default();
        let _ = writeln!(
            out,
            "      {}={value}\n          {}{default}",
            o.key, o.help
        );
    }
    let _ = writeln!(out);
}
