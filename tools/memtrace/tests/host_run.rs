//! memtrace on the host: a loop that stores and reloads 100 quadwords, run by the
//! translator in this test process (no VM) as kernel code and then as user code; the
//! file must hold exactly the loop's accesses in order, with their CPL and PA, and
//! `cpl=3` / `limit=` must keep what they say.

use kpin_tool::host_run::{run_store_reload_loop, Files};
use kpin_tool::KpinTool;
use kpin_tool_memtrace::format::{Record, Trace};
use kpin_tool_memtrace::{MemTrace, BIN_NAME, SUMMARY_NAME};

/// Runs the loop at CPL 0 then CPL 3 under memtrace with `options`; returns the records,
/// the summary and the code's base address.
fn run(options: &str) -> (Vec<Record>, String, u64) {
    let mut tool = MemTrace::new(options).expect("options");
    // Kept whole: the engine runs in the mappings the run owns.
    let run = run_store_reload_loop(&mut tool);
    let (engine, base) = (&run.engine, run.base);
    let mut files = Files::default();
    tool.finish(engine, &mut files).expect("finish");
    let names: Vec<&str> = files.0.iter().map(|f| f.0.as_str()).collect();
    assert_eq!(names, [BIN_NAME, SUMMARY_NAME]);
    assert!(files.0.iter().all(|f| f.2), "every file closed");
    let records = Trace::parse(&files.0[0].1)
        .expect("parses")
        .records()
        .collect();
    let summary = String::from_utf8(files.0[1].1.clone()).unwrap();
    (records, summary, base)
}

#[test]
fn test_the_loops_accesses_in_order_at_both_cpls_and_the_filters() {
    const N: u64 = 100;
    let (all, summary, base) = run("");
    let per_mode = 2 * N as usize + 1;
    assert_eq!(all.len(), 2 * per_mode, "{summary}");
    for (m, cpl) in [(0, 0), (1, 3)] {
        let recs = &all[m * per_mode..(m + 1) * per_mode];
        for (i, pair) in recs[..2 * N as usize].chunks(2).enumerate() {
            let ea = base + 4096 + (N - i as u64) * 8;
            assert_eq!((pair[0].insn_vaddr, pair[0].mem_vaddr), (base + 5, ea));
            assert!(pair[0].is_write() && !pair[0].is_read());
            assert_eq!((pair[1].insn_vaddr, pair[1].mem_vaddr), (base + 9, ea));
            assert!(pair[1].is_read() && !pair[1].is_write());
        }
        // `jmp [rip + 0]` loads its target from the 8 bytes after it.
        let last = recs[2 * N as usize];
        assert_eq!((last.insn_vaddr, last.mem_vaddr), (base + 17, base + 23));
        assert!(recs.iter().all(|r| r.cpl() == cpl && r.size == 8));
        // Identity-mapped: the PA is the VA.
        assert!(recs.iter().all(|r| r.mem_paddr == r.mem_vaddr));
    }
    assert!(
        summary.starts_with(&format!(
            "records={} dropped=0 unresolved=0 lost=0 cpl=all",
            2 * per_mode
        )),
        "{summary}"
    );

    let (user, summary, _) = run("cpl=3");
    assert_eq!(user, all[per_mode..], "{summary}");

    let (limited, summary, _) = run("limit=7");
    assert_eq!(limited, all[..7]);
    assert!(
        summary.starts_with(&format!("records=7 dropped={}", 2 * per_mode - 7)),
        "{summary}"
    );
}
