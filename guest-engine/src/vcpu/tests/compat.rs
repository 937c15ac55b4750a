//! 32-bit user code (`Mode::compat`): entered by `iretq` and `sysretl`, left by `int 0x80`
//! and by `syscall` through CSTAR; `pushfd`/`popfd` and segment pushes move 4 bytes at
//! ESP (SDM vol. 2: IRET, SYSCALL, SYSRET, PUSHF, PUSH).

use super::*;
use crate::vcpu::{Sreg, MODE_KERNEL, MODE_USER};

/// A DPL-3 32-bit code segment (L = 0, D = 1) at GDT slot 0x70, as Linux's
/// `__USER32_CS`; the block's GDT limit grows to hold it.
const USER32_CS: u16 = 0x73;

fn with_user32(v: &mut V<'_>) {
    v.mem
        .poke_u64(GDT + 0x70, seg_desc(0, 0xb, 3, true, false, true));
    v.gdtr.limit = 0x77;
}

/// Puts the virtual CPU in 32-bit user code (CS = USER32_CS, SS = UDATA).
fn to_user32(v: &mut V<'_>, r: &mut GuestRegs) {
    to_user(v, r);
    let mut cs = cache(USER32_CS, 0xb, 3, false);
    cs.db = 1;
    v.segs.sregs[Sreg::Cs as usize] = cs;
    r.set(Gpr::Rsp, USER_PAGE + 0x800);
}

#[test]
fn test_iretq_to_a_32_bit_code_segment_enters_the_compat_mode() {
    let b = block();
    let mut v = vcpu(&b);
    with_user32(&mut v);
    let mut r = kregs();
    r.set(Gpr::Rsp, KSTACK - 0x40);
    let frame = [
        0x0804_9000,
        u64::from(USER32_CS),
        rflags::FIXED | rflags::IF,
        USER_PAGE + 0x100,
        u64::from(UDATA),
    ];
    for (k, w) in frame.iter().enumerate() {
        v.mem.poke_u64(KSTACK - 0x40 + 8 * k as u64, *w);
    }
    assert_eq!(
        run(&mut v, &[0x48, 0xcf], &mut r),
        Emulation::Switch {
            next: GuestVirt(0x0804_9000),
            mode: MODE_USER.compat(),
            invalidate_mappings: false
        }
    );
    assert_eq!(v.bitness(), 32);
    assert_eq!(v.cpl(), 3);
}

#[test]
fn test_syscall_from_32_bit_code_enters_at_cstar_and_sysretl_returns_there() {
    let mut b = block();
    let n = b.msr_count as usize;
    b.msrs[n].index = kpin_abi::x86::msr::CSTAR;
    b.msrs[n].value = 0xffff_ffff_8100_2000;
    b.msr_count += 1;
    let mut v = vcpu(&b);
    let mut r = kregs();
    to_user32(&mut v, &mut r);
    assert_eq!(v.mode(), MODE_USER.compat());
    let e = run(&mut v, &[0x0f, 0x05], &mut r);
    assert_eq!(
        e,
        Emulation::Switch {
            next: GuestVirt(0xffff_ffff_8100_2000),
            mode: MODE_KERNEL,
            invalidate_mappings: false
        }
    );
    assert_eq!(r.get(Gpr::Rcx), PC + 2);
    // sysretl (no REX.W): CS = STAR[63:48] | 3, a 32-bit segment; EIP = ECX.
    r.set(Gpr::Rcx, 0xdead_0000_0804_9010);
    r.set(Gpr::R11, rflags::FIXED | rflags::IF);
    let e = run(&mut v, &[0x0f, 0x07], &mut r);
    assert_eq!(
        e,
        Emulation::Switch {
            next: GuestVirt(0x0804_9010),
            mode: MODE_USER.compat(),
            invalidate_mappings: false
        }
    );
    assert_eq!(v.segs.sregs[Sreg::Cs as usize].selector, 0x23);
    assert_eq!(v.bitness(), 32);
}

#[test]
fn test_pushfd_popfd_and_push_fs_move_four_bytes_in_32_bit_code() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    to_user32(&mut v, &mut r);
    r.rflags |= rflags::CF;
    let esp = r.get(Gpr::Rsp);
    assert_eq!(run(&mut v, &[0x9c], &mut r), after(&[0x9c])); // pushfd
    assert_eq!(r.get(Gpr::Rsp), esp - 4);
    let mut word = [0u8; 8];
    v.mem.peek(esp - 4, &mut word);
    assert_eq!(
        u64::from_le_bytes(word) & 0xffff_ffff,
        rflags::FIXED | rflags::IF | rflags::CF
    );
    assert_eq!(run(&mut v, &[0x0f, 0xa0], &mut r), after(&[0x0f, 0xa0])); // push fs
    assert_eq!(r.get(Gpr::Rsp), esp - 8);
    assert_eq!(run(&mut v, &[0x0f, 0xa1], &mut r), after(&[0x0f, 0xa1])); // pop fs
    r.rflags &= !rflags::CF;
    assert_eq!(run(&mut v, &[0x9d], &mut r), after(&[0x9d])); // popfd
    assert_eq!(r.get(Gpr::Rsp), esp);
    assert_ne!(r.rflags & rflags::CF, 0, "popfd restored CF");
}

