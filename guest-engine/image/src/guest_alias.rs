//! **Stand-in for the shadow MMU** (to be replaced by `guest_engine::shadow_mmu`, which
//! is host-tested and gets wired in next): how translated guest code reaches guest data.
//!
//! Translated code runs at hardware CPL 3 on the engine's own page tables, so every guest
//! virtual address it touches must be mapped there, user-accessible. This first slice
//! copies the guest's mappings of PML4 slot 0 (guest VAs 0–512 GiB: the VMM's boot
//! identity map of 0–4 GiB and the tiny test guests' memory) into engine-owned tables,
//! once, at start: every guest 2 MiB or 1 GiB leaf becomes a 2 MiB engine leaf to the
//! same guest-physical address, **user-accessible** whatever the guest's U bit says,
//! writable only if the guest's entries are writable at every level, never NX.
//!
//! What it does not do — everything the shadow MMU exists for: guest 4 KiB pages (their
//! 2 MiB ranges are left unmapped and counted), later guest page-table changes and CR3
//! writes, A/D bits, faults reflected to the guest, the user view, write protection of
//! code pages. Leaves that would reach the stolen region are refused.

use core::cell::UnsafeCell;

use kpin_abi::attach::AttachBlock;
use kpin_abi::stolen::PHYSMAP_VA;

use crate::guest_mem::is_ram;
use crate::paging;

const ENTRIES: usize = 512;
/// Guest GiBs of slot 0 the stand-in can map (one engine page directory each).
pub const ALIAS_GIBS: usize = 8;

const PRESENT: u64 = 1 << 0;
const WRITABLE: u64 = 1 << 1;
const USER: u64 = 1 << 2;
const LARGE: u64 = 1 << 7;
const ADDR_MASK: u64 = 0x000f_ffff_ffff_f000;
const TWO_MIB: u64 = 1 << 21;
const ONE_GIB: u64 = 1 << 30;

#[repr(C, align(4096))]
struct Tables {
    pdpt: [u64; ENTRIES],
    pd: [[u64; ENTRIES]; ALIAS_GIBS],
}

struct Cell(UnsafeCell<Tables>);
// SAFETY: one vCPU; written only by `map_slot0` before the root entry points at them.
unsafe impl Sync for Cell {}

static TABLES: Cell = Cell(UnsafeCell::new(Tables {
    pdpt: [0; ENTRIES],
    pd: [[0; ENTRIES]; ALIAS_GIBS],
}));

/// What [`map_slot0`] did.
#[derive(Default)]
pub struct Aliased {
    /// 2 MiB engine leaves made.
    pub pages: u64,
    /// Of those, writable.
    pub writable: u64,
    /// Guest 2 MiB ranges mapped with 4 KiB pages, not aliased.
    pub small_ranges: u64,
    /// Guest leaves refused (into the stolen region, or beyond [`ALIAS_GIBS`]).
    pub refused: u64,
}

/// Reads a guest page-table entry; a table outside guest RAM reads as not present.
fn read_pa(b: &AttachBlock, pa: u64) -> u64 {
    if !is_ram(b, pa, 8) {
        return 0;
    }
    // SAFETY: `pa` is guest RAM (never the stolen region, absent from e820), which the
    // physmap maps.
    unsafe { core::ptr::read_volatile((PHYSMAP_VA + pa) as *const u64) }
}

/// Copies the guest's slot-0 mappings under `guest_cr3` into the engine root (see the
/// module header).
pub fn map_slot0(b: &AttachBlock, guest_cr3: u64) -> Aliased {
    // SAFETY: see `Cell`.
    let t = unsafe { &mut *TABLES.0.get() };
    let mut a = Aliased::default();
    let in_stolen =
        |pa: u64, len: u64| pa < b.stolen_base + b.stolen_bytes && pa + len > b.stolen_base;
    let pml4e = read_pa(b, guest_cr3 & ADDR_MASK);
    if pml4e & PRESENT == 0 {
        return a;
    }
    let pdpt = pml4e & ADDR_MASK;
    let leaf = |t: &mut Tables, va: u64, pa: u64, w: bool, a: &mut Aliased| {
        let gib = (va / ONE_GIB) as usize;
        if gib >= ALIAS_GIBS || in_stolen(pa, TWO_MIB) {
            a.refused += 1;
            return;
        }
        let flags = PRESENT | USER | LARGE | if w { WRITABLE } else { 0 };
        t.pd[gib][((va % ONE_GIB) / TWO_MIB) as usize] = (pa & ADDR_MASK) | flags;
        a.pages += 1;
        a.writable += u64::from(w);
    };
    for gib in 0..ENTRIES as u64 {
        let e = read_pa(b, pdpt + gib * 8);
        if e & PRESENT == 0 {
            continue;
        }
        let w1 = pml4e & e & WRITABLE != 0;
        if e & LARGE != 0 {
            for i in 0..ENTRIES as u64 {
                leaf(
                    t,
                    gib * ONE_GIB + i * TWO_MIB,
                    (e & ADDR_MASK & !(ONE_GIB - 1)) + i * TWO_MIB,
                    w1,
                    &mut a,
                );
            }
            continue;
        }
        let pd = e & ADDR_MASK;
        for i in 0..ENTRIES as u64 {
            let d = read_pa(b, pd + i * 8);
            if d & PRESENT == 0 {
                continue;
            }
            if d & LARGE == 0 {
                a.small_ranges += 1;
                continue;
            }
            leaf(
                t,
                gib * ONE_GIB + i * TWO_MIB,
                d & ADDR_MASK & !(TWO_MIB - 1),
                w1 && d & WRITABLE != 0,
                &mut a,
            );
        }
    }
    for gib in 0..ALIAS_GIBS {
        if t.pd[gib].iter().any(|&e| e != 0) {
            let pd_pa = paging::window_pa(b, t.pd[gib].as_ptr() as u64);
            t.pdpt[gib] = pd_pa | PRESENT | WRITABLE | USER;
        }
    }
    let pdpt_pa = paging::window_pa(b, t.pdpt.as_ptr() as u64);
    // SAFETY: slot 0 is neither the window's (257) nor the physmap's (258); the tables
    // are statics of the image, valid for the engine's lifetime.
    unsafe { paging::set_root_entry(b, 0, pdpt_pa | PRESENT | WRITABLE | USER) };
    a
}
