//! The ring-0 gate from CPL 3 (protocol in `entry.rs`'s header): safe wrappers, one per
//! operation. Each call is one #GP round trip through the ring-0 stub.

use core::arch::asm;
use core::sync::atomic::{AtomicU64, Ordering};

use guest_engine::profile;

use crate::ring0::entry::kpin_gate;
use crate::ring0::layout::gate_op;

/// Profile slots (`guest_engine::profile`) of the gate's operations: port I/O by device
/// (each a round trip through ring 0 plus the VM exit to the VMM or KVM's in-kernel
/// device), the rest by operation.
pub mod slot {
    use guest_engine::profile::EMBEDDER;
    /// The first gate slot; the run loop's own slots are below it.
    pub const FIRST: usize = EMBEDDER + 8;
    /// NOP and unknown operations.
    pub const NOP: usize = FIRST;
    /// CR3 loads.
    pub const LOAD_CR3: usize = FIRST + 1;
    /// WRMSR.
    pub const WRMSR: usize = FIRST + 2;
    /// RDMSR and RDMSR_SAFE.
    pub const RDMSR: usize = FIRST + 3;
    /// INVLPG.
    pub const INVLPG: usize = FIRST + 4;
    /// HLT until an interrupt.
    pub const HLT: usize = FIRST + 5;
    /// CR4's SSE bits.
    pub const CR4_SSE: usize = FIRST + 6;
    /// Port I/O to the 8259 PICs (0x20-0x21, 0xa0-0xa1, ELCR 0x4d0-0x4d1).
    pub const PORT_PIC: usize = FIRST + 7;
    /// Port I/O to the PIT (0x40-0x43) and port 0x61.
    pub const PORT_PIT: usize = FIRST + 8;
    /// Port I/O to COM1 (0x3f8-0x3ff).
    pub const PORT_COM1: usize = FIRST + 9;
    /// The engine's own ports (doorbell, failure, attach status: 0xf10-0xf1f).
    pub const PORT_ENGINE: usize = FIRST + 10;
    /// Any other port.
    pub const PORT_OTHER: usize = FIRST + 11;
    /// One past the last gate slot.
    pub const END: usize = FIRST + 12;
    const _: () = assert!(END <= guest_engine::profile::SLOTS);

    /// The slot of port I/O to `port`.
    pub fn port(port: u16) -> usize {
        match port {
            0x20 | 0x21 | 0xa0 | 0xa1 | 0x4d0 | 0x4d1 => PORT_PIC,
            0x40..=0x43 | 0x61 => PORT_PIT,
            0x3f8..=0x3ff => PORT_COM1,
            0xf10..=0xf1f => PORT_ENGINE,
            _ => PORT_OTHER,
        }
    }

    /// The slot of gate operation `op` (port I/O: [`port`]).
    pub fn op(op: u64) -> usize {
        use crate::ring0::layout::gate_op as g;
        match op {
            g::LOAD_CR3 => LOAD_CR3,
            g::WRMSR => WRMSR,
            g::RDMSR | g::RDMSR_SAFE => RDMSR,
            g::INVLPG => INVLPG,
            g::HLT => HLT,
            g::CR4_SSE => CR4_SSE,
            _ => NOP,
        }
    }

    /// The name of gate slot `s`, `None` outside [`FIRST`]..[`END`].
    pub fn name(s: usize) -> Option<&'static str> {
        Some(match s {
            NOP => "gate: nop",
            LOAD_CR3 => "gate: load CR3",
            WRMSR => "gate: wrmsr",
            RDMSR => "gate: rdmsr",
            INVLPG => "gate: invlpg",
            HLT => "gate: hlt (waiting for an interrupt)",
            CR4_SSE => "gate: CR4 SSE bits",
            PORT_PIC => "gate+exit: port I/O, PIC",
            PORT_PIT => "gate+exit: port I/O, PIT/port 0x61",
            PORT_COM1 => "gate+exit: port I/O, COM1",
            PORT_ENGINE => "gate+exit: port I/O, engine doorbell",
            PORT_OTHER => "gate+exit: port I/O, other ports",
            _ => return None,
        })
    }
}

/// Gate round trips made (for the run's counters).
static CALLS: AtomicU64 = AtomicU64::new(0);

/// Gate round trips made so far.
pub fn calls() -> u64 {
    CALLS.load(Ordering::Relaxed)
}

