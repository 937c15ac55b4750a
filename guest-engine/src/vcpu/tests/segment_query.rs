//! `lar`, `lsl`, `verr`, `verw` on the guest's virtual GDT. Expected access rights and
//! limits are worked out from the descriptors' fields as the SDM defines them.

use super::*;

/// `lar eax, cx`.
const LAR_EAX_CX: &[u8] = &[0x0f, 0x02, 0xc1];
/// `lar ax, cx`.
const LAR_AX_CX: &[u8] = &[0x66, 0x0f, 0x02, 0xc1];
/// `lar rax, rcx`.
const LAR_RAX_RCX: &[u8] = &[0x48, 0x0f, 0x02, 0xc1];
/// `lsl eax, ecx`.
const LSL_EAX_ECX: &[u8] = &[0x0f, 0x03, 0xc1];
/// `verr cx`.
const VERR_CX: &[u8] = &[0x0f, 0x00, 0xe1];
/// `verw cx`.
const VERW_CX: &[u8] = &[0x0f, 0x00, 0xe9];
/// `verw [rax]`.
const VERW_M_RAX: &[u8] = &[0x0f, 0x00, 0x28];

/// A slot past the test GDT's entries, for descriptors a test adds (16 bytes).
const EXTRA: u16 = 0x70;

/// Kernel registers with RAX = `rax`, RCX = `sel`, and CF set (no query may touch it).
fn regs(rax: u64, sel: u16) -> GuestRegs {
    let mut r = kregs();
    r.rflags |= rflags::CF;
    r.set(Gpr::Rax, rax);
    r.set(Gpr::Rcx, u64::from(sel));
    r
}

fn zf(r: &GuestRegs) -> bool {
    r.rflags & rflags::ZF != 0
}

/// Runs `bytes` and checks it continued after itself with CF untouched.
fn query(v: &mut V<'_>, bytes: &[u8], r: &mut GuestRegs) {
    assert_eq!(run(v, bytes, r), after(bytes));
    assert_ne!(r.rflags & rflags::CF, 0, "only ZF changes");
}

/// Adds a 16-byte descriptor at [`EXTRA`] and grows the GDT limit over it.
fn add_descriptor(v: &mut V<'_>, lo: u64, hi: u64) {
    v.mem.poke_u64(GDT + u64::from(EXTRA), lo);
    v.mem.poke_u64(GDT + u64::from(EXTRA) + 8, hi);
    v.gdtr.limit = EXTRA + 15;
}

#[test]
fn test_lar_of_kernel_code_sets_zf_and_returns_its_access_rights() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = regs(0xdead_beef_dead_beef, KCODE);
    query(&mut v, LAR_EAX_CX, &mut r);
    assert!(zf(&r));
    // Type 0xb (code, read, accessed), S, DPL 0, P; G and L: 0x00a0_9b00, zero-extended.
    assert_eq!(r.get(Gpr::Rax), 0x00a0_9b00);
    let mut r = regs(0xdead_beef_dead_beef, KDATA);
    query(&mut v, LAR_RAX_RCX, &mut r);
    // Type 3 (data, write, accessed), S, P; G and D/B.
    assert_eq!(r.get(Gpr::Rax), 0x00c0_9300);
}

#[test]
fn test_lar_with_a_16_bit_operand_writes_only_ax_with_the_type_byte() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = regs(0xdead_beef_dead_1234, UDATA);
    query(&mut v, LAR_AX_CX, &mut r);
    assert!(zf(&r));
    // DPL 3 data: 0xf300 in AX, the rest of RAX kept.
    assert_eq!(r.get(Gpr::Rax), 0xdead_beef_dead_f300);
}

#[test]
fn test_lar_clears_zf_and_keeps_the_destination_for_null_and_out_of_limit_selectors() {
    let b = block();
    let mut v = vcpu(&b);
    for sel in [0, 3, GDT_LIMIT + 1, 0xfff8] {
        let mut r = regs(0x1234, sel);
        r.rflags |= rflags::ZF;
        query(&mut v, LAR_EAX_CX, &mut r);
        assert!(!zf(&r), "selector {sel:#x}");
        assert_eq!(r.get(Gpr::Rax), 0x1234, "selector {sel:#x}");
    }
}

#[test]
fn test_lar_fails_when_dpl_is_below_cpl_or_rpl() {
    let b = block();
    let mut v = vcpu(&b);
    // RPL 3 on a DPL-0 data segment, at CPL 0.
    let mut r = regs(0x1234, KDATA | 3);
    query(&mut v, LAR_EAX_CX, &mut r);
    assert!(!zf(&r));
    assert_eq!(r.get(Gpr::Rax), 0x1234);
    // At CPL 3: kernel data fails, user data works.
    let mut r = regs(0, KDATA);
    to_user(&mut v, &mut r);
    query(&mut v, LAR_EAX_CX, &mut r);
    assert!(!zf(&r));
    r.set(Gpr::Rcx, u64::from(UDATA));
    query(&mut v, LAR_EAX_CX, &mut r);
    assert!(zf(&r));
    assert_eq!(r.get(Gpr::Rax), 0x00c0_f300);
}

#[test]
fn test_lar_of_conforming_code_skips_the_privilege_check() {
    let b = block();
    let mut v = vcpu(&b);
    // Conforming, readable, accessed code (type 0xf), DPL 0, 64-bit.
    add_descriptor(&mut v, seg_desc(0, 0xf, 0, true, true, false), 0);
    let mut r = regs(0, EXTRA | 3);
    to_user(&mut v, &mut r);
    query(&mut v, LAR_EAX_CX, &mut r);
    assert!(zf(&r));
    assert_eq!(r.get(Gpr::Rax), 0x00a0_9f00);
    query(&mut v, VERR_CX, &mut r);
    assert!(zf(&r), "conforming readable code is readable from CPL 3");
}

