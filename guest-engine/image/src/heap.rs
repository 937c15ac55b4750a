//! The engine's global allocator, over the heap carved out of the stolen region
//! (`kpin_abi::stolen::HEAP_OFFSET`, [`HEAP_BYTES`](kpin_abi::stolen::HEAP_BYTES)):
//! the translator (`guest-engine`, `no_std + alloc`) and iced-x86 allocate through it.
//!
//! Power-of-two size classes (16 B … the whole heap), each with a free list; a request is
//! rounded up to its class (at least its alignment), a freed block goes back on its
//! class's list, and new blocks are cut from a bump pointer aligned to the class size (so
//! every block is aligned to its size). Simple and never fragments within a class; wastes
//! up to half of each block. One vCPU and no allocation from interrupt stubs (they are
//! asm), so no lock: the `Sync` below rests on that.

use core::alloc::{GlobalAlloc, Layout};
use core::cell::UnsafeCell;

use kpin_abi::stolen::{HEAP_BYTES, HEAP_OFFSET, WINDOW_VA};

/// Smallest class: 16 bytes (2^4).
const MIN_SHIFT: u32 = 4;
/// Number of classes: 2^4 … 2^(4 + CLASSES - 1) bytes.
const CLASSES: usize = 40;

struct State {
    /// Head of each class's free list (0 = empty); a free block's first word links on.
    free: [u64; CLASSES],
    /// Next never-used byte.
    bump: u64,
    /// Bytes currently handed out (rounded to classes).
    in_use: u64,
    /// Largest `in_use` seen.
    peak: u64,
}

/// The allocator.
pub struct Heap(UnsafeCell<State>);

// SAFETY: one vCPU; allocation happens only from the engine's CPL-3 main flow (interrupt
// stubs are asm and never allocate), so no two calls overlap.
unsafe impl Sync for Heap {}

#[global_allocator]
static HEAP: Heap = Heap(UnsafeCell::new(State {
    free: [0; CLASSES],
    bump: WINDOW_VA + HEAP_OFFSET,
    in_use: 0,
    peak: 0,
}));

fn class_of(layout: Layout) -> Option<usize> {
    let size = layout.size().max(layout.align()).max(1 << MIN_SHIFT);
    let shift = size.checked_next_power_of_two()?.trailing_zeros();
    let c = (shift - MIN_SHIFT) as usize;
    (c < CLASSES).then_some(c)
}

// SAFETY: blocks are disjoint (each comes from the bump range once, and is on at most
// one free list while not handed out), aligned to their class size, which is at least
// the layout's size and alignment, and lie inside the heap region the window maps.
unsafe impl GlobalAlloc for Heap {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let Some(c) = class_of(layout) else {
            return core::ptr::null_mut();
        };
        // SAFETY: see `Sync`: no other reference to the state is alive.
        let s = unsafe { &mut *self.0.get() };
        let bytes = 1u64 << (c as u32 + MIN_SHIFT);
        let block = if s.free[c] != 0 {
            let b = s.free[c];
            // SAFETY: `b` is a free block of this class; its first word is the link.
            s.free[c] = unsafe { (b as *const u64).read() };
            b
        } else {
            let start = (s.bump + bytes - 1) & !(bytes - 1);
            let end = start.saturating_add(bytes);
            if end > WINDOW_VA + HEAP_OFFSET + HEAP_BYTES {
                return core::ptr::null_mut();
            }
            s.bump = end;
            start
        };
        s.in_use += bytes;
        s.peak = s.peak.max(s.in_use);
        block as *mut u8
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        let Some(c) = class_of(layout) else {
            return;
        };
        // SAFETY: see `Sync`.
        let s = unsafe { &mut *self.0.get() };
        // SAFETY: `ptr` is a block of class `c` we handed out (the caller's contract),
        // at least 16 bytes and 16-byte aligned: its first word can hold the link.
        unsafe { (ptr as *mut u64).write(s.free[c]) };
        s.free[c] = ptr as u64;
        s.in_use -= 1u64 << (c as u32 + MIN_SHIFT);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let Ok(new_layout) = Layout::from_size_align(new_size, layout.align()) else {
            return core::ptr::null_mut();
        };
        if class_of(layout).is_some() && class_of(layout) == class_of(new_layout) {
            return ptr;
        }
        // SAFETY: forwarded caller contract.
        let new = unsafe { self.alloc(new_layout) };
        if !new.is_null() {
            // SAFETY: both blocks are valid for the smaller size and disjoint.
            unsafe {
                core::ptr::copy_nonoverlapping(ptr, new, layout.size().min(new_size));
                self.dealloc(ptr, layout);
            }
        }
        new
    }
}

/// Bytes in use now and at the peak.
pub fn usage() -> (u64, u64) {
    // SAFETY: see `Sync`; a plain read between allocations.
    let s = unsafe { &*HEAP.0.get() };
    (s.in_use, s.peak)
}
