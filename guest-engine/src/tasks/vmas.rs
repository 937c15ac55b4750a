//! The VMA that maps a user address, found in the address space's maple tree
//! (`mm_struct.mm_mt`, Linux 6.1 and later) by reading guest memory, as the kernel's own
//! `mtree_load` walks it (`lib/maple_tree.c`): from the root down, in each node the first
//! slot whose pivot (an inclusive upper bound) is at least the address, to a leaf whose
//! slot is the `struct vm_area_struct *`.
//!
//! Encoded node pointers (`include/linux/maple_tree.h`, `lib/maple_tree.c`): the root is
//! a node if bits 0–1 are 2 and it is above 4096 (`xa_is_node`; a child slot has bit 2
//! instead, `mt_mk_node`); the node type is bits 3–6 (0 dense, 1 `leaf_64`, 2 `range_64`,
//! 3 `arange_64`), and the node is the pointer with bits 0–7 clear (nodes are 256 bytes,
//! 256-byte aligned). A node's last used slot ("data end") is its
//! metadata's `end` for an `arange_64`; for the others, the metadata's if the last pivot
//! is 0, else the last pivot's index if that pivot is the node's upper bound, else the
//! last slot. The offsets come from BTF ([`MapleLayout`]).
//!
//! Invariants: every read may fail (it is only counted by the caller); the walk goes at
//! most [`MAX_DEPTH`] levels (a loop of nodes ends there); a dead node (its parent is
//! itself, freed under RCU) or a node of the wrong type ends it; the answer is a VMA whose
//! `vm_start <= va < vm_end`, or why there is none ([`VmaMiss`]).

use kpin_abi::attach::{KernelTypes, MapleLayout, MAPLE_NODE_BYTES};

use super::exe::{kernel, word};

/// Levels walked at most (a tree of 2^32 VMAs is 9 levels of `arange_64`).
pub const MAX_DEPTH: usize = 12;
/// Bytes of a node read at once (nodes never straddle a page: 256-byte aligned).
const NODE: usize = MAPLE_NODE_BYTES as usize;

/// The node types of `enum maple_type`.
const LEAF_64: u64 = 1;
const RANGE_64: u64 = 2;
const ARANGE_64: u64 = 3;

/// The VMA that maps an address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Vma {
    /// Its `struct vm_area_struct`'s address.
    pub at: u64,
    /// `vm_start`.
    pub start: u64,
    /// `vm_end` (exclusive).
    pub end: u64,
    /// `vm_pgoff`: the file offset of `start`, in pages (for a private anonymous
    /// mapping, `start >> 12`).
    pub pgoff: u64,
    /// `vm_file` (0: anonymous memory, the vDSO).
    pub file: u64,
}

/// Why no VMA was found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VmaMiss {
    /// A read faulted, or a pointer was not a kernel address.
    Unreadable,
    /// The root or a child is not a node of a type the VMA tree uses, or a node's data
    /// end is past its slots.
    BadNode,
    /// A node was freed (its parent is itself).
    DeadNode,
    /// More than [`MAX_DEPTH`] levels (a loop).
    TooDeep,
    /// The leaf has no VMA there (a gap).
    Gap,
    /// The VMA found does not contain the address.
    Outside,
}

impl From<super::exe::Unreadable> for VmaMiss {
    fn from(_: super::exe::Unreadable) -> Self {
        VmaMiss::Unreadable
    }
}

/// A node's layout: where its pivots, slots and metadata are, and how many pivots.
struct Layout {
    pivot: usize,
    slot: usize,
    meta: usize,
    pivots: usize,
}

impl Layout {
    fn of(m: &MapleLayout, node_type: u64) -> Option<Self> {
        let (pivot, slot, meta, pivots) = match node_type {
            LEAF_64 | RANGE_64 => (m.range_pivot, m.range_slot, m.range_meta, m.range_pivots),
            ARANGE_64 => (
                m.arange_pivot,
                m.arange_slot,
                m.arange_meta,
                m.arange_pivots,
            ),
            _ => return None,
        };
        Some(Layout {
            pivot: usize::from(pivot),
            slot: usize::from(slot),
            meta: usize::from(meta),
            pivots: usize::from(pivots),
        })
    }
}

