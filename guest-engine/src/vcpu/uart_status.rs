//! COM1's line status register answered without a port exit when its value is known.
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

/// COM1's first port (`kpin_abi::x86`).
pub use kpin_abi::x86::COM1_PORT as COM1;
/// The line status register.
pub const LSR: u16 = COM1 + 5;
/// The modem control register.
pub const MCR: u16 = COM1 + 4;
/// MCR.LOOP: loopback mode (THR writes go to the receive buffer).
pub const MCR_LOOP: u8 = 1 << 4;
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

/// What the engine knows of COM1's line status.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LineStatusCache {
    /// The guest's last MCR write, `None` before one (or after a wider access).
    mcr: Option<u8>,
    /// The LSR, when known to be constant.
    lsr: Option<u8>,
    /// The guest's last LCR write.
    lcr: Option<u8>,
    /// The guest's last IER write (with LCR.DLAB clear).
    ier: Option<u8>,
    /// LSR reads answered from the cache.
    pub answered: u64,
}

fn touches_com1(port: u16, size: u8) -> bool {
    let end = port.saturating_add(u16::from(size.max(1)) - 1);
    end >= COM1 && port <= COM1 + 7
}

impl LineStatusCache {
    /// The value of an `in` of `size` bytes at `port`, if known without the device.
    pub fn answer(&mut self, port: u16, size: u8) -> Option<u32> {
        if port != LSR || size != 1 {
            return None;
        }
        let v = self.lsr?;
        self.answered += 1;
        Some(u32::from(v))
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
        } else if size != 1 {
            self.lsr = None;
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
    pub fn write(&mut self, port: u16, size: u8, value: u32) {
        if !touches_com1(port, size) {
            return;
        }
        if size != 1 {
            *self = LineStatusCache {
                answered: self.answered,
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
