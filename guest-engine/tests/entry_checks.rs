//! Trace-entry checks and sensitive instructions: the attention byte stops a running
//! (self-linked) loop at a trace entry, with flags live or dead; a cross-page link
//! re-validates the PA after the page was remapped; `cpuid` goes to the platform and
//! `hlt` stops the run; lookups of global pages survive a CR3 write, others do not; a
//! cross-page link skips the PA check while its target page's lookups last.

mod common;

use common::{HostMemory, HostPlatform, Region, Remapped, Rig};
use guest_engine::attention::reason;
use guest_engine::exit_code::EXIT_PA_MISMATCH;
use guest_engine::{
    Config, Gpr, GuestMemory, GuestPhys, GuestVirt, Mode, NullTool, SensitiveKind, Stop,
};
use iced_x86::code_asm::*;

fn asm(ip: u64, f: impl FnOnce(&mut CodeAssembler)) -> Vec<u8> {
    let mut a = CodeAssembler::new(64).unwrap();
    f(&mut a);
    a.assemble(ip).unwrap()
}

fn put(r: &Region, off: usize, b: &[u8]) {
    r.slice()[off..off + b.len()].copy_from_slice(b);
}

#[test]
fn test_attention_stops_a_linked_loop_at_trace_entry() {
    for flags_live in [false, true] {
        let mut rig = Rig::new(Config::default());
        let block = Region::map(3 * 4096, 0);
        let base = block.addr();
        let code = asm(base, |a| {
            let mut l = a.create_label();
            a.set_label(&mut l).unwrap();
            if flags_live {
                a.cmc().unwrap(); // reads CF: flags live at the trace entry
                a.adc(rax, 0).unwrap();
            } else {
                a.add(rax, 1).unwrap();
            }
            a.jmp(l).unwrap();
        });
        put(&block, 0, &code);
        let exit = rig.native.exit_address();
        let finish = asm(base + 0x100, |a| {
            let mut slot = a.create_label();
            a.jmp(qword_ptr(slot)).unwrap();
            a.set_label(&mut slot).unwrap();
            a.db(&exit.to_le_bytes()).unwrap();
        });
        put(&block, 0x100, &finish);
        let mut mem = HostMemory::new(vec![(base, base + 3 * 4096)]);
        let regs = rig.engine.regs_mut();
        regs.set(Gpr::Rax, 0);
        regs.rflags = 0x203; // CF=1 so that adc counts too
        rig.engine.set_rip(GuestVirt(base));
        let h = rig.engine.attention_handle();
        let t = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(30));
            h.set(reason::REQUEST);
        });
        let stop = rig
            .engine
            .run(&mut mem, &mut HostPlatform::default(), &mut NullTool);
        t.join().unwrap();
        assert_eq!(
            stop,
            Stop::Attention(GuestVirt(base)),
            "flags_live={flags_live}"
        );
        assert!(
            rig.engine.regs().get(Gpr::Rax) > 1000,
            "the loop ran linked"
        );
        assert_eq!(
            rig.engine.stats().exits[guest_engine::exit_code::EXIT_ATTENTION as usize],
            1
        );
        // Clear it and leave the loop.
        rig.engine.set_attention(0);
        rig.engine.set_rip(GuestVirt(base + 0x100));
        let stop = rig
            .engine
            .run(&mut mem, &mut HostPlatform::default(), &mut NullTool);
        assert_eq!(stop, Stop::FetchFault(GuestVirt(exit)));
    }
}

/// `add rax, k; jmp [exit]` at `at`.
fn add_then_leave(at: u64, k: i32, exit: u64) -> Vec<u8> {
    asm(at, |x| {
        x.add(rax, k).unwrap();
        let mut slot = x.create_label();
        x.jmp(qword_ptr(slot)).unwrap();
        x.set_label(&mut slot).unwrap();
        x.db(&exit.to_le_bytes()).unwrap();
    })
}

