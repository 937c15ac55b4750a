//! Which virtual addresses CPL-3 code may use on this KVM: aliases the window's PDPT into
//! other PML4 slots of the boot page tables and reads through each alias with the fault-
//! tolerant probe of `entry.rs`. On `kvm_pvm` hosts, upper-half slots fault with the
//! reserved-bit error code; the result decides where the window and guest kernel
//! addresses can live for code running at CPL 3.

use core::arch::asm;

use kpin_abi::stolen::{BOOT_PT_OFFSET, ENGINE_OFFSET, WINDOW_VA};

use crate::ring0::entry::kpin_probe_read;
use crate::ring0::gate;

/// PML4 slots in a 4-level address space.
pub const SLOTS: u64 = 512;

/// What reading through one slot did.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The read returned this value.
    Read(u64),
    /// The read faulted with this vector and error code.
    Fault(u64, u64),
}

/// The canonical address of byte `offset` in PML4 slot `slot`.
pub fn slot_va(slot: u64, offset: u64) -> u64 {
    let va = (slot << 39) | offset;
    if slot >= 256 {
        va | 0xffff_0000_0000_0000
    } else {
        va
    }
}

/// Reads `va` at CPL 3; a fault is a value, not a report.
pub fn read(va: u64) -> Outcome {
    let (status, rdx, rcx): (u64, u64, u64);
    // SAFETY: `kpin_probe_read` reads one quadword at RDI; a fault there is turned into
    // RAX = 1 by the trap path, so no fault escapes; it clobbers only RAX, RCX, RDX.
    unsafe {
        asm!(
            "call {probe}",
            probe = sym kpin_probe_read,
            in("rdi") va,
            out("rax") status,
            out("rdx") rdx,
            out("rcx") rcx,
        );
    }
    if status == 0 {
        Outcome::Read(rdx)
    } else {
        Outcome::Fault(rdx, rcx)
    }
}

/// Aliases the window into `slot` and reads the engine's first quadword through it.
///
/// # Safety
/// `stolen_base` is the stolen region's guest-physical base and the engine still runs on
/// the VMM's boot page tables; `slot` is neither the window's nor the physmap's slot.
pub unsafe fn probe_slot(stolen_base: u64, slot: u64) -> Outcome {
    let pml4 = (WINDOW_VA + BOOT_PT_OFFSET) as *mut u64;
    let window_slot = (WINDOW_VA >> 39) & 0x1ff;
    // SAFETY: the boot PML4 is in the window (user-writable); entry `slot` is free
    // (caller's contract) and is cleared again below; CR3 reloads flush the TLB.
    unsafe {
        let entry = core::ptr::read_volatile(pml4.add(window_slot as usize));
        core::ptr::write_volatile(pml4.add(slot as usize), entry);
        gate::load_cr3(stolen_base + BOOT_PT_OFFSET);
    }
    let r = read(slot_va(slot, ENGINE_OFFSET));
    // SAFETY: as above.
    unsafe {
        core::ptr::write_volatile(pml4.add(slot as usize), 0);
        gate::load_cr3(stolen_base + BOOT_PT_OFFSET);
    }
    r
}
