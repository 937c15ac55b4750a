//! The per-instruction miss table (bounded, `other` when full), its file, and the
//! top-N ranking and report (issue #13).

use kpin_tool::host_side::BlockNames;
use kpin_tool::MemRecord;
use kpin_tool_cachesim::files;
use kpin_tool_cachesim::insns::{self, InsnMisses, MissKind, MissTable};
use kpin_tool_cachesim::report::TopInsns;
use kpin_tool_cachesim::CacheSim;

#[test]
fn test_table_counts_per_address_and_cpl_and_overflows_into_other() {
    let mut t = MissTable::new(4);
    assert_eq!(t.capacity(), 4);
    t.add(0x1000, 0, MissKind::Data, 2);
    t.add(0x1000, 0, MissKind::Fetch, 1);
    t.add(0x1000, 3, MissKind::Data, 5); // same address, user: another instruction
    t.add(0x2000, 0, MissKind::Data, 0); // no miss: not entered
    assert_eq!(t.len(), 2);
    t.add(0x2000, 0, MissKind::Data, 1);
    t.add(0x3000, 0, MissKind::Fetch, 1);
    assert_eq!(t.len(), 4, "full");
    // Full: a new instruction's misses go to `other`; known ones still count.
    t.add(0x4000, 0, MissKind::Data, 7);
    t.add(0x4000, 0, MissKind::Fetch, 3);
    t.add(0x1000, 0, MissKind::Data, 1);
    assert_eq!(t.len(), 4);
    assert_eq!((t.other.data, t.other.fetch), (7, 3));
    let mut rows: Vec<InsnMisses> = t.entries().copied().collect();
    rows.sort_by_key(|r| (r.va, r.cpl));
    let k = |va, cpl, data, fetch| InsnMisses {
        va,
        cpl,
        data,
        fetch,
    };
    assert_eq!(
        rows,
        [
            k(0x1000, 0, 3, 1),
            k(0x1000, 3, 5, 0),
            k(0x2000, 0, 1, 0),
            k(0x3000, 0, 0, 1)
        ]
    );

    // The file round-trips, `other` included, and the totals are every miss counted.
    let mut text = String::new();
    insns::write(&mut text, &t).unwrap();
    let parsed = insns::parse(&text).unwrap();
    assert_eq!(parsed.other, t.other);
    assert_eq!(parsed.totals(), (3 + 5 + 1 + 7, 1 + 1 + 3));
    let mut prow = parsed.rows.clone();
    prow.sort_by_key(|r| (r.va, r.cpl));
    assert_eq!(prow, rows);
}

#[test]
fn test_file_from_the_guest_is_checked() {
    assert_eq!(insns::parse("va,cpl\n"), Err(1));
    let head = "va,cpl,data_misses,fetch_misses\n";
    assert_eq!(
        insns::parse(&format!("{head}0x10,4,1,1\n")),
        Err(2),
        "CPL 4"
    );
    assert_eq!(
        insns::parse(&format!("{head}10,0,1,1\n")),
        Err(2),
        "not hex"
    );
    assert_eq!(insns::parse(&format!("{head}0x10,0,1\n")), Err(2));
    assert_eq!(insns::parse(&format!("{head}0x10,0,x,1\n")), Err(2));
    assert!(insns::parse(&format!("{head}0x10,0,1,1\nother,,0,0\n")).is_ok());
}

#[test]
fn test_ranking_most_first_ties_by_address_and_zero_left_out() {
    let k = |va, data, fetch| InsnMisses {
        va,
        cpl: 0,
        data,
        fetch,
    };
    let rows = [k(0x30, 5, 0), k(0x10, 9, 1), k(0x20, 5, 4), k(0x40, 0, 2)];
    let top = insns::top(&rows, MissKind::Data, 2);
    assert_eq!(
        top.iter().map(|r| r.va).collect::<Vec<_>>(),
        [0x10, 0x20],
        "9 first, then the lower address of the two 5s"
    );
    let all = insns::top(&rows, MissKind::Data, 10);
    assert_eq!(all.len(), 3, "0x40 has no data misses");
    let fetch = insns::top(&rows, MissKind::Fetch, 10);
    assert_eq!(
        fetch.iter().map(|r| r.va).collect::<Vec<_>>(),
        [0x20, 0x40, 0x10]
    );
}

