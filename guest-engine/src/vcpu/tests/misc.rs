//! `cpuid`, `wbinvd`/`invd`, `xgetbv`, `rdtscp`, `rdpid`, `hlt`, undecodable bytes.

use super::*;

const CPUID: &[u8] = &[0x0f, 0xa2];
const RDTSCP: &[u8] = &[0x0f, 0x01, 0xf9];
const RDPID_RAX: &[u8] = &[0xf3, 0x0f, 0xc7, 0xf8];
const XGETBV: &[u8] = &[0x0f, 0x01, 0xd0];
const WBINVD: &[u8] = &[0x0f, 0x09];
const HLT: &[u8] = &[0xf4];

#[test]
fn test_cpuid_answers_from_the_attach_block_table() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    r.set(Gpr::Rax, 7);
    r.set(Gpr::Rcx, 0);
    assert_eq!(run(&mut v, CPUID, &mut r), after(CPUID));
    assert_eq!(r.get(Gpr::Rbx), 1 | 1 << 7);
    assert_eq!(r.get(Gpr::Rcx), (1 << 2) | (1 << 22));
    r.set(Gpr::Rax, 7);
    r.set(Gpr::Rcx, 1);
    assert_eq!(run(&mut v, CPUID, &mut r), after(CPUID));
    assert_eq!(
        r.get(Gpr::Rbx),
        0,
        "leaf 7 is subleaf-keyed: subleaf 1 is empty"
    );
    assert_eq!(v.stats.cpuids, 2);
}

#[test]
fn test_cpuid_at_cpl3_is_allowed_unless_cpuid_faulting_is_on() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    to_user(&mut v, &mut r);
    assert_eq!(run(&mut v, CPUID, &mut r), after(CPUID));
    assert_eq!(r.get(Gpr::Rbx), 0x6874_7541);
    v.msrs.misc_features = 1;
    let e = run(&mut v, CPUID, &mut r);
    assert_user_fault(&v, e, &r, 13, Some(0));
}

#[test]
fn test_rdtscp_returns_the_tsc_and_tsc_aux() {
    let b = block();
    let mut v = vcpu(&b);
    v.hw.tsc = 0x1_2345_6789;
    let mut r = kregs();
    assert_eq!(run(&mut v, RDTSCP, &mut r), after(RDTSCP));
    assert_eq!(r.get(Gpr::Rax), 0x2345_6789);
    assert_eq!(r.get(Gpr::Rdx), 1);
    assert_eq!(r.get(Gpr::Rcx), 5);
}

#[test]
fn test_rdtscp_and_rdpid_are_ud_when_cpuid_does_not_offer_them() {
    let mut b = block();
    b.cpuid_count = 2; // leaves 0 and 1 only
    let mut v = vcpu(&b);
    let mut r = kregs();
    let e = run(&mut v, RDTSCP, &mut r);
    assert_ud(&v, e, &r);
    let mut v = vcpu(&b);
    let e = run(&mut v, RDPID_RAX, &mut r);
    assert_ud(&v, e, &r);
}

#[test]
fn test_rdpid_reads_tsc_aux() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    assert_eq!(run(&mut v, RDPID_RAX, &mut r), after(RDPID_RAX));
    assert_eq!(r.get(Gpr::Rax), 5);
}

#[test]
fn test_xgetbv_is_ud_because_osxsave_is_never_set() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    let e = run(&mut v, XGETBV, &mut r);
    assert_ud(&v, e, &r);
}

#[test]
fn test_wbinvd_at_cpl0_does_nothing_and_at_cpl3_is_gp0() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    assert_eq!(run(&mut v, WBINVD, &mut r), after(WBINVD));
    to_user(&mut v, &mut r);
    let e = run(&mut v, WBINVD, &mut r);
    assert_user_fault(&v, e, &r, 13, Some(0));
}

#[test]
fn test_hlt_with_interrupts_disabled_stops_the_run() {
    let b = block();
    let mut v = vcpu(&b);
    v.vif = false;
    let mut r = kregs();
    assert_eq!(run(&mut v, HLT, &mut r), Emulation::Stop);
    assert!(matches!(stop(&mut v), VcpuStop::Unsupported { .. }));
    assert_eq!(v.hw.halts, 0);
}

