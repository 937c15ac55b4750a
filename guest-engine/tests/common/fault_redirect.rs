//! The host's stand-in for the image's ring-0 fault redirect: a signal raised by
//! translated code (SIGSEGV for a fault, SIGILL for an isolation check's `ud2`) is sent to
//! the engine's fault exit the way the image's #PF/#UD path does (the faulting cache PC
//! stored into the context, RIP moved to the fault exit, which sets the exit word); a
//! signal outside the code cache restores the default action and re-raises.

use std::sync::atomic::{AtomicU64, Ordering};

use super::Rig;

/// fault_pc, exit_routine, cache start, cache end, signal.
static REDIRECT: [AtomicU64; 5] = [const { AtomicU64::new(0) }; 5];

extern "C" fn on_signal(sig: libc::c_int, _info: *mut libc::siginfo_t, uc: *mut libc::c_void) {
    let uc = uc.cast::<libc::ucontext_t>();
    // SAFETY: the kernel passes a valid ucontext to an SA_SIGINFO handler; the stores go
    // to the engine's context block, whose addresses `install` took from the engine.
    unsafe {
        let rip = (*uc).uc_mcontext.gregs[libc::REG_RIP as usize] as u64;
        let (lo, hi) = (
            REDIRECT[2].load(Ordering::SeqCst),
            REDIRECT[3].load(Ordering::SeqCst),
        );
        if rip < lo || rip >= hi {
            libc::signal(sig, libc::SIG_DFL);
            return;
        }
        *(REDIRECT[0].load(Ordering::SeqCst) as *mut u64) = rip;
        (*uc).uc_mcontext.gregs[libc::REG_RIP as usize] = REDIRECT[1].load(Ordering::SeqCst) as i64;
    }
}

/// Sends `signal` raised in `rig`'s code cache to its exit routine, on an alternate stack
/// (the guest's RSP may be anything, e.g. a stack in slot 259). One rig at a time.
pub fn install(rig: &Rig, signal: libc::c_int) {
    let r = rig.engine.fault_redirect();
    for (i, v) in [
        r.fault_pc,
        r.exit_routine,
        r.region.0,
        r.region.1,
        signal as u64,
    ]
    .iter()
    .enumerate()
    {
        REDIRECT[i].store(*v, Ordering::SeqCst);
    }
    let alt = Box::leak(vec![0u8; 64 * 1024].into_boxed_slice());
    // SAFETY: installing a signal handler and an alternate stack (leaked, so it lives as
    // long as the thread) for this thread and process.
    unsafe {
        let ss = libc::stack_t {
            ss_sp: alt.as_mut_ptr().cast(),
            ss_flags: 0,
            ss_size: alt.len(),
        };
        libc::sigaltstack(&ss, std::ptr::null_mut());
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_signal as *const () as usize;
        sa.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
        libc::sigaction(signal, &sa, std::ptr::null_mut());
    }
}
