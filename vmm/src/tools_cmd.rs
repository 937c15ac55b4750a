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

/// `kpin run --tool`'s long help: what the option does, then each registry tool with its
/// summary and files, so the help names exactly the tools the image has.
pub fn run_tool_help() -> String {
    let mut out = String::from(
        "Run the guest fully instrumented from its first instruction: the engine runs every \
         guest instruction from its code cache under this tool. It logs to <out>/engine.log \
         and writes <out>/counters.json; an instruction or device it cannot handle yet ends \
         the run with status 3 and the guest's state in dump.txt. The tools (`kpin tools` \
         lists their options):",
    );
    for t in TOOLS {
        let _ = write!(out, "\n  {}: {}", t.name, t.summary);
        if let Some(host) = t.host {
            let _ = write!(out, "; host side: {host}");
        }
    }
    out
}

/// The tool names, for help texts: "null, bbcount, ...".
pub fn names() -> String {
    TOOLS.iter().map(|t| t.name).collect::<Vec<_>>().join(", ")
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
