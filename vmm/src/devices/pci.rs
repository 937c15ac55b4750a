//! PCI configuration space through configuration mechanism 1 (the address register at
//! 0xcf8, the data window at 0xcfc–0xcff), with one device on it: a host bridge at
//! 00:00.0 that has no BARs and no interrupt — what a microVM's PCI root looks like.
//!
//! Why: with no configuration mechanism at all, a distribution kernel booted without
//! `pci=off` prints `PCI: Fatal: No config space access function found`; with this one it
//! finds type 1 access (Linux's `pci_check_type1` writes 0x80000000 to 0xcf8 and reads it
//! back; `pci_sanity_check` then looks for a host bridge on bus 0), scans bus 0, finds the
//! bridge and nothing else, and goes on quietly. Every other bus/device/function reads
//! all ones, as an empty slot does.
//!
//! The address register and the data window are two bus entries (0xcf9 between them is
//! the ACPI reset register, `acpi_pm`'s), sharing the address through [`PciConfig`].

use std::cell::Cell;
use std::rc::Rc;

use super::bus::{DeviceAction, PortDevice};

/// The address register's port (a 32-bit register; byte accesses to 0xcf8–0xcfb are
/// not it).
pub const PCI_CONFIG_ADDRESS_PORT: u16 = 0xcf8;
/// The data window's first port.
pub const PCI_CONFIG_DATA_PORT: u16 = 0xcfc;
/// The data window's span.
pub const PCI_CONFIG_DATA_SPAN: u16 = 4;

/// Address register: configuration access enabled.
const ADDRESS_ENABLE: u32 = 1 << 31;
/// Address register bits naming bus, device and function (the register number aside).
const ADDRESS_BDF: u32 = 0x00ff_ff00;
/// The writable bits of the address register (bits 30:24 and 1:0 are reserved, zero).
const ADDRESS_WRITABLE: u32 = ADDRESS_ENABLE | ADDRESS_BDF | 0xfc;

/// The host bridge's identity: vendor Intel, device 0x0d57 (the ID Cloud Hypervisor's
/// PCI root uses; no Linux quirk matches it), class 06:00:00 (host bridge).
const HOST_BRIDGE_VENDOR: u16 = 0x8086;
const HOST_BRIDGE_DEVICE: u16 = 0x0d57;
const CLASS_HOST_BRIDGE: [u8; 3] = [0x00, 0x00, 0x06];

/// The two halves of configuration mechanism 1.
pub struct PciConfig {
    address: Rc<Cell<u32>>,
    host_bridge: [u8; 256],
}

/// The address register (0xcf8, dword accesses).
pub struct PciConfigAddress(Rc<Cell<u32>>);

impl PciConfig {
    /// An empty bus 0 with the host bridge, and its address register.
    pub fn new() -> (Self, PciConfigAddress) {
        let mut host_bridge = [0u8; 256];
        host_bridge[0..2].copy_from_slice(&HOST_BRIDGE_VENDOR.to_le_bytes());
        host_bridge[2..4].copy_from_slice(&HOST_BRIDGE_DEVICE.to_le_bytes());
        host_bridge[9..12].copy_from_slice(&CLASS_HOST_BRIDGE);
        let address = Rc::new(Cell::new(0));
        (
            PciConfig {
                address: address.clone(),
                host_bridge,
            },
            PciConfigAddress(address),
        )
    }

    /// The host bridge's configuration space offset the current address selects, if
    /// it selects the host bridge (00:00.0) with access enabled.
    fn host_bridge_offset(&self, window_offset: u16) -> Option<usize> {
        let a = self.address.get();
        (a & ADDRESS_ENABLE != 0 && a & ADDRESS_BDF == 0)
            .then(|| (a & 0xfc) as usize + usize::from(window_offset & 3))
    }
}

