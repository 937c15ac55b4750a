//! Records straight into the hierarchy: the common case of `CacheSim`'s record by record
//! path (every reference counted, no timeline sample due) in one loop over a slice of
//! records, without that path's per-record checks of the warmup, `sim_refs` and the
//! timeline. The record by record path stays the definition; this loop simulates exactly
//! what it would, and leaves every record it does not handle to it.

use kpin_tool::{access, MemRecord};

use super::{Hierarchy, Kind};
use crate::insns::{MissKind, MissTable};

/// What [`Hierarchy::feed_records`] simulated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fed {
    /// Records simulated, from the first.
    pub records: usize,
    /// References they counted (those the timeline counts).
    pub refs: u64,
}

impl Hierarchy {
    /// While every reference is counted ([`Hierarchy::counting_all`]): simulates
    /// `records` from the first, each as `CacheSim::feed` would, up to the first that it
    /// leaves to `feed`: one whose references would make `budget` references counted
    /// (a timeline sample falls in it), a run of no instruction, or a record of no
    /// reference (not a fetch, a run or a read or write). The L1 misses of each
    /// instruction are counted in `insns`, records without a physical address in
    /// `unresolved`.
    pub fn feed_records(
        &mut self,
        records: &[MemRecord],
        budget: u64,
        insns: &mut MissTable,
        unresolved: &mut u64,
    ) -> Fed {
        let mut refs = 0;
        if !self.all {
            return Fed { records: 0, refs };
        }
        // Each record is checked against the budget with all the references it stands
        // for (those without an address too: a bound, as the record by record path checks
        // each part on its own).
        for (i, r) in records.iter().enumerate() {
            let a = r.access;
            let who = usize::from(a >> access::CPL_SHIFT & 3 == 3);
            refs += if a & access::FETCH_RUN != 0 {
                let n = u64::from(r.size.min(16));
                if n == 0 || refs + n >= budget {
                    return Fed { records: i, refs };
                }
                self.run(r, who, insns, unresolved)
            } else if a & access::FETCH != 0 {
                if refs + 1 >= budget {
                    return Fed { records: i, refs };
                }
                self.refs(Kind::Fetch, r, r.pa, r.size, 1, who, insns, unresolved)
            } else {
                let data = u64::from(a & access::READ != 0) + u64::from(a & access::WRITE != 0);
                let with_fetch = a & access::WITH_FETCH != 0;
                if data == 0 || refs + data + u64::from(with_fetch) >= budget {
                    return Fed { records: i, refs };
                }
                let mut fetched = 0;
                if with_fetch {
                    let len = (a >> access::FETCH_LEN_SHIFT) & 0xf;
                    fetched = self.refs(Kind::Fetch, r, r.ea, len, 1, who, insns, unresolved);
                }
                fetched + self.refs(Kind::Read, r, r.pa, r.size, data, who, insns, unresolved)
            };
        }
        Fed {
            records: records.len(),
            refs,
        }
    }

