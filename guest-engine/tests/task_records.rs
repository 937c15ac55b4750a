//! Issue #27's engine hooks, on the host: a user trace's translation tells the platform
//! its virtual and physical address (`Platform::user_code`, where the task watch records
//! where the code came from) and the tool sees the same physical address
//! (`TraceInstrumenter::physical`); a change of the running task at an emulated
//! instruction puts one `access::TASK` record among the records of a tool that takes them
//! — after the records before that instruction, before its fetch record.

mod common;

use common::{HostMemory, HostPlatform, Region, Remapped, Rig};
use guest_engine::instrument::{access, MemRecord, Tool, TraceInstrumenter};
use guest_engine::platform::{Emulation, Platform, SensitiveInsn};
use guest_engine::{Config, GuestPhys, GuestRegs, GuestVirt, Mode, Stop};

/// The host's `cpuid`, a task change at each one, and the user code it was told of.
#[derive(Default)]
struct Watching {
    host: HostPlatform,
    /// The row the task change names, until taken.
    switched: Option<u64>,
    user_code: Vec<(u64, u64)>,
}

impl Platform for Watching {
    fn emulate(&mut self, insn: &SensitiveInsn, regs: &mut GuestRegs) -> Emulation {
        self.switched = Some(5);
        self.host.emulate(insn, regs)
    }

    fn user_code(&mut self, va: GuestVirt, pa: GuestPhys) {
        self.user_code.push((va.0, pa.0));
    }

    fn take_task_switch(&mut self) -> Option<u64> {
        self.switched.take()
    }
}

/// Every record `(access, ip, ea)`, and the traces' physical addresses.
struct Records {
    takes_tasks: bool,
    records: Vec<(u32, u64, u64)>,
    physical: Vec<u64>,
}

impl Tool for Records {
    fn instrument_trace(&mut self, trace: &mut TraceInstrumenter<'_>) {
        self.physical.push(trace.physical().0);
    }
    fn buffer_full(&mut self, records: &[MemRecord]) {
        self.records
            .extend(records.iter().map(|r| (r.access & 0xff, r.ip, r.ea)));
    }
    fn records_fetches(&self) -> bool {
        true
    }
    fn task_records(&self) -> bool {
        self.takes_tasks
    }
}

/// Runs `nop; cpuid; nop; jmp exit` at `va + 0x40`, the code's page mapped to another
/// frame; returns the tool, the platform, `va` and the frame.
fn run(takes_tasks: bool) -> (Records, Watching, u64, u64) {
    let mut rig = Rig::new(Config {
        mode: Mode::USER,
        ..Config::default()
    });
    let block = Region::map(4096, 0);
    let frame = Region::map(4096, 0);
    let va = block.addr();
    let exit = va + 0x10_0000;
    let mut code = vec![0x90, 0x0F, 0xA2, 0x90];
    let at = va + 0x40 + code.len() as u64 + 5;
    code.push(0xE9);
    code.extend_from_slice(&((exit as i64 - at as i64) as i32).to_le_bytes());
    frame.slice()[0x40..0x40 + code.len()].copy_from_slice(&code);
    let mut mem = Remapped {
        inner: HostMemory::new(vec![(va, va + 4096)]),
        page: va,
        frame: frame.addr(),
    };
    let mut tool = Records {
        takes_tasks,
        records: Vec::new(),
        physical: Vec::new(),
    };
    let mut platform = Watching::default();
    rig.engine.set_rip(GuestVirt(va + 0x40));
    let stop = rig.engine.run(&mut mem, &mut platform, &mut tool);
    assert_eq!(stop, Stop::FetchFault(GuestVirt(exit)));
    (tool, platform, va, frame.addr())
}

#[test]
fn test_user_traces_are_told_with_their_frame_and_a_task_change_falls_between_records() {
    let (tool, platform, va, f) = run(true);
    // (The records' CPL bits are left out: `access & 0xff`.)
    const FETCH: u32 = access::FETCH;
    assert_eq!(
        tool.records,
        [
            (FETCH, va + 0x40, va + 0x40),
            (access::TASK, 0, 5),
            (FETCH, va + 0x41, va + 0x41),
            (FETCH, va + 0x43, va + 0x43),
            (FETCH, va + 0x44, va + 0x44),
        ],
        "the task change after the nop's record, before the cpuid's"
    );
    // The trace before the cpuid and the one after it, each with the frame it came from.
    assert_eq!(
        platform.user_code,
        [(va + 0x40, f + 0x40), (va + 0x43, f + 0x43)]
    );
    assert_eq!(tool.physical, [f + 0x40, f + 0x43]);
    // A tool that does not take task records sees none; the change is still taken.
    let (tool, platform, ..) = run(false);
    assert!(
        tool.records.iter().all(|r| r.0 & access::TASK == 0),
        "{:x?}",
        tool.records
    );
    assert_eq!(tool.records.len(), 4);
    assert_eq!(platform.switched, None);
}
