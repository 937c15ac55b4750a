//! Every address, selector, size and vector the mini-kernel uses, in one place.
//!
//! Physical memory is identity mapped (VA = PA) for the first [`IDENTITY_MAP_BYTES`]; the
//! image sits at [`IMAGE_BASE`] and the frame pool above it. The test regions (user pages,
//! kernel test pages, the per-address-space window) are mapped with 4 KiB pages on demand.
//! None of these addresses is ever printed except where the transcript shows a CR2 value,
//! and those are the constants chosen here, so the transcript does not depend on the build.

/// Size of one small page.
pub const PAGE_SIZE: u64 = 0x1000;
/// Physical (= virtual) load address of the image (see `link.ld`).
pub const IMAGE_BASE: u64 = 0x10_0000;
/// End of the part of physical memory mapped with 4 KiB pages (holds the image and its
/// stack guard pages; `link.ld` asserts the image ends below it).
pub const SMALL_PAGE_LIMIT: u64 = 0x20_0000;
/// Bytes of physical memory identity mapped by the kernel's own page tables.
pub const IDENTITY_MAP_BYTES: u64 = 0x400_0000;
/// First frame handed out by the frame allocator (4 MiB).
pub const FRAME_POOL_START: u64 = 0x40_0000;
/// End (exclusive) of the frame pool (64 MiB).
pub const FRAME_POOL_END: u64 = IDENTITY_MAP_BYTES;

/// Kernel 64-bit code selector (also STAR[47:32]).
pub const KERNEL_CS: u16 = 0x08;
/// Kernel data selector (SYSCALL loads SS = STAR[47:32] + 8).
pub const KERNEL_DS: u16 = 0x10;
/// 32-bit user code selector (STAR[63:48]); present only so the SYSRET layout is complete.
pub const USER_CS32: u16 = 0x18;
/// User data selector with RPL 3 (SYSRET loads SS = STAR[63:48] + 8).
pub const USER_DS: u16 = 0x20 | 3;
/// User 64-bit code selector with RPL 3 (SYSRETQ loads CS = STAR[63:48] + 16).
pub const USER_CS: u16 = 0x28 | 3;
/// Task-state segment selector (a 16-byte descriptor at 0x30 and 0x38).
pub const TSS_SEL: u16 = 0x30;

/// Bytes of the boot/kernel stack.
pub const KERNEL_STACK_BYTES: usize = 32 * 1024;
/// Bytes of the stack used on entry from ring 3 (TSS.RSP0) and by the SYSCALL entry.
pub const TRAP_STACK_BYTES: usize = 16 * 1024;
/// Bytes of the #DF stack (TSS IST1).
pub const DF_STACK_BYTES: usize = 8 * 1024;
/// IST slot (1-based) used by the #DF gate.
pub const DF_IST: u8 = 1;

/// Number of IDT vectors with stubs: the 32 exceptions and the 16 remapped PIC IRQs.
pub const TRAP_VECTORS: usize = 48;
/// Vector of PIC IRQ 0 after the remap (master base).
pub const PIC_MASTER_BASE: u8 = 0x20;
/// Vector of PIC IRQ 8 after the remap (slave base).
pub const PIC_SLAVE_BASE: u8 = 0x28;
/// Vector of the PIT tick (IRQ 0).
pub const TIMER_VECTOR: u64 = PIC_MASTER_BASE as u64;

/// Ring-3 code (`.user_text`) is mapped read-only at this VA.
pub const USER_CODE_VA: u64 = 0x4000_0000;
/// A user page left unmapped until ring-3 code touches it (step `user-pf`).
pub const USER_DEMAND_VA: u64 = 0x4008_0000;
/// Offset inside [`USER_DEMAND_VA`] that the user program writes.
pub const USER_DEMAND_OFFSET: u64 = 0x10;
/// The ring-3 stack page.
pub const USER_STACK_VA: u64 = 0x4010_0000;
/// A user page the timer handler writes the tick count into (step `user-irq`).
pub const USER_SHARED_VA: u64 = 0x4011_0000;

/// Base of the kernel test pages (PML4 slot 511, supervisor only).
pub const KTEST_BASE: u64 = 0xffff_ff80_0000_0000;
/// Executable (read-only) view of the self-modifying-code frame.
pub const SMC_X_VA: u64 = KTEST_BASE;
/// Writable alias of the same frame.
pub const SMC_W_VA: u64 = KTEST_BASE + 0x1000;
/// A kernel page left unmapped until step `pf` reads it.
pub const KERNEL_DEMAND_VA: u64 = KTEST_BASE + 0x10_0000;
/// Offset inside [`KERNEL_DEMAND_VA`] that step `pf` reads.
pub const KERNEL_DEMAND_OFFSET: u64 = 0x18;

/// The VA that the two address spaces of step `cr3` map to different frames (PML4 slot 1).
pub const AS_TEST_VA: u64 = 0x80_0000_0000;

/// A non-canonical address (step `gp`).
pub const NON_CANONICAL_VA: u64 = 0x8000_0000_0000_0000;
/// A selector far beyond the GDT limit (step `gp`); #GP reports it with RPL/TI cleared.
pub const BAD_SELECTOR: u16 = 0xff8;