    /// `n` references of `kind` in a row by `r`'s instruction to the `size` bytes at `pa`
    /// (`u64::MAX`: unresolved, not simulated), its L1 misses counted for it; returns the
    /// references counted.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn refs(
        &mut self,
        kind: Kind,
        r: &MemRecord,
        pa: u64,
        size: u32,
        n: u64,
        who: usize,
        insns: &mut MissTable,
        unresolved: &mut u64,
    ) -> u64 {
        if pa == u64::MAX {
            *unresolved += 1;
            return 0;
        }
        let shift = self.line_shift;
        let (first, last) = (
            pa >> shift,
            pa.wrapping_add(u64::from(super::ref_bytes(size)) - 1) >> shift,
        );
        let leaf = self.leaf(kind);
        let mut missed = 0;
        if first == last {
            // References to one line: those repeating the line their L1 accessed last
            // are hits that change nothing else (`Cache::last`); so are all but the
            // first of the others.
            let c = &mut self.caches[leaf];
            if c.last != first.wrapping_add(1) {
                if !c.access_other(first, who) {
                    missed = 1;
                    self.miss_from(leaf, first, who);
                }
                self.caches[leaf].stats.hits[who] += n - 1;
            } else {
                c.stats.hits[who] += n;
            }
        } else {
            for _ in 0..n {
                let mut line = first;
                loop {
                    if !self.caches[leaf].access(line, who) {
                        missed += 1;
                        self.miss_from(leaf, line, who);
                    }
                    if line >= last {
                        break;
                    }
                    line += 1;
                }
            }
        }
        self.count_refs(kind, n, who);
        if missed > 0 {
            let miss_kind = match kind {
                Kind::Fetch => MissKind::Fetch,
                Kind::Read | Kind::Write => MissKind::Data,
            };
            insns.add(r.ip, r.cpl(), miss_kind, missed);
        }
        n
    }

    /// A run record (`size` instructions from `ip`, lengths in `ea`'s nibbles), line by
    /// line: each line of the run is accessed once, the other fetches counted as the
    /// hits on the line just accessed that one fetch record each would give. Returns
    /// the references counted.
    #[inline(always)]
    fn run(
        &mut self,
        r: &MemRecord,
        who: usize,
        insns: &mut MissTable,
        unresolved: &mut u64,
    ) -> u64 {
        if r.pa == u64::MAX {
            *unresolved += 1;
            return 0;
        }
        let n = r.size.min(16);
        let len = |k: u32| (r.ea >> (4 * k)) & 0xf;
        // The run's bytes: the lengths' sum, and one more if it ends in zero-length
        // instructions (each touches the byte it starts at).
        let lens = if n >= 16 {
            r.ea
        } else {
            r.ea & ((1 << (4 * n)) - 1)
        };
        let end =
            r.pa.wrapping_add(nibble_sum(lens))
                .wrapping_sub(u64::from(len(n - 1) != 0));
        let shift = self.line_shift;
        let (first, last) = (r.pa >> shift, end >> shift);
        let leaf = self.fetch_leaf;
        // Most runs lie wholly in the line the instruction L1 saw last: `n` hits at once.
        if first == last && self.caches[leaf].last == first.wrapping_add(1) {
            self.caches[leaf].stats.hits[who] += u64::from(n);
            self.fetch_refs[who] += u64::from(n);
            return u64::from(n);
        }
        // Instruction `k` touches the lines from its first byte to its last; the run's
        // line accesses never go back, so each of its lines is accessed once in full
        // (the first maybe a hit on the L1's last line), and every other access repeats
        // the line just accessed.
        let accesses = if first == last {
            u64::from(n)
        } else {
            run_line_accesses(r.pa, r.ea, n, shift)
        };
        let mut line = first;
        loop {
            if !self.caches[leaf].access(line, who) {
                self.miss_from(leaf, line, who);
                // The miss is the instruction's that touches the line first.
                let mut off = 0;
                for k in 0..n {
                    let end = r.pa.wrapping_add(off + len(k).max(1) - 1);
                    if end >> shift >= line {
                        break;
                    }
                    off += len(k);
                }
                insns.add(r.ip + off, r.cpl(), MissKind::Fetch, 1);
            }
            if line >= last {
                break;
            }
            line += 1;
        }
        self.fetch_refs[who] += u64::from(n);
        self.caches[leaf].stats.hits[who] += accesses - (last - first + 1);
        u64::from(n)
    }
}

/// The line accesses of a fetch run of `n` instructions from `pa` whose lengths are the
/// nibbles of `lens` (a `FETCH_RUN` record's `ea`), with lines of `1 << shift` bytes: one
/// per instruction, and one more for every line boundary an instruction crosses.
pub(crate) fn run_line_accesses(pa: u64, lens: u64, n: u32, shift: u32) -> u64 {
    let len = |k: u32| (lens >> (4 * k)) & 0xf;
    let mut accesses = u64::from(n);
    let mut off = 0;
    for k in 0..n {
        let at = pa.wrapping_add(off);
        let end = at.wrapping_add(len(k).max(1) - 1);
        accesses += (end >> shift) - (at >> shift);
        off += len(k);
    }
    accesses
}

/// The sum of the 16 nibbles of `x`.
pub(crate) fn nibble_sum(x: u64) -> u64 {
    const LOW: u64 = 0x0f0f_0f0f_0f0f_0f0f;
    // Bytes of at most 30, then all eight added into the top byte (at most 240).
    let bytes = (x & LOW) + ((x >> 4) & LOW);
    bytes.wrapping_mul(0x0101_0101_0101_0101) >> 56
}
