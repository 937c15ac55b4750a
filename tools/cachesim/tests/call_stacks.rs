//! `attribute=on callstacks=on`: shadow call stacks kept from the engine's `CALL`/`RET`
//! bits put each block in the calling context it ran in — per task and mode, a `ret`
//! popping to the frame it returns through (by return address or by slot), a `ret` that
//! matches nothing changing nothing, the depth bounded — and the folded stacks name the
//! functions called, outermost first, with the same totals.

use kpin_tool::host_side::BlockNames;
use kpin_tool::{access, MemRecord};
use kpin_tool_cachesim::attr::{Context, MAX_DEPTH, ROOT};
use kpin_tool_cachesim::CacheSim;

const K: u64 = 0xffff_ffff_8100_0000;
const CPL3: u32 = 3 << access::CPL_SHIFT;

/// The fetch of `len` bytes at `ip` (physical: its low 24 bits), with `flow` bits.
fn at(ip: u64, len: u32, flow: u32, cpl: u32) -> MemRecord {
    MemRecord {
        ip,
        ea: ip,
        size: len,
        access: access::FETCH | flow | cpl,
        pa: ip & 0xff_ffff,
    }
}

/// A `call` at `ip` (`len` bytes) storing its return address at virtual address `slot`:
/// its fetch record, then its stack write's (`call_stack_records`).
fn call(ip: u64, len: u32, slot: u64, cpl: u32) -> [MemRecord; 2] {
    [
        at(ip, len, access::CALL, cpl),
        stack(ip, slot, access::WRITE, cpl),
    ]
}

/// A `ret` at `ip` taking its return address from `slot`.
fn ret(ip: u64, slot: u64, cpl: u32) -> [MemRecord; 2] {
    [
        at(ip, 1, access::RET, cpl),
        stack(ip, slot, access::READ, cpl),
    ]
}

fn stack(ip: u64, slot: u64, rw: u32, cpl: u32) -> MemRecord {
    MemRecord {
        ip,
        ea: slot,
        size: 8,
        access: rw | cpl,
        pa: slot & 0xff_ffff,
    }
}

fn task(row: u64) -> MemRecord {
    MemRecord {
        ip: 0,
        ea: row,
        size: 0,
        access: access::TASK,
        pa: 0,
    }
}

/// What [`run`] sees of a task and context: (code, task, callees, Ir).
type Entry = (u64, u32, Vec<u64>, u64);

/// Feeds `records`; returns per task and context that ran (the code it entered, or in
/// the root context its block; the task; the context's callees, outermost first; Ir),
/// in the order they first ran, and the contexts.
fn run(options: &str, records: &[MemRecord]) -> (Vec<Entry>, Vec<Context>) {
    let mut s = CacheSim::new(options).unwrap();
    s.feed_all(records);
    let at = s.attribution().unwrap();
    let contexts = at.contexts().unwrap_or(&[]).to_vec();
    let chain = |mut c: u32| {
        let mut v = Vec::new();
        while c != ROOT {
            v.push(contexts[c as usize].callee);
            c = contexts[c as usize].parent;
        }
        v.reverse();
        v
    };
    let stacked = at
        .stacked()
        .unwrap_or(&[])
        .iter()
        .filter(|e| e.counts[0] > 0)
        .map(|e| {
            let chain = chain(e.ctx);
            let code = chain.last().copied().unwrap_or(e.code);
            (code, e.task, chain, e.counts[0])
        })
        .collect();
    (stacked, contexts)
}

#[test]
fn calls_and_returns_put_blocks_in_their_callers_context() {
    // K: call f (K+0x1000); f: call g (K+0x2000); g: ret; f: ret; K+5.
    let (f, g) = (K + 0x1000, K + 0x2000);
    let records = [
        at(K, 5, access::CALL, 0),
        at(f, 5, access::CALL, 0),
        at(g, 1, 0, 0),
        at(g + 1, 1, access::RET, 0),
        at(f + 5, 1, access::RET, 0),
        at(K + 5, 2, 0, 0),
    ];
    let (stacked, contexts) = run("attribute=on", &records);
    assert_eq!(
        stacked,
        [
            (K, 0, vec![], 1),
            (f, 0, vec![f], 2),
            (g, 0, vec![f, g], 2),
            (K + 5, 0, vec![], 1),
        ]
    );
    assert_eq!(contexts.len(), 3, "the root, f, f→g");
    // Off: no contexts; the blocks as before.
    let mut s = CacheSim::new("attribute=on callstacks=off").unwrap();
    s.feed_all(&records);
    let at = s.attribution().unwrap();
    assert!(at.contexts().is_none() && at.stacked().is_none());
    assert_eq!(at.totals()[0], 6);
}

