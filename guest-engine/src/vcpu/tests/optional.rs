//! Instructions that follow a CPUID feature, a control bit or the vendor (`optional.rs`),
//! and the rule that no CPL-3 instruction stops the run (`emulate.rs`). Expected outcomes
//! from the SDM's and AMD APM's instruction pages.

use super::*;

/// `rdpmc`: with CR4.PCE allowed at CPL 3, but counters are not virtualized.
const NOT_MODELLED: &[u8] = &[0x0f, 0x33];
const SYSENTER: &[u8] = &[0x0f, 0x34];
const SYSEXIT: &[u8] = &[0x0f, 0x35];
const INT1: &[u8] = &[0xf1];
const RDPMC: &[u8] = &[0x0f, 0x33];
const RDPKRU: &[u8] = &[0x0f, 0x01, 0xee];
const MONITOR: &[u8] = &[0x0f, 0x01, 0xc8];
const MWAITX: &[u8] = &[0x0f, 0x01, 0xfb];
const XBEGIN: &[u8] = &[0xc7, 0xf8, 0x10, 0, 0, 0]; // xbegin .+0x16
const XEND: &[u8] = &[0x0f, 0x01, 0xd5];
const XTEST: &[u8] = &[0x0f, 0x01, 0xd6];
const XABORT: &[u8] = &[0xc6, 0xf8, 0x01];
const CLAC: &[u8] = &[0x0f, 0x01, 0xca];
const STAC: &[u8] = &[0x0f, 0x01, 0xcb];
const XSAVES: &[u8] = &[0x48, 0x0f, 0xc7, 0x28]; // xsaves64 [rax]
const INVPCID: &[u8] = &[0x66, 0x0f, 0x38, 0x82, 0x08]; // invpcid rcx, [rax]
const VMCALL: &[u8] = &[0x0f, 0x01, 0xc1];
const VMMCALL: &[u8] = &[0x0f, 0x01, 0xd9];
/// Never enabled by the virtual CPU: vmfunc, vmxon [rax], vmrun, stgi, skinit, getsec,
/// encls, enclu, rsm, uiret.
const NEVER_ENABLED: &[&[u8]] = &[
    &[0x0f, 0x01, 0xd4],
    &[0xf3, 0x0f, 0xc7, 0x30],
    &[0x0f, 0x01, 0xd8],
    &[0x0f, 0x01, 0xdc],
    &[0x0f, 0x01, 0xde],
    &[0x0f, 0x37],
    &[0x0f, 0x01, 0xcf],
    &[0x0f, 0x01, 0xd7],
    &[0x0f, 0xaa],
    &[0xf3, 0x0f, 0x01, 0xec],
];

/// Makes the block's CPU an Intel one ("GenuineIntel").
fn intel(b: &mut AttachBlock) {
    b.cpuid[0].ebx = u32::from_le_bytes(*b"Genu");
    b.cpuid[0].edx = u32::from_le_bytes(*b"ineI");
    b.cpuid[0].ecx = u32::from_le_bytes(*b"ntel");
}

/// Sets bit `bit` of register `reg` (0 EAX … 3 EDX) of CPUID leaf `leaf` in the block.
fn offer(b: &mut AttachBlock, leaf: u32, reg: usize, bit: u32) {
    let n = b.cpuid_count as usize;
    let e = b.cpuid[..n]
        .iter_mut()
        .find(|e| e.function == leaf)
        .expect("the leaf is in the block");
    *[&mut e.eax, &mut e.ebx, &mut e.ecx, &mut e.edx][reg] |= 1 << bit;
}

/// Sets CPUID 7.0 EBX bit `bit` in the block.
fn offer_leaf7_ebx(b: &mut AttachBlock, bit: u32) {
    offer(b, 7, 1, bit);
}

