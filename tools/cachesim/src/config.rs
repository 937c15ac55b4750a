//! drcachesim's configuration-file format (`config_file=PATH`) for hierarchies deeper
//! than the L1I/L1D/L2/LL options give, and the compact form the host hands the engine.
//!
//! The file: whitespace-separated words, `//` to the end of the line a comment; global
//! settings `name value`, and caches `NAME { param value … }`:
//! ```text
//! num_cores 1
//! line_size 64
//! P0L1I { type instruction core 0 size 32K assoc 8 parent P0L2 }
//! P0L1D { type data        core 0 size 32K assoc 8 parent P0L2 }
//! P0L2  { type unified size 512K assoc 8 parent LLC }
//! LLC   { size 8M assoc 16 parent memory replace_policy LRU }
//! ```
//! Read: `num_cores` (must be 1: kpin simulates one hierarchy), `line_size`,
//! `warmup_refs`, `sim_refs`, `skip_refs` (0 only), `warmup_fraction` (0 only),
//! `cpu_scheduling` and `verbose` (no effect), `coherence` (false only); per cache `type`
//! (`instruction`, `data`, `unified`: the default), `core` (0 only: the cache the core
//! accesses directly), `size`, `assoc`, `parent` (a cache or `memory`, the default),
//! `replace_policy` (`LRU`, `FIFO`, `RANDOM`; drcachesim's `LFU` is refused),
//! `inclusive` (false only: kpin's caches are non-inclusive), `prefetcher` (`none` only),
//! and `miss_file` is refused. The core needs one instruction and one data cache, or one
//! unified cache; a parent holds what its children hold (unified, or the same type); no
//! cycles. Anything else is an error naming the line and the rule.
//!
//! The engine's form (one `caches=` word of the tool options, at most 255 bytes with the
//! rest): per cache, children before parents, `NAME:TYPE[c]:SIZE:ASSOC:PARENT:POLICY`
//! joined by `,`, with `TYPE` `i`/`d`/`u`, `c` for a core cache, `PARENT` an index or
//! `m` (memory), `POLICY` `L`/`F`/`R`.

use alloc::format;
use alloc::string::{String, ToString};
use alloc::vec::Vec;

use crate::options::{parse_size, CacheKind, CacheSpec, Geometry, Policy};

/// A parsed configuration file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// Global settings as option words (`line_size=64`, `sim_refs=…`).
    pub settings: Vec<String>,
    /// The caches, children before parents.
    pub caches: Vec<CacheSpec>,
}

/// Longest cache name.
pub const MAX_NAME: usize = 24;

/// `bytes` with a `K`/`M`/`G` suffix where it divides.
pub fn size_text(bytes: u64) -> String {
    for (shift, suffix) in [(30, "G"), (20, "M"), (10, "K")] {
        if bytes >= 1 << shift && bytes.is_multiple_of(1 << shift) {
            return format!("{}{suffix}", bytes >> shift);
        }
    }
    bytes.to_string()
}

fn policy_of(text: &str) -> Option<Policy> {
    match text {
        "LRU" | "lru" => Some(Policy::Lru),
        "FIFO" | "fifo" => Some(Policy::Fifo),
        "RANDOM" | "random" => Some(Policy::Random),
        _ => None,
    }
}

/// Words of `text` with their line numbers, comments dropped; `{` and `}` are words of
/// their own even when written against a name.
fn words(text: &str) -> Vec<(usize, &str)> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.split("//").next().unwrap_or("");
        for w in line.split_ascii_whitespace() {
            let mut rest = w;
            while !rest.is_empty() {
                let cut = rest.find(['{', '}']).unwrap_or(rest.len());
                if cut == 0 {
                    out.push((n + 1, &rest[..1]));
                    rest = &rest[1..];
                } else {
                    out.push((n + 1, &rest[..cut]));
                    rest = &rest[cut..];
                }
            }
        }
    }
    out
}

struct Raw {
    line: usize,
    name: String,
    kind: CacheKind,
    core: bool,
    size: Option<u64>,
    assoc: Option<u32>,
    parent: Option<String>,
    policy: Policy,
}

