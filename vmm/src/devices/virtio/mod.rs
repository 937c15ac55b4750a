//! Virtio devices over virtio-mmio (version 2, "modern"): the transport (`transport.rs`,
//! the register file a driver programs), virtio-blk over a raw image file (`block.rs`)
//! and virtio-rng from the host's `getrandom` (`rng.rs`). The virtqueues are rust-vmm's
//! `virtio-queue` over guest RAM; the constants are `virtio-bindings`'.
//!
//! Where the work runs: on the vCPU thread, at the driver's `QueueNotify` write. The exit
//! that write causes is the one the device needs anyway; the request is served (a
//! `pread`/`pwrite` on the image, an `fdatasync` for a flush) and the used ring updated
//! before the guest runs again, so requests complete in order with no locking and no
//! second thread (the host has two cores, and under `--tool cachesim` one of them is the
//! simulation's). The interrupt is an irqfd pulse on the device's ISA line of the
//! in-kernel 8259 (edge-triggered, as Linux leaves ISA lines when ACPI names them edge),
//! sent when the interrupt status goes from 0 to non-zero: the driver's handler reads the
//! status, acknowledges it and then walks the used ring, so a completion while the status
//! is still set is found by that walk.
//!
//! Invariants: the devices reach guest RAM only (`VmMemory::ram`: never the stolen
//! region, which is the engine's); every descriptor is checked against it by
//! `virtio-queue`'s `Reader`/`Writer` before a byte moves, chains are bounded by the queue
//! size (loops end), and no guest value can make the VMM panic or allocate without bound.

pub mod block;
pub mod rng;
pub mod transport;

use virtio_queue::{Queue, QueueT};
use vm_memory::GuestMemoryMmap;

/// Guest memory as the devices see it: guest RAM, without the stolen region.
pub type GuestRam = GuestMemoryMmap;

/// One virtio device behind the transport.
pub trait VirtioDevice {
    /// The virtio device ID (`VIRTIO_ID_BLOCK`, `VIRTIO_ID_RNG`).
    fn device_type(&self) -> u32;
    /// The largest size of each of the device's queues (their number is the slice's length).
    fn queue_max_sizes(&self) -> &[u16];
    /// The feature bits the device offers (`VIRTIO_F_VERSION_1` is added by the transport).
    fn features(&self) -> u64;
    /// Reads the device-specific configuration space at `offset` (bytes beyond it read 0).
    fn read_config(&self, offset: u64, data: &mut [u8]);
    /// Serves what the driver made available on queue `index` (ready and valid); returns
    /// whether any descriptor chain was put in the used ring.
    fn process_queue(&mut self, index: usize, queue: &mut Queue, mem: &GuestRam) -> bool;
}

pub use super::IrqLine;

/// Hands every descriptor chain the driver made available on `queue` to `serve` (which
/// returns the bytes it wrote) and puts it in the used ring; whether any was.
pub(crate) fn serve_chains(
    queue: &mut Queue,
    mem: &GuestRam,
    mut serve: impl FnMut(virtio_queue::DescriptorChain<&GuestRam>) -> u32,
) -> bool {
    let mut used = false;
    while let Some(chain) = queue.pop_descriptor_chain(mem) {
        let head = chain.head_index();
        let len = serve(chain);
        // A head outside the table cannot be returned; the entry is consumed anyway.
        used |= queue.add_used(mem, head, len).is_ok();
    }
    used
}

/// Copies `src` into `data` from byte `offset` of `src`; bytes past its end read 0.
pub(crate) fn read_bytes_at(src: &[u8], offset: u64, data: &mut [u8]) {
    data.fill(0);
    let Ok(start) = usize::try_from(offset) else {
        return;
    };
    if start < src.len() {
        let n = data.len().min(src.len() - start);
        data[..n].copy_from_slice(&src[start..start + n]);
    }
}

pub mod disk;