/// One gate call: `op` with arguments `a` and `b`; returns RAX. Its time is charged to
/// the operation's profile slot.
#[inline(always)]
fn call(op: u64, a: u64, b: u64) -> u64 {
    call_as(slot::op(op), op, a, b)
}

/// [`call`] charged to profile slot `prof`.
#[inline(always)]
fn call_as(prof: usize, op: u64, a: u64, b: u64) -> u64 {
    let prev = profile::switch(prof);
    CALLS.fetch_add(1, Ordering::Relaxed);
    let ret: u64;
    // SAFETY: `kpin_gate` is the gate of entry.rs: it preserves every register but RAX
    // (result) and RDX, and the stack below RSP (the call pushes a return address; the
    // target has no red zone). Memory is treated as clobbered (CR3/MSR changes).
    unsafe {
        asm!(
            "call {gate}",
            gate = sym kpin_gate,
            inout("rax") op => ret,
            in("rdi") a,
            in("rsi") b,
            out("rdx") _,
        );
    }
    profile::switch(prev);
    ret
}

/// A round trip that does nothing.
pub fn nop() {
    call(gate_op::NOP, 0, 0);
}

/// `out port, value` (8 bits).
pub fn out8(port: u16, value: u8) {
    call_as(
        slot::port(port),
        gate_op::OUT8,
        u64::from(port),
        u64::from(value),
    );
}

/// `in port` (8 bits).
pub fn in8(port: u16) -> u8 {
    call_as(slot::port(port), gate_op::IN8, u64::from(port), 0) as u8
}

/// `out port, value` of `size` bytes (1, 2 or 4; the low bytes of `value`).
pub fn out(port: u16, size: u8, value: u32) {
    let op = match size {
        1 => gate_op::OUT8,
        2 => gate_op::OUT16,
        _ => gate_op::OUT32,
    };
    call_as(slot::port(port), op, u64::from(port), u64::from(value));
}

/// `in port` of `size` bytes (1, 2 or 4), zero-extended.
pub fn input(port: u16, size: u8) -> u32 {
    let op = match size {
        1 => gate_op::IN8,
        2 => gate_op::IN16,
        _ => gate_op::IN32,
    };
    call_as(slot::port(port), op, u64::from(port), 0) as u32
}

/// Loads CR3.
///
/// # Safety
/// `root` is a page-table root that maps the engine window, stacks and tables exactly as
/// the current one does.
pub unsafe fn load_cr3(root: u64) {
    call(gate_op::LOAD_CR3, root, 0);
}

/// Writes an MSR.
///
/// # Safety
/// Writing `index` with `value` does not break the engine (e.g. EFER, the APIC base).
pub unsafe fn wrmsr(index: u32, value: u64) {
    call(gate_op::WRMSR, u64::from(index), value);
}

/// Reads an MSR (an unknown index is a #GP at ring 0, reported as an engine fault).
pub fn rdmsr(index: u32) -> u64 {
    call(gate_op::RDMSR, u64::from(index), 0)
}

/// Reads an MSR, `None` if the `rdmsr` raised #GP (KVM does not have it).
pub fn rdmsr_safe(index: u32) -> Option<u64> {
    let prev = profile::switch(slot::RDMSR);
    CALLS.fetch_add(1, Ordering::Relaxed);
    let value: u64;
    let failed: u64;
    // SAFETY: as in `call`; this operation also returns RDX (0 = read, 1 = #GP).
    unsafe {
        asm!(
            "call {gate}",
            gate = sym kpin_gate,
            inout("rax") gate_op::RDMSR_SAFE => value,
            in("rdi") u64::from(index),
            in("rsi") 0u64,
            out("rdx") failed,
        );
    }
    profile::switch(prev);
    (failed == 0).then_some(value)
}

/// Invalidates the TLB entry for `va`.
pub fn invlpg(va: u64) {
    call(gate_op::INVLPG, va, 0);
}

/// Sets CR4.OSFXSR/OSXMMEXCPT to those bits of `bits` (the guest's SSE enables).
pub fn cr4_sse(bits: u64) {
    call(
        gate_op::CR4_SSE,
        bits & crate::ring0::layout::CR4_SSE_BITS,
        0,
    );
}

/// Halts until an interrupt has been handled (with IF enabled for the halt).
pub fn hlt() {
    call(gate_op::HLT, 0, 0);
}

/// Calls an operation number the stub does not know; returns what the stub answered.
pub fn unknown(op: u64) -> u64 {
    call(op, 0, 0)
}
