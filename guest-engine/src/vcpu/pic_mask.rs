//! The 8259 PICs' interrupt mask registers (IMR), answered without a port exit when
//! known.
//!
//! Linux's i8259 driver reads the IMR before it masks and acknowledges every interrupt
//! (`mask_and_ack_8259A`: "DUMMY - (do we need this?)"), a gate round trip and a VM exit
//! each. The IMR changes only through the guest's own writes, which all pass through the
//! virtual CPU, so it is known after a write of it (OCW1) or a read through the gate.
//!
//! The device behind the gate is KVM's in-kernel PIC, whose rules this follows
//! (`arch/x86/kvm/i8259.c`): ICW1 (a command-port write with bit 4 set) starts an
//! initialization in which the next data-port writes are ICW2, ICW3 (always, single
//! mode is not supported) and ICW4 if ICW1 asked for it — not the IMR — and it resets
//! the IMR; an OCW3 with the poll bit makes the next read of *either* port a poll (an
//! interrupt acknowledge), which must reach the device. Anything the cache cannot
//! follow (a 16- or 32-bit access spanning PIC ports) forgets what it knew.

/// The master PIC's command port (its data port, the IMR, is `+ 1`).
pub const MASTER_CMD: u16 = 0x20;
/// The slave PIC's command port.
pub const SLAVE_CMD: u16 = 0xa0;

/// ICW1: the command-port bit that starts an initialization.
const ICW1_INIT: u8 = 1 << 4;
/// ICW1: an ICW4 follows.
const ICW1_IC4: u8 = 1 << 0;
/// OCW3 is a command-port write with bits 4:3 = 01.
const OCW3_MASK: u8 = 0x18;
const OCW3_TAG: u8 = 0x08;
/// OCW3: poll command.
const OCW3_POLL: u8 = 1 << 2;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Pic {
    /// The IMR, when known.
    imr: Option<u8>,
    /// Initialization words still expected on the data port.
    icws_left: u8,
    /// The next read of this PIC is a poll.
    poll: bool,
}

/// What the engine knows of both PICs' masks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PicMaskCache {
    pics: [Pic; 2],
    /// IMR reads answered from the cache.
    pub answered: u64,
}

/// The PIC (0 master, 1 slave) and whether `port` is its data port.
fn which(port: u16) -> Option<(usize, bool)> {
    match port {
        MASTER_CMD => Some((0, false)),
        0x21 => Some((0, true)),
        SLAVE_CMD => Some((1, false)),
        0xa1 => Some((1, true)),
        _ => None,
    }
}

/// Whether an access of `size` bytes at `port` covers a PIC port other than as one byte.
fn wide_over_pics(port: u16, size: u8) -> bool {
    size != 1 && (port..port.saturating_add(u16::from(size))).any(|p| which(p).is_some())
}

impl PicMaskCache {
    /// The value of an `in` of `size` bytes at `port`, if known without the device.
    pub fn answer(&mut self, port: u16, size: u8) -> Option<u32> {
        let (i, true) = which(port)? else {
            return None;
        };
        let p = &self.pics[i];
        if size != 1 || p.icws_left != 0 || p.poll {
            return None;
        }
        let v = p.imr?;
        self.answered += 1;
        Some(u32::from(v))
    }

    /// The PIC a one-byte access at `port` reaches and whether it is the data port;
    /// `None` for other ports, and after forgetting everything for a wide access that
    /// covers a PIC port.
    fn reached(&mut self, port: u16, size: u8) -> Option<(&mut Pic, bool)> {
        if wide_over_pics(port, size) {
            *self = PicMaskCache {
                answered: self.answered,
                ..PicMaskCache::default()
            };
            return None;
        }
        let (i, data) = which(port)?;
        Some((&mut self.pics[i], data))
    }

