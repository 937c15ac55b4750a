//! COM1's line status register (and modem status, likewise) answered without a port
//! exit when its value is known.
//!
//! Linux's 8250 console polls the line status register (LSR, 0x3fd) before every
//! character it transmits, so half of a booting guest's COM1 accesses are LSR reads, each
//! a gate round trip plus a VM exit. The VMM's UART (vm-superio) transmits at once and
//! takes no input from the host (`vmm/src/devices/serial.rs`), so its LSR is constant
//! (transmitter empty and idle) except for Data Ready, which only loopback mode can set
//! (a byte written to THR with MCR.LOOP set enters the receive buffer).
//!
//! [`LineStatusCache`] watches the guest's COM1 accesses (which all pass through the
//! virtual CPU) and knows the LSR only when (1) the guest's last MCR write is known and
//! has LOOP clear and (2) an LSR read through the gate since then returned Data Ready
//! clear — then the receive buffer is empty and nothing can fill it. Anything else (an
//! MCR write setting LOOP, a wider access touching the UART, a state it has not seen)
//! forgets the value and the next reads go through the gate again.
//!
//! It also says when a byte written to the transmit register (THR) may be batched
//! ([`LineStatusCache::batches_thr`]): with the divisor latch closed (LCR.DLAB clear), the
//! transmit interrupt disabled (IER.THRI clear) and loopback off, the VMM's UART does
//! nothing with it but print it — no register, no interrupt changes — so the engine may
//! hand a console line's bytes over in one ring record (`kpin_abi::io_ring::Kind::Console`)
//! instead of a port exit per byte, as long as it hands them over before the guest's next
//! access that reaches the UART. Linux's console clears IER around every message it
//! writes, so a boot's kernel messages travel this way.
//!
//! That IER save/clear/restore is itself three port exits per message (read IER, write
//! 0, write the saved value). IER reads are answered from the guest's last write (the
//! UART reads back the low four bits). An IER write is *absorbed* — kept here, not sent
//! — when it cannot change what the UART does: THRI clear in both the value the UART
//! holds and the new one (the UART raises nothing on such a write: its receive buffer
//! is empty, as the known LSR shows, and only THRI raises an interrupt here). The
//! guest's value is written back ([`LineStatusCache::write_back`]) before any other
//! access reaches the UART and before the guest leaves the engine, so the UART holds it
//! whenever anything could observe it.
//!
//! With IER.THRI set (the tty's interrupt-driven transmit: a process writing to the
//! console) every THR byte reaches the UART, but a run of them need not: the UART prints
//! each byte and raises its THR-empty interrupt only if IIR's THR-empty bit is clear,
//! then sets it, and nothing but an access to the UART clears it again. So a run of THR
//! writes with no other UART access between them leaves the UART as its last write alone
//! would, once the earlier bytes are printed: the cache *holds* the last THR byte
//! ([`OutRoute::Hold`]; the one held before it goes to the console batch) and the
//! embedder sends it through the port ([`LineStatusCache::take_held`]) after the batch,
//! before any other access reaches a device and before the guest leaves the engine or
//! is given an interrupt. The THR-empty interrupt then comes later than on the UART's
//! first write, as a 16550 raises it only when its FIFO has drained; the guest cannot
//! tell the difference.

/// COM1's first port (`kpin_abi::x86`).
pub use kpin_abi::x86::COM1_PORT as COM1;
/// The line status register.
pub const LSR: u16 = COM1 + 5;
/// The modem control register.
pub const MCR: u16 = COM1 + 4;
/// MCR.LOOP: loopback mode (THR writes go to the receive buffer).
pub const MCR_LOOP: u8 = 1 << 4;
/// The modem status register.
pub const MSR: u16 = COM1 + 6;
/// LSR.DR: data ready.
pub const LSR_DR: u8 = 1;
/// The interrupt enable register (with LCR.DLAB clear).
pub const IER: u16 = COM1 + 1;
/// IER.THRI: interrupt when the transmit register empties.
pub const IER_THRI: u8 = 1 << 1;
/// The line control register.
pub const LCR: u16 = COM1 + 3;
/// LCR.DLAB: COM1+0 and COM1+1 are the divisor latch, not THR and IER.
pub const LCR_DLAB: u8 = 1 << 7;
/// The IER bits the UART keeps (vm-superio, as a 16550A: reads back `value & 0x0f`).
pub const IER_VALID: u8 = 0x0f;

