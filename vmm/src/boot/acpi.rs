//! ACPI tables, so that a guest's `poweroff` and `reboot` end the run as on a PC.
//!
//! Without ACPI a distribution kernel booted without `reboot=k` has no way to power off:
//! `poweroff -f` prints `reboot: Power down` and halts with interrupts disabled. The VMM
//! therefore gives the guest what Firecracker and Cloud Hypervisor give theirs, built with
//! rust-vmm's `acpi_tables` crate: an RSDP in the BIOS area (where Linux scans for it, and
//! named in the zero page), an XSDT, a FADT and a DSDT. The FADT describes a PM1a event
//! block, a PM1a control block and a reset register at the ports of
//! `kpin_abi::ports` (served by `devices::acpi_pm`); the DSDT holds only the `_S5` package
//! whose SLP_TYP a poweroff writes, and one `LNRO0005` device per virtio-mmio device (the ACPI
//! ID Linux's `virtio_mmio` driver matches, as Firecracker declares its devices: the
//! Debian kernels lack `CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES`, so `virtio_mmio.device=` on
//! the command line would not reach them) with its register page and its ISA interrupt,
//! edge-triggered and active high. A MADT names the one local APIC and KVM's in-kernel
//! IOAPIC (as Firecracker's does): without it Linux stays in virtual-wire mode with SMP
//! disabled, never starts its local APIC timer and ticks with the PIT through the 8259 —
//! five port accesses per tick (two PIT reloads, the PIC's mask, EOI and unmask), each a
//! gate call and a VM exit under the engine: ~5 000 in a boot. With it the tick is the
//! TSC-deadline timer and interrupts come through the IOAPIC (the engine's interrupt
//! stubs take any vector, whichever chip raised it).
//!
//! Invariants: every table lies in [`ACPI_START`, [`ACPI_END`]), inside the e820 reserved
//! range below 1 MiB, 16-byte aligned; checksums are correct (the crate computes them; the
//! tests recompute them).

use crate::devices::virtio::MmioWindow;
use acpi_tables::fadt::{FADTBuilder, Flags};
use acpi_tables::gas::{AccessSize, AddressSpace, GAS};
use acpi_tables::madt::{
    EnabledStatus, IoApic, LocalInterruptController, ProcessorLocalApic, MADT,
};
use acpi_tables::sdt::Sdt;
use acpi_tables::{aml, facs::FACS, rsdp::Rsdp, xsdt::XSDT, Aml};
use kpin_abi::ports::{
    ACPI_PM1A_CNT_PORT, ACPI_PM1A_EVT_PORT, ACPI_PM1_CNT_LEN, ACPI_PM1_EVT_LEN, ACPI_RESET_PORT,
    ACPI_RESET_VALUE, ACPI_S5_SLP_TYP,
};

/// Where the RSDP goes: the start of the BIOS read-only area that Linux scans for it.
pub const ACPI_START: u64 = 0xe_0000;
/// End of the space the tables may use (the BIOS area ends at 1 MiB).
pub const ACPI_END: u64 = 0x10_0000;
/// OEM ID in every table header.
const OEM_ID: [u8; 6] = *b"KPIN  ";
/// OEM table ID in every table header.
const OEM_TABLE_ID: [u8; 8] = *b"KPINVM  ";
/// OEM revision.
const OEM_REVISION: u32 = 1;
/// The SCI's interrupt (the PC's usual IRQ 9). Nothing raises it: the VMM has no ACPI
/// events, but a full (not hardware-reduced) FADT must name one.
const SCI_IRQ: u16 = 9;
/// The local APIC's and the IOAPIC's MMIO addresses (KVM's in-kernel ones).
pub(super) const LAPIC_ADDR: u32 = 0xfee0_0000;
pub(super) const IOAPIC_ADDR: u32 = 0xfec0_0000;

/// FADT IA-PC boot architecture flags: legacy devices (the i8042) and an 8042 present,
/// and no CMOS RTC (bit 5; its ports read all ones here). Without that bit Linux registers
/// the `rtc_cmos` platform device and polls the absent clock's update-in-progress bit:
/// measured under `--tool null`, 13 s of guest time from `registered platform RTC device`
/// to `rtc_cmos: broken or not accessible`, and under load a soft-lockup warning.
const IAPC_BOOT_ARCH: u16 = IAPC_LEGACY_DEVICES | IAPC_8042 | IAPC_CMOS_RTC_NOT_PRESENT;
const IAPC_LEGACY_DEVICES: u16 = 1 << 0;
const IAPC_8042: u16 = 1 << 1;
const IAPC_CMOS_RTC_NOT_PRESENT: u16 = 1 << 5;