use std::cell::Cell;
use std::rc::Rc;

use kpin_abi::mmio::{VIRTIO_MMIO_BASE, VIRTIO_MMIO_SLOTS, VIRTIO_MMIO_STRIDE};
use serde::Serialize;

use crate::devices::mmio::MmioBus;
pub use block::BlockStats;
use transport::{TransportStats, VirtioMmio, MMIO_LEN};

/// ISA interrupt lines of the disks, in slot order: lines no other device of the VM uses
/// (COM1 is 4, the i8042 1 and 12, the ACPI SCI 9, the PIT 0).
pub const DISK_IRQS: [u32; 4] = [10, 11, 6, 7];
/// The virtio-rng's ISA interrupt line.
pub const RNG_IRQ: u32 = 5;
/// The most `--disk`s a run takes.
pub const MAX_DISKS: usize = DISK_IRQS.len();
const _: () = assert!((MAX_DISKS as u64) < VIRTIO_MMIO_SLOTS);

/// Where a device is, as the guest is told (ACPI `_CRS`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct MmioWindow {
    /// Guest-physical base (`run.json`: `"0xd0000000"`).
    #[serde(serialize_with = "hex")]
    pub base: u64,
    /// Bytes.
    pub len: u64,
    /// ISA interrupt line.
    pub irq: u32,
}

fn hex<S: serde::Serializer>(v: &u64, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&format!("{v:#x}"))
}

/// A disk for the VM: the image opened and checked ([`disk::open`]), with its options.
#[derive(Debug)]
pub struct Disk {
    /// The option as given.
    pub config: disk::DiskConfig,
    /// The open image.
    pub image: disk::OpenDisk,
}

/// One device's counters, for `run.json`'s `devices`.
#[derive(Clone, Debug, Serialize)]
pub struct DeviceRecord {
    /// `virtio-blk` or `virtio-rng`.
    pub kind: &'static str,
    /// The image (disks).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path: Option<std::path::PathBuf>,
    /// Attached read-only (disks).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub read_only: Option<bool>,
    /// Where it is.
    #[serde(flatten)]
    pub window: MmioWindow,
    /// Register accesses (each an exit), `QueueNotify` writes and interrupts.
    pub mmio_accesses: u64,
    /// `QueueNotify` writes.
    pub notifies: u64,
    /// Interrupts raised.
    pub interrupts: u64,
    /// The disk's request counts.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub block: Option<BlockStats>,
    /// Random bytes handed over (virtio-rng).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub random_bytes: Option<u64>,
}

/// Reads a device's counters at the end of the run.
struct Probe {
    record: DeviceRecord,
    transport: Rc<Cell<TransportStats>>,
    block: Option<Rc<Cell<BlockStats>>>,
    rng: Option<Rc<Cell<u64>>>,
}

/// The VM's virtio devices: on the MMIO bus, where they are (for the ACPI tables), and
/// their counters.
#[derive(Default)]
pub struct VirtioDevices {
    /// The bus the vCPU loop routes MMIO exits to.
    pub bus: MmioBus,
    /// Each device's window, in slot order (disks first: the first disk is `vda`).
    pub windows: Vec<MmioWindow>,
    probes: Vec<Probe>,
}

