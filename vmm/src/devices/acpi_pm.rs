//! The ACPI power-management registers the VMM's FADT describes (`crate::acpi`): the PM1a
//! event block (status and enable, kept as written, nothing ever raises an event), the
//! PM1a control block (SCI_EN always reads 1; a write with SLP_EN and the `_S5` SLP_TYP
//! powers off) and the reset register (the PC's 0xcf9, whose reset value resets). Both
//! end the run as a clean poweroff, as the i8042 reset does; which writes end it is
//! `kpin_abi::ports::ends_the_run`, shared with the engine.

use kpin_abi::ports::{
    ends_the_run, ACPI_PM1A_CNT_PORT, ACPI_PM1A_EVT_PORT, ACPI_PM1_CNT_SCI_EN, ACPI_RESET_PORT,
};

use super::bus::{DeviceAction, PortDevice};

/// Ports from the PM1a event block through the PM1a control block.
pub const PM_PORT_SPAN: u16 = ACPI_PM1A_CNT_PORT + 2 - ACPI_PM1A_EVT_PORT;

/// The PM1a event and control blocks, at [`ACPI_PM1A_EVT_PORT`].
#[derive(Default)]
pub struct AcpiPm {
    /// PM1 status, then PM1 enable (2 bytes each), then PM1 control.
    regs: [u8; PM_PORT_SPAN as usize],
}

fn value_of(data: &[u8]) -> u32 {
    let mut b = [0u8; 4];
    let n = data.len().min(4);
    b[..n].copy_from_slice(&data[..n]);
    u32::from_le_bytes(b)
}

impl PortDevice for AcpiPm {
    fn read(&mut self, offset: u16, data: &mut [u8]) {
        let cnt = ACPI_PM1A_CNT_PORT - ACPI_PM1A_EVT_PORT;
        for (i, d) in data.iter_mut().enumerate() {
            let o = usize::from(offset) + i;
            *d = match self.regs.get(o) {
                Some(&v) if o == usize::from(cnt) => v | ACPI_PM1_CNT_SCI_EN as u8,
                Some(&v) => v,
                None => 0xff,
            };
        }
    }

    fn write(&mut self, offset: u16, data: &[u8]) -> DeviceAction {
        let port = ACPI_PM1A_EVT_PORT + offset;
        let size = u8::try_from(data.len()).unwrap_or(u8::MAX);
        if ends_the_run(port, size, value_of(data)) {
            return DeviceAction::Reset;
        }
        let status_len = 2;
        for (i, &v) in data.iter().enumerate() {
            let o = usize::from(offset) + i;
            if o < status_len {
                // PM1 status bits are write-1-to-clear; none is ever set.
                self.regs[o] &= !v;
            } else if let Some(r) = self.regs.get_mut(o) {
                *r = v;
            }
        }
        DeviceAction::None
    }
}

/// The reset register, at [`ACPI_RESET_PORT`] (one port). Other values are PCI reset
/// control bits a VM has no use for: ignored, reading 0.
#[derive(Default)]
pub struct ResetRegister;

impl PortDevice for ResetRegister {
    fn read(&mut self, _offset: u16, data: &mut [u8]) {
        data.fill(0);
    }

    fn write(&mut self, _offset: u16, data: &[u8]) -> DeviceAction {
        let size = u8::try_from(data.len()).unwrap_or(u8::MAX);
        if ends_the_run(ACPI_RESET_PORT, size, value_of(data)) {
            DeviceAction::Reset
        } else {
            DeviceAction::None
        }
    }
}

#[cfg(test)]
mod tests {
    use kpin_abi::ports::{ACPI_PM1_CNT_SLP_EN, ACPI_PM1_CNT_SLP_TYP_SHIFT, ACPI_S5_SLP_TYP};

    use super::*;

    const CNT: u16 = ACPI_PM1A_CNT_PORT - ACPI_PM1A_EVT_PORT;

    #[test]
    fn test_s5_with_slp_en_powers_off_after_linux_writes_slp_typ_alone() {
        let mut pm = AcpiPm::default();
        let typ = ACPI_S5_SLP_TYP << ACPI_PM1_CNT_SLP_TYP_SHIFT;
        assert_eq!(pm.write(CNT, &typ.to_le_bytes()), DeviceAction::None);
        let mut b = [0u8; 2];
        pm.read(CNT, &mut b);
        assert_eq!(u16::from_le_bytes(b), typ | ACPI_PM1_CNT_SCI_EN);
        let go = typ | ACPI_PM1_CNT_SLP_EN;
        assert_eq!(pm.write(CNT, &go.to_le_bytes()), DeviceAction::Reset);
    }

    #[test]
    fn test_pm1_enable_keeps_what_is_written_and_status_reads_clear() {
        let mut pm = AcpiPm::default();
        assert_eq!(pm.write(2, &0x0121u16.to_le_bytes()), DeviceAction::None);
        let mut b = [0u8; 4];
        pm.read(0, &mut b);
        assert_eq!(b, [0, 0, 0x21, 0x01]);
        assert_eq!(pm.write(0, &[0xff, 0xff]), DeviceAction::None);
        pm.read(0, &mut b[..2]);
        assert_eq!(&b[..2], &[0, 0]);
    }

    #[test]
    fn test_reset_register_resets_only_on_the_fadt_value() {
        let mut r = ResetRegister;
        assert_eq!(r.write(0, &[0x02]), DeviceAction::None);
        assert_eq!(r.write(0, &[0x06]), DeviceAction::Reset);
    }
}