#[test]
fn test_hlt_waits_then_delivers_the_interrupt_after_the_hlt() {
    let b = block();
    let mut v = vcpu(&b);
    v.hw.wake_with = Some(0x20);
    let mut r = kregs();
    assert_eq!(
        run(&mut v, HLT, &mut r),
        Emulation::Continue(GuestVirt(handler(0x20)))
    );
    assert_eq!(v.hw.halts, 1);
    assert_eq!(v.stats.halts, 1);
    assert_eq!(v.stats.interrupts, 1);
    assert_eq!(frame(&v, &r, false).rip, PC + 1);
    assert!(!v.vif, "through an interrupt gate");
    assert!(v.hw.pending.is_empty());
}

#[test]
fn test_hlt_woken_for_a_detach_continues_at_the_hlt_itself() {
    let b = block();
    let mut v = vcpu(&b);
    v.hw.control_after_halt = true;
    let mut r = kregs();
    assert_eq!(
        run(&mut v, HLT, &mut r),
        Emulation::Continue(GuestVirt(PC)),
        "the guest executes the hlt again after the engine's run loop served the request"
    );
    assert_eq!(v.hw.halts, 1);
    assert_eq!(v.stats.interrupts, 0);
}

#[test]
fn test_hlt_at_cpl3_is_gp0() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    to_user(&mut v, &mut r);
    let e = run(&mut v, HLT, &mut r);
    assert_user_fault(&v, e, &r, 13, Some(0));
    assert_eq!(v.hw.halts, 0);
}

#[test]
fn test_undecodable_bytes_are_ud() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    let e = run(&mut v, &[0x06], &mut r); // push es: invalid in 64-bit mode
    assert_ud(&v, e, &r);
}

#[test]
fn test_ud2_is_ud() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    let e = run(&mut v, &[0x0f, 0x0b], &mut r);
    assert_ud(&v, e, &r);
}

#[test]
fn test_an_instruction_without_a_handler_stops_naming_it_at_cpl0() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    assert_eq!(run(&mut v, &[0x0f, 0x33], &mut r), Emulation::Stop); // rdpmc
    assert_eq!(
        stop(&mut v),
        VcpuStop::Unsupported {
            mnemonic: Some(iced_x86::Mnemonic::Rdpmc),
            why: "performance counters are not virtualized"
        }
    );
    assert_eq!(r, kregs(), "registers untouched");
}

#[test]
fn test_segment_base_answers_the_virtual_fs_and_gs_bases() {
    use crate::SegBase;
    let b = block();
    let mut v = vcpu(&b);
    assert_eq!(v.segment_base(SegBase::Fs), 0x7000_0000);
    assert_eq!(v.segment_base(SegBase::Gs), 0xffff_8880_0000_0000);
    assert_eq!(v.hw.fs_base, 0x7000_0000, "made the hardware's at creation");
    assert_eq!(v.hw.gs_base, 0xffff_8880_0000_0000);
}

#[test]
fn test_under_cr4_tsd_user_rdtsc_is_gp0_and_the_user_mode_emulates_it() {
    let b = block();
    let mut v = vcpu(&b);
    v.hw.tsc = 0x5_0000_0007;
    let mut r = kregs();
    let mov_cr4_rax = [0x0f, 0x22, 0xe0];
    r.set(Gpr::Rax, v.cr4 | cr4::TSD);
    assert_eq!(run(&mut v, &mov_cr4_rax, &mut r), after(&mov_cr4_rax));
    let rdtsc = [0x0f, 0x31];
    assert_eq!(run(&mut v, &rdtsc, &mut r), after(&rdtsc), "CPL 0 may");
    assert_eq!((r.get(Gpr::Rax), r.get(Gpr::Rdx)), (7, 5));
    to_user(&mut v, &mut r);
    assert!(
        v.mode().is_timestamp_faulting(),
        "rdtsc leaves translated user code"
    );
    let e = run(&mut v, &rdtsc, &mut r);
    assert_user_fault(&v, e, &r, 13, Some(0));
}
