//! The virtio-mmio transport, version 2 (virtio 1.2 §4.2.2): the register file at the
//! device's base and its configuration space from 0x100.
//!
//! Registers are 32 bits wide and naturally aligned; any other width or alignment below
//! 0x100 is [`MmioAction::Unsupported`] (Linux's driver uses `readl`/`writel` only; the
//! configuration space takes 1, 2, 4 and 8 bytes). Unknown registers read 0 and ignore
//! writes. A status write of 0 resets the device; `FEATURES_OK` is refused (left clear)
//! when the driver accepted a feature the device does not offer; `QueueNotify` serves
//! the queue when `DRIVER_OK` is set and the queue is ready and valid in guest RAM.

use std::sync::atomic::Ordering;

use virtio_bindings::virtio_config::{
    VIRTIO_CONFIG_S_DRIVER_OK, VIRTIO_CONFIG_S_FEATURES_OK, VIRTIO_F_VERSION_1,
};
use virtio_bindings::virtio_mmio::*;
use virtio_queue::{Queue, QueueT};

use super::{GuestRam, IrqLine, VirtioDevice};
use crate::devices::mmio::{MmioAction, MmioDevice};

/// `MagicValue`: "virt".
const MAGIC: u32 = 0x7472_6976;
/// The transport's version: 2, "modern".
const VERSION: u32 = 2;
/// `VendorID`: "KPIN" (little-endian).
const VENDOR_ID: u32 = u32::from_le_bytes(*b"KPIN");
/// Bytes of the register file and configuration space the guest may access.
pub const MMIO_LEN: u64 = 0x1000;

/// What the transport counted (for `run.json`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TransportStats {
    /// `QueueNotify` writes.
    pub notifies: u64,
    /// Interrupt pulses sent.
    pub interrupts: u64,
    /// Register reads and writes (every one an exit to the VMM).
    pub accesses: u64,
}

/// A virtio device on virtio-mmio.
pub struct VirtioMmio<D: VirtioDevice> {
    device: D,
    mem: GuestRam,
    irq: Box<dyn IrqLine>,
    queues: Vec<Queue>,
    /// Per queue: the driver's last `QueueNum` was a size the queue can take (an invalid
    /// one leaves the queue unserved until a valid one is written).
    size_ok: Vec<bool>,
    queue_sel: u32,
    device_features_sel: u32,
    driver_features_sel: u32,
    driver_features: u64,
    status: u32,
    interrupt_status: u32,
    /// Counters, shared with whoever reports them.
    pub stats: std::rc::Rc<std::cell::Cell<TransportStats>>,
}

impl<D: VirtioDevice> VirtioMmio<D> {
    /// The transport around `device`, reaching `mem`, interrupting through `irq`.
    pub fn new(device: D, mem: GuestRam, irq: Box<dyn IrqLine>) -> Self {
        let queues = device
            .queue_max_sizes()
            .iter()
            .map(|&max| Queue::new(max).expect("the device's queue sizes are powers of two"))
            .collect::<Vec<_>>();
        VirtioMmio {
            device,
            mem,
            irq,
            size_ok: vec![true; queues.len()],
            queues,
            queue_sel: 0,
            device_features_sel: 0,
            driver_features_sel: 0,
            driver_features: 0,
            status: 0,
            interrupt_status: 0,
            stats: Default::default(),
        }
    }

    /// The device behind the transport.
    pub fn device(&self) -> &D {
        &self.device
    }

    fn device_features(&self) -> u64 {
        self.device.features() | (1 << VIRTIO_F_VERSION_1)
    }

    fn count(&self, f: impl FnOnce(&mut TransportStats)) {
        let mut s = self.stats.get();
        f(&mut s);
        self.stats.set(s);
    }

    fn reset(&mut self) {
        for q in &mut self.queues {
            q.reset();
        }
        self.size_ok.fill(true);
        self.queue_sel = 0;
        self.device_features_sel = 0;
        self.driver_features_sel = 0;
        self.driver_features = 0;
        self.status = 0;
        self.interrupt_status = 0;
    }

    fn selected(&mut self) -> Option<&mut Queue> {
        self.queues.get_mut(self.queue_sel as usize)
    }

