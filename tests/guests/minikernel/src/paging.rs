//! The kernel's own 4-level page tables and a bump frame allocator.
//!
//! Invariants:
//! * Physical memory `0..IDENTITY_MAP_BYTES` is identity mapped (supervisor, writable) in every
//!   root the kernel uses: `0..SMALL_PAGE_LIMIT` with 4 KiB pages, the rest with 2 MiB pages.
//!   Page 0 and one guard page below each stack are left unmapped, so a null dereference or a
//!   stack overflow faults (a kernel stack overflow becomes a #DF, handled on IST1).
//! * Frames come from `FRAME_POOL_START..FRAME_POOL_END`, are zeroed when allocated and never
//!   freed; page-table pages are frames too and are reached through the identity map.
//! * Intermediate entries are always present|writable|user; the leaf decides access.

use core::ptr::addr_of;

use crate::cpu::write_cr3;
use crate::entry::{df_stack_bottom, kernel_stack_bottom, trap_stack_bottom};
use crate::global::Global;
use crate::layout::{
    FRAME_POOL_END, FRAME_POOL_START, IDENTITY_MAP_BYTES, PAGE_SIZE, SMALL_PAGE_LIMIT,
};

/// PTE bit 0: present.
pub const PTE_PRESENT: u64 = 1 << 0;
/// PTE bit 1: writable.
pub const PTE_WRITABLE: u64 = 1 << 1;
/// PTE bit 2: accessible at CPL 3.
pub const PTE_USER: u64 = 1 << 2;
/// PDE bit 7: 2 MiB page.
const PTE_HUGE: u64 = 1 << 7;
/// Physical-address bits of an entry (bits 12..52).
const PTE_ADDR_MASK: u64 = 0x000f_ffff_ffff_f000;
/// Entries per table.
const ENTRIES: u64 = 512;
/// Bytes mapped by one 2 MiB PDE.
const HUGE_PAGE_SIZE: u64 = 0x20_0000;
/// Flags of intermediate entries.
const TABLE_FLAGS: u64 = PTE_PRESENT | PTE_WRITABLE | PTE_USER;

static NEXT_FRAME: Global<u64> = Global::new(FRAME_POOL_START);
static KERNEL_ROOT: Global<u64> = Global::new(0);

/// A fresh zeroed 4 KiB frame (physical = identity-mapped virtual address).
pub fn alloc_frame() -> u64 {
    let frame = NEXT_FRAME.get();
    assert!(frame + PAGE_SIZE <= FRAME_POOL_END, "frame pool exhausted");
    NEXT_FRAME.set(frame + PAGE_SIZE);
    // SAFETY: the frame lies in the identity-mapped frame pool, which holds nothing but frames
    // handed out here, and this one has never been handed out before.
    unsafe { core::ptr::write_bytes(frame as *mut u8, 0, PAGE_SIZE as usize) };
    frame
}

/// The root built by [`init`].
pub fn kernel_root() -> u64 {
    KERNEL_ROOT.get()
}

fn entry_ptr(table: u64, index: u64) -> *mut u64 {
    (table + index * 8) as *mut u64
}

/// Reads entry `index` of the table at physical `table`.
pub fn read_entry(table: u64, index: u64) -> u64 {
    // SAFETY: `table` is a page-table frame from `alloc_frame` (identity mapped) and
    // `index < 512`.
    unsafe { entry_ptr(table, index % ENTRIES).read_volatile() }
}

/// Writes entry `index` of the table at physical `table`.
pub fn write_entry(table: u64, index: u64, value: u64) {
    // SAFETY: as in `read_entry`; the caller is the only page-table writer (one CPU).
    unsafe { entry_ptr(table, index % ENTRIES).write_volatile(value) }
}

fn index(va: u64, level_shift: u32) -> u64 {
    (va >> level_shift) % ENTRIES
}

/// Maps the 4 KiB page at `va` to frame `pa` with leaf `flags` in the tree rooted at `root`,
/// creating intermediate tables as needed. Does not flush the TLB.
pub fn map_4k(root: u64, va: u64, pa: u64, flags: u64) {
    let mut table = root;
    for shift in [39, 30, 21] {
        let i = index(va, shift);
        let e = read_entry(table, i);
        if e & PTE_PRESENT == 0 {
            let next = alloc_frame();
            write_entry(table, i, next | TABLE_FLAGS);
            table = next;
        } else {
            assert!(e & PTE_HUGE == 0, "map_4k inside a huge page");
            table = e & PTE_ADDR_MASK;
        }
    }
    write_entry(table, index(va, 12), (pa & PTE_ADDR_MASK) | flags);
}

/// A new PML4 whose entries are copies of `root`'s, so both roots share every mapping
/// below the top level.
pub fn clone_root(root: u64) -> u64 {
    let new = alloc_frame();
    // SAFETY: both are distinct identity-mapped page-table frames of exactly one page.
    unsafe {
        core::ptr::copy_nonoverlapping(root as *const u8, new as *mut u8, PAGE_SIZE as usize)
    };
    new
}

/// Guard pages: page 0 and the page below each stack.
fn guard_pages() -> [u64; 4] {
    [
        0,
        addr_of!(kernel_stack_bottom) as u64 - PAGE_SIZE,
        addr_of!(trap_stack_bottom) as u64 - PAGE_SIZE,
        addr_of!(df_stack_bottom) as u64 - PAGE_SIZE,
    ]
}

/// Builds the kernel's identity map and switches CR3 to it.
pub fn init() {
    let root = alloc_frame();
    let pdpt = alloc_frame();
    let pd = alloc_frame();
    let pt_low = alloc_frame();
    let guards = guard_pages();
    let mut pa = 0;
    while pa < SMALL_PAGE_LIMIT {
        if !guards.contains(&pa) {
            write_entry(pt_low, pa / PAGE_SIZE, pa | PTE_PRESENT | PTE_WRITABLE);
        }
        pa += PAGE_SIZE;
    }
    write_entry(pd, 0, pt_low | TABLE_FLAGS);
    let mut pa = SMALL_PAGE_LIMIT;
    while pa < IDENTITY_MAP_BYTES {
        write_entry(
            pd,
            pa / HUGE_PAGE_SIZE,
            pa | PTE_PRESENT | PTE_WRITABLE | PTE_HUGE,
        );
        pa += HUGE_PAGE_SIZE;
    }
    write_entry(pdpt, 0, pd | TABLE_FLAGS);
    write_entry(root, 0, pdpt | TABLE_FLAGS);
    KERNEL_ROOT.set(root);
    // SAFETY: the new root identity maps the image, its stacks (guard pages excepted), the
    // statics, the descriptor tables and the whole frame pool, exactly as the VMM's map did.
    unsafe { write_cr3(root) };
}
