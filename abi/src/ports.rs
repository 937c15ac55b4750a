//! Port numbers shared by the VMM and the engine: the two the engine uses to reach the
//! VMM (otherwise unused on a PC; an `out` to either, one byte, any value, exits to the
//! VMM), and the platform's power-off and reset ports, whose writes end the run
//! ([`ends_the_run`]): the engine must write its final report before passing one on.

/// The host I/O ring's doorbell: the VMM drains the ring before resuming the vCPU.
/// The engine rings it only when the ring is past its batch threshold, when a record does
/// not fit, and at flush points, so a busy tool does not exit per write.
pub const DOORBELL_PORT: u16 = 0x0f10;
/// The byte written to [`DOORBELL_PORT`] when the engine's push into the record ring
/// ([`crate::record_ring`]) finds it full: the VMM drains the I/O ring as for any other
/// value, then holds the vCPU until the host's simulator has emptied half the ring (or
/// stopped), so that the engine waits without spinning on a core.
pub const DOORBELL_RECORD_ROOM: u8 = 1;
/// The engine failed (an unexpected fault inside the engine, a full code cache that cannot
/// be flushed, a guest triple fault): the VMM drains the ring (the engine's last log lines
/// and last-traces record), dumps state and ends the run as a crash.
pub const ENGINE_FAILURE_PORT: u16 = 0x0f11;
/// Whether `port` is one of the engine's own ports ([`DOORBELL_PORT`],
/// [`ENGINE_FAILURE_PORT`]), which guest code never reaches: under the engine they are
/// absent for the guest (reads all ones, writes dropped), and the ring-0 gate writes them
/// only for the engine.
pub const fn engine_only(port: u16) -> bool {
    port == DOORBELL_PORT || port == ENGINE_FAILURE_PORT
}

/// Reads bit 0 set while an instrumentation window of `kpin attach` is open, and in bits
/// 1-7 the number of windows opened so far (modulo 128), so a guest can tell a new window
/// from the one it already saw even if it never read the port while it was closed (a test
/// guest waits on it, natively or under the engine, which passes port reads through).
/// Each write counts as a guest mark (`kpin status`'s `guest_marks`).
pub const ATTACH_STATUS_PORT: u16 = 0x0f12;
/// The engine served a request of the attach control area
/// ([`crate::attach_control`]): the value written is the request's code. For a detach
/// to native execution the guest's state is in the control area's hand-back fields.
pub const DETACH_PORT: u16 = 0x0f13;

/// The ACPI PM1a event block (PM1 status, then PM1 enable; 2 bytes each), which the FADT
/// the VMM builds names. Otherwise unused on a PC (QEMU's PIIX4 PM block is at 0x600 too).
pub const ACPI_PM1A_EVT_PORT: u16 = 0x0600;
/// Length of the PM1a event block in bytes.
pub const ACPI_PM1_EVT_LEN: u8 = 4;
/// The ACPI PM1a control block (2 bytes): a write with SLP_EN set and SLP_TYP equal to
/// [`ACPI_S5_SLP_TYP`] powers the machine off.
pub const ACPI_PM1A_CNT_PORT: u16 = 0x0604;
/// Length of the PM1a control block in bytes.
pub const ACPI_PM1_CNT_LEN: u8 = 2;
/// PM1 control: SCI_EN (the machine is in ACPI mode; always set).
pub const ACPI_PM1_CNT_SCI_EN: u16 = 1 << 0;
/// PM1 control: SLP_EN (enter the sleep state SLP_TYP names).
pub const ACPI_PM1_CNT_SLP_EN: u16 = 1 << 13;
/// PM1 control: the SLP_TYP field's shift (3 bits).
pub const ACPI_PM1_CNT_SLP_TYP_SHIFT: u16 = 10;
/// SLP_TYP of the soft-off state S5, as the DSDT's `_S5` package says.
pub const ACPI_S5_SLP_TYP: u16 = 5;
/// The FADT's reset register: the PC's reset control port (0xcf9); writing
/// [`ACPI_RESET_VALUE`] resets the machine (for kpin: ends the run).
pub const ACPI_RESET_PORT: u16 = 0x0cf9;
/// The value the FADT tells the OS to write to [`ACPI_RESET_PORT`] (system reset + CPU
/// reset, as on a PC).
pub const ACPI_RESET_VALUE: u8 = 0x06;
/// The i8042 keyboard controller's command port; command [`I8042_RESET`] pulses the
/// reset line.
pub const I8042_COMMAND_PORT: u16 = 0x0064;
/// The i8042 command that resets the machine.
pub const I8042_RESET: u8 = 0xfe;

/// Whether an `out` of `size` bytes of `value` to `port` ends the run: the guest powers the
/// machine off (ACPI S5) or resets it (ACPI reset register, i8042 reset). The engine writes
/// its final report before it passes such a write on; the VMM ends the run on it.
pub fn ends_the_run(port: u16, size: u8, value: u32) -> bool {
    match port {
        I8042_COMMAND_PORT => size == 1 && value as u8 == I8042_RESET,
        ACPI_RESET_PORT => size == 1 && value as u8 == ACPI_RESET_VALUE,
        ACPI_PM1A_CNT_PORT => {
            let v = value as u16;
            size >= 2
                && v & ACPI_PM1_CNT_SLP_EN != 0
                && (v >> ACPI_PM1_CNT_SLP_TYP_SHIFT) & 7 == ACPI_S5_SLP_TYP
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_only_the_doorbell_and_failure_port_are_the_engines_own() {
        assert!(engine_only(DOORBELL_PORT));
        assert!(engine_only(ENGINE_FAILURE_PORT));
        // The attach status port is read by guests (natively and under the engine).
        for port in [
            ATTACH_STATUS_PORT,
            0x0f0f,
            crate::x86::COM1_PORT,
            I8042_COMMAND_PORT,
            ACPI_RESET_PORT,
        ] {
            assert!(!engine_only(port), "{port:#x}");
        }
    }

    #[test]
    fn test_poweroff_and_reset_writes_end_the_run_and_nothing_else_does() {
        let s5 = ACPI_PM1_CNT_SLP_EN | (ACPI_S5_SLP_TYP << ACPI_PM1_CNT_SLP_TYP_SHIFT);
        assert!(ends_the_run(ACPI_PM1A_CNT_PORT, 2, u32::from(s5)));
        // Linux writes SLP_TYP first, then SLP_TYP | SLP_EN: only the second ends it.
        assert!(!ends_the_run(
            ACPI_PM1A_CNT_PORT,
            2,
            u32::from(ACPI_S5_SLP_TYP << ACPI_PM1_CNT_SLP_TYP_SHIFT)
        ));
        // Another sleep state (S3) with SLP_EN is not a poweroff.
        assert!(!ends_the_run(
            ACPI_PM1A_CNT_PORT,
            2,
            u32::from(ACPI_PM1_CNT_SLP_EN | (3 << ACPI_PM1_CNT_SLP_TYP_SHIFT))
        ));
        assert!(ends_the_run(ACPI_RESET_PORT, 1, 6));
        assert!(!ends_the_run(ACPI_RESET_PORT, 1, 2));
        assert!(ends_the_run(I8042_COMMAND_PORT, 1, 0xfe));
        assert!(!ends_the_run(I8042_COMMAND_PORT, 1, 0xd1));
        assert!(!ends_the_run(0x80, 1, 0xfe));
    }
}
