//! Every path the docs name exists (issue #23, "docs as a map").
//!
//! Scans `README.md` and `docs/*.md` for
//! - markdown links to local files (`[text](docs/images.md)`, `[x](host-input.md#anchor)`),
//!   resolved against the linking file's directory, the anchor dropped;
//! - backticked strings that look like repository paths: no spaces, a `/`, and either a
//!   source or doc extension (`.rs`, `.md`, `.toml`, `.sh`, `.py`, `.c`, `.txt`, `.ld`) or
//!   a first component that is a top-level directory of the repository
//!   (`tools/registry/`, `tests/guests/minikernel/`, `.ci/run`), resolved against the
//!   repository root (a `:LINE` suffix is dropped);
//!
//! and fails listing every one that does not exist. Fenced code blocks are skipped (they
//! hold commands and their output). Placeholders (`<out>`, `*`, `{a,b}`, `…`) and the
//! paths of [`IGNORED_PREFIXES`] are not checked. No KVM needed.

use std::path::{Path, PathBuf};

/// Paths the docs name that are not files of the repository, each with its reason.
const IGNORED_PREFIXES: &[(&str, &str)] = &[
    ("images/out/", "built and git-ignored: the image cache"),
    ("kpin-out/", "a run's default output directory"),
    ("target/", "cargo's build output"),
    ("RUN/", "a run's output directory, as the CLI's argument"),
    (
        "../shared/",
        "outside this repository: the shared design notes",
    ),
    (
        "tests/plugin/",
        "QEMU's source tree (its bb plugin), not this repository",
    ),
    ("/dev/", "a device node, not a repository path"),
    ("/bin/", "a path inside the guest"),
    ("/proc/", "a path inside the guest or the host"),
];

/// File extensions that make a backticked string a path claim.
const EXTENSIONS: &[&str] = &[".rs", ".md", ".toml", ".sh", ".py", ".c", ".txt", ".ld"];

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

fn doc_files(root: &Path) -> Vec<PathBuf> {
    let mut files = vec![root.join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .expect("docs/ is readable")
        .map(|e| e.expect("a docs/ entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    files
}

/// The top-level directories of the repository (`vmm`, `tools`, `.ci`, …).
fn top_level_dirs(root: &Path) -> Vec<String> {
    std::fs::read_dir(root)
        .expect("the repository root is readable")
        .filter_map(|e| {
            let e = e.ok()?;
            let name = e.file_name().into_string().ok()?;
            (e.file_type().ok()?.is_dir() && name != ".git").then_some(name)
        })
        .collect()
}

/// The lines of a markdown file outside fenced code blocks, with their numbers.
fn prose_lines(text: &str) -> Vec<(usize, &str)> {
    let mut in_fence = false;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            in_fence = !in_fence;
            continue;
        }
        if !in_fence {
            out.push((i + 1, line));
        }
    }
    out
}

/// Inline code spans of a line (single backticks; double-backtick spans are rare here).
fn code_spans(line: &str) -> Vec<&str> {
    let mut spans = Vec::new();
    let mut rest = line;
    while let Some(start) = rest.find('`') {
        let after = &rest[start + 1..];
        let Some(end) = after.find('`') else { break };
        spans.push(&after[..end]);
        rest = &after[end + 1..];
    }
    spans
}

/// Link targets of a line: the `(…)` after `]`.
fn link_targets(line: &str) -> Vec<&str> {
    let mut targets = Vec::new();
    let mut rest = line;
    while let Some(i) = rest.find("](") {
        let after = &rest[i + 2..];
        let Some(end) = after.find(')') else { break };
        targets.push(&after[..end]);
        rest = &after[end + 1..];
    }
    targets
}

fn is_placeholder(s: &str) -> bool {
    s.contains(['<', '>', '*', '{', '}', '…', '|', '$', '='])
        || s.contains("...")
        || s.contains("::")
}

fn ignored(s: &str) -> bool {
    IGNORED_PREFIXES.iter().any(|(p, _)| s.starts_with(p))
}

/// A backticked string, if it claims to be a repository path: the path to check.
fn path_claim<'a>(span: &'a str, top_dirs: &[String]) -> Option<&'a str> {
    let s = span.trim();
    if s.is_empty() || s.contains(char::is_whitespace) || !s.contains('/') {
        return None;
    }
    if s.contains("://") || is_placeholder(s) || ignored(s) {
        return None;
    }
    // `file.rs:123` names a line of the file.
    let s = match s.rsplit_once(':') {
        Some((p, line)) if line.chars().all(|c| c.is_ascii_digit()) => p,
        _ => s,
    };
    let first = s.split('/').next().unwrap_or("");
    let by_extension = EXTENSIONS.iter().any(|e| s.ends_with(e));
    let by_directory = top_dirs.iter().any(|d| d == first);
    (by_extension || by_directory).then_some(s)
}

