//! Loading a kernel and starting the vCPU at its 64-bit entry point.
//!
//! Boot steps, in order (the Linux x86 64-bit boot protocol; the mini-kernel follows it too):
//! 1. Detect the kernel format: ELF64 (`vmlinux`, the mini-kernel) or bzImage.
//! 2. Load it with linux-loader: ELF segments at `p_paddr`; a bzImage's protected-mode part
//!    at `code32_start`, entered at +0x200 (its 64-bit entry).
//! 3. Place the initrd as high in low RAM as the kernel allows, above everything the kernel
//!    will occupy.
//! 4. Write the command line, the zero page (setup header, e820 map, initrd, cmdline), the
//!    ACPI tables and the MP table.
//! 5. Write an identity map of 0..4 GiB and a boot GDT, and set the vCPU to long mode at the
//!    entry with RSI = zero page and interrupts off.

use std::fs::File;
use std::io::Read;
use std::path::Path;

use kvm_bindings::{kvm_fpu, kvm_regs, kvm_sregs};
use linux_loader::loader::{bzimage::BzImage, elf::Elf, KernelLoader};
use vm_memory::{Bytes, GuestAddress};

use crate::error::{Result, VmmError};
use crate::layout::{
    BOOT_GDT_START, BOOT_PDPT_START, BOOT_PD_COUNT, BOOT_PD_START, BOOT_PML4_START,
    BOOT_STACK_POINTER, CMDLINE_MAX_BYTES, CMDLINE_START, HIMEM_START, INITRD_ALIGN_BYTES,
    ZERO_PAGE_START,
};
use crate::memory::{e820_map, VmMemory};
use crate::x86::{set_flat_long_mode_segments, TWO_MIB};
use kpin_abi::x86::{cr0, cr4, efer, pte, rflags};

/// Offsets inside the zero page (`struct boot_params`), from `arch/x86/include/uapi/asm/bootparam.h`.
mod zp {
    pub const ACPI_RSDP_ADDR: usize = 0x070;
    pub const E820_ENTRIES: usize = 0x1e8;
    pub const SETUP_HEADER: usize = 0x1f1;
    pub const BOOT_FLAG: usize = 0x1fe;
    pub const JUMP: usize = 0x200;
    pub const HEADER_MAGIC: usize = 0x202;
    pub const VERSION: usize = 0x206;
    pub const TYPE_OF_LOADER: usize = 0x210;
    pub const LOADFLAGS: usize = 0x211;
    pub const RAMDISK_IMAGE: usize = 0x218;
    pub const RAMDISK_SIZE: usize = 0x21c;
    pub const CMD_LINE_PTR: usize = 0x228;
    pub const INITRD_ADDR_MAX: usize = 0x22c;
    pub const KERNEL_ALIGNMENT: usize = 0x230;
    pub const CMDLINE_SIZE: usize = 0x238;
    pub const PREF_ADDRESS: usize = 0x258;
    pub const INIT_SIZE: usize = 0x260;
    pub const E820_TABLE: usize = 0x2d0;
    pub const E820_MAX_ENTRIES: usize = 128;
    pub const SIZE: usize = 0x1000;
}

const HDRS_MAGIC: u32 = 0x5372_6448; // "HdrS"
const BOOT_FLAG_MAGIC: u16 = 0xaa55;
/// "Undefined" boot-loader id: we are not a registered boot loader.
const LOADER_TYPE_UNDEFINED: u8 = 0xff;
/// loadflags: protected-mode code is loaded at 0x100000.
const LOADED_HIGH: u8 = 0x01;
/// loadflags: the heap_end_ptr is valid.
const CAN_USE_HEAP: u8 = 0x80;
/// Oldest boot protocol with a 64-bit entry point at +0x200 and relocatable kernels.
const MIN_BOOT_PROTOCOL: u16 = 0x0206;
/// Offset of a bzImage's 64-bit entry from its protected-mode load address.
const BZIMAGE_ENTRY64_OFFSET: u64 = 0x200;
/// Highest initrd address a kernel without a setup header (plain ELF) can take.
const ELF_INITRD_ADDR_MAX: u64 = 0x7fff_ffff;
/// Default kernel alignment advertised for ELF kernels (Linux's CONFIG_PHYSICAL_ALIGN).
const DEFAULT_KERNEL_ALIGNMENT: u32 = 0x20_0000;

/// Boot GDT: null, null, 64-bit code (selector 0x10), data (0x18), as Linux's boot code uses.
const BOOT_GDT: [u64; 4] = [0, 0, 0x00af_9b00_0000_ffff, 0x00cf_9300_0000_ffff];
/// Boot code selector.
pub const BOOT_CS: u16 = 0x10;
/// Boot data selector.
pub const BOOT_DS: u16 = 0x18;

