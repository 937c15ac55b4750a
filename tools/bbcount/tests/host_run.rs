//! bbcount on the host: a counted loop run by the translator in this test process (no
//! VM), as kernel code and then as user code, then the CSV it writes (with each block's
//! CPL and physical address) and its summary's user/kernel split compared with what the loop must have executed.

use guest_engine::{Config, Engine, Gpr, GuestVirt, Mode, Stop, StopPlatform};
use kpin_tool::host_run::{CodePage, Files, Region};
use kpin_tool::KpinTool;
use kpin_tool_bbcount::{parse_csv, BbCount, Row, CSV_NAME};

#[test]
fn loop_blocks_are_counted_exactly() {
    const ITERATIONS: u64 = 100;
    const EXIT: u64 = 0x1000; // not in guest memory: the fetch there ends the run
    let code = Region::map(4096);
    let mut bytes = vec![
        0xb9,
        ITERATIONS as u8,
        0,
        0,
        0, // mov ecx, 100
        0x48,
        0x01,
        0xc8, // l: add rax, rcx
        0xff,
        0xc9, // dec ecx
        0x75,
        0xf9, // jnz l
        0xff,
        0x25,
        0,
        0,
        0,
        0, // jmp [rip + 0]
    ];
    bytes.extend_from_slice(&EXIT.to_le_bytes());
    // SAFETY: the mapping is 4096 bytes, writable, and nothing runs in it yet.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), code.0, bytes.len()) };

    let cache = Region::map(32 << 20);
    let config = Config {
        save_extended_state: true,
        ..Config::default()
    };
    // SAFETY: `cache` is an RWX, page-aligned mapping owned by this test for the engine's
    // lifetime, smaller than 2 GiB.
    let mut engine = unsafe { Engine::new(cache.0, cache.1, config) }.expect("engine");
    let base = code.0 as u64;
    let mut tool = BbCount::default();
    // The same code once as kernel code, then as user code: two translations, whose rows
    // carry their own CPL.
    for (mode, cpl) in [(Mode::KERNEL, 0), (Mode::USER, 3)] {
        engine.set_mode(mode).expect("mode");
        engine.set_rip(GuestVirt(base));
        engine.regs_mut().set(Gpr::Rax, 0);
        let stop = engine.run(&mut CodePage(base, 4096), &mut StopPlatform, &mut tool);
        assert_eq!(stop, Stop::FetchFault(GuestVirt(EXIT)));
        assert_eq!(
            engine.regs().get(Gpr::Rax),
            ITERATIONS * (ITERATIONS + 1) / 2
        );
        // 1 mov + 3 per iteration + 1 jmp, whatever the block boundaries.
        assert_eq!(tool.instructions_at(&engine, cpl), 1 + 3 * ITERATIONS + 1);
    }
    assert_eq!(tool.instructions(&engine), 2 * (1 + 3 * ITERATIONS + 1));

    let mut files = Files::default();
    tool.finish(&engine, &mut files).expect("finish");
    assert_eq!(files.0.len(), 1);
    let (name, csv, closed) = &files.0[0];
    assert_eq!(name, CSV_NAME);
    assert!(closed);
    let rows = parse_csv(std::str::from_utf8(csv).unwrap()).expect("bbcount.csv parses");
    // The loop body's block (add, dec, jnz) runs once per iteration but the first, which
    // is counted in the block that starts at the `mov`.
    for cpl in [0, 3] {
        assert!(
            rows.contains(&Row {
                address: base + 5,
                cpl,
                instructions: 3,
                count: ITERATIONS - 1,
                // `CodePage` maps the code at its own address.
                physical: base + 5,
            }),
            "no CPL {cpl} loop-body row in {rows:?}"
        );
        let sum: u64 = rows
            .iter()
            .filter(|r| r.cpl == cpl)
            .map(|r| u64::from(r.instructions) * r.count)
            .sum();
        assert_eq!(sum, tool.instructions_at(&engine, cpl));
    }
    let mut summary = String::new();
    tool.summary(&engine, &mut summary).unwrap();
    assert!(
        summary
            .starts_with("bbcount: 604 guest instructions executed (CPL 0: 302, CPL 3: 302) in "),
        "{summary}"
    );
}
