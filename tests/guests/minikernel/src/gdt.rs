//! The kernel's own GDT and 64-bit TSS.
//!
//! Layout (fixed by SYSCALL/SYSRET, STAR = 0x0018_0008 << 32):
//! 0x00 null · 0x08 kernel code64 · 0x10 kernel data · 0x18 user code32 (unused) ·
//! 0x20 user data (DPL 3) · 0x28 user code64 (DPL 3) · 0x30/0x38 TSS.
//! The TSS gives RSP0 = the trap stack (traps from ring 3 switch stacks) and IST1 = the #DF
//! stack, and has no I/O permission bitmap (so ring-3 port I/O faults).

use core::arch::asm;
use core::ptr::addr_of;

use crate::entry::{df_stack_top, trap_stack_top};
use crate::global::Global;
use crate::layout::{KERNEL_CS, KERNEL_DS, TSS_SEL};

/// Number of 8-byte GDT slots (the TSS descriptor takes two).
const GDT_SLOTS: usize = 8;
/// Slot of the TSS descriptor's low half.
const TSS_SLOT: usize = 6;

/// Flat 64-bit ring-0 code: P, DPL 0, code exec/read, L.
const DESC_KERNEL_CODE64: u64 = 0x00af_9a00_0000_ffff;
/// Flat ring-0 data: P, DPL 0, data read/write, 4 GiB.
const DESC_KERNEL_DATA: u64 = 0x00cf_9200_0000_ffff;
/// Flat 32-bit ring-3 code (never loaded; SYSRET layout placeholder).
const DESC_USER_CODE32: u64 = 0x00cf_fa00_0000_ffff;
/// Flat ring-3 data: P, DPL 3, data read/write.
const DESC_USER_DATA: u64 = 0x00cf_f200_0000_ffff;
/// Flat 64-bit ring-3 code: P, DPL 3, code exec/read, L.
const DESC_USER_CODE64: u64 = 0x00af_fa00_0000_ffff;
/// System descriptor type 0x9 (available 64-bit TSS) with P set, in bits 40..48.
const DESC_TSS_AVAILABLE: u64 = 0x89 << 40;

/// The 64-bit task-state segment (104 bytes, no I/O bitmap).
#[derive(Clone, Copy)]
#[repr(C, packed(4))]
pub struct Tss {
    reserved0: u32,
    /// RSP0..RSP2: stacks loaded on a privilege change to ring 0..2.
    rsp: [u64; 3],
    reserved1: u64,
    /// IST1..IST7.
    ist: [u64; 7],
    reserved2: u64,
    reserved3: u16,
    /// Offset of the I/O bitmap; = size of the TSS, i.e. none.
    iomap_base: u16,
}

/// Byte size of [`Tss`].
const TSS_BYTES: u64 = core::mem::size_of::<Tss>() as u64;
const _: () = assert!(TSS_BYTES == 104);

static GDT: Global<[u64; GDT_SLOTS]> = Global::new([
    0,
    DESC_KERNEL_CODE64,
    DESC_KERNEL_DATA,
    DESC_USER_CODE32,
    DESC_USER_DATA,
    DESC_USER_CODE64,
    0,
    0,
]);

static TSS: Global<Tss> = Global::new(Tss {
    reserved0: 0,
    rsp: [0; 3],
    reserved1: 0,
    ist: [0; 7],
    reserved2: 0,
    reserved3: 0,
    iomap_base: TSS_BYTES as u16,
});

/// Operand of `lgdt`/`lidt`.
#[repr(C, packed)]
pub struct DescriptorPointer {
    /// Size of the table minus one.
    pub limit: u16,
    /// Linear address of the table.
    pub base: u64,
}

/// Loads the GDT, reloads every segment register and loads the task register.
pub fn init() {
    let (rsp0, ist1) = (
        addr_of!(trap_stack_top) as u64,
        addr_of!(df_stack_top) as u64,
    );
    let mut tss = TSS.get();
    tss.rsp[0] = rsp0;
    tss.ist[usize::from(crate::layout::DF_IST) - 1] = ist1;
    TSS.set(tss);

    let base = TSS.as_ptr() as u64;
    let limit = TSS_BYTES - 1;
    let low = (limit & 0xffff)
        | ((base & 0xff_ffff) << 16)
        | DESC_TSS_AVAILABLE
        | (((limit >> 16) & 0xf) << 48)
        | (((base >> 24) & 0xff) << 56);
    let mut gdt = GDT.get();
    gdt[TSS_SLOT] = low;
    gdt[TSS_SLOT + 1] = base >> 32;
    GDT.set(gdt);

    let gdtr = DescriptorPointer {
        limit: (GDT_SLOTS * 8 - 1) as u16,
        base: GDT.as_ptr() as u64,
    };
    // SAFETY: the new GDT keeps flat code/data descriptors at the selectors loaded below, so
    // the running code, stack and data stay addressable; the far return reloads CS.
    unsafe {
        asm!(
            "lgdt [{gdtr}]",
            "push {kcs}",
            "lea {tmp}, [rip + 2f]",
            "push {tmp}",
            "retfq",
            "2:",
            "mov {tmp:e}, {kds}",
            "mov ss, {tmp:x}",
            "mov ds, {tmp:x}",
            "mov es, {tmp:x}",
            "mov fs, {tmp:x}",
            "mov gs, {tmp:x}",
            "mov {tmp:e}, {tss}",
            "ltr {tmp:x}",
            gdtr = in(reg) &gdtr,
            kcs = const KERNEL_CS,
            kds = const KERNEL_DS,
            tss = const TSS_SEL,
            tmp = out(reg) _,
        )
    };
}
