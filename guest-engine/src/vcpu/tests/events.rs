//! Delivery through the IDT (stack switch, IST, error codes, nested faults, #DF, triple
//! fault), `int n`, `int3`, `iretq`, external interrupts.

use super::*;
use crate::vcpu::{Event, Sreg, MODE_KERNEL, MODE_USER};

const INT3: &[u8] = &[0xcc];
const INT_80: &[u8] = &[0xcd, 0x80];
const INT_30: &[u8] = &[0xcd, 0x30];
const UD2: &[u8] = &[0x0f, 0x0b];
const PUSHFQ: &[u8] = &[0x9c];
const IRETQ: &[u8] = &[0x48, 0xcf];

#[test]
fn test_int3_at_cpl3_switches_to_rsp0_and_returns_after_it() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    to_user(&mut v, &mut r);
    let user_rsp = r.get(Gpr::Rsp);
    let e = run(&mut v, INT3, &mut r);
    assert_eq!(
        e,
        Emulation::Switch {
            next: GuestVirt(handler(3)),
            mode: MODE_KERNEL,
            invalidate_mappings: false
        }
    );
    let f = frame(&v, &r, false);
    assert_eq!(
        f,
        Frame {
            error: None,
            rip: PC + 1,
            cs: u64::from(UCODE),
            rflags: rflags::FIXED | rflags::IF,
            rsp: user_rsp,
            ss: u64::from(UDATA),
        }
    );
    assert_eq!(r.get(Gpr::Rsp), RSP0 - 40);
    assert_eq!(v.segs.sregs[Sreg::Cs as usize].selector, KCODE);
    // 64-bit mode: SS becomes null with RPL = the new CPL.
    assert_eq!(v.segs.sregs[Sreg::Ss as usize].selector, 0);
    assert!(!v.vif, "interrupt gate");
}

#[test]
fn test_int_n_through_a_dpl0_gate_at_cpl3_is_gp_with_the_idt_error_code() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    to_user(&mut v, &mut r);
    let e = run(&mut v, INT_30, &mut r);
    // Error code: vector * 8 + 2 (IDT bit), EXT = 0.
    assert_user_fault(&v, e, &r, 13, Some(0x30 * 8 + 2));
}

#[test]
fn test_int_0x80_through_a_dpl3_gate_is_delivered_and_counted() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    to_user(&mut v, &mut r);
    let e = run(&mut v, INT_80, &mut r);
    assert!(matches!(e, Emulation::Switch { next, .. } if next == GuestVirt(handler(0x80))));
    assert_eq!(frame(&v, &r, false).rip, PC + 2);
    assert_eq!(v.stats.software_ints, 1);
}

#[test]
fn test_trap_gate_keeps_the_virtual_if() {
    let b = block();
    let mut v = vcpu(&b);
    set_gate(&mut v, 0x80, gate(handler(0x80), KCODE, 0, 0xf, 3, true));
    let mut r = kregs();
    assert_eq!(
        run(&mut v, INT_80, &mut r),
        Emulation::Continue(GuestVirt(handler(0x80)))
    );
    assert!(v.vif);
}

#[test]
fn test_delivery_at_cpl0_aligns_the_stack_and_pushes_the_error_code() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    r.set(Gpr::Rsp, KSTACK - 8);
    let mut ev_regs = r;
    let handler_rip = v
        .deliver(&mut ev_regs, PC, Event::fault(13, 0x18))
        .expect("delivered");
    assert_eq!(handler_rip, handler(13));
    assert_eq!(
        ev_regs.get(Gpr::Rsp),
        KSTACK - 16 - 48,
        "aligned to 16, then 6 words"
    );
    let f = frame(&v, &ev_regs, true);
    assert_eq!(f.error, Some(0x18));
    assert_eq!(f.rsp, KSTACK - 8);
    assert_eq!(f.ss, u64::from(KDATA));
}

#[test]
fn test_delivery_through_a_not_present_gate_is_np_with_the_idt_error_code() {
    let b = block();
    let mut v = vcpu(&b);
    set_gate(&mut v, 6, gate(handler(6), KCODE, 0, 0xe, 0, false));
    let mut r = kregs();
    let e = run(&mut v, UD2, &mut r);
    // #UD is benign: the #NP is delivered serially, not as #DF.
    assert_fault(&v, e, &r, 11, Some(6 * 8 + 2));
}

#[test]
fn test_delivery_beyond_the_idt_limit_is_gp_with_the_idt_error_code() {
    let b = block();
    let mut v = vcpu(&b);
    v.idtr.limit = 16 * 0x20 - 1;
    let mut r = kregs();
    let e = run(&mut v, INT_80, &mut r);
    assert_fault(&v, e, &r, 13, Some(0x80 * 8 + 2));
}