/// The kernel formats kpin boots.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelFormat {
    /// An ELF64 executable, entered at `e_entry` (physical).
    Elf,
    /// A Linux bzImage, entered at its 64-bit entry point.
    BzImage,
}

/// What the boot loader did, for the run summary.
#[derive(Clone, Debug)]
pub struct BootInfo {
    /// Kernel format.
    pub format: KernelFormat,
    /// Guest-physical entry point.
    pub entry: u64,
    /// Guest-physical end of the kernel's footprint.
    pub kernel_end: u64,
    /// Where the initrd was put and its size, if any.
    pub initrd: Option<(u64, u64)>,
}

/// Loads `kernel` (and `initrd`) with `cmdline` into `mem`, the ACPI tables declaring the
/// virtio-mmio `devices`; returns where to start.
pub fn load(
    mem: &VmMemory,
    kernel: &Path,
    initrd: Option<&Path>,
    cmdline: &str,
    devices: &[crate::devices::virtio::MmioWindow],
) -> Result<BootInfo> {
    // A regular file only, opened without blocking (a FIFO would hang `open`).
    let (mut file, _) = crate::input_check::open_regular(kernel, "kernel").map_err(|e| {
        VmmError::ReadFile(kernel.to_owned(), std::io::Error::other(format!("{e:#}")))
    })?;
    let mut head = vec![0u8; zp::SIZE];
    let head_len =
        read_up_to(&mut file, &mut head).map_err(|e| VmmError::ReadFile(kernel.to_owned(), e))?;
    head.truncate(head_len);
    let format = detect_format(&head).ok_or_else(|| VmmError::KernelFormat(kernel.to_owned()))?;

    let mut zero_page = vec![0u8; zp::SIZE];
    let (entry, kernel_end, initrd_max) = match format {
        KernelFormat::Elf => {
            let r = Elf::load(&mem.ram, None, &mut file, Some(GuestAddress(HIMEM_START)))
                .map_err(|e| VmmError::KernelLoad(kernel.to_owned(), e))?;
            put_u16(&mut zero_page, zp::BOOT_FLAG, BOOT_FLAG_MAGIC);
            put_u32(&mut zero_page, zp::HEADER_MAGIC, HDRS_MAGIC);
            put_u16(&mut zero_page, zp::VERSION, MIN_BOOT_PROTOCOL);
            put_u32(
                &mut zero_page,
                zp::KERNEL_ALIGNMENT,
                DEFAULT_KERNEL_ALIGNMENT,
            );
            (r.kernel_load.0, r.kernel_end, ELF_INITRD_ADDR_MAX)
        }
        KernelFormat::BzImage => {
            let version = u16::from_le_bytes([head[zp::VERSION], head[zp::VERSION + 1]]);
            if version < MIN_BOOT_PROTOCOL {
                return Err(VmmError::BootProtocol(kernel.to_owned(), version));
            }
            let r = BzImage::load(&mem.ram, None, &mut file, Some(GuestAddress(HIMEM_START)))
                .map_err(|e| VmmError::KernelLoad(kernel.to_owned(), e))?;
            // Copy the setup header as the image has it; its length is encoded at 0x201.
            let hdr_end = (zp::JUMP + 2 + usize::from(head[zp::JUMP + 1])).min(head.len());
            zero_page[zp::SETUP_HEADER..hdr_end].copy_from_slice(&head[zp::SETUP_HEADER..hdr_end]);
            // The decompressor unpacks to pref_address and needs init_size bytes there.
            let pref = get_u64(&zero_page, zp::PREF_ADDRESS);
            let init_size = u64::from(get_u32(&zero_page, zp::INIT_SIZE));
            let end = r.kernel_end.max(pref + init_size);
            let initrd_max = u64::from(get_u32(&zero_page, zp::INITRD_ADDR_MAX));
            (r.kernel_load.0 + BZIMAGE_ENTRY64_OFFSET, end, initrd_max)
        }
    };

    zero_page[zp::TYPE_OF_LOADER] = LOADER_TYPE_UNDEFINED;
    zero_page[zp::LOADFLAGS] |= LOADED_HIGH | CAN_USE_HEAP;

    let initrd = match initrd {
        Some(path) => Some(load_initrd(
            mem,
            path,
            kernel_end,
            initrd_max,
            &mut zero_page,
        )?),
        None => None,
    };

    write_cmdline(mem, cmdline, &mut zero_page)?;
    put_e820(&mut zero_page, mem.ram_bytes);
    let acpi = super::acpi::build(devices);
    for (addr, blob) in &acpi.blobs {
        write(mem, *addr, blob)?;
    }
    put_u64(&mut zero_page, zp::ACPI_RSDP_ADDR, acpi.rsdp_addr);
    write(mem, super::mptable::MPTABLE_START, &super::mptable::build())?;
    write(mem, ZERO_PAGE_START, &zero_page)?;
    write_page_tables(mem)?;
    let gdt: Vec<u8> = BOOT_GDT.iter().flat_map(|d| d.to_le_bytes()).collect();
    write(mem, BOOT_GDT_START, &gdt)?;

    Ok(BootInfo {
        format,
        entry,
        kernel_end,
        initrd,
    })
}