#[test]
fn test_an_instruction_not_modelled_is_ud_at_cpl3_logged_once() {
    // (At CPL 0 it stops the run: misc.rs.)
    let b = block();
    let mut v = vcpu(&b);
    v.cr4 |= kpin_abi::x86::cr4::PCE;
    let mut r = kregs();
    to_user(&mut v, &mut r);
    let e = run(&mut v, NOT_MODELLED, &mut r);
    assert_user_fault(&v, e, &r, 6, None);
    assert_eq!(v.stats.user_unsupported, 1);
    assert_eq!(v.hw.log.len(), 1, "{:?}", v.hw.log);
    assert!(v.hw.log[0].contains("raises #UD"), "{:?}", v.hw.log);
    // Logged once per mnemonic.
    let mut v2 = vcpu(&b);
    v2.cr4 |= kpin_abi::x86::cr4::PCE;
    let mut r2 = kregs();
    to_user(&mut v2, &mut r2);
    for _ in 0..3 {
        let mut r3 = r2;
        run(&mut v2, NOT_MODELLED, &mut r3);
        to_user(&mut v2, &mut r2);
    }
    assert_eq!(v2.stats.user_unsupported, 3);
    assert_eq!(v2.hw.log.len(), 1);
}

#[test]
fn test_on_amd_sysenter_is_ud_and_sysexit_is_gp0_at_cpl3_and_ud_at_cpl0() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    to_user(&mut v, &mut r);
    let e = run(&mut v, SYSENTER, &mut r);
    assert_user_fault(&v, e, &r, 6, None);
    let mut v = vcpu(&b);
    let mut r = kregs();
    to_user(&mut v, &mut r);
    let e = run(&mut v, SYSEXIT, &mut r);
    assert_user_fault(&v, e, &r, 13, Some(0));
    let mut v = vcpu(&b);
    let mut r = kregs();
    let e = run(&mut v, SYSEXIT, &mut r);
    assert_ud(&v, e, &r);
}

#[test]
fn test_amds_lock_mov_cr0_is_mov_cr8_where_cpuid_says_so() {
    let mut b = block();
    let lock_mov_eax_cr0 = [0xf0, 0x0f, 0x20, 0xc0];
    let mut v = vcpu(&b);
    let mut r = kregs();
    to_user(&mut v, &mut r);
    let e = run(&mut v, &lock_mov_eax_cr0, &mut r);
    assert_user_fault(&v, e, &r, 6, None);
    offer(&mut b, 0x8000_0001, 2, 4);
    let mut v = vcpu(&b);
    let mut r = kregs();
    to_user(&mut v, &mut r);
    let e = run(&mut v, &lock_mov_eax_cr0, &mut r);
    assert_user_fault(&v, e, &r, 13, Some(0));
}

#[test]
fn test_sysenter_on_intel_enters_cpl0_at_sysenter_eip_and_esp() {
    let mut b = block();
    intel(&mut b);
    let mut v = vcpu(&b);
    let mut r = kregs();
    to_user(&mut v, &mut r);
    r.set(Gpr::Rcx, 0x77);
    v.msrs.sysenter = [u64::from(KCODE), KSTACK - 0x100, 0xffff_ffff_8123_4560];
    assert_eq!(
        run(&mut v, SYSENTER, &mut r),
        Emulation::Switch {
            next: GuestVirt(0xffff_ffff_8123_4560),
            mode: crate::vcpu::MODE_KERNEL,
            invalidate_mappings: false
        }
    );
    assert_eq!(v.cpl(), 0);
    assert_eq!(r.get(Gpr::Rsp), KSTACK - 0x100);
    assert_eq!(r.get(Gpr::Rcx), 0x77, "sysenter saves nothing");
    assert!(!v.vif, "IF cleared");
    assert_eq!(v.segs.sregs[crate::vcpu::Sreg::Cs as usize].selector, KCODE);
    assert_eq!(
        v.segs.sregs[crate::vcpu::Sreg::Ss as usize].selector,
        KCODE + 8
    );
    assert_eq!(v.segs.sregs[crate::vcpu::Sreg::Cs as usize].l, 1);
}

