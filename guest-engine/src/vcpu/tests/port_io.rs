//! `in`, `out`.

use super::*;

const OUT_DX_AL: &[u8] = &[0xee];
const OUT_DX_AX: &[u8] = &[0x66, 0xef];
const IN_AL_DX: &[u8] = &[0xec];
const IN_EAX_DX: &[u8] = &[0xed];
const OUT_64_AL: &[u8] = &[0xe6, 0x64];
const IN_AL_60: &[u8] = &[0xe4, 0x60];
const OUTSB: &[u8] = &[0x6e];

fn regs(rax: u64, rdx: u64) -> GuestRegs {
    let mut r = kregs();
    r.set(Gpr::Rax, rax);
    r.set(Gpr::Rdx, rdx);
    r
}

#[test]
fn test_out_sends_the_operand_size_to_the_dx_port() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = regs(0x1234_5678, 0x3f8);
    assert_eq!(run(&mut v, OUT_DX_AL, &mut r), after(OUT_DX_AL));
    assert_eq!(run(&mut v, OUT_DX_AX, &mut r), after(OUT_DX_AX));
    assert_eq!(
        v.hw.outs,
        [(0x3f8, 1, 0x78), (0x3f8, 2, 0x5678)],
        "only AL, then AX, reach the port"
    );
    assert_eq!(v.stats.outs, 2);
}

#[test]
fn test_in_al_merges_the_low_byte_and_in_eax_zero_extends() {
    let b = block();
    let mut v = vcpu(&b);
    v.hw.in_value = 0xaabb_ccdd;
    let mut r = regs(0xffff_ffff_ffff_ffff, 0x60);
    assert_eq!(run(&mut v, IN_AL_DX, &mut r), after(IN_AL_DX));
    assert_eq!(r.get(Gpr::Rax), 0xffff_ffff_ffff_ffdd);
    assert_eq!(run(&mut v, IN_EAX_DX, &mut r), after(IN_EAX_DX));
    assert_eq!(r.get(Gpr::Rax), 0xaabb_ccdd);
    assert_eq!(v.hw.ins, [(0x60, 1), (0x60, 4)]);
}

#[test]
fn test_in_with_an_immediate_port() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = regs(0, 0x1234);
    assert_eq!(run(&mut v, IN_AL_60, &mut r), after(IN_AL_60));
    assert_eq!(v.hw.ins, [(0x60, 1)]);
}

#[test]
fn test_the_engines_own_ports_are_absent_for_the_guest() {
    let b = block();
    let mut v = vcpu(&b);
    v.hw.in_value = 0x1234_5678;
    for port in [
        kpin_abi::ports::DOORBELL_PORT,
        kpin_abi::ports::ENGINE_FAILURE_PORT,
    ] {
        let mut r = regs(0x1_0000_0001, u64::from(port));
        assert_eq!(run(&mut v, OUT_DX_AL, &mut r), after(OUT_DX_AL));
        assert_eq!(run(&mut v, IN_AL_DX, &mut r), after(IN_AL_DX));
        assert_eq!(r.get(Gpr::Rax), 0x1_0000_00ff, "AL reads all ones");
        assert_eq!(run(&mut v, IN_EAX_DX, &mut r), after(IN_EAX_DX));
        assert_eq!(r.get(Gpr::Rax), 0xffff_ffff, "EAX reads all ones");
    }
    assert!(v.hw.outs.is_empty(), "{:?}", v.hw.outs);
    assert!(v.hw.ins.is_empty(), "{:?}", v.hw.ins);
    assert_eq!((v.stats.outs, v.stats.ins), (2, 4));
}

#[test]
fn test_out_at_cpl3_with_iopl0_is_gp0_and_reaches_no_port() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = regs(0x41, 0x3f8);
    to_user(&mut v, &mut r);
    let e = run(&mut v, OUT_DX_AL, &mut r);
    assert_user_fault(&v, e, &r, 13, Some(0));
    assert!(v.hw.outs.is_empty());
}

#[test]
fn test_in_at_cpl3_with_iopl3_is_allowed() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = regs(0, 0x3f8);
    to_user(&mut v, &mut r);
    v.iopl = 3;
    assert_eq!(run(&mut v, IN_AL_DX, &mut r), after(IN_AL_DX));
    assert_eq!(v.hw.ins, [(0x3f8, 1)]);
}

#[test]
fn test_i8042_reset_stops_with_the_final_port_write_left_to_the_caller() {
    let b = block();
    let mut v = vcpu(&b);
    // Only AL is written: the bits above it must not reach the port or the check.
    let mut r = regs(0xdead_01fe, 0);
    assert_eq!(run(&mut v, OUT_64_AL, &mut r), Emulation::Stop);
    assert_eq!(
        stop(&mut v),
        VcpuStop::FinalPortWrite {
            port: 0x64,
            size: 1,
            value: 0xfe
        }
    );
    assert!(
        v.hw.outs.is_empty(),
        "the run loop performs it after its report"
    );
}

