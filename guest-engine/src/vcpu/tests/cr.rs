//! Control and debug registers, `smsw`/`lmsw`/`clts`, `invlpg`.

use super::*;

const MOV_RAX_CR0: &[u8] = &[0x0f, 0x20, 0xc0];
const MOV_RAX_CR3: &[u8] = &[0x0f, 0x20, 0xd8];
const MOV_RAX_CR8: &[u8] = &[0x44, 0x0f, 0x20, 0xc0];
const MOV_CR0_RAX: &[u8] = &[0x0f, 0x22, 0xc0];
const MOV_CR2_RAX: &[u8] = &[0x0f, 0x22, 0xd0];
const MOV_CR3_RAX: &[u8] = &[0x0f, 0x22, 0xd8];
const MOV_CR4_RAX: &[u8] = &[0x0f, 0x22, 0xe0];
const MOV_RAX_DR0: &[u8] = &[0x0f, 0x21, 0xc0];
const MOV_RAX_DR4: &[u8] = &[0x0f, 0x21, 0xe0];
const MOV_DR0_RAX: &[u8] = &[0x0f, 0x23, 0xc0];
const MOV_DR6_RAX: &[u8] = &[0x0f, 0x23, 0xf0];
const MOV_DR7_RAX: &[u8] = &[0x0f, 0x23, 0xf8];

fn with_rax(rax: u64) -> GuestRegs {
    let mut r = kregs();
    r.set(Gpr::Rax, rax);
    r
}

#[test]
fn test_mov_from_cr3_and_cr0_read_the_virtual_values() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    assert_eq!(run(&mut v, MOV_RAX_CR3, &mut r), after(MOV_RAX_CR3));
    assert_eq!(r.get(Gpr::Rax), 0x10_0000);
    assert_eq!(run(&mut v, MOV_RAX_CR0, &mut r), after(MOV_RAX_CR0));
    assert_eq!(r.get(Gpr::Rax), b.sregs.cr0);
}

#[test]
fn test_mov_from_cr8_reads_zero_and_writes_are_dropped() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = with_rax(0xdead);
    assert_eq!(run(&mut v, MOV_RAX_CR8, &mut r), after(MOV_RAX_CR8));
    assert_eq!(r.get(Gpr::Rax), 0);
}

#[test]
fn test_mov_to_cr2_stores_it() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = with_rax(0x1234_5678);
    assert_eq!(run(&mut v, MOV_CR2_RAX, &mut r), after(MOV_CR2_RAX));
    assert_eq!(v.cr2, 0x1234_5678);
}

#[test]
fn test_mov_to_cr3_switches_address_space_and_stops_for_shadow_work() {
    let b = block();
    let mut v = vcpu(&b);
    // Bit 63 (keep PCID entries) is not part of the address.
    let mut r = with_rax(0x20_0000 | 1 << 63);
    assert_eq!(run(&mut v, MOV_CR3_RAX, &mut r), Emulation::Stop);
    assert_eq!(v.mem.cr3_writes, [0x20_0000]);
    assert_eq!(
        stop(&mut v),
        VcpuStop::ShadowWork {
            resume: GuestVirt(PC + 3)
        }
    );
}

#[test]
fn test_mov_to_cr3_beyond_maxphyaddr_is_gp0() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = with_rax(1 << 39);
    let e = run(&mut v, MOV_CR3_RAX, &mut r);
    assert_gp0(&v, e, &r);
    assert!(v.mem.cr3_writes.is_empty());
}

#[test]
fn test_mov_to_cr_at_cpl3_is_gp0() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = with_rax(0);
    to_user(&mut v, &mut r);
    let e = run(&mut v, MOV_CR3_RAX, &mut r);
    assert_user_fault(&v, e, &r, 13, Some(0));
    assert!(v.mem.cr3_writes.is_empty());
}

#[test]
fn test_mov_from_cr_at_cpl3_is_gp0() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    to_user(&mut v, &mut r);
    r.set(Gpr::Rax, 7);
    let e = run(&mut v, MOV_RAX_CR0, &mut r);
    assert_user_fault(&v, e, &r, 13, Some(0));
    assert_eq!(
        r.get(Gpr::Rax),
        7,
        "registers are as before the instruction"
    );
}

