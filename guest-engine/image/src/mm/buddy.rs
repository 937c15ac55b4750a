//! The engine heap's algorithm, over any region of memory: power-of-two size classes
//! (16 B … 2^43 B), each with a free list; a request is rounded up to its class (at least
//! its alignment) and every block is aligned to its size. A request takes a block of its
//! class, else splits the smallest larger free block in halves, else cuts new space from a
//! bump pointer (the alignment gap below it goes on the free lists as aligned blocks).
//! Freed blocks of 4 KiB and more merge with their free buddy (growing vectors — the
//! translator's fragment table — free each old buffer, which would otherwise be stranded
//! in its class). Wastes up to half of each block.
//!
//! Pure: no `asm!`, no global state, so the host's unit tests
//! (`guest-engine/image-host-tests`) run it over a buffer of their own. `heap.rs` makes it
//! the image's global allocator over the stolen region's heap.
//!
//! Invariants: blocks are disjoint (each comes from the bump range once, or from splitting
//! a free block into aligned halves, and is on at most one free list while not handed
//! out; merging joins two free buddies), aligned to their class size, which is at least
//! the layout's size and alignment, and lie inside `[start, end)`.

use core::alloc::Layout;

/// Smallest class: 16 bytes (2^4).
const MIN_SHIFT: u32 = 4;
/// Number of classes: 2^4 … 2^(4 + CLASSES - 1) bytes.
const CLASSES: usize = 40;
/// Classes from this one up (4 KiB blocks) are buddy-merged when freed; smaller ones
/// keep plain free lists (long lists, short-lived blocks).
const MERGE_FROM: usize = 12 - MIN_SHIFT as usize;

/// A heap over `[start, end)`.
pub struct Buddy {
    /// Head of each class's free list (0 = empty); a free block's first word links on.
    free: [u64; CLASSES],
    /// Next never-used byte.
    bump: u64,
    start: u64,
    end: u64,
    /// Bytes currently handed out (rounded to classes).
    in_use: u64,
    /// Largest `in_use` seen.
    peak: u64,
}

fn class_of(layout: Layout) -> Option<usize> {
    let size = layout.size().max(layout.align()).max(1 << MIN_SHIFT);
    let shift = size.checked_next_power_of_two()?.trailing_zeros();
    let c = (shift - MIN_SHIFT) as usize;
    (c < CLASSES).then_some(c)
}

fn class_bytes(c: usize) -> u64 {
    1u64 << (c as u32 + MIN_SHIFT)
}

impl Buddy {
    /// A heap over `[start, end)`: `start` 16-byte aligned, the region writable memory
    /// that nothing else uses while the heap lives (the caller's promise, on which the
    /// `unsafe` methods rest).
    pub const fn new(start: u64, end: u64) -> Self {
        Buddy {
            free: [0; CLASSES],
            bump: start,
            start,
            end,
            in_use: 0,
            peak: 0,
        }
    }

    /// Bytes handed out now and at the peak (rounded to classes).
    pub fn usage(&self) -> (u64, u64) {
        (self.in_use, self.peak)
    }

    /// Whether two layouts share a class (a `realloc` between them keeps the block).
    pub fn same_class(a: Layout, b: Layout) -> bool {
        class_of(a).is_some() && class_of(a) == class_of(b)
    }

    /// # Safety
    /// `b` is a free block of class `c` inside the region.
    unsafe fn push(&mut self, c: usize, b: u64) {
        // SAFETY: the caller's promise: a free block of class `c` (≥ 16 bytes, aligned).
        unsafe { (b as *mut u64).write(self.free[c]) };
        self.free[c] = b;
    }

    fn pop(&mut self, c: usize) -> Option<u64> {
        let b = self.free[c];
        if b == 0 {
            return None;
        }
        // SAFETY: `b` is a free block of this class (only `push` links blocks); its first
        // word is the link.
        self.free[c] = unsafe { (b as *const u64).read() };
        Some(b)
    }

    /// Takes `b` off class `c`'s free list if it is there.
    fn unlink(&mut self, c: usize, b: u64) -> bool {
        let mut at: *mut u64 = &mut self.free[c];
        // SAFETY: every link on the list is a free block of the region.
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

    /// Puts `[from, to)` (16-byte aligned, never handed out) on the free lists as aligned
    /// blocks.
    fn release_gap(&mut self, mut from: u64, to: u64) {
        while from < to {
            let mut c = 0;
            while c + 1 < CLASSES
                && from & (class_bytes(c + 1) - 1) == 0
                && from + class_bytes(c + 1) <= to
            {
                c += 1;
            }
            // SAFETY: `[from, from + class_bytes(c))` lies in the gap below the bump
            // pointer, which no block covers.
            unsafe { self.push(c, from) };
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
                // SAFETY: the upper half at each level of the split is free and aligned.
                unsafe { self.push(j, b + class_bytes(j)) };
            }
            return Some(b);
        }
        let bytes = class_bytes(c);
        let start = self.bump.checked_add(bytes - 1)? & !(bytes - 1);
        let end = start.checked_add(bytes)?;
        if end > self.end {
            return None;
        }
        let gap = self.bump;
        self.bump = end;
        self.release_gap(gap, start);
        Some(start)
    }

    /// A block for `layout`, or `None` when the region is exhausted.
    pub fn alloc(&mut self, layout: Layout) -> Option<u64> {
        let c = class_of(layout)?;
        let block = self.take(c)?;
        self.in_use += class_bytes(c);
        self.peak = self.peak.max(self.in_use);
        Some(block)
    }

    /// Returns `block`, which [`Buddy::alloc`] gave for `layout`.
    ///
    /// # Safety
    /// `block` came from this heap's `alloc` with the same `layout` and is not used again.
    pub unsafe fn dealloc(&mut self, block: u64, layout: Layout) {
        let Some(mut c) = class_of(layout) else {
            return;
        };
        self.in_use -= class_bytes(c);
        let mut b = block;
        // Buddy merging for the large classes: a block of class `c` is aligned to its
        // size, so its buddy is `b ^ size`; both halves free make one block of `c + 1`.
        while c >= MERGE_FROM && c + 1 < CLASSES {
            let buddy = b ^ class_bytes(c);
            if buddy < self.start || buddy + class_bytes(c) > self.end || !self.unlink(c, buddy) {
                break;
            }
            b = b.min(buddy);
            c += 1;
        }
        // SAFETY: the caller's promise: `b` (possibly merged with free buddies) is free now.
        unsafe { self.push(c, b) };
    }
}