/// The tables, each with the guest-physical address it goes to.
pub struct AcpiTables {
    /// `(guest-physical address, bytes)` in ascending address order.
    pub blobs: Vec<(u64, Vec<u8>)>,
    /// The RSDP's address (for `boot_params.acpi_rsdp_addr`).
    pub rsdp_addr: u64,
}

fn bytes(t: &dyn Aml) -> Vec<u8> {
    let mut v = Vec::new();
    t.to_aml_bytes(&mut v);
    v
}

fn io_gas(port: u16, bytes: u8) -> GAS {
    GAS::new(
        AddressSpace::SystemIo,
        bytes * 8,
        0,
        match bytes {
            1 => AccessSize::ByteAccess,
            2 => AccessSize::WordAccess,
            _ => AccessSize::DwordAccess,
        },
        u64::from(port),
    )
}

/// The DSDT's `\_SB` entries for the virtio-mmio devices: `VR00`, `VR01`, … each with
/// `_HID "LNRO0005"`, `_UID` its slot, and `_CRS` its register window and interrupt.
fn virtio_devices(devices: &[MmioWindow]) -> Vec<u8> {
    let mut out = Vec::new();
    if devices.is_empty() {
        return out;
    }
    // The AML builders borrow their parts: each level is built in a vector of its own.
    let hid: &'static str = "LNRO0005";
    let mems: Vec<aml::Memory32Fixed> = devices
        .iter()
        .map(|d| aml::Memory32Fixed::new(true, d.base as u32, d.len as u32))
        .collect();
    let irqs: Vec<aml::Interrupt> = devices
        .iter()
        .map(|d| aml::Interrupt::new(true, true, false, false, d.irq))
        .collect();
    let crs: Vec<aml::ResourceTemplate> = mems
        .iter()
        .zip(&irqs)
        .map(|(m, i)| aml::ResourceTemplate::new(vec![m, i]))
        .collect();
    let uids: Vec<u32> = (0..devices.len() as u32).collect();
    let names: Vec<[aml::Name; 3]> = crs
        .iter()
        .zip(&uids)
        .map(|(c, u)| {
            [
                aml::Name::new("_HID".into(), &hid),
                aml::Name::new("_UID".into(), u),
                aml::Name::new("_CRS".into(), c),
            ]
        })
        .collect();
    let paths: Vec<String> = (0..devices.len()).map(|i| format!("VR{i:02X}")).collect();
    let devs: Vec<aml::Device> = names
        .iter()
        .zip(&paths)
        .map(|(n, p)| {
            aml::Device::new(p.as_str().into(), n.iter().map(|x| x as &dyn Aml).collect())
        })
        .collect();
    let children: Vec<&dyn Aml> = devs.iter().map(|d| d as &dyn Aml).collect();
    aml::Scope::new("\\_SB_".into(), children).to_aml_bytes(&mut out);
    out
}

