//! The port-I/O bus: maps port ranges to devices.
//!
//! Invariants: registered ranges never overlap; a port that is not a device's behaves as
//! on a PC with nothing there: reads return all ones, writes are dropped. The documented
//! [`ABSENT_PORTS`] are the legacy devices a PC guest is known to probe; any other port is
//! *unpopulated*, which the run loop counts per port for the run summary.

/// What a device asks the VMM to do after an access.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceAction {
    /// Nothing; keep running.
    None,
    /// The guest asked for a machine reset (used as poweroff).
    Reset,
    /// The engine rang the I/O-ring doorbell: drain the ring.
    DrainRing,
    /// The engine rang the doorbell with [`kpin_abi::ports::DOORBELL_RECORD_ROOM`]: drain
    /// the I/O ring, then wait for room in the record ring.
    WaitForRecordRoom,
    /// The engine reported a failure: drain the ring, then end the run as a crash.
    EngineFailure,
}

/// A device reached through port I/O.
pub trait PortDevice {
    /// Handles an `in` of `data.len()` bytes at `offset` from the device's base port.
    fn read(&mut self, offset: u16, data: &mut [u8]);
    /// Handles an `out` at `offset` from the device's base port.
    fn write(&mut self, offset: u16, data: &[u8]) -> DeviceAction;
}

/// A legacy PC device that this VMM does not model. Guests probe these; like real hardware
/// with the device missing, reads return all ones and writes are dropped.
#[derive(Clone, Copy, Debug)]
pub struct AbsentRange {
    /// First port.
    pub base: u16,
    /// Number of ports.
    pub len: u16,
    /// What a PC would have there.
    pub what: &'static str,
}

/// The absent devices a Linux guest probes during boot.
pub const ABSENT_PORTS: &[AbsentRange] = &[
    AbsentRange {
        base: 0x70,
        len: 2,
        what: "CMOS/RTC",
    },
    AbsentRange {
        base: 0x80,
        len: 1,
        what: "POST code (I/O delay)",
    },
    AbsentRange {
        base: 0x87,
        len: 1,
        what: "DMA page register",
    },
    AbsentRange {
        base: 0xed,
        len: 1,
        what: "I/O delay",
    },
    AbsentRange {
        base: 0x2e8,
        len: 8,
        what: "COM4",
    },
    AbsentRange {
        base: 0x2f8,
        len: 8,
        what: "COM2",
    },
    AbsentRange {
        base: 0x3e8,
        len: 8,
        what: "COM3",
    },
    AbsentRange {
        base: 0x3c0,
        len: 0x20,
        what: "VGA",
    },
    AbsentRange {
        base: 0x3b0,
        len: 0x10,
        what: "MDA/VGA mono",
    },
    AbsentRange {
        base: 0x3f0,
        len: 8,
        what: "floppy controller",
    },
    AbsentRange {
        base: 0xcfa,
        len: 2,
        what: "PCI mechanism selection bytes (0xcf8's dword is `pci`'s, 0xcf9 `acpi_pm`'s)",
    },
];

/// Result of routing one port access.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Routed {
    /// A device handled it.
    Device(DeviceAction),
    /// It hit an absent legacy device.
    Absent,
    /// Nothing is there, and no device is known to be expected there.
    Unpopulated,
}

/// The port bus.
#[derive(Default)]
pub struct PortBus {
    devices: Vec<(u16, u16, Box<dyn PortDevice>)>,
}

impl PortBus {
    /// Adds a device at `[base, base+len)`.
    ///
    /// # Panics
    /// If the range overlaps a registered one: that is a VMM bug, not a guest error.
    pub fn insert(&mut self, base: u16, len: u16, dev: Box<dyn PortDevice>) {
        let end = u32::from(base) + u32::from(len);
        assert!(
            self.devices.iter().all(|(b, l, _)| {
                end <= u32::from(*b) || u32::from(base) >= u32::from(*b) + u32::from(*l)
            }),
            "port range {base:#x}+{len} overlaps a registered device"
        );
        self.devices.push((base, len, dev));
    }

    fn find(&mut self, port: u16) -> Option<(u16, &mut Box<dyn PortDevice>)> {
        self.devices
            .iter_mut()
            .find(|(b, l, _)| port >= *b && u32::from(port) < u32::from(*b) + u32::from(*l))
            .map(|(b, _, d)| (port - *b, d))
    }

    /// Routes an `in`.
    pub fn read(&mut self, port: u16, data: &mut [u8]) -> Routed {
        if let Some((off, dev)) = self.find(port) {
            dev.read(off, data);
            Routed::Device(DeviceAction::None)
        } else {
            data.fill(0xff);
            if is_absent(port) {
                Routed::Absent
            } else {
                Routed::Unpopulated
            }
        }
    }

    /// Routes an `out`.
    pub fn write(&mut self, port: u16, data: &[u8]) -> Routed {
        if let Some((off, dev)) = self.find(port) {
            Routed::Device(dev.write(off, data))
        } else if is_absent(port) {
            Routed::Absent
        } else {
            Routed::Unpopulated
        }
    }
}

fn is_absent(port: u16) -> bool {
    ABSENT_PORTS
        .iter()
        .any(|r| port >= r.base && u32::from(port) < u32::from(r.base) + u32::from(r.len))
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Echo(u8);
    impl PortDevice for Echo {
        fn read(&mut self, offset: u16, data: &mut [u8]) {
            data.fill(self.0 + offset as u8);
        }
        fn write(&mut self, _offset: u16, data: &[u8]) -> DeviceAction {
            self.0 = data[0];
            DeviceAction::None
        }
    }

    #[test]
    fn test_routes_by_offset_and_reports_unhandled() {
        let mut bus = PortBus::default();
        bus.insert(0x3f8, 8, Box::new(Echo(0x10)));
        let mut b = [0u8; 1];
        assert_eq!(bus.read(0x3fa, &mut b), Routed::Device(DeviceAction::None));
        assert_eq!(b[0], 0x12);
        assert_eq!(bus.read(0x70, &mut b), Routed::Absent);
        assert_eq!(b[0], 0xff);
        assert_eq!(bus.write(0x1234, &[1]), Routed::Unpopulated);
        b[0] = 0;
        assert_eq!(bus.read(0x400, &mut b), Routed::Unpopulated);
        assert_eq!(b[0], 0xff, "an unpopulated port reads all ones");
    }

    #[test]
    #[should_panic(expected = "overlaps")]
    fn test_overlapping_devices_are_rejected() {
        let mut bus = PortBus::default();
        bus.insert(0x3f8, 8, Box::new(Echo(0)));
        bus.insert(0x3fc, 8, Box::new(Echo(0)));
    }
}