/// Places the initrd at `path` as high as the kernel allows (below `initrd_max` and low
/// RAM's end, above `kernel_end`) and records it in the zero page; returns its address and
/// size.
fn load_initrd(
    mem: &VmMemory,
    path: &Path,
    kernel_end: u64,
    initrd_max: u64,
    zero_page: &mut [u8],
) -> Result<(u64, u64)> {
    // Checked before reading: `/dev/zero` would be read until memory runs out.
    crate::input_check::check_initrd(path, mem.ram_bytes >> 20).map_err(|e| {
        VmmError::ReadFile(path.to_owned(), std::io::Error::other(format!("{e:#}")))
    })?;
    let data = std::fs::read(path).map_err(|e| VmmError::ReadFile(path.to_owned(), e))?;
    let limit = mem.low_ram_end().min(initrd_max + 1);
    let size = data.len() as u64;
    let floor = kernel_end.next_multiple_of(INITRD_ALIGN_BYTES);
    let free = limit.saturating_sub(floor);
    if size > free {
        return Err(VmmError::InitrdTooLarge {
            initrd_bytes: size,
            free_bytes: free,
            limit,
        });
    }
    let addr = (limit - size) / INITRD_ALIGN_BYTES * INITRD_ALIGN_BYTES;
    write(mem, addr, &data)?;
    put_u32(zero_page, zp::RAMDISK_IMAGE, low32(addr));
    put_u32(zero_page, zp::RAMDISK_SIZE, low32(size));
    Ok((addr, size))
}

/// Writes the NUL-terminated command line at `CMDLINE_START` and points the zero page at it.
fn write_cmdline(mem: &VmMemory, cmdline: &str, zero_page: &mut [u8]) -> Result<()> {
    if cmdline.len() >= CMDLINE_MAX_BYTES || cmdline.contains('\0') {
        return Err(VmmError::Cmdline {
            max: CMDLINE_MAX_BYTES - 1,
        });
    }
    let mut cmd = cmdline.as_bytes().to_vec();
    cmd.push(0);
    write(mem, CMDLINE_START, &cmd)?;
    put_u32(zero_page, zp::CMD_LINE_PTR, low32(CMDLINE_START));
    put_u32(
        zero_page,
        zp::CMDLINE_SIZE,
        low32(CMDLINE_MAX_BYTES as u64 - 1),
    );
    Ok(())
}

/// The guest's e820 map into the zero page's table.
fn put_e820(zero_page: &mut [u8], ram_bytes: u64) {
    let map = e820_map(ram_bytes);
    assert!(
        map.len() <= zp::E820_MAX_ENTRIES,
        "e820 map has at most a handful of entries"
    );
    zero_page[zp::E820_ENTRIES] = u8::try_from(map.len()).expect("checked just above");
    for (i, e) in map.iter().enumerate() {
        let off = zp::E820_TABLE + i * 20;
        put_u64(zero_page, off, e.addr);
        put_u64(zero_page, off + 8, e.size);
        put_u32(zero_page, off + 16, e.kind);
    }
}

