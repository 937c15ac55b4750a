//! `cli`, `sti`, `pushfq`, `popfq`.

use super::*;

const CLI: &[u8] = &[0xfa];
const STI: &[u8] = &[0xfb];
const PUSHFQ: &[u8] = &[0x9c];
const POPFQ: &[u8] = &[0x9d];

#[test]
fn test_cli_clears_the_virtual_if_only() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    assert_eq!(run(&mut v, CLI, &mut r), after(CLI));
    assert!(!v.vif);
    assert_ne!(r.rflags & rflags::IF, 0, "the real IF stays 1");
}

#[test]
fn test_cli_at_cpl3_with_iopl0_is_gp0() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    to_user(&mut v, &mut r);
    let e = run(&mut v, CLI, &mut r);
    assert_user_fault(&v, e, &r, 13, Some(0));
    // The #GP went through an interrupt gate: IF is now 0 for the handler, but the
    // cli itself did not run; the saved RFLAGS still has IF.
    assert_ne!(frame(&v, &r, true).rflags & rflags::IF, 0);
}

#[test]
fn test_cli_and_sti_at_cpl3_with_iopl3_are_allowed() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    to_user(&mut v, &mut r);
    v.iopl = 3;
    assert_eq!(run(&mut v, CLI, &mut r), after(CLI));
    assert!(!v.vif);
    assert_eq!(run(&mut v, STI, &mut r), after(STI));
    assert!(v.vif);
}

#[test]
fn test_sti_at_cpl3_with_iopl0_is_gp0() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    to_user(&mut v, &mut r);
    v.vif = false;
    let e = run(&mut v, STI, &mut r);
    assert_user_fault(&v, e, &r, 13, Some(0));
}

#[test]
fn test_sti_with_an_interrupt_pending_rearms_attention() {
    let b = block();
    let mut v = vcpu(&b);
    v.vif = false;
    v.hw.pending.push(0x30);
    let mut r = kregs();
    assert_eq!(run(&mut v, STI, &mut r), after(STI));
    assert!(v.vif);
    assert_eq!(v.hw.rearms, 1);
}

#[test]
fn test_sti_then_hlt_takes_the_interrupt_after_the_hlt() {
    let b = block();
    let mut v = vcpu(&b);
    v.mem.map(PC, false, false);
    v.mem.poke(PC, &[0xfb, 0xf4]); // sti; hlt
    v.vif = false;
    v.hw.pending.push(0x30);
    let mut r = kregs();
    assert_eq!(run(&mut v, STI, &mut r), after(STI));
    assert_eq!(v.hw.rearms, 0, "sti; hlt: the interrupt waits for the hlt");
    let handler_rip = v.deliver_pending(&mut r, PC + 1).expect("delivered");
    assert_eq!(handler_rip, Some(handler(0x30)));
    assert_eq!(frame(&v, &r, false).rip, PC + 2, "returns after the hlt");
}

#[test]
fn test_pushfq_pushes_the_virtual_if_and_iopl() {
    let b = block();
    let mut v = vcpu(&b);
    v.vif = false;
    v.iopl = 2;
    let mut r = kregs();
    r.rflags |= rflags::CF | rflags::RF;
    assert_eq!(run(&mut v, PUSHFQ, &mut r), after(PUSHFQ));
    assert_eq!(r.get(Gpr::Rsp), KSTACK - 8);
    assert_eq!(
        v.mem.peek_u64(KSTACK - 8),
        rflags::FIXED | rflags::CF | (2 << 12),
        "IF from the virtual flag, IOPL 2, RF not pushed"
    );
}

#[test]
fn test_pushfq_to_an_unmapped_stack_is_pf_with_write_error_and_cr2() {
    let b = block();
    let mut v = vcpu(&b);
    use_ist1(&mut v, 14);
    let mut r = kregs();
    r.set(Gpr::Rsp, UNMAPPED + 8);
    let e = run(&mut v, PUSHFQ, &mut r);
    assert_eq!(e, Emulation::Continue(GuestVirt(handler(14))));
    assert_eq!(v.cr2, UNMAPPED);
    let f = frame(&v, &r, true);
    assert_eq!(
        f.error,
        Some(u64::from(pf::WRITE)),
        "not present, write, supervisor"
    );
    assert_eq!(f.rsp, UNMAPPED + 8, "RSP as before the instruction");
    assert_eq!(r.get(Gpr::Rsp), IST1 - 48, "delivered on IST1");
}

