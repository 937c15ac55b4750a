//! `rdmsr`, `wrmsr` and the virtual MSR file.

use super::*;
use kpin_abi::x86::msr;

const RDMSR: &[u8] = &[0x0f, 0x32];
const WRMSR: &[u8] = &[0x0f, 0x30];

fn msr_regs(index: u32, value: u64) -> GuestRegs {
    let mut r = kregs();
    r.set(Gpr::Rcx, u64::from(index));
    r.set(Gpr::Rax, value & 0xffff_ffff);
    r.set(Gpr::Rdx, value >> 32);
    r
}

fn read(v: &mut V<'_>, index: u32) -> u64 {
    let mut r = msr_regs(index, 0);
    assert_eq!(run(v, RDMSR, &mut r), after(RDMSR));
    (r.get(Gpr::Rdx) << 32) | r.get(Gpr::Rax)
}

#[test]
fn test_rdmsr_reads_the_virtual_lstar_split_into_edx_eax() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = msr_regs(msr::LSTAR, 0);
    assert_eq!(run(&mut v, RDMSR, &mut r), after(RDMSR));
    assert_eq!(r.get(Gpr::Rax), 0x8100_0000);
    assert_eq!(r.get(Gpr::Rdx), 0xffff_ffff);
}

#[test]
fn test_wrmsr_then_rdmsr_round_trips_star() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = msr_regs(msr::STAR, 0x0033_0008_0000_0000);
    assert_eq!(run(&mut v, WRMSR, &mut r), after(WRMSR));
    assert_eq!(read(&mut v, msr::STAR), 0x0033_0008_0000_0000);
    assert!(v.hw.wrmsrs.is_empty(), "virtual, not the hardware's");
}

#[test]
fn test_rdmsr_of_an_index_kvm_lacks_is_gp0_and_logged_once() {
    let b = block();
    let mut v = vcpu(&b);
    for _ in 0..2 {
        let mut r = msr_regs(0x1234, 0);
        let e = run(&mut v, RDMSR, &mut r);
        assert_eq!(e, Emulation::Continue(GuestVirt(handler(13))));
    }
    assert_eq!(v.stats.exceptions[13], 2);
    assert_eq!(v.hw.log.len(), 1);
}

#[test]
fn test_rdmsr_of_an_index_the_vcpu_does_not_keep_reads_kvm() {
    let b = block();
    let mut v = vcpu(&b);
    v.hw.host_msrs.insert(0xfe, 0x508);
    assert_eq!(read(&mut v, 0xfe), 0x508);
}

#[test]
fn test_rdmsr_of_the_tsc_reads_the_hardware_tsc() {
    let b = block();
    let mut v = vcpu(&b);
    v.hw.tsc = 0x55_0000_0001;
    assert_eq!(read(&mut v, msr::TSC), 0x55_0000_0001);
}

#[test]
fn test_rdmsr_and_wrmsr_at_cpl3_are_gp0() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = msr_regs(msr::LSTAR, 0);
    to_user(&mut v, &mut r);
    let e = run(&mut v, RDMSR, &mut r);
    assert_user_fault(&v, e, &r, 13, Some(0));
    let mut v = vcpu(&b);
    let mut r = msr_regs(msr::LSTAR, 0);
    to_user(&mut v, &mut r);
    let e = run(&mut v, WRMSR, &mut r);
    assert_user_fault(&v, e, &r, 13, Some(0));
    assert_eq!(v.msrs.lstar, 0xffff_ffff_8100_0000);
}

#[test]
fn test_wrmsr_efer_changing_a_reserved_bit_or_lme_is_gp0() {
    let b = block();
    for bad in [b.sregs.efer | 1 << 1, b.sregs.efer & !efer::LME] {
        let mut v = vcpu(&b);
        let mut r = msr_regs(msr::EFER, bad);
        let e = run(&mut v, WRMSR, &mut r);
        assert_gp0(&v, e, &r);
        assert_eq!(v.msrs.efer, b.sregs.efer);
    }
}

#[test]
fn test_wrmsr_efer_nxe_reaches_the_shadow_mmu() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = msr_regs(msr::EFER, b.sregs.efer & !efer::NXE);
    assert_eq!(run(&mut v, WRMSR, &mut r), after(WRMSR));
    assert!(!v.mem.control.expect("control").nxe);
}

#[test]
fn test_wrmsr_of_a_non_canonical_lstar_is_gp0() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = msr_regs(msr::LSTAR, 0x8000_0000_0000_0000);
    let e = run(&mut v, WRMSR, &mut r);
    assert_gp0(&v, e, &r);
}

