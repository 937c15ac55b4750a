//! The engine's two ports to the VMM ([`kpin_abi::ports`]): the I/O-ring doorbell and
//! the engine-failure report. Either `out` turns into a [`DeviceAction`] the run loop acts on.

use kpin_abi::ports::{DOORBELL_PORT, DOORBELL_RECORD_ROOM, ENGINE_FAILURE_PORT};

use super::bus::{DeviceAction, PortDevice};

/// First port of the device.
pub const ENGINE_PORTS_BASE: u16 = DOORBELL_PORT;
/// Number of ports.
pub const ENGINE_PORTS_SPAN: u16 = ENGINE_FAILURE_PORT - DOORBELL_PORT + 1;
const _: () = assert!(ENGINE_FAILURE_PORT == DOORBELL_PORT + 1);

/// The doorbell/failure ports.
#[derive(Default)]
pub struct EnginePorts;

impl PortDevice for EnginePorts {
    fn read(&mut self, _offset: u16, data: &mut [u8]) {
        data.fill(0);
    }

    fn write(&mut self, offset: u16, data: &[u8]) -> DeviceAction {
        match offset + ENGINE_PORTS_BASE {
            DOORBELL_PORT if data == [DOORBELL_RECORD_ROOM] => DeviceAction::WaitForRecordRoom,
            DOORBELL_PORT => DeviceAction::DrainRing,
            ENGINE_FAILURE_PORT => DeviceAction::EngineFailure,
            _ => DeviceAction::None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_doorbell_and_failure_ports_map_to_actions() {
        let mut p = EnginePorts;
        assert_eq!(p.write(0, &[0]), DeviceAction::DrainRing);
        assert_eq!(
            p.write(0, &[DOORBELL_RECORD_ROOM]),
            DeviceAction::WaitForRecordRoom
        );
        assert_eq!(p.write(1, &[1]), DeviceAction::EngineFailure);
    }
}
