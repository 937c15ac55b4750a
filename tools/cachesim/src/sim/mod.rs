//! The simulator: set-associative caches in drcachesim's hierarchy (private L1I and L1D,
//! an optional unified L2, a last level), non-inclusive, write-allocate, with hit, miss
//! and compulsory-miss counters split kernel/user. Plain Rust: the engine image runs it on
//! the memory records of the guest, host tests run it on synthetic streams.

use alloc::string::String;
use alloc::vec;
use alloc::vec::Vec;

use crate::options::{CacheKind, Geometry, Options, Policy};

mod feed;
pub use feed::Fed;
pub(crate) use feed::{nibble_sum, run_line_accesses};

/// Index of the kernel (CPL 0–2) half of a split counter.
pub const KERNEL: usize = 0;
/// Index of the user (CPL 3) half of a split counter.
pub const USER: usize = 1;
/// The most bytes one reference is simulated for: the records come from the engine's
/// side, and a `size` of gigabytes would walk (and remember as seen) millions of lines.
/// The largest real operands are an `xsave` area's few KiB; a fetch is at most 15 bytes.
pub const MAX_REF_BYTES: u32 = 4096;

/// The bytes a reference of `size` is simulated for: at least one, at most
/// [`MAX_REF_BYTES`].
#[inline]
pub fn ref_bytes(size: u32) -> u32 {
    size.clamp(1, MAX_REF_BYTES)
}

/// Counters of one cache, each `[kernel, user]`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Line accesses that hit.
    pub hits: [u64; 2],
    /// Line accesses that missed.
    pub misses: [u64; 2],
    /// Misses on a line this cache never held before.
    pub compulsory: [u64; 2],
}

/// Chunks of [`CHUNK_LINES`] lines tracked by bitmap: lines below
/// `MAX_CHUNKS × CHUNK_LINES` (16 GiB of physical addresses with 64-byte lines).
const MAX_CHUNKS: usize = 1 << 16;
/// Lines per bitmap chunk.
const CHUNK_LINES: u64 = 4096;

/// The set of line addresses a cache ever held: a bitmap per 4096-line chunk (512 bytes
/// for 256 KiB of memory with 64-byte lines, so a guest's whole RAM costs 1/512 of its
/// size), and a tree for lines past the bitmaps' reach. (A hash set of lines cost 16+
/// bytes per line and ran the engine's heap out on Linux.)
#[derive(Clone, Debug, Default)]
struct LineSet {
    chunks: Vec<Option<alloc::boxed::Box<[u64; (CHUNK_LINES / 64) as usize]>>>,
    far: alloc::collections::BTreeSet<u64>,
}

impl LineSet {
    fn new() -> Self {
        Self::default()
    }

    /// Inserts `line`; returns whether it was new.
    fn insert(&mut self, line: u64) -> bool {
        let chunk = (line / CHUNK_LINES) as usize;
        if line / CHUNK_LINES >= MAX_CHUNKS as u64 {
            return self.far.insert(line);
        }
        if chunk >= self.chunks.len() {
            self.chunks.resize_with(chunk + 1, || None);
        }
        let bits = self.chunks[chunk]
            .get_or_insert_with(|| alloc::boxed::Box::new([0; (CHUNK_LINES / 64) as usize]));
        let i = (line % CHUNK_LINES) as usize;
        let (word, bit) = (i / 64, 1u64 << (i % 64));
        let new = bits[word] & bit == 0;
        bits[word] |= bit;
        new
    }
}

/// One set-associative cache.
///
/// Each set's ways are kept in recency order for LRU (most recently used first) and in
/// fill order for FIFO (newest first), so the victim is always the last way and a hit is
/// usually found in the first ways searched; invalid ways (tag 0) gather at the end. The
/// contents of a set, and so every hit and miss, are those of the textbook policy. For
/// random replacement ways keep their places, and the victim is the first invalid way or
/// a random one.
#[derive(Clone, Debug)]
pub struct Cache {
    geometry: Geometry,
    assoc: usize,
    set_mask: u64,
    /// `sets × assoc` tags: line address plus one, 0 for an invalid way.
    tags: Vec<u64>,
    policy: Policy,
    rng: u64,
    seen: LineSet,
    /// The tag of the line accessed last (0: none). Accessing it again is a hit that
    /// changes nothing: it is already its set's most recent line (LRU), and hits do not
    /// move FIFO or random state. Consecutive fetches mostly share a line.
    last: u64,
    /// Counters since the start (or the end of the warmup).
    pub stats: Stats,
}

