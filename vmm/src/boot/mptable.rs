//! An Intel MultiProcessor Specification (1.4) table, as Firecracker writes one.
//!
//! Why: a kernel built with `CONFIG_X86_MPPARSE` (Debian's generic kernels; not the cloud
//! ones) looks for the MP floating pointer before it reads ACPI's MADT, in the bottom
//! KiB of RAM, the top KiB of base memory (0x9fc00) and the 64 KiB BIOS area — and it
//! scans by calling `early_memremap(base, length)` on what remains of the range at
//! every 16-byte step (`smp_scan_config` in `arch/x86/kernel/mpparse.c`). Each map and
//! unmap flushes its fixmap pages: with no table to find, the BIOS area alone costs
//! ~72 000 `invlpg`s, and under the engine each one whose page the shadow had mapped is a
//! ring-0 trip — measured with `--tool null` on Debian's 6.12 generic kernel: 40 000
//! trips, 22 % of the boot's cycles. A real PC's BIOS, SeaBIOS under QEMU and Firecracker
//! all provide the table, so the scan stops at its first hit.
//!
//! The table is put where the scan's second range starts ([`MPTABLE_START`], the EBDA,
//! reserved in the e820 map) and says what the MADT says: one enabled boot processor
//! with local APIC ID 0, KVM's IOAPIC (ID 0) at its usual address, and an ISA bus whose
//! sixteen IRQs go to the IOAPIC's pins of the same number, with the 8259 as ExtINT on
//! LINT0 and NMI on LINT1, as a PC BIOS wires them (`lint.rs`). Linux reads it only when
//! ACPI is off (`acpi=off`, or a kernel without ACPI); otherwise it only reports
//! `found SMP MP-table` and uses the MADT.
//!
//! Invariants: the floating pointer is 16-byte aligned and both structures checksum to
//! zero; the whole table fits below [`MPTABLE_END`].

use super::acpi::{IOAPIC_ADDR, LAPIC_ADDR};
use super::layout::{CMDLINE_MAX_BYTES, CMDLINE_START, EBDA_START};

/// Where the floating pointer goes: the start of the scan's second range.
pub const MPTABLE_START: u64 = EBDA_START;
/// The end of that range (the scan looks at one KiB there).
pub const MPTABLE_END: u64 = EBDA_START + 0x400;
// Above the command line, the last boot structure in low memory (`layout.rs`).
const _: () = assert!(MPTABLE_START >= CMDLINE_START + CMDLINE_MAX_BYTES as u64);

/// MP specification revision 1.4.
const SPEC_REV: u8 = 4;
/// KVM's local APIC version register and its IOAPIC's.
const LAPIC_VERSION: u8 = 0x14;
const IOAPIC_VERSION: u8 = 0x11;
/// The one processor's local APIC ID, and the IOAPIC's (as in the MADT).
const BSP_APIC_ID: u8 = 0;
const IOAPIC_ID: u8 = 0;
/// The ISA bus's ID.
const ISA_BUS: u8 = 0;
/// ISA IRQs routed to the IOAPIC.
const ISA_IRQS: u8 = 16;

/// Entry types (MP spec table 4-3).
const ENTRY_PROCESSOR: u8 = 0;
const ENTRY_BUS: u8 = 1;
const ENTRY_IOAPIC: u8 = 2;
const ENTRY_IO_INTERRUPT: u8 = 3;
const ENTRY_LOCAL_INTERRUPT: u8 = 4;
/// Interrupt types (MP spec table 4-9).
const INT_VECTORED: u8 = 0;
const INT_NMI: u8 = 1;
const INT_EXTINT: u8 = 3;
/// Processor entry flags: enabled, bootstrap processor.
const CPU_ENABLED: u8 = 1 << 0;
const CPU_BSP: u8 = 1 << 1;
/// IOAPIC entry flag: usable.
const IOAPIC_USABLE: u8 = 1 << 0;
/// Local interrupt destination "every local APIC".
const ALL_LOCAL_APICS: u8 = 0xff;
/// Length of the configuration table's header.
const HEADER_BYTES: usize = 44;

/// Two's-complement checksum byte that makes `b` sum to zero.
fn checksum(b: &[u8]) -> u8 {
    b.iter().fold(0u8, |a, x| a.wrapping_sub(*x))
}

