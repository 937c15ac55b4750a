//! Misses per instruction (QEMU's `contrib/plugins/cache.c` keeps the same): the engine
//! counts the L1D (data) and L1I (fetch) misses of each instruction, keyed by its guest
//! virtual address and CPL, in a bounded open-addressing table, and writes it at the end
//! as [`crate::INSNS_NAME`]; the host ranks it ([`top`]) for the report.
//!
//! Only a miss touches the table, so the per-access cost of a hit is unchanged. When the
//! table is full, the misses of instructions not in it are counted as `other`: the file
//! and the report say how many, nothing is dropped silently.
//!
//! The file: a header, one row per instruction, then one `other` row:
//! ```text
//! va,cpl,data_misses,fetch_misses
//! 0xffffffff81000045,0,120,3
//! other,,0,0
//! ```

use alloc::string::String;
use alloc::vec;
use alloc::vec::Vec;
use core::fmt;

/// Instructions the table holds by default (a power of two): what the engine's heap
/// affords.
pub const DEFAULT_CAPACITY: usize = 32768;
/// Instructions the table holds when the simulation runs on the host (~34 MiB there): the
/// Linux boot's misses come from more instructions than [`DEFAULT_CAPACITY`].
pub const HOST_CAPACITY: usize = 1 << 19;

/// One instruction's misses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InsnMisses {
    /// Guest virtual address of the instruction.
    pub va: u64,
    /// Virtual CPL it ran at.
    pub cpl: u8,
    /// Its data accesses that missed the L1D (line accesses).
    pub data: u64,
    /// Its fetches that missed the L1I (line accesses).
    pub fetch: u64,
}

/// Which misses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MissKind {
    /// L1D misses of data accesses.
    Data,
    /// L1I misses of instruction fetches.
    Fetch,
}

impl InsnMisses {
    /// Its misses of `kind`.
    pub fn of(&self, kind: MissKind) -> u64 {
        match kind {
            MissKind::Data => self.data,
            MissKind::Fetch => self.fetch,
        }
    }
}

/// A bounded open-addressing (linear probing) table of [`InsnMisses`]. It has twice as
/// many slots as instructions it holds, so a probe always ends at a free slot (a full
/// table sends a new instruction to `other` there) and stays short.
#[derive(Clone, Debug)]
pub struct MissTable {
    /// `used[i]`: slot `i` holds an instruction.
    used: Vec<bool>,
    slots: Vec<InsnMisses>,
    len: usize,
    capacity: usize,
    /// Misses of instructions that found the table full.
    pub other: InsnMisses,
}

impl MissTable {
    /// A table of `capacity` instructions (rounded up to a power of two, at least 1).
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity.max(1).next_power_of_two();
        let n = 2 * capacity;
        Self {
            used: vec![false; n],
            slots: vec![InsnMisses::default(); n],
            len: 0,
            capacity,
            other: InsnMisses::default(),
        }
    }

    /// Instructions held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no instruction is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Instructions it can hold.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Counts `misses` of `kind` for the instruction at `va` run at `cpl`.
    pub fn add(&mut self, va: u64, cpl: u8, kind: MissKind, misses: u64) {
        if misses == 0 {
            return;
        }
        let mask = self.slots.len() - 1;
        // Fibonacci hashing: instruction addresses are dense and share low bits.
        let h = (va ^ u64::from(cpl) << 62).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let mut i = (h >> 32) as usize & mask;
        let entry = loop {
            if !self.used[i] {
                if self.len == self.capacity {
                    break &mut self.other;
                }
                self.used[i] = true;
                self.len += 1;
                self.slots[i] = InsnMisses {
                    va,
                    cpl,
                    ..InsnMisses::default()
                };
                break &mut self.slots[i];
            }
            if self.slots[i].va == va && self.slots[i].cpl == cpl {
                break &mut self.slots[i];
            }
            i = (i + 1) & mask;
        };
        match kind {
            MissKind::Data => entry.data += misses,
            MissKind::Fetch => entry.fetch += misses,
        }
    }

    /// The instructions held, in table order.
    pub fn entries(&self) -> impl Iterator<Item = &InsnMisses> {
        self.slots
            .iter()
            .zip(&self.used)
            .filter(|(_, &u)| u)
            .map(|(e, _)| e)
    }

    /// Forgets every count (the warmup ended).
    pub fn clear(&mut self) {
        if self.len > 0 || self.other != InsnMisses::default() {
            self.used.iter_mut().for_each(|u| *u = false);
            self.len = 0;
            self.other = InsnMisses::default();
        }
    }
}

/// Writes the table as the file described in the module documentation.
pub fn write(out: &mut dyn fmt::Write, t: &MissTable) -> fmt::Result {
    out.write_str("va,cpl,data_misses,fetch_misses\n")?;
    for e in t.entries() {
        writeln!(out, "{:#x},{},{},{}", e.va, e.cpl, e.data, e.fetch)?;
    }
    writeln!(out, "other,,{},{}", t.other.data, t.other.fetch)
}

/// The parsed file: the instructions and the `other` row's counts.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Insns {
    /// One per instruction.
    pub rows: Vec<InsnMisses>,
    /// Misses of instructions the full table could not hold (`va` and `cpl` 0).
    pub other: InsnMisses,
}

impl Insns {
    /// All the misses, `(data, fetch)`: the rows' and `other`'s.
    pub fn totals(&self) -> (u64, u64) {
        self.rows
            .iter()
            .chain([&self.other])
            .fold((0, 0), |(d, f), r| {
                (d.saturating_add(r.data), f.saturating_add(r.fetch))
            })
    }
}

/// Parses the file; the error is the first line number that is not what the engine
/// writes (the file came from inside the guest).
pub fn parse(text: &str) -> Result<Insns, usize> {
    let mut out = Insns::default();
    for (i, line) in text.lines().enumerate() {
        let bad = i + 1;
        if i == 0 {
            if line != "va,cpl,data_misses,fetch_misses" {
                return Err(bad);
            }
            continue;
        }
        let f: Vec<&str> = line.split(',').collect();
        let [va, cpl, data, fetch] = f[..] else {
            return Err(bad);
        };
        let data = data.parse().map_err(|_| bad)?;
        let fetch = fetch.parse().map_err(|_| bad)?;
        if va == "other" && cpl.is_empty() {
            out.other.data += data;
            out.other.fetch += fetch;
            continue;
        }
        let va = va
            .strip_prefix("0x")
            .and_then(|h| u64::from_str_radix(h, 16).ok())
            .ok_or(bad)?;
        let cpl = cpl.parse::<u8>().ok().filter(|&c| c <= 3).ok_or(bad)?;
        out.rows.push(InsnMisses {
            va,
            cpl,
            data,
            fetch,
        });
    }
    Ok(out)
}

/// The `n` instructions with the most misses of `kind` (none with 0), most first; ties
/// by address then CPL, so the ranking does not depend on the table's order.
pub fn top(rows: &[InsnMisses], kind: MissKind, n: usize) -> Vec<InsnMisses> {
    let mut v: Vec<InsnMisses> = rows.iter().filter(|r| r.of(kind) > 0).copied().collect();
    v.sort_unstable_by(|a, b| {
        b.of(kind)
            .cmp(&a.of(kind))
            .then(a.va.cmp(&b.va))
            .then(a.cpl.cmp(&b.cpl))
    });
    v.truncate(n);
    v
}

/// `va` as the report shows it when nothing names it.
pub fn hex(va: u64) -> String {
    alloc::format!("{va:#x}")
}
