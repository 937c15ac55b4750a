//! Guest memory for the task watch's host tests: bytes at addresses, and the maple tree
//! nodes and VMAs of an address space laid out in it as Linux 6.1 does.

use alloc::collections::BTreeMap;

use kpin_abi::attach::{KernelTypes, MapleLayout};

/// The 64-bit maple node layouts (`include/linux/maple_tree.h`).
pub const MAPLE: MapleLayout = MapleLayout {
    range_pivot: 8,
    range_slot: 0x80,
    range_meta: 0xf8,
    range_pivots: 15,
    arange_pivot: 8,
    arange_slot: 0x50,
    arange_meta: 0xf0,
    arange_pivots: 9,
};

/// The pinned 6.1 kernel's task offsets (`current_task`, `task_struct`, the way to the
/// executable's name), without the VMAs' ([`with_vmas`] adds them).
pub const TYPES: KernelTypes = KernelTypes {
    current_task: 0x1fb80,
    task_pid: 0x970,
    task_tgid: 0x974,
    task_comm: 0xba0,
    comm_bytes: 16,
    task_mm: 0x8e0,
    mm_exe_file: 0x3b0,
    file_dentry: 0x18,
    dentry_name_len: 0x24,
    dentry_name: 0x28,
    dentry_parent: 0x10,
    ..KernelTypes::UNKNOWN
};

/// `t` with the pinned 6.1 kernel's VMA offsets.
pub const fn with_vmas(t: KernelTypes) -> KernelTypes {
    KernelTypes {
        mm_mt_root: 0x8,
        mm_vdso: 0x370,
        vma_start: 0,
        vma_end: 8,
        vma_pgoff: 0x68,
        vma_file: 0x70,
        maple: MAPLE,
        ..t
    }
}

/// Node types.
pub const LEAF: u64 = 1;
pub const RANGE: u64 = 2;
pub const ARANGE: u64 = 3;

/// A child slot's encoding of the node at `at` of `node_type` (`mt_mk_node`).
pub const fn child(at: u64, node_type: u64) -> u64 {
    at | node_type << 3 | 4
}

/// The root's encoding (`mte_mk_root`).
pub const fn root(at: u64, node_type: u64) -> u64 {
    at | node_type << 3 | 2
}

/// Guest memory: bytes at addresses (an address not put is unreadable).
#[derive(Default)]
pub struct Mem(pub BTreeMap<u64, u8>);

impl Mem {
    pub fn put(&mut self, va: u64, bytes: &[u8]) {
        for (i, &b) in bytes.iter().enumerate() {
            self.0.insert(va + i as u64, b);
        }
    }

    pub fn word(&mut self, va: u64, v: u64) {
        self.put(va, &v.to_le_bytes());
    }

    /// A node at `at` (256 bytes, zeros where not given): `parent`, then `pivots` and
    /// `slots` where the layout of `node_type` puts them, and the metadata's end.
    pub fn node(
        &mut self,
        at: u64,
        node_type: u64,
        parent: u64,
        pivots: &[u64],
        slots: &[u64],
        meta_end: u8,
    ) {
        self.put(at, &[0; 256]);
        self.word(at, parent);
        let (p, s, m) = if node_type == ARANGE {
            (MAPLE.arange_pivot, MAPLE.arange_slot, MAPLE.arange_meta)
        } else {
            (MAPLE.range_pivot, MAPLE.range_slot, MAPLE.range_meta)
        };
        for (i, &v) in pivots.iter().enumerate() {
            self.word(at + u64::from(p) + 8 * i as u64, v);
        }
        for (i, &v) in slots.iter().enumerate() {
            self.word(at + u64::from(s) + 8 * i as u64, v);
        }
        // The metadata shares the last slot of a range node: only when that is unused.
        if node_type == ARANGE || slots.len() < usize::from(MAPLE.range_pivots) + 1 {
            self.put(at + u64::from(m), &[meta_end]);
        }
    }

    /// A `vm_area_struct` at `at`.
    pub fn vma(&mut self, at: u64, start: u64, end: u64, pgoff: u64, file: u64) {
        self.word(at, start);
        self.word(at + 8, end);
        self.word(at + 0x68, pgoff);
        self.word(at + 0x70, file);
    }

    /// An open file at `file` whose dentries (the root's first) are `path`, placed from
    /// `at` on, with the dentry offsets of `t`; returns the file's dentry.
    pub fn file(&mut self, t: &KernelTypes, file: u64, at: u64, path: &[&str]) -> u64 {
        let dentry = |m: &mut Mem, d: u64, name: &str, parent: u64| {
            m.word(d + u64::from(t.dentry_parent), parent);
            m.put(
                d + u64::from(t.dentry_name_len),
                &(name.len() as u32).to_le_bytes(),
            );
            m.word(d + u64::from(t.dentry_name), d + 0x800);
            m.put(d + 0x800, name.as_bytes());
        };
        let mut parent = at;
        dentry(self, parent, "/", parent);
        for (i, name) in path.iter().enumerate() {
            let d = at + 0x1000 * (i as u64 + 1);
            dentry(self, d, name, parent);
            parent = d;
        }
        self.word(file + u64::from(t.file_dentry), parent);
        parent
    }

    pub fn reader(&mut self) -> impl FnMut(u64, &mut [u8]) -> bool + '_ {
        |va, out| {
            for (i, o) in out.iter_mut().enumerate() {
                match self.0.get(&(va + i as u64)) {
                    Some(&b) => *o = b,
                    None => return false,
                }
            }
            true
        }
    }
}
