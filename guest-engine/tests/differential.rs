//! Differential tests: random programs and compiled functions run natively and under
//! translation; registers, flags and memory must be equal.

mod common;

use common::gen::{program, DATA_BYTES};
use common::{HostMemory, HostPlatform, Region, Rig, FLAGS_MASK};
use guest_engine::{Config, GuestRegs, GuestVirt, NullTool, Stop, Tool};

const STACK_WINDOW: usize = 16 * 1024;

pub struct Outcome {
    pub regs: GuestRegs,
    pub data: Vec<u8>,
    pub stack: Vec<u8>,
}

/// Runs program `seed` natively and translated; returns (native, translated).
pub fn run_case(rig: &mut Rig, block: &Region, seed: u64, items: usize, tool: &mut dyn Tool) -> (Outcome, Outcome) {
    let base = block.addr();
    let p = program(seed, base, items);
    assert!(p.bytes.len() + 2 * STACK_WINDOW < block.len);
    let mem = block.slice();
    mem[..p.bytes.len()].copy_from_slice(&p.bytes);
    let stack_top = base + block.len as u64 - 4096;
    let exit = rig.native.exit_address();
    let reset = |mem: &mut [u8]| {
        let d = (p.data - base) as usize;
        mem[d..d + DATA_BYTES].copy_from_slice(&p.data_image);
        let s = (p.end_slot - base) as usize;
        mem[s..s + 8].copy_from_slice(&exit.to_le_bytes());
        let st = (stack_top - base) as usize;
        mem[st - STACK_WINDOW..st + 64].fill(0);
    };
    let capture = |mem: &[u8], regs: GuestRegs| {
        let d = (p.data - base) as usize;
        let st = (stack_top - base) as usize;
        let mut regs = regs;
        regs.rflags &= FLAGS_MASK;
        Outcome { regs, data: mem[d..d + DATA_BYTES].to_vec(), stack: mem[st - STACK_WINDOW..st + 64].to_vec() }
    };
    let mut init = GuestRegs { gpr: p.init_regs, rflags: p.init_flags };
    init.gpr[4] = stack_top;

    reset(mem);
    *rig.native.regs_mut() = init;
    // SAFETY: the program ends by jumping to the native exit and only touches its block.
    unsafe { rig.native.run(p.entry) };
    let native = capture(mem, *rig.native.regs());

    reset(mem);
    rig.engine.flush();
    *rig.engine.regs_mut() = init;
    rig.engine.set_rip(GuestVirt(p.entry));
    let mut gm = HostMemory::new(vec![(base, base + p.bytes.len() as u64)]);
    let mut plat = HostPlatform::default();
    let stop = rig.engine.run(&mut gm, &mut plat, tool);
    assert_eq!(stop, Stop::FetchFault(GuestVirt(exit)), "seed {seed}: unexpected stop");
    let translated = capture(mem, *rig.engine.regs());
    (native, translated)
}

pub fn check_case(rig: &mut Rig, block: &Region, seed: u64, items: usize, tool: &mut dyn Tool) {
    let (n, t) = run_case(rig, block, seed, items, tool);
    if n.regs != t.regs {
        for i in 0..16 {
            if n.regs.gpr[i] != t.regs.gpr[i] {
                eprintln!("seed {seed}: gpr{i} native {:#x} translated {:#x}", n.regs.gpr[i], t.regs.gpr[i]);
            }
        }
        eprintln!("seed {seed}: flags native {:#x} translated {:#x}", n.regs.rflags, t.regs.rflags);
    }
    assert_eq!(n.regs, t.regs, "seed {seed}: registers differ");
    assert!(n.data == t.data, "seed {seed}: data memory differs");
    assert!(n.stack == t.stack, "seed {seed}: stack memory differs");
}

fn cases() -> u64 {
    std::env::var("KPIN_DIFF_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(3000)
}

#[test]
fn test_random_programs_match_native() {
    let mut rig = Rig::new(Config::default());
    let block = Region::map(1 << 20, 0);
    let n = cases();
    for seed in 0..n {
        check_case(&mut rig, &block, seed, 40, &mut NullTool);
    }
    let s = rig.engine.stats();
    println!("{n} differential cases (random programs, null tool); stats {s:?}");
}

#[test]
fn test_random_programs_without_linking_match_native() {
    let cfg = Config { link_direct: false, fill_ibl: false, ..Config::default() };
    let mut rig = Rig::new(cfg);
    let block = Region::map(1 << 20, 0);
    let n = cases() / 10;
    for seed in 100_000..100_000 + n {
        check_case(&mut rig, &block, seed, 30, &mut NullTool);
    }
    println!("{n} differential cases (random programs, no linking, no IBL)");
}
