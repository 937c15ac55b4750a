//! The simulator against a plain reference model written here, independently: per set an
//! MRU-first list (LRU), an insertion-ordered queue (FIFO) or a way array (RANDOM, with
//! the documented xorshift64 stream), a `HashSet` of lines ever held per cache, and the
//! hierarchy walked by hand. Every counter is compared exactly on random and adversarial
//! streams of references, and on streams of the engine's records fed to [`CacheSim`] as
//! the host thread feeds them (each record expanded here into the references it stands
//! for): the caches' counters, the references, the timeline and the misses per
//! instruction. So is the loop that feeds records straight into the hierarchy
//! (`Hierarchy::feed_records`), stopped at random points.

use std::collections::{HashMap, HashSet, VecDeque};

use kpin_tool::host::{Error, Sink};
use kpin_tool::{access, MemRecord};
use kpin_tool_cachesim::files::parse_timeline;
use kpin_tool_cachesim::insns::{MissTable, HOST_CAPACITY};
use kpin_tool_cachesim::options::{Geometry, Options, Policy};
use kpin_tool_cachesim::sim::{Hierarchy, Kind, Stats, KERNEL, USER};
use kpin_tool_cachesim::{CacheSim, TIMELINE_NAME};

mod common;
use common::program::{Program, Rng};

/// One reference cache.
struct RefCache {
    sets: u64,
    assoc: usize,
    policy: Policy,
    /// LRU: MRU first. FIFO: oldest first. RANDOM: ways in order (`None` = invalid).
    lists: Vec<VecDeque<u64>>,
    ways: Vec<Vec<Option<u64>>>,
    rng: u64,
    seen: HashSet<u64>,
    stats: Stats,
}

impl RefCache {
    fn new(g: Geometry, line: u32, policy: Policy) -> Self {
        let sets = g.size / (u64::from(g.assoc) * u64::from(line));
        RefCache {
            sets,
            assoc: g.assoc as usize,
            policy,
            lists: (0..sets).map(|_| VecDeque::new()).collect(),
            ways: (0..sets).map(|_| vec![None; g.assoc as usize]).collect(),
            rng: 0x2545_F491_4F6C_DD1D,
            seen: HashSet::new(),
            stats: Stats::default(),
        }
    }

    fn access(&mut self, line: u64, who: usize) -> bool {
        let set = (line % self.sets) as usize;
        let hit = match self.policy {
            Policy::Lru => {
                let l = &mut self.lists[set];
                if let Some(p) = l.iter().position(|&x| x == line) {
                    l.remove(p);
                    l.push_front(line);
                    true
                } else {
                    if l.len() == self.assoc {
                        l.pop_back();
                    }
                    l.push_front(line);
                    false
                }
            }
            Policy::Fifo => {
                let l = &mut self.lists[set];
                if l.contains(&line) {
                    true
                } else {
                    if l.len() == self.assoc {
                        l.pop_front();
                    }
                    l.push_back(line);
                    false
                }
            }
            Policy::Random => {
                let w = &mut self.ways[set];
                if w.contains(&Some(line)) {
                    true
                } else {
                    let slot = match w.iter().position(|x| x.is_none()) {
                        Some(i) => i,
                        None => {
                            self.rng ^= self.rng << 13;
                            self.rng ^= self.rng >> 7;
                            self.rng ^= self.rng << 17;
                            (self.rng % self.assoc as u64) as usize
                        }
                    };
                    w[slot] = Some(line);
                    false
                }
            }
        };
        if hit {
            self.stats.hits[who] += 1;
        } else {
            self.stats.misses[who] += 1;
            if self.seen.insert(line) {
                self.stats.compulsory[who] += 1;
            }
        }
        hit
    }
}

struct RefHierarchy {
    l1i: RefCache,
    l1d: RefCache,
    l2: Option<RefCache>,
    ll: RefCache,
    line: u64,
    fetch: [u64; 2],
    data: [u64; 2],
}

impl RefHierarchy {
    fn new(o: &Options) -> Self {
        let c = |g| RefCache::new(g, o.line_size, o.policy);
        RefHierarchy {
            l1i: c(o.l1i),
            l1d: c(o.l1d),
            l2: o.l2.map(c),
            ll: c(o.ll),
            line: u64::from(o.line_size),
            fetch: [0; 2],
            data: [0; 2],
        }
    }