/// Whether `entry` is an encoded node pointer (`xa_is_node`).
fn is_node(entry: u64) -> bool {
    entry & 3 == 2 && entry > 4096
}

/// The `u64` at byte `at` of `node` (`None`: past it).
fn u64_at(node: &[u8; NODE], at: usize) -> Option<u64> {
    let b = node.get(at..at.checked_add(8)?)?;
    Some(u64::from_le_bytes(b.try_into().ok()?))
}

/// The VMA of the address space `mm` (a `struct mm_struct *`) that maps `va`.
pub fn find_vma(
    t: &KernelTypes,
    mm: u64,
    va: u64,
    read: &mut dyn FnMut(u64, &mut [u8]) -> bool,
) -> Result<Vma, VmaMiss> {
    let mut entry = word(read, kernel(mm)?.wrapping_add(u64::from(t.mm_mt_root)))?;
    if !is_node(entry) {
        // Empty, or a lone entry at index 0: no VMA maps user code there.
        return Err(VmaMiss::BadNode);
    }
    // The range of indices the node covers.
    let (mut min, mut max) = (0u64, u64::MAX);
    for _ in 0..MAX_DEPTH {
        let node_type = (entry >> 3) & 0xf;
        let layout = Layout::of(&t.maple, node_type).ok_or(VmaMiss::BadNode)?;
        let at = kernel(entry & !0xff)?;
        let mut node = [0u8; NODE];
        if !read(at, &mut node) {
            return Err(VmaMiss::Unreadable);
        }
        let bad = VmaMiss::BadNode;
        if u64_at(&node, 0).ok_or(bad)? & !0xff == at {
            return Err(VmaMiss::DeadNode);
        }
        let pivot = |i: usize| u64_at(&node, layout.pivot + 8 * i).ok_or(bad);
        let meta_end = || node.get(layout.meta).map(|&e| usize::from(e)).ok_or(bad);
        let last = layout.pivots - 1;
        let end = if node_type == ARANGE_64 || pivot(last)? == 0 {
            meta_end()?
        } else if pivot(last)? == max {
            last
        } else {
            layout.pivots
        };
        if end > layout.pivots {
            return Err(bad);
        }
        // The first slot whose pivot reaches `va`; the last used one's bound is the node's.
        let mut offset = 0;
        if pivot(0)? >= va {
            max = pivot(0)?;
        } else {
            loop {
                offset += 1;
                if offset >= end || pivot(offset)? >= va {
                    break;
                }
            }
            min = pivot(offset - 1)?.wrapping_add(1);
            if offset < end && pivot(offset)? != 0 {
                max = pivot(offset)?;
            }
        }
        entry = u64_at(&node, layout.slot + 8 * offset).ok_or(bad)?;
        if node_type == LEAF_64 {
            if entry == 0 {
                return Err(VmaMiss::Gap);
            }
            return read_vma(t, kernel(entry)?, va, read);
        }
        // A child is an encoded node without the root's bit 1 (`mt_mk_node`): its address
        // and type are checked at the top.
        if entry == 0 || min > max {
            return Err(bad);
        }
    }
    Err(VmaMiss::TooDeep)
}

/// The VMA at `at`, if it contains `va`.
fn read_vma(
    t: &KernelTypes,
    at: u64,
    va: u64,
    read: &mut dyn FnMut(u64, &mut [u8]) -> bool,
) -> Result<Vma, VmaMiss> {
    let field = |read: &mut dyn FnMut(u64, &mut [u8]) -> bool, off: u32| {
        word(read, at.wrapping_add(u64::from(off)))
    };
    let start = field(read, t.vma_start)?;
    let end = field(read, t.vma_end)?;
    if !(start <= va && va < end) {
        return Err(VmaMiss::Outside);
    }
    Ok(Vma {
        at,
        start,
        end,
        pgoff: field(read, t.vma_pgoff)?,
        file: field(read, t.vma_file)?,
    })
}

