//! Precise exceptions: a fault inside translated code (in glue, with a register spilled,
//! and in a verbatim copy) is redirected by a SIGSEGV handler to the exit routine, and the
//! engine maps the cache PC back to the guest instruction and restores the guest registers
//! exactly as they were before that instruction (and the engine's instruction count excludes
//! the faulting instruction and the rest of its block).

mod common;

use common::{HostMemory, HostPlatform, Region, Rig};
use guest_engine::{Config, Gpr, GuestVirt, Mode, NullTool, Stop};

#[test]
fn test_faults_in_cache_map_back_to_the_guest_instruction() {
    let mut rig = Rig::new(Config {
        count_insns: true,
        ..Config::default()
    });
    common::fault_redirect::install(&rig, libc::SIGSEGV);
    let block = Region::map(3 * 4096, 0);
    let base = block.addr();
    let bad = base + 2 * 4096;
    // SAFETY: make the third page inaccessible.
    unsafe { libc::mprotect(bad as *mut libc::c_void, 4096, libc::PROT_NONE) };
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
