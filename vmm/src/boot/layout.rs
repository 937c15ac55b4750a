//! Guest-physical memory layout used by the VMM at boot.
//!
//! Invariants: every structure the VMM writes before the first instruction lies in
//! guest RAM below [`HIMEM_START`], in the order listed here, and none overlaps another.
//! The layout follows the Linux x86 64-bit boot protocol (`Documentation/arch/x86/boot.rst`),
//! which the mini-kernel also follows.

/// Guest-physical address of the boot GDT the VMM installs (4 descriptors).
pub const BOOT_GDT_START: u64 = 0x500;
/// Guest-physical address of the `boot_params` "zero page" handed to the kernel in RSI.
pub const ZERO_PAGE_START: u64 = 0x7000;
/// Boot stack pointer given to the kernel; the kernel sets up its own stack at once.
pub const BOOT_STACK_POINTER: u64 = 0x8ff0;
/// Boot page-table root (PML4); followed by one PDPT and four page directories.
pub const BOOT_PML4_START: u64 = 0x9000;
/// Boot PDPT.
pub const BOOT_PDPT_START: u64 = 0xa000;
/// First of the four boot page directories (identity map of 0..4 GiB with 2 MiB pages).
pub const BOOT_PD_START: u64 = 0xb000;
/// Number of page directories, each mapping 1 GiB.
pub const BOOT_PD_COUNT: u64 = 4;
/// Kernel command line (NUL-terminated).
pub const CMDLINE_START: u64 = 0x20000;
/// Maximum command-line length including the NUL (Linux's `COMMAND_LINE_SIZE` on x86).
pub const CMDLINE_MAX_BYTES: usize = 2048;
/// End of conventional low memory (640 KiB minus the EBDA); e820 RAM below this.
pub const EBDA_START: u64 = 0x9fc00;
/// Start of high memory: kernels are loaded at or above this address.
pub const HIMEM_START: u64 = 0x10_0000;
/// Start of the 32-bit MMIO hole; guest RAM does not overlap [`MMIO_GAP_START`, 4 GiB).
pub const MMIO_GAP_START: u64 = 0xc000_0000;
/// End of the 32-bit MMIO hole.
pub const MMIO_GAP_END: u64 = 0x1_0000_0000;
/// Alignment of the stolen region's guest-physical base (1 GiB, so it can be mapped
/// with one large page-directory-pointer entry in a shadow root).
pub const STOLEN_ALIGN_BYTES: u64 = 0x4000_0000;
/// Size of the stolen region (engine image, heap, code cache, shadow tables, I/O ring).
pub const STOLEN_SIZE_BYTES: u64 = kpin_abi::stolen::LAYOUT_BYTES;
/// Initial RSP of the engine (a window virtual address): the top of the free gap between
/// the host I/O ring and the engine image in the stolen region. The engine's first
/// instructions switch to a stack of its own.
pub const ENGINE_BOOT_STACK_TOP: u64 =
    kpin_abi::stolen::WINDOW_VA + kpin_abi::stolen::ENGINE_OFFSET;
const _: () = assert!(
    kpin_abi::stolen::IO_RING_OFFSET + kpin_abi::stolen::IO_RING_BYTES + 0x1000
        <= kpin_abi::stolen::ENGINE_OFFSET
);
/// Smallest guest RAM `kpin run` accepts.
pub const MIN_MEM_MIB: u64 = 16;
/// Largest guest RAM `kpin run` accepts.
pub const MAX_MEM_MIB: u64 = 64 << 10;
/// Guest-physical addresses below this are reserved for the boot structures above and
/// are never handed out for an initrd.
pub const INITRD_ALIGN_BYTES: u64 = 0x1000;
/// Fill level of the host I/O ring at which the engine rings the doorbell: a busy tool
/// exits to the VMM once per this many bytes, not once per write.
pub const IO_RING_BATCH_BYTES: u32 = 128 << 10;
