//! The guest-physical window of the VMM's MMIO devices (virtio-mmio), shared by the VMM,
//! which places its devices there, and the engine, which maps guest pages of the window
//! through to the hardware so that translated code's accesses exit to KVM and reach the
//! VMM's device models, as natively.
//!
//! The window is fixed, so the engine needs no field in the attach block: a page of the
//! window that holds no device reads all ones and drops writes (the VMM's unbacked-MMIO
//! rule), natively and under the engine alike.
//!
//! Invariant: the window lies in the 32-bit MMIO gap (`[0xc000_0000, 4 GiB)`), below the
//! IOAPIC (0xfec0_0000) and the local APIC (0xfee0_0000), and holds no RAM.

/// Guest-physical base of the first device.
pub const VIRTIO_MMIO_BASE: u64 = 0xd000_0000;
/// Bytes between two devices' bases (one 4 KiB page each, as Firecracker does).
pub const VIRTIO_MMIO_STRIDE: u64 = 0x1000;
/// Number of device slots in the window.
pub const VIRTIO_MMIO_SLOTS: u64 = 8;
/// End of the window (exclusive).
pub const VIRTIO_MMIO_END: u64 = VIRTIO_MMIO_BASE + VIRTIO_MMIO_SLOTS * VIRTIO_MMIO_STRIDE;

/// Whether the 4 KiB frame at `frame` lies in the window.
pub const fn is_device_frame(frame: u64) -> bool {
    frame >= VIRTIO_MMIO_BASE && frame < VIRTIO_MMIO_END
}

const _: () = assert!(VIRTIO_MMIO_BASE >= 0xc000_0000 && VIRTIO_MMIO_END <= 0xfec0_0000);
