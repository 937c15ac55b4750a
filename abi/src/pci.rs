//! PCI configuration mechanism 1 as the VMM models it (`vmm/src/devices/pci.rs`): the
//! address register at 0xcf8, the data window at 0xcfc–0xcff, one host bridge at
//! 00:00.0 and all ones for every other bus/device/function.
//!
//! Shared because the engine answers the guest's configuration reads itself (a port
//! exit costs a gate call and a VM exit; `guest-engine/src/vcpu/pci_config.rs`): both
//! sides read the same bytes through [`read_data`], so the guest sees one device whether
//! it runs natively or under the engine. The host bridge has no writable register, so
//! these bytes never change.

/// The address register's port (a 32-bit register; the VMM routes every access at this
/// port to it, and byte/word accesses are not the register).
pub const ADDRESS_PORT: u16 = 0xcf8;
/// The data window's first port.
pub const DATA_PORT: u16 = 0xcfc;
/// The data window's span.
pub const DATA_SPAN: u16 = 4;

/// Address register: configuration access enabled.
pub const ADDRESS_ENABLE: u32 = 1 << 31;
/// Address register bits naming bus, device and function (the register number aside).
pub const ADDRESS_BDF: u32 = 0x00ff_ff00;
/// The writable bits of the address register (bits 30:24 and 1:0 are reserved, zero).
pub const ADDRESS_WRITABLE: u32 = ADDRESS_ENABLE | ADDRESS_BDF | 0xfc;

/// The host bridge's vendor: Intel.
pub const HOST_BRIDGE_VENDOR: u16 = 0x8086;
/// The host bridge's device ID: 0x0d57, the one Cloud Hypervisor's PCI root uses (no
/// Linux quirk matches it).
pub const HOST_BRIDGE_DEVICE: u16 = 0x0d57;
/// Class code bytes 0x09–0x0b: programming interface, subclass, base class (06:00:00,
/// host bridge).
const CLASS_HOST_BRIDGE: [u8; 3] = [0x00, 0x00, 0x06];

/// The host bridge's configuration space (256 bytes): its identity and class, every other
/// byte zero (no BARs, no interrupt, no capabilities, header type 0).
pub const HOST_BRIDGE: [u8; 256] = host_bridge();

const fn host_bridge() -> [u8; 256] {
    let mut c = [0u8; 256];
    let v = HOST_BRIDGE_VENDOR.to_le_bytes();
    let d = HOST_BRIDGE_DEVICE.to_le_bytes();
    c[0] = v[0];
    c[1] = v[1];
    c[2] = d[0];
    c[3] = d[1];
    c[9] = CLASS_HOST_BRIDGE[0];
    c[10] = CLASS_HOST_BRIDGE[1];
    c[11] = CLASS_HOST_BRIDGE[2];
    c
}

/// The address register's value after a dword write of `value`.
pub const fn address_written(value: u32) -> u32 {
    value & ADDRESS_WRITABLE
}

/// Fills `data` with what an `in` of `data.len()` bytes at `DATA_PORT + window_offset`
/// returns while the address register holds `address`: the host bridge's bytes from the
/// selected register plus the window offset (zero past its 256 bytes), all ones when
/// `address` selects anything else or has access disabled.
pub fn read_data(address: u32, window_offset: u16, data: &mut [u8]) {
    if address & ADDRESS_ENABLE == 0 || address & ADDRESS_BDF != 0 {
        data.fill(0xff);
        return;
    }
    let at = (address & 0xfc) as usize + usize::from(window_offset & 3);
    for (i, b) in data.iter_mut().enumerate() {
        *b = HOST_BRIDGE.get(at + i).copied().unwrap_or(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dword(address: u32) -> u32 {
        let mut v = [0u8; 4];
        read_data(address, 0, &mut v);
        u32::from_le_bytes(v)
    }

    #[test]
    fn test_host_bridge_identity_and_empty_slots() {
        assert_eq!(dword(0x8000_0000), 0x0d57_8086);
        assert_eq!(dword(0x8000_0008), 0x0600_0000);
        assert_eq!(dword(0x8000_0010), 0, "no BAR");
        assert_eq!(dword(0x8000_0800), u32::MAX, "device 1");
        assert_eq!(dword(0x0000_0000), u32::MAX, "access disabled");
        let mut w = [0u8; 2];
        read_data(0x8000_00fc, 3, &mut w);
        assert_eq!(w, [0, 0], "past the last register");
        assert_eq!(address_written(u32::MAX), ADDRESS_WRITABLE);
    }
}
