//! Translation modes and mapping changes: the same VA in two modes gets two fragments and
//! indirect jumps / returns in each mode land in their own mode's fragments (also when the
//! modes map the VA to different frames); `invalidate_all_mappings` after a remap sends
//! the next indirect branch and cross-page link to the new code; unknown modes are
//! errors; engine-side instruction counting counts emulated instructions per mode; the
//! dispatcher remembers the traces it entered.

mod common;

use common::{HostMemory, HostPlatform, Region, Rig};
use guest_engine::exit_code::{EXIT_IBL_MISS, EXIT_PA_MISMATCH};
use guest_engine::{
    Config, CounterId, EngineError, Gpr, GuestMemory, GuestPhys, GuestVirt, Mode, NullTool, Stop,
    Tool, TraceInstrumenter,
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

/// Identity memory, except that pages listed in `remap` translate to other host pages
/// (for the modes listed with them).
struct Views {
    inner: HostMemory,
    remap: Vec<(u64, u64, Option<Mode>)>,
}

impl GuestMemory for Views {
    fn translate(&mut self, va: GuestVirt, mode: Mode) -> Option<GuestPhys> {
        for &(page, frame, only) in &self.remap {
            if va.page().0 == page && only.is_none_or(|m| m == mode) {
                return Some(GuestPhys(frame + (va.0 - page)));
            }
        }
        self.inner.translate(va, mode)
    }
    fn read(&mut self, pa: GuestPhys, out: &mut [u8]) -> bool {
        if self.remap.iter().any(|&(_, f, _)| pa.page().0 == f) {
            // SAFETY: remapped frames are live host pages.
            unsafe {
                std::ptr::copy_nonoverlapping(pa.0 as *const u8, out.as_mut_ptr(), out.len())
            };
            return true;
        }
        self.inner.read(pa, out)
    }
}

/// Page 0: `rcx` times { call [slot] (indirect, to F on page 1); jmp rdx (indirect, to
/// the loop tail) }; then `jmp b` (direct, cross-page, to page 2) which adds `100 * k`
/// and leaves through the native exit. Page 1: F = `add rax, k; ret`.
struct Program {
    block: Region,
    exit: u64,
}

const LOOPS: u64 = 20;
/// Blocks per run: per iteration `call`, F, `lea; jmp`, `dec; jne`; then `jmp b`, B.
const BLOCKS: u64 = 4 * LOOPS + 2;
/// Instructions per run: 7 per iteration, then `jmp b`, `add`, `jmp [exit]`.
const INSNS: u64 = 7 * LOOPS + 3;

impl Program {
    fn new(rig: &Rig) -> Self {
        let block = Region::map(3 * 4096, 0);
        let exit = rig.native.exit_address();
        let (a, f, b) = (block.addr(), block.addr() + 4096, block.addr() + 8192);
        put(
            &block,
            0,
            &asm(a, |x| {
                let mut top = x.create_label();
                let mut tail = x.create_label();
                let mut slot_f = x.create_label();
                x.set_label(&mut top).unwrap();
                x.call(qword_ptr(slot_f)).unwrap();
                x.lea(rdx, ptr(tail)).unwrap();
                x.jmp(rdx).unwrap();
                x.set_label(&mut tail).unwrap();
                x.dec(rcx).unwrap();
                x.jne(top).unwrap();
                x.jmp(b).unwrap();
                x.set_label(&mut slot_f).unwrap();
                x.dq(&[f]).unwrap();
            }),
        );
        put(&block, 4096, &Self::page_f(f, 1));
        put(&block, 8192, &Self::page_b(b, 1, exit));
        Program { block, exit }
    }

    fn page_f(f: u64, k: i32) -> Vec<u8> {
        asm(f, |x| {
            x.add(rax, k).unwrap();
            x.ret().unwrap();
        })
    }

    fn page_b(b: u64, k: i32, exit: u64) -> Vec<u8> {
        asm(b, |x| {
            let mut slot = x.create_label();
            x.add(rax, 100 * k).unwrap();
            x.jmp(qword_ptr(slot)).unwrap();
            x.set_label(&mut slot).unwrap();
            x.dq(&[exit]).unwrap();
        })
    }

    fn range(&self) -> HostMemory {
        HostMemory::new(vec![(self.block.addr(), self.block.addr() + 3 * 4096)])
    }

    fn a(&self) -> u64 {
        self.block.addr()
    }

    /// Sets the registers the program starts with (its stack in `stack`) and RIP.
    fn start(&self, rig: &mut Rig, stack: &[u64]) {
        let regs = rig.engine.regs_mut();
        regs.gpr = [0; 16];
        regs.set(Gpr::Rcx, LOOPS);
        regs.set(Gpr::Rsp, stack.as_ptr() as u64 + 8 * 256);
        regs.rflags = 0x202;
        rig.engine.set_rip(GuestVirt(self.a()));
    }

    /// Runs the program; returns rax.
    fn run(&self, rig: &mut Rig, mem: &mut dyn GuestMemory, tool: &mut dyn Tool) -> u64 {
        let stack = vec![0u64; 512];
        self.start(rig, &stack);
        let stop = rig.engine.run(mem, &mut HostPlatform::default(), tool);
        assert_eq!(stop, Stop::FetchFault(GuestVirt(self.exit)));
        rig.engine.regs().get(Gpr::Rax)
    }
}

/// Counts block executions into one counter per mode, which the instrumenter names
/// (translations of the same code differ per mode).
#[derive(Default)]
struct PerModeCount {
    ids: [Option<CounterId>; 2],
}

impl Tool for PerModeCount {
    fn instrument_trace(&mut self, t: &mut TraceInstrumenter<'_>) {
        let slot = t.mode().slot().unwrap();
        let id = *self.ids[slot].get_or_insert_with(|| t.alloc_counter().unwrap());
        for k in 0..t.bbls().len() {
            t.insert_bbl_counter(k, id, 1);
        }
    }
}

#[test]
fn test_modes_have_their_own_fragments_and_lookup_tables() {
    let mut rig = Rig::new(Config {
        count_insns: true,
        ..Config::default()
    });
    let p = Program::new(&rig);
    let mut mem = p.range();
    let mut tool = PerModeCount::default();
    let misses = |rig: &Rig| rig.engine.stats().exits[EXIT_IBL_MISS as usize];
    let mut per_mode_misses = [0; 2];
    for round in 0..3 {
        for (label, mode) in [(0, Mode::KERNEL), (1, Mode::USER)] {
            rig.engine.set_mode(mode).unwrap();
            assert_eq!(rig.engine.mode(), mode);
            let m0 = misses(&rig);
            assert_eq!(p.run(&mut rig, &mut mem, &mut tool), LOOPS + 100);
            per_mode_misses[label] += misses(&rig) - m0;
            // Every block ran in its own mode's translation.
            let blocks = |l: usize| tool.ids[l].map_or(0, |id| rig.engine.counter(id));
            let other_rounds = if label == 0 { round } else { round + 1 };
            assert_eq!(blocks(label), (round + 1) * BLOCKS);
            assert_eq!(blocks(1 - label), other_rounds * BLOCKS);
        }
    }
    // Each mode missed its three lookups (call, ret, jmp rdx) only in its first round,
    // plus the final jump out of every run: switching modes (as on every syscall) clears
    // no table.
    assert_eq!(per_mode_misses, [3 + 3, 3 + 3]);
    assert_eq!(rig.engine.executed_insns(Mode::KERNEL), 3 * INSNS);
    assert_eq!(rig.engine.executed_insns(Mode::USER), 3 * INSNS);
}

#[test]
fn test_modes_mapping_one_va_to_different_frames_run_their_own_code() {
    let mut rig = Rig::new(Config::default());
    let p = Program::new(&rig);
    // In user mode, F's page is another frame whose F adds 7.
    let alias = Region::map(4096, 0);
    let f = p.a() + 4096;
    put(&alias, 0, &Program::page_f(f, 7));
    let mut mem = Views {
        inner: p.range(),
        remap: vec![(f, alias.addr(), Some(Mode::USER))],
    };
    for _ in 0..3 {
        rig.engine.set_mode(Mode::KERNEL).unwrap();
        assert_eq!(p.run(&mut rig, &mut mem, &mut NullTool), LOOPS + 100);
        rig.engine.set_mode(Mode::USER).unwrap();
        assert_eq!(p.run(&mut rig, &mut mem, &mut NullTool), 7 * LOOPS + 100);
    }
    // Five traces (page 0: three, F, B) translated once per mode.
    assert_eq!(rig.engine.fragment_count(), 10);
}

#[test]
fn test_invalidate_all_mappings_sends_indirect_branches_and_cross_page_links_to_new_code() {
    let mut rig = Rig::new(Config::default());
    let p = Program::new(&rig);
    let (f, b) = (p.a() + 4096, p.a() + 8192);
    let alias = Region::map(2 * 4096, 0);
    put(&alias, 0, &Program::page_f(f, 3));
    put(&alias, 4096, &Program::page_b(b, 3, p.exit));
    let mut mem = Views {
        inner: p.range(),
        remap: Vec::new(),
    };
    for _ in 0..2 {
        assert_eq!(p.run(&mut rig, &mut mem, &mut NullTool), LOOPS + 100);
    }
    assert!(rig.engine.stats().links >= 1);
    // A CR3 write that changes nothing: the cross-page link's PA check fails on the
    // emptied SoftTLB, but the mapping still holds, so the link is kept.
    let before = rig.engine.stats();
    rig.engine.invalidate_all_mappings();
    assert_eq!(p.run(&mut rig, &mut mem, &mut NullTool), LOOPS + 100);
    let after = rig.engine.stats();
    assert_eq!(after.exits[EXIT_PA_MISMATCH as usize], 1);
    assert_eq!(after.links, before.links, "no link was undone");
    assert_eq!(after.fragments, before.fragments);
    // A CR3 write: F's and B's pages now map to the alias frames.
    mem.remap = vec![(f, alias.addr(), None), (b, alias.addr() + 4096, None)];
    assert_eq!(
        p.run(&mut rig, &mut mem, &mut NullTool),
        LOOPS + 100,
        "stale until the mappings are invalidated"
    );
    rig.engine.invalidate_all_mappings();
    assert_eq!(p.run(&mut rig, &mut mem, &mut NullTool), 3 * LOOPS + 300);
    assert_eq!(
        rig.engine.stats().exits[EXIT_PA_MISMATCH as usize],
        2,
        "the cross-page link to B re-validated its PA"
    );
    assert_eq!(p.run(&mut rig, &mut mem, &mut NullTool), 3 * LOOPS + 300);
    // And back (the old fragments are reused: keyed by PA).
    let fragments = rig.engine.fragment_count();
    mem.remap.clear();
    rig.engine.invalidate_all_mappings();
    assert_eq!(p.run(&mut rig, &mut mem, &mut NullTool), LOOPS + 100);
    assert_eq!(rig.engine.fragment_count(), fragments);
}

#[test]
fn test_unknown_modes_are_errors() {
    let cache = Region::map_cache(guest_engine::layout::MIN_REGION_BYTES);
    let bad = Config {
        mode: Mode(1),
        ..Config::default()
    };
    // SAFETY: a fresh RWX mapping owned by the test.
    let r = unsafe { guest_engine::Engine::new(cache.ptr, cache.len, bad) };
    assert_eq!(r.err(), Some(EngineError::UnknownMode(1)));
    let mut rig = Rig::new(Config::default());
    assert_eq!(
        rig.engine.set_mode(Mode(2)),
        Err(EngineError::UnknownMode(2))
    );
    assert_eq!(rig.engine.mode(), Mode::KERNEL);
}

/// Emulates `cpuid` as the host does, then switches to user mode and drops all mappings
/// (as a `sysret` and a CR3 write would).
struct SwitchAfterCpuid(HostPlatform);

impl guest_engine::Platform for SwitchAfterCpuid {
    fn emulate(
        &mut self,
        insn: &guest_engine::SensitiveInsn,
        regs: &mut guest_engine::GuestRegs,
    ) -> guest_engine::Emulation {
        match self.0.emulate(insn, regs) {
            guest_engine::Emulation::Continue(next) => guest_engine::Emulation::Switch {
                next,
                mode: Mode::USER,
                invalidate_mappings: true,
            },
            other => other,
        }
    }
}

#[test]
fn test_emulated_instructions_are_counted_and_recent_traces_are_kept() {
    let mut rig = Rig::new(Config {
        count_insns: true,
        ..Config::default()
    });
    let block = Region::map(4096, 0);
    let base = block.addr();
    let code = asm(base, |a| {
        a.xor(eax, eax).unwrap();
        a.xor(ecx, ecx).unwrap();
        a.cpuid().unwrap();
        a.mov(r8, rax).unwrap();
        a.hlt().unwrap();
    });
    put(&block, 0, &code);
    let mut mem = HostMemory::new(vec![(base, base + 4096)]);
    let mut plat = SwitchAfterCpuid(HostPlatform::default());
    rig.engine.set_rip(GuestVirt(base));
    let stop = rig.engine.run(&mut mem, &mut plat, &mut NullTool);
    assert!(matches!(stop, Stop::Sensitive(_)), "{stop:?}");
    // xor, xor, cpuid (emulated) in kernel mode, mov in user mode; hlt stopped the run
    // unexecuted.
    assert_eq!(rig.engine.mode(), Mode::USER);
    assert_eq!(rig.engine.executed_insns(Mode::KERNEL), 3);
    assert_eq!(rig.engine.executed_insns(Mode::USER), 1);
    let cpuid_next = base + code.len() as u64 - 1 - 3;
    let recent: Vec<_> = rig.engine.recent_traces().collect();
    assert_eq!(
        recent,
        vec![
            (GuestVirt(base), Mode::KERNEL),
            (GuestVirt(cpuid_next), Mode::USER)
        ]
    );
    for _ in 0..40 {
        rig.engine.set_rip(GuestVirt(base));
        rig.engine.run(&mut mem, &mut plat, &mut NullTool);
    }
    let recent: Vec<_> = rig.engine.recent_traces().collect();
    assert_eq!(recent.len(), guest_engine::layout::RECENT_TRACES);
    assert_eq!(recent.last(), Some(&(GuestVirt(cpuid_next), Mode::USER)));
}

#[test]
fn test_a_stepping_mode_stops_after_every_instruction_and_computes_the_same() {
    let mut rig = Rig::new(Config {
        count_insns: true,
        ..Config::default()
    });
    let p = Program::new(&rig);
    let mut mem = p.range();
    // The ordinary user mode first: its lookup tables and links are warm, and the
    // stepping mode must use none of them.
    rig.engine.set_mode(Mode::USER).unwrap();
    assert_eq!(p.run(&mut rig, &mut mem, &mut NullTool), LOOPS + 100);
    let before = rig.engine.executed_insns(Mode::USER);
    let links = rig.engine.stats().links;
    let stepping = Mode::USER.stepping();
    rig.engine.set_mode(stepping).unwrap();
    let stack = vec![0u64; 512];
    p.start(&mut rig, &stack);
    let mut steps = 0;
    let last = loop {
        match rig
            .engine
            .run(&mut mem, &mut HostPlatform::default(), &mut NullTool)
        {
            Stop::Stepped(next) => {
                assert_eq!(
                    rig.engine.rip(),
                    next,
                    "stopped before the next instruction"
                );
                steps += 1;
                assert!(steps <= INSNS, "more stops than instructions");
            }
            other => break other,
        }
    };
    assert_eq!(
        steps, INSNS,
        "one stop per instruction, the last jump's included"
    );
    assert_eq!(last, Stop::FetchFault(GuestVirt(p.exit)));
    assert_eq!(rig.engine.regs().get(Gpr::Rax), LOOPS + 100);
    assert_eq!(
        rig.engine.executed_insns(Mode::USER) - before,
        INSNS,
        "a stepping mode counts with its CPL"
    );
    assert_eq!(
        rig.engine.stats().links,
        links,
        "nothing linked while stepping"
    );
    assert_eq!(stepping.cpl(), 3);
    assert_eq!(stepping.slot(), Mode::USER.slot());
}
