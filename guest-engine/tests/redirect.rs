//! `Engine::run_redirected`: one guest instruction run natively with its memory operand
//! moved into engine memory (how the image performs the guest's own accesses to the
//! reserved zone). The instruction's effects on registers and flags are the hardware's,
//! the operand's bytes come in and go out through the buffer, and an exception it raises
//! comes back as a fault with the guest state before it.

mod common;

use common::Rig;
use guest_engine::redirect::{redirectable, Redirected};
use guest_engine::{Config, Gpr};
use iced_x86::{Decoder, DecoderOptions, Instruction, InstructionInfoFactory};

fn decode(bytes: &[u8]) -> Instruction {
    Decoder::with_ip(64, bytes, 0x40_0000, DecoderOptions::NONE).decode()
}

#[test]
fn test_alu_and_sse_operands_run_on_the_buffer() {
    let mut rig = Rig::new(Config::default());
    let mut f = InstructionInfoFactory::new();
    // add qword [rbx + rcx*8 + 8], rax (a zone address: never touched).
    let add = decode(&[0x48, 0x01, 0x44, 0xCB, 0x08]);
    assert_eq!(redirectable(&mut f, &add), Some(8));
    let regs = rig.engine.regs_mut();
    regs.set(Gpr::Rax, 0xFFFF_FFFF_FFFF_FFFF);
    regs.set(Gpr::Rbx, 0xffff_8100_0000_0000);
    regs.set(Gpr::Rcx, 3);
    regs.rflags = 0x202;
    let mut data = 1u64.to_le_bytes();
    let r = rig
        .engine
        .run_redirected(&add, 0xffff_8100_0000_0020, &mut data);
    assert_eq!(r, Ok(Redirected::Done));
    assert_eq!(u64::from_le_bytes(data), 0, "1 + (-1)");
    let flags = rig.engine.regs().rflags;
    assert_eq!(flags & 0x41, 0x41, "ZF and CF set by the add: {flags:#x}");
    assert_eq!(rig.engine.regs().get(Gpr::Rcx), 3);

    // movzx eax, word gs:[rdx] (a segment prefix: the linear address is given).
    let movzx = decode(&[0x65, 0x0F, 0xB7, 0x02]);
    assert_eq!(redirectable(&mut f, &movzx), Some(2));
    let mut data = [0x34, 0x12];
    let r = rig
        .engine
        .run_redirected(&movzx, 0xffff_8000_0000_0ffe, &mut data);
    assert_eq!(r, Ok(Redirected::Done));
    assert_eq!(rig.engine.regs().get(Gpr::Rax), 0x1234);

    // cmpxchg [rdi], rsi: equal, so the operand takes RSI.
    let cmpxchg = decode(&[0x48, 0x0F, 0xB1, 0x37]);
    assert_eq!(redirectable(&mut f, &cmpxchg), Some(8));
    let regs = rig.engine.regs_mut();
    regs.set(Gpr::Rax, 7);
    regs.set(Gpr::Rsi, 99);
    let mut data = 7u64.to_le_bytes();
    let r = rig
        .engine
        .run_redirected(&cmpxchg, 0xffff_8080_0000_0100, &mut data);
    assert_eq!(r, Ok(Redirected::Done));
    assert_eq!(u64::from_le_bytes(data), 99);
}

#[test]
fn test_an_exception_of_the_instruction_is_a_fault_with_the_state_before_it() {
    let mut rig = Rig::new(Config::default());
    common::fault_redirect::install(&rig, libc::SIGSEGV);
    let mut f = InstructionInfoFactory::new();
    // movaps xmm0, [rax] at an address 8 mod 16: #GP on a real CPU (SIGSEGV here), since
    // the buffer keeps the address's alignment modulo 64.
    let movaps = decode(&[0x0F, 0x28, 0x00]);
    assert_eq!(redirectable(&mut f, &movaps), Some(16));
    rig.engine.regs_mut().set(Gpr::Rax, 0x1234);
    let mut data = [0u8; 16];
    let r = rig
        .engine
        .run_redirected(&movaps, 0xffff_8100_0000_0008, &mut data);
    assert_eq!(r, Ok(Redirected::Fault));
    assert_eq!(rig.engine.regs().get(Gpr::Rax), 0x1234);
    // Aligned, the same instruction loads.
    let mut data = [0u8; 16];
    let r = rig
        .engine
        .run_redirected(&movaps, 0xffff_8100_0000_0010, &mut data);
    assert_eq!(r, Ok(Redirected::Done));
}

#[test]
fn test_fxsave_writes_its_512_bytes_to_the_buffer() {
    // fxsave [rbx] redirected stores what fxsave stores in place: the control word first.
    let mut rig = Rig::new(Config::default());
    let mut f = InstructionInfoFactory::new();
    let fxsave = decode(&[0x0F, 0xAE, 0x03]);
    assert_eq!(redirectable(&mut f, &fxsave), Some(512));
    let mut data = [0xEEu8; 512];
    let r = rig
        .engine
        .run_redirected(&fxsave, 0xffff_8100_0000_0040, &mut data);
    assert_eq!(r, Ok(Redirected::Done));
    let mut fcw = 0u16;
    // SAFETY: fnstcw stores two bytes to a valid local.
    unsafe { std::arch::asm!("fnstcw [{}]", in(reg) &mut fcw) };
    assert_eq!(u16::from_le_bytes([data[0], data[1]]), fcw);
    assert_ne!(&data[..32], &[0xEE; 32][..], "written");
}

#[test]
fn test_only_single_explicit_operand_forms_qualify() {
    let mut f = InstructionInfoFactory::new();
    for (bytes, what) in [
        (&[0xFF, 0x33][..], "push [rbx]"),
        (&[0x8F, 0x03][..], "pop [rbx]"),
        (&[0xFF, 0x23][..], "jmp [rbx]"),
        (&[0xFF, 0x13][..], "call [rbx]"),
        (&[0xA4][..], "movsb"),
        (&[0xF3, 0xAB][..], "rep stosd"),
        (&[0xD7][..], "xlat"),
        (&[0x48, 0x0F, 0xAB, 0x03][..], "bts [rbx], rax"),
        (&[0xC4, 0xE2, 0x6D, 0x90, 0x04, 0x8F][..], "vpgatherdd"),
        (
            &[0x0F, 0xAE, 0x23][..],
            "xsave [rbx] (its size depends on its mask)",
        ),
    ] {
        assert_eq!(redirectable(&mut f, &decode(bytes)), None, "{what}");
    }
    for (bytes, size, what) in [
        (&[0x48, 0x0F, 0xBA, 0x2B, 0x05][..], 8, "bts qword [rbx], 5"),
        (
            &[0xF0, 0x48, 0x0F, 0xC1, 0x03][..],
            8,
            "lock xadd [rbx], rax",
        ),
        (&[0xC5, 0xFE, 0x6F, 0x03][..], 32, "vmovdqu ymm0, [rbx]"),
        (&[0xDD, 0x03][..], 8, "fld qword [rbx]"),
        (&[0x0F, 0xAE, 0x03][..], 512, "fxsave [rbx]"),
    ] {
        assert_eq!(redirectable(&mut f, &decode(bytes)), Some(size), "{what}");
    }
}
