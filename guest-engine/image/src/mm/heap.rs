//! The engine's global allocator, over the heap carved out of the stolen region
//! (`kpin_abi::stolen::HEAP_OFFSET`, [`HEAP_BYTES`](kpin_abi::stolen::HEAP_BYTES)):
//! the translator (`guest-engine`, `no_std + alloc`) and iced-x86 allocate through it.
//!
//! Power-of-two size classes (16 B … the whole heap), each with a free list; a request is
//! rounded up to its class (at least its alignment) and every block is aligned to its
//! size. A request takes a block of its class, else splits the smallest larger free block
//! in halves, else cuts new space from a bump pointer (the alignment gap below it goes on
//! the free lists as aligned blocks). Freed blocks of 4 KiB and more merge with their
//! free buddy (growing vectors — the translator's fragment table — free each old buffer,
//! which would otherwise be stranded in its class). Wastes up to half of each block. One
//! vCPU and no allocation from interrupt stubs (they are
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

/// Classes from this one up (4 KiB blocks) are buddy-merged when freed; smaller ones
/// keep plain free lists (long lists, short-lived blocks).
const MERGE_FROM: usize = 12 - MIN_SHIFT as usize;

const HEAP_START: u64 = WINDOW_VA + HEAP_OFFSET;
const HEAP_END: u64 = HEAP_START + HEAP_BYTES;

fn class_bytes(c: usize) -> u64 {
    1u64 << (c as u32 + MIN_SHIFT)
}

impl State {
    fn push(&mut self, c: usize, b: u64) {
        // SAFETY: `b` is a free block of class `c` (≥ 16 bytes, aligned) in the heap.
        unsafe { (b as *mut u64).write(self.free[c]) };
        self.free[c] = b;
    }

    fn pop(&mut self, c: usize) -> Option<u64> {
        let b = self.free[c];
        if b == 0 {
            return None;
        }
        // SAFETY: `b` is a free block of this class; its first word is the link.
        self.free[c] = unsafe { (b as *const u64).read() };
        Some(b)
    }

    /// Takes `b` off class `c`'s free list if it is there.
    fn unlink(&mut self, c: usize, b: u64) -> bool {
        let mut at: *mut u64 = &mut self.free[c];
        // SAFETY: every link on the list is a free block of the heap.
        unsafe {
            while *at != 0 {
                if *at == b {
                    *at = (b as *const u64).read();
                    return true;
                }
                at = *at as *mut u64;
            }
        }
        false
    }

    /// Puts `[from, to)` (16-byte aligned) on the free lists as aligned blocks.
    fn release_gap(&mut self, mut from: u64, to: u64) {
        while from < to {
            let mut c = 0;
            while c + 1 < CLASSES
                && from & (class_bytes(c + 1) - 1) == 0
                && from + class_bytes(c + 1) <= to
            {
                c += 1;
            }
            self.push(c, from);
            from += class_bytes(c);
        }
    }

    /// A block of class `c`: its free list, else a larger free block split down, else
    /// new space from the bump pointer (the alignment gap goes on the free lists).
    fn take(&mut self, c: usize) -> Option<u64> {
        if let Some(b) = self.pop(c) {
            return Some(b);
        }
        if let Some(k) = (c + 1..CLASSES).find(|&k| self.free[k] != 0) {
            let b = self.pop(k)?;
            for j in (c..k).rev() {
                self.push(j, b + class_bytes(j));
            }
            return Some(b);
        }
        let bytes = class_bytes(c);
        let start = (self.bump + bytes - 1) & !(bytes - 1);
        let end = start.checked_add(bytes)?;
        if end > HEAP_END {
            return None;
        }
        let gap = self.bump;
        self.bump = end;
        self.release_gap(gap, start);
        Some(start)
    }
}

// SAFETY: blocks are disjoint (each comes from the bump range once, or from splitting a
// free block into aligned halves, and is on at most one free list while not handed out;
// merging joins two free buddies), aligned to their class size, which is at least the
// layout's size and alignment, and lie inside the heap region the window maps.
unsafe impl GlobalAlloc for Heap {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let Some(c) = class_of(layout) else {
            return core::ptr::null_mut();
        };
        // SAFETY: see `Sync`: no other reference to the state is alive.
        let s = unsafe { &mut *self.0.get() };
        let Some(block) = s.take(c) else {
            return core::ptr::null_mut();
        };
        s.in_use += class_bytes(c);
        s.peak = s.peak.max(s.in_use);
        block as *mut u8
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        let Some(mut c) = class_of(layout) else {
            return;
        };
        // SAFETY: see `Sync`.
        let s = unsafe { &mut *self.0.get() };
        s.in_use -= class_bytes(c);
        let mut b = ptr as u64;
        // Buddy merging for the large classes: a block of class `c` is aligned to its
        // size, so its buddy is `b ^ size`; both halves free make one block of `c + 1`.
        while c >= MERGE_FROM && c + 1 < CLASSES {
            let buddy = b ^ class_bytes(c);
            if buddy < HEAP_START || buddy + class_bytes(c) > HEAP_END || !s.unlink(c, buddy) {
                break;
            }
            b = b.min(buddy);
            c += 1;
        }
        s.push(c, b);
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
