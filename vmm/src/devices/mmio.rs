//! The MMIO bus: guest-physical ranges → device models (the virtio-mmio devices of
//! `devices::virtio`). The vCPU loop hands every `KVM_EXIT_MMIO` to it; an access no
//! device claims is the loop's (unbacked: all ones below 4 GiB, as on a PC).
//!
//! Invariants: ranges never overlap (`insert` refuses); an access is routed only when it
//! lies wholly inside one device's range, and the device sees the offset from its base.

/// What a device did with one access.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MmioAction {
    /// Served.
    Done,
    /// An access form the device does not support (a width or alignment its registers do
    /// not have): the run ends naming it rather than go on with a device in an unknown
    /// state.
    Unsupported,
}

/// A device on the MMIO bus.
pub trait MmioDevice {
    /// Reads `data.len()` bytes at `offset` from the device's base.
    fn read(&mut self, offset: u64, data: &mut [u8]) -> MmioAction;
    /// Writes `data` at `offset` from the device's base.
    fn write(&mut self, offset: u64, data: &[u8]) -> MmioAction;
}

/// How the bus routed an access.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MmioRouted {
    /// A device took it.
    Device(MmioAction),
    /// No device's range holds it.
    Unclaimed,
}

struct Entry {
    base: u64,
    len: u64,
    device: Box<dyn MmioDevice>,
}

/// The MMIO bus (few devices: a linear search).
#[derive(Default)]
pub struct MmioBus {
    devices: Vec<Entry>,
}

impl MmioBus {
    /// Adds `device` at `[base, base + len)`; `false` (and nothing added) if that overlaps
    /// a device already there or is empty.
    pub fn insert(&mut self, base: u64, len: u64, device: Box<dyn MmioDevice>) -> bool {
        let Some(end) = base.checked_add(len) else {
            return false;
        };
        if len == 0
            || self
                .devices
                .iter()
                .any(|e| base < e.base + e.len && e.base < end)
        {
            return false;
        }
        self.devices.push(Entry { base, len, device });
        true
    }

    /// Whether no device is on the bus.
    pub fn is_empty(&self) -> bool {
        self.devices.is_empty()
    }

    fn find(&mut self, addr: u64, len: usize) -> Option<(&mut Entry, u64)> {
        let end = addr.checked_add(len as u64)?;
        self.devices
            .iter_mut()
            .find(|e| addr >= e.base && end <= e.base + e.len)
            .map(|e| {
                let offset = addr - e.base;
                (e, offset)
            })
    }

    /// Routes a read of `data.len()` bytes at guest-physical `addr`.
    pub fn read(&mut self, addr: u64, data: &mut [u8]) -> MmioRouted {
        match self.find(addr, data.len()) {
            Some((e, offset)) => MmioRouted::Device(e.device.read(offset, data)),
            None => MmioRouted::Unclaimed,
        }
    }

    /// Routes a write of `data` at guest-physical `addr`.
    pub fn write(&mut self, addr: u64, data: &[u8]) -> MmioRouted {
        match self.find(addr, data.len()) {
            Some((e, offset)) => MmioRouted::Device(e.device.write(offset, data)),
            None => MmioRouted::Unclaimed,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Remembers the last write; reads return the offset's low byte.
    struct Probe;
    impl MmioDevice for Probe {
        fn read(&mut self, offset: u64, data: &mut [u8]) -> MmioAction {
            data.fill(offset as u8);
            MmioAction::Done
        }
        fn write(&mut self, _offset: u64, data: &[u8]) -> MmioAction {
            if data.len() == 8 {
                MmioAction::Unsupported
            } else {
                MmioAction::Done
            }
        }
    }

    #[test]
    fn test_accesses_inside_one_range_reach_its_device_with_the_offset() {
        let mut bus = MmioBus::default();
        assert!(bus.is_empty());
        assert!(bus.insert(0x1000, 0x100, Box::new(Probe)));
        let mut d = [0u8; 4];
        assert_eq!(
            bus.read(0x1010, &mut d),
            MmioRouted::Device(MmioAction::Done)
        );
        assert_eq!(d, [0x10; 4]);
        assert_eq!(
            bus.write(0x10fc, &[0; 8]),
            MmioRouted::Unclaimed,
            "straddles the end"
        );
        assert_eq!(bus.read(0xfff, &mut d), MmioRouted::Unclaimed);
        assert_eq!(bus.read(u64::MAX - 1, &mut d), MmioRouted::Unclaimed);
        assert_eq!(
            bus.write(0x1000, &[0; 8]),
            MmioRouted::Device(MmioAction::Unsupported)
        );
    }

    #[test]
    fn test_overlapping_or_empty_ranges_are_refused() {
        let mut bus = MmioBus::default();
        assert!(bus.insert(0x1000, 0x1000, Box::new(Probe)));
        assert!(!bus.insert(0x1800, 0x1000, Box::new(Probe)));
        assert!(!bus.insert(0x0800, 0x1000, Box::new(Probe)));
        assert!(!bus.insert(0x3000, 0, Box::new(Probe)));
        assert!(!bus.insert(u64::MAX, 2, Box::new(Probe)));
        assert!(bus.insert(0x2000, 0x1000, Box::new(Probe)));
    }
}