    fn read_register(&mut self, offset: u32) -> u32 {
        match offset {
            VIRTIO_MMIO_MAGIC_VALUE => MAGIC,
            VIRTIO_MMIO_VERSION => VERSION,
            VIRTIO_MMIO_DEVICE_ID => self.device.device_type(),
            VIRTIO_MMIO_VENDOR_ID => VENDOR_ID,
            VIRTIO_MMIO_DEVICE_FEATURES => match self.device_features_sel {
                0 => self.device_features() as u32,
                1 => (self.device_features() >> 32) as u32,
                _ => 0,
            },
            VIRTIO_MMIO_QUEUE_NUM_MAX => self.selected().map_or(0, |q| u32::from(q.max_size())),
            VIRTIO_MMIO_QUEUE_READY => self.selected().map_or(0, |q| u32::from(q.ready())),
            VIRTIO_MMIO_INTERRUPT_STATUS => self.interrupt_status,
            VIRTIO_MMIO_STATUS => self.status,
            // No shared memory regions: a length of all ones says so.
            VIRTIO_MMIO_SHM_LEN_LOW | VIRTIO_MMIO_SHM_LEN_HIGH => u32::MAX,
            VIRTIO_MMIO_SHM_BASE_LOW | VIRTIO_MMIO_SHM_BASE_HIGH => u32::MAX,
            // The configuration space never changes under the driver.
            VIRTIO_MMIO_CONFIG_GENERATION => 0,
            _ => 0,
        }
    }

    fn write_register(&mut self, offset: u32, v: u32) {
        // Queue setup is only legal while the queue is not ready (virtio 1.2 §4.2.2.3.2).
        let setup = self.selected().is_some_and(|q| !q.ready());
        match offset {
            VIRTIO_MMIO_DEVICE_FEATURES_SEL => self.device_features_sel = v,
            VIRTIO_MMIO_DRIVER_FEATURES_SEL => self.driver_features_sel = v,
            VIRTIO_MMIO_DRIVER_FEATURES if self.status & VIRTIO_CONFIG_S_FEATURES_OK == 0 => {
                match self.driver_features_sel {
                    0 => {
                        self.driver_features = (self.driver_features & !0xffff_ffff) | u64::from(v)
                    }
                    1 => {
                        self.driver_features =
                            (self.driver_features & 0xffff_ffff) | (u64::from(v) << 32)
                    }
                    _ => {}
                }
            }
            VIRTIO_MMIO_QUEUE_SEL => self.queue_sel = v,
            VIRTIO_MMIO_QUEUE_NUM if setup => {
                let sel = self.queue_sel as usize;
                if let Some(q) = self.queues.get_mut(sel) {
                    // An invalid size (zero, not a power of two, above the maximum) is
                    // refused and leaves the queue unserved.
                    let ok = u16::try_from(v).is_ok_and(|n| q.try_set_size(n).is_ok());
                    self.size_ok[sel] = ok;
                }
            }
            VIRTIO_MMIO_QUEUE_READY => {
                if let Some(q) = self.selected() {
                    q.set_ready(v == 1);
                }
            }
            VIRTIO_MMIO_QUEUE_DESC_LOW if setup => {
                self.with_queue(|q| q.set_desc_table_address(Some(v), None))
            }
            VIRTIO_MMIO_QUEUE_DESC_HIGH if setup => {
                self.with_queue(|q| q.set_desc_table_address(None, Some(v)))
            }
            VIRTIO_MMIO_QUEUE_AVAIL_LOW if setup => {
                self.with_queue(|q| q.set_avail_ring_address(Some(v), None))
            }
            VIRTIO_MMIO_QUEUE_AVAIL_HIGH if setup => {
                self.with_queue(|q| q.set_avail_ring_address(None, Some(v)))
            }
            VIRTIO_MMIO_QUEUE_USED_LOW if setup => {
                self.with_queue(|q| q.set_used_ring_address(Some(v), None))
            }
            VIRTIO_MMIO_QUEUE_USED_HIGH if setup => {
                self.with_queue(|q| q.set_used_ring_address(None, Some(v)))
            }
            VIRTIO_MMIO_QUEUE_NOTIFY => self.notify(v),
            VIRTIO_MMIO_INTERRUPT_ACK => self.interrupt_status &= !v,
            VIRTIO_MMIO_STATUS => self.set_status(v),
            _ => {}
        }
    }

    fn with_queue(&mut self, f: impl FnOnce(&mut Queue)) {
        if let Some(q) = self.selected() {
            f(q);
        }
    }

    fn set_status(&mut self, v: u32) {
        if v == 0 {
            self.reset();
            return;
        }
        let mut v = v;
        if v & VIRTIO_CONFIG_S_FEATURES_OK != 0
            && self.status & VIRTIO_CONFIG_S_FEATURES_OK == 0
            && self.driver_features & !self.device_features() != 0
        {
            // A feature the device never offered: the driver reads FEATURES_OK back clear.
            v &= !VIRTIO_CONFIG_S_FEATURES_OK;
        }
        self.status = v;
    }

