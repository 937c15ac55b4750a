//! Fetch records against instruction executions when an instruction faults: a fault
//! takes the instruction back (its count and its records), so the retry must leave
//! exactly one fetch record per execution — also when the record buffer filled up (and
//! was delivered) between the instruction's records and the instruction itself.
//! Fetch records carry the physical address of the frame their trace was translated from;
//! fetch runs give the same stream as a record per instruction.

mod common;

use common::{HostMemory, HostPlatform, Region, Remapped, Rig};
use guest_engine::instrument::{access, MemRecord, Tool, TraceInstrumenter};
use guest_engine::{Config, Gpr, GuestPhys, GuestVirt, Mode, Stop};

/// The fault redirect serves one rig at a time: the tests that install it take turns.
static ONE_RIG: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A user-mode rig under `config` whose faults of `signal` the fault redirect serves, and
/// `code` followed by a `jmp` to `exit` (1 MiB past the block: unmapped, so the run ends
/// there) at the start of a fresh 4 KiB block at `base`; `_turn` holds the redirect for
/// the test.
struct Setup {
    block: Region,
    rig: Rig,
    base: u64,
    exit: u64,
    _turn: std::sync::MutexGuard<'static, ()>,
}

fn setup(config: Config, signal: libc::c_int, code: &[u8]) -> Setup {
    let rig = Rig::new(Config {
        mode: Mode::USER,
        ..config
    });
    let turn = ONE_RIG.lock().unwrap_or_else(|e| e.into_inner());
    common::fault_redirect::install(&rig, signal);
    let block = Region::map(4096, 0);
    let base = block.addr();
    let exit = base + 0x10_0000;
    let mut code = code.to_vec();
    let at = base + code.len() as u64 + 5;
    code.push(0xE9);
    code.extend_from_slice(&((exit as i64 - at as i64) as i32).to_le_bytes());
    block.slice()[..code.len()].copy_from_slice(&code);
    Setup {
        block,
        rig,
        base,
        exit,
        _turn: turn,
    }
}

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
    let Setup {
        mut rig,
        base,
        exit,
        block: _block,
        _turn,
    } = setup(
        Config {
            record_buffer_records: 4,
            ..Config::default()
        },
        libc::SIGSEGV,
        &[0x90, 0x90, 0x90, 0x48, 0x8B, 0x03],
    );
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

/// Every record as an event: fetches expanded from runs, `(ip, pa, len, is_fetch)`.
struct Stream {
    runs: bool,
    events: Vec<(u64, u64, u32, bool)>,
    records: usize,
    /// Operand records that carried their instruction's fetch.
    with_fetch: usize,
}

impl Tool for Stream {
    fn instrument_trace(&mut self, trace: &mut TraceInstrumenter<'_>) {
        for i in 0..trace.instructions().len() {
            trace.insert_mem_records(i);
        }
    }
    fn buffer_full(&mut self, records: &[MemRecord]) {
        self.records += records.len();
        for r in records {
            if r.access & access::FETCH_RUN != 0 {
                let mut off = 0;
                for k in 0..r.size {
                    let len = ((r.ea >> (4 * k)) & 0xf) as u32;
                    self.events.push((r.ip + off, r.pa + off, len, true));
                    off += u64::from(len);
                }
            } else {
                if r.access & access::WITH_FETCH != 0 {
                    self.with_fetch += 1;
                    let len = (r.access >> access::FETCH_LEN_SHIFT) & 0xf;
                    self.events.push((r.ip, r.ea, len, true));
                }
                let fetch = r.access & access::FETCH != 0;
                self.events.push((r.ip, r.pa, r.size, fetch));
            }
        }
    }
    fn records_fetches(&self) -> bool {
        true
    }
    fn fetch_runs(&self) -> bool {
        self.runs
    }
    fn records_need_pa(&self) -> bool {
        true
    }
}

/// What one pass of [`fault_and_retry`] saw: the stream (addresses relative to the
/// code's base), the records delivered, and the operand records that carried their
/// instruction's fetch.
type Pass = (Vec<(u64, u64, u32, bool)>, usize, usize);