#[test]
fn a_ret_unwinds_to_its_slot_or_else_its_address_and_a_call_drops_what_is_below() {
    let (f, g, h) = (K + 0x1000, K + 0x2000, K + 0x3000);
    let sp = 0xffff_c900_0000_3f00; // a kernel stack
    let mut records = Vec::new();
    // call f; f: call g; g's ret reads f's call's slot (a longjmp past f, or a return
    // thunk): both frames go.
    records.extend(call(K, 5, sp, 0));
    records.extend(call(f, 5, sp - 8, 0));
    records.extend(ret(g, sp, 0));
    records.push(at(K + 5, 1, 0, 0));
    // call h; a ret whose slot is not known and that returns where no frame does
    // changes nothing; one that returns to h's caller pops h.
    records.extend(call(K + 6, 5, sp, 0));
    records.push(at(h, 1, access::RET, 0));
    records.push(at(K + 0x99, 1, 0, 0));
    records.push(at(K + 0x9a, 1, access::RET, 0));
    records.push(at(K + 0xb, 1, 0, 0));
    // call f, which calls g deeper down and is left (no ret: its frames stay); a call
    // from higher up the stack drops both.
    records.extend(call(K + 0x20, 5, sp - 0x100, 0));
    records.extend(call(f, 5, sp - 0x108, 0));
    records.extend([at(g, 1, 0, 0), at(g + 1, 1, 0, 0), at(g + 2, 1, 0, 0)]);
    records.extend(call(K + 0x40, 5, sp, 0));
    records.push(at(h + 0x10, 1, 0, 0));
    let (stacked, _) = run("attribute=on", &records);
    assert_eq!(
        stacked,
        [
            (K, 0, vec![], 1),
            (f, 0, vec![f], 2),
            (g, 0, vec![f, g], 5),
            (K + 5, 0, vec![], 2), // unwound through both frames
            (h, 0, vec![h], 3),    // and past a ret that matched nothing
            (K + 0xb, 0, vec![], 1),
            (K + 0x20, 0, vec![], 1),
            (h + 0x10, 0, vec![h + 0x10], 1), // the stale frames dropped
        ]
    );
}

