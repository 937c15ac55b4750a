//! Reporting an unexpected exception in the engine (entered at CPL 3 from the ring-0
//! trap path in `entry.rs`, with interrupts off, on its own stack) and panics.

use core::arch::asm;
use core::sync::atomic::{AtomicBool, Ordering};

use crate::log;
use crate::ring0::entry::{FaultRecord, FAULT, GPR_NAMES};
use crate::ring0::layout::{VEC_DF, VEC_PF};
use crate::ring0::log::fail;

/// Mnemonics of the exception vectors.
const NAMES: [&str; 32] = [
    "#DE", "#DB", "NMI", "#BP", "#OF", "#BR", "#UD", "#NM", "#DF", "CSO", "#TS", "#NP", "#SS",
    "#GP", "#PF", "RES15", "#MF", "#AC", "#MC", "#XM", "#VE", "#CP", "RES22", "RES23", "RES24",
    "RES25", "RES26", "RES27", "#HV", "#VC", "#SX", "RES31",
];

/// The mnemonic of exception `vector` (`#PF`), or `?`.
pub fn vector_name(vector: u64) -> &'static str {
    NAMES.get(vector as usize).copied().unwrap_or("?")
}

/// Set by `bringup.crash=nested`: the reporter faults before reporting.
static FAULT_WHILE_REPORTING: AtomicBool = AtomicBool::new(false);

/// Makes the next fault report fault itself (tests the nested path of `entry.rs`).
pub fn fault_while_reporting() {
    FAULT_WHILE_REPORTING.store(true, Ordering::Relaxed);
}

/// Entered from `kpin_trap_common` (never called); logs the fault record and fails.
pub extern "C" fn kpin_fault_report() -> ! {
    if FAULT_WHILE_REPORTING.load(Ordering::Relaxed) {
        // SAFETY: a deliberate #UD; the trap path sees a report in progress and ends the
        // run through the failure port from ring 0.
        unsafe { asm!("ud2") };
    }
    // SAFETY: the ring-0 trap path finished writing the record before `iretq`ing here,
    // and nothing writes it again (a second fault takes the nested path).
    let f: FaultRecord = unsafe { core::ptr::read_volatile(FAULT.0.get()) };
    let name = NAMES.get(f.vector as usize).copied().unwrap_or("?");
    if let Some(why) = crate::ring0::gate::refusal() {
        log!(
            Error,
            "engine: the gate refused a call: {why}; operation RAX={:#x}, RDI={:#x}, RSI={:#x}, caller RSP {:#x}",
            f.gprs[0],
            f.gprs[5],
            f.gprs[4],
            f.rsp
        );
    }
    log!(
        Error,
        "engine: unexpected exception {name} (vector {}) in the engine: error code {:#x}, RIP {:#x}, CS {:#x} (CPL {}), RFLAGS {:#x}, RSP {:#x}, SS {:#x}, CR2 {:#x}",
        f.vector,
        f.error,
        f.rip,
        f.cs,
        f.cs & 3,
        f.rflags,
        f.rsp,
        f.ss,
        f.cr2
    );
    if f.vector == u64::from(VEC_PF) {
        log!(
            Error,
            "engine: #PF at {:#x}: {} {} access from CPL {}{}",
            f.cr2,
            if f.error & 1 != 0 {
                "protection violation on a"
            } else {
                "not-present page on a"
            },
            if f.error & 2 != 0 {
                "write"
            } else if f.error & 16 != 0 {
                "fetch"
            } else {
                "read"
            },
            if f.error & 4 != 0 { 3 } else { 0 },
            if f.error & 8 != 0 {
                " (reserved bit set)"
            } else {
                ""
            },
        );
    }
    if f.vector == u64::from(VEC_DF) {
        log!(Error, "engine: #DF taken on its IST stack (IST1)");
    }
    for (i, chunk) in GPR_NAMES.chunks(5).enumerate() {
        let mut line = [0u64; 5];
        for (j, v) in line.iter_mut().enumerate().take(chunk.len()) {
            *v = f.gprs[i * 5 + j];
        }
        log!(
            Error,
            "engine:   {}={:#018x} {}={:#018x} {}={:#018x} {}={:#018x} {}={:#018x}",
            chunk[0],
            line[0],
            chunk[1],
            line[1],
            chunk[2],
            line[2],
            chunk[3],
            line[3],
            chunk[4],
            line[4]
        );
    }
    fail()
}

/// The panic handler's work: log and fail. At ring 0 (a panic in `ring0_setup`) the gate
/// cannot be used, so the failure port is written directly.
pub fn panic(info: &core::panic::PanicInfo<'_>) -> ! {
    let cs: u16;
    // SAFETY: reading CS has no side effects.
    unsafe { asm!("mov {0:x}, cs", out(reg) cs, options(nomem, nostack, preserves_flags)) };
    if cs & 3 == 0 {
        // SAFETY: at ring 0 `out` is allowed; the VMM ends the run on this port.
        unsafe {
            asm!("out dx, al", in("dx") kpin_abi::ports::ENGINE_FAILURE_PORT, in("al") crate::ring0::layout::fail_code::RING0_PANIC, options(nostack));
        }
        loop {
            core::hint::spin_loop();
        }
    }
    log!(Error, "engine: panic: {info}");
    fail()
}
