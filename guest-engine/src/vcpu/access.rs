//! Guest virtual memory as the virtual CPU's emulations see it: reads and writes at a
//! given privilege that fail with the page fault a real CPU would raise — the shadow
//! MMU's walk (`PhysmapMemory::try_read_virt`/`try_write_virt`) gives the exact error
//! code and CR2, and sets the guest's A/D bits as the CPU would.

use crate::guest_mem::{PhysmapMemory, MODE_KERNEL, MODE_USER};

/// A guest page fault: the address (CR2) and the error code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageFault {
    /// The faulting linear address.
    pub cr2: u64,
    /// The #PF error code.
    pub error: u32,
}

/// Which privilege an access is made at: `user` = CPL 3 (supervisor pages fault).
fn mode(user: bool) -> guest_engine::Mode {
    if user {
        MODE_USER
    } else {
        MODE_KERNEL
    }
}

fn page_fault(f: guest_engine::shadow_mmu::GuestFault) -> PageFault {
    PageFault {
        cr2: f.cr2.0,
        error: f.error_code,
    }
}

/// Reads `out.len()` bytes at `va` as a data read at CPL 3 (`user`) or CPL 0.
pub fn read(mem: &PhysmapMemory<'_>, va: u64, user: bool, out: &mut [u8]) -> Result<(), PageFault> {
    mem.try_read_virt(va, mode(user), out).map_err(page_fault)
}

/// Writes `data` (at most 16 bytes) at `va` as a data write at CPL 3 (`user`) or CPL 0;
/// nothing is written on a fault.
pub fn write(mem: &PhysmapMemory<'_>, va: u64, user: bool, data: &[u8]) -> Result<(), PageFault> {
    mem.try_write_virt(va, mode(user), data).map_err(page_fault)
}

/// Reads a little-endian u64.
pub fn read_u64(mem: &PhysmapMemory<'_>, va: u64, user: bool) -> Result<u64, PageFault> {
    let mut b = [0u8; 8];
    read(mem, va, user, &mut b)?;
    Ok(u64::from_le_bytes(b))
}