#[test]
fn kernel_stacks_are_told_apart_by_address_and_user_stacks_by_task() {
    let (fa, fb, sw, kf) = (K + 0x1000, K + 0x2000, K + 0x3000, K + 0x4000);
    let (a, b) = (0xffff_c900_0000_3f00, 0xffff_c900_0000_7f00); // two kernel stacks
    let (uf, upa) = (0x40_1000, |va: u64| va & 0xff_ffff);
    let mut r = vec![task(1)];
    // Task 1's user code calls uf; the kernel is entered (a syscall) before uf runs.
    r.extend(call(0x40_0000, 5, 0x7fff_f000, CPL3));
    r.push(at(K + 0x100, 1, 0, 0)); // the entry code: no stack known yet
                                    // On stack A: call fa; fa calls sw (a context switch).
    r.extend(call(K + 0x101, 5, a, 0));
    r.extend(call(fa, 5, a - 8, 0));
    r.extend([at(sw, 1, 0, 0), at(sw + 1, 1, 0, 0), at(sw + 2, 1, 0, 0)]);
    // Another task's kernel code, on stack B (no TASK record: the kernel switched tasks
    // inside itself): call fb; fb calls sw.
    r.extend(call(K + 0x200, 5, b, 0));
    r.extend(call(fb, 5, b - 8, 0));
    // Back on A: sw returns into fa, which calls kf and returns.
    r.extend(ret(sw + 3, a - 8, 0));
    r.extend(call(fa + 5, 5, a - 8, 0));
    r.extend(ret(kf, a - 8, 0));
    r.extend(ret(fa + 10, a, 0));
    // Back to user mode: uf runs, called.
    r.push(at(uf, 1, 0, CPL3));
    // Task 2 in user mode: its own stack, at the root.
    r.push(task(2));
    r.push(at(0x40_2000, 1, 0, CPL3));
    // Task 1 again, still in uf; it returns.
    r.push(task(1));
    r.extend(ret(uf + 1, 0x7fff_f000, CPL3));
    r.push(at(0x40_0005, 1, 0, CPL3));
    // B again: sw returns into fb.
    r.push(at(K + 0x300, 1, 0, 0));
    r.extend(ret(sw + 4, b - 8, 0));
    r.push(at(fb + 5, 1, 0, 0));
    let (blocks, _) = run("attribute=on", &r);
    for want in [
        (K + 0x100, 1, vec![]),
        (sw, 1, vec![fa, sw]),
        (fb, 1, vec![fb]),
        (kf, 1, vec![fa, kf]),
        (fa, 1, vec![fa]),
        (upa(uf), 1, vec![upa(uf)]),
        (upa(0x40_2000), 2, vec![]),
        (upa(0x40_0005), 1, vec![]),
        (K + 0x300, 1, vec![]),
    ] {
        assert!(
            blocks.iter().any(|b| (b.0, b.1, b.2.clone()) == want),
            "{want:x?} in {blocks:x?}"
        );
    }
}

#[test]
fn recursion_is_bounded_in_depth() {
    // f calls itself 200 times, then returns 200 times.
    let f = K + 0x1000;
    let mut records = vec![at(K, 5, access::CALL, 0)];
    records.extend((0..200).map(|_| at(f, 5, access::CALL, 0)));
    records.push(at(f, 1, access::RET, 0));
    records.extend((0..200).map(|_| at(f + 5, 1, access::RET, 0)));
    records.push(at(K + 5, 1, 0, 0));
    let (blocks, contexts) = run("attribute=on", &records);
    assert!(contexts.iter().all(|c| c.depth <= MAX_DEPTH));
    assert_eq!(contexts.len(), MAX_DEPTH as usize + 1);
    assert!(blocks.iter().all(|b| b.2.len() <= MAX_DEPTH as usize));
    assert_eq!(
        blocks.last().unwrap().2,
        Vec::<u64>::new(),
        "back at the root"
    );
}

struct Kernel;
impl BlockNames for Kernel {
    fn source(&self) -> String {
        "a test map".into()
    }
    fn name(&self, addr: u64) -> Option<String> {
        (addr >= K).then(|| format!("kfunc{}+0x{:x}", (addr - K) >> 12, addr & 0xfff))
    }
}

#[test]
fn folded_stacks_name_the_calls_outermost_first() {
    let (f, g) = (K + 0x1000, K + 0x2000);
    let records = [
        at(K, 5, access::CALL, 0),
        at(f, 5, access::CALL, 0),
        at(g, 3, access::RET, 0),
        at(f + 5, 1, access::RET, 0),
    ];
    let mut s = CacheSim::new("attribute=on").unwrap();
    s.feed_all(&records);
    let at = s.attribution().unwrap();
    let counters = parse_counters(&s);
    let made = kpin_tool_cachesim::profile::attribute(
        at.blocks(),
        Some((at.contexts().unwrap(), at.stacked().unwrap())),
        &counters,
        &[],
        Some(&Kernel),
        None,
    );
    let mut lines = made.folded.lines();
    lines.sort();
    assert_eq!(
        lines,
        [
            "row 0;[kernel];kfunc0 1",
            "row 0;[kernel];kfunc1 2",
            "row 0;[kernel];kfunc1;kfunc2 1",
        ]
    );
    assert!(made.attributed.totals_match_counters);
}