/// Where an `out` the guest made to a port goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutRoute {
    /// A THR byte the UART would only print: batch it (see the module's text).
    BatchThr,
    /// A THR byte written with THRI set: hold it, batching `release` (the byte held
    /// before it, already as good as printed).
    Hold {
        /// The previously held byte, for the console batch.
        release: Option<u8>,
    },
    /// An IER write kept in the engine until [`LineStatusCache::write_back`].
    Absorb,
    /// To the device, after sending the held THR byte and then writing back the
    /// absorbed IER value, if given.
    Device {
        /// The held THR byte to send first.
        thr_first: Option<u8>,
        /// The IER value to write to the UART first.
        ier_first: Option<u8>,
    },
}

/// What the engine knows of COM1's line status.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LineStatusCache {
    /// The guest's last MCR write, `None` before one (or after a wider access).
    mcr: Option<u8>,
    /// The LSR, when known to be constant.
    lsr: Option<u8>,
    /// The MSR, when known to be constant: the UART's modem inputs are fixed and
    /// only loopback mode (MCR.LOOP) derives them from MCR (8250 drivers read it on
    /// every interrupt).
    msr: Option<u8>,
    /// The guest's last LCR write.
    lcr: Option<u8>,
    /// The guest's last IER write (with LCR.DLAB clear).
    ier: Option<u8>,
    /// The IER the UART holds (differs from `ier` while a write is absorbed).
    device_ier: Option<u8>,
    /// LSR and IER reads answered from the cache.
    pub answered: u64,
    /// IER writes absorbed.
    pub absorbed: u64,
    /// The THR byte written last with THRI set and not yet sent.
    held: Option<u8>,
    /// THR writes held (each held byte but the last of a run never reaches the port).
    pub held_total: u64,
}

fn touches_com1(port: u16, size: u8) -> bool {
    let end = port.saturating_add(u16::from(size.max(1)) - 1);
    end >= COM1 && port <= COM1 + 7
}

impl LineStatusCache {
    /// The value of an `in` of `size` bytes at `port`, if known without the device.
    pub fn answer(&mut self, port: u16, size: u8) -> Option<u32> {
        let v = match (port, size) {
            (LSR, 1) => self.lsr?,
            (MSR, 1) => self.msr?,
            (IER, 1) if self.dlab_clear() => self.ier? & IER_VALID,
            _ => return None,
        };
        self.answered += 1;
        Some(u32::from(v))
    }

    /// Before an `in` that [`LineStatusCache::answer`] could not answer reaches a
    /// device: the held THR byte to send first (whatever the port), then the IER value
    /// to write back, if the read touches the UART.
    pub fn before_device_read(&mut self, port: u16, size: u8) -> (Option<u8>, Option<u8>) {
        let thr = self.take_held();
        let ier = if touches_com1(port, size) {
            self.write_back()
        } else {
            None
        };
        (thr, ier)
    }

    /// The held THR byte, to send to the UART now (after the console batch): before any
    /// other device access, a `hlt`, an interrupt, the end of the run or a detach.
    pub fn take_held(&mut self) -> Option<u8> {
        self.held.take()
    }

    /// Whether the THR write of `size` bytes at `port` can be held (see the module's
    /// text): THRI set in the UART and in the guest's IER (no absorbed write waits), the
    /// divisor latch closed, loopback off and the LSR known constant.
    fn holds_thr(&self, port: u16, size: u8) -> bool {
        port == COM1
            && size == 1
            && self.dlab_clear()
            && self.lsr.is_some()
            && self.mcr.is_some_and(|m| m & MCR_LOOP == 0)
            && self.unsent_ier().is_none()
            && self.device_ier.is_some_and(|d| d & IER_THRI != 0)
    }

