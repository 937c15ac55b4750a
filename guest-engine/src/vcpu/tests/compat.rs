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
