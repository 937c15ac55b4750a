//! Engine logging through the host I/O ring (`engine.log` in the run's output directory).
//! The engine is the ring's only producer; the VMM formatted the ring before entry.
//! Lines are formatted into a fixed buffer (longer lines are truncated); the doorbell is
//! rung past the ring's batch threshold, when a record does not fit, and on [`flush`].

use core::cell::UnsafeCell;
use core::fmt::{self, Write};

use kpin_abi::io_ring::{Kind, LogLevel, Producer, RingError};
use kpin_abi::ports::{DOORBELL_PORT, ENGINE_FAILURE_PORT};
use kpin_abi::stolen::{IO_RING_BYTES, IO_RING_OFFSET, WINDOW_VA};

use crate::ring0::gate;
use crate::ring0::layout::fail_code;

/// Longest log line in bytes.
const LINE_BYTES: usize = 1024;
/// Console bytes batched before they go to the ring however the guest goes on.
const CONSOLE_BYTES: usize = 512;

struct Slot(UnsafeCell<Option<Producer>>);
// SAFETY: one vCPU, and logging runs only at CPL 3 in the engine's main flow or in the
// fault reporter (which runs with interrupts off after the main flow stopped).
unsafe impl Sync for Slot {}

static RING: Slot = Slot(UnsafeCell::new(None));

fn producer() -> Option<&'static mut Producer> {
    // SAFETY: see `Slot`: no two references are alive at once.
    unsafe { (*RING.0.get()).as_mut() }
}

struct Console(UnsafeCell<([u8; CONSOLE_BYTES], usize)>);
// SAFETY: as for `Slot`: one vCPU, used only from the engine's main flow at CPL 3 (the
// virtual CPU's port I/O and the run loop).
unsafe impl Sync for Console {}

/// Bytes the guest wrote to COM1's THR that the engine batches
/// (`guest_engine::vcpu::LineStatusCache::batches_thr`), and how many.
static CONSOLE: Console = Console(UnsafeCell::new(([0; CONSOLE_BYTES], 0)));

/// Batches one byte the guest wrote to COM1's transmit register; a full batch goes to
/// the ring at once.
pub fn console_byte(b: u8) {
    // SAFETY: see `Console`: no other reference to it is alive.
    let (buf, len) = unsafe { &mut *CONSOLE.0.get() };
    buf[*len] = b;
    *len += 1;
    if *len == CONSOLE_BYTES {
        push_console();
    }
}

/// Hands the batched console bytes to the VMM's UART now (a ring record and the
/// doorbell): before the guest's next port access through the gate, a `hlt`, an
/// interrupt, and every [`flush`].
pub fn console_flush() {
    // SAFETY: see `Console`.
    if unsafe { (*CONSOLE.0.get()).1 } > 0 {
        flush();
    }
}

/// Pushes the batched console bytes as one record.
fn push_console() {
    // SAFETY: see `Console`.
    let (buf, len) = unsafe { &mut *CONSOLE.0.get() };
    if *len == 0 {
        return;
    }
    let n = core::mem::take(len);
    // A ring that cannot take them even after a doorbell is broken; the bytes are lost
    // like the log line that would report it.
    let _ = push(Kind::Console, 0, &buf[..n]);
}

/// Attaches to the I/O ring in the stolen region.
pub fn init() -> Result<(), RingError> {
    let base = (WINDOW_VA + IO_RING_OFFSET) as *mut u8;
    // SAFETY: the window maps the stolen region, where the VMM formatted a ring of
    // IO_RING_BYTES at IO_RING_OFFSET; the engine is its only producer.
    let p = unsafe { Producer::attach(base, IO_RING_BYTES as usize)? };
    // SAFETY: see `Slot`.
    unsafe { *RING.0.get() = Some(p) };
    Ok(())
}

/// Rings the doorbell so that the host drains the ring now (batched console bytes
/// included).
pub fn flush() {
    push_console();
    if let Some(p) = producer() {
        if p.used() > 0 {
            p.note_doorbell();
            gate::notify(DOORBELL_PORT, 0);
        }
    }
}

/// Doorbells rung so far (each is one VM exit).
pub fn doorbells() -> u64 {
    producer().map_or(0, |p| p.doorbells())
}

/// Appends one record, ringing the doorbell when the ring is full or past its threshold.
pub fn push(kind: Kind, file: u16, payload: &[u8]) -> Result<(), RingError> {
    let p = producer().ok_or(RingError::BadHeader)?;
    let r = match p.push(kind, file, payload) {
        Err(RingError::Full) => {
            p.note_doorbell();
            gate::notify(DOORBELL_PORT, 0);
            p.push(kind, file, payload)
        }
        r => r,
    };
    if p.wants_doorbell() {
        p.note_doorbell();
        gate::notify(DOORBELL_PORT, 0);
    }
    r
}

struct Line {
    buf: [u8; LINE_BYTES],
    len: usize,
}

impl Write for Line {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let n = s.len().min(LINE_BYTES - self.len);
        self.buf[self.len..self.len + n].copy_from_slice(&s.as_bytes()[..n]);
        self.len += n;
        Ok(())
    }
}

/// Formats and logs one line.
pub fn write(level: LogLevel, args: fmt::Arguments<'_>) {
    let mut line = Line {
        buf: [0; LINE_BYTES],
        len: 0,
    };
    let _ = line.write_fmt(args);
    // A log line that cannot be written has nowhere else to go.
    let _ = push(Kind::Log, level as u16, &line.buf[..line.len]);
}

/// Ends the run: flushes the log and writes the failure port, which the VMM treats as the
/// engine's final report (exit status 3).
pub fn fail() -> ! {
    flush();
    gate::notify(ENGINE_FAILURE_PORT, fail_code::REPORTED);
    loop {
        core::hint::spin_loop();
    }
}

/// `log!(Info, "fmt", args…)`: one line into `engine.log`.
#[macro_export]
macro_rules! log {
    ($level:ident, $($arg:tt)*) => {
        $crate::ring0::log::write(kpin_abi::io_ring::LogLevel::$level, format_args!($($arg)*))
    };
}
