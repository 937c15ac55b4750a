//! Steps `syscall` and `user-priv`: ring-3 tasks entered with `iretq`.

use crate::console::{newline, print, print_dec, print_hex, print_ok};
use crate::cpu::{rdmsr, wrmsr, EFER_SCE, MSR_EFER, MSR_LSTAR, MSR_SFMASK, MSR_STAR, RFLAGS_IF};
use crate::entry::syscall_entry;
use crate::layout::{KERNEL_CS, USER_CS32};
use crate::syscall::{self, IF_CLEAR_IN_USER, IF_SEEN_IN_KERNEL, SYSCALLS};
use crate::traps::USER_REPORT_RBX;
use crate::traps::{clear_trap_log, trap_log, VEC_GP, VEC_UD};
use crate::user::{self, priv_insn_va, Entry, PrivInsn, Program};

/// STAR: SYSCALL CS = 0x08 (SS 0x10); SYSRET CS = 0x18 + 16 = 0x28|3, SS = 0x18 + 8 = 0x20|3.
const STAR: u64 = ((USER_CS32 as u64) << 48) | ((KERNEL_CS as u64) << 32);
/// SFMASK: clear TF, IF, DF, IOPL, NT and AC on SYSCALL (as Linux does).
const SFMASK: u64 = 0x4_7700;

/// Sets STAR, LSTAR, SFMASK and EFER.SCE for SYSCALL/SYSRET.
fn enable_syscall() {
    // SAFETY: SYSCALL is enabled with an entry that switches to the kernel's trap stack and
    // selectors matching the GDT layout.
    unsafe {
        wrmsr(MSR_STAR, STAR);
        wrmsr(MSR_LSTAR, syscall_entry as *const () as u64);
        wrmsr(MSR_SFMASK, SFMASK);
        wrmsr(MSR_EFER, rdmsr(MSR_EFER) | EFER_SCE);
    }
}

/// Step `syscall`: a ring-3 task makes six syscalls (add, four writes, exit); every result
/// comes back through `sysretq`, and the exit code sums them all.
pub fn syscall_sysret() {
    enable_syscall();
    syscall::reset_log();
    let exit = user::run(Program::Syscall, 0, None);
    print("star=");
    print_hex(rdmsr(MSR_STAR));
    print(" sfmask=");
    print_hex(rdmsr(MSR_SFMASK));
    print(" syscalls=");
    print_dec(SYSCALLS.get());
    print(" writes=");
    let mut i = 0;
    while let Some(v) = syscall::write_log(i) {
        if i > 0 {
            print(",");
        }
        print_hex(v);
        i += 1;
    }
    print(" if-masked-in-kernel ");
    print_ok(!IF_SEEN_IN_KERNEL.get());
    print(" user-if ");
    print_ok(!IF_CLEAR_IN_USER.get());
    print(" exit=");
    print_dec(exit);
    newline();
}

/// Step `user-priv`: `hlt`, `cli`, `rdmsr` and `mov rax, cr3` at CPL 3 each raise #GP(0) at
/// their own RIP; the kernel continues after each and the task exits through the gate.
pub fn privileged_at_cpl3() {
    clear_trap_log();
    let result = user::run(Program::Privileged, 0, None);
    let insns = [
        ("hlt", PrivInsn::Hlt),
        ("cli", PrivInsn::Cli),
        ("rdmsr", PrivInsn::Rdmsr),
        ("mov-cr3", PrivInsn::MovFromCr3),
    ];
    for (i, &(name, insn)) in insns.iter().enumerate() {
        if i > 0 {
            print(" ");
        }
        print(name);
        match trap_log(i) {
            Some(t) => {
                print(" vector=");
                print_dec(t.vector);
                print(" err=");
                print_hex(t.error);
                print(" rip ");
                print_ok(t.vector == VEC_GP && t.rip == priv_insn_va(insn) && t.cs & 3 == 3);
            }
            None => print(" no-trap BAD"),
        }
    }
    print(" gate ");
    print_ok(trap_log(insns.len()).is_some_and(|t| t.vector == VEC_UD));
    print(" exit=");
    print_hex(result);
    newline();
}

/// Step `selectors`: ring-3 code entered with `iretq` reads CS and SS (`mov r16, sreg`) and
/// RFLAGS.IF (`pushfq`) and reports them through the exit gate.
pub fn selectors_after_iretq() {
    clear_trap_log();
    let selectors = user::run(Program::Selectors, 0, None);
    let user_if = USER_REPORT_RBX.get();
    print("iretq to cpl3, user reads cs=");
    print_hex(selectors & 0xffff);
    print(" ss=");
    print_hex((selectors >> 16) & 0xffff);
    print(if user_if & RFLAGS_IF != 0 {
        " if=1"
    } else {
        " if=0"
    });
    newline();
}

/// Step `sysret`: enter ring 3 with `sysretq` (no SYSCALL involved) and leave through the
/// exit gate; the gate's #UD frame shows the CS and SS that STAR gave the task and the
/// RFLAGS.IF that R11 gave it.
pub fn sysret_to_cpl3() {
    enable_syscall();
    clear_trap_log();
    user::run_entered_by(Entry::Sysretq, Program::Selectors, 0, None);
    print("sysretq to cpl3, exit-gate frame ");
    match trap_log(0) {
        Some(t) if t.vector == VEC_UD && trap_log(1).is_none() => {
            print("cs=");
            print_hex(t.cs);
            print(" ss=");
            print_hex(t.ss);
            print(if t.rflags & RFLAGS_IF != 0 {
                " if=1"
            } else {
                " if=0"
            });
        }
        _ => print("missing BAD"),
    }
    newline();
}
