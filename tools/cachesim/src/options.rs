//! Options in drcachesim's names, parsed from `key=value` words, and the geometry rules a
//! cache must satisfy (the ones drcachesim and QEMU's `contrib/plugins/cache.c` check).

use alloc::format;
use alloc::string::{String, ToString};
use alloc::vec;
use alloc::vec::Vec;

use kpin_tool::{OptionSpec, ValueKind};

const fn opt(
    key: &'static str,
    kind: ValueKind,
    default: Option<&'static str>,
    help: &'static str,
) -> OptionSpec {
    OptionSpec {
        key,
        help,
        default,
        kind,
    }
}

/// The `--tool-option` keys (drcachesim's names), for the tool's [`crate::SPEC`]; each is
/// also accepted as `cachesim.KEY`. [`Options::parse_host`] reads them all (and
/// [`Options::parse`] all but `config_file`, which the host expands before boot).
pub const KEYS: &[OptionSpec] = &[
    opt(
        "L1I_size",
        ValueKind::Size,
        Some("32K"),
        "L1 instruction cache size",
    ),
    opt(
        "L1I_assoc",
        ValueKind::Count,
        Some("8"),
        "L1 instruction cache ways",
    ),
    opt(
        "L1D_size",
        ValueKind::Size,
        Some("32K"),
        "L1 data cache size",
    ),
    opt(
        "L1D_assoc",
        ValueKind::Count,
        Some("8"),
        "L1 data cache ways",
    ),
    opt(
        "L2_size",
        ValueKind::Size,
        None,
        "adds a unified L2 of this size (512K if only L2_assoc is given)",
    ),
    opt(
        "L2_assoc",
        ValueKind::Count,
        None,
        "adds a unified L2 with these ways (8 if only L2_size is given)",
    ),
    opt(
        "LL_size",
        ValueKind::Size,
        Some("8M"),
        "last-level cache size",
    ),
    opt(
        "LL_assoc",
        ValueKind::Count,
        Some("16"),
        "last-level cache ways",
    ),
    opt(
        "line_size",
        ValueKind::Size,
        Some("64"),
        "line size in bytes, every level",
    ),
    opt(
        "replace_policy",
        ValueKind::Choice(&["LRU", "FIFO", "RANDOM"]),
        Some("LRU"),
        "replacement policy, every level",
    ),
    opt(
        "warmup_refs",
        ValueKind::Count,
        Some("0"),
        "references simulated before the statistics start",
    ),
    opt(
        "sim_refs",
        ValueKind::Count,
        Some("0"),
        "references simulated after the warmup (0: all)",
    ),
    opt(
        "interval_refs",
        ValueKind::Count,
        Some("1000"),
        "references per timeline sample at the start",
    ),
    opt(
        "top",
        ValueKind::Count,
        Some("10"),
        "instructions the report lists by data and by fetch misses",
    ),
    opt(
        "attribute",
        ValueKind::Choice(&["off", "on"]),
        Some("off"),
        "events per process and code block: cachesim-cachegrind.out, flame graph, per-process table",
    ),
    opt(
        "callstacks",
        ValueKind::Choice(&["on", "off"]),
        Some("on"),
        "with attribute=on: blocks per calling context from shadow call stacks (per task and mode, 64 calls deep): the flame graphs show callers",
    ),
    opt(
        "config_file",
        ValueKind::Path,
        None,
        "a drcachesim cache hierarchy file (replaces the L1I/L1D/L2/LL keys)",
    ),
];

/// The options a `config_file` replaces (it describes every cache).
const GEOMETRY_KEYS: &[&str] = &[
    "L1I_size",
    "L1I_assoc",
    "L1D_size",
    "L1D_assoc",
    "L2_size",
    "L2_assoc",
    "LL_size",
    "LL_assoc",
];

/// How a cache picks the line to evict from a full set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// Least recently used.
    Lru,
    /// First in, first out (hits do not refresh a line).
    Fifo,
    /// Uniformly random way, from a fixed-seed PRNG (runs are reproducible).
    Random,
}

