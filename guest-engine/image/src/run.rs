//! Running the guest from the code cache: after bring-up, the engine creates the
//! translator (`guest_engine::Engine`) over the code-cache region of the stolen region,
//! loads the guest's registers from the attach block, maps guest data through the
//! slot-0 stand-in (`guest_alias`, until the shadow MMU is wired in) and runs the guest
//! at hardware CPL 3 under the chosen tool until it stops.
//!
//! How a run ends: a guest i8042 reset (`out 0x64, 0xfe`) — the engine first writes its
//! final report (statistics, the tool's output files), then performs the `out` through
//! the gate, and the VMM ends the run as a clean poweroff; anything the virtual CPU does
//! not emulate, a fetch the guest's page tables do not allow, or an engine error — a log
//! line naming it and the guest RIP, the report, then the failure port (exit status 3).

use alloc::string::String;
use core::cell::Cell;
use core::fmt::Write;

use guest_engine::{Config, Engine, GuestVirt, Stop};
use kpin_abi::attach::AttachBlock;
use kpin_abi::stolen::{CODE_CACHE_BYTES, CODE_CACHE_OFFSET, LAYOUT_BYTES, WINDOW_VA};

use crate::deliver::{self, Event, Kind};
use crate::guest_alias;
use crate::guest_mem::{PhysmapMemory, MODE_KERNEL};
use crate::log::fail;
use crate::tools::Chosen;
use crate::vcpu::Vcpu;
use crate::{entry, gate, heap, irq, log, timer};

/// CR0.PG, EFER.LMA: the guest must be in 64-bit long mode (all the translator knows).
const CR0_PG: u64 = 1 << 31;
const EFER_LMA: u64 = 1 << 10;

