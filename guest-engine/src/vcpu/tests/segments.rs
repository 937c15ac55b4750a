//! `mov sreg`, `mov r/m, sreg`, `push`/`pop fs`/`gs`, `retf`.

use super::*;
use crate::vcpu::Sreg;

const MOV_DS_AX: &[u8] = &[0x8e, 0xd8];
const MOV_SS_AX: &[u8] = &[0x8e, 0xd0];
const MOV_FS_AX: &[u8] = &[0x8e, 0xe0];
const MOV_CS_AX: &[u8] = &[0x8e, 0xc8];
const MOV_EAX_DS: &[u8] = &[0x8c, 0xd8];
const PUSH_FS: &[u8] = &[0x0f, 0xa0];
const POP_FS: &[u8] = &[0x0f, 0xa1];
const POP_GS: &[u8] = &[0x0f, 0xa9];
const RETFQ: &[u8] = &[0x48, 0xcb];
const RETFQ_16: &[u8] = &[0x48, 0xca, 0x10, 0x00];

fn with_rax(rax: u64) -> GuestRegs {
    let mut r = kregs();
    r.set(Gpr::Rax, rax);
    r
}

fn seg(v: &V<'_>, s: Sreg) -> Segment {
    v.segs.sregs[s as usize]
}

#[test]
fn test_mov_ds_loads_the_descriptor_and_sets_its_accessed_bit() {
    let b = block();
    let mut v = vcpu(&b);
    v.segs.sregs[Sreg::Ds as usize] = Segment::default();
    let mut r = with_rax(u64::from(KDATA));
    assert_eq!(run(&mut v, MOV_DS_AX, &mut r), after(MOV_DS_AX));
    let ds = seg(&v, Sreg::Ds);
    assert_eq!(
        (ds.selector, ds.present, ds.dpl, ds.type_),
        (KDATA, 1, 0, 0x3)
    );
    let mut ty = [0u8];
    v.mem.peek(GDT + u64::from(KDATA) + 5, &mut ty);
    assert_eq!(ty[0] & 1, 1, "accessed in the guest's GDT");
}

#[test]
fn test_mov_ds_null_makes_it_unusable() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = with_rax(0);
    assert_eq!(run(&mut v, MOV_DS_AX, &mut r), after(MOV_DS_AX));
    assert_eq!(seg(&v, Sreg::Ds).unusable, 1);
    assert_eq!(seg(&v, Sreg::Ds).selector, 0);
}

/// The block's CPU with `vendor` and CPUID 0x8000_0021 EAX = `eax`.
fn with_vendor(vendor: &[u8; 12], eax_8000_0021: u32) -> Box<AttachBlock> {
    let mut b = block();
    b.cpuid[0].ebx = u32::from_le_bytes(vendor[..4].try_into().unwrap());
    b.cpuid[0].edx = u32::from_le_bytes(vendor[4..8].try_into().unwrap());
    b.cpuid[0].ecx = u32::from_le_bytes(vendor[8..].try_into().unwrap());
    let n = b.cpuid_count as usize;
    b.cpuid[n] = CpuidEntry {
        function: 0x8000_0021,
        eax: eax_8000_0021,
        ..b.cpuid[n]
    };
    b.cpuid_count += 1;
    b
}

