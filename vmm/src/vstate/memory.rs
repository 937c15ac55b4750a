//! Guest RAM, the stolen region, and the e820 map that describes them to the guest.
//!
//! Invariants: guest RAM never overlaps the 32-bit MMIO gap; the stolen region lies above
//! all guest RAM at a [`STOLEN_ALIGN_BYTES`]-aligned address, is registered with KVM as its
//! own memslot, and is absent from the e820 map, so the guest OS never allocates from it.

use kvm_bindings::kvm_userspace_memory_region;
use kvm_ioctls::VmFd;
use vm_memory::{Address, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};

use crate::boot::layout::{
    EBDA_START, HIMEM_START, MAX_MEM_MIB, MIN_MEM_MIB, MMIO_GAP_END, MMIO_GAP_START,
    STOLEN_ALIGN_BYTES, STOLEN_SIZE_BYTES,
};
use crate::error::{Result, VmmError};

/// e820 type of usable RAM.
pub const E820_RAM: u32 = 1;
/// e820 type of reserved memory.
pub const E820_RESERVED: u32 = 2;

/// One e820 entry (the attach block's layout; the boot protocol's is the same
/// without the padding).
pub use kpin_abi::attach::E820Entry;

/// The guest's physical memory: RAM regions plus the stolen region.
pub struct VmMemory {
    /// Guest RAM as the guest sees it (one or two regions around the MMIO gap).
    pub ram: GuestMemoryMmap,
    /// The stolen region: a separate mapping the VMM keeps, never shown to the guest OS.
    pub stolen: GuestMemoryMmap,
    /// Total guest RAM in bytes.
    pub ram_bytes: u64,
}

/// The guest-physical ranges of `ram_bytes` of RAM, split around the MMIO gap.
pub fn ram_ranges(ram_bytes: u64) -> Vec<(GuestAddress, usize)> {
    let low = ram_bytes.min(MMIO_GAP_START);
    let mut ranges = vec![(GuestAddress(0), to_usize(low))];
    if ram_bytes > low {
        ranges.push((GuestAddress(MMIO_GAP_END), to_usize(ram_bytes - low)));
    }
    ranges
}

/// Guest-physical base of the stolen region for `ram_bytes` of guest RAM.
pub fn stolen_base(ram_bytes: u64) -> u64 {
    let ram_end = ram_ranges(ram_bytes)
        .iter()
        .map(|(a, len)| a.raw_value() + *len as u64)
        .max()
        .unwrap_or(0);
    ram_end
        .max(MMIO_GAP_END)
        .next_multiple_of(STOLEN_ALIGN_BYTES)
}

/// The e820 map the guest is given: low RAM, the BIOS hole, high RAM. The stolen region
/// is deliberately not listed.
pub fn e820_map(ram_bytes: u64) -> Vec<E820Entry> {
    let mut map = vec![
        E820Entry::new(0, EBDA_START, E820_RAM),
        E820Entry::new(EBDA_START, HIMEM_START - EBDA_START, E820_RESERVED),
    ];
    for (addr, len) in ram_ranges(ram_bytes) {
        let start = addr.raw_value().max(HIMEM_START);
        let end = addr.raw_value() + len as u64;
        if end > start {
            map.push(E820Entry::new(start, end - start, E820_RAM));
        }
    }
    map
}

fn to_usize(v: u64) -> usize {
    usize::try_from(v).expect("guest memory sizes are bounded by MAX_MEM_MIB and fit usize")
}

