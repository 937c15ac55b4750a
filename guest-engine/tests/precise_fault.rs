//! Precise exceptions: a fault inside translated code (in glue, with a register spilled,
//! and in a verbatim copy) is redirected by a SIGSEGV handler to the exit routine, and the
//! engine maps the cache PC back to the guest instruction and restores the guest registers
//! exactly as they were before that instruction (and the engine's instruction count excludes
//! the faulting instruction and the rest of its block).

mod common;

use common::{HostMemory, HostPlatform, Region, Rig};
use guest_engine::{Config, Gpr, GuestVirt, Mode, NullTool, Stop};

/// The fault redirect serves one rig at a time: the tests that install it take turns.
static ONE_RIG: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A rig counting instructions, with SIGSEGV redirected to the engine's fault path (the
/// guard holds the redirect for the test), and a block of three pages whose third is
/// inaccessible.
fn faulting_rig() -> (Rig, Region, std::sync::MutexGuard<'static, ()>) {
    let rig = Rig::new(Config {
        count_insns: true,
        ..Config::default()
    });
    let turn = ONE_RIG.lock().unwrap_or_else(|e| e.into_inner());
    common::fault_redirect::install(&rig, libc::SIGSEGV);
    let block = Region::map(3 * 4096, 0);
    let bad = block.addr() + 2 * 4096;
    // SAFETY: make the third page inaccessible.
    unsafe { libc::mprotect(bad as *mut libc::c_void, 4096, libc::PROT_NONE) };
    (rig, block, turn)
}

/// The engine image's fault handler stores the faulting PC in a fixed cell of its own
/// (`Engine::take_fault_pc_from`): the redirect points there, and the stop reads it.
#[test]
fn test_a_fault_pc_stored_in_the_embedders_cell_maps_back_the_same() {
    static CELL: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut rig = Rig::new(Config::default());
    rig.engine.take_fault_pc_from(&CELL);
    assert_eq!(
        rig.engine.fault_redirect().fault_pc,
        CELL.as_ptr() as u64,
        "the handler is told to store into the cell"
    );
    let turn = ONE_RIG.lock().unwrap_or_else(|e| e.into_inner());
    common::fault_redirect::install(&rig, libc::SIGSEGV);
    let block = Region::map(3 * 4096, 0);
    let base = block.addr();
    let bad = base + 2 * 4096;
    // SAFETY: make the third page inaccessible.
    unsafe { libc::mprotect(bad as *mut libc::c_void, 4096, libc::PROT_NONE) };
    // mov rcx, 7; mov r9, [rdi] (rdi in the bad page)
    let code = [0x48, 0xC7, 0xC1, 7, 0, 0, 0, 0x4C, 0x8B, 0x0F];
    block.slice()[..code.len()].copy_from_slice(&code);
    let mut mem = HostMemory::new(vec![(base, base + 2 * 4096)]);
    rig.engine.regs_mut().set(Gpr::Rsp, base + 4096);
    rig.engine.regs_mut().set(Gpr::Rdi, bad + 8);
    rig.engine.set_rip(GuestVirt(base));
    let stop = rig
        .engine
        .run(&mut mem, &mut HostPlatform::default(), &mut NullTool);
    drop(turn);
    let Stop::Fault { guest_pc, cache_pc } = stop else {
        panic!("unexpected stop {stop:?}")
    };
    assert_eq!(guest_pc, GuestVirt(base + 7), "the load");
    assert_eq!(cache_pc.0, CELL.load(std::sync::atomic::Ordering::Relaxed));
    assert_eq!(rig.engine.regs().get(Gpr::Rcx), 7);
}