#[test]
fn test_a_null_fs_load_zeroes_the_base_on_intel_and_on_amd_with_null_select_clears_base() {
    // (vendor, CPUID 0x8000_0021 EAX, base cleared)
    let cases: [(&[u8; 12], u32, bool); 3] = [
        (b"GenuineIntel", 0, true),
        (b"AuthenticAMD", 1 << 6, true),
        (b"AuthenticAMD", 0, false),
    ];
    for (vendor, eax, cleared) in cases {
        let b = with_vendor(vendor, eax);
        let mut v = vcpu(&b);
        let mut r = with_rax(0);
        to_user(&mut v, &mut r);
        assert_eq!(run(&mut v, MOV_FS_AX, &mut r), after(MOV_FS_AX));
        let expect = if cleared { 0 } else { 0x7000_0000 };
        assert_eq!(seg(&v, Sreg::Fs).base, expect, "{vendor:?} {eax:#x}");
        assert_eq!(v.hw.fs_base, expect, "the hardware base follows");
    }
    // What the embedder measured on the hardware wins over CPUID (an AMD CPU that
    // zeroes the base with NullSelectClearsBase hidden).
    let b = with_vendor(b"AuthenticAMD", 0);
    let mut v = vcpu(&b);
    v.hw.null_clears = Some(true);
    let mut r = with_rax(0);
    to_user(&mut v, &mut r);
    assert_eq!(run(&mut v, MOV_FS_AX, &mut r), after(MOV_FS_AX));
    assert_eq!(seg(&v, Sreg::Fs).base, 0);
}

#[test]
fn test_mov_ss_null_at_cpl3_is_gp0() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    to_user(&mut v, &mut r);
    r.set(Gpr::Rax, 3);
    let e = run(&mut v, MOV_SS_AX, &mut r);
    assert_user_fault(&v, e, &r, 13, Some(0));
}

#[test]
fn test_mov_ss_null_with_rpl_equal_cpl0_is_allowed() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = with_rax(0);
    assert_eq!(run(&mut v, MOV_SS_AX, &mut r), after(MOV_SS_AX));
    assert_eq!(seg(&v, Sreg::Ss).unusable, 1);
}

#[test]
fn test_mov_ss_of_read_only_data_is_gp_with_the_selector() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = with_rax(u64::from(RO_DATA));
    let e = run(&mut v, MOV_SS_AX, &mut r);
    assert_fault(&v, e, &r, 13, Some(u64::from(RO_DATA)));
    assert_eq!(seg(&v, Sreg::Ss).selector, KDATA, "SS unchanged");
}

#[test]
fn test_mov_ss_not_present_is_ss_fault_and_mov_ds_is_np() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = with_rax(u64::from(NP_DATA));
    let e = run(&mut v, MOV_SS_AX, &mut r);
    assert_fault(&v, e, &r, 12, Some(u64::from(NP_DATA)));
    let mut v = vcpu(&b);
    let mut r = with_rax(u64::from(NP_DATA));
    let e = run(&mut v, MOV_DS_AX, &mut r);
    assert_fault(&v, e, &r, 11, Some(u64::from(NP_DATA)));
}

#[test]
fn test_mov_ds_of_execute_only_code_is_gp_with_the_selector() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = with_rax(u64::from(XO_CODE));
    let e = run(&mut v, MOV_DS_AX, &mut r);
    assert_fault(&v, e, &r, 13, Some(u64::from(XO_CODE)));
}

#[test]
fn test_mov_ds_of_a_dpl0_segment_at_cpl3_is_gp_with_the_selector() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    to_user(&mut v, &mut r);
    r.set(Gpr::Rax, u64::from(KDATA | 3));
    let e = run(&mut v, MOV_DS_AX, &mut r);
    assert_user_fault(&v, e, &r, 13, Some(u64::from(KDATA)));
}

#[test]
fn test_mov_ds_beyond_the_gdt_limit_is_gp_with_the_selector() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = with_rax(0x80);
    let e = run(&mut v, MOV_DS_AX, &mut r);
    assert_fault(&v, e, &r, 13, Some(0x80));
}

#[test]
fn test_mov_fs_with_a_based_segment_sets_the_hardware_base() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = with_rax(u64::from(BASED_DATA | 3));
    assert_eq!(run(&mut v, MOV_FS_AX, &mut r), after(MOV_FS_AX));
    assert_eq!(seg(&v, Sreg::Fs).base, 0x1234_5000);
    assert_eq!(v.hw.fs_base, 0x1234_5000);
}

#[test]
fn test_mov_cs_is_ud() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = with_rax(u64::from(KCODE));
    let e = run(&mut v, MOV_CS_AX, &mut r);
    assert_ud(&v, e, &r);
}