    /// Returns the line accesses that missed the L1.
    fn access(&mut self, addr: u64, size: u32, kind: Kind, who: usize) -> u64 {
        if kind == Kind::Fetch {
            self.fetch[who] += 1;
        } else {
            self.data[who] += 1;
        }
        let mut line = addr / self.line;
        let end = (addr + u64::from(size) - 1) / self.line;
        let mut l1_misses = 0;
        while line <= end {
            let l1 = if kind == Kind::Fetch {
                &mut self.l1i
            } else {
                &mut self.l1d
            };
            let l1_hit = l1.access(line, who);
            l1_misses += u64::from(!l1_hit);
            let hit = l1_hit || self.l2.as_mut().is_some_and(|c| c.access(line, who));
            if !hit {
                self.ll.access(line, who);
            }
            line += 1;
        }
        l1_misses
    }

    fn stats(&self) -> Vec<Stats> {
        let mut v = vec![self.l1i.stats, self.l1d.stats];
        v.extend(self.l2.as_ref().map(|c| c.stats));
        v.push(self.ll.stats);
        v
    }
}

type Ref = (u64, u32, Kind, usize);

fn compare(o: &Options, stream: &[Ref], what: &str) {
    let mut sim = Hierarchy::new(o);
    let mut reference = RefHierarchy::new(o);
    for &(a, s, k, w) in stream {
        sim.access(a, s, k, w);
        reference.access(a, s, k, w);
    }
    let got: Vec<Stats> = sim.caches().map(|(_, c)| c.stats).collect();
    assert_eq!(got, reference.stats(), "{what}: {:?}", o.policy);
    assert_eq!(sim.fetch_refs, reference.fetch, "{what}");
    assert_eq!(sim.data_refs, reference.data, "{what}");
    // The streams are built to exercise both outcomes.
    let s = &got[1];
    assert!(
        s.hits.iter().sum::<u64>() > 0 || what.contains("thrash"),
        "{what}: no L1D hit"
    );
    assert!(s.misses.iter().sum::<u64>() > 0, "{what}: no L1D miss");
}

/// A small deterministic PRNG for the streams (not the simulator's).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
}

fn small() -> Options {
    Options {
        l1i: Geometry {
            size: 1024,
            assoc: 2,
        },
        l1d: Geometry {
            size: 2048,
            assoc: 4,
        },
        l2: Some(Geometry {
            size: 8192,
            assoc: 4,
        }),
        ll: Geometry {
            size: 32768,
            assoc: 8,
        },
        line_size: 64,
        ..Options::default()
    }
}

fn random_stream(seed: u64, n: usize, span: u64) -> Vec<Ref> {
    let mut r = Lcg(seed);
    (0..n)
        .map(|_| {
            let kind = match r.next() % 3 {
                0 => Kind::Fetch,
                1 => Kind::Read,
                _ => Kind::Write,
            };
            let size = [1, 2, 4, 8, 16, 64][(r.next() % 6) as usize];
            (r.next() % span, size, kind, (r.next() % 2) as usize)
        })
        .collect()
}

fn policies() -> [Policy; 3] {
    [Policy::Lru, Policy::Fifo, Policy::Random]
}

#[test]
fn random_streams_match_the_reference() {
    for policy in policies() {
        for (seed, span) in [(1, 16 << 10), (2, 64 << 10), (3, 1 << 20)] {
            let o = Options { policy, ..small() };
            compare(&o, &random_stream(seed, 50_000, span), "random");
            let no_l2 = Options { l2: None, ..o };
            compare(
                &no_l2,
                &random_stream(seed + 10, 50_000, span),
                "random, no L2",
            );
        }
    }
}

/// A program-like stream: runs of sequential fetches (instruction lengths 1-15) with
/// jumps, and data accesses that mostly revisit the line they touched last — so the
/// simulator's same-line shortcut (a repeated line hits without touching LRU, FIFO or
/// random state) is taken most of the time and must change no counter.
#[test]
fn sequential_runs_and_repeated_lines_match_the_reference() {
    for policy in policies() {
        let o = Options { policy, ..small() };
        let mut r = Lcg(21);
        let (mut pc, mut data) = (0x1000u64, 0x40_000u64);
        let mut s: Vec<Ref> = Vec::new();
        for i in 0..60_000u64 {
            let who = (i / 5000 % 2) as usize;
            s.push((pc, 1 + (r.next() % 15) as u32, Kind::Fetch, who));
            pc += 1 + r.next() % 15;
            if r.next().is_multiple_of(16) {
                pc = 0x1000 + (r.next() % 256) * 64 + r.next() % 64;
            }
            if r.next().is_multiple_of(3) {
                if r.next().is_multiple_of(8) {
                    data = 0x40_000 + (r.next() % 600) * 64;
                }
                let kind = if r.next() & 1 == 0 {
                    Kind::Read
                } else {
                    Kind::Write
                };
                s.push((data + r.next() % 56, 8, kind, who));
            }
        }
        compare(&o, &s, "sequential");
    }
}