/// Page A at the start of `block` (`mov rax, 0; jmp B`) and page B after it, which adds
/// 1 to RAX and leaves to `exit`: a cross-page link once A's jump is linked. Returns
/// (A, B).
fn a_jumps_to_b(block: &Region, exit: u64) -> (u64, u64) {
    let (a, b) = (block.addr(), block.addr() + 4096);
    put(
        block,
        0,
        &asm(a, |x| {
            x.mov(rax, 0i64).unwrap();
            x.jmp(b).unwrap();
        }),
    );
    put(block, 4096, &add_then_leave(b, 1, exit));
    (a, b)
}

#[test]
fn test_cross_page_link_revalidates_pa_after_remap() {
    let mut rig = Rig::new(Config::default());
    let block = Region::map(4 * 4096, 0);
    let alias = Region::map(4096, 0);
    let exit = rig.native.exit_address();
    let (a, b) = a_jumps_to_b(&block, exit);
    put(&alias, 0, &add_then_leave(b, 5, exit));
    let mut mem = HostMemory::new(vec![(a, a + 2 * 4096)]);
    for _ in 0..2 {
        rig.engine.set_rip(GuestVirt(a));
        let stop = rig
            .engine
            .run(&mut mem, &mut HostPlatform::default(), &mut NullTool);
        assert_eq!(stop, Stop::FetchFault(GuestVirt(exit)));
        assert_eq!(rig.engine.regs().get(Gpr::Rax), 1);
    }
    assert!(rig.engine.stats().links >= 1, "A was linked to B");
    // The guest remaps B's page to another frame with different code.
    let mut remapped = Remapped {
        inner: mem,
        page: b,
        frame: alias.addr(),
    };
    rig.engine.invalidate_page(GuestVirt(b));
    rig.engine.set_rip(GuestVirt(a));
    let stop = rig
        .engine
        .run(&mut remapped, &mut HostPlatform::default(), &mut NullTool);
    assert_eq!(stop, Stop::FetchFault(GuestVirt(exit)));
    assert_eq!(
        rig.engine.regs().get(Gpr::Rax),
        5,
        "the new frame's code ran"
    );
    assert_eq!(rig.engine.stats().exits[EXIT_PA_MISMATCH as usize], 1);
    // The stale link was undone and relinked to the new fragment: no further mismatch.
    let links = rig.engine.stats().links;
    rig.engine.set_rip(GuestVirt(a));
    let stop = rig
        .engine
        .run(&mut remapped, &mut HostPlatform::default(), &mut NullTool);
    assert_eq!(stop, Stop::FetchFault(GuestVirt(exit)));
    assert_eq!(rig.engine.regs().get(Gpr::Rax), 5);
    assert_eq!(rig.engine.stats().exits[EXIT_PA_MISMATCH as usize], 1);
    assert!(rig.engine.stats().links > links || links >= 2);
}

#[test]
fn test_cpuid_is_emulated_and_hlt_stops() {
    let mut rig = Rig::new(Config::default());
    let block = Region::map(4096, 0);
    let base = block.addr();
    let code = asm(base, |a| {
        a.xor(eax, eax).unwrap();
        a.xor(ecx, ecx).unwrap();
        a.cpuid().unwrap();
        a.mov(r8, rax).unwrap();
        a.mov(r9, rbx).unwrap();
        a.hlt().unwrap();
    });
    put(&block, 0, &code);
    let hlt_at = base + code.len() as u64 - 1;
    let mut mem = HostMemory::new(vec![(base, base + 4096)]);
    let mut plat = HostPlatform::default();
    rig.engine.set_rip(GuestVirt(base));
    let stop = rig.engine.run(&mut mem, &mut plat, &mut NullTool);
    match stop {
        Stop::Sensitive(s) => {
            assert_eq!(s.pc, GuestVirt(hlt_at));
            assert_eq!(s.kind, SensitiveKind::Halt);
        }
        other => panic!("unexpected stop {other:?}"),
    }
    let want = std::arch::x86_64::__cpuid_count(0, 0);
    assert_eq!(plat.emulated, 1);
    assert_eq!(rig.engine.regs().get(Gpr::R8), u64::from(want.eax));
    assert_eq!(rig.engine.regs().get(Gpr::R9), u64::from(want.ebx));
    assert_eq!(rig.engine.rip(), GuestVirt(hlt_at));
}