#[test]
fn test_a_users_ac_flag_is_kept_in_the_frame_but_not_carried_into_the_kernel() {
    // The kernel's code runs at hardware CPL 3: a user's AC there would make its
    // misaligned accesses fault.
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    to_user(&mut v, &mut r);
    r.rflags |= rflags::AC;
    let e = run(&mut v, &[0x0f, 0x0b], &mut r); // ud2
    assert_user_fault(&v, e, &r, 6, None);
    assert_eq!(r.rflags & rflags::AC, 0, "the handler runs without AC");
    assert_ne!(
        frame(&v, &r, false).rflags & rflags::AC,
        0,
        "iretq restores it"
    );
}

/// Asserts that 32-bit code at [`PC`] raised exception `vector` (no error code),
/// delivered at CPL 0 with the 32-bit CS in the frame.
fn assert_fault32(v: &V<'_>, e: Emulation, r: &GuestRegs, vector: u8) {
    assert_eq!(
        e,
        Emulation::Switch {
            next: GuestVirt(handler(vector)),
            mode: MODE_KERNEL,
            invalidate_mappings: false
        },
        "vector {vector}"
    );
    let f = frame(v, r, false);
    assert_eq!((f.rip, f.cs), (PC, u64::from(USER32_CS)));
}

/// Runs `bytes` as 32-bit code at [`PC`] (the test helper decodes 64-bit code).
fn run32(v: &mut V<'_>, bytes: &[u8], r: &mut GuestRegs) -> Emulation {
    let i = iced_x86::Decoder::with_ip(32, bytes, PC, iced_x86::DecoderOptions::NONE).decode();
    let mut insn = crate::SensitiveInsn {
        pc: GuestVirt(PC),
        len: i.len() as u8,
        bytes: [0; crate::layout::MAX_INSN_BYTES],
        kind: crate::SensitiveKind::Other,
    };
    insn.bytes[..bytes.len()].copy_from_slice(bytes);
    v.emulate(&insn, r)
}

#[test]
fn test_far_jmp_and_far_call_switch_between_64_and_32_bit_code() {
    let b = block();
    let mut v = vcpu(&b);
    with_user32(&mut v);
    let mut r = kregs();
    to_user(&mut v, &mut r);
    // jmp far [rax] (m16:64) to USER32_CS:0x0804_9000.
    v.mem.poke_u64(USER_PAGE, 0x0804_9000);
    v.mem.poke(USER_PAGE + 8, &USER32_CS.to_le_bytes());
    r.set(Gpr::Rax, USER_PAGE);
    assert_eq!(
        run(&mut v, &[0x48, 0xff, 0x28], &mut r),
        Emulation::Switch {
            next: GuestVirt(0x0804_9000),
            mode: MODE_USER.compat(),
            invalidate_mappings: false
        }
    );
    // call far 0x33:0x401000 (ptr16:32) from 32-bit code: CS and EIP pushed, 4 bytes each.
    let esp = r.get(Gpr::Rsp);
    let call_far = [0x9a, 0x00, 0x10, 0x40, 0x00, 0x33, 0x00];
    v.mem
        .poke_u64(GDT + 0x30, seg_desc(0, 0xb, 3, true, true, false));
    let e = run32(&mut v, &call_far, &mut r);
    assert_eq!(
        e,
        Emulation::Switch {
            next: GuestVirt(0x40_1000),
            mode: MODE_USER,
            invalidate_mappings: false
        }
    );
    assert_eq!(r.get(Gpr::Rsp), esp - 8);
    let mut w = [0u8; 8];
    v.mem.peek(esp - 8, &mut w);
    assert_eq!(
        u32::from_le_bytes(w[..4].try_into().unwrap()),
        (PC + 7) as u32
    );
    assert_eq!(
        u32::from_le_bytes(w[4..].try_into().unwrap()),
        u32::from(USER32_CS)
    );
}