#[test]
fn strided_conflicts_and_line_crossing_match_the_reference() {
    for policy in policies() {
        let o = Options { policy, ..small() };
        // Every line maps to set 0 of L1D (stride = sets × line), cycling through k lines.
        let l1d_stride = 2048 / 4;
        for k in [3, 4, 5, 9, 17] {
            let s: Vec<Ref> = (0..20_000u64)
                .map(|i| ((i % k) * l1d_stride, 8, Kind::Read, (i / 7 % 2) as usize))
                .collect();
            // More lines than ways: LRU and FIFO never hit (checked exactly below).
            compare(&o, &s, if k > 4 { "strided thrash" } else { "strided" });
        }
        // Accesses straddling two lines, mixed with aligned ones.
        let mut r = Lcg(9);
        let s: Vec<Ref> = (0..20_000)
            .map(|_| {
                let line = r.next() % 300;
                let off = if r.next() & 1 == 0 { 60 } else { 0 };
                (line * 64 + off, 8, Kind::Write, USER)
            })
            .collect();
        compare(&o, &s, "line-crossing");
    }
}

#[test]
fn thrashing_an_n_plus_1_way_set_misses_every_time_under_lru_and_fifo() {
    for policy in [Policy::Lru, Policy::Fifo] {
        let o = Options {
            policy,
            l2: None,
            ..small()
        };
        let ways = u64::from(o.l1d.assoc);
        let stride = o.l1d.size / ways; // one L1D set
        let rounds = 100;
        let s: Vec<Ref> = (0..rounds * (ways + 1))
            .map(|i| ((i % (ways + 1)) * stride, 4, Kind::Read, KERNEL))
            .collect();
        compare(&o, &s, "thrash");
        let mut h = Hierarchy::new(&o);
        for &(a, sz, k, w) in &s {
            h.access(a, sz, k, w);
        }
        let d = h.l1d().stats;
        assert_eq!(
            d.hits,
            [0, 0],
            "{policy:?}: an n+1-line cycle never hits an n-way set"
        );
        assert_eq!(d.misses[KERNEL], rounds * (ways + 1));
        assert_eq!(d.compulsory[KERNEL], ways + 1);
        // The last level holds all of them: only compulsory misses there.
        assert_eq!(h.ll().stats.misses[KERNEL], ways + 1);
        // n lines fit: only the compulsory misses.
        let mut h = Hierarchy::new(&o);
        for i in 0..rounds * ways {
            h.access((i % ways) * stride, 4, Kind::Read, USER);
        }
        assert_eq!(h.l1d().stats.misses[USER], ways);
        assert_eq!(h.l1d().stats.hits[USER], rounds * ways - ways);
    }
}

#[test]
fn warmup_and_sim_refs_bound_the_statistics() {
    let o = Options {
        warmup_refs: 1000,
        sim_refs: 500,
        ..small()
    };
    let s = random_stream(5, 5000, 64 << 10);
    let mut h = Hierarchy::new(&o);
    for &(a, sz, k, w) in &s {
        h.access(a, sz, k, w);
    }
    let refs: u64 = h.fetch_refs.iter().chain(&h.data_refs).sum();
    assert_eq!(refs, 500);
    assert_eq!(h.skipped_refs, 3500);
    // The same as a reference warmed with the first 1000 and measured on the next 500.
    let mut reference = RefHierarchy::new(&Options {
        warmup_refs: 0,
        sim_refs: 0,
        ..o.clone()
    });
    for &(a, sz, k, w) in &s[..1000] {
        reference.access(a, sz, k, w);
    }
    let before = reference.stats();
    for &(a, sz, k, w) in &s[1000..1500] {
        reference.access(a, sz, k, w);
    }
    let diff: Vec<Stats> = reference
        .stats()
        .iter()
        .zip(&before)
        .map(|(a, b)| Stats {
            hits: [a.hits[0] - b.hits[0], a.hits[1] - b.hits[1]],
            misses: [a.misses[0] - b.misses[0], a.misses[1] - b.misses[1]],
            compulsory: [
                a.compulsory[0] - b.compulsory[0],
                a.compulsory[1] - b.compulsory[1],
            ],
        })
        .collect();
    let got: Vec<Stats> = h.caches().map(|(_, c)| c.stats).collect();
    assert_eq!(got, diff);
}