#[test]
fn test_mov_from_ds_to_a_32_bit_register_zero_extends() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = with_rax(u64::MAX);
    assert_eq!(run(&mut v, MOV_EAX_DS, &mut r), after(MOV_EAX_DS));
    assert_eq!(r.get(Gpr::Rax), u64::from(KDATA));
}

#[test]
fn test_push_fs_pushes_the_selector_and_pop_gs_loads_one() {
    let b = block();
    let mut v = vcpu(&b);
    v.segs.sregs[Sreg::Fs as usize].selector = 0x1b;
    let mut r = kregs();
    assert_eq!(run(&mut v, PUSH_FS, &mut r), after(PUSH_FS));
    assert_eq!(r.get(Gpr::Rsp), KSTACK - 8);
    assert_eq!(v.mem.peek_u64(KSTACK - 8), 0x1b);
    assert_eq!(run(&mut v, POP_GS, &mut r), after(POP_GS));
    assert_eq!(r.get(Gpr::Rsp), KSTACK);
    assert_eq!(seg(&v, Sreg::Gs).selector, UDATA);
    assert_eq!(v.hw.gs_base, 0, "the loaded descriptor's base");
}

#[test]
fn test_pop_fs_with_a_bad_selector_faults_with_rsp_unchanged() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    r.set(Gpr::Rsp, KSTACK - 8);
    v.mem.poke_u64(KSTACK - 8, u64::from(XO_CODE));
    let e = run(&mut v, POP_FS, &mut r);
    assert_fault(&v, e, &r, 13, Some(u64::from(XO_CODE)));
    assert_eq!(
        frame(&v, &r, true).rsp,
        KSTACK - 8,
        "the pop did not happen"
    );
}

fn far_frame(v: &mut V<'_>, rip: u64, cs: u16) -> GuestRegs {
    let mut r = kregs();
    r.set(Gpr::Rsp, KSTACK - 0x40);
    v.mem.poke_u64(KSTACK - 0x40, rip);
    v.mem.poke_u64(KSTACK - 0x38, u64::from(cs));
    r
}

#[test]
fn test_retfq_to_the_same_privilege_loads_cs_and_pops_the_immediate() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = far_frame(&mut v, 0xffff_8000_0000_1234, KCODE);
    assert_eq!(
        run(&mut v, RETFQ_16, &mut r),
        Emulation::Continue(GuestVirt(0xffff_8000_0000_1234))
    );
    assert_eq!(r.get(Gpr::Rsp), KSTACK - 0x40 + 16 + 0x10);
    assert_eq!(seg(&v, Sreg::Cs).selector, KCODE);
}

#[test]
fn test_retfq_to_an_outer_privilege_stops_unsupported() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = far_frame(&mut v, 0x40_0000, UCODE);
    assert_eq!(run(&mut v, RETFQ, &mut r), Emulation::Stop);
    assert!(matches!(stop(&mut v), VcpuStop::Unsupported { .. }));
}

#[test]
fn test_retfq_to_32_bit_code_stops_unsupported() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = far_frame(&mut v, 0x1000, CODE32);
    assert_eq!(run(&mut v, RETFQ, &mut r), Emulation::Stop);
    assert!(matches!(stop(&mut v), VcpuStop::Unsupported { .. }));
}

#[test]
fn test_retfq_to_a_null_selector_is_gp0_and_to_data_is_gp_selector() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = far_frame(&mut v, 0x1000, 0);
    let e = run(&mut v, RETFQ, &mut r);
    assert_gp0(&v, e, &r);
    let mut v = vcpu(&b);
    let mut r = far_frame(&mut v, 0x1000, KDATA);
    let e = run(&mut v, RETFQ, &mut r);
    assert_fault(&v, e, &r, 13, Some(u64::from(KDATA)));
}

#[test]
fn test_retfq_to_a_non_canonical_rip_is_gp0() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = far_frame(&mut v, 0x8000_0000_0000_0000, KCODE);
    let e = run(&mut v, RETFQ, &mut r);
    assert_gp0(&v, e, &r);
}