#[test]
fn test_return_cache_collisions_fall_back_to_the_hash_lookup() {
    // Two call sites whose return addresses share their low 16 bits alternate calls to
    // one subroutine: each return finds the other site's landing pad in the return-cache
    // slot, which must reject it and continue in the hash lookup.
    let mut rig = Rig::new(Config {
        count_ibl_lookups: true,
        ..Config::default()
    });
    let block = Region::map(0x30000, 0);
    let base = block.addr();
    let exit = rig.native.exit_address();
    let sub = base + 0x20000;
    let (a, b) = (base, base + 0x10000);
    // A: loop 50 times { inc r8; call sub; jmp B }, B: call sub; dec rcx; jnz A; exit
    put(
        &block,
        0,
        &asm(a, |x| {
            x.inc(r8).unwrap();
            x.call(sub).unwrap();
            x.jmp(b).unwrap();
        }),
    );
    put(
        &block,
        0x10000,
        &asm(b, |x| {
            let mut slot = x.create_label();
            x.nop().unwrap();
            x.nop().unwrap();
            x.nop().unwrap();
            x.call(sub).unwrap();
            x.dec(rcx).unwrap();
            x.jne(a).unwrap();
            x.jmp(qword_ptr(slot)).unwrap();
            x.set_label(&mut slot).unwrap();
            x.db(&exit.to_le_bytes()).unwrap();
        }),
    );
    put(
        &block,
        0x20000,
        &asm(sub, |x| {
            x.add(rax, r8).unwrap();
            x.ret().unwrap();
        }),
    );
    assert_eq!(
        (a + 3 + 5) & 0xFFFF,
        (b + 3 + 5) & 0xFFFF,
        "return addresses collide"
    );
    let stack = Region::map(1 << 16, 0);
    let init = |regs: &mut guest_engine::GuestRegs| {
        regs.gpr = [0; 16];
        regs.set(Gpr::Rcx, 50);
        regs.set(Gpr::Rsp, stack.addr() + (1 << 15));
        regs.rflags = 0x202;
    };
    init(rig.native.regs_mut());
    // SAFETY: the program ends by jumping to the native exit.
    unsafe { rig.native.run(a) };
    let mut want = *rig.native.regs();
    let mut mem = HostMemory::new(vec![(base, base + 0x30000)]);
    init(rig.engine.regs_mut());
    rig.engine.set_rip(GuestVirt(a));
    let stop = rig
        .engine
        .run(&mut mem, &mut HostPlatform::default(), &mut NullTool);
    assert_eq!(stop, Stop::FetchFault(GuestVirt(exit)));
    let mut got = *rig.engine.regs();
    want.rflags &= common::FLAGS_MASK;
    got.rflags &= common::FLAGS_MASK;
    assert_eq!(got, want);
    assert_eq!(got.get(Gpr::Rax), (1..=50).map(|k| 2 * k).sum::<u64>());
    let misses = rig.engine.stats().exits[guest_engine::exit_code::EXIT_IBL_MISS as usize];
    assert!(
        misses <= 4,
        "the hash lookup caught the collisions ({misses} misses)"
    );
}

/// Runs `rig` from `entry` until it leaves for `exit`; returns RAX.
fn run_to_exit(rig: &mut Rig, mem: &mut HostMemory, entry: u64, exit: u64) -> u64 {
    rig.engine.set_rip(GuestVirt(entry));
    let stop = rig
        .engine
        .run(mem, &mut HostPlatform::default(), &mut NullTool);
    assert_eq!(stop, Stop::FetchFault(GuestVirt(exit)));
    rig.engine.regs().get(Gpr::Rax)
}

