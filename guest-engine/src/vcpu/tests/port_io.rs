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

#[test]
fn test_string_port_io_stops_unsupported() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = regs(0, 0x3f8);
    assert_eq!(run(&mut v, OUTSB, &mut r), Emulation::Stop);
    assert!(matches!(
        stop(&mut v),
        VcpuStop::Unsupported { why, .. } if why.contains("string port I/O")
    ));
}