#[test]
fn every_path_the_docs_name_exists() {
    let root = repo_root();
    let top_dirs = top_level_dirs(&root);
    let mut missing = Vec::new();
    let mut checked = 0usize;
    for file in doc_files(&root) {
        let text = std::fs::read_to_string(&file).expect("a doc file is readable");
        let rel = file
            .strip_prefix(&root)
            .unwrap_or(&file)
            .display()
            .to_string();
        let dir = file.parent().expect("a doc file has a directory");
        for (n, line) in prose_lines(&text) {
            for target in link_targets(line) {
                let target = target.split_whitespace().next().unwrap_or("");
                let path = target.split('#').next().unwrap_or("");
                if path.is_empty() || path.contains("://") || path.starts_with("mailto:") {
                    continue;
                }
                checked += 1;
                if !dir.join(path).exists() {
                    missing.push(format!("{rel}:{n}: link ({target})"));
                }
            }
            for span in code_spans(line) {
                if let Some(path) = path_claim(span, &top_dirs) {
                    checked += 1;
                    if !root.join(path).exists() {
                        missing.push(format!("{rel}:{n}: `{span}`"));
                    }
                }
            }
        }
    }
    assert!(
        checked > 50,
        "only {checked} paths found: is the scan broken?"
    );
    assert!(
        missing.is_empty(),
        "{} path(s) named in the docs do not exist (relative to the repository root, \
         links relative to their file):\n{}",
        missing.len(),
        missing.join("\n")
    );
}

#[test]
fn the_scan_recognises_paths_and_skips_placeholders() {
    let dirs = vec!["tools".to_string(), "vmm".to_string(), ".ci".to_string()];
    assert_eq!(
        path_claim("vmm/src/control/windows.rs", &dirs),
        Some("vmm/src/control/windows.rs")
    );
    assert_eq!(
        path_claim("control/server.rs", &dirs),
        Some("control/server.rs")
    );
    assert_eq!(
        path_claim("tools/registry/", &dirs),
        Some("tools/registry/")
    );
    assert_eq!(
        path_claim("tools/kpin-tool", &dirs),
        Some("tools/kpin-tool")
    );
    assert_eq!(path_claim(".ci/run", &dirs), Some(".ci/run"));
    assert_eq!(
        path_claim("vmm/src/main.rs:42", &dirs),
        Some("vmm/src/main.rs")
    );
    assert_eq!(path_claim("attach-<n>/", &dirs), None);
    assert_eq!(path_claim("images/out/kpin-engine.elf", &dirs), None);
    assert_eq!(path_claim("kpin_abi::x86", &dirs), None);
    assert_eq!(path_claim("--tool null|bbcount", &dirs), None);
    assert_eq!(path_claim("kpin attach|detach", &dirs), None);
    assert_eq!(path_claim("a/b", &dirs), None);
    assert_eq!(
        link_targets("see [x](docs/a.md#b) and [y](c.md)"),
        vec!["docs/a.md#b", "c.md"]
    );
    assert_eq!(code_spans("a `b/c.rs` d `e`"), vec!["b/c.rs", "e"]);
}
