//! PCI configuration mechanism 1 answered inside the engine.
//!
//! A booting Linux without `pci=off` reads configuration space a few hundred times
//! (the early quirks' scan of bus 0, `pci_check_type1`, the PCI probe): an `out` of the
//! address to 0xcf8 and an `in` from the data window 0xcfc–0xcff each, every one a gate
//! call and a VM exit. The VMM's model (`vmm/src/devices/pci.rs`) is a host bridge at
//! 00:00.0 with read-only bytes and all ones elsewhere, described once in
//! `kpin_abi::pci`; what a read returns depends only on the address register. So the
//! engine keeps the guest's address register (the *latch*) itself and answers reads
//! from the shared description:
//!
//! * a dword `out` to 0xcf8 sets the latch and is absorbed (the VMM's register keeps
//!   its old value until the latch is written back); a byte or word `out` there is
//!   absorbed too, as the VMM drops it;
//! * an `in` from 0xcf8 and from the data window is answered once the latch is known
//!   (byte and word reads of 0xcf8 are all ones, not the register, as in the VMM);
//! * an `out` to the data window reaches the VMM, after the latch is written back;
//! * before a native detach the latch is written back
//!   ([`PciConfigCache::unsent_latch`]), so the VMM's register holds
//!   the guest's value whenever anything but the engine could observe it.
//!
//! The latch is unknown when the engine starts (the guest may have run natively): until
//! the guest writes 0xcf8, its reads go to the VMM, and a dword read of 0xcf8 teaches the
//! engine the VMM's value. While the latch is unknown there is nothing to write back, so
//! a read that reaches the VMM never needs a write-back first.
//!
//! Plain Rust on `kpin_abi` and `core` only: the VMM's tests compile this file against
//! its own model to compare the two (`vmm/src/devices/pci.rs`).

use kpin_abi::pci::{self, ADDRESS_PORT, DATA_PORT, DATA_SPAN};

/// Where an `out` the guest made to a port goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PciOut {
    /// Kept in the engine (an address register write).
    Absorb,
    /// To the device, after writing `latch_first` (a dword) to 0xcf8 if given.
    Device {
        /// The latch to write back first.
        latch_first: Option<u32>,
    },
}

/// What the engine knows of the PCI address register.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PciConfigCache {
    /// The guest's address register, once known.
    latch: Option<u32>,
    /// What the VMM's register holds, when known (differs from `latch` while a write
    /// is absorbed).
    device: Option<u32>,
    /// Reads answered in the engine.
    pub answered: u64,
    /// Writes kept in the engine.
    pub absorbed: u64,
}

/// Whether the VMM routes an access at `port` to its PCI model (its bus routes by the
/// first port: 0xcf8 for the address register, 0xcfc–0xcff for the data window).
fn reaches_pci(port: u16) -> bool {
    port == ADDRESS_PORT || (DATA_PORT..DATA_PORT + DATA_SPAN).contains(&port)
}

impl PciConfigCache {
    /// The value of an `in` of `size` bytes at `port`, if known without the device.
    pub fn answer(&mut self, port: u16, size: u8) -> Option<u32> {
        let mut b = [0u8; 4];
        let data = &mut b[..usize::from(size.min(4))];
        if port == ADDRESS_PORT && data.len() == 4 {
            data.copy_from_slice(&self.latch?.to_le_bytes());
        } else if port == ADDRESS_PORT {
            data.fill(0xff);
        } else if reaches_pci(port) {
            pci::read_data(self.latch?, port - DATA_PORT, data);
        } else {
            return None;
        }
        self.answered += 1;
        Some(u32::from_le_bytes(b))
    }

    /// The device answered an `in` of `size` bytes at `port` with `value`.
    pub fn read_done(&mut self, port: u16, size: u8, value: u32) {
        if port == ADDRESS_PORT && size == 4 {
            self.latch = Some(value);
            self.device = Some(value);
        }
    }

    /// Routes an `out` of `size` bytes of `value` at `port` and updates what is known.
    pub fn out(&mut self, port: u16, size: u8, value: u32) -> PciOut {
        if port == ADDRESS_PORT {
            if size == 4 {
                self.latch = Some(pci::address_written(value));
            }
            self.absorbed += 1;
            return PciOut::Absorb;
        }
        PciOut::Device {
            latch_first: if reaches_pci(port) {
                self.write_back()
            } else {
                None
            },
        }
    }