impl Cache {
    /// An empty cache of `geometry` with `line`-byte lines (checked by
    /// [`Options::check`]; an unchecked geometry is rounded to something valid).
    pub fn new(geometry: Geometry, line: u32, policy: Policy) -> Self {
        let assoc = geometry.assoc.max(1) as usize;
        let sets = geometry.sets(line).unwrap_or(1).max(1).next_power_of_two();
        let ways = sets as usize * assoc;
        Self {
            geometry,
            assoc,
            set_mask: sets - 1,
            tags: vec![0; ways],
            policy,
            rng: 0x2545_F491_4F6C_DD1D,
            seen: LineSet::new(),
            last: 0,
            stats: Stats::default(),
        }
    }

    /// The geometry.
    pub fn geometry(&self) -> Geometry {
        self.geometry
    }

    /// Accesses line `line` (an address divided by the line size) for `who` ([`KERNEL`]
    /// or [`USER`]); returns whether it hit. A miss fills the line.
    #[inline]
    pub fn access(&mut self, line: u64, who: usize) -> bool {
        if line.wrapping_add(1) == self.last {
            self.stats.hits[who] += 1;
            return true;
        }
        self.access_other(line, who)
    }

    /// [`Cache::access`] of a line other than the last one accessed.
    #[inline]
    fn access_other(&mut self, line: u64, who: usize) -> bool {
        let tag = line.wrapping_add(1);
        self.last = tag;
        let base = (line & self.set_mask) as usize * self.assoc;
        // The set's first way is its most recent line (LRU), its newest (FIFO), or way 0
        // (random): a hit there changes no policy state. Data accesses mostly alternate
        // between a few lines in different sets, so this is where most of them hit.
        if self.tags[base] == tag {
            self.stats.hits[who] += 1;
            return true;
        }
        self.access_set(base, line, tag, who)
    }

    /// [`Cache::access`] past the first way of the set at `base`.
    #[inline(never)]
    fn access_set(&mut self, base: usize, line: u64, tag: u64, who: usize) -> bool {
        let set = &mut self.tags[base..base + self.assoc];
        if let Some(w) = set.iter().skip(1).position(|&t| t == tag) {
            if self.policy == Policy::Lru {
                // To the front (a few ways at most, mostly: no call to `memmove`).
                for k in (1..=w + 1).rev() {
                    set[k] = set[k - 1];
                }
                set[0] = tag;
            }
            self.stats.hits[who] += 1;
            return true;
        }
        self.stats.misses[who] += 1;
        if self.seen.insert(line) {
            self.stats.compulsory[who] += 1;
        }
        match self.policy {
            Policy::Lru | Policy::Fifo => {
                // The last way is the least recently used (or filled), or invalid.
                let n = set.len();
                set.copy_within(0..n - 1, 1);
                set[0] = tag;
            }
            Policy::Random => {
                let victim = match set.iter().position(|&t| t == 0) {
                    Some(w) => w,
                    None => {
                        // xorshift64: reproducible from the fixed seed.
                        self.rng ^= self.rng << 13;
                        self.rng ^= self.rng >> 7;
                        self.rng ^= self.rng << 17;
                        (self.rng % set.len() as u64) as usize
                    }
                };
                set[victim] = tag;
            }
        }
        false
    }
}

/// What a reference does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Instruction fetch (goes to L1I).
    Fetch,
    /// Data read (L1D).
    Read,
    /// Data write (L1D; write-allocate, so a write is simulated as an access).
    Write,
}

/// The hierarchy: a tree of caches (drcachesim's model for one core). Instruction fetches
/// start at the instruction leaf, data accesses at the data leaf (the same cache for a
/// unified L1); a miss goes on to the parent, until a hit or memory. From the options'
/// L1I/L1D/L2/LL or from a `config_file`.
#[derive(Clone, Debug)]
pub struct Hierarchy {
    caches: Vec<Cache>,
    names: Vec<String>,
    /// Per cache: the index of its parent (`None`: memory).
    parents: Vec<Option<usize>>,
    fetch_leaf: usize,
    data_leaf: usize,
    line_shift: u32,
    warmup_left: u64,
    sim_left: Option<u64>,
    /// [`Hierarchy::counting_all`], kept up to date: the same-line test of every record
    /// asks it.
    all: bool,
    /// References simulated (after the warmup), `[kernel, user]`, by kind: fetches, and
    /// data references.
    pub fetch_refs: [u64; 2],
    /// Data references (reads and writes) simulated after the warmup, `[kernel, user]`.
    pub data_refs: [u64; 2],
    /// References not simulated because `sim_refs` was reached.
    pub skipped_refs: u64,
}