#[test]
fn test_mov_to_cr0_reserved_combinations_are_gp0() {
    let b = block();
    let cr0 = b.sregs.cr0;
    for bad in [
        cr0 | 1 << 32,                   // bits 63:32 reserved
        (cr0 & !kpin_abi::x86::cr0::PE), // PG without PE
        cr0 | kpin_abi::x86::cr0::NW,    // NW without CD
    ] {
        let mut v = vcpu(&b);
        let mut r = with_rax(bad);
        let e = run(&mut v, MOV_CR0_RAX, &mut r);
        assert_gp0(&v, e, &r);
        assert_eq!(v.cr0, cr0);
    }
}

#[test]
fn test_mov_to_cr0_that_leaves_paging_stops_unsupported() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = with_rax(b.sregs.cr0 & !(kpin_abi::x86::cr0::PG));
    assert_eq!(run(&mut v, MOV_CR0_RAX, &mut r), Emulation::Stop);
    assert!(matches!(stop(&mut v), VcpuStop::Unsupported { .. }));
}

#[test]
fn test_mov_to_cr0_setting_ts_stops_unsupported() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = with_rax(b.sregs.cr0 | kpin_abi::x86::cr0::TS);
    assert_eq!(run(&mut v, MOV_CR0_RAX, &mut r), Emulation::Stop);
    assert!(matches!(stop(&mut v), VcpuStop::Unsupported { .. }));
}

#[test]
fn test_mov_to_cr0_clearing_wp_reaches_the_shadow_mmu() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = with_rax(b.sregs.cr0 & !kpin_abi::x86::cr0::WP);
    assert_eq!(run(&mut v, MOV_CR0_RAX, &mut r), after(MOV_CR0_RAX));
    let c = v.mem.control.expect("paging control set");
    assert!(!c.wp);
    assert!(c.nxe && c.pge);
}

#[test]
fn test_mov_to_cr4_with_a_bit_cpuid_hides_is_gp0() {
    let b = block();
    for bit in [
        cr4::OSXSAVE,
        cr4::SMAP,
        cr4::PCIDE,
        cr4::LA57,
        cr4::VMXE,
        1 << 32,
    ] {
        let mut v = vcpu(&b);
        let mut r = with_rax(b.sregs.cr4 | bit);
        let e = run(&mut v, MOV_CR4_RAX, &mut r);
        assert_gp0(&v, e, &r);
        assert_eq!(v.cr4, b.sregs.cr4);
    }
}

#[test]
fn test_mov_to_cr4_smep_and_sse_bits_reach_shadow_and_hardware() {
    let b = block();
    let mut v = vcpu(&b);
    let new = (b.sregs.cr4 | cr4::SMEP) & !cr4::OSXMMEXCPT;
    let mut r = with_rax(new);
    assert_eq!(run(&mut v, MOV_CR4_RAX, &mut r), after(MOV_CR4_RAX));
    assert_eq!(v.cr4, new);
    assert!(v.mem.control.expect("control").smep);
    assert_eq!(v.hw.cr4_sse.last(), Some(&new));
}

#[test]
fn test_mov_to_cr4_clearing_pae_stops_unsupported() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = with_rax(b.sregs.cr4 & !cr4::PAE);
    assert_eq!(run(&mut v, MOV_CR4_RAX, &mut r), Emulation::Stop);
    assert!(matches!(stop(&mut v), VcpuStop::Unsupported { .. }));
}

#[test]
fn test_debug_registers_store_and_read_back() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = with_rax(0xffff_8000_1234_0000);
    assert_eq!(run(&mut v, MOV_DR0_RAX, &mut r), after(MOV_DR0_RAX));
    r.set(Gpr::Rax, 0);
    assert_eq!(run(&mut v, MOV_RAX_DR0, &mut r), after(MOV_RAX_DR0));
    assert_eq!(r.get(Gpr::Rax), 0xffff_8000_1234_0000);
}

#[test]
fn test_mov_dr4_aliases_dr6_without_cr4_de_and_is_ud_with_it() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    assert_eq!(run(&mut v, MOV_RAX_DR4, &mut r), after(MOV_RAX_DR4));
    assert_eq!(r.get(Gpr::Rax), 0xffff_0ff0, "DR6 at reset");
    v.cr4 |= cr4::DE;
    let mut r = kregs();
    let e = run(&mut v, MOV_RAX_DR4, &mut r);
    assert_ud(&v, e, &r);
}

#[test]
fn test_mov_dr6_with_upper_bits_is_gp0() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = with_rax(1 << 32);
    let e = run(&mut v, MOV_DR6_RAX, &mut r);
    assert_gp0(&v, e, &r);
}