impl Policy {
    /// drcachesim's spelling.
    pub fn name(self) -> &'static str {
        match self {
            Policy::Lru => "LRU",
            Policy::Fifo => "FIFO",
            Policy::Random => "RANDOM",
        }
    }
}

/// Size and shape of one cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    /// Total bytes.
    pub size: u64,
    /// Ways per set.
    pub assoc: u32,
}

/// What a cache holds (drcachesim's `type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheKind {
    /// Instructions only.
    Instruction,
    /// Data only.
    Data,
    /// Both.
    Unified,
}

impl CacheKind {
    /// drcachesim's spelling.
    pub fn name(self) -> &'static str {
        match self {
            CacheKind::Instruction => "instruction",
            CacheKind::Data => "data",
            CacheKind::Unified => "unified",
        }
    }
}

/// One cache of a hierarchy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheSpec {
    /// Its name (the report's, e.g. `L1D`, `P0L2`, `LLC`).
    pub name: String,
    /// What it holds.
    pub kind: CacheKind,
    /// Whether the core accesses it directly (an L1; drcachesim's `core 0`).
    pub core: bool,
    /// Size and ways.
    pub geometry: Geometry,
    /// Index of its parent in the list (always after it); `None`: memory.
    pub parent: Option<usize>,
    /// Its replacement policy.
    pub policy: Policy,
}

/// The whole configuration (drcachesim's defaults).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Options {
    /// Private instruction cache.
    pub l1i: Geometry,
    /// Private data cache.
    pub l1d: Geometry,
    /// Optional unified second level (none by default).
    pub l2: Option<Geometry>,
    /// Last level.
    pub ll: Geometry,
    /// Line size in bytes, every level.
    pub line_size: u32,
    /// Replacement policy, every level.
    pub policy: Policy,
    /// References simulated before the statistics start (caches warm, counters reset).
    pub warmup_refs: u64,
    /// References simulated after the warmup (0: all).
    pub sim_refs: u64,
    /// References per timeline sample at the start (doubled whenever the timeline fills).
    pub interval_refs: u64,
    /// Instructions the report lists by data misses and by fetch misses (QEMU's
    /// `cache.c` calls it `limit`).
    pub top: u64,
    /// A hierarchy from a `config_file` (children before parents), replacing `l1i`, `l1d`,
    /// `l2` and `ll`; `None`: those four.
    pub caches: Option<Vec<CacheSpec>>,
    /// Whether the events are kept per task and code block (`attribute=on`; off by
    /// default: it costs the simulation a lookup per block and a few adds per record).
    pub attribute: bool,
    /// With `attribute`, whether blocks are kept per calling context too
    /// (`callstacks=on`, the default: the flame graphs' frames are then the calls the
    /// code ran under).
    pub callstacks: bool,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            l1i: Geometry {
                size: 32 << 10,
                assoc: 8,
            },
            l1d: Geometry {
                size: 32 << 10,
                assoc: 8,
            },
            l2: None,
            ll: Geometry {
                size: 8 << 20,
                assoc: 16,
            },
            line_size: 64,
            policy: Policy::Lru,
            warmup_refs: 0,
            sim_refs: 0,
            interval_refs: 1_000,
            top: 10,
            caches: None,
            attribute: false,
            callstacks: true,
        }
    }
}

/// Why a geometry is refused: the rule it breaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GeometryError {
    /// The line size is not a power of two.
    LineNotPowerOfTwo,
    /// The line size is under 4 bytes.
    LineTooSmall,
    /// Associativity 0.
    AssocZero,
    /// The size is 0 or not a power of two.
    SizeNotPowerOfTwo,
    /// The size is not a multiple of `assoc × line_size` (no whole number of sets). With
    /// a power-of-two size this also makes the number of sets a power of two.
    SizeNotDivisible,
}

impl GeometryError {
    /// The rule, in words.
    pub fn rule(self) -> &'static str {
        match self {
            GeometryError::LineNotPowerOfTwo => "line_size must be a power of two",
            GeometryError::LineTooSmall => "line_size must be at least 4",
            GeometryError::AssocZero => "assoc must be at least 1",
            GeometryError::SizeNotPowerOfTwo => "size must be a nonzero power of two",
            GeometryError::SizeNotDivisible => "size must be a multiple of assoc * line_size",
        }
    }
}

