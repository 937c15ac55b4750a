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
//!
//! The bytes and the address register's rules are `kpin_abi::pci`'s, shared with the
//! engine, which answers the guest's configuration reads from them without a port exit
//! (`guest-engine/src/vcpu/pci_config.rs`).

use std::cell::Cell;
use std::rc::Rc;

use kpin_abi::pci;

use super::bus::{DeviceAction, PortDevice};

pub use kpin_abi::pci::{
    ADDRESS_PORT as PCI_CONFIG_ADDRESS_PORT, DATA_PORT as PCI_CONFIG_DATA_PORT,
    DATA_SPAN as PCI_CONFIG_DATA_SPAN,
};

/// The data window of configuration mechanism 1 (the host bridge's bytes are
/// `kpin_abi::pci::HOST_BRIDGE`).
pub struct PciConfig {
    address: Rc<Cell<u32>>,
}

/// The address register (0xcf8, dword accesses).
pub struct PciConfigAddress(Rc<Cell<u32>>);

impl PciConfig {
    /// An empty bus 0 with the host bridge, and its address register.
    pub fn new() -> (Self, PciConfigAddress) {
        let address = Rc::new(Cell::new(0));
        (
            PciConfig {
                address: address.clone(),
            },
            PciConfigAddress(address),
        )
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
            self.0.set(pci::address_written(u32::from_le_bytes(b)));
        }
        DeviceAction::None
    }
}

impl PortDevice for PciConfig {
    fn read(&mut self, offset: u16, data: &mut [u8]) {
        pci::read_data(self.address.get(), offset, data);
    }

    /// The host bridge has no writable register that changes anything: its command
    /// register has no memory or I/O space to enable, and it has no BARs, so a BAR
    /// sizing write reads back zero ("not implemented"). Writes are dropped.
    fn write(&mut self, _offset: u16, _data: &[u8]) -> DeviceAction {
        DeviceAction::None
    }
}

/// The engine's side (`guest-engine/src/vcpu/pci_config.rs`), compiled here to compare
/// it with this model: the two crates cannot depend on each other (the engine builds
/// iced-x86 `no_std`, the VMM with `std`), and the file uses only `kpin_abi` and `core`.
#[cfg(test)]
#[path = "../../../guest-engine/src/vcpu/pci_config.rs"]
mod engine_pci_config;

