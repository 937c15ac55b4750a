//! SIGINT and SIGTERM during `kpin run` (part of the `kpin` binary, not the library).
//!
//! The handler does only what is async-signal-safe: it counts the signal and writes its
//! number to a pipe (non-blocking: a full pipe drops the byte, a stop is already on its
//! way then). A thread reads the pipe, says what is happening, and makes the run's
//! [`StopRequest`]: the vCPU loop notices it before its next `KVM_RUN`, and the VMM's stop
//! thread kicks the vCPU thread out of `KVM_RUN` until it does (the signal may have landed
//! on any thread). The run then ends with `Outcome::Interrupted`: the I/O ring is drained,
//! the files so far are kept, and `run.json` says the run is incomplete.
//!
//! A second SIGINT after any stop signal ends kpin at once from the handler (`_exit` with
//! status 130), for a stop that does not come: nothing more is written, so `run.json`
//! still says the run is running (incomplete). Further SIGTERMs are ignored (a stop is
//! already under way).
//!
//! The handlers are installed with `SA_RESTART` only once the guest's images are built
//! (before that, the default action ends kpin, which has written nothing yet).

use std::io::Read;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicI32, AtomicU32, Ordering};

use vmm::vstate::vm::{signal_name, StopRequest};

/// Exit status of a process ended by `signal`, as shells report it: 128 + the number.
pub fn exit_status(signal: i32) -> u8 {
    u8::try_from(128 + signal).unwrap_or(u8::MAX)
}

/// The pipe's write end (-1 before [`install`]).
static PIPE_WRITE: AtomicI32 = AtomicI32::new(-1);
/// Stop signals seen so far.
static SEEN: AtomicU32 = AtomicU32::new(0);

extern "C" fn on_stop_signal(signal: libc::c_int) {
    // SAFETY: __errno_location returns the calling thread's errno, always valid.
    let errno = unsafe { *libc::__errno_location() };
    if SEEN.fetch_add(1, Ordering::SeqCst) > 0 && signal == libc::SIGINT {
        const MSG: &[u8] =
            b"kpin: second SIGINT: exiting at once; files not finished stay unfinished\n";
        // SAFETY: write(2) and _exit(2) are async-signal-safe; MSG is a valid buffer.
        unsafe {
            libc::write(libc::STDERR_FILENO, MSG.as_ptr().cast(), MSG.len());
            libc::_exit(libc::c_int::from(exit_status(libc::SIGINT)));
        }
    }
    let fd = PIPE_WRITE.load(Ordering::SeqCst);
    if fd >= 0 {
        let byte = u8::try_from(signal).unwrap_or(0);
        // SAFETY: write(2) is async-signal-safe; `byte` is a valid one-byte buffer. A full
        // pipe (EAGAIN) loses the byte: a stop is pending then anyway.
        unsafe { libc::write(fd, (&raw const byte).cast(), 1) };
    }
    // SAFETY: as above.
    unsafe { *libc::__errno_location() = errno };
}

/// Installs the SIGINT and SIGTERM handlers and the thread that turns them into `stop`.
/// Call once.
pub fn install(stop: &StopRequest) -> std::io::Result<()> {
    let mut fds = [0; 2];
    // SAFETY: `fds` is a writable array of two ints.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: pipe2 returned two fds that nobody else owns; the write end is kept open for
    // the rest of the process (the handler may use it at any time).
    let mut read_end = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fds[0]) });
    // SAFETY: fcntl on the write end we own; no pointers.
    if unsafe { libc::fcntl(fds[1], libc::F_SETFL, libc::O_NONBLOCK) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    PIPE_WRITE.store(fds[1], Ordering::SeqCst);
    let stop = stop.clone();
    std::thread::Builder::new()
        .name("kpin-signals".into())
        .spawn(move || {
            let mut byte = [0u8];
            // The read retries on EINTR (std does); it ends only if the pipe breaks.
            while read_end.read_exact(&mut byte).is_ok() {
                let signal = i32::from(byte[0]);
                let name = signal_name(signal);
                if stop.request(signal) {
                    eprintln!(
                        "kpin: {name}: stopping the guest; its files so far are kept and run.json will say the run is incomplete (a second SIGINT ends kpin at once)"
                    );
                } else {
                    eprintln!("kpin: {name}: already stopping");
                }
            }
        })?;
    for signal in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: an all-zero sigaction is valid; the fields are set below.
        let mut act: libc::sigaction = unsafe { std::mem::zeroed() };
        act.sa_sigaction = on_stop_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
        act.sa_flags = libc::SA_RESTART;
        // SAFETY: `act.sa_mask` is a valid sigset to fill; sigaction gets valid pointers
        // and a handler that is async-signal-safe.
        let r = unsafe {
            libc::sigfillset(&mut act.sa_mask);
            libc::sigaction(signal, &act, std::ptr::null_mut())
        };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}
