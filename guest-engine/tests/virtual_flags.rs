//! `cli`, `sti`, `pushfq` and `popfq` at virtual CPL 0 with `Config::inline_virtual_flags`:
//! they run inline against the virtual IF and IOPL in the cache context, with the images
//! and effects the emulation gives (IF and IOPL virtual, TF never loaded), no exit; an
//! `sti` that finds an interrupt held back sets the attention byte; `sti; hlt` still
//! exits to the platform.

mod common;

use common::{HostMemory, HostPlatform, Region, Rig};
use guest_engine::exit_code::EXIT_SENSITIVE;
use guest_engine::{Config, Gpr, GuestVirt, Mode, NullTool, Stop};
use iced_x86::code_asm::*;

const IF: u64 = 1 << 9;
const TF: u64 = 1 << 8;
const IOPL3: u64 = 3 << 12;

fn rig() -> Rig {
    Rig::new(Config {
        mode: Mode::KERNEL,
        inline_virtual_flags: true,
        ..Config::default()
    })
}

/// Ends the code `a` assembles with a jump to `target` through a pointer after it.
fn jump_out(a: &mut CodeAssembler, target: u64) {
    let mut slot = a.create_label();
    a.jmp(qword_ptr(slot)).unwrap();
    a.set_label(&mut slot).unwrap();
    a.db(&target.to_le_bytes()).unwrap();
}

fn run(rig: &mut Rig, block: &Region, code: &[u8]) -> Stop {
    let base = block.addr();
    block.slice()[..code.len()].copy_from_slice(code);
    let mut mem = HostMemory::new(vec![(base, base + 4096)]);
    rig.engine.regs_mut().set(Gpr::Rsp, base + 0xf00);
    rig.engine.regs_mut().rflags = 0x202;
    rig.engine.set_rip(GuestVirt(base));
    rig.engine
        .run(&mut mem, &mut HostPlatform::default(), &mut NullTool)
}

#[test]
fn test_flag_instructions_run_inline_with_the_emulations_images() {
    let mut rig = rig();
    let block = Region::map(4096, 0);
    let base = block.addr();
    let exit = rig.native.exit_address();
    let code = {
        let mut a = CodeAssembler::new(64).unwrap();
        a.cli().unwrap();
        a.pushfq().unwrap();
        a.pop(rax).unwrap();
        a.sti().unwrap();
        a.pushfq().unwrap();
        a.pop(rbx).unwrap();
        a.push(rcx).unwrap();
        a.popfq().unwrap();
        a.pushfq().unwrap();
        a.pop(rdx).unwrap();
        jump_out(&mut a, exit);
        a.assemble(base).unwrap()
    };
    rig.engine.set_virtual_flags(true, 0);
    // The word popped: CF, IOPL 3, TF, IF clear (bit 1 is always set).
    rig.engine.regs_mut().set(Gpr::Rcx, 0x3103);
    let stop = run(&mut rig, &block, &code);
    assert_eq!(stop, Stop::FetchFault(GuestVirt(exit)));
    let r = *rig.engine.regs();
    assert_eq!(r.get(Gpr::Rax) & (IF | IOPL3), 0, "after cli: IF clear");
    assert_eq!(r.get(Gpr::Rbx) & (IF | IOPL3), IF, "after sti: IF set");
    let popped = r.get(Gpr::Rdx);
    assert_eq!(
        popped & (IF | IOPL3 | TF | 1),
        IOPL3 | 1,
        "after popfq: CF and IOPL 3, no IF or TF"
    );
    assert_eq!(rig.engine.virtual_flags(), (false, 3));
    assert_eq!(r.rflags & (1 | TF), 1, "the real CF loaded, TF not");
    assert_eq!(
        rig.engine.stats().exits[EXIT_SENSITIVE as usize],
        0,
        "no exits"
    );
}

