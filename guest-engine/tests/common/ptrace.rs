//! Reference executions by single-stepping a forked child under ptrace.

use guest_engine::native::NativeRunner;

/// One executed instruction: RIP and the 16 GPRs before it executes.
#[derive(Clone, Copy, Debug)]
pub struct Step {
    pub rip: u64,
    pub gpr: [u64; 16],
    pub fs_base: u64,
    pub gs_base: u64,
}

fn gprs(r: &libc::user_regs_struct) -> [u64; 16] {
    [
        r.rax, r.rcx, r.rdx, r.rbx, r.rsp, r.rbp, r.rsi, r.rdi, r.r8, r.r9, r.r10, r.r11, r.r12,
        r.r13, r.r14, r.r15,
    ]
}

/// Runs `native` at `entry` in a forked child, single-stepping every instruction from the
/// first arrival at `entry` until the native exit routine; returns the steps.
pub fn single_step(native: &mut NativeRunner, entry: u64) -> Vec<Step> {
    let exit = native.exit_address();
    // SAFETY: fork/ptrace/waitpid on our own child; the child only runs the native runner
    // (memory prepared before the fork) and _exit.
    unsafe {
        let pid = libc::fork();
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            libc::ptrace(libc::PTRACE_TRACEME, 0, 0, 0);
            libc::raise(libc::SIGSTOP);
            native.run(entry);
            libc::_exit(0);
        }
        let mut status = 0;
        libc::waitpid(pid, &mut status, 0);
        assert!(libc::WIFSTOPPED(status));
        libc::ptrace(libc::PTRACE_SETOPTIONS, pid, 0, libc::PTRACE_O_EXITKILL);
        let mut steps = Vec::new();
        let mut started = false;
        loop {
            libc::ptrace(libc::PTRACE_SINGLESTEP, pid, 0, 0);
            libc::waitpid(pid, &mut status, 0);
            if libc::WIFEXITED(status) || libc::WIFSIGNALED(status) {
                panic!("child ended before reaching the exit routine");
            }
            let mut regs: libc::user_regs_struct = std::mem::zeroed();
            libc::ptrace(libc::PTRACE_GETREGS, pid, 0, &mut regs as *mut _);
            if regs.rip == entry {
                started = true;
            }
            if regs.rip == exit {
                break;
            }
            if started {
                steps.push(Step {
                    rip: regs.rip,
                    gpr: gprs(&regs),
                    fs_base: regs.fs_base,
                    gs_base: regs.gs_base,
                });
            }
        }
        libc::kill(pid, libc::SIGKILL);
        libc::waitpid(pid, &mut status, 0);
        steps
    }
}
