//! The simulator against a plain reference model written here, independently: per set an
//! MRU-first list (LRU), an insertion-ordered queue (FIFO) or a way array (RANDOM, with
//! the documented xorshift64 stream), a `HashSet` of lines ever held per cache, and the
//! hierarchy walked by hand. Every counter is compared exactly on random and adversarial
//! streams.

use std::collections::{HashSet, VecDeque};

use kpin_tool_cachesim::options::{Geometry, Options, Policy};
use kpin_tool_cachesim::sim::{Hierarchy, Kind, Stats, KERNEL, USER};

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

    fn access(&mut self, addr: u64, size: u32, kind: Kind, who: usize) {
        if kind == Kind::Fetch {
            self.fetch[who] += 1;
        } else {
            self.data[who] += 1;
        }
        let mut line = addr / self.line;
        let end = (addr + u64::from(size) - 1) / self.line;
        while line <= end {
            let l1 = if kind == Kind::Fetch {
                &mut self.l1i
            } else {
                &mut self.l1d
            };
            let hit = l1.access(line, who) || self.l2.as_mut().is_some_and(|c| c.access(line, who));
            if !hit {
                self.ll.access(line, who);
            }
            line += 1;
        }
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