/// What a [`CacheSim`] fed records reports: per cache its stats, the references by kind,
/// the unresolved records, the timeline's rows and the misses per instruction.
#[derive(Debug, PartialEq)]
struct Outcome {
    stats: Vec<Stats>,
    fetch: [u64; 2],
    data: [u64; 2],
    skipped: u64,
    unresolved: u64,
    timeline: Vec<Vec<u64>>,
    insns: Vec<(u64, u8, u64, u64)>,
}

/// The reference for a record stream: each record expanded into the references it stands
/// for, simulated one by one by [`RefHierarchy`], with the warmup, `sim_refs`, the
/// timeline and the per-instruction misses kept by hand.
struct RefFeed {
    h: RefHierarchy,
    warmup_left: u64,
    sim_left: Option<u64>,
    skipped: u64,
    unresolved: u64,
    interval: u64,
    counted: u64,
    rows: Vec<Vec<u64>>,
    insns: HashMap<(u64, u8), (u64, u64)>,
}

impl RefFeed {
    fn new(o: &Options) -> Self {
        RefFeed {
            h: RefHierarchy::new(o),
            warmup_left: o.warmup_refs,
            sim_left: (o.sim_refs > 0).then_some(o.sim_refs),
            skipped: 0,
            unresolved: 0,
            interval: o.interval_refs,
            counted: 0,
            rows: Vec::new(),
            insns: HashMap::new(),
        }
    }

    fn row(&self) -> Vec<u64> {
        let h = &self.h;
        let mut row = vec![h.fetch[0], h.fetch[1], h.data[0], h.data[1]];
        for s in h.stats() {
            row.extend([s.hits[0], s.hits[1], s.misses[0], s.misses[1]]);
        }
        row
    }

    /// One reference of the instruction at `ip` (`pa` `u64::MAX`: not simulated).
    fn reference(&mut self, ip: u64, cpl: u8, pa: u64, size: u32, kind: Kind) {
        if pa == u64::MAX {
            self.unresolved += 1;
            return;
        }
        let who = usize::from(cpl == 3);
        if self.warmup_left > 0 {
            self.h.access(pa, size.max(1), kind, who);
            self.warmup_left -= 1;
            if self.warmup_left == 0 {
                for c in [&mut self.h.l1i, &mut self.h.l1d, &mut self.h.ll] {
                    c.stats = Stats::default();
                }
                if let Some(c) = &mut self.h.l2 {
                    c.stats = Stats::default();
                }
                (self.h.fetch, self.h.data) = ([0; 2], [0; 2]);
            }
            return;
        }
        // Past `sim_refs` a reference is skipped, but the timeline still counts it.
        let skip = self.sim_left == Some(0);
        if let Some(n) = &mut self.sim_left {
            *n = n.saturating_sub(1);
        }
        self.skipped += u64::from(skip);
        let missed = if skip {
            0
        } else {
            self.h.access(pa, size.max(1), kind, who)
        };
        if missed > 0 {
            let e = self.insns.entry((ip, cpl)).or_default();
            if kind == Kind::Fetch {
                e.1 += missed;
            } else {
                e.0 += missed;
            }
        }
        self.counted += 1;
        if self.counted.is_multiple_of(self.interval) {
            let row = self.row();
            self.rows.push(row);
        }
    }

