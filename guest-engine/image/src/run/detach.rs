//! The engine's side of `kpin detach` and of `kpin attach` on a resident engine: the
//! requests of the attach control area (`kpin_abi::attach_control`), served by the run
//! loop at a safe point.
//!
//! A safe point is the top of the run loop (a trace boundary: the engine's registers and
//! RIP are exactly the guest's, nothing of an instruction half done) with no interrupt
//! waiting in the pending bitmap — one the ring-0 stubs took from the local APIC but the
//! guest has not been given yet could not be handed back. Until then the request waits;
//! every stop checks it again.
//!
//! - [`REQ_DETACH_NATIVE`]: the report (`counters.json`, the tool's `finish` and files),
//!   the guest's state into the hand-back fields, the ring flushed, then the ack port; the
//!   VMM loads the state into the vCPU and this engine instance is gone.
//! - [`REQ_DETACH_RESIDENT`]: the report, then tool `null` and a flushed code cache.
//! - [`REQ_SWITCH`]: the log flushed and the ack (the VMM moves the output directory to
//!   the new window's), then the new tool and a flushed code cache.
//!
//! FPU/SSE/AVX state needs no hand-back: the engine image is soft-float and never
//! touches vector or x87 registers, so the hardware's are the guest's throughout.

use core::cell::RefCell;

use guest_engine::attention::reason;
use guest_engine::vcpu::uart_status;
use guest_engine::Engine;
use kpin_abi::attach::{Msr, PendingEvents, Regs, SystemRegs};
use kpin_abi::attach_control::{
    Control, CONTROL_OFFSET, MAGIC, MAX_HANDBACK_MSRS, REQ_DETACH_NATIVE, REQ_DETACH_RESIDENT,
    REQ_NONE, REQ_SWITCH, REQ_TAKEN,
};
use kpin_abi::ports::DETACH_PORT;
use kpin_abi::stolen::WINDOW_VA;
use kpin_abi::x86::msr;

use crate::events::irq;
use crate::log;
use crate::mm::guest_memory::{MODE_KERNEL, MODE_USER};
use crate::mm::shadow::Shadow;
use crate::ring0::{gate, log};
use crate::run::tools::Chosen;
use crate::run::vcpu::Vcpu;

/// The attention reason the VMM sets for a request.
const ATTENTION: u8 = reason::REQUEST;

fn area() -> *mut Control {
    (WINDOW_VA + CONTROL_OFFSET) as *mut Control
}

/// Whether the VMM set the area up (a VMM without control channel leaves it zero).
fn present() -> bool {
    // SAFETY: the control area lies in the attach slot of the stolen region, mapped
    // present and writable at WINDOW_VA for the engine's lifetime; only volatile
    // accesses to its fields, and the VMM writes it only while the vCPU is stopped.
    unsafe { core::ptr::read_volatile(&raw const (*area()).magic) == MAGIC }
}

/// The pending request, if any.
pub fn requested() -> u32 {
    if !present() {
        return REQ_NONE;
    }
    // SAFETY: as in `present`.
    unsafe { core::ptr::read_volatile(&raw const (*area()).request) }
}

/// Publishes where the attention word is, so the VMM can stop guest code that loops in
/// the cache.
pub fn publish(engine: &Engine) {
    if !present() {
        return;
    }
    let offset = engine.attention_handle().address() - WINDOW_VA;
    // SAFETY: as in `present`.
    unsafe {
        core::ptr::write_volatile(&raw mut (*area()).attention_bit, u32::from(ATTENTION));
        core::ptr::write_volatile(&raw mut (*area()).attention_offset, offset);
    }
}

/// Updates the live instruction count `kpin status` shows.
pub fn note_progress(engine: &Engine) {
    if !present() {
        return;
    }
    let n = engine
        .executed_insns(MODE_KERNEL)
        .wrapping_add(engine.executed_insns(MODE_USER));
    // SAFETY: as in `present`.
    unsafe { core::ptr::write_volatile(&raw mut (*area()).guest_insns, n) };
}

/// For `Hardware::control_requested`: a request is pending (the attention bit is set
/// again, so that the `hlt` the guest re-executes leaves the cache at once).
pub fn wants_loop(engine_attention: u64) -> bool {
    if requested() == REQ_NONE {
        return false;
    }
    if engine_attention != 0 {
        // SAFETY: the live engine's attention word (see `irq::hand_over`); the stubs
        // only OR bits into its low byte, as this does.
        unsafe {
            let p = engine_attention as *mut u64;
            core::ptr::write_volatile(p, core::ptr::read_volatile(p) | u64::from(ATTENTION));
        }
    }
    true
}

/// Writes a window's report (`run::report` with the run's cycle count).
pub type Report<'a> = dyn FnMut(&Engine, &Vcpu<'_>, &RefCell<Shadow>, &mut Chosen) + 'a;