#[test]
fn test_invalidate_code_page_retranslates_modified_code() {
    let mut rig = Rig::new(Config::default());
    let block = Region::map(2 * 4096, 0);
    let (a, b) = (block.addr(), block.addr() + 4096);
    let exit = rig.native.exit_address();
    let page_a = |k: i32| {
        asm(a, |x| {
            x.mov(eax, k).unwrap();
            x.jmp(b).unwrap();
        })
    };
    let page_b = |k: i32| {
        asm(b, |x| {
            let mut slot = x.create_label();
            x.add(eax, k).unwrap();
            x.jmp(qword_ptr(slot)).unwrap();
            x.set_label(&mut slot).unwrap();
            x.db(&exit.to_le_bytes()).unwrap();
        })
    };
    put(&block, 0, &page_a(1));
    put(&block, 4096, &page_b(10));
    let mut mem = HostMemory::new(vec![(a, a + 2 * 4096)]);
    let mut run = |rig: &mut Rig| run_to_exit(rig, &mut mem, a, exit);
    assert_eq!(run(&mut rig), 11);
    assert_eq!(run(&mut rig), 11);
    // Self-modifying code: B changes in place; without invalidation the stale
    // translation would still run.
    put(&block, 4096, &page_b(20));
    assert_eq!(run(&mut rig), 11, "stale until invalidated");
    assert_eq!(rig.engine.invalidate_code_page(GuestPhys(b)), 1);
    assert_eq!(run(&mut rig), 21);
    put(&block, 0, &page_a(2));
    assert_eq!(rig.engine.invalidate_code_page(GuestPhys(a)), 1);
    assert_eq!(run(&mut rig), 22);
    assert_eq!(run(&mut rig), 22);
}

#[test]
fn test_invalidated_trace_with_unchanged_bytes_is_revived_not_retranslated() {
    let mut rig = Rig::new(Config::default());
    let block = Region::map(4096, 0);
    let (a, second) = (block.addr(), block.addr() + 0x100);
    let exit = rig.native.exit_address();
    // Two traces on one page, each ending in an indirect jump: A sets EAX and jumps to
    // the second, which adds its constant and leaves. Only the second's bytes change.
    let jump_via_slot = |x: &mut CodeAssembler, to: u64| {
        let mut slot = x.create_label();
        x.jmp(qword_ptr(slot)).unwrap();
        x.set_label(&mut slot).unwrap();
        x.db(&to.to_le_bytes()).unwrap();
    };
    put(
        &block,
        0,
        &asm(a, |x| {
            x.mov(eax, 1).unwrap();
            jump_via_slot(x, second);
        }),
    );
    let second_code = |k: i32| {
        asm(second, |x| {
            x.add(eax, k).unwrap();
            jump_via_slot(x, exit);
        })
    };
    put(&block, 0x100, &second_code(10));
    let mut mem = HostMemory::new(vec![(a, a + 4096)]);
    let mut run = |rig: &mut Rig| run_to_exit(rig, &mut mem, a, exit);
    assert_eq!(run(&mut rig), 11);
    assert_eq!(rig.engine.stats().fragments, 2);
    // A write to the frame that left both traces' bytes as they were (e.g. to the gap).
    assert_eq!(rig.engine.invalidate_code_page(GuestPhys(a)), 2);
    assert_eq!(run(&mut rig), 11);
    assert_eq!(rig.engine.stats().revived, 2, "both looked up again");
    assert_eq!(rig.engine.stats().fragments, 2, "and neither retranslated");
    // The second trace's bytes change: it is retranslated, the first revived again.
    put(&block, 0x100, &second_code(20));
    assert_eq!(rig.engine.invalidate_code_page(GuestPhys(a)), 2);
    assert_eq!(run(&mut rig), 21);
    assert_eq!(rig.engine.stats().revived, 3);
    assert_eq!(rig.engine.stats().fragments, 3);
    // Changed back: the translation of the old bytes was buried only until its key
    // was missed once, so the second trace is translated once more.
    put(&block, 0x100, &second_code(10));
    assert_eq!(rig.engine.invalidate_code_page(GuestPhys(a)), 2);
    assert_eq!(run(&mut rig), 11);
    assert_eq!(rig.engine.stats().fragments, 4);
}