/// Runs `code` (see [`setup`]) under a [`Stream`], without fetch runs and with them: from
/// its start, with `first` setting registers (given the code's base), until it faults at
/// `base + fault_at`; then from there, with `retry` setting registers, until it leaves.
fn fault_and_retry(
    signal: libc::c_int,
    code: &[u8],
    fault_at: u64,
    first: impl Fn(&mut guest_engine::GuestRegs, u64),
    retry: impl Fn(&mut guest_engine::GuestRegs, u64),
) -> [Pass; 2] {
    [false, true].map(|runs| {
        let Setup {
            mut rig,
            base,
            exit,
            block: _block,
            _turn,
        } = setup(Config::default(), signal, code);
        let mut mem = HostMemory::new(vec![(base, base + 4096)]);
        let mut tool = Stream {
            runs,
            events: Vec::new(),
            records: 0,
            with_fetch: 0,
        };
        rig.engine.regs_mut().set(Gpr::Rsp, base + 0xf00);
        first(rig.engine.regs_mut(), base);
        rig.engine.set_rip(GuestVirt(base));
        let stop = rig
            .engine
            .run(&mut mem, &mut HostPlatform::default(), &mut tool);
        let at = GuestVirt(base + fault_at);
        assert!(
            matches!(stop, Stop::Fault { guest_pc, .. } if guest_pc == at),
            "runs={runs}: {stop:?}"
        );
        retry(rig.engine.regs_mut(), base);
        rig.engine.set_rip(at);
        let stop = rig
            .engine
            .run(&mut mem, &mut HostPlatform::default(), &mut tool);
        assert_eq!(stop, Stop::FetchFault(GuestVirt(exit)), "runs={runs}");
        let rel = |a: u64| a.wrapping_sub(base);
        let events = tool
            .events
            .iter()
            .map(|&(ip, pa, size, fetch)| (rel(ip), rel(pa), size, fetch))
            .collect();
        (events, tool.records, tool.with_fetch)
    })
}

/// The instructions fetched, and those with a data access, in a pass's stream.
fn fetched_and_accessed(pass: &Pass) -> (Vec<u64>, Vec<u64>) {
    let of = |fetch: bool| {
        pass.0
            .iter()
            .filter(|e| e.3 == fetch)
            .map(|e| e.0)
            .collect()
    };
    (of(true), of(false))
}

#[test]
fn test_fetch_runs_give_the_same_stream_and_a_fault_inside_one_trims_it() {
    // nop; xor eax, eax; add rcx, 1; mov rdx, [rbx]; inc rdx; div rsi; nop; jmp exit:
    // with runs, the instructions without memory records share records, and the stream
    // of fetches and data accesses is the same as with a record each. RSI = 0 makes the
    // div fault inside the second run: the run keeps `inc` only, and the retry (RSI = 1)
    // records the div and what follows once.
    let code = [
        0x90, 0x31, 0xC0, 0x48, 0x83, 0xC1, 0x01, 0x48, 0x8B, 0x13, 0x48, 0xFF, 0xC2, 0x48, 0xF7,
        0xF6, 0x90,
    ];
    let [each, runs] = fault_and_retry(
        libc::SIGFPE,
        &code,
        13,
        |r, base| {
            r.set(Gpr::Rbx, base + 0x800);
            r.set(Gpr::Rsi, 0);
        },
        |r, _| {
            r.set(Gpr::Rsi, 1);
            r.set(Gpr::Rdx, 0);
        },
    );
    for pass in [&each, &runs] {
        let (fetched, _) = fetched_and_accessed(pass);
        assert_eq!(
            fetched,
            [0, 1, 3, 7, 10, 13, 16, 17],
            "each instruction fetched once"
        );
    }
    assert_eq!(each.0, runs.0, "the same stream");
    assert!(runs.1 < each.1, "fewer records with runs");
}

