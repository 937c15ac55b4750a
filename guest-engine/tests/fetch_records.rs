//! Fetch records against instruction executions when an instruction faults: a fault
//! takes the instruction back (its count and its records), so the retry must leave
//! exactly one fetch record per execution — also when the record buffer filled up (and
//! was delivered) between the instruction's records and the instruction itself.
//! Fetch records carry the physical address of the frame their trace was translated from.

mod common;

use common::{HostMemory, HostPlatform, Region, Remapped, Rig};
use guest_engine::instrument::{access, MemRecord, Tool, TraceInstrumenter};
use guest_engine::{Config, Gpr, GuestPhys, GuestVirt, Mode, Stop};

/// Counts the fetch records delivered per instruction address.
#[derive(Default)]
struct Fetches(Vec<u64>);

impl Tool for Fetches {
    fn instrument_trace(&mut self, _trace: &mut TraceInstrumenter<'_>) {}
    fn buffer_full(&mut self, records: &[MemRecord]) {
        self.0.extend(
            records
                .iter()
                .filter(|r| r.access & access::FETCH != 0)
                .map(|r| r.ip),
        );
    }
    fn records_fetches(&self) -> bool {
        true
    }
}

#[test]
fn test_a_faulting_instruction_whose_fetch_filled_the_buffer_is_fetched_once() {
    // nop; nop; nop; mov rax, [rbx]; jmp exit — with a buffer of four records the mov's
    // fetch record fills it (a delivery right before the mov runs); RBX unmapped makes
    // the mov fault; the retry with RBX valid completes it.
    let mut rig = Rig::new(Config {
        mode: Mode::USER,
        record_buffer_records: 4,
        ..Config::default()
    });
    common::fault_redirect::install(&rig, libc::SIGSEGV);
    let block = Region::map(4096, 0);
    let base = block.addr();
    let exit = base + 0x10_0000;
    let mut code = vec![0x90, 0x90, 0x90, 0x48, 0x8B, 0x03];
    let at = base + code.len() as u64 + 5;
    code.push(0xE9);
    code.extend_from_slice(&((exit as i64 - at as i64) as i32).to_le_bytes());
    block.slice()[..code.len()].copy_from_slice(&code);
    let mov = base + 3;
    let data = base + 0x800;
    let mut mem = HostMemory::new(vec![(base, base + 4096)]);
    let mut tool = Fetches::default();
    rig.engine.invalidate_code_page(GuestPhys(base));
    rig.engine.regs_mut().set(Gpr::Rsp, base + 0xf00);
    rig.engine.regs_mut().set(Gpr::Rbx, 0x10); // unmapped in this process
    rig.engine.set_rip(GuestVirt(base));
    let stop = rig
        .engine
        .run(&mut mem, &mut HostPlatform::default(), &mut tool);
    assert!(
        matches!(stop, Stop::Fault { guest_pc, .. } if guest_pc == GuestVirt(mov)),
        "{stop:?}"
    );
    // The guest "handles" the fault and retries the load.
    rig.engine.regs_mut().set(Gpr::Rbx, data);
    rig.engine.set_rip(GuestVirt(mov));
    let stop = rig
        .engine
        .run(&mut mem, &mut HostPlatform::default(), &mut tool);
    assert_eq!(stop, Stop::FetchFault(GuestVirt(exit)));
    let count = |ip| tool.0.iter().filter(|&&x| x == ip).count();
    assert_eq!(
        [count(base), count(base + 1), count(base + 2), count(mov)],
        [1, 1, 1, 1],
        "fetch records per instruction: {:x?}",
        tool.0
    );
}

/// Collects the fetch records' (ip, pa).
#[derive(Default)]
struct FetchPas(Vec<(u64, u64)>);

impl Tool for FetchPas {
    fn buffer_full(&mut self, records: &[MemRecord]) {
        let fetches = records.iter().filter(|r| r.access & access::FETCH != 0);
        self.0.extend(fetches.map(|r| (r.ip, r.pa)));
    }
    fn records_fetches(&self) -> bool {
        true
    }
    fn records_need_pa(&self) -> bool {
        true
    }
}

#[test]
fn test_fetch_records_carry_the_frame_the_code_was_translated_from() {
    // The code's page maps to another frame (whose bytes are the code that runs): each
    // fetch record's physical address is in that frame, written by the append itself.
    let mut rig = Rig::new(Config {
        mode: Mode::USER,
        ..Config::default()
    });
    let block = Region::map(4096, 0);
    let frame = Region::map(4096, 0);
    let va = block.addr();
    let exit = va + 0x10_0000;
    let mut code = vec![0x90, 0x48, 0x31, 0xC0]; // nop; xor rax, rax
    let at = va + 0x40 + code.len() as u64 + 5;
    code.push(0xE9);
    code.extend_from_slice(&((exit as i64 - at as i64) as i32).to_le_bytes());
    frame.slice()[0x40..0x40 + code.len()].copy_from_slice(&code);
    let mut mem = Remapped {
        inner: HostMemory::new(vec![(va, va + 4096)]),
        page: va,
        frame: frame.addr(),
    };
    let mut tool = FetchPas::default();
    rig.engine.set_rip(GuestVirt(va + 0x40));
    let stop = rig
        .engine
        .run(&mut mem, &mut HostPlatform::default(), &mut tool);
    assert_eq!(stop, Stop::FetchFault(GuestVirt(exit)));
    let f = frame.addr();
    assert_eq!(
        tool.0,
        [
            (va + 0x40, f + 0x40),
            (va + 0x41, f + 0x41),
            (va + 0x44, f + 0x44)
        ]
    );
}
