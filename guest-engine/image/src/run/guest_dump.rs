//! The virtual guest's state, logged when the engine gives up on a run: what a developer
//! needs to see where the *guest* was and how it got there (the VMM's own dump shows the engine's vCPU, which
//! at a failure is inside the engine, not the guest). The lines go to `engine.log`; the
//! VMM appends that log's tail to `dump.txt`.

use core::fmt::Write;

use guest_engine::{Engine, Gpr};
use iced_x86::{Decoder, DecoderOptions};

use crate::log;
use crate::mm::guest_memory::{ShadowedMemory, MODE_KERNEL};
use crate::run::vcpu::Vcpu;

/// Guest bytes shown before and after RIP.
const BYTES_AROUND_RIP: u64 = 16;

/// Logs the guest's registers, system state and the code at RIP.
pub fn log_guest_state(engine: &Engine, vcpu: &Vcpu<'_>, mem: &ShadowedMemory<'_>) {
    let r = engine.regs();
    let rip = engine.rip().0;
    log!(
        Error,
        "guest state: RIP {rip:#018x} RFLAGS {:#010x} (virtual IF {})",
        r.rflags,
        u8::from(vcpu.vif)
    );
    let names = [
        ("RAX", Gpr::Rax),
        ("RBX", Gpr::Rbx),
        ("RCX", Gpr::Rcx),
        ("RDX", Gpr::Rdx),
        ("RSI", Gpr::Rsi),
        ("RDI", Gpr::Rdi),
        ("RBP", Gpr::Rbp),
        ("RSP", Gpr::Rsp),
        ("R8", Gpr::R8),
        ("R9", Gpr::R9),
        ("R10", Gpr::R10),
        ("R11", Gpr::R11),
        ("R12", Gpr::R12),
        ("R13", Gpr::R13),
        ("R14", Gpr::R14),
        ("R15", Gpr::R15),
    ];
    for row in names.chunks(4) {
        let mut line = alloc::string::String::from("guest state:");
        for (name, g) in row {
            let _ = write!(line, " {name:>3} {:#018x}", r.get(*g));
        }
        log!(Error, "{line}");
    }
    let s = &vcpu.segs;
    let mut line = alloc::string::String::from("guest state:");
    for (name, seg) in ["ES", "CS", "SS", "DS", "FS", "GS"]
        .iter()
        .zip(s.sregs.iter())
    {
        let _ = write!(line, " {name} {:#06x}", seg.selector);
    }
    let _ = write!(
        line,
        " (CPL {}) FS.base {:#x} GS.base {:#x} TR {:#06x}",
        s.cpl(),
        s.sregs[4].base,
        s.sregs[5].base,
        s.tr.selector
    );
    log!(Error, "{line}");
    log!(
        Error,
        "guest state: CR3 {:#x} GDTR {:#x}/{:#x} IDTR {:#x}/{:#x}",
        vcpu.cr3(),
        vcpu.gdtr.base,
        vcpu.gdtr.limit,
        vcpu.idtr.base,
        vcpu.idtr.limit
    );
    log_code_at(rip, mem);
    log_recent_traces(engine);
}

/// Logs the guest bytes around `rip` (`??` where the guest cannot read them) and the
/// instruction there, or why it cannot be read.
fn log_code_at(rip: u64, mem: &ShadowedMemory<'_>) {
    let start = rip.saturating_sub(BYTES_AROUND_RIP);
    let mut bytes = [0u8; 2 * BYTES_AROUND_RIP as usize];
    let mut line = alloc::string::String::new();
    // Bytes readable from RIP on without a gap (the instruction's bytes).
    let mut at_rip = 0;
    for (i, b) in bytes.iter_mut().enumerate() {
        let va = start + i as u64;
        let ok = mem.read_virt(va, MODE_KERNEL, core::slice::from_mut(b));
        let mark = if va == rip { " >" } else { " " };
        if ok {
            let _ = write!(line, "{mark}{b:02x}");
        } else {
            let _ = write!(line, "{mark}??");
        }
        if ok && va == rip + at_rip as u64 {
            at_rip += 1;
        }
    }
    log!(Error, "guest state: code at {start:#x}:{line}");
    if at_rip == 0 {
        log!(
            Error,
            "guest state: RIP is not readable through the guest's page tables"
        );
        return;
    }
    let from = (rip - start) as usize;
    let mut d = Decoder::with_ip(64, &bytes[from..from + at_rip], rip, DecoderOptions::NONE);
    let i = d.decode();
    log!(
        Error,
        "guest state: instruction at RIP: {:?} ({} bytes)",
        i.mnemonic(),
        i.len()
    );
}

/// Logs the traces the dispatcher entered last, oldest first, four to a line (links and
/// lookup-table hits inside the cache are not seen: each entry is where the guest came
/// back to the dispatcher).
fn log_recent_traces(engine: &Engine) {
    let traces: alloc::vec::Vec<_> = engine.recent_traces().collect();
    log!(
        Error,
        "guest state: last {} traces entered from the dispatcher (oldest first; VA/CPL):",
        traces.len()
    );
    for row in traces.chunks(4) {
        let mut line = alloc::string::String::from("guest state:  ");
        for (va, mode) in row {
            let _ = write!(line, " {:#018x}/{}", va.0, mode.0);
        }
        log!(Error, "{line}");
    }
}
