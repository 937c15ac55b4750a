//! Running the guest from the code cache: after bring-up, the engine creates the shadow
//! MMU (`mm/shadow.rs`) and loads the kernel view's shadow root into the real CR3, creates
//! the translator (`guest_engine::Engine`) over the code-cache region of the stolen
//! region, loads the guest's registers from the attach block and runs the guest at
//! hardware CPL 3 under the chosen tool until it stops.
//!
//! Around each run of the translator the loop (1) tells the translator what the shadow's
//! `EngineWork` lists (code frames written, mappings dropped) — before every run, so that
//! no stale trace or mapping survives into guest code —, (2) after the run, stops on a
//! shadow-MMU failure, then (3) handles the stop: a hardware #PF goes to `cache_page_fault.rs`
//! (fill and retry, self-modifying code, or a guest fault), a guest fault to
//! [`reflect_guest_fault`], an emulation that stopped only for (1) resumes. The loop is
//! `run_loop.rs`'s `RunLoop`, one method per step; this file sets it up and writes the
//! report.
//!
//! How a run ends: a guest i8042 reset (`out 0x64, 0xfe`) — the engine first writes its
//! final report (statistics, the tool's output files), then performs the `out` through
//! the gate, and the VMM ends the run as a clean poweroff; anything the virtual CPU does
//! not emulate, a fetch the guest's page tables do not allow, or an engine error — a log
//! line naming it and the guest RIP, the report, then the failure port (exit status 3).

pub mod bringup;
pub mod cache_page_fault;
pub mod detach;
pub mod error;
pub mod guest_dump;
pub mod profile;
mod run_loop;
pub mod tasks;
pub mod tools;
pub mod vcpu;
pub mod zone_access;

use core::cell::RefCell;
use core::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use guest_engine::profile as prof;
use guest_engine::shadow_mmu::{GuestFault, View};
use guest_engine::{exit_code, Config, Engine, GuestVirt};
use kpin_abi::attach::AttachBlock;
use kpin_abi::stolen::{CODE_CACHE_BYTES, CODE_CACHE_OFFSET, HEAP_BYTES, LAYOUT_BYTES, WINDOW_VA};

/// Heap bytes the translator's tables may grow by between flushes (a fixed share: a
/// tool's own start-up data, cachesim's caches and line sets, must not shrink it).
const HEAP_GROWTH_BYTES: u64 = HEAP_BYTES * 5 / 16;

/// Heap bytes in use past which the translator's tables are flushed however little they
/// have grown since the last flush: room for the shadow MMU's reverse map and smaller
/// tables' growth (the fragment and exit tables are allocated whole at the start and
/// never double; a tool whose own data outgrows the rest ends the run with an
/// allocation failure, not a flush per translation).
const HEAP_CAP_BYTES: u64 = HEAP_BYTES * 7 / 8;
/// Growth since the last flush below which no flush is asked for.
const HEAP_MIN_GROWTH_BYTES: u64 = HEAP_BYTES / 32;

/// Heap bytes in use after the last flush (at the first call: the engine's start), and
/// whether the previous call asked for a flush, so that the next call finds the floor.
static HEAP_FLOOR: AtomicU64 = AtomicU64::new(u64::MAX);
static HEAP_FLUSH_ASKED: AtomicBool = AtomicBool::new(false);

/// `Config::memory_pressure`: the translator's tables live on the heap and keep
/// invalidated fragments until a flush (Linux patches its text thousands of times at
/// boot: alternatives, ftrace, static keys), so when they have grown by a budget since
/// the last flush the cache is flushed whole, as when it fills. The budget counts from
/// the heap's use after the last flush, not from zero: a tool's own data (insmix's
/// blocks, cachesim's line sets) is not freed by a flush, and a fixed threshold made a
/// tool that crossed it flush before every translation (691 flushes and half the cycles
/// of an insmix Linux boot).
fn heap_pressure() -> bool {
    let used = heap::usage().0;
    if HEAP_FLUSH_ASKED.swap(false, Ordering::Relaxed) {
        HEAP_FLOOR.store(used, Ordering::Relaxed);
    } else {
        // The first call sets the floor; memory freed since (a tool switched for a
        // smaller one) lowers it.
        HEAP_FLOOR.fetch_min(used, Ordering::Relaxed);
    }
    let floor = HEAP_FLOOR.load(Ordering::Relaxed);
    let limit = floor.saturating_add(HEAP_GROWTH_BYTES).min(HEAP_CAP_BYTES);
    // Near the cap a flush still needs some growth to free, or it would come before
    // every translation.
    let flush = used > limit && used - floor > HEAP_MIN_GROWTH_BYTES;
    HEAP_FLUSH_ASKED.store(flush, Ordering::Relaxed);
    flush
}