#[test]
fn test_faults_in_cache_map_back_to_the_guest_instruction() {
    let (mut rig, block, _turn) = faulting_rig();
    let base = block.addr();
    let bad = base + 2 * 4096;
    let mut code = Vec::new();
    code.extend_from_slice(&[0x48, 0xC7, 0xC1, 7, 0, 0, 0]); // mov rcx, 7
    code.extend_from_slice(&[0x48, 0xC7, 0xC2, 9, 0, 0, 0]); // mov rdx, 9
    let rip_rel_at = base + code.len() as u64;
    let disp = (bad as i64 - (rip_rel_at as i64 + 7)) as i32;
    code.extend_from_slice(&[0x48, 0x8B, 0x05]); // mov rax, [rip+bad]
    code.extend_from_slice(&disp.to_le_bytes());
    code.extend_from_slice(&[0x49, 0xC7, 0xC2, 1, 0, 0, 0]); // mov r10, 1
    block.slice()[..code.len()].copy_from_slice(&code);
    let mut mem = HostMemory::new(vec![(base, base + 2 * 4096)]);

    rig.engine.regs_mut().gpr = [0x1111; 16];
    rig.engine.regs_mut().set(Gpr::Rsp, base + 4096);
    rig.engine.set_rip(GuestVirt(base));
    let stop = rig
        .engine
        .run(&mut mem, &mut HostPlatform::default(), &mut NullTool);
    let Stop::Fault { guest_pc, .. } = stop else {
        panic!("unexpected stop {stop:?}")
    };
    assert_eq!(guest_pc, GuestVirt(rip_rel_at));
    let r = rig.engine.regs();
    assert_eq!(
        r.get(Gpr::Rcx),
        7,
        "the spilled scratch register is restored"
    );
    assert_eq!(r.get(Gpr::Rdx), 9);
    assert_eq!(r.get(Gpr::Rax), 0x1111);
    assert_eq!(r.get(Gpr::R10), 0x1111);
    assert_eq!(
        rig.engine.executed_insns(Mode::KERNEL),
        2,
        "the faulting load and the rest of its block are not counted"
    );

    // A verbatim instruction faulting: mov r9, [rdi] with rdi in the bad page.
    let code2 = [
        0x48, 0xC7, 0xC6, 5, 0, 0, 0, 0x4C, 0x8B, 0x0F, 0x49, 0xC7, 0xC2, 1, 0, 0, 0,
    ];
    block.slice()[0x400..0x400 + code2.len()].copy_from_slice(&code2);
    rig.engine.regs_mut().set(Gpr::Rdi, bad + 8);
    rig.engine.set_rip(GuestVirt(base + 0x400));
    let stop = rig
        .engine
        .run(&mut mem, &mut HostPlatform::default(), &mut NullTool);
    let Stop::Fault { guest_pc, .. } = stop else {
        panic!("unexpected stop {stop:?}")
    };
    assert_eq!(guest_pc, GuestVirt(base + 0x407));
    assert_eq!(rig.engine.executed_insns(Mode::KERNEL), 2 + 1);
    assert_eq!(rig.engine.regs().get(Gpr::Rsi), 5);
    assert_eq!(rig.engine.regs().get(Gpr::Rdi), bad + 8);
}

/// A block whose flags are live at its start adds its instruction count further on, at
/// its count point (`insn_count.rs`): a fault before that point leaves the count at the
/// instructions executed before it, and so does one after it.
#[test]
fn test_a_fault_before_or_after_the_count_point_counts_what_ran() {
    let (mut rig, block, _turn) = faulting_rig();
    let base = block.addr();
    let bad = base + 2 * 4096;
    const ADC_RCX: [u8; 4] = [0x48, 0x83, 0xD1, 0x00]; // adc rcx, 0 (reads CF)
    const ADC_RDX: [u8; 4] = [0x48, 0x83, 0xD2, 0x00]; // adc rdx, 0
    const LOAD: [u8; 3] = [0x48, 0x8B, 0x07]; // mov rax, [rdi]
    const CMP: [u8; 3] = [0x48, 0x39, 0xC0]; // cmp rax, rax (writes every flag)
    const MOV_R10: [u8; 7] = [0x49, 0xC7, 0xC2, 1, 0, 0, 0]; // mov r10, 1
                                                             // (code, offset of the load, instructions executed before it)
    let cases: [(Vec<u8>, u64, u64); 2] = [
        // CF live until the `cmp`: the count point is past the faulting load.
        (
            [&ADC_RCX[..], &LOAD, &ADC_RDX, &CMP, &MOV_R10].concat(),
            4,
            1,
        ),
        // Dead before the `cmp`, ahead of the load.
        ([&ADC_RCX[..], &CMP, &LOAD, &MOV_R10].concat(), 7, 2),
    ];
    let mut mem = HostMemory::new(vec![(base, base + 2 * 4096)]);
    let mut total = 0;
    for (n, (code, load_at, before)) in cases.iter().enumerate() {
        let at = 0x200 * n as u64;
        block.slice()[at as usize..at as usize + code.len()].copy_from_slice(code);
        rig.engine.regs_mut().set(Gpr::Rdi, bad);
        rig.engine.regs_mut().set(Gpr::Rsp, base + 4096);
        rig.engine.set_rip(GuestVirt(base + at));
        let stop = rig
            .engine
            .run(&mut mem, &mut HostPlatform::default(), &mut NullTool);
        let Stop::Fault { guest_pc, .. } = stop else {
            panic!("case {n}: unexpected stop {stop:?}")
        };
        assert_eq!(guest_pc, GuestVirt(base + at + load_at), "case {n}");
        total += before;
        assert_eq!(
            rig.engine.executed_insns(Mode::KERNEL),
            total,
            "case {n}: the instructions before the fault, no more"
        );
    }
}