    fn feed(&mut self, r: &MemRecord) {
        let (a, cpl) = (r.access, r.cpl());
        if a & access::FETCH_RUN != 0 {
            if r.pa == u64::MAX {
                self.unresolved += 1;
                return;
            }
            let mut off = 0;
            for k in 0..r.size.min(16) {
                let len = (r.ea >> (4 * k)) & 0xf;
                self.reference(r.ip + off, cpl, r.pa + off, len as u32, Kind::Fetch);
                off += len;
            }
            return;
        }
        if a & access::FETCH != 0 {
            return self.reference(r.ip, cpl, r.pa, r.size, Kind::Fetch);
        }
        if a & access::WITH_FETCH != 0 {
            let len = (a >> access::FETCH_LEN_SHIFT) & 0xf;
            self.reference(r.ip, cpl, r.ea, len, Kind::Fetch);
        }
        let refs = u32::from(a & access::READ != 0) + u32::from(a & access::WRITE != 0);
        if r.pa == u64::MAX {
            self.unresolved += 1;
            return;
        }
        for _ in 0..refs {
            self.reference(r.ip, cpl, r.pa, r.size, Kind::Read);
        }
    }

    fn outcome(&self) -> Outcome {
        let mut timeline = self.rows.clone();
        let last = self.row();
        if timeline.last() != Some(&last) {
            timeline.push(last);
        }
        let mut insns: Vec<_> = self
            .insns
            .iter()
            .map(|(&(va, cpl), &(d, f))| (va, cpl, d, f))
            .collect();
        insns.sort_unstable();
        Outcome {
            stats: self.h.stats(),
            fetch: self.h.fetch,
            data: self.h.data,
            skipped: self.skipped,
            unresolved: self.unresolved,
            timeline,
            insns,
        }
    }
}

/// The files a [`CacheSim`] writes, in memory.
#[derive(Default)]
struct Files(Vec<(String, Vec<u8>)>);

impl Sink for Files {
    fn open(&mut self, name: &str) -> Result<u16, Error> {
        self.0.push((name.to_string(), Vec::new()));
        Ok((self.0.len() - 1) as u16)
    }

    fn write(&mut self, file: u16, data: &[u8]) -> Result<(), Error> {
        self.0[usize::from(file)].1.extend_from_slice(data);
        Ok(())
    }

    fn close(&mut self, _file: u16) -> Result<(), Error> {
        Ok(())
    }
}

fn sim_outcome(sim: &CacheSim) -> Outcome {
    let mut files = Files::default();
    sim.write_files(&mut files).unwrap();
    let (_, csv) = files.0.iter().find(|(n, _)| n == TIMELINE_NAME).unwrap();
    let timeline = parse_timeline(std::str::from_utf8(csv).unwrap()).unwrap();
    let h = sim.hierarchy();
    let mut insns: Vec<_> = sim
        .insns()
        .entries()
        .map(|e| (e.va, e.cpl, e.data, e.fetch))
        .collect();
    insns.sort_unstable();
    Outcome {
        stats: h.caches().map(|(_, c)| c.stats).collect(),
        fetch: h.fetch_refs,
        data: h.data_refs,
        skipped: h.skipped_refs,
        unresolved: sim.unresolved(),
        timeline: timeline.rows,
        insns,
    }
}

/// Feeds `records` to a [`CacheSim`] for `o` in stretches of uneven length (as the host
/// thread's ring hands them over) and to the reference; every outcome must be equal.
fn compare_records(o: &Options, records: &[MemRecord], what: &str) {
    let mut sim = CacheSim::with_insn_capacity(&o.to_words(), HOST_CAPACITY).unwrap();
    let mut reference = RefFeed::new(o);
    let mut rng = Rng(7);
    let mut rest = records;
    while !rest.is_empty() {
        let (now, later) = rest.split_at((1 + rng.below(5000) as usize).min(rest.len()));
        kpin_tool::host_side::RecordConsumer::feed(&mut sim, now);
        rest = later;
    }
    for r in records {
        reference.feed(r);
    }
    let (got, want) = (sim_outcome(&sim), reference.outcome());
    assert!(
        want.stats[0].hits.iter().sum::<u64>() > 0 && want.stats[1].misses.iter().sum::<u64>() > 0,
        "{what}: the stream exercises hits and misses"
    );
    assert!(want.timeline.len() > 3, "{what}: timeline rows");
    if got != want {
        // Name the first field that differs rather than dumping both.
        assert_eq!(got.stats, want.stats, "{what}: {o:?}");
        assert_eq!((got.fetch, got.data), (want.fetch, want.data), "{what}");
        assert_eq!(
            (got.skipped, got.unresolved),
            (want.skipped, want.unresolved),
            "{what}"
        );
        assert_eq!(
            got.timeline.len(),
            want.timeline.len(),
            "{what}: timeline rows"
        );
        for (i, (g, w)) in got.timeline.iter().zip(&want.timeline).enumerate() {
            assert_eq!(g, w, "{what}: timeline row {i}");
        }
        assert_eq!(got.insns, want.insns, "{what}: misses per instruction");
    }
}