#[test]
fn test_wrmsr_fs_and_gs_base_set_the_segment_and_hardware_bases() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = msr_regs(msr::FS_BASE, 0x7fff_0000_1000);
    assert_eq!(run(&mut v, WRMSR, &mut r), after(WRMSR));
    let mut r = msr_regs(msr::GS_BASE, 0xffff_8880_1000_0000);
    assert_eq!(run(&mut v, WRMSR, &mut r), after(WRMSR));
    assert_eq!(v.hw.fs_base, 0x7fff_0000_1000);
    assert_eq!(v.hw.gs_base, 0xffff_8880_1000_0000);
    assert_eq!(read(&mut v, msr::FS_BASE), 0x7fff_0000_1000);
}

#[test]
fn test_wrmsr_apic_base_keeping_the_page_passes_through_and_moving_it_stops() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = msr_regs(msr::APIC_BASE, 0xfee0_0900);
    assert_eq!(run(&mut v, WRMSR, &mut r), after(WRMSR));
    assert_eq!(v.hw.wrmsrs, [(msr::APIC_BASE, 0xfee0_0900)]);
    let mut r = msr_regs(msr::APIC_BASE, 0xfed0_0900);
    assert_eq!(run(&mut v, WRMSR, &mut r), Emulation::Stop);
    assert!(matches!(stop(&mut v), VcpuStop::Unsupported { .. }));
    assert_eq!(v.hw.wrmsrs.len(), 1);
}

#[test]
fn test_wrmsr_misc_features_accepts_only_cpuid_faulting() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = msr_regs(msr::MISC_FEATURES_ENABLES, 1);
    assert_eq!(run(&mut v, WRMSR, &mut r), after(WRMSR));
    assert_eq!(v.msrs.misc_features, 1);
    let mut r = msr_regs(msr::MISC_FEATURES_ENABLES, 2);
    let e = run(&mut v, WRMSR, &mut r);
    assert_gp0(&v, e, &r);
}

#[test]
fn test_arch_capabilities_reads_the_attach_block_value_and_writes_are_gp0() {
    let mut b = block();
    let n = b.msr_count as usize;
    b.msrs[n].index = msr::ARCH_CAPABILITIES;
    b.msrs[n].value = 0x2_0c6b;
    b.msr_count += 1;
    let mut v = vcpu(&b);
    assert_eq!(read(&mut v, msr::ARCH_CAPABILITIES), 0x2_0c6b);
    let mut r = msr_regs(msr::ARCH_CAPABILITIES, 0);
    let e = run(&mut v, WRMSR, &mut r);
    assert_gp0(&v, e, &r);
}

#[test]
fn test_writes_kvm_drops_are_dropped_without_a_fault() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = msr_regs(0xc001_001f, 1 << 46); // AMD NB_CFG
    assert_eq!(run(&mut v, WRMSR, &mut r), after(WRMSR));
    assert!(v.hw.wrmsrs.is_empty());
}

/// Every MSR the virtual CPU passes through to KVM, with every CPUID feature that enables
/// one offered, is one the ring-0 gate lets WRMSR write (`msr::GATE_WRITABLE`); the
/// engine's own MSRs are not.
#[test]
fn test_every_pass_through_msr_is_one_the_gate_writes() {
    let mut b = block();
    let n = b.cpuid_count as usize;
    let kvm = u32::from_le_bytes(*b"KVMK");
    let vmkv = u32::from_le_bytes(*b"VMKV");
    let m = u32::from_le_bytes(*b"M\0\0\0");
    b.cpuid[n] = cpuid_entry(0x4000_0000, [0x4000_0001, kvm, vmkv, m], false);
    b.cpuid[n + 1] = cpuid_entry(0x4000_0001, [u32::MAX, 0, 0, 0], false);
    b.cpuid_count += 2;
    for e in b.cpuid.iter_mut().take(n) {
        match e.function {
            1 => e.ecx |= 1 << 21,
            7 => e.ebx |= 1 << 1,
            _ => {}
        }
    }
    let file = crate::vcpu::MsrFile::new(&b);
    let candidates = (0..0x2000)
        .chain(0xc000_0000..0xc000_2000)
        .chain(0x4b56_4d00..0x4b56_4e00);
    let mut passed = 0;
    for i in candidates {
        if file.passes_through(i) {
            passed += 1;
            assert!(
                msr::gate_writable(i),
                "{i:#x} passes through, the gate refuses it"
            );
        }
    }
    // The microcode signature, APIC base, TSC_ADJUST, TSC_DEADLINE, 256 x2APIC registers,
    // two old and two new kvm-clock MSRs, steal time, PV EOI, poll control.
    assert_eq!(passed, 4 + 256 + 2 + 2 + 3);
    for i in [msr::FS_BASE, msr::GS_BASE, msr::KERNEL_GS_BASE] {
        assert!(msr::gate_writable(i), "{i:#x}");
    }
    for i in [
        msr::EFER,
        msr::STAR,
        msr::LSTAR,
        msr::SFMASK,
        msr::PAT,
        msr::TSC,
        msr::TSC_AUX,
        msr::SYSENTER_EIP,
        msr::MISC_ENABLE,
        0x4b56_4d02,
    ] {
        assert!(!msr::gate_writable(i), "{i:#x}");
    }
}