use crate::json::JsonObject;
use crate::log;
use crate::mm::guest_memory::{MODE_KERNEL, MODE_USER};
use crate::mm::heap;
use crate::mm::shadow::Shadow;
use crate::ring0::log;
use crate::ring0::log::fail;
use crate::ring0::{entry, gate, page_tables as paging};
use crate::run::error::RunError;
use crate::run::tools::Chosen;
use crate::run::vcpu::Vcpu;
use run_loop::RunLoop;

use guest_engine::vcpu::Event;

/// CR0.PG, EFER.LMA: the guest must be in 64-bit long mode (all the translator knows).
const CR0_PG: u64 = kpin_abi::x86::cr0::PG;
const EFER_LMA: u64 = kpin_abi::x86::efer::LMA;

/// Runs the guest described by `block` under tool `tool_name`; never returns.
pub fn run_guest(block: &AttachBlock, tool_name: &str) -> ! {
    let tool = check_guest(block, tool_name);
    let shadow = enter_shadow(block);
    let engine = new_engine(block, tool_name);
    RunLoop::setup(block, engine, &shadow, tool).run()
}

/// The tool `tool_name` with the block's options, once the block says the stolen region
/// is large enough and the guest is at CPL 0 in 64-bit long mode; else the run ends.
fn check_guest(block: &AttachBlock, tool_name: &str) -> Chosen {
    let options = core::str::from_utf8(block.tool_options()).unwrap_or("");
    if block.stolen_bytes < LAYOUT_BYTES {
        log!(
            Error,
            "engine: the stolen region has {} bytes; the engine's layout needs {LAYOUT_BYTES}",
            block.stolen_bytes
        );
        fail();
    }
    let Some(tool) = Chosen::for_boot(tool_name, options) else {
        log!(
            Error,
            "engine: unknown tool {tool_name:?} (this engine has: {})",
            tools::ToolNames
        );
        fail();
    };
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
    tool
}

/// The shadow MMU, with the kernel view's shadow root loaded into the real CR3.
fn enter_shadow(block: &AttachBlock) -> RefCell<Shadow> {
    let shadow = match Shadow::new(block, paging::engine_root(block)) {
        Ok(sh) => RefCell::new(sh),
        Err(e) => {
            log!(Error, "engine: creating the shadow MMU failed: {e}");
            fail();
        }
    };
    if let Err(e) = shadow.borrow_mut().enter(View::Kernel) {
        log!(Error, "engine: loading the guest's shadow root failed: {e}");
        fail();
    }
    log!(
        Info,
        "engine: guest memory through the shadow MMU: kernel-view shadow root loaded for guest CR3 {:#x}",
        block.sregs.cr3
    );
    shadow
}