/// Records with every shape the engine sends, at random: runs of 2–16 instructions (some
/// of zero length, some crossing lines), single fetches, operands with and without their
/// instruction's fetch, read-modify-writes, line-crossing and unresolved addresses, both
/// CPLs; addresses from a small span, so lines repeat, or a wide one.
fn random_records(seed: u64, n: usize, span: u64) -> Vec<MemRecord> {
    let mut r = Rng(seed);
    let cpl = |r: &mut Rng| {
        if r.chance(50) {
            3u32 << access::CPL_SHIFT
        } else {
            0
        }
    };
    let pa = |r: &mut Rng| {
        if r.below(500) == 0 {
            u64::MAX
        } else {
            r.below(span)
        }
    };
    (0..n)
        .map(|_| {
            let ip = 0x40_0000 + r.below(4096);
            match r.below(4) {
                0 => {
                    let n = 2 + r.below(15);
                    let lens = (0..n).fold(0, |l, k| l | r.below(16) << (4 * k));
                    MemRecord {
                        ip,
                        ea: lens,
                        size: n as u32,
                        access: access::FETCH | access::FETCH_RUN | cpl(&mut r),
                        pa: pa(&mut r),
                    }
                }
                1 => MemRecord {
                    ip,
                    ea: ip,
                    size: 1 + r.below(15) as u32,
                    access: access::FETCH | cpl(&mut r),
                    pa: pa(&mut r),
                },
                k => {
                    let rw = [access::READ, access::WRITE, access::READ | access::WRITE]
                        [r.below(3) as usize];
                    let with_fetch = if k == 2 {
                        access::WITH_FETCH | (1 + r.below(15) as u32) << access::FETCH_LEN_SHIFT
                    } else {
                        0
                    };
                    MemRecord {
                        ip,
                        ea: if k == 2 { pa(&mut r) } else { ip },
                        size: [1, 2, 4, 8, 16, 64][r.below(6) as usize],
                        access: rw | with_fetch | cpl(&mut r),
                        pa: pa(&mut r),
                    }
                }
            }
        })
        .collect()
}

fn program_records(seed: u64, n: usize) -> Vec<MemRecord> {
    let mut p = Program::new(seed);
    let mut v = Vec::new();
    p.records(n, &mut v);
    v
}

#[test]
fn record_streams_match_the_reference_in_every_counter() {
    let geometries = [
        ("small", small()),
        (
            "no L2, 32-byte lines",
            Options {
                l1i: Geometry {
                    size: 1024,
                    assoc: 1,
                },
                l1d: Geometry {
                    size: 1024,
                    assoc: 2,
                },
                l2: None,
                ll: Geometry {
                    size: 16384,
                    assoc: 16,
                },
                line_size: 32,
                ..Options::default()
            },
        ),
        (
            "issue #25's",
            Options {
                l1i: Geometry {
                    size: 16 << 10,
                    assoc: 8,
                },
                l1d: Geometry {
                    size: 16 << 10,
                    assoc: 8,
                },
                l2: None,
                ll: Geometry {
                    size: 2 << 20,
                    assoc: 16,
                },
                line_size: 64,
                ..Options::default()
            },
        ),
    ];
    for (name, g) in geometries {
        for policy in policies() {
            let o = Options {
                policy,
                interval_refs: 997,
                ..g.clone()
            };
            compare_records(
                &o,
                &program_records(3, 150_000),
                &format!("{name}, program"),
            );
            compare_records(
                &o,
                &random_records(4, 60_000, 48 << 10),
                &format!("{name}, random"),
            );
            compare_records(
                &o,
                &random_records(5, 60_000, 4 << 20),
                &format!("{name}, random wide"),
            );
        }
    }
}

#[test]
fn record_streams_match_the_reference_with_warmup_and_sim_refs() {
    for policy in policies() {
        let o = Options {
            policy,
            interval_refs: 500,
            warmup_refs: 20_000,
            ..small()
        };
        compare_records(&o, &program_records(6, 100_000), "warmup");
        let limited = Options {
            sim_refs: 90_000,
            ..o
        };
        let records = program_records(7, 100_000);
        compare_records(&limited, &records, "warmup and sim_refs");
    }
}