#[test]
fn test_an_operand_record_carrying_the_fetch_goes_with_a_faulting_instruction() {
    // nop; mov rdx, [rbx]; nop; jmp exit — with runs and physical addresses the mov's
    // fetch rides on its operand record (`WITH_FETCH`). RBX unmapped makes the mov fault:
    // that record is taken back whole, and the retry fetches and reads once; the stream
    // is the one a record per fetch gives.
    let [each, runs] = fault_and_retry(
        libc::SIGSEGV,
        &[0x90, 0x48, 0x8B, 0x13, 0x90],
        1,
        |r, _| r.set(Gpr::Rbx, 0x10), // unmapped in this process
        |r, base| r.set(Gpr::Rbx, base + 0x800),
    );
    for pass in [&each, &runs] {
        assert_eq!(fetched_and_accessed(pass), (vec![0, 1, 4, 5], vec![1]));
    }
    assert_eq!((each.2, runs.2), (0, 1), "the mov's fetch rode on its read");
    assert_eq!(each.0, runs.0, "the same stream");
}

/// The records of the instructions at `ips`: `(ip, access, ea, pa)`; with `split`, a
/// tool answering `call_stack_records`.
struct Flows {
    ips: [u64; 2],
    split: bool,
    seen: Vec<(u64, u32, u64, u64)>,
}

impl Tool for Flows {
    fn instrument_trace(&mut self, trace: &mut TraceInstrumenter<'_>) {
        for i in 0..trace.instructions().len() {
            trace.insert_mem_records(i);
        }
    }
    fn buffer_full(&mut self, records: &[MemRecord]) {
        self.seen.extend(
            records
                .iter()
                .filter(|r| self.ips.contains(&r.ip))
                .map(|r| (r.ip, r.access, r.ea, r.pa)),
        );
    }
    fn records_fetches(&self) -> bool {
        true
    }
    fn fetch_runs(&self) -> bool {
        true
    }
    fn records_need_pa(&self) -> bool {
        true
    }
    fn call_stack_records(&self) -> bool {
        self.split
    }
}

#[test]
fn test_a_call_and_its_ret_say_so_on_the_records_carrying_their_fetches() {
    // call f; jmp over; f: nop; ret; over: jmp exit — the call's stack write carries its
    // fetch and `CALL`, the ret's stack read `RET`, and both name the same slot. For a
    // tool answering `call_stack_records` the fetches have records of their own, and the
    // stack accesses' records keep the slot's virtual address.
    for split in [false, true] {
        let Setup {
            mut rig,
            base,
            exit,
            block: _block,
            _turn,
        } = setup(
            Config::default(),
            libc::SIGSEGV,
            &[0xE8, 0x02, 0, 0, 0, 0xEB, 0x02, 0x90, 0xC3],
        );
        let mut mem = HostMemory::new(vec![(base, base + 4096)]);
        let mut tool = Flows {
            ips: [base, base + 8],
            split,
            seen: Vec::new(),
        };
        rig.engine.regs_mut().set(Gpr::Rsp, base + 0xf00);
        rig.engine.set_rip(GuestVirt(base));
        let stop = rig
            .engine
            .run(&mut mem, &mut HostPlatform::default(), &mut tool);
        assert_eq!(stop, Stop::FetchFault(GuestVirt(exit)));
        let slot = base + 0xf00 - 8;
        let bits = access::CALL
            | access::RET
            | access::READ
            | access::WRITE
            | access::FETCH
            | access::WITH_FETCH;
        let seen: Vec<(u64, u32, u64, u64)> = tool
            .seen
            .iter()
            .map(|&(ip, a, ea, pa)| {
                // A fetch's `ea`/`pa` is the instruction's (identity-mapped here).
                (ip - base, a & bits, ea, pa)
            })
            .collect();
        let (call, ret) = (access::CALL, access::RET);
        let (r, w, with) = (access::READ, access::WRITE, access::WITH_FETCH);
        if split {
            let fetch = access::FETCH;
            assert_eq!(
                seen,
                [
                    (0, fetch | call, base, base),
                    (0, w, slot, slot),
                    (8, fetch | ret, base + 8, base + 8),
                    (8, r, slot, slot)
                ]
            );
        } else {
            assert_eq!(
                seen,
                [
                    (0, call | w | with, base, slot),
                    (8, ret | r | with, base + 8, slot)
                ],
                "the slot in pa, the instruction in ea"
            );
        }
    }
}