    fn notify(&mut self, index: u32) {
        self.count(|s| s.notifies += 1);
        if self.status & VIRTIO_CONFIG_S_DRIVER_OK == 0 {
            return;
        }
        let Some(queue) = self.queues.get_mut(index as usize) else {
            return;
        };
        if !self.size_ok[index as usize] || !queue.ready() || !queue.is_valid(&self.mem) {
            return;
        }
        let used = self.device.process_queue(index as usize, queue, &self.mem);
        // The driver may ask for no interrupt (VRING_AVAIL_F_NO_INTERRUPT).
        if used && queue.needs_notification(&self.mem).unwrap_or(true) {
            self.raise(VIRTIO_MMIO_INT_VRING);
        }
        // Keeps the ring's stores ordered before the interrupt on other threads' view.
        std::sync::atomic::fence(Ordering::SeqCst);
    }

    fn raise(&mut self, bits: u32) {
        let was = self.interrupt_status;
        self.interrupt_status |= bits;
        // An edge only when the status becomes non-zero: the driver acknowledges before it
        // walks the used ring, so a completion while the status is set is found then.
        if was == 0 {
            self.irq.trigger();
            self.count(|s| s.interrupts += 1);
        }
    }
}

impl<D: VirtioDevice> MmioDevice for VirtioMmio<D> {
    fn read(&mut self, offset: u64, data: &mut [u8]) -> MmioAction {
        self.count(|s| s.accesses += 1);
        if offset >= u64::from(VIRTIO_MMIO_CONFIG) {
            if !matches!(data.len(), 1 | 2 | 4 | 8) {
                return MmioAction::Unsupported;
            }
            self.device
                .read_config(offset - u64::from(VIRTIO_MMIO_CONFIG), data);
            return MmioAction::Done;
        }
        if data.len() != 4 || !offset.is_multiple_of(4) {
            return MmioAction::Unsupported;
        }
        let v = self.read_register(offset as u32);
        data.copy_from_slice(&v.to_le_bytes());
        MmioAction::Done
    }

    fn write(&mut self, offset: u64, data: &[u8]) -> MmioAction {
        self.count(|s| s.accesses += 1);
        if offset >= u64::from(VIRTIO_MMIO_CONFIG) {
            // Neither device has a writable configuration field.
            return if matches!(data.len(), 1 | 2 | 4 | 8) {
                MmioAction::Done
            } else {
                MmioAction::Unsupported
            };
        }
        let Ok(bytes) = <[u8; 4]>::try_from(data) else {
            return MmioAction::Unsupported;
        };
        if !offset.is_multiple_of(4) {
            return MmioAction::Unsupported;
        }
        self.write_register(offset as u32, u32::from_le_bytes(bytes));
        MmioAction::Done
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;
    use std::rc::Rc;
    use virtio_bindings::virtio_config::{VIRTIO_CONFIG_S_ACKNOWLEDGE, VIRTIO_CONFIG_S_DRIVER};
    use virtio_queue::desc::{split::Descriptor, RawDescriptor};
    use virtio_queue::mock::MockSplitQueue;
    use vm_memory::{GuestAddress, GuestMemoryMmap};

    /// Counts its pulses.
    #[derive(Clone, Default)]
    struct Pulses(Rc<Cell<u32>>);
    impl IrqLine for Pulses {
        fn trigger(&self) {
            self.0.set(self.0.get() + 1);
        }
    }

    /// A device with one queue of 16 that uses every chain with length 0.
    struct Echo;
    impl VirtioDevice for Echo {
        fn device_type(&self) -> u32 {
            42
        }
        fn queue_max_sizes(&self) -> &[u16] {
            &[16]
        }
        fn features(&self) -> u64 {
            1 << 5
        }
        fn read_config(&self, offset: u64, data: &mut [u8]) {
            super::super::read_bytes_at(&[1, 2, 3, 4, 5, 6, 7, 8], offset, data);
        }
        fn process_queue(&mut self, _: usize, q: &mut Queue, mem: &GuestRam) -> bool {
            let mut used = false;
            while let Some(c) = q.pop_descriptor_chain(mem) {
                used |= q.add_used(mem, c.head_index(), 0).is_ok();
            }
            used
        }
    }

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap()
    }

    fn w(t: &mut VirtioMmio<Echo>, off: u32, v: u32) {
        assert_eq!(t.write(u64::from(off), &v.to_le_bytes()), MmioAction::Done);
    }