#[test]
fn test_invalidate_page_drops_that_pages_ibl_entries_and_keeps_the_others() {
    use guest_engine::exit_code::EXIT_IBL_MISS;
    let mut rig = Rig::new(Config::default());
    let block = Region::map(4 * 4096, 0);
    let alias = Region::map(4096, 0);
    // A: jump indirectly to C, which jumps indirectly to B; B adds its constant and
    // leaves. Pages A, B and C are separate, so remapping B must not cost C's entry.
    let (a, b, c) = (block.addr(), block.addr() + 4096, block.addr() + 2 * 4096);
    let exit = rig.native.exit_address();
    put(
        &block,
        0,
        &asm(a, |x| {
            x.mov(rax, 0i64).unwrap();
            x.mov(rcx, c).unwrap();
            x.jmp(rcx).unwrap();
        }),
    );
    put(
        &block,
        2 * 4096,
        &asm(c, |x| {
            x.mov(rcx, b).unwrap();
            x.jmp(rcx).unwrap();
        }),
    );
    put(&block, 4096, &add_then_leave(b, 1, exit));
    put(&alias, 0, &add_then_leave(b, 5, exit));
    let mut mem = HostMemory::new(vec![(a, a + 3 * 4096)]);
    let misses = |rig: &Rig| rig.engine.stats().exits[EXIT_IBL_MISS as usize];
    for _ in 0..2 {
        rig.engine.set_rip(GuestVirt(a));
        let stop = rig
            .engine
            .run(&mut mem, &mut HostPlatform::default(), &mut NullTool);
        assert_eq!(stop, Stop::FetchFault(GuestVirt(exit)));
        assert_eq!(rig.engine.regs().get(Gpr::Rax), 1);
    }
    // Each run misses on the jump to the exit (no fragment there); the first also on C
    // and B, the second hits both.
    assert_eq!(misses(&rig), 4, "the second run hit both IBL entries");
    let mut remapped = Remapped {
        inner: mem,
        page: b,
        frame: alias.addr(),
    };
    rig.engine.invalidate_page(GuestVirt(b));
    rig.engine.set_rip(GuestVirt(a));
    let stop = rig
        .engine
        .run(&mut remapped, &mut HostPlatform::default(), &mut NullTool);
    assert_eq!(stop, Stop::FetchFault(GuestVirt(exit)));
    assert_eq!(
        rig.engine.regs().get(Gpr::Rax),
        5,
        "B's IBL entry was dropped: the new frame's code ran"
    );
    assert_eq!(
        misses(&rig),
        6,
        "only B's entry (and the exit) missed; C's stayed"
    );
}

#[test]
fn test_indirect_branches_to_address_zero_fault_in_the_guest() {
    // An empty IBL bucket is [tag 0, code 0], and tag 0 is the tag of target 0: `jmp rax`,
    // `call rax` and `ret` to 0 must stop as the guest's fetch fault at 0, never run host
    // address 0 (a process calling through a null pointer would otherwise end the VM).
    type Site = fn(&mut CodeAssembler);
    let sites: [(&str, Site); 3] = [
        ("jmp rax", |a| a.jmp(rax).unwrap()),
        ("call rax", |a| a.call(rax).unwrap()),
        ("ret", |a| {
            a.push(rax).unwrap();
            a.ret().unwrap();
        }),
    ];
    for (name, site) in sites {
        let mut rig = Rig::new(Config::default());
        let block = Region::map(4096, 0);
        let stack = Region::map(4096, 0);
        let base = block.addr();
        let code = asm(base, |a| {
            a.xor(eax, eax).unwrap();
            site(a);
        });
        put(&block, 0, &code);
        let mut mem = HostMemory::new(vec![
            (base, base + 4096),
            (stack.addr(), stack.addr() + 4096),
        ]);
        rig.engine.regs_mut().set(Gpr::Rsp, stack.addr() + 2048);
        rig.engine.set_rip(GuestVirt(base));
        let stop = rig
            .engine
            .run(&mut mem, &mut HostPlatform::default(), &mut NullTool);
        assert_eq!(stop, Stop::FetchFault(GuestVirt(0)), "{name}");
    }
}