#[cfg(test)]
mod tests {
    use super::super::test_guest::{child, root, with_vmas, Mem, ARANGE, LEAF, RANGE};
    use super::*;

    const T: KernelTypes = with_vmas(KernelTypes::UNKNOWN);
    const MM: u64 = 0xffff_8880_0100_0000;
    const TREE: u64 = MM; // `mm_mt` is the mm's first member
    const R: u64 = 0xffff_8880_0200_0000;
    const A: u64 = 0xffff_8880_0200_0100;
    const B: u64 = 0xffff_8880_0200_0200;
    const V1: u64 = 0xffff_8880_0300_0000;
    const V2: u64 = 0xffff_8880_0300_0100;
    const V3: u64 = 0xffff_8880_0300_0200;
    const FILE: u64 = 0xffff_8880_0400_0000;

    /// Two leaves under a root of `root_type`: [0, 0x4fffff] holds a gap, the text VMA
    /// V1 at 0x400000..0x4a0000 and a gap; [0x500000, max] holds V2 at
    /// 0x500000..0x520000, a gap, V3 (anonymous) at 0x7fff0000..0x7fff2000 and a gap to
    /// the end.
    fn address_space(root_type: u64) -> Mem {
        let mut m = Mem::default();
        m.word(MM + 8, root(R, root_type));
        m.node(
            R,
            root_type,
            TREE | 1,
            &[0x4f_ffff],
            &[child(A, LEAF), child(B, LEAF)],
            1,
        );
        m.node(
            A,
            LEAF,
            R,
            &[0x3f_ffff, 0x49_ffff, 0x4f_ffff],
            &[0, V1, 0],
            2,
        );
        m.node(
            B,
            LEAF,
            R,
            &[0x51_ffff, 0x7ffe_ffff, 0x7fff_1fff],
            &[V2, 0, V3, 0],
            3,
        );
        m.vma(V1, 0x40_0000, 0x4a_0000, 0, FILE);
        m.vma(V2, 0x50_0000, 0x52_0000, 0xa0, FILE);
        m.vma(V3, 0x7fff_0000, 0x7fff_2000, 0x7fff0, 0);
        m
    }

    fn find(m: &mut Mem, va: u64) -> Result<Vma, VmaMiss> {
        find_vma(&T, MM, va, &mut m.reader())
    }

    #[test]
    fn test_the_vma_of_an_address_under_either_root_type() {
        for root_type in [RANGE, ARANGE] {
            let mut m = address_space(root_type);
            let v = find(&mut m, 0x40_1234).unwrap();
            assert_eq!(
                v,
                Vma {
                    at: V1,
                    start: 0x40_0000,
                    end: 0x4a_0000,
                    pgoff: 0,
                    file: FILE
                }
            );
            assert_eq!(find(&mut m, 0x4a_0000 - 1).unwrap().at, V1);
            assert_eq!(find(&mut m, 0x50_0000).unwrap().pgoff, 0xa0);
            assert_eq!(find(&mut m, 0x7fff_1fff).unwrap().at, V3);
            assert_eq!(find(&mut m, 0x7fff_1fff).unwrap().file, 0);
            assert_eq!(find(&mut m, 0x3f_f000), Err(VmaMiss::Gap));
            assert_eq!(find(&mut m, 0x4c_0000), Err(VmaMiss::Gap));
            assert_eq!(find(&mut m, 0x7000_0000), Err(VmaMiss::Gap));
            assert_eq!(
                find(&mut m, 0x7fff_f000_0000),
                Err(VmaMiss::Gap),
                "the last slot reaches the node's upper bound"
            );
        }
    }