/// Parses a configuration file; caches without a `replace_policy` get `policy`.
pub fn parse(text: &str, policy: Policy) -> Result<Config, String> {
    let w = words(text);
    let mut i = 0;
    let mut settings = Vec::new();
    let mut raws: Vec<Raw> = Vec::new();
    let next = |i: &mut usize, what: &str, line: usize| -> Result<(usize, &str), String> {
        let v = *w
            .get(*i)
            .ok_or_else(|| format!("line {line}: {what} expects a value"))?;
        *i += 1;
        Ok(v)
    };
    let number = |line: usize, key: &str, v: &str| -> Result<u64, String> {
        v.parse::<u64>()
            .map_err(|_| format!("line {line}: {key} {v}: not a number"))
    };
    while i < w.len() {
        let (line, key) = w[i];
        i += 1;
        if key == "{" || key == "}" {
            return Err(format!(
                "line {line}: '{key}' without a cache name before it"
            ));
        }
        let is_cache = w.get(i).is_some_and(|&(_, v)| v == "{");
        if !is_cache {
            let (_, v) = next(&mut i, key, line)?;
            match key {
                "num_cores" if number(line, key, v)? == 1 => {}
                "num_cores" => {
                    return Err(format!(
                        "line {line}: num_cores {v}: num_cores must be 1 (kpin simulates one core's hierarchy)"
                    ))
                }
                "line_size" | "warmup_refs" | "sim_refs" => {
                    settings.push(format!("{key}={}", number(line, key, v)?))
                }
                "skip_refs" | "warmup_fraction"
                    if v.parse::<f64>().map_err(|_| {
                        format!("line {line}: {key} {v}: not a number")
                    })? == 0.0 => {}
                "skip_refs" | "warmup_fraction" => {
                    return Err(format!(
                        "line {line}: {key} {v}: {key} must be 0 (use warmup_refs)"
                    ))
                }
                "cpu_scheduling" | "verbose" => {}
                "coherence" if v == "false" => {}
                "coherence" => {
                    return Err(format!(
                        "line {line}: coherence {v}: coherence must be false (one core)"
                    ))
                }
                _ => return Err(format!("line {line}: unknown setting {key:?}")),
            }
            continue;
        }
        i += 1; // the `{`
        if key.len() > MAX_NAME
            || !key
                .bytes()
                .all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'-')
        {
            return Err(format!(
                "line {line}: cache name {key:?}: names are at most {MAX_NAME} letters, digits, '_' or '-'"
            ));
        }
        if key == "memory" {
            return Err(format!(
                "line {line}: \"memory\" names main memory, not a cache"
            ));
        }
        if raws.iter().any(|r| r.name == key) {
            return Err(format!("line {line}: cache {key} is described twice"));
        }
        let mut r = Raw {
            line,
            name: key.to_string(),
            kind: CacheKind::Unified,
            core: false,
            size: None,
            assoc: None,
            parent: None,
            policy,
        };
        loop {
            let (pl, p) = next(&mut i, &format!("cache {key}"), line)?;
            if p == "}" {
                break;
            }
            let (_, v) = next(&mut i, p, pl)?;
            let at = format!("line {pl}: {key} {p} {v}");
            match p {
                "type" => {
                    r.kind = match v {
                        "instruction" => CacheKind::Instruction,
                        "data" => CacheKind::Data,
                        "unified" => CacheKind::Unified,
                        _ => return Err(format!("{at}: type is instruction, data or unified")),
                    }
                }
                "core" if v == "0" => r.core = true,
                "core" => return Err(format!("{at}: core must be 0 (num_cores is 1)")),
                "size" => r.size = Some(parse_size(v).ok_or_else(|| format!("{at}: not a size"))?),
                "assoc" => r.assoc = Some(v.parse().map_err(|_| format!("{at}: not a number"))?),
                "parent" => r.parent = Some(v.to_string()),
                "replace_policy" => {
                    r.policy = policy_of(v).ok_or_else(|| {
                        format!(
                            "{at}: replace_policy is LRU, FIFO or RANDOM (LFU is not simulated)"
                        )
                    })?
                }
                "inclusive" if v == "false" => {}
                "inclusive" => {
                    return Err(format!(
                        "{at}: inclusive must be false (kpin's caches are non-inclusive)"
                    ))
                }
                "prefetcher" if v == "none" => {}
                "prefetcher" => return Err(format!("{at}: prefetcher must be none")),
                "miss_file" => return Err(format!("{at}: miss_file is not supported")),
                _ => return Err(format!("line {pl}: cache {key}: unknown parameter {p:?}")),
            }
        }
        raws.push(r);
    }
    if raws.is_empty() {
        return Err("no caches described".into());
    }
    // Parents by index; then children before parents (deepest first, file order kept).
    let mut parent_of = Vec::new();
    for r in &raws {
        parent_of.push(match r.parent.as_deref() {
            None | Some("memory") => None,
            Some(p) => Some(raws.iter().position(|x| x.name == p).ok_or_else(|| {
                format!(
                    "line {}: cache {}: parent {p} is not a cache (nor memory)",
                    r.line, r.name
                )
            })?),
        });
    }
    let mut depth = Vec::new();
    for (k, r) in raws.iter().enumerate() {
        let (mut at, mut d) = (k, 0usize);
        while let Some(p) = parent_of[at] {
            d += 1;
            if d > raws.len() {
                return Err(format!(
                    "line {}: cache {}: its parents form a cycle",
                    r.line, r.name
                ));
            }
            at = p;
        }
        depth.push(d);
    }
    let mut order: Vec<usize> = (0..raws.len()).collect();
    order.sort_by_key(|&k| core::cmp::Reverse(depth[k]));
    let mut caches = Vec::new();
    for &k in &order {
        let r = &raws[k];
        let missing = |what| format!("line {}: cache {}: {what} is required", r.line, r.name);
        caches.push(CacheSpec {
            name: r.name.clone(),
            kind: r.kind,
            core: r.core,
            geometry: Geometry {
                size: r.size.ok_or_else(|| missing("size"))?,
                assoc: r.assoc.ok_or_else(|| missing("assoc"))?,
            },
            parent: parent_of[k].map(|p| order.iter().position(|&o| o == p).unwrap_or(0)),
            policy: r.policy,
        });
    }
    check_tree(&caches)?;
    Ok(Config { settings, caches })
}