/// Serves a pending request if this is a safe point. `report` writes the window's
/// report (counters, the tool's files). Never returns after a native detach; otherwise
/// the run continues with `tool`.
pub fn serve(
    engine: &mut Engine,
    vcpu: &Vcpu<'_>,
    shadow: &RefCell<Shadow>,
    tool: &mut Chosen,
    report: &mut Report<'_>,
) {
    let req = requested();
    if req == REQ_NONE || irq::highest().is_some() {
        return;
    }
    // From here on the VMM no longer withdraws the request.
    // SAFETY: as in `present`.
    unsafe { core::ptr::write_volatile(&raw mut (*area()).request, req | REQ_TAKEN) };
    match req {
        REQ_DETACH_NATIVE => {
            report(engine, vcpu, shadow, tool);
            // The guest goes on natively with the UART: it must hold the guest's IER.
            if let Some(ier) = vcpu.hw.com1.unsent_ier() {
                gate::out(uart_status::IER, 1, u32::from(ier));
            }
            // And the PCI model the guest's address register (`vcpu::pci_config`).
            if let Some(latch) = vcpu.hw.pci.unsent_latch() {
                gate::out(kpin_abi::pci::ADDRESS_PORT, 4, latch);
            }
            hand_back(engine, vcpu);
            log!(
                Info,
                "engine: detaching at guest RIP {:#x}: the guest continues natively",
                engine.rip().0
            );
            ack(req);
            // The VMM replaced this vCPU state; reaching here means it did not.
            log!(Error, "engine: the VMM did not take the guest back");
            log::fail();
        }
        REQ_DETACH_RESIDENT => {
            report(engine, vcpu, shadow, tool);
            *tool = Chosen::resident();
            engine.reset_for_new_tool();
            log!(
                Info,
                "engine: window closed at guest RIP {:#x}: resident, no instrumentation",
                engine.rip().0
            );
            ack(req);
        }
        REQ_SWITCH => {
            // SAFETY: as in `present`; the VMM wrote the tool fields before the request.
            let c = unsafe { core::ptr::read_volatile(area()) };
            let name = trim(&c.tool_name);
            let options = core::str::from_utf8(trim(&c.tool_options)).unwrap_or("");
            let name = core::str::from_utf8(name).unwrap_or("");
            // The VMM moves the output directory on the ack: the new tool's files and
            // log lines go to the new window.
            ack(req);
            match Chosen::by_name(name, options) {
                Some(t) => *tool = t,
                None => {
                    log!(Error, "engine: unknown tool {name:?} to switch to");
                    log::fail();
                }
            }
            engine.reset_for_new_tool();
            log!(
                Info,
                "engine: window opened at guest RIP {:#x} with tool {name} (code cache flushed)",
                engine.rip().0
            );
        }
        other => {
            log!(Error, "engine: unknown control request {other}");
            log::fail();
        }
    }
}

/// Clears the request, flushes the ring and tells the VMM.
fn ack(req: u32) {
    // SAFETY: as in `present`.
    unsafe { core::ptr::write_volatile(&raw mut (*area()).request, REQ_NONE) };
    log::flush();
    gate::out(DETACH_PORT, 1, req);
}

fn trim(b: &[u8]) -> &[u8] {
    &b[..b.iter().position(|&c| c == 0).unwrap_or(b.len())]
}

/// Writes the guest's complete architectural state into the hand-back fields.
fn hand_back(engine: &Engine, vcpu: &Vcpu<'_>) {
    let g = &engine.regs().gpr;
    let regs = Regs {
        rax: g[0],
        rcx: g[1],
        rdx: g[2],
        rbx: g[3],
        rsp: g[4],
        rbp: g[5],
        rsi: g[6],
        rdi: g[7],
        r8: g[8],
        r9: g[9],
        r10: g[10],
        r11: g[11],
        r12: g[12],
        r13: g[13],
        r14: g[14],
        r15: g[15],
        rip: engine.rip().0,
        rflags: vcpu.rflags_image(engine.regs().rflags),
    };
    let s = &vcpu.segs.sregs;
    let sregs = SystemRegs {
        es: s[0],
        cs: s[1],
        ss: s[2],
        ds: s[3],
        fs: s[4],
        gs: s[5],
        tr: vcpu.segs.tr,
        ldt: vcpu.segs.ldtr,
        gdt: vcpu.gdtr,
        idt: vcpu.idtr,
        cr0: vcpu.cr0,
        cr2: vcpu.cr2,
        cr3: vcpu.cr3(),
        cr4: vcpu.cr4,
        cr8: 0,
        efer: vcpu.msrs.efer,
        apic_base: 0,
    };
    let m = &vcpu.msrs;
    let list = [
        (msr::STAR, m.star),
        (msr::LSTAR, m.lstar),
        (msr::CSTAR, m.cstar),
        (msr::SFMASK, m.sfmask),
        (msr::FS_BASE, s[4].base),
        (msr::GS_BASE, s[5].base),
        (msr::KERNEL_GS_BASE, m.kernel_gs_base),
        (msr::SYSENTER_CS, m.sysenter[0]),
        (msr::SYSENTER_ESP, m.sysenter[1]),
        (msr::SYSENTER_EIP, m.sysenter[2]),
        (msr::PAT, m.pat),
        (msr::TSC_AUX, m.tsc_aux),
    ];
    let mut msrs = [Msr::default(); MAX_HANDBACK_MSRS];
    for (slot, (index, value)) in msrs.iter_mut().zip(list) {
        *slot = Msr {
            index,
            pad: 0,
            value,
        };
    }
    // SAFETY: as in `present`; the VMM reads these only after the ack port.
    unsafe {
        let a = area();
        core::ptr::write_volatile(&raw mut (*a).regs, regs);
        core::ptr::write_volatile(&raw mut (*a).sregs, sregs);
        core::ptr::write_volatile(&raw mut (*a).events, PendingEvents::default());
        core::ptr::write_volatile(&raw mut (*a).msrs, msrs);
        core::ptr::write_volatile(&raw mut (*a).msr_count, list.len() as u32);
    }
}
