//! The engine's own page tables, built at CPL 3 in its `.bss` and loaded through the
//! LOAD_CR3 gate, replacing the VMM's boot tables: the stolen region at `WINDOW_VA` and
//! every e820 range of guest-physical memory at `PHYSMAP_VA`, 2 MiB pages (this KVM has no
//! 1 GiB pages), user-accessible because the engine runs at CPL 3.
//!
//! Invariant: the engine's own tables map the window exactly as the boot tables do, so
//! switching is invisible to the running code. Once guest code runs, the real CR3 holds a
//! shadow root (`mm/shadow.rs`), which copies this root's window and physmap PML4 entries.

use core::cell::UnsafeCell;

use kpin_abi::attach::AttachBlock;
use kpin_abi::stolen::{PHYSMAP_VA, WINDOW_VA};

use crate::ring0::gate;

const ENTRIES: usize = 512;
/// Page directories for the physmap: 8 GiB of guest-physical address space.
pub const PHYSMAP_PDS: usize = 8;
const PRESENT: u64 = kpin_abi::x86::pte::PRESENT;
const WRITABLE: u64 = kpin_abi::x86::pte::WRITABLE;
const USER: u64 = kpin_abi::x86::pte::USER;
const LARGE: u64 = kpin_abi::x86::pte::PAGE_SIZE;
const TABLE: u64 = PRESENT | WRITABLE | USER;
const TWO_MIB: u64 = 1 << 21;
const ONE_GIB: u64 = 1 << 30;

#[repr(C, align(4096))]
struct Tables {
    pml4: [u64; ENTRIES],
    window_pdpt: [u64; ENTRIES],
    window_pd: [u64; ENTRIES],
    physmap_pdpt: [u64; ENTRIES],
    physmap_pd: [[u64; ENTRIES]; PHYSMAP_PDS],
}

pub(crate) struct Cell(UnsafeCell<Tables>);
// SAFETY: one vCPU; the tables are written only by `build`, before they are loaded.
unsafe impl Sync for Cell {}

/// The tables; the PML4 comes first, so the static's address is the engine's root (the
/// gate's LOAD_CR3 check accepts it by symbol).
pub(crate) static TABLES: Cell = Cell(UnsafeCell::new(Tables {
    pml4: [0; ENTRIES],
    window_pdpt: [0; ENTRIES],
    window_pd: [0; ENTRIES],
    physmap_pdpt: [0; ENTRIES],
    physmap_pd: [[0; ENTRIES]; PHYSMAP_PDS],
}));

/// The guest-physical address of the engine's root (built by [`build_and_load`]): the
/// shadow MMU's template, whose window and physmap slots every shadow root copies.
pub fn engine_root(b: &AttachBlock) -> u64 {
    // SAFETY: only the address of the static is taken.
    let t = unsafe { &*TABLES.0.get() };
    window_pa(b, t.pml4.as_ptr() as u64)
}

/// Whether the physmap maps guest-physical address `pa` (it covers the e820 ranges of the
/// first [`PHYSMAP_PDS`] GiBs that hold any, in 2 MiB pages).
pub fn physmap_maps(b: &AttachBlock, pa: u64) -> bool {
    // SAFETY: the tables are written only by `build_and_load`, before guest code runs.
    let t = unsafe { &*TABLES.0.get() };
    let gib = pa / ONE_GIB;
    let Some(&pdpte) = t.physmap_pdpt.get(gib as usize) else {
        return false;
    };
    if pdpte == 0 {
        return false;
    }
    t.physmap_pd
        .iter()
        .find(|pd| window_pa(b, pd.as_ptr() as u64) == pdpte & !0xfff)
        .is_some_and(|pd| pd[((pa % ONE_GIB) / TWO_MIB) as usize] != 0)
}

/// The guest-physical address of an engine object in the window.
pub fn window_pa(b: &AttachBlock, va: u64) -> u64 {
    b.stolen_base + (va - WINDOW_VA)
}

/// What [`build`] mapped.
pub struct Mapped {
    /// The new root (guest-physical).
    pub cr3: u64,
    /// 2 MiB pages of the window.
    pub window_pages: u64,
    /// 2 MiB pages of the physmap.
    pub physmap_pages: u64,
    /// e820 bytes beyond what the physmap page directories cover (not mapped).
    pub unmapped_bytes: u64,
}

fn slot(va: u64) -> usize {
    ((va >> 39) & 0x1ff) as usize
}

/// Builds the tables for the stolen region and memory map in `b` and loads them.
pub fn build_and_load(b: &AttachBlock) -> Mapped {
    // SAFETY: called once, before the tables are loaded; no other reference exists.
    let t = unsafe { &mut *TABLES.0.get() };
    let pa = |r: &[u64; ENTRIES]| b.stolen_base + (r.as_ptr() as u64 - WINDOW_VA);
    let window_pages = (b.stolen_bytes / TWO_MIB).min(ENTRIES as u64);
    for (i, e) in t
        .window_pd
        .iter_mut()
        .take(window_pages as usize)
        .enumerate()
    {
        *e = (b.stolen_base + i as u64 * TWO_MIB) | TABLE | LARGE;
    }
    t.window_pdpt[0] = pa(&t.window_pd) | TABLE;
    t.pml4[slot(WINDOW_VA)] = pa(&t.window_pdpt) | TABLE;

    let mut used_pds = 0;
    let mut physmap_pages = 0;
    let mut unmapped_bytes = 0;
    let n = (b.e820_count as usize).min(b.e820.len());
    for e in &b.e820[..n] {
        let end = e.addr.saturating_add(e.size);
        let mut page = e.addr / TWO_MIB * TWO_MIB;
        while page < end {
            let gib = (page / ONE_GIB) as usize;
            if gib >= ENTRIES {
                break;
            }
            if t.physmap_pdpt[gib] == 0 {
                if used_pds == PHYSMAP_PDS {
                    unmapped_bytes += end - page;
                    break;
                }
                t.physmap_pdpt[gib] = pa(&t.physmap_pd[used_pds]) | TABLE;
                used_pds += 1;
            }
            let pd_pa = t.physmap_pdpt[gib] & !0xfff;
            let pd = t
                .physmap_pd
                .iter_mut()
                .find(|pd| b.stolen_base + (pd.as_ptr() as u64 - WINDOW_VA) == pd_pa)
                .expect("every PDPT entry points at one of our page directories");
            let idx = ((page % ONE_GIB) / TWO_MIB) as usize;
            if pd[idx] == 0 {
                pd[idx] = page | TABLE | LARGE;
                physmap_pages += 1;
            }
            page += TWO_MIB;
        }
    }
    t.pml4[slot(PHYSMAP_VA)] = pa(&t.physmap_pdpt) | TABLE;
    let cr3 = pa(&t.pml4);
    // SAFETY: the new root maps the window exactly as the boot tables do (same 2 MiB
    // pages of the stolen region at WINDOW_VA), so code, stacks and tables stay mapped.
    unsafe { gate::load_cr3(cr3) };
    Mapped {
        cr3,
        window_pages,
        physmap_pages,
        unmapped_bytes,
    }
}