#[test]
fn test_sti_with_an_interrupt_held_back_sets_attention_and_sti_hlt_exits() {
    let mut rig = rig();
    let block = Region::map(4096, 0);
    let base = block.addr();
    // sti; jmp [next] (a new trace: its entry checks attention); next: hlt
    let next = base + 0x100;
    let code = {
        let mut a = CodeAssembler::new(64).unwrap();
        a.sti().unwrap();
        jump_out(&mut a, next);
        a.assemble(base).unwrap()
    };
    block.slice()[0x100] = 0xF4; // hlt
    rig.engine.set_virtual_flags(false, 0);
    rig.engine.set_irq_held(true);
    let stop = run(&mut rig, &block, &code);
    assert_eq!(stop, Stop::Attention(GuestVirt(next)));
    assert_eq!(rig.engine.virtual_flags(), (true, 0));
    assert_eq!(rig.engine.stats().exits[EXIT_SENSITIVE as usize], 0);

    // `sti; hlt`: the `sti` stays an exit (the platform's emulation keeps the interrupt
    // shadow); the host platform stops on it.
    rig.engine.set_attention(0);
    rig.engine.set_irq_held(false);
    rig.engine.set_virtual_flags(false, 0);
    let stop = run(&mut rig, &block, &[0xFB, 0xF4]);
    assert!(matches!(stop, Stop::Sensitive(_)), "{stop:?}");
}

/// `mov r, sreg` into a register reads the selector `Engine::set_selectors` put in the
/// context, with the CPU's widths (a 16-bit destination keeps its upper bits, a 32- or
/// 64-bit one is zero-extended), without an exit; into memory it still exits.
#[test]
fn test_selector_reads_run_inline_against_the_contexts_selectors() {
    let mut rig = rig();
    let block = Region::map(4096, 0);
    let base = block.addr();
    let exit = rig.native.exit_address();
    let code = {
        let mut a = CodeAssembler::new(64).unwrap();
        a.mov(eax, ss).unwrap();
        a.mov(bx, cs).unwrap();
        a.mov(rcx, ds).unwrap();
        a.mov(r9d, es).unwrap();
        a.mov(r10w, fs).unwrap();
        a.mov(r11, gs).unwrap();
        jump_out(&mut a, exit);
        a.assemble(base).unwrap()
    };
    // ES, CS, SS, DS, FS, GS.
    rig.engine
        .set_selectors([0x2b, 0x10, 0x18, 0x33, 0x53, 0x63]);
    for r in [Gpr::Rax, Gpr::Rbx, Gpr::Rcx, Gpr::R9, Gpr::R10, Gpr::R11] {
        rig.engine.regs_mut().set(r, 0xffff_ffff_ffff_ffff);
    }
    let stop = run(&mut rig, &block, &code);
    assert_eq!(stop, Stop::FetchFault(GuestVirt(exit)));
    let r = *rig.engine.regs();
    assert_eq!(r.get(Gpr::Rax), 0x18, "SS, zero-extended");
    assert_eq!(r.get(Gpr::Rbx), 0xffff_ffff_ffff_0010, "CS into BX only");
    assert_eq!(r.get(Gpr::Rcx), 0x33, "DS");
    assert_eq!(r.get(Gpr::R9), 0x2b, "ES");
    assert_eq!(r.get(Gpr::R10), 0xffff_ffff_ffff_0053, "FS into R10W only");
    assert_eq!(r.get(Gpr::R11), 0x63, "GS");
    assert_eq!(
        rig.engine.stats().exits[EXIT_SENSITIVE as usize],
        0,
        "no exits"
    );

    // Into memory: it still leaves the cache for the platform.
    let block = Region::map(4096, 0);
    let code = {
        let mut a = CodeAssembler::new(64).unwrap();
        a.mov(word_ptr(rsp - 8), ss).unwrap();
        a.assemble(block.addr()).unwrap()
    };
    let stop = run(&mut rig, &block, &code);
    assert!(
        matches!(stop, Stop::Sensitive(s) if s.pc == GuestVirt(block.addr())),
        "{stop:?}"
    );
}

/// Builds an `iretq` frame (SS, RSP from RBX, RFLAGS from RCX, CS, RIP from RDX), sets CF
/// (so that a path that must keep the guest's flags shows it) and `iretq`s.
fn iretq_with_frame(base: u64, cs_sel: i32, ss_sel: i32) -> Vec<u8> {
    let mut a = CodeAssembler::new(64).unwrap();
    a.push(ss_sel).unwrap();
    a.push(rbx).unwrap();
    a.push(rcx).unwrap();
    a.push(cs_sel).unwrap();
    a.push(rdx).unwrap();
    a.stc().unwrap();
    a.iretq().unwrap();
    a.assemble(base).unwrap()
}

