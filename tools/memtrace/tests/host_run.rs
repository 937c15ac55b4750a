//! memtrace on the host: a loop that stores and reloads 100 quadwords, run by the
//! translator in this test process (no VM) as kernel code and then as user code; the
//! file must hold exactly the loop's accesses in order, with their CPL and PA, and
//! `cpl=3` / `limit=` must keep what they say.

use guest_engine::{Config, Engine, Gpr, GuestVirt, Mode, Stop, StopPlatform};
use kpin_tool::host_run::{CodePage, Files, Region};
use kpin_tool::KpinTool;
use kpin_tool_memtrace::format::{Record, Trace};
use kpin_tool_memtrace::{MemTrace, BIN_NAME, SUMMARY_NAME};

/// Runs the loop at CPL 0 then CPL 3 under memtrace with `options`; returns the records,
/// the summary and the code's base address.
fn run(options: &str) -> (Vec<Record>, String, u64) {
    const ITERATIONS: u64 = 100;
    const EXIT: u64 = 0x1000; // not in guest memory: the fetch there ends the run
    let code = Region::map(8192);
    let mut bytes = vec![
        0xb9,
        ITERATIONS as u8,
        0,
        0,
        0, // mov ecx, 100
        0x48,
        0x89,
        0x0c,
        0xcf, // l: mov [rdi + rcx*8], rcx
        0x48,
        0x03,
        0x04,
        0xcf, // add rax, [rdi + rcx*8]
        0xff,
        0xc9, // dec ecx
        0x75,
        0xf4, // jnz l
        0xff,
        0x25,
        0,
        0,
        0,
        0, // jmp [rip + 0]
    ];
    bytes.extend_from_slice(&EXIT.to_le_bytes());
    // SAFETY: the mapping is 8192 bytes, writable, and nothing runs in it yet.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), code.0, bytes.len()) };

    let cache = Region::map(32 << 20);
    let config = Config {
        save_extended_state: true,
        count_insns: true,
        ..Config::default()
    };
    // SAFETY: `cache` is an RWX, page-aligned mapping owned by this test for the engine's
    // lifetime, smaller than 2 GiB.
    let mut engine = unsafe { Engine::new(cache.0, cache.1, config) }.expect("engine");
    let base = code.0 as u64;
    let mut tool = MemTrace::new(options).expect("options");
    for mode in [Mode::KERNEL, Mode::USER] {
        engine.set_mode(mode).expect("mode");
        engine.set_rip(GuestVirt(base));
        engine.regs_mut().set(Gpr::Rax, 0);
        engine.regs_mut().set(Gpr::Rdi, base + 4096);
        let stop = engine.run(&mut CodePage(base, 8192), &mut StopPlatform, &mut tool);
        assert_eq!(stop, Stop::FetchFault(GuestVirt(EXIT)));
    }
    let mut files = Files::default();
    tool.finish(&engine, &mut files).expect("finish");
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
