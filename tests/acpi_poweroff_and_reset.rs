//! A guest powers off through the ACPI PM1a control block (SLP_TYP = `_S5`'s, SLP_EN) or
//! resets through the FADT's reset register, natively and under the engine: either ends
//! the run as a clean poweroff, and under the engine the tool's results are written
//! first (the engine passes the write on only after its final report).

use kpin_abi::ports::{
    ACPI_PM1A_CNT_PORT, ACPI_PM1_CNT_SLP_EN, ACPI_PM1_CNT_SLP_TYP_SHIFT, ACPI_RESET_PORT,
    ACPI_RESET_VALUE, ACPI_S5_SLP_TYP,
};
use kpin_tests::{require_kvm, run_tiny_guest};
use vmm::Outcome;

/// `mov dx, ACPI_PM1A_CNT_PORT; mov ax, SLP_TYP(S5); out dx, ax; or ax, SLP_EN;
/// out dx, ax; hlt` — Linux's order: the type first, then the type with SLP_EN.
fn s5_poweroff() -> Vec<u8> {
    let typ = ACPI_S5_SLP_TYP << ACPI_PM1_CNT_SLP_TYP_SHIFT;
    let mut c = vec![0x66, 0xba];
    c.extend_from_slice(&ACPI_PM1A_CNT_PORT.to_le_bytes());
    c.extend_from_slice(&[0x66, 0xb8]);
    c.extend_from_slice(&typ.to_le_bytes());
    c.extend_from_slice(&[0x66, 0xef]);
    c.extend_from_slice(&[0x66, 0x0d]);
    c.extend_from_slice(&ACPI_PM1_CNT_SLP_EN.to_le_bytes());
    c.extend_from_slice(&[0x66, 0xef, 0xf4]);
    c
}

/// `mov dx, ACPI_RESET_PORT; mov al, 2; out dx, al; mov al, ACPI_RESET_VALUE; out dx, al;
/// hlt` — a value other than the FADT's does nothing.
fn reset_register() -> Vec<u8> {
    let mut c = vec![0x66, 0xba];
    c.extend_from_slice(&ACPI_RESET_PORT.to_le_bytes());
    c.extend_from_slice(&[0xb0, 0x02, 0xee, 0xb0, ACPI_RESET_VALUE, 0xee, 0xf4]);
    c
}

fn check(name: &str, code: &[u8], tool: Option<&str>) {
    let (report, console, log, _) = run_tiny_guest(name, code, tool);
    assert_eq!(
        report.outcome,
        Outcome::Poweroff,
        "{name} ({tool:?}): console:\n{console}\nengine.log:\n{log}\n{:?}",
        report.dump
    );
    if tool.is_some() {
        // The final report came before the write that ended the run.
        assert!(log.contains("engine: stats:"), "{log}");
        assert!(log.contains("(poweroff or reset): passing it on"), "{log}");
    }
}

#[test]
fn test_acpi_s5_poweroff_ends_the_run_cleanly_natively_and_under_the_engine() {
    require_kvm!();
    check("acpi-s5-native", &s5_poweroff(), None);
    check("acpi-s5-null", &s5_poweroff(), Some("null"));
}

#[test]
fn test_acpi_reset_register_ends_the_run_cleanly_natively_and_under_the_engine() {
    require_kvm!();
    check("acpi-reset-native", &reset_register(), None);
    check("acpi-reset-null", &reset_register(), Some("null"));
}