/// Runs the guest described by `block` under tool `tool_name`; never returns.
pub fn run_guest(block: &AttachBlock, tool_name: &str) -> ! {
    let Some(mut tool) = Chosen::by_name(tool_name) else {
        log!(
            Error,
            "engine: unknown tool {tool_name:?} (this engine has: null, bbcount)"
        );
        fail();
    };
    if block.stolen_bytes < LAYOUT_BYTES {
        log!(
            Error,
            "engine: the stolen region has {} bytes; the engine's layout needs {LAYOUT_BYTES}",
            block.stolen_bytes
        );
        fail();
    }
    let s = &block.sregs;
    if s.cr0 & CR0_PG == 0 || s.efer & EFER_LMA == 0 || s.cs.l != 1 {
        log!(
            Error,
            "engine: the guest is not in 64-bit long mode (CR0={:#x} EFER={:#x} CS.L={}); only 64-bit guest code is translated",
            s.cr0,
            s.efer,
            s.cs.l
        );
        fail();
    }
    if s.cs.dpl != 0 {
        log!(
            Error,
            "engine: the guest is at CPL {}; only CPL-0 guest code is run so far",
            s.cs.dpl
        );
        fail();
    }
    let cr3 = Cell::new(s.cr3);
    let alias = guest_alias::map_slot0(block, cr3.get());
    log!(
        Info,
        "engine: guest data: STAND-IN for the shadow MMU: the guest's PML4 slot 0 copied into the engine's root as {} user-accessible 2 MiB pages ({} writable); {} guest 2 MiB ranges with 4 KiB pages and {} refused leaves NOT mapped",
        alias.pages,
        alias.writable,
        alias.small_ranges,
        alias.refused
    );
    let config = Config {
        // The image is soft-float (no SSE in engine code): guest vector state stays in
        // the registers across exits, and analysis routines leave it alone.
        save_extended_state: false,
        analysis_preserves_vector_state: true,
        mode: MODE_KERNEL,
        ..Config::default()
    };
    // SAFETY: the code-cache region lies in the stolen region, which the window maps
    // present, writable, user and executable (no NX) in 2 MiB pages; nothing else uses
    // it (see `kpin_abi::stolen`); 32 MiB < 2 GiB; 2 MiB aligned.
    let engine = unsafe {
        Engine::new(
            (WINDOW_VA + CODE_CACHE_OFFSET) as *mut u8,
            CODE_CACHE_BYTES as usize,
            config,
        )
    };
    let mut engine = match engine {
        Ok(e) => e,
        Err(e) => {
            log!(Error, "engine: creating the translator failed: {e}");
            fail();
        }
    };
    let r = &block.regs;
    let regs = engine.regs_mut();
    regs.gpr = [
        r.rax, r.rcx, r.rdx, r.rbx, r.rsp, r.rbp, r.rsi, r.rdi, r.r8, r.r9, r.r10, r.r11, r.r12,
        r.r13, r.r14, r.r15,
    ];
    regs.rflags = r.rflags;
    engine.set_rip(GuestVirt(r.rip));
    log!(
        Info,
        "engine: running the guest from {:#x} under tool {tool_name} (code cache {} MiB at {:#x})",
        r.rip,
        CODE_CACHE_BYTES >> 20,
        WINDOW_VA + CODE_CACHE_OFFSET
    );
    log::flush();

    arm_fault_redirect(&engine);
    let mut mem = PhysmapMemory::new(block, &cr3);
    let mut vcpu = Vcpu::new(block, &cr3);
    let t0 = timer::tsc();
    irq::hand_over(&engine);
    loop {
        // TODO(merge): engine.set_mode(vcpu.mode) — the one place the translation mode
        // follows the virtual CPL (traces are keyed by it).
        let stop = engine.run(&mut mem, &mut vcpu, tool.as_tool());
        let cycles = timer::tsc().wrapping_sub(t0);
        match stop {
            Stop::Sensitive(insn) if vcpu.final_write.is_some() => {
                let Some((port, value)) = vcpu.final_write.take() else {
                    continue;
                };
                report(&engine, &vcpu, &tool, cycles);
                log!(
                    Info,
                    "engine: guest RIP {:#x} writes {value:#x} to port {port:#x} (i8042 reset): passing it on",
                    insn.pc.0
                );
                log::flush();
                gate::out8(port, value);
                // The VMM normally ends the run here; if not, the guest continues.
                engine.set_rip(GuestVirt(insn.pc.0 + u64::from(insn.len)));
            }
            Stop::Sensitive(insn) if vcpu.triple.is_some() => {
                if let Some(t) = vcpu.triple {
                    log!(
                        Error,
                        "engine: the guest triple-faulted at RIP {:#x}: {} (vector {}, error code {:#x}) while delivering #DF",
                        insn.pc.0,
                        crate::fault::vector_name(u64::from(t.last.vector)),
                        t.last.vector,
                        t.last.error.unwrap_or(0)
                    );
                }
                report(&engine, &vcpu, &tool, cycles);
                fail();
            }
            Stop::Sensitive(insn) => {
                let mut text = String::new();
                match vcpu.unsupported {
                    Some(u) => {
                        let name = u.mnemonic.map_or(String::from("(undecodable)"), |m| {
                            let mut n = String::new();
                            let _ = write!(n, "{m:?}");
                            n.to_ascii_lowercase()
                        });
                        let _ = write!(
                            text,
                            "unsupported sensitive instruction `{name}` ({:?}) at guest RIP {:#x}: {}; bytes",
                            insn.kind, insn.pc.0, u.why
                        );
                    }
                    None => {
                        let _ = write!(
                            text,
                            "sensitive instruction ({:?}) at guest RIP {:#x} stopped the run; bytes",
                            insn.kind, insn.pc.0
                        );
                    }
                }
                for b in &insn.bytes[..usize::from(insn.len).min(insn.bytes.len())] {
                    let _ = write!(text, " {b:02x}");
                }
                log!(Error, "engine: {text}");
                report(&engine, &vcpu, &tool, cycles);
                fail();
            }
            Stop::Fault { guest_pc, .. } => {
                // SAFETY: written by the ring-0 trap path before it redirected the fault
                // to the exit routine, which ran before `run` returned.
                let (vector, error, cr2) = unsafe {
                    (
                        core::ptr::read_volatile(&raw const entry::kpin_cache_fault_vector),
                        core::ptr::read_volatile(&raw const entry::kpin_cache_fault_error),
                        core::ptr::read_volatile(&raw const entry::kpin_cache_fault_cr2),
                    )
                };
                let ev = exception_from_cache(&mut vcpu, vector as u8, error as u32, cr2);
                deliver_or_fail(&mut engine, &mut vcpu, &tool, cycles, guest_pc.0, ev);
            }
            Stop::FetchFault(va) => {
                // The fetch faults at the target: #PF with I/D set, RIP = CR2 = the target.
                vcpu.cr2 = va.0;
                let user = if vcpu.cpl() == 3 { PF_USER } else { 0 };
                let present = u32::from(vcpu.mem().walk(va.0, MODE_KERNEL).is_some());
                let ev = Event::fault(deliver::PF, PF_FETCH | user | present);
                deliver_or_fail(&mut engine, &mut vcpu, &tool, cycles, va.0, ev);
            }
            Stop::Attention(va) => {
                // State is precise at `va`. Only interrupts set attention so far.
                engine.set_attention(0);
                match vcpu.deliver_pending(engine.regs_mut(), va.0) {
                    Ok(Some(handler)) => engine.set_rip(GuestVirt(handler)),
                    Ok(None) => engine.set_rip(va),
                    Err(t) => {
                        vcpu.triple = Some(t);
                        log!(
                            Error,
                            "engine: the guest triple-faulted delivering an interrupt at RIP {:#x}",
                            va.0
                        );
                        report(&engine, &vcpu, &tool, cycles);
                        fail();
                    }
                }
            }
            other => {
                log!(
                    Error,
                    "engine: the run stopped at guest RIP {:#x}: {other:?}",
                    engine.rip().0
                );
                report(&engine, &vcpu, &tool, cycles);
                fail();
            }
        }
    }
}

