//! The ring-0 gate from CPL 3 (protocol in `entry.rs`'s header): safe wrappers, one per
//! operation. Each call is one #GP round trip through the ring-0 stub.

use core::arch::asm;
use core::sync::atomic::{AtomicU64, Ordering};

use crate::ring0::entry::kpin_gate;
use crate::ring0::layout::gate_op;

/// Gate round trips made (for the run's counters).
static CALLS: AtomicU64 = AtomicU64::new(0);

/// Gate round trips made so far.
pub fn calls() -> u64 {
    CALLS.load(Ordering::Relaxed)
}

/// One gate call: `op` with arguments `a` and `b`; returns RAX.
#[inline(always)]
fn call(op: u64, a: u64, b: u64) -> u64 {
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
    ret
}

/// A round trip that does nothing.
pub fn nop() {
    call(gate_op::NOP, 0, 0);
}

/// `out port, value` (8 bits).
pub fn out8(port: u16, value: u8) {
    call(gate_op::OUT8, u64::from(port), u64::from(value));
}

/// `in port` (8 bits).
pub fn in8(port: u16) -> u8 {
    call(gate_op::IN8, u64::from(port), 0) as u8
}

/// `out port, value` of `size` bytes (1, 2 or 4; the low bytes of `value`).
pub fn out(port: u16, size: u8, value: u32) {
    let op = match size {
        1 => gate_op::OUT8,
        2 => gate_op::OUT16,
        _ => gate_op::OUT32,
    };
    call(op, u64::from(port), u64::from(value));
}

/// `in port` of `size` bytes (1, 2 or 4), zero-extended.
pub fn input(port: u16, size: u8) -> u32 {
    let op = match size {
        1 => gate_op::IN8,
        2 => gate_op::IN16,
        _ => gate_op::IN32,
    };
    call(op, u64::from(port), 0) as u32
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