/// Checks a line size.
pub fn check_line(line: u32) -> Result<(), GeometryError> {
    if !line.is_power_of_two() {
        return Err(GeometryError::LineNotPowerOfTwo);
    }
    if line < 4 {
        return Err(GeometryError::LineTooSmall);
    }
    Ok(())
}

impl Geometry {
    /// Checks the geometry with lines of `line` bytes; returns the number of sets.
    pub fn sets(&self, line: u32) -> Result<u64, GeometryError> {
        check_line(line)?;
        if self.assoc == 0 {
            return Err(GeometryError::AssocZero);
        }
        if !self.size.is_power_of_two() {
            return Err(GeometryError::SizeNotPowerOfTwo);
        }
        let way_bytes = u64::from(self.assoc) * u64::from(line);
        if self.size.checked_rem(way_bytes) != Some(0) {
            return Err(GeometryError::SizeNotDivisible);
        }
        Ok(self.size / way_bytes)
    }
}

/// A size: decimal bytes with an optional `K`, `M` or `G` suffix (binary multiples).
pub fn parse_size(text: &str) -> Option<u64> {
    let (digits, shift) = match text.as_bytes().last()? {
        b'K' | b'k' => (&text[..text.len() - 1], 10),
        b'M' | b'm' => (&text[..text.len() - 1], 20),
        b'G' | b'g' => (&text[..text.len() - 1], 30),
        _ => (text, 0),
    };
    let n: u64 = digits.parse().ok()?;
    n.checked_mul(1u64 << shift)
}