/// #PF error code bits the engine sets itself.
const PF_USER: u32 = 1 << 2;
const PF_FETCH: u32 = 1 << 4;

/// The guest exception for a fault the hardware raised in translated code (seen at CPL 3:
/// a #PF's U bit is replaced by the virtual CPL's; CR2 becomes the guest's).
fn exception_from_cache(vcpu: &mut Vcpu<'_>, vector: u8, error: u32, cr2: u64) -> Event {
    let has_error = matches!(vector, 8 | 10..=14 | 17 | 21 | 29 | 30);
    let error = if vector == deliver::PF {
        vcpu.cr2 = cr2;
        (error & !PF_USER) | if vcpu.cpl() == 3 { PF_USER } else { 0 }
    } else {
        error
    };
    Event {
        vector,
        error: has_error.then_some(error),
        kind: Kind::Exception,
    }
}

/// Delivers `ev` at `rip` and continues at the handler; a triple fault ends the run.
fn deliver_or_fail(
    engine: &mut Engine,
    vcpu: &mut Vcpu<'_>,
    tool: &Chosen,
    cycles: u64,
    rip: u64,
    ev: Event,
) {
    match vcpu.deliver(engine.regs_mut(), rip, ev) {
        Ok(handler) => engine.set_rip(GuestVirt(handler)),
        Err(t) => {
            log!(
                Error,
                "engine: the guest triple-faulted: {} (vector {}) at RIP {rip:#x}, then {} (vector {}, error code {:#x}) while delivering #DF",
                crate::fault::vector_name(u64::from(ev.vector)),
                ev.vector,
                crate::fault::vector_name(u64::from(t.last.vector)),
                t.last.vector,
                t.last.error.unwrap_or(0)
            );
            report(engine, vcpu, tool, cycles);
            fail();
        }
    }
}

/// Tells the ring-0 trap path where the code cache is, so that a fault in translated
/// code becomes a FAULT exit of the cache instead of an engine fault report.
fn arm_fault_redirect(engine: &Engine) {
    let r = engine.fault_redirect();
    // SAFETY: plain stores to the trap path's parameters; it reads them only on a fault,
    // and `kpin_cache_len` (stored last) stays 0 — redirect off — until the rest is set.
    unsafe {
        core::ptr::write_volatile(&raw mut entry::kpin_cache_fault_pc_at, r.fault_pc);
        core::ptr::write_volatile(&raw mut entry::kpin_cache_exit_word_at, r.exit_word_at);
        core::ptr::write_volatile(&raw mut entry::kpin_cache_exit_word, r.exit_word);
        core::ptr::write_volatile(&raw mut entry::kpin_cache_exit_routine, r.exit_routine);
        core::ptr::write_volatile(&raw mut entry::kpin_cache_lo, r.region.0);
        core::ptr::write_volatile(
            &raw mut entry::kpin_cache_len,
            r.region.1.wrapping_sub(r.region.0),
        );
    }
}

/// Logs what the run did and writes the tool's output files.
fn report(engine: &Engine, vcpu: &Vcpu<'_>, tool: &Chosen, cycles: u64) {
    let st = engine.stats();
    let (heap_now, heap_peak) = heap::usage();
    log!(
        Info,
        "engine: stats: {} traces translated ({} guest instructions, {} guest bytes -> {} cache bytes), {} links, exits direct {} ibl-miss {} sensitive {} attention {} fault {}; emulated: {} out, {} in, {} cpuid; delivered: {} interrupts, {} int n, exceptions by vector {:?}; {} halts; emulations by kind {:?}; heap {} KiB (peak {} KiB); {} TSC cycles in the run",
        st.fragments,
        st.guest_insns,
        st.guest_bytes,
        st.cache_bytes,
        st.links,
        st.exits[0],
        st.exits[1],
        st.exits[2],
        st.exits[3],
        st.exits[7],
        vcpu.stats.outs,
        vcpu.stats.ins,
        vcpu.stats.cpuids,
        vcpu.stats.interrupts,
        vcpu.stats.software_ints,
        vcpu.stats.exceptions,
        vcpu.stats.halts,
        vcpu.stats.emulated,
        heap_now >> 10,
        heap_peak >> 10,
        cycles
    );
    if let Chosen::BbCount(b) = tool {
        log!(
            Info,
            "bbcount: {} guest instructions executed in {} block executions; bbcount.csv written{}",
            b.instructions(engine),
            b.executions(engine),
            if b.uncounted > 0 {
                " (some blocks uncounted: counters exhausted)"
            } else {
                ""
            }
        );
        b.write_csv(engine);
    }
    log::flush();
}