impl VmMemory {
    /// Allocates `mem_mib` MiB of guest RAM and the stolen region, and registers both with KVM.
    pub fn new(vm: &VmFd, mem_mib: u64) -> Result<Self> {
        if !(MIN_MEM_MIB..=MAX_MEM_MIB).contains(&mem_mib) {
            return Err(VmmError::MemSize {
                requested_mib: mem_mib,
                min_mib: MIN_MEM_MIB,
                max_mib: MAX_MEM_MIB,
            });
        }
        let ram_bytes = mem_mib << 20;
        let ram =
            GuestMemoryMmap::from_ranges(&ram_ranges(ram_bytes)).map_err(VmmError::VmMemory)?;
        let stolen = GuestMemoryMmap::from_ranges(&[(
            GuestAddress(stolen_base(ram_bytes)),
            to_usize(STOLEN_SIZE_BYTES),
        )])
        .map_err(VmmError::VmMemory)?;
        for (slot, region) in (0u32..).zip(ram.iter().chain(stolen.iter())) {
            let host = region
                .get_host_address(vm_memory::MemoryRegionAddress(0))
                .map_err(|e| VmmError::GuestAccess(region.start_addr().raw_value(), e))?;
            let desc = kvm_userspace_memory_region {
                slot,
                flags: 0,
                guest_phys_addr: region.start_addr().raw_value(),
                memory_size: region.len(),
                userspace_addr: host as u64,
            };
            // SAFETY: `host` is the start of a live mmap of `region.len()` bytes owned by
            // `ram`/`stolen`, which `VmMemory` keeps alive as long as the VM that uses them
            // (the `Vm` struct drops the VM fd before its memory).
            unsafe { vm.set_user_memory_region(desc) }
                .map_err(|e| VmmError::Kvm("KVM_SET_USER_MEMORY_REGION", e))?;
        }
        Ok(VmMemory {
            ram,
            stolen,
            ram_bytes,
        })
    }

    /// Highest address + 1 of guest RAM below the MMIO gap.
    pub fn low_ram_end(&self) -> u64 {
        self.ram_bytes.min(MMIO_GAP_START)
    }

    /// Host address of `offset` bytes into the stolen region.
    pub fn stolen_host_address(&self, offset: u64) -> Result<*mut u8> {
        let base = stolen_base(self.ram_bytes);
        self.stolen
            .get_host_address(GuestAddress(base + offset))
            .map_err(|e| VmmError::GuestAccess(base + offset, e))
    }

    /// Reads guest-physical memory (RAM or stolen region) into `buf`, failing if any byte
    /// is outside both.
    pub fn read(&self, gpa: u64, buf: &mut [u8]) -> Result<()> {
        use vm_memory::Bytes;
        self.ram
            .read_slice(buf, GuestAddress(gpa))
            .or_else(|_| self.stolen.read_slice(buf, GuestAddress(gpa)))
            .map_err(|e| VmmError::GuestAccess(gpa, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_small_ram_is_one_region_below_gap() {
        let r = ram_ranges(256 << 20);
        assert_eq!(r, vec![(GuestAddress(0), 256 << 20)]);
    }

    #[test]
    fn test_large_ram_splits_around_mmio_gap() {
        let r = ram_ranges(4 << 30);
        assert_eq!(r[0], (GuestAddress(0), MMIO_GAP_START as usize));
        assert_eq!(r[1], (GuestAddress(MMIO_GAP_END), (1 << 30) as usize));
    }

    #[test]
    fn test_stolen_region_above_ram_and_aligned() {
        for mib in [16, 256, 3072, 4096, 6000] {
            let base = stolen_base(mib << 20);
            assert_eq!(base % STOLEN_ALIGN_BYTES, 0);
            for (a, len) in ram_ranges(mib << 20) {
                assert!(
                    a.raw_value() + len as u64 <= base,
                    "{mib} MiB overlaps stolen region"
                );
            }
        }
    }

    #[test]
    fn test_e820_excludes_stolen_region_and_bios_hole() {
        let map = e820_map(256 << 20);
        let base = stolen_base(256 << 20);
        assert!(map.iter().all(|e| e.addr + e.size <= base));
        assert!(map.iter().any(|e| e.kind == E820_RESERVED
            && e.addr == EBDA_START
            && e.addr + e.size == HIMEM_START));
        let ram: u64 = map
            .iter()
            .filter(|e| e.kind == E820_RAM)
            .map(|e| e.size)
            .sum();
        assert_eq!(ram, (256 << 20) - (HIMEM_START - EBDA_START));
    }
}
