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