/// Identity memory (one page optionally remapped) that calls some pages global.
struct WithGlobals {
    inner: Remapped,
    global: Vec<u64>,
}

impl GuestMemory for WithGlobals {
    fn translate(&mut self, va: GuestVirt, mode: Mode) -> Option<GuestPhys> {
        self.inner.translate(va, mode)
    }
    fn translate_global(&mut self, va: GuestVirt, mode: Mode) -> Option<(GuestPhys, bool)> {
        let pa = self.inner.translate(va, mode)?;
        Some((pa, self.global.contains(&va.page().0)))
    }
    fn read(&mut self, pa: GuestPhys, out: &mut [u8]) -> bool {
        self.inner.read(pa, out)
    }
}

#[test]
fn test_lookups_of_global_pages_survive_a_cr3_write_and_others_do_not() {
    use guest_engine::exit_code::EXIT_IBL_MISS;
    // Page A jumps through memory to page B (an IBL lookup), which adds to RAX and
    // leaves. With B global, its IBL entry survives `invalidate_nonglobal_mappings` (no
    // new miss) but not `invalidate_all_mappings`; with B not global, a CR3 write's clear
    // drops it, so that B remapped to another frame runs the new frame's code.
    for b_global in [true, false] {
        let mut rig = Rig::new(Config::default());
        let block = Region::map(2 * 4096, 0);
        let alias = Region::map(4096, 0);
        let (a, b) = (block.addr(), block.addr() + 4096);
        let exit = rig.native.exit_address();
        put(
            &block,
            0,
            &asm(a, |x| {
                x.mov(rax, 0i64).unwrap();
                let mut slot = x.create_label();
                x.jmp(qword_ptr(slot)).unwrap();
                x.set_label(&mut slot).unwrap();
                x.db(&b.to_le_bytes()).unwrap();
            }),
        );
        put(&block, 4096, &add_then_leave(b, 1, exit));
        put(&alias, 0, &add_then_leave(b, 5, exit));
        let mut mem = WithGlobals {
            inner: Remapped {
                inner: HostMemory::new(vec![(a, a + 2 * 4096)]),
                page: 0,
                frame: 0,
            },
            global: if b_global { vec![a, b] } else { vec![a] },
        };
        // (RAX, whether A's jump to B missed the IBL table); B's jump to the exit
        // address always misses (it faults: nothing to insert).
        let run = |rig: &mut Rig, mem: &mut WithGlobals| {
            let misses = |rig: &Rig| rig.engine.stats().exits[EXIT_IBL_MISS as usize];
            let before = misses(rig);
            rig.engine.set_rip(GuestVirt(a));
            let stop = rig
                .engine
                .run(mem, &mut HostPlatform::default(), &mut NullTool);
            assert_eq!(stop, Stop::FetchFault(GuestVirt(exit)));
            (rig.engine.regs().get(Gpr::Rax), misses(rig) - before == 2)
        };
        assert_eq!(run(&mut rig, &mut mem), (1, true), "the first jump misses");
        assert_eq!(run(&mut rig, &mut mem), (1, false), "then hits");
        rig.engine.invalidate_nonglobal_mappings();
        if b_global {
            assert_eq!(
                run(&mut rig, &mut mem),
                (1, false),
                "kept across a CR3 write"
            );
            rig.engine.invalidate_all_mappings();
            assert_eq!(
                run(&mut rig, &mut mem),
                (1, true),
                "dropped by a global flush"
            );
        } else {
            assert_eq!(run(&mut rig, &mut mem), (1, true), "dropped by a CR3 write");
            // The next space maps B elsewhere.
            mem.inner.page = b;
            mem.inner.frame = alias.addr();
            rig.engine.invalidate_nonglobal_mappings();
            assert_eq!(
                run(&mut rig, &mut mem),
                (5, true),
                "the new frame's code ran"
            );
        }
    }
}

