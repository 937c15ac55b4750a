//! A run record (`access::FETCH_RUN`) simulates exactly what one fetch record per
//! instruction would: same hits, misses and compulsory misses in every cache, same
//! per-instruction misses — also with runs that cross lines, start cold, and follow data.
//! So does an operand record carrying its instruction's fetch (`access::WITH_FETCH`),
//! against a fetch record followed by the operand's (also when the operand has no
//! physical address: the fetch still counts).

use kpin_tool::{access, MemRecord};
use kpin_tool_cachesim::CacheSim;

fn fetch(ip: u64, pa: u64, len: u32) -> MemRecord {
    MemRecord {
        ip,
        ea: ip,
        size: len,
        access: access::FETCH,
        pa,
    }
}

/// Per cache its stats, the references, and per instruction (va, cpl, data, fetch) misses.
type Summary = (Vec<String>, u64, Vec<(u64, u8, u64, u64)>);

fn summary(s: &CacheSim) -> Summary {
    let caches = s
        .hierarchy()
        .caches()
        .map(|(name, c)| format!("{name} {:?}", c.stats))
        .collect();
    let mut insns: Vec<_> = s
        .insns()
        .entries()
        .map(|e| (e.va, e.cpl, e.data, e.fetch))
        .collect();
    insns.sort_unstable();
    (caches, s.references(), insns)
}

#[test]
fn test_run_records_simulate_like_one_fetch_record_each() {
    let opts = "L1I_size=1K L1I_assoc=2 L1D_size=1K L1D_assoc=2 LL_size=4K LL_assoc=4 line_size=32";
    let (mut each, mut runs) = (CacheSim::new(opts).unwrap(), CacheSim::new(opts).unwrap());
    // A pseudo-random program: runs of 1-16 instructions of 1-15 bytes at scattered
    // addresses (crossing lines now and then), data accesses between them.
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for _ in 0..20_000 {
        let n = 1 + next() % 16;
        let start = (next() % 0x4000) & !1;
        let (mut lens, mut at) = (0u64, start);
        for k in 0..n {
            let len = 1 + next() % 15;
            lens |= len << (4 * k);
            each.feed(&fetch(0xffff_8000_0000_0000 + at, at, len as u32));
            at += len;
        }
        runs.feed(&MemRecord {
            ip: 0xffff_8000_0000_0000 + start,
            ea: lens,
            size: n as u32,
            access: access::FETCH | access::FETCH_RUN,
            pa: start,
        });
        // The data access of the instruction after the run: a read or a read-modify-write,
        // now and then without a physical address.
        let dlen = 1 + next() % 15;
        let rmw = next() % 4 == 0;
        let d = MemRecord {
            ip: 0xffff_8000_0000_0000 + at,
            ea: 0,
            size: 8,
            access: if rmw {
                access::READ | access::WRITE
            } else {
                access::READ
            },
            pa: if next() % 50 == 0 {
                u64::MAX
            } else {
                0x10_0000 + (next() % 0x2000)
            },
        };
        each.feed(&fetch(d.ip, at, dlen as u32));
        each.feed(&d);
        runs.feed(&MemRecord {
            ea: at,
            access: d.access | access::WITH_FETCH | (dlen as u32) << access::FETCH_LEN_SHIFT,
            ..d
        });
    }
    assert_eq!(summary(&each), summary(&runs));
    assert_eq!(each.unresolved(), runs.unresolved());
    assert!(each.references() > 100_000 && each.unresolved() > 0);
}

#[test]
fn a_reference_of_any_size_is_simulated_for_at_most_a_page() {
    // The records come from the engine's side: a size of gigabytes, high in the
    // physical address space (past the seen-lines bitmaps), alone, in a batch and with
    // attribution, simulates the lines of MAX_REF_BYTES and no more.
    use kpin_tool_cachesim::sim::MAX_REF_BYTES;
    let huge = |bits: u32| MemRecord {
        ip: 0x40_1000,
        ea: 0,
        size: u32::MAX,
        access: bits,
        pa: 0x7fff_0000_0000,
    };
    for opts in ["line_size=64", "line_size=64 attribute=on"] {
        let mut s = CacheSim::new(opts).unwrap();
        s.feed(&huge(access::READ));
        s.feed_all(&[huge(access::WRITE), huge(access::READ | access::WRITE)]);
        let l1d = s.hierarchy().l1d().stats;
        let lines = u64::from(MAX_REF_BYTES / 64);
        assert_eq!(l1d.misses[0] + l1d.misses[1], lines, "{opts}");
        // The write hits them all, and the read-modify-write is a read and a write.
        assert_eq!(l1d.hits[0] + l1d.hits[1], 3 * lines, "{opts}");
    }
}
