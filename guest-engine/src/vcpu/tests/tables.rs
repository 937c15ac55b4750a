//! `lgdt`, `lidt`, `sgdt`, `sidt`, `ltr`, `lldt`, `str`, `sldt`.

use super::*;

const LGDT_RAX: &[u8] = &[0x0f, 0x01, 0x10];
const LIDT_RAX: &[u8] = &[0x0f, 0x01, 0x18];
const SGDT_RAX: &[u8] = &[0x0f, 0x01, 0x00];
const SIDT_RAX: &[u8] = &[0x0f, 0x01, 0x08];
const LTR_AX: &[u8] = &[0x0f, 0x00, 0xd8];
const LLDT_AX: &[u8] = &[0x0f, 0x00, 0xd0];
const STR_EAX: &[u8] = &[0x0f, 0x00, 0xc8];
const SLDT_EAX: &[u8] = &[0x0f, 0x00, 0xc0];

fn with_rax(rax: u64) -> GuestRegs {
    let mut r = kregs();
    r.set(Gpr::Rax, rax);
    r
}

#[test]
fn test_lgdt_and_lidt_load_limit_and_base() {
    let b = block();
    let mut v = vcpu(&b);
    v.mem.poke(KDATA_PAGE, &0x1ffu16.to_le_bytes());
    v.mem.poke_u64(KDATA_PAGE + 2, 0xffff_8000_0000_9000);
    let mut r = with_rax(KDATA_PAGE);
    assert_eq!(run(&mut v, LGDT_RAX, &mut r), after(LGDT_RAX));
    assert_eq!(v.gdtr.limit, 0x1ff);
    assert_eq!(v.gdtr.base, 0xffff_8000_0000_9000);
    assert_eq!(run(&mut v, LIDT_RAX, &mut r), after(LIDT_RAX));
    assert_eq!(v.idtr.base, 0xffff_8000_0000_9000);
}

#[test]
fn test_lidt_from_an_unmapped_operand_is_pf_with_cr2() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = with_rax(UNMAPPED + 0x10);
    let e = run(&mut v, LIDT_RAX, &mut r);
    assert_fault(&v, e, &r, 14, Some(0));
    assert_eq!(v.cr2, UNMAPPED + 0x10);
    assert_eq!(v.idtr.base, IDT, "IDTR unchanged");
}

#[test]
fn test_lgdt_with_a_non_canonical_operand_is_gp0() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = with_rax(0x8000_0000_0000_0000);
    let e = run(&mut v, LGDT_RAX, &mut r);
    assert_gp0(&v, e, &r);
}

#[test]
fn test_lgdt_at_cpl3_is_gp0() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    to_user(&mut v, &mut r);
    r.set(Gpr::Rax, USER_PAGE);
    let e = run(&mut v, LGDT_RAX, &mut r);
    assert_user_fault(&v, e, &r, 13, Some(0));
    assert_eq!(v.gdtr.base, GDT);
}

#[test]
fn test_sgdt_stores_limit_then_base() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = with_rax(KDATA_PAGE + 6);
    assert_eq!(run(&mut v, SGDT_RAX, &mut r), after(SGDT_RAX));
    let mut out = [0u8; 10];
    v.mem.peek(KDATA_PAGE + 6, &mut out);
    assert_eq!(u16::from_le_bytes([out[0], out[1]]), GDT_LIMIT);
    assert_eq!(
        u64::from_le_bytes(out[2..].try_into().expect("8 bytes")),
        GDT
    );
}

#[test]
fn test_sgdt_to_a_read_only_page_is_pf_present_write() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = with_rax(RO_PAGE + 0x20);
    let e = run(&mut v, SGDT_RAX, &mut r);
    assert_fault(&v, e, &r, 14, Some(u64::from(pf::PRESENT | pf::WRITE)));
    assert_eq!(v.cr2, RO_PAGE + 0x20);
}

