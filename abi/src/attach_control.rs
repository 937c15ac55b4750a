//! The attach control area: how the VMM asks a running engine to end or change an
//! instrumentation window, and where the engine hands the guest's state back on a detach
//! to native execution. It lives in the attach slot of the stolen region, after the
//! attach block ([`CONTROL_OFFSET`]), so that the engine can write it while it still
//! holds the block it was started from.
//!
//! Protocol (one request at a time):
//! 1. The VMM (vCPU thread, between two `KVM_RUN`s) writes `tool_name`/`tool_options`
//!    for [`REQ_SWITCH`], then `request`, then ORs the engine's attention bit
//!    `attention_bit` into the word at stolen offset `attention_offset` (so that guest
//!    code looping in the code cache leaves it at the next trace entry) and, if the vCPU
//!    is halted, makes it runnable.
//! 2. The engine checks `request` at every stop of its run loop. At the first one where
//!    no interrupt waits in its pending bitmap (a safe point: a trace boundary, the guest
//!    state precise), it takes the request (ORs [`REQ_TAKEN`] into `request`: from then
//!    on the VMM no longer withdraws it) and serves it: for the detaches, the tool's `finish`, its
//!    files and `counters.json` through the I/O ring; for [`REQ_DETACH_NATIVE`] the
//!    guest's complete state into the hand-back fields; it clears `request` and writes
//!    the request's code to [`crate::ports::DETACH_PORT`].
//! 3. The VMM, on that port write, drains the ring (the window's files land in the
//!    window's directory) and then, for [`REQ_DETACH_NATIVE`], loads the hand-back state
//!    into the vCPU and runs it natively.
//!
//! 4. A request not yet taken may be withdrawn by the VMM (it writes [`REQ_NONE`]): the
//!    engine then never sees it, and nothing changed.
//!
//! Invariant: the engine writes only `attention_offset`, `guest_insns`, `request` (to
//! take or clear it) and the hand-back fields; the VMM writes only `magic`, `request` and
//! the tool fields. Both sides use volatile accesses, and the VMM writes only while the
//! vCPU is stopped (the engine runs on it).

use crate::attach::{Msr, PendingEvents, Regs, SystemRegs, TOOL_NAME_BYTES, TOOL_OPTIONS_BYTES};

/// Offset of the control area in the stolen region (inside the attach slot, after the
/// attach block).
pub const CONTROL_OFFSET: u64 = crate::stolen::ATTACH_OFFSET + 0x6000;
/// `magic` of a valid area: "KPINCTRL".
pub const MAGIC: u64 = u64::from_le_bytes(*b"KPINCTRL");
/// Capacity of [`Control::msrs`].
pub const MAX_HANDBACK_MSRS: usize = 24;

/// No request.
pub const REQ_NONE: u32 = 0;
/// End the window and hand the guest back for native execution.
pub const REQ_DETACH_NATIVE: u32 = 1;
/// End the window and stay resident with no instrumentation (tool `null`, clean cache).
pub const REQ_DETACH_RESIDENT: u32 = 2;
/// Open a window on a resident engine: switch to `tool_name` with a clean cache.
pub const REQ_SWITCH: u32 = 3;
/// Set in `request` by the engine when it starts serving the request.
pub const REQ_TAKEN: u32 = 1 << 31;

/// The control area.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Control {
    /// [`MAGIC`] once the VMM set the area up.
    pub magic: u64,
    /// VMM → engine: a `REQ_*`; the engine sets it back to [`REQ_NONE`] when served.
    pub request: u32,
    /// The attention reason bit the VMM ORs in (written by the engine).
    pub attention_bit: u32,
    /// Engine → VMM: stolen-region offset of the translator's attention word (0 until
    /// the engine runs the guest).
    pub attention_offset: u64,
    /// Engine → VMM: guest instructions this engine instance executed so far (updated
    /// at every stop of its run loop).
    pub guest_insns: u64,
    /// VMM → engine, for [`REQ_SWITCH`]: the tool name, NUL-padded.
    pub tool_name: [u8; TOOL_NAME_BYTES],
    /// VMM → engine, for [`REQ_SWITCH`]: the tool options, NUL-padded.
    pub tool_options: [u8; TOOL_OPTIONS_BYTES],
    /// Hand-back: general registers, RIP and the guest's RFLAGS (virtual IF and IOPL).
    pub regs: Regs,
    /// Hand-back: segments with their caches, GDTR/IDTR, CR0/2/3/4, EFER (CR8 and
    /// APIC_BASE are the local APIC's, which the engine does not virtualise: the VMM
    /// keeps KVM's).
    pub sregs: SystemRegs,
    /// Hand-back: the interrupt shadow (`interrupt_shadow`); nothing else is pending at a
    /// safe point.
    pub events: PendingEvents,
    /// Number of valid [`Control::msrs`].
    pub msr_count: u32,
    /// Padding.
    pub pad: u32,
    /// Hand-back: the MSRs the engine virtualises (syscall MSRs, FS/GS/KERNEL_GS bases,
    /// SYSENTER, PAT, TSC_AUX).
    pub msrs: [Msr; MAX_HANDBACK_MSRS],
}

const _: () = assert!(
    CONTROL_OFFSET + core::mem::size_of::<Control>() as u64
        <= crate::stolen::ATTACH_OFFSET + crate::stolen::ATTACH_BYTES
);
const _: () = assert!(
    core::mem::size_of::<crate::attach::AttachBlock>() as u64
        <= CONTROL_OFFSET - crate::stolen::ATTACH_OFFSET
);

impl Control {
    /// A set-up area with no request.
    pub fn new() -> Self {
        Control {
            magic: MAGIC,
            request: REQ_NONE,
            attention_bit: 0,
            attention_offset: 0,
            guest_insns: 0,
            tool_name: [0; TOOL_NAME_BYTES],
            tool_options: [0; TOOL_OPTIONS_BYTES],
            regs: Regs::default(),
            sregs: SystemRegs::default(),
            events: PendingEvents::default(),
            msr_count: 0,
            pad: 0,
            msrs: [Msr::default(); MAX_HANDBACK_MSRS],
        }
    }

    /// Sets the tool name and options for [`REQ_SWITCH`]; `false` (nothing changed) if
    /// either does not fit.
    pub fn set_tool(&mut self, name: &[u8], options: &[u8]) -> bool {
        if name.len() > TOOL_NAME_BYTES || options.len() > TOOL_OPTIONS_BYTES {
            return false;
        }
        self.tool_name = [0; TOOL_NAME_BYTES];
        self.tool_name[..name.len()].copy_from_slice(name);
        self.tool_options = [0; TOOL_OPTIONS_BYTES];
        self.tool_options[..options.len()].copy_from_slice(options);
        true
    }

    /// The hand-back MSRs.
    pub fn handback_msrs(&self) -> &[Msr] {
        &self.msrs[..(self.msr_count as usize).min(MAX_HANDBACK_MSRS)]
    }
}

impl Default for Control {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_control_area_fits_after_the_block_and_sets_tools() {
        let mut c = Control::new();
        assert_eq!(c.magic, MAGIC);
        assert!(c.set_tool(b"bbcount", b"top=5"));
        assert_eq!(&c.tool_name[..8], b"bbcount\0");
        assert!(!c.set_tool(&[b'x'; TOOL_NAME_BYTES + 1], b""));
        assert_eq!(&c.tool_name[..7], b"bbcount", "unchanged on failure");
        c.msr_count = 99;
        assert_eq!(c.handback_msrs().len(), MAX_HANDBACK_MSRS);
    }
}
