use std::alloc::Layout;
use std::collections::BTreeMap;

use crate::buddy::Buddy;
use crate::json::JsonObject;

/// A region of host memory aligned to its size, for a heap to manage.
struct Region {
    ptr: *mut u8,
    layout: Layout,
}

impl Region {
    fn new(bytes: usize) -> Self {
        let layout = Layout::from_size_align(bytes, bytes).expect("a power of two");
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        assert!(!ptr.is_null());
        Region { ptr, layout }
    }

    fn heap(&self) -> Buddy {
        let start = self.ptr as u64;
        Buddy::new(start, start + self.layout.size() as u64)
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) };
    }
}

fn layout(size: usize, align: usize) -> Layout {
    Layout::from_size_align(size, align).expect("valid")
}

/// The class size a request is rounded to.
fn class_size(l: Layout) -> u64 {
    (l.size().max(l.align()).max(16)).next_power_of_two() as u64
}

#[test]
fn test_blocks_are_aligned_to_their_class_disjoint_and_inside_the_region() {
    let region = Region::new(1 << 20);
    let mut heap = region.heap();
    let (lo, hi) = (region.ptr as u64, region.ptr as u64 + (1 << 20));
    let mut live: BTreeMap<u64, u64> = BTreeMap::new();
    for (i, &(size, align)) in [
        (1, 1),
        (16, 8),
        (17, 8),
        (100, 64),
        (4096, 4096),
        (5000, 16),
        (3, 2),
    ]
    .iter()
    .cycle()
    .take(70)
    .enumerate()
    {
        let l = layout(size, align);
        let b = heap.alloc(l).expect("room");
        let bytes = class_size(l);
        assert_eq!(b % bytes, 0, "block {b:#x} of class {bytes} misaligned");
        assert!(
            b >= lo && b + bytes <= hi,
            "block {b:#x} outside the region"
        );
        // No live block overlaps it.
        if let Some((&s, &n)) = live.range(..b + bytes).next_back() {
            assert!(s + n <= b || s >= b + bytes, "{b:#x} overlaps {s:#x}+{n}");
        }
        live.insert(b, bytes);
        // SAFETY: `b` is a fresh block of `bytes` bytes inside the region.
        unsafe { std::ptr::write_bytes(b as *mut u8, i as u8, bytes as usize) };
    }
    // Every block still holds its own byte: nothing was handed out twice.
    for (i, (&b, &n)) in live.iter().enumerate() {
        // SAFETY: a live block of `n` bytes.
        let bytes = unsafe { std::slice::from_raw_parts(b as *const u8, n as usize) };
        assert!(
            bytes.iter().all(|&x| x == bytes[0]),
            "block {i} at {b:#x} was overwritten"
        );
    }
    assert_eq!(heap.usage().0, live.values().sum::<u64>());
}

#[test]
fn test_freed_large_buddies_merge_and_small_blocks_are_reused() {
    let region = Region::new(1 << 20);
    let mut heap = region.heap();
    let page = layout(4096, 4096);
    let a = heap.alloc(page).expect("a");
    let b = heap.alloc(page).expect("b");
    assert_eq!(a ^ b, 4096, "two pages cut one after the other are buddies");
    // SAFETY: both came from this heap with `page`.
    unsafe {
        heap.dealloc(b, page);
        heap.dealloc(a, page);
    }
    // Merged: an 8 KiB request gets their union.
    let two = heap.alloc(layout(8192, 8192)).expect("8 KiB");
    assert_eq!(two, a.min(b));
    // A small class keeps a plain free list: the block freed last comes back first.
    let s = layout(24, 8);
    let x = heap.alloc(s).expect("x");
    // SAFETY: from this heap with `s`.
    unsafe { heap.dealloc(x, s) };
    assert_eq!(heap.alloc(s), Some(x));
}

#[test]
fn test_an_exhausted_or_impossible_request_is_refused_and_usage_is_tracked() {
    let region = Region::new(1 << 16);
    let mut heap = region.heap();
    assert_eq!(
        heap.alloc(layout(1 << 17, 8)),
        None,
        "larger than the region"
    );
    let half = layout(1 << 15, 8);
    let a = heap.alloc(half).expect("first half");
    let b = heap.alloc(half).expect("second half");
    assert_eq!(heap.alloc(layout(16, 8)), None, "full");
    assert_eq!(heap.usage(), (1 << 16, 1 << 16));
    // SAFETY: from this heap with `half`.
    unsafe {
        heap.dealloc(a, half);
        heap.dealloc(b, half);
    }
    assert_eq!(heap.usage(), (0, 1 << 16));
    assert!(
        heap.alloc(layout(1 << 16, 8)).is_some(),
        "merged back into one block"
    );
}

#[test]
fn test_random_allocation_and_release_never_hands_out_overlapping_blocks() {
    let region = Region::new(1 << 22);
    let mut heap = region.heap();
    let mut live: Vec<(u64, Layout)> = Vec::new();
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for step in 0..20_000 {
        let r = next();
        if r % 3 == 0 && !live.is_empty() {
            let (b, l) = live.swap_remove((r as usize / 3) % live.len());
            // SAFETY: a live block from this heap with `l`.
            unsafe {
                assert_eq!(
                    *(b as *const u64),
                    b,
                    "step {step}: block {b:#x} was reused while live"
                );
                heap.dealloc(b, l);
            }
            continue;
        }
        let size = 1usize << (r % 14);
        let l = layout(size + (r as usize >> 20) % size.max(1), 1 << ((r >> 8) % 7));
        let Some(b) = heap.alloc(l) else { continue };
        // SAFETY: a fresh block of at least 8 bytes.
        unsafe { *(b as *mut u64) = b };
        live.push((b, l));
    }
    let in_use: u64 = live.iter().map(|&(_, l)| class_size(l)).sum();
    assert_eq!(heap.usage().0, in_use);
}

#[test]
fn test_counters_json_nests_and_closes_what_is_left_open() {
    let mut j = JsonObject::new();
    j.u64("fragments", 42)
        .begin("exits")
        .u64("direct", 1)
        .u64("indirect", u64::MAX);
    j.end().begin("shadow").begin("faults").u64("pf", 3);
    let text = j.finish();
    let v: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
    assert_eq!(v["fragments"], 42);
    assert_eq!(v["exits"]["indirect"], u64::MAX);
    assert_eq!(v["shadow"]["faults"]["pf"], 3);
    assert!(text.ends_with("}\n"), "{text}");
    let empty = JsonObject::new().finish();
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&empty).expect("{}"),
        serde_json::json!({})
    );
}

#[test]
fn test_a_realloc_within_a_class_keeps_its_block() {
    assert!(Buddy::same_class(layout(20, 8), layout(32, 8)));
    assert!(!Buddy::same_class(layout(16, 8), layout(17, 8)));
    assert!(
        !Buddy::same_class(layout(8, 8), layout(8, 64)),
        "alignment rounds the class up"
    );
    let huge = layout(1 << 50, 8);
    assert!(!Buddy::same_class(huge, huge), "no class: never kept");
}