    /// The device answered an `in` of `size` bytes at `port` with `value`.
    pub fn read_done(&mut self, port: u16, size: u8, value: u32) {
        let Some((p, data)) = self.reached(port, size) else {
            return;
        };
        if core::mem::take(&mut p.poll) {
            return;
        }
        if data && p.icws_left == 0 {
            p.imr = Some(value as u8);
        }
    }

    /// The guest wrote `value` (`size` bytes) to `port`.
    pub fn write(&mut self, port: u16, size: u8, value: u32) {
        let Some((p, data)) = self.reached(port, size) else {
            return;
        };
        let v = value as u8;
        if data {
            if p.icws_left > 0 {
                p.icws_left -= 1;
            } else {
                p.imr = Some(v);
            }
        } else if v & ICW1_INIT != 0 {
            *p = Pic {
                imr: None,
                icws_left: 2 + (v & ICW1_IC4),
                poll: false,
            };
        } else if v & OCW3_MASK == OCW3_TAG && v & OCW3_POLL != 0 {
            p.poll = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_imr_known_after_a_read_or_an_ocw1() {
        let mut c = PicMaskCache::default();
        assert_eq!(c.answer(0x21, 1), None);
        c.read_done(0x21, 1, 0xfb);
        assert_eq!(c.answer(0x21, 1), Some(0xfb));
        c.write(0xa1, 1, 0xef);
        assert_eq!(c.answer(0xa1, 1), Some(0xef));
        assert_eq!(c.answer(0x20, 1), None, "IRR/ISR reads go to the device");
        assert_eq!(c.answered, 2);
    }

    #[test]
    fn test_initialization_words_are_not_the_imr() {
        let mut c = PicMaskCache::default();
        c.write(0x21, 1, 0xff);
        // Linux's init_8259A: ICW1 with ICW4, vector base, cascade, 8086 mode.
        c.write(0x20, 1, 0x11);
        assert_eq!(c.answer(0x21, 1), None, "reset by ICW1");
        for icw in [0x30, 0x04, 0x01] {
            c.write(0x21, 1, icw);
            assert_eq!(c.answer(0x21, 1), None);
        }
        c.write(0x21, 1, 0xfb);
        assert_eq!(c.answer(0x21, 1), Some(0xfb));
        // Without ICW4: two words, then the IMR.
        c.write(0xa0, 1, 0x10);
        c.write(0xa1, 1, 0x38);
        c.write(0xa1, 1, 0x02);
        c.write(0xa1, 1, 0x7f);
        assert_eq!(c.answer(0xa1, 1), Some(0x7f));
    }

    #[test]
    fn test_a_poll_read_goes_to_the_device_and_teaches_nothing() {
        let mut c = PicMaskCache::default();
        c.write(0x21, 1, 0xfe);
        c.write(0x20, 1, 0x0c);
        assert_eq!(c.answer(0x21, 1), None, "poll pending");
        c.read_done(0x21, 1, 0x80);
        assert_eq!(c.answer(0x21, 1), Some(0xfe));
        // OCW2 (EOI) and OCW3 register selects change nothing.
        c.write(0x20, 1, 0x60);
        c.write(0x20, 1, 0x0b);
        assert_eq!(c.answer(0x21, 1), Some(0xfe));
    }

    #[test]
    fn test_wide_accesses_forget_everything() {
        let mut c = PicMaskCache::default();
        c.write(0x21, 1, 0xfe);
        c.write(0xa1, 1, 0xff);
        c.write(0x1f, 2, 0);
        assert_eq!((c.answer(0x21, 1), c.answer(0xa1, 1)), (None, None));
        c.write(0x21, 1, 0xfe);
        c.read_done(0x20, 2, 0);
        assert_eq!(c.answer(0x21, 1), None);
        assert_eq!(c.answer(0x21, 2), None);
        c.write(0x22, 4, 0);
        c.write(0x21, 1, 0xfe);
        assert_eq!(c.answer(0x21, 1), Some(0xfe), "0x22.. is not a PIC port");
    }
}