#[test]
fn test_pushfq_at_cpl3_onto_a_supervisor_page_is_pf_present_write_user() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    to_user(&mut v, &mut r);
    r.set(Gpr::Rsp, KDATA_PAGE + 0x100);
    let e = run(&mut v, PUSHFQ, &mut r);
    assert_eq!(v.cr2, KDATA_PAGE + 0xf8);
    assert_eq!(
        frame(&v, &r, true).error,
        Some(u64::from(pf::PRESENT | pf::WRITE | pf::USER))
    );
    assert!(matches!(e, Emulation::Switch { next, .. } if next == GuestVirt(handler(14))));
}

#[test]
fn test_popfq_at_cpl0_loads_if_iopl_and_arithmetic_flags() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    r.set(Gpr::Rsp, KSTACK - 8);
    v.mem.poke_u64(
        KSTACK - 8,
        rflags::FIXED | rflags::CF | rflags::DF | (3 << 12),
    );
    assert_eq!(run(&mut v, POPFQ, &mut r), after(POPFQ));
    assert!(!v.vif, "IF = 0 popped");
    assert_eq!(v.iopl, 3);
    assert_eq!(r.get(Gpr::Rsp), KSTACK);
    assert_eq!(
        r.rflags,
        rflags::FIXED | rflags::CF | rflags::DF | rflags::IF,
        "the real IF stays 1 and the real IOPL 0"
    );
}

#[test]
fn test_popfq_at_cpl3_silently_keeps_if_and_iopl() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    to_user(&mut v, &mut r);
    let rsp = r.get(Gpr::Rsp);
    v.mem.poke_u64(rsp, rflags::FIXED | (3 << 12));
    assert_eq!(run(&mut v, POPFQ, &mut r), after(POPFQ));
    assert!(v.vif, "IF unchanged at CPL > IOPL");
    assert_eq!(v.iopl, 0, "IOPL unchanged at CPL > 0");
}

#[test]
fn test_popfq_setting_tf_keeps_it_virtual_and_switches_to_the_stepping_mode() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    r.set(Gpr::Rsp, KSTACK - 8);
    v.mem
        .poke_u64(KSTACK - 8, rflags::FIXED | rflags::TF | rflags::IF);
    assert_eq!(
        run(&mut v, POPFQ, &mut r),
        Emulation::Switch {
            next: GuestVirt(PC + 1),
            mode: crate::vcpu::MODE_KERNEL.stepping(),
            invalidate_mappings: false
        }
    );
    assert_eq!(r.rflags & rflags::TF, 0, "never in the real RFLAGS");
    assert!(v.tf);
    assert_ne!(v.rflags_image(r.rflags) & rflags::TF, 0, "pushf sees it");
    // Cleared again: back to the ordinary mode.
    r.set(Gpr::Rsp, KSTACK - 8);
    v.mem.poke_u64(KSTACK - 8, rflags::FIXED | rflags::IF);
    assert_eq!(
        run(&mut v, POPFQ, &mut r),
        Emulation::Switch {
            next: GuestVirt(PC + 1),
            mode: crate::vcpu::MODE_KERNEL,
            invalidate_mappings: false
        }
    );
    assert!(!v.tf);
}

#[test]
fn test_popfq_from_an_unmapped_stack_is_pf_read() {
    let b = block();
    let mut v = vcpu(&b);
    use_ist1(&mut v, 14);
    let mut r = kregs();
    r.set(Gpr::Rsp, UNMAPPED);
    let e = run(&mut v, POPFQ, &mut r);
    assert_eq!(e, Emulation::Continue(GuestVirt(handler(14))));
    assert_eq!(
        frame(&v, &r, true).error,
        Some(0),
        "not present, read, supervisor"
    );
    assert_eq!(v.cr2, UNMAPPED);
}

#[test]
fn test_single_step_delivers_db_with_bs_as_a_trap_and_clears_tf() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    to_user(&mut v, &mut r);
    v.tf = true;
    assert_eq!(v.mode(), crate::vcpu::MODE_USER.stepping());
    let before = r;
    let handler = v
        .after_instruction(true, &before, PC, &[0x90], &mut r, PC + 3)
        .expect("a trap")
        .expect("delivered");
    assert_eq!(handler, super::handler(1));
    let f = frame(&v, &r, false);
    assert_eq!(f.rip, PC + 3, "RIP after the instruction");
    assert_ne!(
        f.rflags & rflags::TF,
        0,
        "the frame keeps TF for the return"
    );
    assert!(!v.tf, "the handler runs without TF");
    assert_eq!(v.mode(), crate::vcpu::MODE_KERNEL);
    assert_ne!(v.dr6 & (1 << 14), 0, "DR6.BS");
}
