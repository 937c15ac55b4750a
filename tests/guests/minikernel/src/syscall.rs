//! The SYSCALL table: `exit`, `write` (records a number) and `add`.
//!
//! ABI: RAX = number, RDI/RSI = arguments, RAX = result (SYSRETQ returns it). `exit`
//! never returns to ring 3: it ends the task started by `user::run` with RDI as its result.
//! The entry (`syscall_entry` in entry.rs) runs with the RFLAGS bits in SFMASK cleared,
//! so interrupts are off; the handler records what it saw so step `syscall` can print it.

use crate::cpu::{rflags, RFLAGS_IF};
use crate::entry::user_return;
use crate::global::Global;

/// `exit(code)`: end the ring-3 task.
pub const SYS_EXIT: u64 = 0;
/// `write(n)`: record `n`; returns how many numbers have been written.
pub const SYS_WRITE: u64 = 1;
/// `add(a, b)`: returns `a + b`.
pub const SYS_ADD: u64 = 2;
/// Returned for an unknown number.
pub const ENOSYS: u64 = u64::MAX;
/// Numbers `write` keeps.
pub const WRITE_LOG_LEN: usize = 8;

/// Registers saved by `syscall_entry`, lowest address first.
#[repr(C)]
pub struct SyscallFrame {
    pub rax: u64,
    pub r10: u64,
    pub r9: u64,
    pub r8: u64,
    pub rdx: u64,
    pub rsi: u64,
    pub rdi: u64,
    /// User RIP (saved by SYSCALL).
    pub rcx: u64,
    /// User RFLAGS (saved by SYSCALL).
    pub r11: u64,
    pub user_rsp: u64,
}

static WRITES: [Global<u64>; WRITE_LOG_LEN] = [const { Global::new(0) }; WRITE_LOG_LEN];
static WRITES_USED: Global<usize> = Global::new(0);
/// Number of syscalls handled.
pub static SYSCALLS: Global<u64> = Global::new(0);
/// Whether IF was ever set inside the handler (SFMASK must clear it).
pub static IF_SEEN_IN_KERNEL: Global<bool> = Global::new(false);
/// Whether IF was clear in some caller's saved RFLAGS (R11).
pub static IF_CLEAR_IN_USER: Global<bool> = Global::new(false);

/// Forgets the write log and the counters.
pub fn reset_log() {
    WRITES_USED.set(0);
    SYSCALLS.set(0);
    IF_SEEN_IN_KERNEL.set(false);
    IF_CLEAR_IN_USER.set(false);
}

/// The `i`-th written number.
pub fn write_log(i: usize) -> Option<u64> {
    (i < WRITES_USED.get()).then(|| WRITES[i].get())
}

/// Called by `syscall_entry`.
pub extern "C" fn syscall_dispatch(frame: &mut SyscallFrame) -> u64 {
    SYSCALLS.set(SYSCALLS.get() + 1);
    if rflags() & RFLAGS_IF != 0 {
        IF_SEEN_IN_KERNEL.set(true);
    }
    if frame.r11 & RFLAGS_IF == 0 {
        IF_CLEAR_IN_USER.set(true);
    }
    match frame.rax {
        SYS_EXIT => {
            // SAFETY: a syscall comes from the ring-3 task `run_user` started, so its saved
            // kernel context is valid.
            unsafe { user_return(frame.rdi) }
        }
        SYS_WRITE => {
            let used = WRITES_USED.get();
            if used < WRITE_LOG_LEN {
                WRITES[used].set(frame.rdi);
                WRITES_USED.set(used + 1);
            }
            (used + 1) as u64
        }
        SYS_ADD => frame.rdi.wrapping_add(frame.rsi),
        _ => ENOSYS,
    }
}
