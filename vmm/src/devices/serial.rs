//! COM1: a 16550 UART (vm-superio) whose output goes to the host console and, optionally,
//! to a file. Its interrupt is raised through an irqfd on the in-kernel PIC's IRQ 4.
//!
//! The console sink also watches the guest's lines for a Linux kernel panic, so that a
//! panicking guest ends the run as a crash even if it then resets the machine.
//!
//! It takes no input from the host: the engine relies on that to answer the guest's
//! line-status reads itself once it has seen the value (`guest_engine::vcpu::uart_status`;
//! only loopback mode can then set Data Ready). Feeding input would need that cache to
//! learn about it.

use std::cell::{Cell, RefCell};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::rc::Rc;

use vm_superio::{Serial, Trigger};
use vmm_sys_util::eventfd::EventFd;

use super::bus::{DeviceAction, PortDevice};

/// COM1's first port (`kpin_abi::x86`).
pub use kpin_abi::x86::COM1_PORT;
/// Number of UART registers.
pub const COM1_PORT_SPAN: u16 = 8;
/// COM1's ISA interrupt line.
pub const COM1_IRQ: u32 = 4;
/// A console line containing one of these marks a guest kernel panic: Linux's, and the
/// mini-kernel's (which then resets the machine, which would otherwise look clean).
const PANIC_MARKS: &[&str] = &["Kernel panic - not syncing", "MINIKERNEL-PANIC"];
/// Longest line kept for matching; longer lines are matched on their first bytes.
const LINE_KEEP_BYTES: usize = 512;

/// Raises the UART interrupt by signalling an eventfd registered as an irqfd.
pub struct IrqTrigger(pub EventFd);

impl Trigger for IrqTrigger {
    type E = std::io::Error;
    fn trigger(&self) -> std::io::Result<()> {
        self.0.write(1)
    }
}

/// What the console has seen that the run loop cares about.
#[derive(Default)]
pub struct ConsoleWatch {
    /// Set when a kernel-panic line went by.
    pub panicked: Cell<bool>,
    /// Bytes the guest wrote to the console.
    pub bytes: Cell<u64>,
}

/// Where console bytes go. The UART flushes after every byte; a batch of bytes the
/// engine held (`Com1::transmitter`) is flushed once at its end instead: a Linux boot's
/// ~16 600 console bytes were two `write` system calls each, on the vCPU thread.
pub struct ConsoleSink {
    echo_stdout: bool,
    file: Option<BufWriter<File>>,
    line: Vec<u8>,
    watch: Rc<ConsoleWatch>,
    /// Set while a batch is written: the UART's per-byte flushes wait for its end.
    batch: bool,
}

impl ConsoleSink {
    /// A sink echoing to stdout if `echo_stdout`, copying to `file` if given.
    pub fn new(echo_stdout: bool, file: Option<File>, watch: Rc<ConsoleWatch>) -> Self {
        ConsoleSink {
            echo_stdout,
            file: file.map(BufWriter::new),
            line: Vec::new(),
            watch,
            batch: false,
        }
    }

    fn watch_byte(&mut self, b: u8) {
        if b == b'\n' {
            let line = String::from_utf8_lossy(&self.line);
            if PANIC_MARKS.iter().any(|m| line.contains(m)) {
                self.watch.panicked.set(true);
            }
            self.line.clear();
        } else if self.line.len() < LINE_KEEP_BYTES {
            self.line.push(b);
        }
    }
}

impl Write for ConsoleSink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        for &b in buf {
            self.watch_byte(b);
        }
        self.watch
            .bytes
            .set(self.watch.bytes.get() + buf.len() as u64);
        // A closed or failing stdout (`kpin run | head`) ends the echo, never the copy in
        // the console file.
        if self.echo_stdout && std::io::stdout().lock().write_all(buf).is_err() {
            self.echo_stdout = false;
        }
        if let Some(f) = self.file.as_mut() {
            f.write_all(buf)?;
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        if self.batch {
            return Ok(());
        }
        if self.echo_stdout && std::io::stdout().lock().flush().is_err() {
            self.echo_stdout = false;
        }
        if let Some(f) = self.file.as_mut() {
            f.flush()?;
        }
        Ok(())
    }
}

/// The UART behind COM1.
pub type Uart = Serial<IrqTrigger, vm_superio::serial::NoEvents, ConsoleSink>;

/// COM1 on the port bus. The UART is shared with the host I/O ring's daemon, which
/// writes the transmit bytes the engine batched (`kpin_abi::io_ring::Kind::Console`)
/// into it as the guest's own `out`s would have.
pub struct Com1(Rc<RefCell<Uart>>);

impl Com1 {
    /// COM1 backed by `uart`.
    pub fn new(uart: Uart) -> Self {
        Com1(Rc::new(RefCell::new(uart)))
    }

    /// Writes bytes to the transmit register, one `out` each, in order (what the
    /// engine's batched console records stand for), and flushes the console once.
    pub fn transmitter(&self) -> impl FnMut(&[u8]) + 'static {
        let uart = self.0.clone();
        move |bytes| {
            let mut uart = uart.borrow_mut();
            uart.writer_mut().batch = true;
            for &b in bytes {
                // As for a guest `out`: a failed console write must not stop the guest.
                let _ = uart.write(0, b);
            }
            let sink = uart.writer_mut();
            sink.batch = false;
            let _ = sink.flush();
        }
    }
}

impl PortDevice for Com1 {
    fn read(&mut self, offset: u16, data: &mut [u8]) {
        let v = u8::try_from(offset).map_or(0xff, |o| self.0.borrow_mut().read(o));
        data.fill(v);
    }

    fn write(&mut self, offset: u16, data: &[u8]) -> DeviceAction {
        if let (Ok(o), Some(&v)) = (u8::try_from(offset), data.first()) {
            // A failed console write (e.g. a closed stdout) must not stop the guest.
            let _ = self.0.borrow_mut().write(o, v);
        }
        DeviceAction::None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_panic_line_is_detected_and_bytes_counted() {
        let watch = Rc::new(ConsoleWatch::default());
        let mut sink = ConsoleSink::new(false, None, watch.clone());
        sink.write_all(b"[ 1.0] ok\n").unwrap();
        assert!(!watch.panicked.get());
        sink.write_all(b"[ 2.0] Kernel panic - not syncing: VFS\n")
            .unwrap();
        assert!(watch.panicked.get());
        assert_eq!(watch.bytes.get(), 49);
        let watch = Rc::new(ConsoleWatch::default());
        let mut sink = ConsoleSink::new(false, None, watch.clone());
        sink.write_all(b"MINIKERNEL-PANIC vector=14 err=0x5\n")
            .unwrap();
        assert!(watch.panicked.get());
    }

    #[test]
    fn test_uart_transmits_to_sink_file() {
        let dir = std::env::temp_dir().join(format!("kpin-serial-{}", std::process::id()));
        let watch = Rc::new(ConsoleWatch::default());
        let file = File::create(&dir).unwrap();
        let sink = ConsoleSink::new(false, Some(file), watch);
        let evt = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let mut com = Com1::new(Serial::new(IrqTrigger(evt), sink));
        for b in b"hi" {
            com.write(0, &[*b]);
        }
        // Bytes batched by the engine reach the same UART, in order.
        (com.transmitter())(b"!\n");
        let mut lsr = [0];
        com.read(5, &mut lsr);
        assert_eq!(lsr[0] & 0x20, 0x20, "THR empty");
        drop(com);
        assert_eq!(std::fs::read(&dir).unwrap(), b"hi!\n");
        std::fs::remove_file(dir).unwrap();
    }
}