    /// Whether LCR.DLAB is known clear (COM1+0/+1 are THR/RBR and IER).
    fn dlab_clear(&self) -> bool {
        self.lcr.is_some_and(|l| l & LCR_DLAB == 0)
    }

    /// The IER value to write to the UART before an access reaches it (or the guest
    /// leaves the engine), if a write was absorbed; the UART then holds it.
    pub fn write_back(&mut self) -> Option<u8> {
        let guest = self.unsent_ier()?;
        self.device_ier = Some(guest);
        Some(guest)
    }

    /// The guest's IER value when the UART does not hold it (an absorbed write).
    pub fn unsent_ier(&self) -> Option<u8> {
        let guest = self.ier? & IER_VALID;
        (self.device_ier != Some(guest)).then_some(guest)
    }

    /// Whether the IER write of `value` can be absorbed (see the module's text).
    fn absorbs_ier(&self, port: u16, size: u8, value: u32) -> bool {
        port == IER
            && size == 1
            && self.dlab_clear()
            && self.lsr.is_some()
            && self.device_ier.is_some_and(|d| d & IER_THRI == 0)
            && (value as u8) & IER_THRI == 0
    }

    /// Routes an `out` of `size` bytes of `value` at `port` and updates what is known.
    pub fn out(&mut self, port: u16, size: u8, value: u32) -> OutRoute {
        let route = if self.batches_thr(port, size) {
            OutRoute::BatchThr
        } else if self.holds_thr(port, size) {
            self.held_total += 1;
            OutRoute::Hold {
                release: self.held.replace(value as u8),
            }
        } else if self.absorbs_ier(port, size, value) {
            self.absorbed += 1;
            OutRoute::Absorb
        } else {
            OutRoute::Device {
                thr_first: self.take_held(),
                ier_first: if touches_com1(port, size) {
                    self.write_back()
                } else {
                    None
                },
            }
        };
        let ier_reaches_uart = route != OutRoute::Absorb && port == IER && size == 1;
        let dlab_clear = self.dlab_clear();
        self.write(port, size, value);
        if ier_reaches_uart {
            self.device_ier = dlab_clear.then_some(value as u8 & IER_VALID);
        }
        route
    }

    /// The device answered an `in` of `size` bytes at `port` with `value`.
    pub fn read_done(&mut self, port: u16, size: u8, value: u32) {
        if !touches_com1(port, size) {
            return;
        }
        if port == LSR && size == 1 {
            let v = value as u8;
            let no_loop = self.mcr.is_some_and(|m| m & MCR_LOOP == 0);
            self.lsr = (no_loop && v & LSR_DR == 0).then_some(v);
        } else if port == MSR && size == 1 {
            let no_loop = self.mcr.is_some_and(|m| m & MCR_LOOP == 0);
            self.msr = no_loop.then_some(value as u8);
        } else if port == IER && size == 1 && self.dlab_clear() {
            // What the UART holds (any absorbed value was written back before this
            // read went through).
            self.ier = Some(value as u8);
            self.device_ier = Some(value as u8 & IER_VALID);
        } else if size != 1 {
            self.lsr = None;
            self.msr = None;
        }
    }

    /// Whether an `out` of `size` bytes at `port` is a THR write the UART would only
    /// print (see the module's text), so that it may be batched.
    pub fn batches_thr(&self, port: u16, size: u8) -> bool {
        port == COM1
            && size == 1
            && self.lcr.is_some_and(|l| l & LCR_DLAB == 0)
            && self.ier.is_some_and(|i| i & IER_THRI == 0)
            && self.mcr.is_some_and(|m| m & MCR_LOOP == 0)
    }

