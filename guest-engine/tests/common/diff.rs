//! Running one generated program natively and under translation.

use guest_engine::{GuestRegs, GuestVirt, Stop, Tool};

use super::gen::{program, Program, DATA_BYTES};
use super::{HostMemory, HostPlatform, Region, Rig, FLAGS_MASK};

pub const STACK_WINDOW: usize = 16 * 1024;

pub struct Outcome {
    pub regs: GuestRegs,
    pub data: Vec<u8>,
    pub stack: Vec<u8>,
}

pub struct Prepared {
    pub p: Program,
    pub init: GuestRegs,
    pub stack_top: u64,
    pub base: u64,
    pub exit: u64,
}

impl Prepared {
    pub fn new(rig: &Rig, block: &Region, seed: u64, items: usize) -> Self {
        let base = block.addr();
        let p = program(seed, base, items);
        assert!(p.bytes.len() + 2 * STACK_WINDOW < block.len);
        block.slice()[..p.bytes.len()].copy_from_slice(&p.bytes);
        let stack_top = base + block.len as u64 - 4096;
        let mut init = GuestRegs {
            gpr: p.init_regs,
            rflags: p.init_flags,
        };
        init.gpr[4] = stack_top;
        Prepared {
            p,
            init,
            stack_top,
            base,
            exit: rig.native.exit_address(),
        }
    }

    pub fn reset(&self, block: &Region) {
        let mem = block.slice();
        let d = (self.p.data - self.base) as usize;
        mem[d..d + DATA_BYTES].copy_from_slice(&self.p.data_image);
        let s = (self.p.end_slot - self.base) as usize;
        mem[s..s + 8].copy_from_slice(&self.exit.to_le_bytes());
        let st = (self.stack_top - self.base) as usize;
        mem[st - STACK_WINDOW..st + 64].fill(0);
    }

    pub fn capture(&self, block: &Region, regs: GuestRegs) -> Outcome {
        let mem = block.slice();
        let d = (self.p.data - self.base) as usize;
        let st = (self.stack_top - self.base) as usize;
        let mut regs = regs;
        regs.rflags &= FLAGS_MASK;
        Outcome {
            regs,
            data: mem[d..d + DATA_BYTES].to_vec(),
            stack: mem[st - STACK_WINDOW..st + 64].to_vec(),
        }
    }

    pub fn run_native(&self, rig: &mut Rig, block: &Region) -> Outcome {
        self.reset(block);
        *rig.native.regs_mut() = self.init;
        // SAFETY: the program ends by jumping to the native exit and only touches its block.
        unsafe { rig.native.run(self.p.entry) };
        self.capture(block, *rig.native.regs())
    }

    pub fn run_translated(&self, rig: &mut Rig, block: &Region, tool: &mut dyn Tool) -> Outcome {
        self.reset(block);
        rig.engine.flush();
        *rig.engine.regs_mut() = self.init;
        rig.engine.set_rip(GuestVirt(self.p.entry));
        let mut gm = HostMemory::new(vec![(self.base, self.base + self.p.bytes.len() as u64)]);
        let mut plat = HostPlatform::default();
        let stop = rig.engine.run(&mut gm, &mut plat, tool);
        assert_eq!(
            stop,
            Stop::FetchFault(GuestVirt(self.exit)),
            "unexpected stop"
        );
        self.capture(block, *rig.engine.regs())
    }
}

pub fn check_case(rig: &mut Rig, block: &Region, seed: u64, items: usize, tool: &mut dyn Tool) {
    let prep = Prepared::new(rig, block, seed, items);
    let n = prep.run_native(rig, block);
    let t = prep.run_translated(rig, block, tool);
    if n.regs != t.regs {
        for i in 0..16 {
            if n.regs.gpr[i] != t.regs.gpr[i] {
                eprintln!(
                    "seed {seed}: gpr{i} native {:#x} translated {:#x}",
                    n.regs.gpr[i], t.regs.gpr[i]
                );
            }
        }
        eprintln!(
            "seed {seed}: flags native {:#x} translated {:#x}",
            n.regs.rflags, t.regs.rflags
        );
    }
    assert_eq!(n.regs, t.regs, "seed {seed}: registers differ");
    assert!(n.data == t.data, "seed {seed}: data memory differs");
    assert!(n.stack == t.stack, "seed {seed}: stack memory differs");
}
