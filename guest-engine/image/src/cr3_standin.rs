//! **STAND-IN (drop at the shadow-MMU merge).** Emulated `mov cr3, r64` (and `invlpg`)
//! without the shadow MMU: the whole guest page-table tree of the new root is copied into
//! engine-owned tables from a fixed pool — every PML4 slot but the engine's (256: faults
//! at CPL 3 on this KVM, 257: the window, 258: the physmap) — with every leaf
//! user-accessible (translated code runs at hardware CPL 3), writable only where the guest
//! is writable at every level, 4 KiB leaves kept as 4 KiB, 2 MiB leaves as 2 MiB, 1 GiB
//! leaves split into 2 MiB (this KVM has no 1 GiB pages); leaves into the stolen region or
//! beyond the pool are refused (left unmapped). Then the real CR3 is reloaded through the
//! gate, which flushes the TLB. No A/D bits, no user view, no write protection of code:
//! everything `guest_engine::shadow_mmu` exists for. Cost: a walk of the whole tree per
//! CR3 write or `invlpg`.

use core::cell::UnsafeCell;

use kpin_abi::attach::AttachBlock;
use kpin_abi::stolen::PHYSMAP_VA;

use crate::guest_mem::is_ram;
use crate::paging;

const ENTRIES: usize = 512;
/// Engine pages for copied tables (1 MiB).
const POOL_PAGES: usize = 256;
const PRESENT: u64 = 1 << 0;
const WRITABLE: u64 = 1 << 1;
const USER: u64 = 1 << 2;
const LARGE: u64 = 1 << 7;
const ADDR_MASK: u64 = 0x000f_ffff_ffff_f000;
/// PML4 slots the engine owns or that fault at CPL 3 here (see ARCHITECTURE.md).
const ENGINE_SLOTS: [usize; 3] = [256, 257, 258];

#[repr(C, align(4096))]
struct Pool([[u64; ENTRIES]; POOL_PAGES]);

struct PoolCell(UnsafeCell<Pool>);
// SAFETY: one vCPU; the pool is rewritten only by `remap`, while no guest code runs, and
// the CR3 reload at its end drops every translation through the old contents.
unsafe impl Sync for PoolCell {}

static POOL: PoolCell = PoolCell(UnsafeCell::new(Pool([[0; ENTRIES]; POOL_PAGES])));

/// What a [`remap`] copied.
#[derive(Default, Debug)]
pub struct Copied {
    /// Engine tables used.
    pub tables: usize,
    /// Leaves mapped.
    pub leaves: u64,
    /// Leaves refused (stolen region, not RAM-backed tables, pool full).
    pub refused: u64,
}

struct Copier<'a> {
    b: &'a AttachBlock,
    pool: &'a mut Pool,
    used: usize,
    out: Copied,
}

impl Copier<'_> {
    fn read(&self, pa: u64) -> u64 {
        if !is_ram(self.b, pa, 8) {
            return 0;
        }
        // SAFETY: `pa` is guest RAM, which the physmap maps; aligned (table entries).
        unsafe { core::ptr::read_volatile((PHYSMAP_VA + pa) as *const u64) }
    }

    fn in_stolen(&self, pa: u64, len: u64) -> bool {
        pa < self.b.stolen_base + self.b.stolen_bytes && pa + len > self.b.stolen_base
    }

    /// A fresh zeroed pool page: its index.
    fn alloc(&mut self) -> Option<usize> {
        let i = self.used;
        if i >= POOL_PAGES {
            return None;
        }
        self.used += 1;
        self.pool.0[i] = [0; ENTRIES];
        Some(i)
    }

    fn pa_of(&self, i: usize) -> u64 {
        paging::window_pa(self.b, self.pool.0[i].as_ptr() as u64)
    }

    fn leaf(&mut self, pa: u64, size: u64, writable: bool, large: bool) -> u64 {
        if self.in_stolen(pa, size) {
            self.out.refused += 1;
            return 0;
        }
        self.out.leaves += 1;
        pa | PRESENT | USER | if writable { WRITABLE } else { 0 } | if large { LARGE } else { 0 }
    }

    /// Copies the guest table at `guest` (level 3 = PDPT … 1 = PT); the engine entry that
    /// points at the copy, or 0.
    fn table(&mut self, guest: u64, level: u32, writable: bool) -> u64 {
        let Some(t) = self.alloc() else {
            self.out.refused += 1;
            return 0;
        };
        for i in 0..ENTRIES as u64 {
            let e = self.read(guest + i * 8);
            if e & PRESENT == 0 {
                continue;
            }
            let w = writable && e & WRITABLE != 0;
            let entry = if level == 1 {
                self.leaf(e & ADDR_MASK, 1 << 12, w, false)
            } else if level == 2 && e & LARGE != 0 {
                self.leaf(e & ADDR_MASK & !((1 << 21) - 1), 1 << 21, w, true)
            } else if level == 3 && e & LARGE != 0 {
                // A 1 GiB leaf as 512 2 MiB leaves.
                let base = e & ADDR_MASK & !((1 << 30) - 1);
                match self.alloc() {
                    Some(pd) => {
                        for k in 0..ENTRIES as u64 {
                            let l = self.leaf(base + (k << 21), 1 << 21, w, true);
                            self.pool.0[pd][k as usize] = l;
                        }
                        self.pa_of(pd) | PRESENT | WRITABLE | USER
                    }
                    None => {
                        self.out.refused += 1;
                        0
                    }
                }
            } else {
                self.table(e & ADDR_MASK, level - 1, w)
            };
            self.pool.0[t][i as usize] = entry;
        }
        self.pa_of(t) | PRESENT | WRITABLE | USER
    }
}

/// Copies the tree under guest root `cr3` into the engine's root and reloads it.
pub fn remap(b: &AttachBlock, cr3: u64) -> Copied {
    // SAFETY: see `PoolCell`: no guest code runs while the dispatcher calls this.
    let pool = unsafe { &mut *POOL.0.get() };
    let mut c = Copier {
        b,
        pool,
        used: 0,
        out: Copied::default(),
    };
    let root = cr3 & ADDR_MASK;
    let mut slots = [0u64; ENTRIES];
    for (s, slot) in slots.iter_mut().enumerate() {
        if ENGINE_SLOTS.contains(&s) {
            continue;
        }
        let e = c.read(root + 8 * s as u64);
        if e & PRESENT != 0 {
            *slot = c.table(e & ADDR_MASK, 3, e & WRITABLE != 0);
        }
    }
    c.out.tables = c.used;
    // SAFETY: the engine's own slots are skipped by `set_guest_slots`; the pool tables
    // stay valid until the next `remap`, which reloads CR3 again.
    unsafe { paging::set_guest_slots(b, &slots, &ENGINE_SLOTS) };
    c.out
}
