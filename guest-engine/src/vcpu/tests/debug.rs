//! Debug registers and single-stepping around the stepping mode (`debug.rs`): execution
//! breakpoints are faults before the instruction (suppressed by RF), data breakpoints
//! traps after it with DR6.Bn, by condition and length (SDM vol. 3, §18.2–18.3).

use super::*;

/// `mov [rax], ecx` and `mov ecx, [rax]`.
const STORE: &[u8] = &[0x89, 0x08];
const LOAD: &[u8] = &[0x8b, 0x08];

/// DR7 with breakpoint `n` enabled locally, condition `rw`, length code `len`.
fn dr7(n: u64, rw: u64, len: u64) -> u64 {
    0x400 | 1 << (2 * n) | rw << (16 + 4 * n) | len << (18 + 4 * n)
}

#[test]
fn test_armed_breakpoints_make_the_mode_a_stepping_one() {
    let b = block();
    let mut v = vcpu(&b);
    assert_eq!(v.mode(), crate::vcpu::MODE_KERNEL);
    v.dr7 = dr7(0, 0, 0);
    assert_eq!(v.mode(), crate::vcpu::MODE_KERNEL.stepping());
}

#[test]
fn test_an_execution_breakpoint_is_a_fault_at_the_instruction_unless_rf() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    to_user(&mut v, &mut r);
    v.dr[2] = PC;
    v.dr7 = dr7(2, 0, 0);
    assert!(
        v.instruction_breakpoint(&mut r, PC + 1).is_none(),
        "elsewhere"
    );
    let h = v
        .instruction_breakpoint(&mut r, PC)
        .expect("hit")
        .expect("delivered");
    assert_eq!(h, handler(1));
    let f = frame(&v, &r, false);
    assert_eq!(f.rip, PC, "a fault: RIP = the instruction");
    assert_eq!(v.dr6 & 0xf, 1 << 2, "DR6.B2");
    // The handler returns with RF set: the instruction then runs once.
    let mut r2 = kregs();
    to_user(&mut v, &mut r2);
    r2.rflags |= 1 << 16;
    assert!(v.instruction_breakpoint(&mut r2, PC).is_none());
    let before = r2;
    assert!(v
        .after_instruction(false, &before, PC, &[0x90], &mut r2, PC + 1)
        .is_none());
    assert_eq!(r2.rflags & (1 << 16), 0, "RF cleared once it ran");
}

#[test]
fn test_data_breakpoints_trap_after_an_access_by_condition_and_length() {
    let b = block();
    // (DR7 R/W, LEN code, DR0, instruction, accessed address, hit)
    type Case<'a> = (u64, u64, u64, &'a [u8], u64, bool);
    let cases: [Case; 7] = [
        (1, 3, USER_PAGE + 0x10, STORE, USER_PAGE + 0x10, true),
        (1, 3, USER_PAGE + 0x10, LOAD, USER_PAGE + 0x10, false), // write-only
        (3, 3, USER_PAGE + 0x10, LOAD, USER_PAGE + 0x10, true),
        (1, 0, USER_PAGE + 0x13, STORE, USER_PAGE + 0x10, true), // dword covers it
        (1, 0, USER_PAGE + 0x14, STORE, USER_PAGE + 0x10, false),
        (1, 2, USER_PAGE + 0x1c, STORE, USER_PAGE + 0x18, true), // 8 bytes, aligned down
        (1, 1, USER_PAGE + 0x12, STORE, USER_PAGE + 0x0e, false), // [0xe, 0x12) misses
    ];
    for (rw, len, addr, insn, at, hit) in cases {
        let mut v = vcpu(&b);
        let mut r = kregs();
        to_user(&mut v, &mut r);
        r.set(Gpr::Rax, at);
        v.dr[0] = addr;
        v.dr7 = dr7(0, rw, len);
        let before = r;
        let d = v.after_instruction(false, &before, PC, insn, &mut r, PC + 2);
        assert_eq!(d.is_some(), hit, "{rw} {len} {addr:#x} {insn:02x?} {at:#x}");
        if hit {
            let f = frame(&v, &r, false);
            assert_eq!(f.rip, PC + 2, "a trap: RIP after the instruction");
            assert_eq!(v.dr6 & 0x400f, 1, "DR6.B0 only");
        }
    }
}

#[test]
fn test_a_data_hit_and_a_single_step_are_one_db_with_both_bits() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    to_user(&mut v, &mut r);
    r.set(Gpr::Rax, USER_PAGE);
    v.dr[1] = USER_PAGE;
    v.dr7 = dr7(1, 1, 0);
    v.tf = true;
    let before = r;
    v.after_instruction(true, &before, PC, STORE, &mut r, PC + 2)
        .expect("a trap")
        .expect("delivered");
    assert_eq!(v.dr6 & 0x400f, 1 << 14 | 1 << 1, "BS and B1");
    assert_eq!(v.stats.exceptions[1], 1, "one #DB");
}