/// The translator over the code-cache region, holding the guest's registers from
/// `block`.
fn new_engine(block: &AttachBlock, tool_name: &str) -> Engine {
    let host_flags = guest_engine::host_flags::probe();
    log!(
        Info,
        "engine: undefined flags this CPU writes: {host_flags:?}"
    );
    let config = Config {
        // The image is soft-float (no SSE in engine code): guest vector state stays in
        // the registers across exits, and analysis routines leave it alone.
        save_extended_state: false,
        analysis_preserves_vector_state: true,
        mode: MODE_KERNEL,
        // Guest instructions executed per virtual CPL, for counters.json.
        count_insns: true,
        memory_pressure: Some(heap_pressure),
        // Linux's `cli`/`sti`/`pushfq`/`popfq` at CPL 0 (~10^6 a boot) run inline.
        inline_virtual_flags: true,
        // Measured on this CPU (translated code runs on it at CPL 3 too): glue before an
        // `and`/`or`/`xor`/`test` need not keep AF if the CPU writes it anyway.
        host_flags,
        // Unknown to the guest, whose code must not be able to make a changed trace
        // hash like the one translated: the TSC now, and at `_start`.
        code_hash_key: [
            crate::events::timer::tsc(),
            // SAFETY: written once by `_start` before any CPL-3 code ran.
            unsafe { core::ptr::read_volatile(&raw const entry::kpin_boot_tsc) }.rotate_left(29),
        ],
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
    engine
}

/// The guest must take `fault` at the instruction `guest_pc` (the engine's registers are
/// the guest's before it). The shadow's part of a #PF — dropping the faulting address's
/// leaves, as the CPU drops its TLB entries — is done first, then the virtual CR2 is set
/// and the fault delivered through the guest's IDT (a `fault.vector` of 13 is the #GP(0)
/// of a non-canonical address, without CR2). `Ok` means delivered (the engine's RIP and
/// registers are the handler's); `Err` says why the run must stop.
pub fn reflect_guest_fault(
    engine: &mut Engine,
    vcpu: &mut Vcpu<'_>,
    shadow: &RefCell<Shadow>,
    fault: GuestFault,
    guest_pc: GuestVirt,
) -> Result<(), RunError> {
    let pf = fault.vector == guest_engine::shadow_mmu::PF_VECTOR;
    {
        let mut sh = shadow.borrow_mut();
        sh.counters.reflected += 1;
        if pf {
            sh.page_fault_delivered(fault.cr2.0, fault.error_code)
                .map_err(|error| RunError::Shadow {
                    rip: guest_pc.0,
                    error,
                })?;
        }
    }
    if pf {
        vcpu.cr2 = fault.cr2.0;
    }
    deliver_at(
        engine,
        vcpu,
        guest_pc.0,
        Event::from_hardware(fault.vector, fault.error_code),
    )
}

/// Tells the translator what the shadow MMU did that it must know before guest code runs
/// again.
fn tell_translator(engine: &mut Engine, shadow: &RefCell<Shadow>) {
    let work = shadow.borrow_mut().take_work();
    if work.all_mappings {
        // Every VA→PA assumption of the cache goes (SoftTLB mirror, lookup tables);
        // translations stay, keyed by frame, and so do the frames' protections.
        engine.invalidate_all_mappings();
    } else {
        if work.nonglobal_mappings {
            // A CR3 write: the same, but what the cache knows of global pages stays (as
            // their TLB entries do); the `invlpg`s below still drop theirs.
            engine.invalidate_nonglobal_mappings();
        }
        for va in &work.pages {
            engine.invalidate_page(*va);
        }
    }
    let mut invalidated = 0;
    for frame in &work.code_frames {
        invalidated += engine.invalidate_code_page(*frame);
    }
    shadow.borrow_mut().counters.fragments_invalidated += invalidated as u64;
}

/// Delivers `ev` with return address `rip` and continues at the handler; `Err` (the run
/// must end) on a guest triple fault.
fn deliver_at(
    engine: &mut Engine,
    vcpu: &mut Vcpu<'_>,
    rip: u64,
    ev: Event,
) -> Result<(), RunError> {
    let handler = vcpu
        .deliver(engine.regs_mut(), rip, ev)
        .map_err(|t| RunError::TripleFault {
            rip,
            first: ev,
            last: t.last,
        })?;
    engine.set_rip(GuestVirt(handler));
    Ok(())
}

/// Tells the ring-0 trap path where the code cache is, so that a fault in translated
/// code becomes a FAULT exit of the cache instead of an engine fault report.
fn arm_fault_redirect(engine: &mut Engine) {
    // SAFETY: a shared reference to the trap path's cell, which lives in the image's data
    // for the whole run and is only accessed atomically or by the ring-0 stubs' stores,
    // which run while no CPL-3 code does.
    engine.take_fault_pc_from(unsafe { &entry::kpin_cache_fault_rip });
    let r = engine.fault_redirect();
    // SAFETY: plain stores to the trap path's parameters; it reads them only on a fault,
    // and `kpin_cache_len` (stored last) stays 0 — redirect off — until the rest is set.
    unsafe {
        core::ptr::write_volatile(&raw mut entry::kpin_cache_exit_routine, r.exit_routine);
        core::ptr::write_volatile(&raw mut entry::kpin_cache_lo, r.region.0);
        core::ptr::write_volatile(
            &raw mut entry::kpin_cache_len,
            r.region.1.wrapping_sub(r.region.0),
        );
    }
}

/// The virtual CPU's sections of `counters.json`: what it emulated and delivered.
fn write_vcpu_counters(j: &mut JsonObject, vcpu: &Vcpu<'_>) {
    let v = &vcpu.stats;
    j.begin("emulated")
        .u64("total", v.emulated.iter().sum())
        .u64("port_out", v.outs)
        .u64("port_in", v.ins)
        .u64("cpuid", v.cpuids)
        // Of the port reads, those the engine answered itself (COM1's LSR and IER,
        // the PICs' masks, PCI configuration reads); of the writes, those it kept
        // (COM1 IER writes: a console message's save/clear/restore; the PCI address).
        .u64(
            "port_in_answered_in_engine",
            vcpu.hw.com1.answered + vcpu.hw.pic.answered + vcpu.hw.pci.answered,
        )
        .u64(
            "port_out_kept_in_engine",
            vcpu.hw.com1.absorbed + vcpu.hw.pci.absorbed,
        )
        // COM1 THR writes made with THRI set and held (all but the last of a run
        // never reach the port).
        .u64("com1_thr_writes_held", vcpu.hw.com1.held_total)
        .end();
    // The port accesses that left the engine (a gate call and a VM exit each): the
    // total, then per site `"<in|out> <port> at <guest RIP>"`, then those at sites the
    // table had no room for.
    let exits = &vcpu.hw.port_exits;
    j.begin("port_exits").u64("total", exits.total);
    for s in exits.sites() {
        let dir = if s.out { "out" } else { "in" };
        j.u64(
            &alloc::format!("{dir} {:#x} at {:#x}", s.port, s.rip),
            s.count,
        );
    }
    j.u64("unlisted_sites", exits.unlisted).end();
    j.begin("events")
        .u64("interrupts_delivered", v.interrupts)
        .u64("exceptions_delivered", v.exceptions.iter().sum())
        .u64("software_interrupts", v.software_ints)
        .u64("halts", v.halts)
        // CPL-3 instructions the virtual CPU does not model, answered with #UD.
        .u64("user_unsupported_ud", v.user_unsupported)
        // DR7 writes enabling a hardware breakpoint.
        .u64("breakpoint_enables", v.breakpoint_enables)
        .end();
}

/// Logs what the run did, writes `counters.json` and lets the tool write its files.
fn report(
    engine: &Engine,
    vcpu: &Vcpu<'_>,
    shadow: &RefCell<Shadow>,
    tool: &mut Chosen,
    cycles: u64,
) {
    prof::switch(profile::REPORT);
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
    let sh = shadow.borrow();
    log!(Info, "engine: shadow: {}", *sh);
    tool.finish(engine);
    let mut j = JsonObject::new();
    j.begin("translation")
        .u64("traces", st.fragments)
        .u64("guest_instructions", st.guest_insns)
        .u64("guest_bytes", st.guest_bytes)
        .u64("code_cache_bytes", st.cache_bytes)
        .u64("code_cache_bytes_in_use", engine.cache_used_bytes() as u64)
        .u64("code_cache_flushes", st.flushes)
        .u64("code_cache_flushes_for_heap", st.pressure_flushes)
        .u64("links", st.links)
        .u64("traces_revived", st.revived)
        .end();
    j.begin("exits")
        .u64("direct", st.exits[exit_code::EXIT_DIRECT as usize])
        .u64("ibl_miss", st.exits[exit_code::EXIT_IBL_MISS as usize])
        .u64("sensitive", st.exits[exit_code::EXIT_SENSITIVE as usize])
        .u64(
            "pa_mismatch",
            st.exits[exit_code::EXIT_PA_MISMATCH as usize],
        )
        .u64("fault", st.exits[exit_code::EXIT_FAULT as usize])
        .u64("attention", st.exits[exit_code::EXIT_ATTENTION as usize])
        .end();
    j.begin("guest_instructions")
        .u64("cpl0", engine.executed_insns(MODE_KERNEL))
        .u64("cpl3", engine.executed_insns(MODE_USER))
        // Of those, emulated outside the cache (no block counter sees them) ...
        .u64("emulated", st.emulated_insns)
        // ... and block counts taken back after faults cut a block short.
        .u64("taken_back_after_faults", st.insns_taken_back)
        .end();
    write_vcpu_counters(&mut j, vcpu);
    j.begin("smc")
        .u64("frames_invalidated", sh.counters.code_writes)
        .u64("traces_invalidated", sh.counters.fragments_invalidated)
        .end();
    sh.write_json(&mut j);
    j.u64("gate_calls", gate::calls())
        .u64("ring_doorbells", log::doorbells())
        .u64("tsc_cycles", cycles)
        .u64("heap_peak_bytes", heap_peak);
    let table = profile::write(&mut j);
    for line in table.lines().take(16) {
        log!(Info, "engine: profile: {line}");
    }
    if let Err(e) = tools::write_file(kpin_abi::output::ENGINE_PROFILE, table.as_bytes()) {
        log!(
            Error,
            "engine: cannot write {}: {e}",
            kpin_abi::output::ENGINE_PROFILE
        );
    }
    let text = j.finish();
    if let Err(e) = tools::write_file(kpin_abi::output::ENGINE_COUNTERS, text.as_bytes()) {
        log!(
            Error,
            "engine: cannot write {}: {e}",
            kpin_abi::output::ENGINE_COUNTERS
        );
    }
    // The same instant as the counters above: the rows sum to their totals.
    tasks::report(vcpu);
    log::flush();
}