/// An `iretq` at virtual CPL 0 to the same CS and SS selectors runs inline: RIP, RSP
/// and the flags popped, IF and IOPL into the virtual flags, no exit, counted as an
/// emulated instruction; to other selectors, or with TF in the popped flags, it exits to
/// the platform with the guest's state as it was before it.
#[test]
fn test_same_selector_iretq_runs_inline_and_anything_else_exits() {
    let mut rig = Rig::new(Config {
        mode: Mode::KERNEL,
        inline_virtual_flags: true,
        count_insns: true,
        ..Config::default()
    });
    let block = Region::map(4096, 0);
    let base = block.addr();
    let exit = rig.native.exit_address();
    rig.engine
        .set_selectors([0x18, 0x10, 0x18, 0x18, 0x18, 0x18]);
    let new_rsp = base + 0xe00;
    let frame = |rig: &mut Rig, flags: u64| {
        rig.engine.set_virtual_flags(false, 0);
        rig.engine.regs_mut().set(Gpr::Rbx, new_rsp);
        rig.engine.regs_mut().set(Gpr::Rcx, flags);
        rig.engine.regs_mut().set(Gpr::Rdx, exit);
    };
    // ZF, IF, IOPL 3 (and the always-set bit 1): inline.
    frame(&mut rig, 0x3246);
    let stop = run(&mut rig, &block, &iretq_with_frame(base, 0x10, 0x18));
    assert_eq!(stop, Stop::FetchFault(GuestVirt(exit)));
    let r = *rig.engine.regs();
    assert_eq!(r.get(Gpr::Rsp), new_rsp, "RSP popped");
    assert_eq!(r.rflags & 0xff, 0x46, "ZF loaded, CF cleared");
    assert_eq!(rig.engine.virtual_flags(), (true, 3));
    assert_eq!(
        rig.engine.stats().exits[EXIT_SENSITIVE as usize],
        0,
        "no exits"
    );
    assert_eq!(rig.engine.stats().emulated_insns, 1);
    assert_eq!(rig.engine.executed_insns(Mode::KERNEL), 7);

    // Another CS selector, another SS, TF set: the platform's (the host's stops on it),
    // with CF still set and RSP at the frame. (Each in a block of its own, all kept
    // mapped: a block at a reused address would run the translation of the one before.)
    let mut blocks = vec![block];
    for (cs_sel, ss_sel, flags) in [
        (0x08, 0x18, 0x246),
        (0x10, 0x20, 0x246),
        (0x10, 0x18, 0x346),
    ] {
        blocks.push(Region::map(4096, 0));
        let block = blocks.last().unwrap();
        let base = block.addr();
        frame(&mut rig, flags);
        let code = iretq_with_frame(base, cs_sel, ss_sel);
        let stop = run(&mut rig, block, &code);
        let iretq_at = GuestVirt(base + code.len() as u64 - 2);
        assert!(
            matches!(&stop, Stop::Sensitive(s) if s.pc == iretq_at),
            "cs {cs_sel:#x} ss {ss_sel:#x} flags {flags:#x}: {stop:?}"
        );
        let r = *rig.engine.regs();
        assert_eq!(r.rflags & 1, 1, "the guest's CF kept");
        assert_eq!(r.get(Gpr::Rsp), base + 0xf00 - 40, "RSP at the frame");
        assert_eq!(rig.engine.virtual_flags(), (false, 0));
    }
    // A frame in the engine's reserved zone is never read inline.
    blocks.push(Region::map(4096, 0));
    let block = blocks.last().unwrap();
    let zone = 0xffff_8000_0000_1000;
    rig.engine.regs_mut().set(Gpr::Rdi, zone);
    let code = {
        let mut a = CodeAssembler::new(64).unwrap();
        a.mov(rsp, rdi).unwrap();
        a.iretq().unwrap();
        a.assemble(block.addr()).unwrap()
    };
    let stop = run(&mut rig, block, &code);
    assert!(matches!(&stop, Stop::Sensitive(_)), "{stop:?}");
    assert_eq!(rig.engine.regs().get(Gpr::Rsp), zone);
    assert_eq!(rig.engine.stats().emulated_insns, 1, "none of them inline");
}