    #[test]
    fn test_a_full_leaf_ends_at_its_last_pivot_or_its_last_slot() {
        let mut m = Mem::default();
        let leaf = 0xffff_8880_0200_0000;
        m.word(MM + 8, root(leaf, LEAF));
        // 16 slots: VMAs of one page each from 0x1000; slot 15 up to the node's max.
        let pivots: alloc::vec::Vec<u64> = (1..=15).map(|i| (i + 1) * 0x1000 - 1).collect();
        let slots: alloc::vec::Vec<u64> = (0..16).map(|i| V1 + i * 0x100).collect();
        m.node(leaf, LEAF, TREE | 1, &pivots, &slots, 0);
        for i in 0..16u64 {
            m.vma(V1 + i * 0x100, (i + 1) * 0x1000, (i + 2) * 0x1000, i, FILE);
        }
        m.vma(V1 + 15 * 0x100, 0x10_000, 0x20_000, 15, FILE);
        assert_eq!(find(&mut m, 0x3000).unwrap().pgoff, 2);
        assert_eq!(find(&mut m, 0xf000).unwrap().pgoff, 14);
        assert_eq!(find(&mut m, 0x1_8000).unwrap().pgoff, 15);
        // Pivot 14 at the node's max (the root's: u64::MAX): slot 14 is the last.
        m.word(leaf + 8 + 14 * 8, u64::MAX);
        m.vma(V1 + 14 * 0x100, 0xf000, 0x30_000, 14, FILE);
        assert_eq!(find(&mut m, 0x1_8000).unwrap().pgoff, 14);
    }

    #[test]
    fn test_bad_pointers_dead_nodes_and_loops_end_the_walk() {
        // The root is not a node, or empty.
        let mut m = address_space(RANGE);
        m.word(MM + 8, V1);
        assert_eq!(find(&mut m, 0x40_1000), Err(VmaMiss::BadNode));
        m.word(MM + 8, 0);
        assert_eq!(find(&mut m, 0x40_1000), Err(VmaMiss::BadNode));
        // The mm is not a kernel address, or unreadable.
        assert_eq!(
            find_vma(&T, 0x1000, 0x40_1000, &mut m.reader()),
            Err(VmaMiss::Unreadable)
        );
        assert_eq!(
            find_vma(&T, MM + 0x10_0000, 0x40_1000, &mut m.reader()),
            Err(VmaMiss::Unreadable)
        );
        // A child nowhere, of a dense type, or in user memory.
        let mut m = address_space(RANGE);
        m.word(R + 0x80, child(0xffff_8880_0900_0000, LEAF));
        assert_eq!(find(&mut m, 0x40_1000), Err(VmaMiss::Unreadable));
        m.word(R + 0x80, child(A, 0));
        assert_eq!(find(&mut m, 0x40_1000), Err(VmaMiss::BadNode));
        m.word(R + 0x80, child(0x7000, LEAF));
        assert_eq!(find(&mut m, 0x40_1000), Err(VmaMiss::Unreadable));
        // A dead node (freed under RCU: its parent is itself).
        let mut m = address_space(RANGE);
        m.word(A, A);
        assert_eq!(find(&mut m, 0x40_1000), Err(VmaMiss::DeadNode));
        // A node whose metadata says more slots than it has.
        m.word(A, R);
        m.put(A + 0xf8, &[16]);
        assert_eq!(find(&mut m, 0x40_1000), Err(VmaMiss::BadNode));
        // A loop: the root's first child is the root itself.
        let mut m = address_space(RANGE);
        m.word(R + 0x80, child(R, RANGE));
        assert_eq!(find(&mut m, 0x40_1000), Err(VmaMiss::TooDeep));
        // The VMA found does not contain the address, or is not a kernel pointer.
        let mut m = address_space(RANGE);
        m.vma(V1, 0x40_0000, 0x40_1000, 0, FILE);
        assert_eq!(find(&mut m, 0x40_1000), Err(VmaMiss::Outside));
        m.word(A + 0x80 + 8, 0x5000);
        assert_eq!(find(&mut m, 0x40_1000), Err(VmaMiss::Unreadable));
    }
}
