//! What the virtual CPU needs from its embedder: the hardware it reaches through the
//! ring-0 gate ([`Hardware`]) and guest memory through the shadow MMU ([`GuestMmu`]).
//! The engine image implements both with its gate calls and its `Shadow`; the host unit
//! tests with mocks.

use core::fmt;

use crate::shadow_mmu::{PagingControl, ShadowError, View};

/// A fault a guest memory access raises: a #PF with its CR2, or the #GP(0) of a
/// non-canonical address (the shadow MMU's type: one for both).
pub use crate::shadow_mmu::GuestFault;

/// Hardware the virtual CPU reaches only through the engine's ring-0 gate (or bare
/// metal the engine owns): port I/O, pass-through MSRs, the real CR4's SSE bits, the
/// hardware FS/GS bases, `hlt`, the pending-interrupt bitmap and the TSC.
pub trait Hardware {
    /// `out` of the low `size` (1, 2, 4) bytes of `value` to `port`.
    fn port_out(&mut self, port: u16, size: u8, value: u32);
    /// `in` of `size` (1, 2, 4) bytes from `port`, zero-extended.
    fn port_in(&mut self, port: u16, size: u8) -> u32;
    /// The guest RIP of the port instruction whose accesses follow (for the embedder's
    /// per-site count of the accesses that leave it, [`super::PortExitTable`]).
    fn port_site(&mut self, _rip: u64) {}
    /// `rdmsr` of an MSR the virtual MSR file passes through to KVM.
    fn rdmsr_passthrough(&mut self, index: u32) -> u64;
    /// `rdmsr` that answers `None` where the hardware raises #GP.
    fn rdmsr_safe(&mut self, index: u32) -> Option<u64>;
    /// `wrmsr` of an MSR the virtual MSR file passes through (its effect is the
    /// guest's; the virtual CPU never passes an engine-owned index).
    fn wrmsr_passthrough(&mut self, index: u32, value: u64);
    /// Makes the real CR4's SSE bits (OSFXSR, OSXMMEXCPT) those of the guest's `cr4`.
    fn set_cr4_sse(&mut self, cr4: u64);
    /// Sets the hardware FS (`fs`) or GS base that translated code uses (`base` is
    /// canonical).
    fn set_hw_base(&mut self, fs: bool, base: u64);
    /// Waits until an interrupt is pending (`hlt` with interrupts enabled).
    fn halt(&mut self);
    /// The highest pending external interrupt vector, if any.
    fn pending_highest(&self) -> Option<u8>;
    /// Marks `vector` delivered.
    fn take_pending(&mut self, vector: u8);
    /// Asks the translator to stop at its next attention check if a vector is pending
    /// (after the virtual IF became 1).
    fn rearm_attention(&mut self);
    /// The time-stamp counter.
    fn tsc(&mut self) -> u64;
    /// Whether the embedder wants the run loop back (a detach or tool switch the VMM
    /// asked for): a `hlt` woken without an interrupt then returns to re-execute itself
    /// later instead of waiting again.
    fn control_requested(&self) -> bool {
        false
    }
    /// Whether loading a null selector into FS or GS zeroes its base on this CPU, if the
    /// embedder measured it (else the vendor and CPUID decide).
    fn null_selector_clears_base(&self) -> Option<bool> {
        None
    }

    /// A line for the engine log (info level).
    fn log(&mut self, line: fmt::Arguments<'_>);
}

/// Guest virtual memory and the shadow MMU, as the virtual CPU uses them.
pub trait GuestMmu {
    /// Reads `out.len()` bytes at `va` as a data read at CPL 3 (`user`) or CPL 0 (also
    /// the CPU's implicit supervisor accesses), or the #PF the guest would take. A/D bits
    /// are set as hardware would.
    fn read(&mut self, va: u64, user: bool, out: &mut [u8]) -> Result<(), GuestFault>;
    /// Writes `data` (at most 16 bytes) at `va` as a data write; nothing is written on a
    /// fault.
    fn write(&mut self, va: u64, user: bool, data: &[u8]) -> Result<(), GuestFault>;
    /// The guest's CR3.
    fn cr3(&self) -> u64;
    /// `mov cr3`: switches the guest's address space.
    fn write_cr3(&mut self, cr3: u64) -> Result<(), ShadowError>;
    /// `invlpg va`.
    fn invlpg(&mut self, va: u64) -> Result<(), ShadowError>;
    /// The paging-control bits of CR0/CR4/EFER changed (or not).
    fn set_paging_control(&mut self, control: PagingControl) -> Result<(), ShadowError>;
    /// The virtual CPL changed: the shadow view that follows it.
    fn enter_view(&mut self, view: View) -> Result<(), ShadowError>;
    /// Records an engine failure; the run stops at its next check.
    fn record_failure(&mut self, e: ShadowError);
    /// Whether an engine failure was recorded.
    fn failed(&self) -> bool;
    /// Whether the translator must hear of something (a CR3 write, a code frame
    /// written) before guest code runs again.
    fn has_work(&self) -> bool;

    /// Reads `out.len()` bytes at `va` with the kernel's privileges for an observer (the
    /// task watch): `false` on anything the guest would fault on *and* on a frame the
    /// engine cannot read, which for an instruction's access is an engine failure.
    fn observe(&mut self, va: u64, out: &mut [u8]) -> bool {
        self.read(va, false, out).is_ok()
    }

    /// Reads a little-endian u64.
    fn read_u64(&mut self, va: u64, user: bool) -> Result<u64, GuestFault> {
        let mut b = [0u8; 8];
        self.read(va, user, &mut b)?;
        Ok(u64::from_le_bytes(b))
    }
}
