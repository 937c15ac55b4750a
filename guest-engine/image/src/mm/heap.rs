//! The engine's global allocator: [`Buddy`] over the heap carved out of the stolen region
//! (`kpin_abi::stolen::HEAP_OFFSET`, [`HEAP_BYTES`](kpin_abi::stolen::HEAP_BYTES)); the
//! translator (`guest-engine`, `no_std + alloc`) and iced-x86 allocate through it. One
//! vCPU and no allocation from interrupt stubs (they are asm), so no lock: the `Sync`
//! below rests on that.

use core::alloc::{GlobalAlloc, Layout};
use core::cell::UnsafeCell;

use kpin_abi::stolen::{HEAP_BYTES, HEAP_OFFSET, WINDOW_VA};

use super::buddy::Buddy;

/// The allocator.
pub struct Heap(UnsafeCell<Buddy>);

// SAFETY: one vCPU; allocation happens only from the engine's CPL-3 main flow (interrupt
// stubs are asm and never allocate), so no two calls overlap.
unsafe impl Sync for Heap {}

#[global_allocator]
static HEAP: Heap = Heap(UnsafeCell::new(Buddy::new(
    WINDOW_VA + HEAP_OFFSET,
    WINDOW_VA + HEAP_OFFSET + HEAP_BYTES,
)));

// SAFETY: `Buddy` hands out disjoint blocks aligned to their class size, which is at least
// the layout's size and alignment, inside the heap region the window maps (present and
// writable for the engine's lifetime, used by nothing else).
unsafe impl GlobalAlloc for Heap {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: see `Sync`: no other reference to the state is alive.
        let heap = unsafe { &mut *self.0.get() };
        heap.alloc(layout)
            .map_or(core::ptr::null_mut(), |b| b as *mut u8)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: see `Sync`; `ptr` came from `alloc` with `layout` (GlobalAlloc's contract).
        unsafe { (*self.0.get()).dealloc(ptr as u64, layout) };
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let Ok(new_layout) = Layout::from_size_align(new_size, layout.align()) else {
            return core::ptr::null_mut();
        };
        if Buddy::same_class(layout, new_layout) {
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
    unsafe { &*HEAP.0.get() }.usage()
}