#[test]
fn test_mov_dr7_enabling_a_breakpoint_switches_to_stepping_and_general_detect_stops() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = with_rax(0x000d_0001); // L0, R/W0 = write, LEN0 = 4 bytes
    assert_eq!(
        run(&mut v, MOV_DR7_RAX, &mut r),
        Emulation::Switch {
            next: GuestVirt(PC + 3),
            mode: crate::vcpu::MODE_KERNEL.stepping(),
            invalidate_mappings: false
        }
    );
    assert_eq!(v.dr7, 0x000d_0401, "kept, bit 10 reads 1");
    assert_eq!(v.stats.breakpoint_enables, 1);
    let mut r = with_rax(1 << 13); // GD
    assert_eq!(run(&mut v, MOV_DR7_RAX, &mut r), Emulation::Stop);
    assert!(matches!(stop(&mut v), VcpuStop::Unsupported { .. }));
}

#[test]
fn test_smsw_register_gets_cr0_and_memory_its_low_word() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    let smsw_eax = [0x0f, 0x01, 0xe0];
    assert_eq!(run(&mut v, &smsw_eax, &mut r), after(&smsw_eax));
    assert_eq!(r.get(Gpr::Rax), b.sregs.cr0);
    let smsw_m = [0x0f, 0x01, 0x20]; // smsw [rax]
    r.set(Gpr::Rax, KDATA_PAGE);
    v.mem.poke_u64(KDATA_PAGE, u64::MAX);
    assert_eq!(run(&mut v, &smsw_m, &mut r), after(&smsw_m));
    assert_eq!(
        v.mem.peek_u64(KDATA_PAGE),
        0xffff_ffff_ffff_0000 | (b.sregs.cr0 & 0xffff)
    );
}

#[test]
fn test_smsw_at_cpl3_works_without_umip_and_is_gp0_with_it() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    to_user(&mut v, &mut r);
    let smsw_eax = [0x0f, 0x01, 0xe0];
    assert_eq!(run(&mut v, &smsw_eax, &mut r), after(&smsw_eax));
    assert_eq!(r.get(Gpr::Rax), b.sregs.cr0);
    v.cr4 |= cr4::UMIP;
    let e = run(&mut v, &smsw_eax, &mut r);
    assert_user_fault(&v, e, &r, 13, Some(0));
}

#[test]
fn test_lmsw_cannot_clear_pe() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = with_rax(0); // lmsw ax with PE = 0
    let lmsw_ax = [0x0f, 0x01, 0xf0];
    assert_eq!(run(&mut v, &lmsw_ax, &mut r), after(&lmsw_ax));
    assert_ne!(v.cr0 & kpin_abi::x86::cr0::PE, 0);
    assert_eq!(
        v.cr0 & kpin_abi::x86::cr0::MP,
        0,
        "MP loaded from the operand"
    );
}

#[test]
fn test_clts_at_cpl0_continues_and_at_cpl3_is_gp0() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    let clts = [0x0f, 0x06];
    assert_eq!(run(&mut v, &clts, &mut r), after(&clts));
    to_user(&mut v, &mut r);
    let e = run(&mut v, &clts, &mut r);
    assert_user_fault(&v, e, &r, 13, Some(0));
}

#[test]
fn test_invlpg_tells_the_shadow_mmu_the_address() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = with_rax(0xffff_8000_0123_4000);
    let invlpg = [0x0f, 0x01, 0x38];
    assert_eq!(run(&mut v, &invlpg, &mut r), after(&invlpg));
    assert_eq!(v.mem.invlpgs, [0xffff_8000_0123_4000]);
}

#[test]
fn test_a_shadow_failure_on_a_cr3_write_stops_with_shadow_failure() {
    let b = block();
    let mut v = vcpu(&b);
    v.mem.fail_next = true;
    let mut r = with_rax(0x20_0000);
    assert_eq!(run(&mut v, MOV_CR3_RAX, &mut r), Emulation::Stop);
    assert_eq!(stop(&mut v), VcpuStop::ShadowFailure);
    assert!(
        v.mem.failure.is_some(),
        "recorded for the run loop's report"
    );
}

#[test]
fn test_a_shadow_failure_on_a_cr4_write_stops_with_shadow_failure() {
    let b = block();
    let mut v = vcpu(&b);
    v.mem.fail_next = true;
    let mut r = with_rax(b.sregs.cr4 | cr4::SMEP);
    assert_eq!(run(&mut v, MOV_CR4_RAX, &mut r), Emulation::Stop);
    assert_eq!(stop(&mut v), VcpuStop::ShadowFailure);
}