impl Hierarchy {
    /// An empty hierarchy for `o` (which [`Options::parse`] checked).
    pub fn new(o: &Options) -> Self {
        let specs = o.specs();
        // The core's caches: one instruction and one data cache, or one unified cache
        // for both (checked by `Options::check`).
        let leaf = |want: CacheKind| {
            specs
                .iter()
                .position(|s| s.core && (s.kind == want || s.kind == CacheKind::Unified))
                .unwrap_or(0)
        };
        let (fetch_leaf, data_leaf) = (leaf(CacheKind::Instruction), leaf(CacheKind::Data));
        Self {
            caches: specs
                .iter()
                .map(|s| Cache::new(s.geometry, o.line_size, s.policy))
                .collect(),
            names: specs.iter().map(|s| s.name.clone()).collect(),
            parents: specs.iter().map(|s| s.parent).collect(),
            fetch_leaf,
            data_leaf,
            line_shift: o.line_size.max(1).trailing_zeros(),
            warmup_left: o.warmup_refs,
            sim_left: (o.sim_refs > 0).then_some(o.sim_refs),
            all: o.warmup_refs == 0 && o.sim_refs == 0,
            fetch_refs: [0; 2],
            data_refs: [0; 2],
            skipped_refs: 0,
        }
    }

    /// Whether the warmup is over (statistics are being kept).
    pub fn measuring(&self) -> bool {
        self.warmup_left == 0
    }

    /// The cache references of `kind` start at.
    #[inline]
    fn leaf(&self, kind: Kind) -> usize {
        match kind {
            Kind::Fetch => self.fetch_leaf,
            Kind::Read | Kind::Write => self.data_leaf,
        }
    }

    /// Whether every reference is simulated and counted (the warmup is over and there is
    /// no `sim_refs` limit).
    #[inline]
    pub fn counting_all(&self) -> bool {
        self.all
    }

    /// While [`Hierarchy::counting_all`]: one access of `line` by a reference of `kind`
    /// (its L1, then the caches above on a miss), the reference itself counted by the
    /// caller ([`Hierarchy::count_refs`]). Returns whether the L1 hit.
    #[inline(always)]
    pub fn access_line(&mut self, kind: Kind, line: u64, who: usize) -> bool {
        let leaf = self.leaf(kind);
        let hit = self.caches[leaf].access(line, who);
        if !hit {
            self.miss_from(leaf, line, who);
        }
        hit
    }

    /// Counts `refs` references of `kind` by `who` (their line accesses made by
    /// [`Hierarchy::access_line`] or the caller).
    #[inline]
    pub fn count_refs(&mut self, kind: Kind, refs: u64, who: usize) {
        match kind {
            Kind::Fetch => self.fetch_refs[who] += refs,
            Kind::Read | Kind::Write => self.data_refs[who] += refs,
        }
    }

    /// While [`Hierarchy::counting_all`]: counts `n` more accesses by `who` to the line
    /// the L1 of `kind` has just accessed (hits that change nothing else).
    #[inline]
    pub fn add_repeat_hits(&mut self, kind: Kind, n: u64, who: usize) {
        let leaf = self.leaf(kind);
        self.caches[leaf].stats.hits[who] += n;
    }

    /// Counts `n` references of `kind` by `who` that touch only the bytes `first..=last`,
    /// when those lie in the line their L1 accessed last and every reference is simulated
    /// and counted: then each would be a hit that changes nothing but counters. Returns
    /// whether it counted them (else nothing changed).
    #[inline]
    pub fn same_line_hits(
        &mut self,
        kind: Kind,
        first: u64,
        last: u64,
        n: u64,
        who: usize,
    ) -> bool {
        if !self.counting_all() {
            return false;
        }
        let line = first >> self.line_shift;
        let leaf = self.leaf(kind);
        let c = &mut self.caches[leaf];
        if last >> self.line_shift != line || c.last != line.wrapping_add(1) {
            return false;
        }
        c.stats.hits[who] += n;
        self.count_refs(kind, n, who);
        true
    }