#[test]
fn test_acpi_poweroff_stops_and_other_pm1_writes_pass() {
    let b = block();
    let mut v = vcpu(&b);
    // SLP_TYP = 5 (S5) first, then with SLP_EN: only the second powers off.
    let mut r = regs(5 << 10, 0x604);
    assert_eq!(run(&mut v, OUT_DX_AX, &mut r), after(OUT_DX_AX));
    assert_eq!(v.hw.outs, [(0x604, 2, 5 << 10)]);
    let mut r = regs((5 << 10) | (1 << 13), 0x604);
    assert_eq!(run(&mut v, OUT_DX_AX, &mut r), Emulation::Stop);
    assert!(matches!(
        stop(&mut v),
        VcpuStop::FinalPortWrite {
            port: 0x604,
            size: 2,
            ..
        }
    ));
}

/// Gives the guest TSS an I/O permission bitmap right after its 0x68 bytes that allows
/// only `allowed` of ports 0–0xff (plus the trailing all-ones byte), its limit covering it.
fn io_bitmap(v: &mut V<'_>, allowed: &[u16]) {
    let mut map = [0xffu8; 0x21];
    for &p in allowed {
        map[usize::from(p / 8)] &= !(1 << (p % 8));
    }
    v.mem.poke(TSS + 0x66, &0x68u16.to_le_bytes());
    v.mem.poke(TSS + 0x68, &map);
    v.segs.tr.limit = 0x68 + map.len() as u32 - 1;
}

#[test]
fn test_at_cpl3_above_iopl_the_tss_io_bitmap_decides() {
    let b = block();
    let mut v = vcpu(&b);
    io_bitmap(&mut v, &[0x80]);
    let mut r = regs(0x41, 0x80);
    to_user(&mut v, &mut r);
    assert_eq!(run(&mut v, OUT_DX_AL, &mut r), after(OUT_DX_AL));
    assert_eq!(run(&mut v, IN_AL_DX, &mut r), after(IN_AL_DX));
    assert_eq!(v.hw.outs, [(0x80, 1, 0x41)]);
    // A word at 0x80 also needs 0x81's bit.
    let e = run(&mut v, OUT_DX_AX, &mut r);
    assert_user_fault(&v, e, &r, 13, Some(0));
    assert_eq!(v.hw.outs.len(), 1);
}

#[test]
fn test_at_cpl3_a_port_beyond_the_tss_limit_or_a_denied_bit_is_gp0() {
    let b = block();
    for port in [0x81u64, 0x3f8] {
        let mut v = vcpu(&b);
        io_bitmap(&mut v, &[0x80]);
        let mut r = regs(0, port);
        to_user(&mut v, &mut r);
        let e = run(&mut v, IN_AL_DX, &mut r);
        assert_user_fault(&v, e, &r, 13, Some(0));
        assert!(v.hw.ins.is_empty());
    }
}

#[test]
fn test_rep_insb_fills_memory_and_counts_rcx_down() {
    let b = block();
    let mut v = vcpu(&b);
    v.hw.in_value = 0x5a;
    let mut r = regs(0, 0x80);
    to_user(&mut v, &mut r);
    v.iopl = 3;
    r.set(Gpr::Rdi, USER_PAGE + 0x10);
    r.set(Gpr::Rcx, 3);
    let rep_insb = [0xf3, 0x6c];
    assert_eq!(run(&mut v, &rep_insb, &mut r), after(&rep_insb));
    let mut got = [0u8; 4];
    v.mem.peek(USER_PAGE + 0x10, &mut got);
    assert_eq!(got, [0x5a, 0x5a, 0x5a, 0]);
    assert_eq!(r.get(Gpr::Rdi), USER_PAGE + 0x13);
    assert_eq!(r.get(Gpr::Rcx), 0);
    assert_eq!(v.hw.ins.len(), 3);
}

#[test]
fn test_rep_outsb_faulting_midway_keeps_the_elements_done_and_retries() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = regs(0, 0x80);
    to_user(&mut v, &mut r);
    v.iopl = 3;
    v.mem.poke(USER_PAGE + 0xffe, &[1, 2]);
    // The third byte is on the next, unmapped page.
    r.set(Gpr::Rsi, USER_PAGE + 0xffe);
    r.set(Gpr::Rcx, 5);
    let rep_outsb = [0xf3, 0x6e];
    assert_eq!(
        run(&mut v, &rep_outsb, &mut r),
        Emulation::Continue(GuestVirt(PC)),
        "the instruction runs again from the element that faults"
    );
    assert_eq!(v.hw.outs, [(0x80, 1, 1), (0x80, 1, 2)]);
    assert_eq!(r.get(Gpr::Rsi), USER_PAGE + 0x1000);
    assert_eq!(r.get(Gpr::Rcx), 3);
    let e = run(&mut v, &rep_outsb, &mut r);
    // Not present, a read, from user mode.
    assert_user_fault(&v, e, &r, 14, Some(0x4));
    assert_eq!(v.cr2, USER_PAGE + 0x1000);
}

#[test]
fn test_outsb_at_cpl3_without_permission_is_gp0() {
    let b = block();
    let mut v = vcpu(&b);
    // (The block's TSS has a map base of 0 and limit 0x67: port 0x3f8's byte is past it.)
    let mut r = regs(0, 0x3f8);
    to_user(&mut v, &mut r);
    r.set(Gpr::Rsi, USER_PAGE);
    let e = run(&mut v, OUTSB, &mut r);
    assert_user_fault(&v, e, &r, 13, Some(0));
    assert!(v.hw.outs.is_empty());
}