#[test]
fn test_a_cross_page_link_skips_the_pa_check_while_its_page_lookups_last() {
    // Page A jumps directly to page B (a cross-page link), which adds to RAX and leaves;
    // page C, 16 MiB past B, shares B's SoftTLB slot: running C empties what B's check
    // reads. The link enters B past its check, as B's IBL entries trust B's mapping, and
    // for as long: a CR3 write sends it back to the check unless B is global, an `invlpg`
    // of B or a whole flush does in any case; once a lookup has found B mapped to the
    // same frame again it skips the check again.
    const SLOT_SPAN: u64 = 4096 * 4096; // SOFTTLB_ENTRIES pages
    for b_global in [true, false] {
        let mut rig = Rig::new(Config::default());
        let len = (SLOT_SPAN + 3 * 4096) as usize;
        let block = Region::map(len, 0);
        let exit = rig.native.exit_address();
        let (a, b) = a_jumps_to_b(&block, exit);
        let c = b + SLOT_SPAN;
        put(&block, (c - a) as usize, &add_then_leave(c, 7, exit));
        let mut mem = WithGlobals {
            inner: Remapped {
                inner: HostMemory::new(vec![(a, a + len as u64)]),
                page: 0,
                frame: 0,
            },
            global: if b_global { vec![a, b] } else { vec![a] },
        };
        let run_at = |rig: &mut Rig, mem: &mut WithGlobals, at: u64| {
            rig.engine.set_rip(GuestVirt(at));
            let stop = rig
                .engine
                .run(mem, &mut HostPlatform::default(), &mut NullTool);
            assert_eq!(stop, Stop::FetchFault(GuestVirt(exit)));
        };
        // Runs C, then A: (RAX, PA check failures so far).
        let run = |rig: &mut Rig, mem: &mut WithGlobals| {
            run_at(rig, mem, c);
            run_at(rig, mem, a);
            (
                rig.engine.regs().get(Gpr::Rax),
                rig.engine.stats().exits[EXIT_PA_MISMATCH as usize],
            )
        };
        run_at(&mut rig, &mut mem, a);
        run_at(&mut rig, &mut mem, a);
        assert!(rig.engine.stats().links >= 1, "A was linked to B");
        assert_eq!(run(&mut rig, &mut mem), (1, 0), "no check");
        assert_eq!(run(&mut rig, &mut mem), (1, 0), "no check");
        rig.engine.invalidate_nonglobal_mappings();
        let checks = if b_global {
            assert_eq!(run(&mut rig, &mut mem), (1, 0), "kept across a CR3 write");
            0
        } else {
            assert_eq!(
                run(&mut rig, &mut mem),
                (1, 1),
                "one check after a CR3 write"
            );
            1
        };
        assert_eq!(run(&mut rig, &mut mem), (1, checks), "then none");
        rig.engine.invalidate_page(GuestVirt(b));
        assert_eq!(
            run(&mut rig, &mut mem),
            (1, checks + 1),
            "one check after an invlpg"
        );
        assert_eq!(run(&mut rig, &mut mem), (1, checks + 1), "then none");
        rig.engine.invalidate_all_mappings();
        assert_eq!(
            run(&mut rig, &mut mem),
            (1, checks + 2),
            "one check after a flush"
        );
        assert_eq!(run(&mut rig, &mut mem), (1, checks + 2), "then none");
        // The guest remaps B, and an `invlpg` of B (or, B not global, a CR3 write) lets
        // the check send A to the new frame's code.
        let alias = Region::map(4096, 0);
        put(&alias, 0, &add_then_leave(b, 5, exit));
        mem.inner.page = b;
        mem.inner.frame = alias.addr();
        assert_eq!(
            run(&mut rig, &mut mem),
            (1, checks + 2),
            "the old frame's, until"
        );
        if b_global {
            rig.engine.invalidate_page(GuestVirt(b));
        } else {
            rig.engine.invalidate_nonglobal_mappings();
        }
        assert_eq!(
            run(&mut rig, &mut mem),
            (5, checks + 3),
            "the new frame's code ran"
        );
    }
}