#[cfg(test)]
mod tests {
    use super::engine_pci_config::{PciConfigCache, PciOut};
    use super::*;
    use crate::devices::bus::PortBus;

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
        assert_eq!(u32::from_le_bytes(v), pci::ADDRESS_WRITABLE);
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
        assert_eq!(u16::from_le_bytes(w), pci::HOST_BRIDGE_DEVICE);
        // A byte access to the address register is not the register.
        addr.write(0, &[0x12]);
        let mut v = [0u8; 4];
        addr.read(0, &mut v);
        assert_eq!(u32::from_le_bytes(v), 0x8000_0000);
    }

    /// The VMM's bus with the PCI model registered as `vstate/vm.rs` registers it.
    fn pci_bus() -> PortBus {
        let mut bus = PortBus::default();
        let (pci, pci_address) = PciConfig::new();
        bus.insert(PCI_CONFIG_ADDRESS_PORT, 1, Box::new(pci_address));
        bus.insert(PCI_CONFIG_DATA_PORT, PCI_CONFIG_DATA_SPAN, Box::new(pci));
        bus
    }

    fn bus_in(bus: &mut PortBus, port: u16, size: u8) -> u32 {
        let mut b = [0u8; 4];
        bus.read(port, &mut b[..usize::from(size)]);
        u32::from_le_bytes(b)
    }

    fn bus_out(bus: &mut PortBus, port: u16, size: u8, value: u32) {
        bus.write(port, &value.to_le_bytes()[..usize::from(size)]);
    }

    /// The guest's accesses under the engine: answered by its cache where it can, else
    /// through the VMM's bus in the order `guest-engine/image/src/run/vcpu.rs` sends
    /// them (the latch written back first).
    struct Engine {
        cache: PciConfigCache,
        bus: PortBus,
        /// Accesses that reached the bus (port exits).
        exits: u64,
    }

    impl Engine {
        fn input(&mut self, port: u16, size: u8) -> u32 {
            if let Some(v) = self.cache.answer(port, size) {
                return v;
            }
            self.exits += 1;
            let v = bus_in(&mut self.bus, port, size);
            self.cache.read_done(port, size, v);
            v
        }

        fn output(&mut self, port: u16, size: u8, value: u32) {
            if let PciOut::Device { latch_first } = self.cache.out(port, size, value) {
                if let Some(l) = latch_first {
                    self.exits += 1;
                    bus_out(&mut self.bus, PCI_CONFIG_ADDRESS_PORT, 4, l);
                }
                self.exits += 1;
                bus_out(&mut self.bus, port, size, value);
            }
        }
    }

    /// Every data-window access the guest can make: each port, each size.
    const WINDOW: [(u16, u8); 12] = [
        (0xcfc, 1),
        (0xcfd, 1),
        (0xcfe, 1),
        (0xcff, 1),
        (0xcfc, 2),
        (0xcfd, 2),
        (0xcfe, 2),
        (0xcff, 2),
        (0xcfc, 4),
        (0xcfd, 4),
        (0xcfe, 4),
        (0xcff, 4),
    ];

    #[test]
    fn test_the_engine_answers_every_register_as_this_model_does() {
        let mut native = pci_bus();
        let mut engine = Engine {
            cache: PciConfigCache::default(),
            bus: pci_bus(),
            exits: 0,
        };
        // 00:00.0 (the bridge), its function 1, device 1, the last device and function
        // of bus 0, bus 1, the last bus; and the bridge with access disabled.
        let devices = [
            0x8000_0000u32,
            0x8000_0100,
            0x8000_0800,
            0x8000_ff00,
            0x8001_0000,
            0x80ff_0000,
            0x0000_0000,
        ];
        for d in devices {
            for reg in (0..256).step_by(4) {
                let a = d | reg;
                bus_out(&mut native, PCI_CONFIG_ADDRESS_PORT, 4, a);
                engine.output(PCI_CONFIG_ADDRESS_PORT, 4, a);
                for (port, size) in WINDOW
                    .into_iter()
                    .chain([(0xcf8, 1), (0xcf8, 2), (0xcf8, 4)])
                {
                    assert_eq!(
                        engine.input(port, size),
                        bus_in(&mut native, port, size),
                        "{size}-byte read at {port:#x}, address {a:#x}"
                    );
                }
            }
        }
        assert_eq!(engine.exits, 0, "every read answered in the engine");
        assert_eq!(engine.cache.absorbed, devices.len() as u64 * 64);
    }

    #[test]
    fn test_a_mixed_sequence_leaves_both_models_in_one_state() {
        // The guest ran natively first: the VMM's register holds a value the engine
        // does not know when it takes over.
        let mut native = pci_bus();
        let mut engine_bus = pci_bus();
        bus_out(&mut native, PCI_CONFIG_ADDRESS_PORT, 4, 0x8000_0008);
        bus_out(&mut engine_bus, PCI_CONFIG_ADDRESS_PORT, 4, 0x8000_0008);
        let mut engine = Engine {
            cache: PciConfigCache::default(),
            bus: engine_bus,
            exits: 0,
        };
        // A fixed pseudo-random sequence of reads and writes (xorshift).
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for step in 0..20_000 {
            let r = next();
            let size = [1u8, 2, 4][(r % 3) as usize];
            let write = (r >> 2) % 2 == 0;
            let port = if (r >> 3) % 3 == 0 {
                PCI_CONFIG_ADDRESS_PORT
            } else {
                WINDOW[((r >> 5) % 12) as usize].0
            };
            // Addresses on bus 0, mostly device 0, sometimes disabled.
            let value = ((r >> 16) as u32 & 0x8000_19fc) | (r >> 48) as u32 & 3;
            if write {
                bus_out(&mut native, port, size, value);
                engine.output(port, size, value);
            } else {
                assert_eq!(
                    engine.input(port, size),
                    bus_in(&mut native, port, size),
                    "step {step}: {size}-byte read at {port:#x}"
                );
            }
            if step % 997 == 0 {
                // A native detach: the VMM's register then holds the guest's value.
                if let Some(l) = engine.cache.unsent_latch() {
                    bus_out(&mut engine.bus, PCI_CONFIG_ADDRESS_PORT, 4, l);
                }
                assert_eq!(
                    bus_in(&mut engine.bus, PCI_CONFIG_ADDRESS_PORT, 4),
                    bus_in(&mut native, PCI_CONFIG_ADDRESS_PORT, 4),
                    "step {step}: the VMM's address register"
                );
            }
        }
        assert!(engine.cache.answered > 5_000, "{}", engine.cache.answered);
        assert!(engine.exits < 8_000, "{} exits", engine.exits);
    }
}