#[test]
fn test_lar_and_lsl_of_the_tss_and_ldt() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = regs(0, TSS_SEL);
    query(&mut v, LAR_EAX_CX, &mut r);
    assert!(zf(&r));
    // 64-bit TSS (available, type 9), system, DPL 0, P.
    assert_eq!(r.get(Gpr::Rax), 0x0000_8900);
    query(&mut v, LSL_EAX_ECX, &mut r);
    assert!(zf(&r));
    assert_eq!(r.get(Gpr::Rax), 0x67);
    let mut r = regs(0, LDT_SEL);
    query(&mut v, LSL_EAX_ECX, &mut r);
    assert!(zf(&r));
    assert_eq!(r.get(Gpr::Rax), 0xfff);
}

#[test]
fn test_a_call_gate_is_lar_only_and_an_interrupt_gate_neither() {
    let b = block();
    let mut v = vcpu(&b);
    let [lo, hi] = gate(0xffff_ffff_8100_0000, KCODE, 0, 0xc, 0, true);
    add_descriptor(&mut v, lo, hi);
    let mut r = regs(0x55, EXTRA);
    query(&mut v, LAR_EAX_CX, &mut r);
    assert!(zf(&r));
    assert_eq!(r.get(Gpr::Rax), 0x0000_8c00);
    let mut r = regs(0x55, EXTRA);
    query(&mut v, LSL_EAX_ECX, &mut r);
    assert!(!zf(&r), "lsl takes no gate");
    assert_eq!(r.get(Gpr::Rax), 0x55);
    let [lo, hi] = gate(0xffff_ffff_8100_0000, KCODE, 0, 0xe, 0, true);
    add_descriptor(&mut v, lo, hi);
    query(&mut v, LAR_EAX_CX, &mut r);
    assert!(
        !zf(&r),
        "an interrupt gate is not valid for lar in 64-bit mode"
    );
}

#[test]
fn test_a_16_byte_system_descriptor_must_fit_and_have_a_zero_upper_type() {
    let b = block();
    let mut v = vcpu(&b);
    let [lo, _] = sys_desc(TSS, 0x67, 9);
    // Upper half with a non-zero type field (bits 8-12 of its second dword).
    add_descriptor(&mut v, lo, 0x0000_0900_0000_0000);
    let mut r = regs(0, EXTRA);
    query(&mut v, LSL_EAX_ECX, &mut r);
    assert!(!zf(&r));
    // A correct upper half, but the table ends inside it.
    add_descriptor(&mut v, lo, 0);
    v.gdtr.limit = EXTRA + 7;
    query(&mut v, LSL_EAX_ECX, &mut r);
    assert!(!zf(&r));
    v.gdtr.limit = EXTRA + 15;
    query(&mut v, LSL_EAX_ECX, &mut r);
    assert!(zf(&r));
    assert_eq!(r.get(Gpr::Rax), 0x67);
}

#[test]
fn test_lsl_returns_the_byte_granular_limit() {
    let b = block();
    let mut v = vcpu(&b);
    // Limit 0xfffff with G = 1.
    let mut r = regs(0, KDATA);
    query(&mut v, LSL_EAX_ECX, &mut r);
    assert!(zf(&r));
    assert_eq!(r.get(Gpr::Rax), 0xffff_ffff);
}

#[test]
fn test_verr_and_verw_follow_readability_writability_and_type() {
    let b = block();
    let mut v = vcpu(&b);
    let cases: [(&[u8], u16, bool); 8] = [
        (VERR_CX, KCODE, true),
        (VERR_CX, XO_CODE, false),
        (VERR_CX, RO_DATA, true),
        (VERR_CX, TSS_SEL, false),
        (VERW_CX, KDATA, true),
        (VERW_CX, RO_DATA, false),
        (VERW_CX, KCODE, false),
        (VERW_CX, 0, false),
    ];
    for (insn, sel, want) in cases {
        let mut r = regs(0, sel);
        query(&mut v, insn, &mut r);
        assert_eq!(zf(&r), want, "{insn:02x?} of {sel:#x}");
    }
}

#[test]
fn test_verw_at_cpl3_sees_only_user_segments() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = regs(0, KDATA);
    to_user(&mut v, &mut r);
    query(&mut v, VERW_CX, &mut r);
    assert!(!zf(&r));
    r.set(Gpr::Rcx, u64::from(UDATA));
    query(&mut v, VERW_CX, &mut r);
    assert!(zf(&r));
}

#[test]
fn test_verw_of_a_memory_operand_reads_the_selector_and_faults_like_a_load() {
    let b = block();
    let mut v = vcpu(&b);
    // Linux's `verw mds_verw_sel`: the selector of kernel data, in memory.
    v.mem.poke(KDATA_PAGE, &KDATA.to_le_bytes());
    let mut r = regs(KDATA_PAGE, 0);
    query(&mut v, VERW_M_RAX, &mut r);
    assert!(zf(&r));
    let mut r = regs(UNMAPPED, 0);
    let e = run(&mut v, VERW_M_RAX, &mut r);
    assert_fault(&v, e, &r, 14, Some(0));
    assert_eq!(v.cr2, UNMAPPED);
}