    fn r(t: &mut VirtioMmio<Echo>, off: u32) -> u32 {
        let mut d = [0u8; 4];
        assert_eq!(t.read(u64::from(off), &mut d), MmioAction::Done);
        u32::from_le_bytes(d)
    }

    /// Drives the transport as Linux's virtio_mmio does, up to DRIVER_OK, with the queue
    /// at the mock queue's addresses.
    fn bring_up(t: &mut VirtioMmio<Echo>, q: &MockSplitQueue<GuestMemoryMmap>) {
        w(t, VIRTIO_MMIO_STATUS, 0);
        w(t, VIRTIO_MMIO_STATUS, VIRTIO_CONFIG_S_ACKNOWLEDGE);
        w(
            t,
            VIRTIO_MMIO_STATUS,
            VIRTIO_CONFIG_S_ACKNOWLEDGE | VIRTIO_CONFIG_S_DRIVER,
        );
        w(t, VIRTIO_MMIO_DRIVER_FEATURES_SEL, 1);
        w(t, VIRTIO_MMIO_DRIVER_FEATURES, 1);
        w(t, VIRTIO_MMIO_DRIVER_FEATURES_SEL, 0);
        w(t, VIRTIO_MMIO_DRIVER_FEATURES, 1 << 5);
        let s = VIRTIO_CONFIG_S_ACKNOWLEDGE | VIRTIO_CONFIG_S_DRIVER | VIRTIO_CONFIG_S_FEATURES_OK;
        w(t, VIRTIO_MMIO_STATUS, s);
        assert_eq!(r(t, VIRTIO_MMIO_STATUS), s);
        w(t, VIRTIO_MMIO_QUEUE_SEL, 0);
        assert_eq!(r(t, VIRTIO_MMIO_QUEUE_NUM_MAX), 16);
        w(t, VIRTIO_MMIO_QUEUE_NUM, 16);
        w(t, VIRTIO_MMIO_QUEUE_DESC_LOW, q.desc_table_addr().0 as u32);
        w(t, VIRTIO_MMIO_QUEUE_DESC_HIGH, 0);
        w(t, VIRTIO_MMIO_QUEUE_AVAIL_LOW, q.avail_addr().0 as u32);
        w(t, VIRTIO_MMIO_QUEUE_AVAIL_HIGH, 0);
        w(t, VIRTIO_MMIO_QUEUE_USED_LOW, q.used_addr().0 as u32);
        w(t, VIRTIO_MMIO_QUEUE_USED_HIGH, 0);
        w(t, VIRTIO_MMIO_QUEUE_READY, 1);
        w(t, VIRTIO_MMIO_STATUS, s | VIRTIO_CONFIG_S_DRIVER_OK);
    }

    #[test]
    fn test_identity_registers_and_config_space() {
        let m = mem();
        let mut t = VirtioMmio::new(Echo, m, Box::new(Pulses::default()));
        assert_eq!(r(&mut t, VIRTIO_MMIO_MAGIC_VALUE), 0x7472_6976);
        assert_eq!(r(&mut t, VIRTIO_MMIO_VERSION), 2);
        assert_eq!(r(&mut t, VIRTIO_MMIO_DEVICE_ID), 42);
        assert_eq!(r(&mut t, VIRTIO_MMIO_DEVICE_FEATURES), 1 << 5);
        w(&mut t, VIRTIO_MMIO_DEVICE_FEATURES_SEL, 1);
        assert_eq!(r(&mut t, VIRTIO_MMIO_DEVICE_FEATURES), 1, "VERSION_1");
        let mut b = [0u8; 2];
        assert_eq!(t.read(0x102, &mut b), MmioAction::Done);
        assert_eq!(b, [3, 4]);
        let mut q = [0u8; 8];
        assert_eq!(t.read(0x104, &mut q), MmioAction::Done);
        assert_eq!(q, [5, 6, 7, 8, 0, 0, 0, 0], "past the end reads 0");
        // Registers are 32-bit and aligned; anything else ends the run.
        assert_eq!(t.read(0x0, &mut q), MmioAction::Unsupported);
        assert_eq!(t.read(0x2, &mut b), MmioAction::Unsupported);
        assert_eq!(t.write(0x51, &[0; 4]), MmioAction::Unsupported);
        let mut wide = [0u8; 16];
        assert_eq!(t.read(0x100, &mut wide), MmioAction::Unsupported);
    }

