//! The VMM on hand-assembled guests: a clean poweroff through the i8042, console output,
//! a triple fault and a spinning guest each end the run with the right outcome, every
//! crash carries a guest-state dump, and a port nothing serves reads all ones as on a PC.

use kpin_tests::{require_kvm, run_guest, scratch_dir, tiny_elf};
use vmm::{Outcome, VmConfig};

/// `mov dx,0x3f8; mov al,'O'; out dx,al; mov al,'K'; out dx,al; mov al,10; out dx,al`
const PRINT_OK: &[u8] = &[
    0x66, 0xba, 0xf8, 0x03, 0xb0, b'O', 0xee, 0xb0, b'K', 0xee, 0xb0, 0x0a, 0xee,
];
/// `mov al,0xfe; out 0x64,al; hlt`
const RESET: &[u8] = &[0xb0, 0xfe, 0xe6, 0x64, 0xf4];

fn run(name: &str, code: &[u8]) -> (vmm::RunReport, String) {
    let dir = scratch_dir(name);
    let kernel = dir.join("guest.elf");
    std::fs::write(&kernel, tiny_elf(code)).unwrap();
    let console = dir.join("console.txt");
    let cfg = VmConfig {
        mem_mib: 32,
        timeout: Some(std::time::Duration::from_secs(20)),
        console_file: Some(console.clone()),
        ..VmConfig::new(kernel)
    };
    let (report, _) = run_guest(&cfg, &dir);
    let text = std::fs::read_to_string(console).unwrap();
    (report, text)
}

#[test]
fn test_print_and_i8042_reset_is_clean_poweroff() {
    require_kvm!();
    let (report, console) = run("poweroff", &[PRINT_OK, RESET].concat());
    assert_eq!(report.outcome, Outcome::Poweroff);
    assert!(report.dump.is_none());
    assert_eq!(console, "OK\n");
}

#[test]
fn test_ud2_without_idt_is_triple_fault_with_dump() {
    require_kvm!();
    let (report, _) = run("triple", &[0x0f, 0x0b]);
    assert_eq!(report.outcome, Outcome::TripleFault);
    let dump = report.dump.expect("a crash carries a dump");
    assert!(dump.contains("RIP="), "{dump}");
    assert!(dump.contains("CR3=0000000000009000"), "{dump}");
}

#[test]
fn test_unpopulated_port_reads_all_ones_and_is_counted_per_port() {
    require_kvm!();
    // in al,0x99; out 0x99,al; cmp al,0xff; mov al,'N'; jne +2; mov al,'Y';
    // mov dx,0x3f8; out dx,al; mov al,10; out dx,al; then the i8042 reset.
    let mut code = vec![
        0xe4, 0x99, 0xe6, 0x99, 0x3c, 0xff, 0xb0, b'N', 0x75, 0x02, 0xb0, b'Y', 0x66, 0xba, 0xf8,
        0x03, 0xee, 0xb0, 0x0a, 0xee,
    ];
    code.extend_from_slice(RESET);
    let (report, console) = run("port", &code);
    assert_eq!(report.outcome, Outcome::Poweroff, "{:?}", report.dump);
    assert_eq!(console, "Y\n", "the read returned all ones");
    assert_eq!(report.exits.unpopulated_ports.get(&0x99), Some(&2));
    assert_eq!(report.exits.unpopulated_ports.len(), 1);
}

#[test]
fn test_spinning_guest_times_out() {
    require_kvm!();
    let dir = scratch_dir("timeout");
    let kernel = dir.join("guest.elf");
    // jmp $
    std::fs::write(&kernel, tiny_elf(&[0xeb, 0xfe])).unwrap();
    let cfg = VmConfig {
        mem_mib: 32,
        timeout: Some(std::time::Duration::from_secs(1)),
        ..VmConfig::new(kernel)
    };
    let (report, _) = run_guest(&cfg, &dir);
    assert_eq!(report.outcome, Outcome::Timeout);
    assert!(report.dump.unwrap().contains("jmp"));
}