#[test]
fn test_sysenter_on_intel_with_a_null_sysenter_cs_and_sysexit_at_cpl3_are_gp0() {
    let mut b = block();
    intel(&mut b);
    for insn in [SYSENTER, SYSEXIT] {
        let mut v = vcpu(&b);
        let mut r = kregs();
        to_user(&mut v, &mut r);
        v.msrs.sysenter = [0, 0, 0];
        if insn == SYSEXIT {
            v.msrs.sysenter[0] = u64::from(KCODE);
        }
        let e = run(&mut v, insn, &mut r);
        assert_user_fault(&v, e, &r, 13, Some(0));
    }
}

#[test]
fn test_int1_delivers_db_as_a_trap_past_a_dpl0_gate() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    to_user(&mut v, &mut r);
    let e = run(&mut v, INT1, &mut r);
    assert_eq!(
        e,
        Emulation::Switch {
            next: GuestVirt(handler(1)),
            mode: crate::vcpu::MODE_KERNEL,
            invalidate_mappings: false
        }
    );
    let f = frame(&v, &r, false);
    assert_eq!(f.rip, PC + 1, "a trap returns after the instruction");
    assert_eq!(f.cs, u64::from(UCODE));
    assert_eq!(v.stats.exceptions[1], 1);
}

#[test]
fn test_rdpmc_is_gp0_at_cpl3_without_cr4_pce() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    to_user(&mut v, &mut r);
    let e = run(&mut v, RDPMC, &mut r);
    assert_user_fault(&v, e, &r, 13, Some(0));
}

#[test]
fn test_rdpkru_without_cr4_pke_and_monitor_at_cpl3_are_ud() {
    let b = block();
    for insn in [RDPKRU, MONITOR] {
        let mut v = vcpu(&b);
        let mut r = kregs();
        to_user(&mut v, &mut r);
        let e = run(&mut v, insn, &mut r);
        assert_user_fault(&v, e, &r, 6, None);
    }
}

#[test]
fn test_mwaitx_returns_at_once_on_amd_and_is_ud_elsewhere_without_monitorx() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    to_user(&mut v, &mut r);
    assert_eq!(run(&mut v, MWAITX, &mut r), after(MWAITX), "AMD runs it");
    let mut b = block();
    intel(&mut b);
    let mut v = vcpu(&b);
    let mut r = kregs();
    to_user(&mut v, &mut r);
    let e = run(&mut v, MWAITX, &mut r);
    assert_user_fault(&v, e, &r, 6, None);
    offer(&mut b, 0x8000_0001, 2, 29);
    let mut v = vcpu(&b);
    let mut r = kregs();
    to_user(&mut v, &mut r);
    assert_eq!(run(&mut v, MWAITX, &mut r), after(MWAITX));
}

#[test]
fn test_tsx_is_ud_without_rtm() {
    let b = block();
    for insn in [XBEGIN, XEND, XTEST, XABORT] {
        let mut v = vcpu(&b);
        let mut r = kregs();
        to_user(&mut v, &mut r);
        let e = run(&mut v, insn, &mut r);
        assert_user_fault(&v, e, &r, 6, None);
    }
}

#[test]
fn test_with_rtm_xbegin_aborts_to_its_fallback_and_xend_outside_a_transaction_is_gp0() {
    let mut b = block();
    offer_leaf7_ebx(&mut b, 11);
    let mut v = vcpu(&b);
    let mut r = kregs();
    to_user(&mut v, &mut r);
    r.set(Gpr::Rax, 0xdead_beef_1234_5678);
    assert_eq!(
        run(&mut v, XBEGIN, &mut r),
        Emulation::Continue(GuestVirt(PC + 6 + 0x10))
    );
    assert_eq!(
        r.get(Gpr::Rax),
        0xdead_beef_0000_0000,
        "EAX = abort status 0"
    );
    assert_eq!(
        run(&mut v, XABORT, &mut r),
        after(XABORT),
        "nothing to abort"
    );
    r.rflags |= rflags::CF;
    assert_eq!(run(&mut v, XTEST, &mut r), after(XTEST));
    assert_eq!(
        r.rflags & rflags::STATUS,
        rflags::ZF,
        "ZF = 1: not in a transaction"
    );
    let e = run(&mut v, XEND, &mut r);
    assert_user_fault(&v, e, &r, 13, Some(0));
}