impl Options {
    /// Parses `key=value` words separated by whitespace; keys not in drcachesim's set
    /// (and not `cachesim.`-prefixed) are left to others (e.g. `bringup.*`). Keys may be
    /// given bare (`L1D_size=16K`) or as `cachesim.L1D_size=16K`.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut o = Options::default();
        for word in text.split_ascii_whitespace() {
            let Some((key, value)) = word.split_once('=') else {
                continue;
            };
            let prefixed = key.strip_prefix("cachesim.");
            let key = prefixed.unwrap_or(key);
            let size = || parse_size(value).ok_or_else(|| format!("{word}: not a size"));
            let number = || {
                value
                    .parse::<u64>()
                    .map_err(|_| format!("{word}: not a number"))
            };
            let assoc = || {
                value
                    .parse::<u32>()
                    .map_err(|_| format!("{word}: not a number"))
            };
            let l2 = |o: &mut Options| {
                *o.l2.get_or_insert(Geometry {
                    size: 512 << 10,
                    assoc: 8,
                })
            };
            match key {
                "L1I_size" => o.l1i.size = size()?,
                "L1I_assoc" => o.l1i.assoc = assoc()?,
                "L1D_size" => o.l1d.size = size()?,
                "L1D_assoc" => o.l1d.assoc = assoc()?,
                "L2_size" => {
                    let g = l2(&mut o);
                    o.l2 = Some(Geometry { size: size()?, ..g });
                }
                "L2_assoc" => {
                    let g = l2(&mut o);
                    o.l2 = Some(Geometry {
                        assoc: assoc()?,
                        ..g
                    });
                }
                "LL_size" => o.ll.size = size()?,
                "LL_assoc" => o.ll.assoc = assoc()?,
                "line_size" => {
                    o.line_size = u32::try_from(size()?)
                        .map_err(|_| format!("{word}: line_size too large"))?
                }
                "replace_policy" => {
                    o.policy = match value {
                        "LRU" | "lru" => Policy::Lru,
                        "FIFO" | "fifo" => Policy::Fifo,
                        "RANDOM" | "random" => Policy::Random,
                        _ => return Err(format!("{word}: replace_policy is LRU, FIFO or RANDOM")),
                    }
                }
                "attribute" => {
                    o.attribute = match value {
                        "on" => true,
                        "off" => false,
                        _ => return Err(format!("{word}: attribute is on or off")),
                    }
                }
                "callstacks" => {
                    o.callstacks = match value {
                        "on" => true,
                        "off" => false,
                        _ => return Err(format!("{word}: callstacks is on or off")),
                    }
                }
                "warmup_refs" => o.warmup_refs = number()?,
                "sim_refs" => o.sim_refs = number()?,
                "top" => o.top = number()?,
                "interval_refs" => {
                    o.interval_refs = number()?.max(1);
                }
                "config_file" => {
                    return Err(format!(
                        "{word}: config_file is read by the host (kpin run expands it before boot)"
                    ))
                }
                "caches" => o.caches = Some(crate::config::decode(value)?),
                _ if prefixed.is_some() => return Err(format!("{word}: unknown cachesim option")),
                _ => {}
            }
        }
        if o.caches.is_some() {
            for word in text.split_ascii_whitespace() {
                let key = word.split_once('=').map_or(word, |(k, _)| k);
                let key = key.strip_prefix("cachesim.").unwrap_or(key);
                if GEOMETRY_KEYS.contains(&key) {
                    return Err(format!(
                        "{word}: cannot be combined with config_file (the file describes every cache)"
                    ));
                }
            }
        }
        o.check()?;
        Ok(o)
    }

    /// [`Options::parse`] for the host: a `config_file=PATH` word is read with `read` and
    /// its hierarchy and settings applied (drcachesim's format, see [`crate::config`]).
    pub fn parse_host(
        text: &str,
        read: &mut dyn FnMut(&str) -> Result<String, String>,
    ) -> Result<Self, String> {
        let mut words: Vec<String> = Vec::new();
        let mut file = None;
        for word in text.split_ascii_whitespace() {
            let key = word.split_once('=').map_or(word, |(k, _)| k);
            if key == "config_file" || key == "cachesim.config_file" {
                if file.is_some() {
                    return Err(format!("{word}: config_file given twice"));
                }
                file = Some(word.split_once('=').map_or("", |(_, v)| v).to_string());
            } else {
                words.push(word.to_string());
            }
        }
        if let Some(path) = file {
            let text = read(&path).map_err(|e| format!("config_file={path}: {e}"))?;
            let policy = Options::parse(&words.join(" "))?.policy;
            let conf = crate::config::parse(&text, policy)
                .map_err(|e| format!("config_file={path}: {e}"))?;
            words.extend(conf.settings);
            words.push(format!("caches={}", crate::config::encode(&conf.caches)));
        }
        Options::parse(&words.join(" "))
    }

    /// The options as `key=value` words [`Options::parse`] reads back to the same
    /// options (what the host hands the engine).
    pub fn to_words(&self) -> String {
        let mut w = String::new();
        let mut push = |k: &str, v: String| {
            if !w.is_empty() {
                w.push(' ');
            }
            w.push_str(k);
            w.push('=');
            w.push_str(&v);
        };
        match &self.caches {
            Some(c) => push("caches", crate::config::encode(c)),
            None => {
                let d = Options::default();
                for (k, v, dv) in [
                    ("L1I", self.l1i, d.l1i),
                    ("L1D", self.l1d, d.l1d),
                    ("LL", self.ll, d.ll),
                ] {
                    if v.size != dv.size {
                        push(&format!("{k}_size"), crate::config::size_text(v.size));
                    }
                    if v.assoc != dv.assoc {
                        push(&format!("{k}_assoc"), v.assoc.to_string());
                    }
                }
                if let Some(l2) = self.l2 {
                    push("L2_size", crate::config::size_text(l2.size));
                    push("L2_assoc", l2.assoc.to_string());
                }
            }
        }
        let d = Options::default();
        if self.line_size != d.line_size {
            push("line_size", self.line_size.to_string());
        }
        if self.policy != d.policy {
            push("replace_policy", self.policy.name().to_string());
        }
        if self.warmup_refs != 0 {
            push("warmup_refs", self.warmup_refs.to_string());
        }
        if self.sim_refs != 0 {
            push("sim_refs", self.sim_refs.to_string());
        }
        if self.interval_refs != d.interval_refs {
            push("interval_refs", self.interval_refs.to_string());
        }
        if self.attribute {
            push("attribute", "on".to_string());
        }
        if !self.callstacks {
            push("callstacks", "off".to_string());
        }
        w
    }

    /// The hierarchy, children before parents: the `config_file`'s, or L1I and L1D →
    /// L2 (if any) → LL.
    pub fn specs(&self) -> Vec<CacheSpec> {
        if let Some(c) = &self.caches {
            return c.clone();
        }
        let spec = |name: &str, kind, core, geometry, parent| CacheSpec {
            name: name.to_string(),
            kind,
            core,
            geometry,
            parent,
            policy: self.policy,
        };
        let l1_parent = Some(2);
        let mut v = vec![
            spec("L1I", CacheKind::Instruction, true, self.l1i, l1_parent),
            spec("L1D", CacheKind::Data, true, self.l1d, l1_parent),
        ];
        if let Some(l2) = self.l2 {
            v.push(spec("L2", CacheKind::Unified, false, l2, Some(3)));
        }
        v.push(spec("LL", CacheKind::Unified, false, self.ll, None));
        v
    }

    /// Checks every cache's geometry, and a `config_file` hierarchy's shape; the error
    /// names the cache and the rule.
    pub fn check(&self) -> Result<(), String> {
        check_line(self.line_size)
            .map_err(|e| format!("line_size={}: {}", self.line_size, e.rule()))?;
        let specs = self.specs();
        crate::config::check_tree(&specs)?;
        for spec in &specs {
            let (name, g) = (&spec.name, spec.geometry);
            {
                g.sets(self.line_size).map_err(|e| {
                    format!(
                        "{name} (size {}, assoc {}, line {}): {}",
                        g.size,
                        g.assoc,
                        self.line_size,
                        e.rule()
                    )
                })?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_drcachesims() {
        let o = Options::parse("").unwrap();
        assert_eq!(
            o.l1i,
            Geometry {
                size: 32768,
                assoc: 8
            }
        );
        assert_eq!(
            o.l1d,
            Geometry {
                size: 32768,
                assoc: 8
            }
        );
        assert_eq!(o.l2, None);
        assert_eq!(
            o.ll,
            Geometry {
                size: 8 << 20,
                assoc: 16
            }
        );
        assert_eq!(o.line_size, 64);
        assert_eq!(o.policy, Policy::Lru);
    }

    #[test]
    fn every_option_is_read_with_size_suffixes() {
        let o = Options::parse(
            "bringup.checks=true L1I_size=16K L1I_assoc=4 cachesim.L1D_size=8k L1D_assoc=2 \
             L2_size=256K L2_assoc=4 LL_size=2M LL_assoc=8 line_size=32 replace_policy=FIFO \
             warmup_refs=100 sim_refs=5000 interval_refs=77",
        )
        .unwrap();
        assert_eq!(
            o.l1i,
            Geometry {
                size: 16384,
                assoc: 4
            }
        );
        assert_eq!(
            o.l1d,
            Geometry {
                size: 8192,
                assoc: 2
            }
        );
        assert_eq!(
            o.l2,
            Some(Geometry {
                size: 262144,
                assoc: 4
            })
        );
        assert_eq!(
            o.ll,
            Geometry {
                size: 2 << 20,
                assoc: 8
            }
        );
        assert_eq!(o.line_size, 32);
        assert_eq!(o.policy, Policy::Fifo);
        assert_eq!(
            (o.warmup_refs, o.sim_refs, o.interval_refs),
            (100, 5000, 77)
        );
        assert_eq!(
            Options::parse("replace_policy=RANDOM").unwrap().policy,
            Policy::Random
        );
        assert_eq!(parse_size("1G"), Some(1 << 30));
        assert_eq!(parse_size("12"), Some(12));
        assert_eq!(parse_size("K"), None);
        assert_eq!(parse_size("99999999999999999999K"), None);
    }

    /// [`KEYS`] and the parser agree: every declared key is read (a default to the
    /// default options, bare and prefixed), and every key the parser matches is declared,
    /// except `caches`, the host's word for a `config_file` hierarchy.
    #[test]
    fn keys_list_exactly_what_the_parser_reads() {
        for o in KEYS {
            let value = match (o.default, o.kind) {
                (Some(d), _) => d,
                (None, ValueKind::Size) => "512K",
                (None, _) => "8",
            };
            for key in [o.key.to_string(), format!("cachesim.{}", o.key)] {
                let word = format!("{key}={value}");
                let mut read = false;
                let parsed = Options::parse_host(&word, &mut |_| {
                    read = true;
                    Err("not here".into())
                });
                match (o.default, o.kind) {
                    (_, ValueKind::Path) => assert!(read, "{word}"),
                    (Some(_), _) => assert_eq!(parsed, Ok(Options::default()), "{word}"),
                    (None, _) => assert_ne!(parsed, Ok(Options::default()), "{word}"),
                }
            }
        }
        let src = include_str!("options.rs");
        let parse = &src[src.find("pub fn parse(").unwrap()..];
        let parse = &parse[..parse.find("\n    }\n").unwrap()];
        let mut arms: Vec<&str> = parse
            .lines()
            .filter_map(|l| l.strip_prefix("                \""))
            .filter_map(|l| l.split_once("\" =>").map(|(k, _)| k))
            .filter(|k| *k != "caches")
            .collect();
        let mut declared: Vec<&str> = KEYS.iter().map(|o| o.key).collect();
        arms.sort_unstable();
        declared.sort_unstable();
        assert_eq!(arms, declared);
        assert_eq!(crate::SPEC.options.len(), KEYS.len());
    }

    #[test]
    fn bad_values_and_unknown_prefixed_keys_are_errors() {
        for bad in [
            "L1D_size=lots",
            "L1D_assoc=-1",
            "replace_policy=LFU",
            "cachesim.L3_size=1M",
            "sim_refs=1e6",
            "config_file=x.conf",
        ] {
            let e = Options::parse(bad).expect_err(bad);
            assert!(e.starts_with(bad), "{bad}: {e}");
        }
    }

    #[test]
    fn each_geometry_rule_is_named() {
        let g = |size, assoc| Geometry { size, assoc };
        assert_eq!(g(32768, 8).sets(64), Ok(64));
        assert_eq!(g(32768, 8).sets(48), Err(GeometryError::LineNotPowerOfTwo));
        assert_eq!(g(32768, 8).sets(2), Err(GeometryError::LineTooSmall));
        assert_eq!(g(32768, 0).sets(64), Err(GeometryError::AssocZero));
        assert_eq!(g(0, 8).sets(64), Err(GeometryError::SizeNotPowerOfTwo));
        assert_eq!(
            g(48 << 10, 8).sets(64),
            Err(GeometryError::SizeNotPowerOfTwo)
        );
        assert_eq!(
            g(32768, 1024).sets(64),
            Err(GeometryError::SizeNotDivisible)
        );
        assert_eq!(g(32768, 3).sets(64), Err(GeometryError::SizeNotDivisible));
        assert_eq!(
            g(32768 * 3, 3).sets(64),
            Err(GeometryError::SizeNotPowerOfTwo)
        );
        assert_eq!(g(4096, 1).sets(64), Ok(64));
        let e = Options::parse("L1D_size=48K").unwrap_err();
        assert!(e.contains("L1D") && e.contains("power of two"), "{e}");
        let e = Options::parse("LL_assoc=0").unwrap_err();
        assert!(
            e.contains("LL") && e.contains("assoc must be at least 1"),
            "{e}"
        );
        let e = Options::parse("line_size=3").unwrap_err();
        assert!(
            e.contains("line_size=3") && e.contains("power of two"),
            "{e}"
        );
        let e = Options::parse("L2_size=4K L2_assoc=128").unwrap_err();
        assert!(
            e.contains("L2") && e.contains("multiple of assoc * line_size"),
            "{e}"
        );
    }
}