#[test]
fn test_external_interrupt_error_codes_have_the_ext_bit() {
    let b = block();
    let mut v = vcpu(&b);
    v.idtr.limit = 16 * 0x20 - 1;
    v.hw.pending.push(0x30);
    let mut r = kregs();
    let h = v.deliver_pending(&mut r, PC).expect("no triple fault");
    assert_eq!(h, Some(handler(13)));
    assert_eq!(frame(&v, &r, true).error, Some(0x30 * 8 + 2 + 1));
}

#[test]
fn test_gate_with_a_non_code_selector_is_gp_with_the_selector() {
    let b = block();
    let mut v = vcpu(&b);
    set_gate(&mut v, 6, gate(handler(6), KDATA, 0, 0xe, 0, true));
    let mut r = kregs();
    let e = run(&mut v, UD2, &mut r);
    assert_fault(&v, e, &r, 13, Some(u64::from(KDATA)));
}

#[test]
fn test_contributory_fault_while_delivering_a_contributory_fault_is_df() {
    let b = block();
    let mut v = vcpu(&b);
    // #GP's gate is not present (#NP, contributory): #GP then #NP is #DF.
    set_gate(&mut v, 13, gate(handler(13), KCODE, 0, 0xe, 0, false));
    let mut r = kregs();
    r.set(Gpr::Rax, 0x8000_0000_0000_0000);
    let e = run(&mut v, &[0x0f, 0x01, 0x10], &mut r); // lgdt [rax], non-canonical
    assert_fault(&v, e, &r, 8, Some(0));
}

#[test]
fn test_page_fault_while_delivering_a_page_fault_is_df() {
    let b = block();
    let mut v = vcpu(&b);
    use_ist1(&mut v, 8);
    let mut r = kregs();
    r.set(Gpr::Rsp, UNMAPPED + 8);
    let e = run(&mut v, PUSHFQ, &mut r);
    assert_eq!(e, Emulation::Continue(GuestVirt(handler(8))));
    assert_eq!(r.get(Gpr::Rsp), IST1 - 48);
    assert_eq!(frame(&v, &r, true).error, Some(0));
    assert_eq!(v.stats.exceptions[8], 1);
    assert_eq!(v.stats.exceptions[14], 0, "the #PF was never delivered");
}

#[test]
fn test_a_fault_while_delivering_df_is_a_triple_fault() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    r.set(Gpr::Rsp, UNMAPPED + 8);
    assert_eq!(run(&mut v, PUSHFQ, &mut r), Emulation::Stop);
    match stop(&mut v) {
        VcpuStop::TripleFault(t) => assert_eq!(t.last.vector, 14),
        other => panic!("expected a triple fault, got {other:?}"),
    }
}

#[test]
fn test_a_failed_delivery_rolls_back_the_pushes_it_made() {
    let b = block();
    let mut v = vcpu(&b);
    use_ist1(&mut v, 8);
    // The stack crosses from a mapped page (0x8000) into an unmapped one (0x7000): the
    // first two pushes of int3's frame succeed, the third faults.
    let mut r = kregs();
    r.set(Gpr::Rsp, 0x8010);
    v.mem.poke_u64(0x8008, 0x1111);
    v.mem.poke_u64(0x8000, 0x2222);
    let e = run(&mut v, INT3, &mut r);
    assert_eq!(
        e,
        Emulation::Continue(GuestVirt(handler(8))),
        "#PF, then #PF: #DF"
    );
    assert_eq!(v.mem.peek_u64(0x8008), 0x1111);
    assert_eq!(v.mem.peek_u64(0x8000), 0x2222);
    assert_eq!(v.cr2, 0x7ff8);
}

#[test]
fn test_exception_delivery_restores_registers_from_before_the_instruction() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    r.set(Gpr::Rcx, 0x1234); // rdmsr of an unknown index
    let e = run(&mut v, &[0x0f, 0x32], &mut r);
    assert_gp0(&v, e, &r);
    assert_eq!(r.get(Gpr::Rcx), 0x1234);
}

fn iret_frame(v: &mut V<'_>, words: [u64; 5]) -> GuestRegs {
    let mut r = kregs();
    r.set(Gpr::Rsp, KSTACK - 0x40);
    for (k, w) in words.iter().enumerate() {
        v.mem.poke_u64(KSTACK - 0x40 + 8 * k as u64, *w);
    }
    r
}