#[test]
fn test_sidt_at_cpl3_works_without_umip_and_is_gp0_with_it() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    to_user(&mut v, &mut r);
    r.set(Gpr::Rax, USER_PAGE);
    assert_eq!(run(&mut v, SIDT_RAX, &mut r), after(SIDT_RAX));
    assert_eq!(v.mem.peek_u64(USER_PAGE + 2), IDT);
    v.cr4 |= cr4::UMIP;
    v.mem.poke_u64(USER_PAGE + 2, 0);
    let e = run(&mut v, SIDT_RAX, &mut r);
    assert_user_fault(&v, e, &r, 13, Some(0));
    assert_eq!(v.mem.peek_u64(USER_PAGE + 2), 0, "nothing stored");
}

#[test]
fn test_ltr_loads_the_tss_and_marks_it_busy() {
    let b = block();
    let mut v = vcpu(&b);
    v.segs.tr = Segment::default();
    let mut r = with_rax(u64::from(TSS_SEL));
    assert_eq!(run(&mut v, LTR_AX, &mut r), after(LTR_AX));
    assert_eq!(v.segs.tr.selector, TSS_SEL);
    assert_eq!(v.segs.tr.base, TSS);
    assert_eq!(v.segs.tr.limit, 0x67);
    assert_eq!(v.segs.tr.type_, 0xb);
    let mut ty = [0u8];
    v.mem.peek(GDT + u64::from(TSS_SEL) + 5, &mut ty);
    assert_eq!(ty[0] & 0xf, 0xb, "busy in the guest's GDT");
}

#[test]
fn test_ltr_of_a_busy_tss_is_gp_with_the_selector() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = with_rax(u64::from(TSS_SEL));
    assert_eq!(run(&mut v, LTR_AX, &mut r), after(LTR_AX));
    let e = run(&mut v, LTR_AX, &mut r);
    assert_fault(&v, e, &r, 13, Some(u64::from(TSS_SEL)));
}

#[test]
fn test_ltr_of_a_null_selector_is_gp0() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = with_rax(3);
    let e = run(&mut v, LTR_AX, &mut r);
    assert_gp0(&v, e, &r);
}

#[test]
fn test_ltr_of_an_ldt_selector_or_beyond_the_limit_is_gp_with_the_selector() {
    let b = block();
    for sel in [TSS_SEL | 4, 0x70, KDATA] {
        let mut v = vcpu(&b);
        let mut r = with_rax(u64::from(sel));
        let e = run(&mut v, LTR_AX, &mut r);
        assert_fault(&v, e, &r, 13, Some(u64::from(sel & 0xfffc)));
    }
}

#[test]
fn test_lldt_loads_a_64_bit_base_and_null_makes_it_unusable() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = with_rax(u64::from(LDT_SEL));
    assert_eq!(run(&mut v, LLDT_AX, &mut r), after(LLDT_AX));
    assert_eq!(v.segs.ldtr.base, 0xffff_8000_0000_7000);
    assert_eq!(v.segs.ldtr.limit, 0xfff);
    r.set(Gpr::Rax, 0);
    assert_eq!(run(&mut v, LLDT_AX, &mut r), after(LLDT_AX));
    assert_eq!(v.segs.ldtr.unusable, 1);
}

#[test]
fn test_lldt_of_a_tss_descriptor_is_gp_with_the_selector() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = with_rax(u64::from(TSS_SEL));
    let e = run(&mut v, LLDT_AX, &mut r);
    assert_fault(&v, e, &r, 13, Some(u64::from(TSS_SEL)));
}

#[test]
fn test_str_and_sldt_store_the_selectors_zero_extended() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = with_rax(u64::MAX);
    assert_eq!(run(&mut v, STR_EAX, &mut r), after(STR_EAX));
    assert_eq!(r.get(Gpr::Rax), u64::from(TSS_SEL));
    r.set(Gpr::Rax, u64::MAX);
    assert_eq!(run(&mut v, SLDT_EAX, &mut r), after(SLDT_EAX));
    assert_eq!(r.get(Gpr::Rax), 0);
}
