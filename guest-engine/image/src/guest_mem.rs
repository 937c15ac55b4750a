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
const WRITABLE: u64 = 1 << 1;
/// CR0.WP.
const CR0_WP: u64 = 1 << 16;

/// What a walk checks the entries for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Access {
    Fetch,
    Read,
    Write,
}
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
    /// The guest's CR0 (WP decides whether supervisor writes honour R/W).
    pub cr0: u64,
    block: &'a AttachBlock,
}

impl<'a> PhysmapMemory<'a> {
    /// Guest memory described by `block` (its e820 map), walked from `cr3`.
    pub fn new(block: &'a AttachBlock, cr3: &'a Cell<u64>) -> Self {
        Self {
            cr3,
            efer: block.sregs.efer,
            cr0: block.sregs.cr0,
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
        self.walk_for(va, mode, true)
    }

    /// Reads guest virtual memory as a data read in `mode` (no NX check); `false` if a
    /// byte's page is not mapped for it or not RAM.
    pub fn read_virt(&self, va: u64, mode: Mode, out: &mut [u8]) -> bool {
        for (i, b) in out.iter_mut().enumerate() {
            let Some(pa) = self.walk_for(va.wrapping_add(i as u64), mode, false) else {
                return false;
            };
            if !self.is_ram(pa, 1) {
                return false;
            }
            // SAFETY: `pa` is guest RAM, mapped by the physmap.
            *b = unsafe { core::ptr::read_volatile((PHYSMAP_VA + pa) as *const u8) };
        }
        true
    }

    /// Writes guest virtual memory as a data write in `mode` (R/W bits checked for user
    /// mode, and for supervisor mode when CR0.WP is set); `false` — and nothing written —
    /// if a byte's page does not allow it or is not RAM.
    pub fn write_virt(&self, va: u64, mode: Mode, data: &[u8]) -> bool {
        let mut pas = [0u64; 16];
        if data.len() > pas.len() {
            return false;
        }
        for (i, pa) in pas.iter_mut().enumerate().take(data.len()) {
            match self.walk_access(va.wrapping_add(i as u64), mode, Access::Write) {
                Some(p) if self.is_ram(p, 1) => *pa = p,
                _ => return false,
            }
        }
        for (b, pa) in data.iter().zip(pas) {
            // SAFETY: `pa` is guest RAM, mapped writable by the physmap.
            unsafe { core::ptr::write_volatile((PHYSMAP_VA + pa) as *mut u8, *b) };
        }
        true
    }

    fn walk_for(&self, va: u64, mode: Mode, fetch: bool) -> Option<u64> {
        let access = if fetch { Access::Fetch } else { Access::Read };
        self.walk_access(va, mode, access)
    }

    fn walk_access(&self, va: u64, mode: Mode, access: Access) -> Option<u64> {
        let nxe = access == Access::Fetch && self.efer & EFER_NXE != 0;
        let check_w = access == Access::Write && (mode == MODE_USER || self.cr0 & CR0_WP != 0);
        let mut table = self.cr3.get() & ADDR_MASK;
        for level in (0..4u32).rev() {
            let shift = 12 + 9 * level;
            let entry = self.read_u64(table + ((va >> shift) & 0x1ff) * 8)?;
            if entry & PRESENT == 0
                || (nxe && entry & NX != 0)
                || (mode == MODE_USER && entry & USER == 0)
                || (check_w && entry & WRITABLE == 0)
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