/// Reads until `buf` is full or EOF; returns the bytes read.
fn read_up_to(f: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

/// Tells an ELF64 from a bzImage by their magic numbers.
pub fn detect_format(head: &[u8]) -> Option<KernelFormat> {
    const ELFCLASS64: u8 = 2;
    if head.len() >= 5 && head[..4] == *b"\x7fELF" && head[4] == ELFCLASS64 {
        return Some(KernelFormat::Elf);
    }
    if head.len() >= zp::HEADER_MAGIC + 4 && get_u32(head, zp::HEADER_MAGIC) == HDRS_MAGIC {
        return Some(KernelFormat::BzImage);
    }
    None
}

fn write_page_tables(mem: &VmMemory) -> Result<()> {
    write(
        mem,
        BOOT_PML4_START,
        &(BOOT_PDPT_START | pte::PRESENT | pte::WRITABLE).to_le_bytes(),
    )?;
    for pd in 0..BOOT_PD_COUNT {
        let pd_addr = BOOT_PD_START + pd * 0x1000;
        let pdpte = pd_addr | pte::PRESENT | pte::WRITABLE;
        write(mem, BOOT_PDPT_START + pd * 8, &pdpte.to_le_bytes())?;
        let entries: Vec<u8> = (0..512u64)
            .flat_map(|i| {
                ((((pd * 512) + i) * TWO_MIB) | pte::PRESENT | pte::WRITABLE | pte::PAGE_SIZE)
                    .to_le_bytes()
            })
            .collect();
        write(mem, pd_addr, &entries)?;
    }
    Ok(())
}

/// The general registers at the entry point.
pub fn initial_regs(entry: u64) -> kvm_regs {
    kvm_regs {
        rip: entry,
        rsi: ZERO_PAGE_START,
        rsp: BOOT_STACK_POINTER,
        rbp: BOOT_STACK_POINTER,
        rflags: rflags::FIXED,
        ..Default::default()
    }
}

/// Long-mode system registers at the entry point, starting from KVM's reset values.
pub fn initial_sregs(mut s: kvm_sregs) -> kvm_sregs {
    set_flat_long_mode_segments(&mut s, BOOT_CS, BOOT_DS);
    s.gdt.base = BOOT_GDT_START;
    s.gdt.limit = u16::try_from(BOOT_GDT.len() * 8 - 1).expect("4 descriptors");
    s.idt.base = 0;
    s.idt.limit = 0;
    s.cr0 = cr0::PE | cr0::MP | cr0::ET | cr0::NE | cr0::PG;
    s.cr3 = BOOT_PML4_START;
    s.cr4 = cr4::PAE;
    s.efer = efer::LME | efer::LMA;
    s
}

/// FPU state at entry: x87 control word and MXCSR at their reset defaults.
pub fn initial_fpu() -> kvm_fpu {
    kvm_fpu {
        fcw: 0x37f,
        mxcsr: 0x1f80,
        ..Default::default()
    }
}

fn write(mem: &VmMemory, gpa: u64, data: &[u8]) -> Result<()> {
    mem.ram
        .write_slice(data, GuestAddress(gpa))
        .map_err(|e| VmmError::GuestAccess(gpa, e))
}

fn low32(v: u64) -> u32 {
    u32::try_from(v).expect("boot structures live below 4 GiB")
}

fn put_u16(b: &mut [u8], off: usize, v: u16) {
    b[off..off + 2].copy_from_slice(&v.to_le_bytes());
}
fn put_u32(b: &mut [u8], off: usize, v: u32) {
    b[off..off + 4].copy_from_slice(&v.to_le_bytes());
}
fn put_u64(b: &mut [u8], off: usize, v: u64) {
    b[off..off + 8].copy_from_slice(&v.to_le_bytes());
}
fn get_u32(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes(b[off..off + 4].try_into().expect("4-byte slice"))
}
fn get_u64(b: &[u8], off: usize) -> u64 {
    u64::from_le_bytes(b[off..off + 8].try_into().expect("8-byte slice"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_detects_elf64_and_bzimage_and_rejects_garbage() {
        let mut elf = vec![0u8; 64];
        elf[..5].copy_from_slice(b"\x7fELF\x02");
        assert_eq!(detect_format(&elf), Some(KernelFormat::Elf));
        let mut elf32 = elf.clone();
        elf32[4] = 1;
        assert_eq!(detect_format(&elf32), None);
        let mut bz = vec![0u8; 0x400];
        bz[0x202..0x206].copy_from_slice(b"HdrS");
        assert_eq!(detect_format(&bz), Some(KernelFormat::BzImage));
        assert_eq!(detect_format(b"hello"), None);
        assert_eq!(detect_format(&[]), None);
    }

    #[test]
    fn test_sregs_are_long_mode_with_boot_selectors() {
        let s = initial_sregs(kvm_sregs::default());
        assert_eq!(s.efer & (efer::LME | efer::LMA), efer::LME | efer::LMA);
        assert_eq!(s.cs.selector, BOOT_CS);
        assert_eq!(s.cs.l, 1);
        assert_eq!(s.ss.selector, BOOT_DS);
        assert_ne!(s.cr0 & cr0::PG, 0);
        // The GDT descriptor at the code selector is a present, long-mode code segment.
        let desc = BOOT_GDT[usize::from(BOOT_CS / 8)];
        assert_ne!(desc & (1 << 53), 0, "L bit");
        assert_ne!(desc & (1 << 47), 0, "present");
    }
}