#[test]
fn test_clac_and_stac_are_ud_at_cpl3_and_toggle_ac_at_cpl0_with_smap() {
    let mut b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    let e = run(&mut v, STAC, &mut r);
    assert_ud(&v, e, &r);
    offer_leaf7_ebx(&mut b, 20);
    let mut v = vcpu(&b);
    let mut r = kregs();
    assert_eq!(run(&mut v, STAC, &mut r), after(STAC));
    assert_ne!(r.rflags & rflags::AC, 0);
    assert_eq!(run(&mut v, CLAC, &mut r), after(CLAC));
    assert_eq!(r.rflags & rflags::AC, 0);
    to_user(&mut v, &mut r);
    let e = run(&mut v, CLAC, &mut r);
    assert_user_fault(&v, e, &r, 6, None);
}

#[test]
fn test_xsaves_and_invpcid_are_ud_without_their_feature_and_gp0_at_cpl3_with_it() {
    let mut b = block();
    for insn in [XSAVES, INVPCID] {
        let mut v = vcpu(&b);
        let mut r = kregs();
        to_user(&mut v, &mut r);
        let e = run(&mut v, insn, &mut r);
        assert_user_fault(&v, e, &r, 6, None);
    }
    offer_leaf7_ebx(&mut b, 10);
    let mut v = vcpu(&b);
    let mut r = kregs();
    to_user(&mut v, &mut r);
    let e = run(&mut v, INVPCID, &mut r);
    assert_user_fault(&v, e, &r, 13, Some(0));
}

#[test]
fn test_facilities_never_enabled_are_ud_at_every_cpl() {
    let b = block();
    for insn in NEVER_ENABLED {
        let mut v = vcpu(&b);
        let mut r = kregs();
        let e = run(&mut v, insn, &mut r);
        assert_ud(&v, e, &r);
        let mut v = vcpu(&b);
        let mut r = kregs();
        to_user(&mut v, &mut r);
        let e = run(&mut v, insn, &mut r);
        assert_user_fault(&v, e, &r, 6, None);
        assert_eq!(v.stats.user_unsupported, 0, "{insn:02x?} is modelled");
    }
}

#[test]
fn test_the_vendors_hypercall_at_cpl3_gets_kvm_eperm_and_the_other_vendors_is_gp0() {
    let amd = block();
    let mut intel_block = block();
    intel(&mut intel_block);
    // (block, its hypercall, the other vendor's)
    for (b, native, other) in [(&amd, VMMCALL, VMCALL), (&intel_block, VMCALL, VMMCALL)] {
        let mut v = vcpu(b);
        let mut r = kregs();
        to_user(&mut v, &mut r);
        r.set(Gpr::Rax, 9);
        assert_eq!(run(&mut v, native, &mut r), after(native));
        assert_eq!(r.get(Gpr::Rax), u64::MAX, "RAX = -KVM_EPERM");
        let e = run(&mut v, other, &mut r);
        assert_user_fault(&v, e, &r, 13, Some(0));
        // At CPL 0 the hypercall is not forwarded: the run stops; the other one is #UD.
        let mut v = vcpu(b);
        let mut r = kregs();
        assert_eq!(run(&mut v, native, &mut r), Emulation::Stop);
        let mut v = vcpu(b);
        let mut r = kregs();
        let e = run(&mut v, other, &mut r);
        assert_ud(&v, e, &r);
    }
}

#[test]
fn test_serialize_is_ud_unless_cpuid_offers_it() {
    let mut b = block();
    let serialize: &[u8] = &[0x0f, 0x01, 0xe8];
    let mut v = vcpu(&b);
    let mut r = kregs();
    to_user(&mut v, &mut r);
    let e = run(&mut v, serialize, &mut r);
    assert_user_fault(&v, e, &r, 6, None);
    offer(&mut b, 7, 3, 14);
    let mut v = vcpu(&b);
    let mut r = kregs();
    to_user(&mut v, &mut r);
    assert_eq!(run(&mut v, serialize, &mut r), after(serialize));
}