/// Builds the RSDP, XSDT, FADT, FACS, DSDT and MADT, laid out from [`ACPI_START`], the DSDT
/// declaring `devices` (virtio-mmio).
pub fn build(devices: &[MmioWindow]) -> AcpiTables {
    let align = |a: u64| a.next_multiple_of(16);
    let rsdp_addr = ACPI_START;
    let xsdt_addr = align(rsdp_addr + Rsdp::len() as u64);
    // The XSDT's entries are the FADT (the DSDT and FACS hang off the FADT) and the MADT.
    let xsdt_len = 36 + 2 * 8;
    let fadt_addr = align(xsdt_addr + xsdt_len);
    let facs_addr = align(fadt_addr + acpi_tables::fadt::FADT::len() as u64).next_multiple_of(64);
    let dsdt_addr = align(facs_addr + FACS::len() as u64);
    let madt = {
        let mut m = MADT::new(
            OEM_ID,
            OEM_TABLE_ID,
            OEM_REVISION,
            LocalInterruptController::Address(LAPIC_ADDR),
        );
        m.add_structure(ProcessorLocalApic::new(0, 0, EnabledStatus::Enabled));
        m.add_structure(IoApic::new(0, IOAPIC_ADDR, 0));
        bytes(&m)
    };

    // DSDT: Name (_S5, Package () { SLP_TYPa, SLP_TYPb, 0, 0 }).
    let s5 = ACPI_S5_SLP_TYP as u8;
    let zero = 0u8;
    let s5_pkg = aml::Package::new(vec![&s5, &s5, &zero, &zero]);
    let s5_name = aml::Name::new("_S5_".into(), &s5_pkg);
    let mut body = bytes(&s5_name);
    body.extend(virtio_devices(devices));
    let mut dsdt = Sdt::new(*b"DSDT", 36, 2, OEM_ID, OEM_TABLE_ID, OEM_REVISION);
    dsdt.append_slice(&body);
    let dsdt = dsdt.as_slice().to_vec();
    let madt_addr = align(dsdt_addr + dsdt.len() as u64);

    let facs = bytes(&FACS::new());

    let mut f = FADTBuilder::new(OEM_ID, OEM_TABLE_ID, OEM_REVISION)
        .dsdt_64(dsdt_addr)
        .firmware_ctrl_64(facs_addr)
        .flag(Flags::Wbinvd)
        .flag(Flags::PwrButton)
        .flag(Flags::SlpButton)
        .flag(Flags::ResetRegSup)
        .flag(Flags::Headless);
    f.sci_int = SCI_IRQ.into();
    // SMI_CMD = 0: the machine is always in ACPI mode (SCI_EN reads 1), no handover.
    f.pm1a_evt_blk = u32::from(ACPI_PM1A_EVT_PORT).into();
    f.pm1_evt_len = ACPI_PM1_EVT_LEN;
    f.pm1a_cnt_blk = u32::from(ACPI_PM1A_CNT_PORT).into();
    f.pm1_cnt_len = ACPI_PM1_CNT_LEN;
    f.x_pm1a_evt_blk = io_gas(ACPI_PM1A_EVT_PORT, ACPI_PM1_EVT_LEN);
    f.x_pm1a_cnt_blk = io_gas(ACPI_PM1A_CNT_PORT, ACPI_PM1_CNT_LEN);
    f.reset_reg = io_gas(ACPI_RESET_PORT, 1);
    f.reset_value = ACPI_RESET_VALUE;
    f.iapc_boot_arch = IAPC_BOOT_ARCH.into();
    let fadt = bytes(&f.finalize());

    let mut xsdt = XSDT::new(OEM_ID, OEM_TABLE_ID, OEM_REVISION);
    xsdt.add_entry(fadt_addr);
    xsdt.add_entry(madt_addr);
    let xsdt = bytes(&xsdt);
    debug_assert_eq!(xsdt.len() as u64, xsdt_len);

    let rsdp = bytes(&Rsdp::new(OEM_ID, xsdt_addr));
    let blobs = vec![
        (rsdp_addr, rsdp),
        (xsdt_addr, xsdt),
        (fadt_addr, fadt),
        (facs_addr, facs),
        (dsdt_addr, dsdt),
        (madt_addr, madt),
    ];
    AcpiTables { blobs, rsdp_addr }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sum(b: &[u8]) -> u8 {
        b.iter().fold(0u8, |a, x| a.wrapping_add(*x))
    }

    #[test]
    fn test_virtio_devices_are_declared_in_the_dsdt() {
        let none = build(&[]);
        let w = |base, irq| MmioWindow {
            base,
            len: 0x1000,
            irq,
        };
        let t = build(&[w(0xd000_0000, 10), w(0xd000_1000, 5)]);
        let dsdt = |t: &AcpiTables| {
            t.blobs
                .iter()
                .find(|(_, b)| b.starts_with(b"DSDT"))
                .unwrap()
                .1
                .clone()
        };
        let (d0, d) = (dsdt(&none), dsdt(&t));
        assert!(d.len() > d0.len());
        assert_eq!(sum(&d), 0);
        let has = |needle: &[u8]| d.windows(needle.len()).any(|x| x == needle);
        assert!(has(b"LNRO0005\0"));
        assert!(has(b"VR00") && has(b"VR01") && has(b"_SB_"));
        // Memory32Fixed (0x86) with the base, and the extended IRQ (0x89) with line 10.
        assert!(has(&[0x86, 9, 0, 1, 0, 0, 0, 0xd0, 0, 0x10, 0, 0]));
        assert!(has(&[0x89, 6, 0, 0b11, 1, 10, 0, 0, 0]));
        let end = t.blobs.last().map(|(a, b)| a + b.len() as u64).unwrap();
        assert!(end <= ACPI_END);
    }

    #[test]
    fn test_tables_fit_the_bios_area_without_overlap_and_checksum_to_zero() {
        let t = build(&[]);
        let mut end = ACPI_START;
        for (addr, b) in &t.blobs {
            assert!(*addr >= end, "table at {addr:#x} overlaps the previous one");
            assert_eq!(addr % 16, 0);
            end = addr + b.len() as u64;
        }
        assert!(end <= ACPI_END);
        let find = |sig: &[u8]| {
            t.blobs
                .iter()
                .find(|(_, b)| b.starts_with(sig))
                .unwrap_or_else(|| panic!("no {}", String::from_utf8_lossy(sig)))
        };
        // RSDP: the first 20 bytes and the whole 36 bytes each sum to zero.
        let (_, rsdp) = find(b"RSD PTR ");
        assert_eq!(sum(&rsdp[..20]), 0);
        assert_eq!(sum(rsdp), 0);
        for sig in [b"XSDT", b"FACP", b"DSDT", b"APIC"] {
            let (_, b) = find(sig);
            let len = u32::from_le_bytes(b[4..8].try_into().unwrap()) as usize;
            assert_eq!(len, b.len(), "{}", String::from_utf8_lossy(sig));
            assert_eq!(sum(b), 0, "{} checksum", String::from_utf8_lossy(sig));
        }
    }

    #[test]
    fn test_fadt_names_the_pm_ports_reset_register_and_the_other_tables() {
        let t = build(&[]);
        let addr_of = |sig: &[u8]| t.blobs.iter().find(|(_, b)| b.starts_with(sig)).unwrap();
        let (fadt_addr, fadt) = addr_of(b"FACP");
        let u32_at = |o: usize| u32::from_le_bytes(fadt[o..o + 4].try_into().unwrap());
        let u64_at = |o: usize| u64::from_le_bytes(fadt[o..o + 8].try_into().unwrap());
        // Offsets from the ACPI spec's FADT layout.
        assert_eq!(u32_at(56), u32::from(ACPI_PM1A_EVT_PORT));
        assert_eq!(u32_at(64), u32::from(ACPI_PM1A_CNT_PORT));
        assert_eq!(fadt[88], ACPI_PM1_EVT_LEN);
        assert_eq!(fadt[89], ACPI_PM1_CNT_LEN);
        assert_ne!(u32_at(112) & Flags::ResetRegSup as u32, 0);
        assert_eq!(u32_at(112) & Flags::HwReducedAcpi as u32, 0);
        assert_eq!(fadt[116], 1, "reset register in I/O space");
        assert_eq!(u64_at(120), u64::from(ACPI_RESET_PORT));
        assert_eq!(fadt[128], ACPI_RESET_VALUE);
        assert_eq!(u64_at(140), addr_of(b"DSDT").0);
        // IA-PC boot architecture (offset 109): 8042 present, no CMOS RTC.
        let boot_arch = u16::from_le_bytes([fadt[109], fadt[110]]);
        assert_eq!(boot_arch & (1 << 1), 1 << 1);
        assert_eq!(boot_arch & (1 << 5), 1 << 5);
        assert_eq!(u64_at(132), addr_of(b"FACS").0);
        // The XSDT's one entry is the FADT; the RSDP points at the XSDT.
        let (xsdt_addr, xsdt) = addr_of(b"XSDT");
        assert_eq!(
            u64::from_le_bytes(xsdt[36..44].try_into().unwrap()),
            *fadt_addr
        );
        let (_, rsdp) = addr_of(b"RSD PTR ");
        assert_eq!(
            u64::from_le_bytes(rsdp[24..32].try_into().unwrap()),
            *xsdt_addr
        );
        assert_eq!(t.rsdp_addr, ACPI_START);
    }

    #[test]
    fn test_madt_names_the_one_local_apic_and_the_ioapic() {
        let t = build(&[]);
        let (madt_addr, madt) = t
            .blobs
            .iter()
            .find(|(_, b)| b.starts_with(b"APIC"))
            .unwrap();
        assert_eq!(sum(madt), 0);
        let u32_at = |o: usize| u32::from_le_bytes(madt[o..o + 4].try_into().unwrap());
        assert_eq!(u32_at(4) as usize, madt.len());
        assert_eq!(u32_at(36), LAPIC_ADDR);
        // Processor local APIC (type 0, length 8): UID 0, APIC ID 0, enabled.
        assert_eq!(&madt[44..52], &[0, 8, 0, 0, 1, 0, 0, 0]);
        // I/O APIC (type 1, length 12): ID 0 (KVM's), its address, GSI base 0.
        assert_eq!(&madt[52..56], &[1, 12, 0, 0]);
        assert_eq!(u32_at(56), IOAPIC_ADDR);
        assert_eq!(u32_at(60), 0);
        assert_eq!(madt.len(), 64);
        let (_, xsdt) = t
            .blobs
            .iter()
            .find(|(_, b)| b.starts_with(b"XSDT"))
            .unwrap();
        assert_eq!(
            u64::from_le_bytes(xsdt[44..52].try_into().unwrap()),
            *madt_addr
        );
    }

    #[test]
    fn test_dsdt_defines_s5_with_the_slp_typ_the_pm_device_expects() {
        let t = build(&[]);
        let (_, dsdt) = t
            .blobs
            .iter()
            .find(|(_, b)| b.starts_with(b"DSDT"))
            .unwrap();
        let body = &dsdt[36..];
        // NameOp "_S5_" PackageOp len count BytePrefix 5 BytePrefix 5 Zero Zero
        assert_eq!(&body[..5], b"\x08_S5_");
        assert_eq!(body[5], 0x12);
        let pkg = &body[7..];
        assert_eq!(pkg[0], 4);
        assert_eq!(
            &pkg[1..5],
            &[0x0a, ACPI_S5_SLP_TYP as u8, 0x0a, ACPI_S5_SLP_TYP as u8]
        );
    }
}