/// The shape rules: unique names, parents after their children, a parent holds what its
/// children hold, and the core has one instruction and one data cache or one unified.
pub fn check_tree(caches: &[CacheSpec]) -> Result<(), String> {
    for (k, c) in caches.iter().enumerate() {
        if caches[..k].iter().any(|o| o.name == c.name) {
            return Err(format!("cache {}: two caches have that name", c.name));
        }
        if let Some(p) = c.parent {
            let parent = caches
                .get(p)
                .filter(|_| p > k)
                .ok_or_else(|| format!("cache {}: its parent must come after it", c.name))?;
            if parent.kind != CacheKind::Unified && parent.kind != c.kind {
                return Err(format!(
                    "cache {} ({}) and its parent {} ({}): a parent must be unified or of its children's type",
                    c.name,
                    c.kind.name(),
                    parent.name,
                    parent.kind.name()
                ));
            }
        }
    }
    let count = |k: CacheKind| {
        caches
            .iter()
            .filter(|c| c.core && (c.kind == k || c.kind == CacheKind::Unified))
            .count()
    };
    for (k, what) in [
        (CacheKind::Instruction, "instruction"),
        (CacheKind::Data, "data"),
    ] {
        let n = count(k);
        if n != 1 {
            return Err(format!(
                "core 0 has {n} {what} caches: it must have exactly one (an {what} or unified cache with `core 0`)"
            ));
        }
    }
    Ok(())
}

/// The engine's form of `caches` (see the module documentation).
pub fn encode(caches: &[CacheSpec]) -> String {
    let mut out = String::new();
    for (k, c) in caches.iter().enumerate() {
        if k > 0 {
            out.push(',');
        }
        let kind = match c.kind {
            CacheKind::Instruction => "i",
            CacheKind::Data => "d",
            CacheKind::Unified => "u",
        };
        let parent = c.parent.map_or("m".to_string(), |p| p.to_string());
        let policy = &c.policy.name()[..1];
        out.push_str(&format!(
            "{}:{kind}{}:{}:{}:{parent}:{policy}",
            c.name,
            if c.core { "c" } else { "" },
            size_text(c.geometry.size),
            c.geometry.assoc
        ));
    }
    out
}

/// Reads [`encode`]'s form back (shape checked later by [`check_tree`]).
pub fn decode(text: &str) -> Result<Vec<CacheSpec>, String> {
    let bad = |what: &str| format!("caches={text}: {what}");
    let mut out = Vec::new();
    for item in text.split(',') {
        let f: Vec<&str> = item.split(':').collect();
        let [name, kind, size, assoc, parent, policy] = f[..] else {
            return Err(bad("expected NAME:TYPE:SIZE:ASSOC:PARENT:POLICY per cache"));
        };
        let (kind, core) = match kind {
            "i" => (CacheKind::Instruction, false),
            "d" => (CacheKind::Data, false),
            "u" => (CacheKind::Unified, false),
            "ic" => (CacheKind::Instruction, true),
            "dc" => (CacheKind::Data, true),
            "uc" => (CacheKind::Unified, true),
            _ => return Err(bad("TYPE is i, d or u, with c for a core cache")),
        };
        if name.is_empty() || name.len() > MAX_NAME {
            return Err(bad("bad cache name"));
        }
        out.push(CacheSpec {
            name: name.to_string(),
            kind,
            core,
            geometry: Geometry {
                size: parse_size(size).ok_or_else(|| bad("bad size"))?,
                assoc: assoc.parse().map_err(|_| bad("bad assoc"))?,
            },
            parent: match parent {
                "m" => None,
                p => Some(p.parse().map_err(|_| bad("bad parent"))?),
            },
            policy: match policy {
                "L" => Policy::Lru,
                "F" => Policy::Fifo,
                "R" => Policy::Random,
                _ => return Err(bad("POLICY is L, F or R")),
            },
        });
    }
    Ok(out)
}