#[test]
fn a_call_that_jumps_at_once_is_a_call_of_where_it_jumps() {
    // call thunk; thunk: jmp f (an indirect-branch thunk); f: two instructions, then
    // a jump within f: the context is f's, and stays so.
    let (thunk, f) = (K + 0x1000, K + 0x2000);
    let records = [
        at(K, 5, access::CALL, 0),
        at(thunk, 2, 0, 0),
        at(f, 1, 0, 0),
        at(f + 1, 1, 0, 0),
        at(f + 2, 1, 0, 0),
        at(f + 0x10, 1, access::RET, 0),
        at(K + 5, 1, 0, 0),
    ];
    let (stacked, contexts) = run("attribute=on", &records);
    assert_eq!(
        stacked,
        [
            (K, 0, vec![], 1),
            (thunk, 0, vec![thunk], 1),
            (f, 0, vec![f], 4),
            (K + 5, 0, vec![], 1)
        ]
    );
    assert_eq!(contexts.len(), 3);
}

/// The counters file `s` writes, read back.
fn parse_counters(s: &CacheSim) -> kpin_tool_cachesim::files::Counters {
    let mut text = String::new();
    kpin_tool_cachesim::files::write_counters(
        &mut text,
        s.options(),
        s.hierarchy(),
        s.unresolved(),
    )
    .unwrap();
    kpin_tool_cachesim::files::parse_counters(&text).unwrap()
}

#[test]
fn a_retpoline_is_a_call_of_where_it_returns() {
    // Linux's retpoline and return thunk: K calls the thunk T, whose `call L` pushes
    // a frame that `L: mov [rsp], rax; jmp R` turns into a jump to the target; the
    // return thunk R calls S, which drops its own return address and returns through
    // L's slot — to G, the target. G is a call of K's, in context [G].
    let (t, r, sr, g) = (K + 0x1000, K + 0x2000, K + 0x3000, K + 0x4000);
    let sp = 0xffff_c900_0000_3f00;
    let mut records = Vec::new();
    records.extend(call(K, 5, sp, 0));
    records.extend(call(t, 5, sp - 8, 0));
    records.extend([at(t + 0xc, 4, 0, 0), at(t + 0x10, 5, 0, 0)]);
    records.extend(call(r, 5, sp - 16, 0));
    records.push(at(sr, 4, 0, 0));
    records.extend(ret(sr + 4, sp - 8, 0));
    records.extend((0..4).map(|k| at(g + k, 1, 0, 0)));
    records.extend(ret(g + 4, sp, 0));
    records.push(at(K + 5, 1, 0, 0));
    let (stacked, _) = run("attribute=on", &records);
    assert_eq!(
        stacked,
        [
            (K, 0, vec![], 1),
            (t, 0, vec![t], 1),
            (t + 0xc, 0, vec![t, t + 0xc], 2),
            (r, 0, vec![t, r], 1),
            (sr, 0, vec![t, r, sr], 2),
            (g, 0, vec![g], 5),
            (K + 5, 0, vec![], 1),
        ]
    );
}

#[test]
fn stacks_named_by_any_stack_pointer_stay_bounded() {
    // A guest that calls on 20 000 kernel stacks (any RSP it likes) and never returns:
    // the simulation keeps going and the stacks it keeps stay bounded, so a stack's
    // frames may be dropped: its task starts over at the root.
    let f = K + 0x1000;
    let mut records = Vec::new();
    for k in 0..20_000u64 {
        records.extend(call(K, 5, 0xffff_c900_0000_3f00 + (k << 14), 0));
        records.extend([at(f, 1, 0, 0), at(f + 1, 1, 0, 0), at(f + 2, 1, 0, 0)]);
    }
    // Back on the first stack, deeper than f's frame: that frame was dropped, so the
    // call is made at the root.
    let g = K + 0x3000;
    records.extend(call(f + 3, 5, 0xffff_c900_0000_3f00 - 0x100, 0));
    records.push(at(g, 1, 0, 0));
    let (stacked, contexts) = run("attribute=on", &records);
    assert_eq!(contexts.len(), 3, "the root, f, g");
    assert_eq!(stacked.iter().map(|e| e.3).sum::<u64>(), 80_002);
    assert!(
        stacked.iter().any(|e| e.0 == g && e.2 == [g]),
        "{stacked:x?}"
    );
}
