//! Just enough of the i8042 keyboard controller for a guest to find it and to reset the
//! machine through it (command 0xfe on port 0x64), which kpin treats as poweroff.
//!
//! Linux booted with `reboot=k` reboots this way (without it, through the ACPI reset register).

use super::bus::{DeviceAction, PortDevice};

/// Base port of the controller's data register (0x60); the command/status port is 0x64.
pub const I8042_DATA_PORT: u16 = 0x60;
/// Span of ports from the data port to the command port inclusive.
pub const I8042_PORT_SPAN: u16 = 5;
const OFFSET_DATA: u16 = 0;
const OFFSET_COMMAND: u16 = 4;
const CMD_READ_CTR: u8 = 0x20;
const CMD_WRITE_CTR: u8 = 0x60;
const CMD_RESET_CPU: u8 = 0xfe;
/// Status bit: output buffer full (a byte waits on port 0x60).
const STATUS_OBF: u8 = 1 << 0;
/// Status bit: the keyboard is not inhibited by the key lock (Linux warns "Keylock
/// active" when it reads clear).
const STATUS_UNLOCKED: u8 = 1 << 4;

/// The controller.
#[derive(Default)]
pub struct I8042 {
    ctr: u8,
    pending_out: Option<u8>,
    expect_ctr_write: bool,
}

impl PortDevice for I8042 {
    fn read(&mut self, offset: u16, data: &mut [u8]) {
        let v = match offset {
            OFFSET_DATA => self.pending_out.take().unwrap_or(0),
            OFFSET_COMMAND => {
                if self.pending_out.is_some() {
                    STATUS_UNLOCKED | STATUS_OBF
                } else {
                    STATUS_UNLOCKED
                }
            }
            _ => 0xff,
        };
        data.fill(v);
    }

    fn write(&mut self, offset: u16, data: &[u8]) -> DeviceAction {
        let Some(&v) = data.first() else {
            return DeviceAction::None;
        };
        match offset {
            OFFSET_COMMAND => match v {
                CMD_RESET_CPU => return DeviceAction::Reset,
                CMD_READ_CTR => self.pending_out = Some(self.ctr),
                CMD_WRITE_CTR => self.expect_ctr_write = true,
                _ => {}
            },
            OFFSET_DATA if self.expect_ctr_write => {
                self.ctr = v;
                self.expect_ctr_write = false;
            }
            _ => {}
        }
        DeviceAction::None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_reset_command_requests_reset() {
        let mut k = I8042::default();
        assert_eq!(k.write(OFFSET_COMMAND, &[0xfe]), DeviceAction::Reset);
    }

    #[test]
    fn test_ctr_round_trips_through_data_port() {
        let mut k = I8042::default();
        k.write(OFFSET_COMMAND, &[CMD_WRITE_CTR]);
        k.write(OFFSET_DATA, &[0x47]);
        k.write(OFFSET_COMMAND, &[CMD_READ_CTR]);
        let mut s = [0];
        k.read(OFFSET_COMMAND, &mut s);
        assert_eq!(s[0] & STATUS_OBF, STATUS_OBF);
        let mut d = [0];
        k.read(OFFSET_DATA, &mut d);
        assert_eq!(d[0], 0x47);
        k.read(OFFSET_COMMAND, &mut s);
        assert_eq!(s[0] & STATUS_OBF, 0);
    }
}
