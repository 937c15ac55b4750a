//! The local APIC's LINT pins, wired as a PC BIOS leaves them.

use kvm_ioctls::VcpuFd;

use crate::error::{Result, VmmError};

/// Local APIC register offsets and delivery modes for the LINT pins.
const APIC_LVT0: usize = 0x350;
const APIC_LVT1: usize = 0x360;
const APIC_MODE_EXTINT: u32 = 0x7 << 8;
const APIC_MODE_NMI: u32 = 0x4 << 8;
const APIC_LVT_DELIVERY_MASK: u32 = 0x7 << 8;
const APIC_LVT_MASKED: u32 = 1 << 16;

/// Wires the local APIC's LINT0 to the 8259 (ExtINT) and LINT1 to NMI, as a PC BIOS
/// leaves them, so PIC interrupts reach a guest that never programs its local APIC.
pub fn set_lint_pins(vcpu: &VcpuFd) -> Result<()> {
    let mut lapic = vcpu
        .get_lapic()
        .map_err(|e| VmmError::Kvm("KVM_GET_LAPIC", e))?;
    for (reg, mode) in [(APIC_LVT0, APIC_MODE_EXTINT), (APIC_LVT1, APIC_MODE_NMI)] {
        let bytes: [u8; 4] = std::array::from_fn(|i| lapic.regs[reg + i] as u8);
        let v = u32::from_le_bytes(bytes);
        let v = (v & !(APIC_LVT_DELIVERY_MASK | APIC_LVT_MASKED)) | mode;
        for (i, b) in v.to_le_bytes().into_iter().enumerate() {
            lapic.regs[reg + i] = b as libc::c_char;
        }
    }
    vcpu.set_lapic(&lapic)
        .map_err(|e| VmmError::Kvm("KVM_SET_LAPIC", e))
}
