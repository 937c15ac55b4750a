//! `guest_engine::GuestMemory` over the physmap: translates a guest virtual address by
//! walking the guest's own 4-level page tables (root = the virtual CR3, shared with the
//! virtual CPU, which will update it on emulated CR3 writes) and reads guest-physical
//! bytes at `PHYSMAP_VA + pa`.
//!
//! The walk is read-only: it sets no accessed/dirty bits (the shadow MMU, host-tested in
//! `guest_engine::shadow_mmu`, does that when it is wired in). Only guest RAM listed in
//! the e820 map is read; anything else (the stolen region, holes) answers "not backed".

use core::cell::Cell;

use guest_engine::{GuestMemory, GuestPhys, GuestVirt, Mode};
use kpin_abi::attach::AttachBlock;
use kpin_abi::stolen::PHYSMAP_VA;

const PRESENT: u64 = 1 << 0;
const USER: u64 = 1 << 2;
const LARGE: u64 = 1 << 7;
const NX: u64 = 1 << 63;
/// Physical-address bits of a table entry (bits 12–51).
const ADDR_MASK: u64 = 0x000f_ffff_ffff_f000;
/// EFER.NXE.
const EFER_NXE: u64 = 1 << 11;

/// Translation mode of traces run at virtual CPL 0 (the only one so far).
pub const MODE_KERNEL: Mode = Mode(0);
/// Translation mode of traces run at virtual CPL 3.
pub const MODE_USER: Mode = Mode(3);

/// Whether `[pa, pa + len)` lies inside one e820 RAM range of `block` (so the physmap
/// maps it).
pub fn is_ram(block: &AttachBlock, pa: u64, len: u64) -> bool {
    let n = (block.e820_count as usize).min(block.e820.len());
    let end = pa.saturating_add(len);
    block.e820[..n]
        .iter()
        .any(|e| e.kind == 1 && e.addr <= pa && end <= e.addr.saturating_add(e.size))
}

/// Guest memory seen through the physmap.
pub struct PhysmapMemory<'a> {
    /// The guest's CR3 (virtual CPU state).
    pub cr3: &'a Cell<u64>,
    /// The guest's EFER (NXE decides whether bit 63 is NX).
    pub efer: u64,
    block: &'a AttachBlock,
}

impl<'a> PhysmapMemory<'a> {
    /// Guest memory described by `block` (its e820 map), walked from `cr3`.
    pub fn new(block: &'a AttachBlock, cr3: &'a Cell<u64>) -> Self {
        Self {
            cr3,
            efer: block.sregs.efer,
            block,
        }
    }

    /// Whether `[pa, pa + len)` lies inside one e820 RAM range (so the physmap maps it).
    pub fn is_ram(&self, pa: u64, len: u64) -> bool {
        is_ram(self.block, pa, len)
    }

    fn read_u64(&self, pa: u64) -> Option<u64> {
        if !pa.is_multiple_of(8) || !self.is_ram(pa, 8) {
            return None;
        }
        // SAFETY: `pa` is guest RAM, which the physmap maps (every e820 range up to its
        // 8 GiB limit); aligned; a volatile read because the guest owns the memory.
        Some(unsafe { core::ptr::read_volatile((PHYSMAP_VA + pa) as *const u64) })
    }

    /// Walks the guest tables for an instruction fetch at `va` in `mode`: the physical
    /// address, or `None` where the fetch would fault (not present, NX, or a supervisor
    /// page fetched in user mode).
    pub fn walk(&self, va: u64, mode: Mode) -> Option<u64> {
        let nxe = self.efer & EFER_NXE != 0;
        let mut table = self.cr3.get() & ADDR_MASK;
        for level in (0..4u32).rev() {
            let shift = 12 + 9 * level;
            let entry = self.read_u64(table + ((va >> shift) & 0x1ff) * 8)?;
            if entry & PRESENT == 0
                || (nxe && entry & NX != 0)
                || (mode == MODE_USER && entry & USER == 0)
            {
                return None;
            }
            let leaf = level == 0 || ((level == 1 || level == 2) && entry & LARGE != 0);
            if leaf {
                let page_mask = (1u64 << shift) - 1;
                return Some((entry & ADDR_MASK & !page_mask) | (va & page_mask));
            }
            table = entry & ADDR_MASK;
        }
        None
    }
}

impl GuestMemory for PhysmapMemory<'_> {
    fn translate(&mut self, va: GuestVirt, mode: Mode) -> Option<GuestPhys> {
        self.walk(va.0, mode).map(GuestPhys)
    }

    fn read(&mut self, pa: GuestPhys, out: &mut [u8]) -> bool {
        if !self.is_ram(pa.0, out.len() as u64) {
            return false;
        }
        // SAFETY: the whole range is guest RAM mapped by the physmap.
        let src =
            unsafe { core::slice::from_raw_parts((PHYSMAP_VA + pa.0) as *const u8, out.len()) };
        out.copy_from_slice(src);
        true
    }
}