#[test]
fn test_pushad_popad_into_bound_and_aam_in_32_bit_code() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    to_user32(&mut v, &mut r);
    for (k, g) in [Gpr::Rax, Gpr::Rcx, Gpr::Rdx, Gpr::Rbx]
        .into_iter()
        .enumerate()
    {
        r.set(g, 0x100 + k as u64);
    }
    let esp = r.get(Gpr::Rsp);
    assert_eq!(run32(&mut v, &[0x60], &mut r), after(&[0x60])); // pushad
    assert_eq!(r.get(Gpr::Rsp), esp - 32);
    assert_eq!(v.mem.peek_u64(esp - 8) as u32, 0x101, "ECX below EAX");
    r.set(Gpr::Rax, 0);
    assert_eq!(run32(&mut v, &[0x61], &mut r), after(&[0x61])); // popad
    assert_eq!((r.get(Gpr::Rax), r.get(Gpr::Rsp)), (0x100, esp));
    // into: nothing without OF, #OF (a trap, RIP after) with it.
    assert_eq!(run32(&mut v, &[0xce], &mut r), after(&[0xce]));
    r.rflags |= 1 << 11;
    set_gate(&mut v, 4, gate(handler(4), KCODE, 0, 0xe, 3, true));
    let e = run32(&mut v, &[0xce], &mut r);
    assert!(matches!(e, Emulation::Switch { next, .. } if next == GuestVirt(handler(4))));
    assert_eq!(frame(&v, &r, false).rip, PC + 1);
    // bound eax, [ebx]: inside, then outside (#BR).
    let mut v = vcpu(&b);
    let mut r = kregs();
    to_user32(&mut v, &mut r);
    v.mem.poke(USER_PAGE, &[1, 0, 0, 0, 9, 0, 0, 0]);
    r.set(Gpr::Rbx, USER_PAGE);
    r.set(Gpr::Rax, 9);
    let bound = [0x62, 0x03];
    assert_eq!(run32(&mut v, &bound, &mut r), after(&bound));
    r.set(Gpr::Rax, 10);
    let e = run32(&mut v, &bound, &mut r);
    assert_fault32(&v, e, &r, 5);
    // aam: AL = 79 → AH = 7, AL = 9; aam 0 is #DE.
    let mut v = vcpu(&b);
    let mut r = kregs();
    to_user32(&mut v, &mut r);
    r.set(Gpr::Rax, 79);
    assert_eq!(run32(&mut v, &[0xd4, 0x0a], &mut r), after(&[0xd4, 0x0a]));
    assert_eq!(r.get(Gpr::Rax) & 0xffff, 0x0709);
    let e = run32(&mut v, &[0xd4, 0x00], &mut r);
    assert_fault32(&v, e, &r, 0);
}

#[test]
fn test_lgs_loads_the_selector_then_the_offset() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    to_user(&mut v, &mut r);
    v.mem.poke(USER_PAGE, &0x1234u32.to_le_bytes());
    v.mem.poke(USER_PAGE + 4, &UDATA.to_le_bytes());
    r.set(Gpr::Rbx, USER_PAGE);
    let lgs_eax = [0x0f, 0xb5, 0x03]; // lgs eax, [rbx]
    assert_eq!(run(&mut v, &lgs_eax, &mut r), after(&lgs_eax));
    assert_eq!(r.get(Gpr::Rax), 0x1234);
    assert_eq!(v.segs.sregs[Sreg::Gs as usize].selector, UDATA);
    // A kernel code selector: #GP(sel), nothing loaded.
    v.mem.poke(USER_PAGE + 4, &KCODE.to_le_bytes());
    r.set(Gpr::Rax, 0);
    let e = run(&mut v, &lgs_eax, &mut r);
    assert_user_fault(&v, e, &r, 13, Some(u64::from(KCODE)));
}

#[test]
fn test_decimal_adjustments_and_salc_in_32_bit_code() {
    let b = block();
    // (instruction, AX before, CF|AF before, AX after, CF|AF after): the host's results.
    let cases: [(u8, u64, u64, u64, u64); 4] = [
        (0x27, 0x41, 0x10, 0x47, 0x10),   // daa after 0x38 + 0x09
        (0x2f, 0x1f, 0x10, 0x19, 0x10),   // das
        (0x37, 0x0b, 0x00, 0x0101, 0x11), // aaa
        (0x3f, 0x0d, 0x00, 0xff07, 0x11), // aas
    ];
    for (op, ax, flags, want_ax, want_flags) in cases {
        let mut v = vcpu(&b);
        let mut r = kregs();
        to_user32(&mut v, &mut r);
        r.set(Gpr::Rax, ax);
        r.rflags |= flags;
        assert_eq!(run32(&mut v, &[op], &mut r), after(&[op]), "{op:#x}");
        assert_eq!(r.get(Gpr::Rax) & 0xffff, want_ax, "{op:#x}");
        assert_eq!(r.rflags & 0x11, want_flags, "{op:#x}");
    }
    let mut v = vcpu(&b);
    let mut r = kregs();
    to_user32(&mut v, &mut r);
    r.set(Gpr::Rax, 0x1234);
    r.rflags |= 1;
    assert_eq!(run32(&mut v, &[0xd6], &mut r), after(&[0xd6]));
    assert_eq!(r.get(Gpr::Rax), 0x12ff, "salc");
}

#[test]
fn test_arpl_raises_the_destination_rpl() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    to_user32(&mut v, &mut r);
    r.set(Gpr::Rax, 0x28);
    r.set(Gpr::Rcx, 0x2b);
    let arpl_ax_cx = [0x63, 0xc8];
    assert_eq!(run32(&mut v, &arpl_ax_cx, &mut r), after(&arpl_ax_cx));
    assert_eq!(r.get(Gpr::Rax), 0x2b);
    assert_ne!(r.rflags & rflags::ZF, 0);
    assert_eq!(run32(&mut v, &arpl_ax_cx, &mut r), after(&arpl_ax_cx));
    assert_eq!(r.rflags & rflags::ZF, 0, "already as high");
}