    #[test]
    fn test_features_the_device_never_offered_leave_features_ok_clear() {
        let mut t = VirtioMmio::new(Echo, mem(), Box::new(Pulses::default()));
        w(&mut t, VIRTIO_MMIO_DRIVER_FEATURES, 1 << 6);
        w(&mut t, VIRTIO_MMIO_STATUS, VIRTIO_CONFIG_S_FEATURES_OK | 3);
        assert_eq!(r(&mut t, VIRTIO_MMIO_STATUS), 3);
    }

    #[test]
    fn test_notify_serves_the_queue_and_pulses_once_until_acknowledged() {
        let m = mem();
        let pulses = Pulses::default();
        let mut t = VirtioMmio::new(Echo, m.clone(), Box::new(pulses.clone()));
        let q = MockSplitQueue::create(&m, GuestAddress(0x1000), 16);
        bring_up(&mut t, &q);
        let d = RawDescriptor::from(Descriptor::new(0x8000, 16, 0, 0));
        q.add_desc_chains(&[d], 0).unwrap();
        w(&mut t, VIRTIO_MMIO_QUEUE_NOTIFY, 0);
        assert_eq!(q.used().idx().load(), 1);
        assert_eq!(pulses.0.get(), 1);
        assert_eq!(
            r(&mut t, VIRTIO_MMIO_INTERRUPT_STATUS),
            VIRTIO_MMIO_INT_VRING
        );
        // A second completion before the acknowledgement: no second edge.
        q.add_desc_chains(&[d], 1).unwrap();
        w(&mut t, VIRTIO_MMIO_QUEUE_NOTIFY, 0);
        assert_eq!((q.used().idx().load(), pulses.0.get()), (2, 1));
        w(&mut t, VIRTIO_MMIO_INTERRUPT_ACK, VIRTIO_MMIO_INT_VRING);
        assert_eq!(r(&mut t, VIRTIO_MMIO_INTERRUPT_STATUS), 0);
        q.add_desc_chains(&[d], 2).unwrap();
        w(&mut t, VIRTIO_MMIO_QUEUE_NOTIFY, 0);
        assert_eq!((q.used().idx().load(), pulses.0.get()), (3, 2));
        // A notify of a queue that does not exist, and a reset, are harmless.
        w(&mut t, VIRTIO_MMIO_QUEUE_NOTIFY, 7);
        w(&mut t, VIRTIO_MMIO_STATUS, 0);
        assert_eq!(r(&mut t, VIRTIO_MMIO_QUEUE_READY), 0);
        assert_eq!(r(&mut t, VIRTIO_MMIO_INTERRUPT_STATUS), 0);
        assert_eq!(t.stats.get().notifies, 4);
    }

    #[test]
    fn test_hostile_queue_setups_are_never_served() {
        let m = mem();
        let pulses = Pulses::default();
        let mut t = VirtioMmio::new(Echo, m.clone(), Box::new(pulses.clone()));
        let q = MockSplitQueue::create(&m, GuestAddress(0x1000), 16);
        bring_up(&mut t, &q);
        // Not a power of two, then a ring outside guest RAM: invalid, never served.
        w(&mut t, VIRTIO_MMIO_QUEUE_READY, 0);
        w(&mut t, VIRTIO_MMIO_QUEUE_NUM, 12);
        w(&mut t, VIRTIO_MMIO_QUEUE_READY, 1);
        w(&mut t, VIRTIO_MMIO_QUEUE_NOTIFY, 0);
        w(&mut t, VIRTIO_MMIO_QUEUE_READY, 0);
        w(&mut t, VIRTIO_MMIO_QUEUE_NUM, 16);
        w(&mut t, VIRTIO_MMIO_QUEUE_USED_HIGH, 0x10);
        w(&mut t, VIRTIO_MMIO_QUEUE_READY, 1);
        w(&mut t, VIRTIO_MMIO_QUEUE_NOTIFY, 0);
        assert_eq!(pulses.0.get(), 0);
        // Queue registers written while the queue is ready are ignored.
        w(&mut t, VIRTIO_MMIO_QUEUE_USED_HIGH, 0);
        w(&mut t, VIRTIO_MMIO_QUEUE_NOTIFY, 0);
        assert_eq!(pulses.0.get(), 0);
        // A selector past the queues reads 0 and ignores writes.
        w(&mut t, VIRTIO_MMIO_QUEUE_SEL, 9);
        assert_eq!(r(&mut t, VIRTIO_MMIO_QUEUE_NUM_MAX), 0);
        w(&mut t, VIRTIO_MMIO_QUEUE_READY, 1);
        assert_eq!(r(&mut t, VIRTIO_MMIO_QUEUE_READY), 0);
    }
}