    /// The line size as a shift.
    pub fn line_shift(&self) -> u32 {
        self.line_shift
    }

    /// One reference of `size` bytes (at most [`MAX_REF_BYTES`]) at physical address
    /// `addr` by `who`; every line it
    /// touches is accessed in turn. Returns the line accesses that missed the L1 the
    /// reference started at and were counted (0 during the warmup and past `sim_refs`).
    #[inline]
    pub fn access(&mut self, addr: u64, size: u32, kind: Kind, who: usize) -> u64 {
        // Most references touch one line, the one their L1 saw last (a fetch after a
        // fetch in the same line): a hit that changes nothing else (`Cache::last`).
        let last = addr.saturating_add(u64::from(ref_bytes(size)) - 1);
        if self.same_line_hits(kind, addr, last, 1, who) {
            return 0;
        }
        self.access_lines(addr, size, kind, who)
    }

    /// [`Hierarchy::access`] past its same-line shortcut.
    #[inline(never)]
    fn access_lines(&mut self, addr: u64, size: u32, kind: Kind, who: usize) -> u64 {
        let measuring = self.warmup_left == 0;
        if measuring {
            match &mut self.sim_left {
                Some(0) => {
                    self.skipped_refs += 1;
                    return 0;
                }
                Some(n) => *n -= 1,
                None => {}
            }
            self.count_refs(kind, 1, who);
        }
        let first = addr >> self.line_shift;
        let last = addr.saturating_add(u64::from(ref_bytes(size)) - 1) >> self.line_shift;
        let leaf = self.leaf(kind);
        let mut leaf_misses = 0;
        let mut line = first;
        loop {
            if !self.caches[leaf].access(line, who) {
                leaf_misses += 1;
                self.miss_from(leaf, line, who);
            }
            if line >= last {
                break;
            }
            line += 1;
        }
        if self.warmup_left > 0 {
            self.warmup_left -= 1;
            if self.warmup_left == 0 {
                self.reset_stats();
                self.all = self.sim_left.is_none();
            }
        }
        if measuring {
            leaf_misses
        } else {
            0
        }
    }

    /// `line` missed cache `child`: accesses it in the caches above, up to a hit or
    /// memory.
    #[inline(never)]
    fn miss_from(&mut self, child: usize, line: u64, who: usize) {
        let mut at = self.parents[child];
        while let Some(i) = at {
            if self.caches[i].access(line, who) {
                break;
            }
            at = self.parents[i];
        }
    }

    fn reset_stats(&mut self) {
        for c in &mut self.caches {
            c.stats = Stats::default();
        }
    }

    /// The caches with their names, children before parents (L1s first, the last level
    /// last).
    pub fn caches(&self) -> impl Iterator<Item = (&str, &Cache)> {
        self.names.iter().map(String::as_str).zip(&self.caches)
    }

    /// The cache named `name`.
    pub fn cache(&self, name: &str) -> Option<&Cache> {
        self.caches().find(|(n, _)| *n == name).map(|(_, c)| c)
    }

    /// The index of each cache's parent (`None`: memory), in [`Hierarchy::caches`] order.
    pub fn parents(&self) -> &[Option<usize>] {
        &self.parents
    }

    /// The cache instruction fetches start at.
    pub fn l1i(&self) -> &Cache {
        &self.caches[self.fetch_leaf]
    }

    /// The cache data accesses start at.
    pub fn l1d(&self) -> &Cache {
        &self.caches[self.data_leaf]
    }

    /// The last level on the data path (its parent is memory).
    pub fn ll(&self) -> &Cache {
        let mut i = self.data_leaf;
        while let Some(p) = self.parents[i] {
            i = p;
        }
        &self.caches[i]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_set_remembers_near_and_far_lines() {
        let mut s = LineSet::new();
        let lines = [
            0,
            1,
            63,
            64,
            4095,
            4096,
            1 << 20,
            (MAX_CHUNKS as u64) * CHUNK_LINES,
            u64::MAX >> 6,
        ];
        for l in lines {
            assert!(s.insert(l), "{l} new");
        }
        for l in lines {
            assert!(!s.insert(l), "{l} seen");
        }
        assert!(s.insert(2));
        assert_eq!(s.far.len(), 2);
    }
}