#[test]
fn test_iretq_to_cpl3_loads_cs_ss_rsp_and_rflags() {
    let b = block();
    let mut v = vcpu(&b);
    v.vif = false;
    let flags = rflags::FIXED | rflags::IF | rflags::CF;
    let mut r = iret_frame(
        &mut v,
        [
            0x40_1000,
            u64::from(UCODE),
            flags,
            USER_PAGE + 0x100,
            u64::from(UDATA),
        ],
    );
    let e = run(&mut v, IRETQ, &mut r);
    assert_eq!(
        e,
        Emulation::Switch {
            next: GuestVirt(0x40_1000),
            mode: MODE_USER,
            invalidate_mappings: false
        }
    );
    assert_eq!(v.cpl(), 3);
    assert_eq!(v.segs.sregs[Sreg::Ss as usize].selector, UDATA);
    assert_eq!(r.get(Gpr::Rsp), USER_PAGE + 0x100);
    assert!(v.vif);
    assert_eq!(r.rflags, flags);
    // Returning outward, DS (DPL 0) becomes null.
    assert_eq!(v.segs.sregs[Sreg::Ds as usize].unusable, 1);
    assert_eq!(v.segs.sregs[Sreg::Ds as usize].selector, 0);
}

#[test]
fn test_iretq_to_a_more_privileged_cs_is_gp_with_the_selector() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    to_user(&mut v, &mut r);
    let rsp = r.get(Gpr::Rsp);
    for (k, w) in [0x1000, u64::from(KCODE), 0x202, rsp, u64::from(KDATA)]
        .into_iter()
        .enumerate()
    {
        v.mem.poke_u64(rsp + 8 * k as u64, w);
    }
    let e = run(&mut v, IRETQ, &mut r);
    assert_user_fault(&v, e, &r, 13, Some(u64::from(KCODE)));
}

#[test]
fn test_iretq_to_a_non_canonical_rip_is_gp0() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = iret_frame(
        &mut v,
        [
            0x8000_0000_0000_0000,
            u64::from(KCODE),
            0x202,
            KSTACK,
            u64::from(KDATA),
        ],
    );
    let e = run(&mut v, IRETQ, &mut r);
    assert_gp0(&v, e, &r);
}

#[test]
fn test_iretq_to_cpl3_with_a_null_ss_is_gp0() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = iret_frame(&mut v, [0x40_1000, u64::from(UCODE), 0x202, USER_PAGE, 3]);
    let e = run(&mut v, IRETQ, &mut r);
    assert_gp0(&v, e, &r);
    assert_eq!(v.cpl(), 0);
}

#[test]
fn test_iretq_to_32_bit_code_is_gp_with_the_selector() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = iret_frame(
        &mut v,
        [0x1000, u64::from(CODE32), 0x202, KSTACK, u64::from(KDATA)],
    );
    let e = run(&mut v, IRETQ, &mut r);
    assert_fault(&v, e, &r, 13, Some(u64::from(CODE32)));
}

#[test]
fn test_iretq_with_ss_rpl_not_matching_cs_rpl_is_gp_with_the_ss_selector() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = iret_frame(
        &mut v,
        [
            0x40_1000,
            u64::from(UCODE),
            0x202,
            USER_PAGE,
            u64::from(KDATA),
        ],
    );
    let e = run(&mut v, IRETQ, &mut r);
    assert_fault(&v, e, &r, 13, Some(u64::from(KDATA)));
}

#[test]
fn test_iretq_from_an_unmapped_stack_is_pf_read() {
    let b = block();
    let mut v = vcpu(&b);
    use_ist1(&mut v, 14);
    let mut r = kregs();
    r.set(Gpr::Rsp, UNMAPPED);
    let e = run(&mut v, IRETQ, &mut r);
    assert_eq!(e, Emulation::Continue(GuestVirt(handler(14))));
    assert_eq!(frame(&v, &r, true).error, Some(0));
    assert_eq!(v.cr2, UNMAPPED);
}

#[test]
fn test_pending_interrupt_waits_while_the_virtual_if_is_clear() {
    let b = block();
    let mut v = vcpu(&b);
    v.vif = false;
    v.hw.pending.push(0x21);
    let mut r = kregs();
    assert_eq!(v.deliver_pending(&mut r, PC), Ok(None));
    assert_eq!(v.hw.pending, [0x21]);
    v.vif = true;
    assert_eq!(v.deliver_pending(&mut r, PC), Ok(Some(handler(0x21))));
    assert!(v.hw.pending.is_empty());
    let f = frame(&v, &r, false);
    assert_eq!(f.rip, PC, "an interrupt returns to where it arrived");
    assert_ne!(f.rflags & rflags::IF, 0);
}

#[test]
fn test_software_events_have_the_kind_that_decides_the_dpl_check() {
    // int3 is a software exception (DPL-checked, not EXT): through a DPL-0 gate at
    // CPL 3 it is #GP(3 * 8 + 2).
    let b = block();
    let mut v = vcpu(&b);
    set_gate(&mut v, 3, gate(handler(3), KCODE, 0, 0xe, 0, true));
    let mut r = kregs();
    to_user(&mut v, &mut r);
    let e = run(&mut v, INT3, &mut r);
    assert_user_fault(&v, e, &r, 13, Some(3 * 8 + 2));
}