impl VirtioDevices {
    /// The devices: one virtio-blk per disk (slots 0.., [`DISK_IRQS`]), then a virtio-rng
    /// if `rng` ([`RNG_IRQ`]). `irq_line(n)` makes the eventfd that pulses ISA line `n`.
    pub fn new<E: IrqLine + 'static>(
        mem: &GuestRam,
        disks: Vec<Disk>,
        rng: bool,
        irq_line: &mut dyn FnMut(u32) -> crate::error::Result<E>,
    ) -> crate::error::Result<Self> {
        assert!(disks.len() <= MAX_DISKS, "checked by the command line");
        let mut set = VirtioDevices::default();
        let mut slot = 0u64;
        let mut window = |irq: u32| {
            let w = MmioWindow {
                base: VIRTIO_MMIO_BASE + slot * VIRTIO_MMIO_STRIDE,
                len: MMIO_LEN,
                irq,
            };
            slot += 1;
            w
        };
        for (i, d) in disks.into_iter().enumerate() {
            let w = window(DISK_IRQS[i]);
            let id = format!("kpin-vd{}", (b'a' + i as u8) as char);
            let block = block::Block::new(d.image.file, d.image.len, d.config.read_only, &id);
            let block_stats = block.stats.clone();
            let t = VirtioMmio::new(block, mem.clone(), Box::new(irq_line(w.irq)?));
            set.probes.push(Probe {
                record: DeviceRecord {
                    kind: "virtio-blk",
                    path: Some(d.config.path),
                    read_only: Some(d.config.read_only),
                    ..DeviceRecord::empty("virtio-blk", w)
                },
                transport: t.stats.clone(),
                block: Some(block_stats),
                rng: None,
            });
            set.add(w, Box::new(t));
        }
        if rng {
            let w = window(RNG_IRQ);
            let dev = rng::Rng::default();
            let bytes = dev.bytes.clone();
            let t = VirtioMmio::new(dev, mem.clone(), Box::new(irq_line(w.irq)?));
            set.probes.push(Probe {
                record: DeviceRecord::empty("virtio-rng", w),
                transport: t.stats.clone(),
                block: None,
                rng: Some(bytes),
            });
            set.add(w, Box::new(t));
        }
        Ok(set)
    }

    fn add(&mut self, w: MmioWindow, dev: Box<dyn crate::devices::mmio::MmioDevice>) {
        let inserted = self.bus.insert(w.base, w.len, dev);
        assert!(inserted, "the slots do not overlap");
        self.windows.push(w);
    }

    /// Every device's counters now.
    pub fn records(&self) -> Vec<DeviceRecord> {
        self.probes
            .iter()
            .map(|p| {
                let t = p.transport.get();
                DeviceRecord {
                    mmio_accesses: t.accesses,
                    notifies: t.notifies,
                    interrupts: t.interrupts,
                    block: p.block.as_ref().map(|b| b.get()),
                    random_bytes: p.rng.as_ref().map(|r| r.get()),
                    ..p.record.clone()
                }
            })
            .collect()
    }
}

impl DeviceRecord {
    fn empty(kind: &'static str, window: MmioWindow) -> Self {
        DeviceRecord {
            kind,
            path: None,
            read_only: None,
            window,
            mmio_accesses: 0,
            notifies: 0,
            interrupts: 0,
            block: None,
            random_bytes: None,
        }
    }
}

/// An eventfd registered as an irqfd on ISA line `irq` of the in-kernel 8259: each write
/// pulses the line.
pub fn irqfd(
    vm: &kvm_ioctls::VmFd,
    irq: u32,
) -> crate::error::Result<vmm_sys_util::eventfd::EventFd> {
    use crate::error::VmmError;
    let fd = vmm_sys_util::eventfd::EventFd::new(libc::EFD_NONBLOCK)
        .map_err(|e| VmmError::Host("creating a virtio interrupt eventfd", e))?;
    vm.register_irqfd(&fd, irq)
        .map_err(|e| VmmError::Kvm("KVM_IRQFD", e))?;
    Ok(fd)
}

/// Opens every `--disk` ([`disk::open`]); the error names the image and what is wrong.
pub fn open_disks(configs: &[disk::DiskConfig]) -> crate::error::Result<Vec<Disk>> {
    configs
        .iter()
        .map(|c| {
            disk::open(c)
                .map(|image| Disk {
                    config: c.clone(),
                    image,
                })
                .map_err(|e| {
                    crate::error::VmmError::ReadFile(c.path.clone(), std::io::Error::other(e))
                })
        })
        .collect()
}