    /// The guest wrote `value` (`size` bytes) to `port` (before it reaches the device).
    fn write(&mut self, port: u16, size: u8, value: u32) {
        if !touches_com1(port, size) {
            return;
        }
        if size != 1 {
            *self = LineStatusCache {
                answered: self.answered,
                absorbed: self.absorbed,
                held_total: self.held_total,
                ..LineStatusCache::default()
            };
            return;
        }
        let dlab = self.lcr.is_none_or(|l| l & LCR_DLAB != 0);
        match port {
            LCR => self.lcr = Some(value as u8),
            IER if !dlab => self.ier = Some(value as u8),
            // A write whose meaning is unknown (with DLAB known set it is the divisor
            // latch's high byte, and IER keeps its value).
            IER if self.lcr.is_none() => self.ier = None,
            MCR => {
                let m = value as u8;
                self.mcr = Some(m);
                if m & MCR_LOOP != 0 {
                    self.lsr = None;
                    self.msr = None;
                }
            }
            // THR (or the divisor latch): with LOOP clear the byte leaves at once and the
            // LSR is unchanged; in loopback (or an unknown MCR) it may set Data Ready.
            COM1 if self.mcr.is_none_or(|m| m & MCR_LOOP != 0) => self.lsr = None,
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn learned() -> LineStatusCache {
        let mut c = LineStatusCache::default();
        c.write(MCR, 1, 0x0b);
        c.read_done(LSR, 1, 0x60);
        c
    }

    #[test]
    fn test_unknown_until_mcr_written_and_lsr_read() {
        let mut c = LineStatusCache::default();
        assert_eq!(c.answer(LSR, 1), None);
        c.read_done(LSR, 1, 0x60);
        assert_eq!(c.answer(LSR, 1), None, "MCR unknown: loopback possible");
        c.write(MCR, 1, 0x0b);
        assert_eq!(c.answer(LSR, 1), None, "no LSR read since");
        c.read_done(LSR, 1, 0x60);
        assert_eq!(c.answer(LSR, 1), Some(0x60));
        assert_eq!(c.answered, 1);
        c.write(COM1, 1, u32::from(b'x'));
        assert_eq!(c.answer(LSR, 1), Some(0x60), "THR write without loopback");
    }

    #[test]
    fn test_loopback_and_data_ready_forget_the_value() {
        let mut c = learned();
        c.write(MCR, 1, 0x1b);
        assert_eq!(c.answer(LSR, 1), None);
        c.write(COM1, 1, 0x55);
        c.write(MCR, 1, 0x0b);
        c.read_done(LSR, 1, 0x61);
        assert_eq!(c.answer(LSR, 1), None, "a byte is waiting");
        c.read_done(COM1, 1, 0x55);
        c.read_done(LSR, 1, 0x60);
        assert_eq!(c.answer(LSR, 1), Some(0x60));
    }

    #[test]
    fn test_thr_batched_only_with_dlab_thri_and_loop_known_clear() {
        let mut c = LineStatusCache::default();
        assert!(!c.batches_thr(COM1, 1), "nothing known");
        c.write(MCR, 1, 0x0b);
        c.write(LCR, 1, 0x03);
        assert!(!c.batches_thr(COM1, 1), "IER unknown");
        c.write(IER, 1, 0);
        assert!(c.batches_thr(COM1, 1));
        assert!(!c.batches_thr(COM1, 2) && !c.batches_thr(IER, 1));
        c.write(IER, 1, u32::from(IER_THRI));
        assert!(!c.batches_thr(COM1, 1), "the UART would interrupt");
        c.write(LCR, 1, 0x83);
        assert!(!c.batches_thr(COM1, 1), "divisor latch open");
        c.write(IER, 1, 0x00);
        c.write(LCR, 1, 0x03);
        assert!(
            !c.batches_thr(COM1, 1),
            "that write went to the divisor latch: THRI still set"
        );
        c.write(IER, 1, 0x01);
        assert!(c.batches_thr(COM1, 1), "receive interrupts only");
        c.write(MCR, 1, u32::from(MCR_LOOP));
        assert!(!c.batches_thr(COM1, 1), "loopback");
        c.write(MCR, 1, 0x0b);
        c.write(COM1, 2, 0);
        assert!(!c.batches_thr(COM1, 1), "a wide write forgets everything");
    }

    /// Linux's console: LCR, MCR and IER set up, the LSR learned.
    fn console() -> LineStatusCache {
        let mut c = LineStatusCache::default();
        assert_eq!(
            c.out(LCR, 1, 0x03),
            OutRoute::Device {
                thr_first: None,
                ier_first: None
            }
        );
        c.out(MCR, 1, 0x0b);
        c.out(IER, 1, 0x05);
        c.read_done(LSR, 1, 0x60);
        c
    }

    #[test]
    fn test_console_ier_save_clear_restore_stays_in_the_engine() {
        let mut c = console();
        assert_eq!(c.answer(IER, 1), Some(0x05));
        assert_eq!(c.out(IER, 1, 0), OutRoute::Absorb);
        assert_eq!(c.out(COM1, 1, u32::from(b'x')), OutRoute::BatchThr);
        assert_eq!(c.answer(IER, 1), Some(0));
        assert_eq!(c.out(IER, 1, 0x05), OutRoute::Absorb);
        assert_eq!((c.answered, c.absorbed), (2, 2));
        // The UART already holds 0x05: nothing to write back.
        assert_eq!(c.write_back(), None);
    }

    #[test]
    fn test_an_absorbed_value_reaches_the_uart_before_anything_else_does() {
        let mut c = console();
        c.out(IER, 1, 0x01);
        assert_eq!(c.before_device_read(0x80, 1), (None, None), "not the UART");
        assert_eq!(
            c.before_device_read(COM1 + 2, 1),
            (None, Some(0x01)),
            "IIR read"
        );
        assert_eq!(
            c.before_device_read(COM1 + 2, 1),
            (None, None),
            "written back once"
        );
        c.out(IER, 1, 0x00);
        assert_eq!(
            c.out(LCR, 1, 0x83),
            OutRoute::Device {
                thr_first: None,
                ier_first: Some(0x00)
            },
            "before DLAB opens"
        );
        assert_eq!(c.answer(IER, 1), None, "divisor latch open");
        assert_eq!(
            c.out(IER, 1, 0x00),
            OutRoute::Device {
                thr_first: None,
                ier_first: None
            }
        );
    }

    #[test]
    fn test_ier_writes_that_could_interrupt_reach_the_uart() {
        let mut c = console();
        // Setting THRI makes the UART raise its THR-empty interrupt.
        assert_eq!(
            c.out(IER, 1, u32::from(IER_THRI | 1)),
            OutRoute::Device {
                thr_first: None,
                ier_first: None
            }
        );
        // Clearing it again changes what a later THR write would raise.
        assert_eq!(
            c.out(IER, 1, 1),
            OutRoute::Device {
                thr_first: None,
                ier_first: None
            }
        );
        assert_eq!(c.out(IER, 1, 0), OutRoute::Absorb);
        // Unknown LSR (loopback on): nothing is absorbed.
        c.out(MCR, 1, u32::from(MCR_LOOP));
        assert_eq!(
            c.out(IER, 1, 0),
            OutRoute::Device {
                thr_first: None,
                ier_first: None
            }
        );
        // The value read back through the gate is what the UART keeps.
        let mut d = LineStatusCache::default();
        d.out(LCR, 1, 0x03);
        d.read_done(IER, 1, 0x0f);
        assert_eq!(d.answer(IER, 1), Some(0x0f));
    }

    /// The console after the tty started an interrupt-driven transmit (IER 0x07).
    fn transmitting() -> LineStatusCache {
        let mut c = console();
        assert_eq!(
            c.out(IER, 1, 0x07),
            OutRoute::Device {
                thr_first: None,
                ier_first: None
            }
        );
        c
    }

    #[test]
    fn test_a_run_of_thr_writes_with_thri_reaches_the_uart_as_its_last_byte() {
        let mut c = transmitting();
        // serial8250_tx_chars: the IIR read goes to the UART, then the bytes.
        assert_eq!(c.before_device_read(COM1 + 2, 1), (None, None));
        assert_eq!(c.out(COM1, 1, 0x61), OutRoute::Hold { release: None });
        assert_eq!(c.answer(LSR, 1), Some(0x60));
        assert_eq!(
            c.out(COM1, 1, 0x62),
            OutRoute::Hold {
                release: Some(0x61)
            }
        );
        assert_eq!(
            c.out(COM1, 1, 0x63),
            OutRoute::Hold {
                release: Some(0x62)
            }
        );
        // The next IIR read: the last byte reaches the UART first.
        assert_eq!(c.before_device_read(COM1 + 2, 1), (Some(0x63), None));
        assert_eq!(c.take_held(), None);
        assert_eq!(c.out(COM1, 1, 0x64), OutRoute::Hold { release: None });
        // stop_tx clears THRI: the byte goes before the IER write.
        assert_eq!(
            c.out(IER, 1, 0x05),
            OutRoute::Device {
                thr_first: Some(0x64),
                ier_first: None
            }
        );
        assert_eq!(c.out(COM1, 1, 0x65), OutRoute::BatchThr, "THRI clear");
        assert_eq!(c.held_total, 4);
    }

    #[test]
    fn test_a_held_byte_goes_before_any_other_device_access_or_at_a_flush() {
        let mut c = transmitting();
        c.out(COM1, 1, 0x61);
        assert_eq!(
            c.out(0x80, 1, 0),
            OutRoute::Device {
                thr_first: Some(0x61),
                ier_first: None
            },
            "another device"
        );
        c.out(COM1, 1, 0x62);
        assert_eq!(c.before_device_read(0xcfc, 4), (Some(0x62), None));
        c.out(COM1, 1, 0x63);
        assert_eq!(
            c.take_held(),
            Some(0x63),
            "hlt, interrupt, detach, poweroff"
        );
    }

    #[test]
    fn test_thr_writes_are_held_only_when_the_uart_holds_thri_and_prints_them() {
        let sends = OutRoute::Device {
            thr_first: None,
            ier_first: None,
        };
        let mut c = transmitting();
        c.out(MCR, 1, u32::from(MCR_LOOP | 0x0b));
        assert_eq!(
            c.out(COM1, 1, 0x61),
            sends,
            "loopback: the byte is received"
        );
        let mut c = transmitting();
        c.out(LCR, 1, 0x83);
        assert_eq!(c.out(COM1, 1, 0x01), sends, "divisor latch");
        let mut c = transmitting();
        c.out(COM1 + 3, 2, 0x0b03);
        assert_eq!(c.out(COM1, 1, 0x61), sends, "state forgotten");
        // The UART's IER unknown (read back never, written with DLAB unknown).
        let mut d = LineStatusCache::default();
        d.out(MCR, 1, 0x0b);
        d.read_done(LSR, 1, 0x60);
        d.out(IER, 1, 0x07);
        d.out(LCR, 1, 0x03);
        assert_eq!(d.out(COM1, 1, 0x61), sends, "THRI in the UART unknown");
    }

    #[test]
    fn test_modem_status_known_outside_loopback() {
        let mut c = LineStatusCache::default();
        c.read_done(MSR, 1, 0xb0);
        assert_eq!(c.answer(MSR, 1), None, "MCR unknown: loopback possible");
        c.out(MCR, 1, 0x0b);
        c.read_done(MSR, 1, 0xb0);
        assert_eq!(c.answer(MSR, 1), Some(0xb0));
        assert_eq!(c.answer(MSR, 2), None);
        c.out(MCR, 1, u32::from(MCR_LOOP | 0x0b));
        assert_eq!(c.answer(MSR, 1), None, "loopback: MSR follows MCR");
        c.read_done(MSR, 1, 0xf0);
        assert_eq!(c.answer(MSR, 1), None);
        c.out(MCR, 1, 0x0b);
        c.read_done(MSR, 1, 0xb0);
        c.out(COM1 + 4, 2, 0x000b);
        assert_eq!(c.answer(MSR, 1), None, "a wide write forgets it");
    }

    #[test]
    fn test_wide_accesses_and_other_ports() {
        let mut c = learned();
        assert_eq!(c.answer(LSR, 2), None);
        assert_eq!(c.answer(COM1 + 6, 1), None);
        c.write(0x80, 1, 0);
        c.write(0x3f0, 4, 0);
        assert_eq!(c.answer(LSR, 1), Some(0x60), "ports outside COM1");
        c.write(COM1 + 3, 2, 0x1b03);
        assert_eq!(c.answer(LSR, 1), None, "a 16-bit write covering MCR");
    }
}