    /// The latch to write to the VMM's address register (a dword `out` to 0xcf8) before
    /// anything else could observe it, if it does not hold it yet; it holds it after.
    fn write_back(&mut self) -> Option<u32> {
        let latch = self.unsent_latch()?;
        self.device = Some(latch);
        Some(latch)
    }

    /// The guest's address register when the VMM's does not hold it (an absorbed
    /// write), to write to 0xcf8 before a native detach.
    pub fn unsent_latch(&self) -> Option<u32> {
        let latch = self.latch?;
        (self.device != Some(latch)).then_some(latch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_reads_go_to_the_device_until_the_latch_is_known() {
        let mut c = PciConfigCache::default();
        assert_eq!(c.answer(0xcf8, 4), None);
        assert_eq!(c.answer(0xcfc, 4), None);
        assert_eq!(c.answer(0xcf8, 1), Some(0xff), "not the register");
        assert_eq!(c.answer(0xcf9, 1), None, "the reset register");
        assert_eq!(c.answer(0x3f8, 1), None);
        c.read_done(0xcf8, 2, 0x1234);
        assert_eq!(c.answer(0xcfc, 4), None, "a word read teaches nothing");
        c.read_done(0xcf8, 4, 0x8000_0000);
        assert_eq!(c.answer(0xcfc, 4), Some(0x0d57_8086));
        assert_eq!(c.unsent_latch(), None, "the device holds it");
        assert_eq!(c.answered, 2);
    }

    #[test]
    fn test_address_writes_are_absorbed_and_answered() {
        let mut c = PciConfigCache::default();
        assert_eq!(c.out(0xcf8, 4, 0xffff_ffff), PciOut::Absorb);
        assert_eq!(c.answer(0xcf8, 4), Some(pci::ADDRESS_WRITABLE));
        assert_eq!(c.out(0xcf8, 4, 0x8000_0008), PciOut::Absorb);
        assert_eq!(c.answer(0xcfe, 2), Some(0x0600), "class at offset 0x0a");
        assert_eq!(c.answer(0xcff, 1), Some(0x06));
        assert_eq!(c.out(0xcf8, 1, 0x12), PciOut::Absorb, "dropped by the VMM");
        assert_eq!(c.answer(0xcf8, 4), Some(0x8000_0008));
        assert_eq!(c.out(0xcf8, 4, 0x8000_0800), PciOut::Absorb);
        assert_eq!(c.answer(0xcfc, 4), Some(u32::MAX), "device 1: empty slot");
        assert_eq!(c.answer(0xcfd, 2), Some(0xffff));
        assert_eq!((c.answered, c.absorbed), (6, 4));
    }

    #[test]
    fn test_the_latch_reaches_the_device_before_a_data_write_or_a_detach() {
        let mut c = PciConfigCache::default();
        c.out(0xcf8, 4, 0x8000_0010);
        assert_eq!(
            c.out(0x80, 1, 0),
            PciOut::Device { latch_first: None },
            "not the PCI model"
        );
        assert_eq!(
            c.out(0xcf9, 1, 0),
            PciOut::Device { latch_first: None },
            "the reset register is acpi_pm's"
        );
        assert_eq!(
            c.out(0xcfc, 4, u32::MAX),
            PciOut::Device {
                latch_first: Some(0x8000_0010)
            }
        );
        assert_eq!(
            c.out(0xcfd, 1, 0),
            PciOut::Device { latch_first: None },
            "written back once"
        );
        c.out(0xcf8, 4, 0x8000_0004);
        assert_eq!(c.unsent_latch(), Some(0x8000_0004), "detach");
        assert_eq!(c.write_back(), Some(0x8000_0004));
        assert_eq!(c.unsent_latch(), None);
        // Back to the value the device holds: nothing to write.
        c.out(0xcf8, 4, 0x8000_0010);
        c.out(0xcf8, 4, 0x8000_0004);
        assert_eq!(c.unsent_latch(), None);
    }
}