/// The records' loop ([`Hierarchy::feed_records`]) against the reference, stopped at
/// random budgets of references (as the next timeline sample stops it), every record it
/// leaves fed on its own with room: the counters, the references, the unresolved records
/// and the misses per instruction are those of the reference.
#[test]
fn feeding_records_straight_into_the_hierarchy_matches_the_reference() {
    let issue_25 = Options {
        l1i: Geometry {
            size: 16 << 10,
            assoc: 8,
        },
        l1d: Geometry {
            size: 16 << 10,
            assoc: 8,
        },
        l2: None,
        ll: Geometry {
            size: 2 << 20,
            assoc: 16,
        },
        ..Options::default()
    };
    for g in [small(), issue_25] {
        for policy in policies() {
            let o = Options {
                policy,
                interval_refs: u64::MAX,
                ..g.clone()
            };
            let mut records = program_records(11, 100_000);
            records.extend(random_records(12, 40_000, 64 << 10));
            let mut h = Hierarchy::new(&o);
            let mut insns = MissTable::new(HOST_CAPACITY);
            let (mut unresolved, mut refs, mut stops) = (0, 0, 0);
            let mut rng = Rng(13);
            let mut rest = &records[..];
            while !rest.is_empty() {
                // Now and then too small for the next record.
                let most = if rng.chance(20) { 4 } else { 200 };
                let budget = 1 + rng.below(most);
                let fed = h.feed_records(rest, budget, &mut insns, &mut unresolved);
                assert!(fed.refs < budget, "{policy:?}: {fed:?} within {budget}");
                refs += fed.refs;
                stops += u64::from(fed.records < rest.len());
                rest = &rest[fed.records..];
                if fed.records == 0 {
                    // The next record's references reach the budget.
                    let fed = h.feed_records(&rest[..1], u64::MAX, &mut insns, &mut unresolved);
                    assert_eq!(fed.records, 1);
                    refs += fed.refs;
                    rest = &rest[1..];
                }
            }
            assert!(stops > 1000, "{policy:?}: the budgets stopped the loop");
            let mut reference = RefFeed::new(&o);
            records.iter().for_each(|r| reference.feed(r));
            let want = reference.outcome();
            let mut got: Vec<_> = insns
                .entries()
                .map(|e| (e.va, e.cpl, e.data, e.fetch))
                .collect();
            got.sort_unstable();
            let stats: Vec<Stats> = h.caches().map(|(_, c)| c.stats).collect();
            assert_eq!(stats, want.stats, "{policy:?}");
            assert_eq!((h.fetch_refs, h.data_refs), (want.fetch, want.data));
            assert_eq!(refs, want.fetch.iter().chain(&want.data).sum::<u64>());
            assert_eq!(unresolved, want.unresolved);
            assert!(got == want.insns, "{policy:?}: misses per instruction");
        }
    }
}

/// The loop leaves to `CacheSim::feed` what only it handles: records while warming up
/// or counting up to `sim_refs`, and records of no reference (a run of no instruction, a
/// task change).
#[test]
fn feeding_records_straight_leaves_the_rest_to_the_record_by_record_path() {
    let records = program_records(14, 100);
    let mut insns = MissTable::new(64);
    let mut unresolved = 0;
    for o in [
        Options {
            warmup_refs: 10,
            ..small()
        },
        Options {
            sim_refs: 1000,
            ..small()
        },
    ] {
        let mut h = Hierarchy::new(&o);
        let fed = h.feed_records(&records, u64::MAX, &mut insns, &mut unresolved);
        assert_eq!((fed.records, fed.refs), (0, 0));
    }
    let mut h = Hierarchy::new(&small());
    let empty_run = MemRecord {
        ip: 0x1000,
        ea: 0,
        size: 0,
        access: access::FETCH | access::FETCH_RUN,
        pa: 0x1000,
    };
    let task = MemRecord {
        ip: 0,
        ea: 5,
        size: 0,
        access: access::TASK,
        pa: 0,
    };
    for odd in [empty_run, task] {
        let stream = [records[0], records[1], odd, records[2]];
        let fed = h.feed_records(&stream, u64::MAX, &mut insns, &mut unresolved);
        assert_eq!(fed.records, 2, "{odd:?}");
    }
}