impl PortDevice for PciConfigAddress {
    fn read(&mut self, _offset: u16, data: &mut [u8]) {
        if data.len() == 4 {
            data.copy_from_slice(&self.0.get().to_le_bytes());
        } else {
            data.fill(0xff);
        }
    }

    fn write(&mut self, _offset: u16, data: &[u8]) -> DeviceAction {
        if let Ok(b) = <[u8; 4]>::try_from(data) {
            self.0.set(u32::from_le_bytes(b) & ADDRESS_WRITABLE);
        }
        DeviceAction::None
    }
}

impl PortDevice for PciConfig {
    fn read(&mut self, offset: u16, data: &mut [u8]) {
        match self.host_bridge_offset(offset) {
            Some(at) => {
                for (i, b) in data.iter_mut().enumerate() {
                    *b = self.host_bridge.get(at + i).copied().unwrap_or(0);
                }
            }
            None => data.fill(0xff),
        }
    }

    /// The host bridge has no writable register that changes anything: its command
    /// register has no memory or I/O space to enable, and it has no BARs, so a BAR
    /// sizing write reads back zero ("not implemented"). Writes are dropped.
    fn write(&mut self, _offset: u16, _data: &[u8]) -> DeviceAction {
        DeviceAction::None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read32(data: &mut PciConfig, addr: &mut PciConfigAddress, address: u32) -> u32 {
        addr.write(0, &address.to_le_bytes());
        let mut v = [0u8; 4];
        data.read(0, &mut v);
        u32::from_le_bytes(v)
    }

    #[test]
    fn test_type1_check_reads_back_the_enable_bit() {
        let (_, mut addr) = PciConfig::new();
        addr.write(0, &0x8000_0000u32.to_le_bytes());
        let mut v = [0u8; 4];
        addr.read(0, &mut v);
        assert_eq!(u32::from_le_bytes(v), 0x8000_0000);
        // Reserved bits read as zero.
        addr.write(0, &0xffff_ffffu32.to_le_bytes());
        addr.read(0, &mut v);
        assert_eq!(u32::from_le_bytes(v), ADDRESS_WRITABLE);
    }

    #[test]
    fn test_host_bridge_at_00_00_0_and_empty_slots_elsewhere() {
        let (mut data, mut addr) = PciConfig::new();
        assert_eq!(read32(&mut data, &mut addr, 0x8000_0000), 0x0d57_8086);
        assert_eq!(read32(&mut data, &mut addr, 0x8000_0008) >> 8, 0x06_0000);
        // Device 1, function 1, bus 1: nothing there.
        for a in [0x8000_0800, 0x8000_0100, 0x8001_0000] {
            assert_eq!(read32(&mut data, &mut addr, a), u32::MAX);
        }
        // Access disabled: all ones even for the bridge.
        assert_eq!(read32(&mut data, &mut addr, 0), u32::MAX);
        // A BAR sizing write leaves the BAR reading zero.
        addr.write(0, &0x8000_0010u32.to_le_bytes());
        data.write(0, &u32::MAX.to_le_bytes());
        assert_eq!(read32(&mut data, &mut addr, 0x8000_0010), 0);
    }

    #[test]
    fn test_byte_and_word_reads_inside_the_window() {
        let (mut data, mut addr) = PciConfig::new();
        addr.write(0, &0x8000_0008u32.to_le_bytes());
        let mut b = [0u8; 1];
        data.read(3, &mut b);
        assert_eq!(b[0], 0x06, "class code's base class at offset 0x0b");
        let mut w = [0u8; 2];
        addr.write(0, &0x8000_0000u32.to_le_bytes());
        data.read(2, &mut w);
        assert_eq!(u16::from_le_bytes(w), HOST_BRIDGE_DEVICE);
        // A byte access to the address register is not the register.
        addr.write(0, &[0x12]);
        let mut v = [0u8; 4];
        addr.read(0, &mut v);
        assert_eq!(u32::from_le_bytes(v), 0x8000_0000);
    }
}
