//! The run timeout: a thread that, once the deadline passes, kicks the vCPU thread out of
//! `KVM_RUN` with a real-time signal until the vCPU loop acknowledges.
//!
//! Invariant: the watchdog only signals the vCPU thread while that thread is alive — the
//! loop calls [`Watchdog::finish`] (which joins the watchdog) before it returns.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use vmm_sys_util::signal::{register_signal_handler, SIGRTMIN};

use crate::error::{Result, VmmError};

/// How often the watchdog re-kicks a vCPU that has not noticed the timeout yet (a kick
/// that lands just before `KVM_RUN` is entered is otherwise lost).
const KICK_INTERVAL: Duration = Duration::from_millis(50);

extern "C" fn ignore_kick(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}

/// A running watchdog.
pub struct Watchdog {
    expired: Arc<AtomicBool>,
    stop: Option<Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Watchdog {
    /// Arms a watchdog for the calling (vCPU) thread. `None` never expires.
    pub fn arm(timeout: Option<Duration>) -> Result<Self> {
        register_signal_handler(SIGRTMIN(), ignore_kick)
            .map_err(|e| VmmError::Host("installing the vCPU kick signal handler", e.into()))?;
        let expired = Arc::new(AtomicBool::new(false));
        let Some(timeout) = timeout else {
            return Ok(Watchdog {
                expired,
                stop: None,
                thread: None,
            });
        };
        // SAFETY: pthread_self has no preconditions.
        let vcpu_thread = unsafe { libc::pthread_self() };
        let (stop, stopped) = channel::<()>();
        let flag = expired.clone();
        let thread = std::thread::Builder::new()
            .name("kpin-watchdog".into())
            .spawn(move || {
                if stopped.recv_timeout(timeout) != Err(RecvTimeoutError::Timeout) {
                    return;
                }
                flag.store(true, Ordering::SeqCst);
                loop {
                    // SAFETY: the vCPU thread is alive: it joins this thread (in `finish`)
                    // before it can exit, and it only does so after sending on `stop`.
                    unsafe { libc::pthread_kill(vcpu_thread, SIGRTMIN()) };
                    if stopped.recv_timeout(KICK_INTERVAL) != Err(RecvTimeoutError::Timeout) {
                        return;
                    }
                }
            })
            .map_err(|e| VmmError::Host("spawning the watchdog thread", e))?;
        Ok(Watchdog {
            expired,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// Whether the deadline has passed.
    pub fn expired(&self) -> bool {
        self.expired.load(Ordering::SeqCst)
    }

    /// Stops the watchdog and waits for its thread.
    pub fn finish(mut self) {
        self.stop_and_join();
    }

    fn stop_and_join(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.stop_and_join();
    }
}