/// The floating pointer and the configuration table right after it, to be written at
/// [`MPTABLE_START`].
pub fn build() -> Vec<u8> {
    let table_addr = MPTABLE_START + 16;
    let mut entries = Vec::new();
    let mut count: u16 = 0;
    let mut entry = |bytes: &[u8]| {
        entries.extend_from_slice(bytes);
        count += 1;
    };
    // Processor: type, APIC ID, APIC version, flags, CPU signature and feature flags
    // (left 0: Linux reads neither), 8 reserved bytes.
    let mut cpu = [0u8; 20];
    cpu[..4].copy_from_slice(&[
        ENTRY_PROCESSOR,
        BSP_APIC_ID,
        LAPIC_VERSION,
        CPU_ENABLED | CPU_BSP,
    ]);
    entry(&cpu);
    let mut bus = [ENTRY_BUS, ISA_BUS, 0, 0, 0, 0, 0, 0];
    bus[2..].copy_from_slice(b"ISA   ");
    entry(&bus);
    let mut ioapic = [
        ENTRY_IOAPIC,
        IOAPIC_ID,
        IOAPIC_VERSION,
        IOAPIC_USABLE,
        0,
        0,
        0,
        0,
    ];
    ioapic[4..].copy_from_slice(&IOAPIC_ADDR.to_le_bytes());
    entry(&ioapic);
    // Interrupt entries: type, interrupt type, flags (u16, 0 = as the bus defines),
    // source bus, source IRQ, destination APIC, destination pin.
    for irq in 0..ISA_IRQS {
        entry(&[
            ENTRY_IO_INTERRUPT,
            INT_VECTORED,
            0,
            0,
            ISA_BUS,
            irq,
            IOAPIC_ID,
            irq,
        ]);
    }
    entry(&[
        ENTRY_LOCAL_INTERRUPT,
        INT_EXTINT,
        0,
        0,
        ISA_BUS,
        0,
        ALL_LOCAL_APICS,
        0,
    ]);
    entry(&[
        ENTRY_LOCAL_INTERRUPT,
        INT_NMI,
        0,
        0,
        ISA_BUS,
        0,
        ALL_LOCAL_APICS,
        1,
    ]);

    let mut table = Vec::with_capacity(HEADER_BYTES + entries.len());
    table.extend_from_slice(b"PCMP");
    let len = u16::try_from(HEADER_BYTES + entries.len()).expect("a few hundred bytes");
    table.extend_from_slice(&len.to_le_bytes());
    table.push(SPEC_REV);
    table.push(0); // checksum, below
    table.extend_from_slice(b"KPIN    "); // OEM ID
    table.extend_from_slice(b"KPINVM      "); // product ID
    table.extend_from_slice(&0u32.to_le_bytes()); // OEM table pointer
    table.extend_from_slice(&0u16.to_le_bytes()); // OEM table size
    table.extend_from_slice(&count.to_le_bytes());
    table.extend_from_slice(&LAPIC_ADDR.to_le_bytes());
    table.extend_from_slice(&[0; 4]); // extended table length and checksum, reserved
    debug_assert_eq!(table.len(), HEADER_BYTES);
    table.extend_from_slice(&entries);
    table[7] = checksum(&table);

    // Floating pointer: signature, table address, length in 16-byte units, revision,
    // checksum, feature bytes (0: a configuration table is present; no IMCR).
    let mut fp = [0u8; 16];
    fp[..4].copy_from_slice(b"_MP_");
    fp[4..8].copy_from_slice(&(table_addr as u32).to_le_bytes());
    fp[8] = 1;
    fp[9] = SPEC_REV;
    fp[10] = checksum(&fp);

    let mut out = fp.to_vec();
    out.extend_from_slice(&table);
    assert!(MPTABLE_START + out.len() as u64 <= MPTABLE_END);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sum(b: &[u8]) -> u8 {
        b.iter().fold(0u8, |a, x| a.wrapping_add(*x))
    }

    /// What Linux's `smp_scan_config` accepts at a 16-byte step, and the configuration
    /// table `smp_read_mpc` then checks.
    #[test]
    fn test_floating_pointer_is_found_where_linux_scans_and_names_a_valid_table() {
        let t = build();
        assert_eq!(MPTABLE_START, 639 * 0x400);
        assert_eq!(MPTABLE_START % 16, 0);
        assert!(MPTABLE_START + t.len() as u64 <= MPTABLE_END);
        let fp = &t[..16];
        assert_eq!(&fp[..4], b"_MP_");
        assert_eq!(fp[8], 1, "length in 16-byte units");
        assert!(fp[9] == 1 || fp[9] == 4);
        assert_eq!(sum(fp), 0);
        let phys = u64::from(u32::from_le_bytes(fp[4..8].try_into().unwrap()));
        let table = &t[(phys - MPTABLE_START) as usize..];
        assert_eq!(&table[..4], b"PCMP");
        let len = usize::from(u16::from_le_bytes([table[4], table[5]]));
        assert_eq!(len, table.len());
        assert_eq!(sum(&table[..len]), 0);
        assert_eq!(table[6], SPEC_REV);
        assert_eq!(
            u32::from_le_bytes(table[36..40].try_into().unwrap()),
            0xfee0_0000
        );
        // Walk the entries as `smp_read_mpc` does: each type has its fixed length.
        let count = u16::from_le_bytes([table[34], table[35]]);
        let (mut at, mut seen) = (HEADER_BYTES, Vec::new());
        for _ in 0..count {
            let size = if table[at] == ENTRY_PROCESSOR { 20 } else { 8 };
            seen.push(&table[at..at + size]);
            at += size;
        }
        assert_eq!(at, len);
        let cpus: Vec<_> = seen.iter().filter(|e| e[0] == ENTRY_PROCESSOR).collect();
        assert_eq!(cpus.len(), 1);
        assert_eq!(&cpus[0][..4], &[0, 0, 0x14, 0b11], "APIC ID 0, enabled BSP");
        let ioapic = seen.iter().find(|e| e[0] == ENTRY_IOAPIC).unwrap();
        assert_eq!(&ioapic[4..8], &0xfec0_0000u32.to_le_bytes());
        let irqs: Vec<_> = seen
            .iter()
            .filter(|e| e[0] == ENTRY_IO_INTERRUPT)
            .map(|e| (e[5], e[7]))
            .collect();
        assert_eq!(irqs, (0..16).map(|i| (i, i)).collect::<Vec<_>>());
        let lint: Vec<_> = seen
            .iter()
            .filter(|e| e[0] == ENTRY_LOCAL_INTERRUPT)
            .map(|e| (e[1], e[7]))
            .collect();
        assert_eq!(lint, [(INT_EXTINT, 0), (INT_NMI, 1)]);
    }

    #[test]
    fn test_table_stays_clear_of_the_acpi_tables() {
        let end = MPTABLE_START + build().len() as u64;
        assert!(end <= super::super::acpi::ACPI_START);
    }
}
