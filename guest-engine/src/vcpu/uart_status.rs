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

/// COM1's base port.
pub const COM1: u16 = 0x3f8;
/// The line status register.
pub const LSR: u16 = COM1 + 5;
/// The modem control register.
pub const MCR: u16 = COM1 + 4;
/// MCR.LOOP: loopback mode (THR writes go to the receive buffer).
pub const MCR_LOOP: u8 = 1 << 4;
/// LSR.DR: data ready.
pub const LSR_DR: u8 = 1;

/// What the engine knows of COM1's line status.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LineStatusCache {
    /// The guest's last MCR write, `None` before one (or after a wider access).
    mcr: Option<u8>,
    /// The LSR, when known to be constant.
    lsr: Option<u8>,
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

    /// The guest wrote `value` (`size` bytes) to `port` (before it reaches the device).
    pub fn write(&mut self, port: u16, size: u8, value: u32) {
        if !touches_com1(port, size) {
            return;
        }
        if size != 1 {
            self.mcr = None;
            self.lsr = None;
            return;
        }
        match port {
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