struct Names;

impl BlockNames for Names {
    fn source(&self) -> String {
        "System.map test".into()
    }
    fn name(&self, addr: u64) -> Option<String> {
        (addr >= 0xffff_ffff_8100_0000).then(|| format!("memset+{:#x}", addr & 0xff))
    }
}

#[test]
fn test_report_names_shares_and_other() {
    let k = |va, cpl, data, fetch| InsnMisses {
        va,
        cpl,
        data,
        fetch,
    };
    let parsed = insns::Insns {
        rows: vec![k(0xffff_ffff_8100_0010, 0, 30, 0), k(0x40_1000, 3, 10, 5)],
        other: k(0, 0, 60, 0),
    };
    let top = TopInsns::new(&parsed, 10, Some(&Names));
    assert_eq!(top.data.len(), 2);
    assert_eq!(top.data[0].symbol.as_deref(), Some("memset+0x10"));
    assert_eq!(top.data[0].address, "0xffffffff81000010");
    assert!((top.data[0].share - 0.30).abs() < 1e-9, "30 of 100");
    assert_eq!(top.data[1].symbol, None, "a user address no symbol covers");
    assert_eq!(top.fetch.len(), 1);
    assert!((top.fetch[0].share - 1.0).abs() < 1e-9);
    let text = top.text();
    assert!(text.contains("names from System.map test"), "{text}");
    assert!(
        text.contains("memset+0x10") && text.contains("30.00%"),
        "{text}"
    );
    assert!(
        text.contains("60 misses of instructions past the table"),
        "{text}"
    );
    let none = TopInsns::new(&parsed, 10, None);
    assert!(none.text().contains("nowhere (no symbols)"));
}

/// The engine side: a fetch record's L1I misses and a data record's L1D misses land on
/// its instruction, and nothing is counted during the warmup.
#[test]
fn test_cachesim_counts_l1_misses_per_instruction() {
    use kpin_tool::access;
    let rec = |ip: u64, pa: u64, bits: u32| MemRecord {
        ip,
        ea: pa,
        size: 8,
        access: bits | 3 << access::CPL_SHIFT,
        pa,
    };
    let mut sim = CacheSim::new("warmup_refs=1").unwrap();
    sim.feed(&rec(0x400, 0x9000, access::READ)); // warmup: not counted
    assert!(sim.insns().is_empty());
    sim.feed(&rec(0x400, 0x1000, access::FETCH)); // cold L1I line: 1 miss
    sim.feed(&rec(0x400, 0x2000, access::READ | access::WRITE)); // read misses, write hits
    sim.feed(&rec(0x404, 0x1004, access::FETCH)); // same line: hit
    sim.feed(&rec(0x404, 0x203c, access::READ)); // crosses into 0x2040: 1 miss
    let mut rows: Vec<InsnMisses> = sim.insns().entries().copied().collect();
    rows.sort_by_key(|r| r.va);
    assert_eq!(
        rows,
        [
            InsnMisses {
                va: 0x400,
                cpl: 3,
                data: 1,
                fetch: 1
            },
            InsnMisses {
                va: 0x404,
                cpl: 3,
                data: 1,
                fetch: 0
            }
        ]
    );
    let h = sim.hierarchy();
    let m = |c: &kpin_tool_cachesim::sim::Cache| c.stats.misses[0] + c.stats.misses[1];
    assert_eq!((m(h.l1d()), m(h.l1i())), (2, 1));
    let _ = files::timeline_width(h);
}
