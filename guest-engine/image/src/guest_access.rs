//! Guest virtual memory as the virtual CPU's emulations see it: reads and writes at a
//! given privilege that fail with the page fault a real CPU would raise.
//!
//! Today this wraps `PhysmapMemory::read_virt/write_virt` (a walk without A/D bits) and
//! computes the #PF error code roughly (P from whether a supervisor read of the byte would
//! succeed, W, U). At the shadow-MMU merge only the bodies of [`read`] and [`write`]
//! change: they call `try_read_virt`/`try_write_virt`, whose `GuestFault` carries the
//! exact error code and CR2.

use crate::guest_mem::{PhysmapMemory, MODE_KERNEL, MODE_USER};

/// #PF error code bits.
const PF_PRESENT: u32 = 1 << 0;
const PF_WRITE: u32 = 1 << 1;
const PF_USER: u32 = 1 << 2;

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

/// A #PF error code from its P, W and U bits.
fn error_code(present: bool, write: bool, user: bool) -> u32 {
    let bit = |b: bool, v: u32| if b { v } else { 0 };
    bit(present, PF_PRESENT) | bit(write, PF_WRITE) | bit(user, PF_USER)
}

/// The first byte of `[va, va + len)` that the access cannot touch, and its error code.
fn fault_at(mem: &PhysmapMemory<'_>, va: u64, len: usize, user: bool, write: bool) -> PageFault {
    let mut probe = [0u8; 1];
    for k in 0..len as u64 {
        let a = va.wrapping_add(k);
        let ok = if write {
            // A probe that writes nothing: check the byte's page with a read first, then a
            // write of the byte's own value (the caller is about to fault anyway).
            mem.read_virt(a, mode(user), &mut probe) && mem.write_virt(a, mode(user), &probe)
        } else {
            mem.read_virt(a, mode(user), &mut probe)
        };
        if !ok {
            let present = mem.read_virt(a, MODE_KERNEL, &mut probe);
            return PageFault {
                cr2: a,
                error: error_code(present, write, user),
            };
        }
    }
    PageFault {
        cr2: va,
        error: error_code(false, write, user),
    }
}

/// Reads `out.len()` bytes at `va` as a data read at CPL 3 (`user`) or CPL 0.
pub fn read(mem: &PhysmapMemory<'_>, va: u64, user: bool, out: &mut [u8]) -> Result<(), PageFault> {
    if mem.read_virt(va, mode(user), out) {
        Ok(())
    } else {
        Err(fault_at(mem, va, out.len(), user, false))
    }
}

/// Writes `data` (at most 16 bytes) at `va` as a data write at CPL 3 (`user`) or CPL 0;
/// nothing is written on a fault.
pub fn write(mem: &PhysmapMemory<'_>, va: u64, user: bool, data: &[u8]) -> Result<(), PageFault> {
    if mem.write_virt(va, mode(user), data) {
        Ok(())
    } else {
        Err(fault_at(mem, va, data.len(), user, true))
    }
}

/// Reads a little-endian u64.
pub fn read_u64(mem: &PhysmapMemory<'_>, va: u64, user: bool) -> Result<u64, PageFault> {
    let mut b = [0u8; 8];
    read(mem, va, user, &mut b)?;
    Ok(u64::from_le_bytes(b))
}
