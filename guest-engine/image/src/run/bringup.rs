//! The engine's CPL-3 main flow at bring-up: attach to the I/O ring, check and log the
//! attach block, optionally measure the gate and the timer and probe the address space,
//! switch to the engine's own page tables, optionally fault on purpose, then run the
//! guest (`run/mod.rs`).
//!
//! Tool options read here (`key=value`, separated by spaces; other keys belong to the tool):
//! * `bringup.checks=true|false` — run the measurements and the probe below (default
//!   false, so that a normal run starts the guest at once; giving `bringup.gates`,
//!   `bringup.ticks` or `bringup.probe` turns them on);
//! * `bringup.gates=N` — gate round trips to measure (default [`DEFAULT_GATES`]);
//! * `bringup.ticks=N` — PIT ticks to await at CPL 3 (default [`DEFAULT_TICKS`]);
//! * `bringup.probe=true|false` — probe which PML4 slots CPL-3 code can read (default true);
//! * `bringup.crash=pf|gp|ud|de|df|nested|ring0|gate-caller|gate-cr3|gate-port|gate-msr|gate-notify`
//!   — fault on purpose after the measurements (`nested`: the fault reporter faults too, so
//!   ring 0 writes the failure port itself; `ring0`: a RDMSR gate on a nonexistent MSR
//!   faults inside the ring-0 stub; `gate-*`: a gate call the gate refuses — from outside
//!   the engine's `.text`, a CR3 root in the code cache, IN8 of the failure port, a WRMSR
//!   of EFER, NOTIFY of COM1).

use core::arch::asm;

use kpin_abi::attach::{AttachBlock, MAGIC, VERSION};
use kpin_abi::stolen::{BOOT_PT_OFFSET, ENGINE_OFFSET, IO_RING_OFFSET, PHYSMAP_VA, WINDOW_VA};

use crate::events::timer;
use crate::log;
use crate::ring0::entry::kpin_boot_tsc;
use crate::ring0::layout::{gate_op, DEFAULT_GATES, DEFAULT_TICKS, PIC1_DATA, TIMER_HZ};
use crate::ring0::log;
use crate::ring0::log::fail;
use crate::ring0::{engine_tables as descriptors, gate, page_tables as paging, probe};

/// MSR used to check the WRMSR/RDMSR gates (the guest has not run, so nothing depends
/// on its value yet).
const MSR_KERNEL_GS_BASE: u32 = kpin_abi::x86::msr::KERNEL_GS_BASE;
/// Upper bound on the wait for timer ticks, in TSC cycles (seconds at any real TSC rate).
const TICK_WAIT_CYCLES: u64 = 20_000_000_000;
/// An MSR index no CPU implements: RDMSR of it is a #GP at ring 0.
const NO_SUCH_MSR: u32 = 0xdead_beef;
/// Offset of the boot protocol's "HdrS" magic in the zero page.
const HDRS_OFFSET: u64 = 0x202;
/// An address the boot page tables leave unmapped (PML4 slot 0 is empty).
const UNMAPPED_VA: u64 = 0x1000;

/// A deliberate fault, chosen with `bringup.crash=`.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Crash {
    Pf,
    Gp,
    Ud,
    De,
    Df,
    Nested,
    Ring0,
    GateCaller,
    GateCr3,
    GatePort,
    GateMsr,
    GateNotify,
}

struct Options {
    checks: bool,
    probe: bool,
    gates: u64,
    ticks: u64,
    crash: Option<Crash>,
}

/// Parses the `bringup.*` options; an unknown `bringup.` key or a bad value is an error.
fn parse_options(text: &str) -> Result<Options, &str> {
    let mut o = Options {
        checks: false,
        probe: true,
        gates: DEFAULT_GATES,
        ticks: DEFAULT_TICKS,
        crash: None,
    };
    for word in text.split_ascii_whitespace() {
        let Some(rest) = word.strip_prefix("bringup.") else {
            continue;
        };
        let (key, value) = rest.split_once('=').ok_or(word)?;
        match key {
            "checks" => o.checks = value.parse().map_err(|_| word)?,
            "gates" => {
                o.gates = value.parse().map_err(|_| word)?;
                o.checks = true;
            }
            "probe" => {
                o.probe = value.parse().map_err(|_| word)?;
                o.checks = true;
            }
            "ticks" => {
                o.ticks = value.parse::<u64>().map_err(|_| word)?.max(1);
                o.checks = true;
            }
            "crash" => {
                o.crash = Some(match value {
                    "pf" => Crash::Pf,
                    "gp" => Crash::Gp,
                    "ud" => Crash::Ud,
                    "de" => Crash::De,
                    "df" => Crash::Df,
                    "nested" => Crash::Nested,
                    "ring0" => Crash::Ring0,
                    "gate-caller" => Crash::GateCaller,
                    "gate-cr3" => Crash::GateCr3,
                    "gate-port" => Crash::GatePort,
                    "gate-msr" => Crash::GateMsr,
                    "gate-notify" => Crash::GateNotify,
                    _ => return Err(word),
                })
            }
            _ => return Err(word),
        }
    }
    Ok(o)
}

/// CPL-3 entry from `_start` (`ring0/entry.rs` names it by symbol).
#[no_mangle]
pub extern "C" fn kpin_engine_main(attach: *const AttachBlock) -> ! {
    let main_tsc = timer::tsc();
    if log::init().is_err() {
        // Nothing to log through: the failure port alone says the engine failed.
        fail();
    }
    // SAFETY: `_start` wrote it before anything else ran.
    let boot_tsc = unsafe { core::ptr::read_volatile(&raw const kpin_boot_tsc) };
    log!(
        Info,
        "engine: kpin-engine {} at CPL 3; the ring-0 setup took {} TSC cycles",
        env!("CARGO_PKG_VERSION"),
        main_tsc.wrapping_sub(boot_tsc)
    );
    if attach as u64 != WINDOW_VA {
        log!(
            Error,
            "engine: attach block pointer {:#x} is not the window base",
            attach as u64
        );
        fail();
    }
    // SAFETY: the window maps the stolen region, whose first ATTACH_BYTES hold the block
    // the VMM wrote; it is plain old data, so any bytes are a value (checked next).
    let block: &AttachBlock = unsafe { &*attach };
    if !block.is_valid() {
        log!(
            Error,
            "engine: the attach block is invalid: magic {:#x} (want {MAGIC:#x}), version {} (want {VERSION}), size {} (want {})",
            block.magic,
            block.version,
            block.size,
            core::mem::size_of::<AttachBlock>()
        );
        fail();
    }
    let tool = core::str::from_utf8(block.tool_name()).unwrap_or("?");
    let options = core::str::from_utf8(block.tool_options()).unwrap_or("");
    log_attach(block, tool, options);
    let opts = match parse_options(options) {
        Ok(o) => o,
        Err(word) => {
            log!(Error, "engine: bad bring-up option {word:?} (known: bringup.checks=BOOL bringup.gates=N bringup.ticks=N bringup.probe=BOOL bringup.crash=pf|gp|ud|de|df|nested|ring0|gate-caller|gate-cr3|gate-port|gate-msr|gate-notify)");
            fail();
        }
    };
    log::flush();

    let mut tsc_hz = 0;
    if opts.checks {
        tsc_hz = measure_timer(opts.ticks);
        log::flush();
        measure_gates(block, opts.gates, tsc_hz);
        log::flush();
        if opts.probe {
            probe_address_space(block.stolen_base);
            log::flush();
        }
    }
    switch_to_own_page_tables(block);
    log::flush();
    if let Some(c) = opts.crash {
        crash(c);
    }
    let total = timer::tsc().wrapping_sub(boot_tsc);
    if tsc_hz > 0 {
        let us = |cycles: u64| cycles.saturating_mul(1_000_000) / tsc_hz;
        log!(
            Info,
            "engine: bring-up took {} us from _start (ring-0 setup {} us, before the first CPL-3 instruction)",
            us(total),
            us(main_tsc.wrapping_sub(boot_tsc))
        );
    } else {
        log!(
            Info,
            "engine: bring-up took {total} TSC cycles from _start (checks off: bringup.checks=true measures the gate and timer)"
        );
    }
    log!(Info, "engine: bring-up complete (tool {tool})");
    crate::run::run_guest(block, tool)
}

fn log_attach(b: &AttachBlock, tool: &str, options: &str) {
    let r = &b.regs;
    let s = &b.sregs;
    log!(
        Info,
        "engine: attach: guest RIP={:#x} RSP={:#x} RSI={:#x} RFLAGS={:#x} CR0={:#x} CR3={:#x} CR4={:#x} EFER={:#x} CS={:#x} (L={}) SS={:#x} GDT={:#x}+{:#x}",
        r.rip, r.rsp, r.rsi, r.rflags, s.cr0, s.cr3, s.cr4, s.efer, s.cs.selector, s.cs.l,
        s.ss.selector, s.gdt.base, s.gdt.limit
    );
    log!(
        Info,
        "engine: attach: {} CPUID entries, {} MSRs, {} e820 entries, {} MiB RAM, stolen region {:#x}+{:#x}, events: exception {} interrupt {} nmi {}",
        b.cpuid_count, b.msr_count, b.e820_count, b.ram_bytes >> 20, b.stolen_base, b.stolen_bytes,
        b.events.exception_valid, b.events.interrupt_valid, b.events.nmi_pending
    );
    let [_, ebx, ecx, edx] = b.cpuid(0, 0);
    let mut vendor = [0u8; 12];
    vendor[..4].copy_from_slice(&ebx.to_le_bytes());
    vendor[4..8].copy_from_slice(&edx.to_le_bytes());
    vendor[8..].copy_from_slice(&ecx.to_le_bytes());
    log!(
        Info,
        "engine: attach: CPUID vendor {:?}; tool {tool:?} options {options:?}",
        core::str::from_utf8(&vendor).unwrap_or("?")
    );
}

/// Starts the PIT, waits for `ticks` ticks at CPL 3, checks that they interrupted CPL 3,
/// exercises the HLT gate, stops the PIT. Returns the TSC rate it measured (Hz).
fn measure_timer(ticks: u64) -> u64 {
    let cpl3_before = timer::irqs_at_cpl3();
    timer::start_pit(TIMER_HZ);
    let start = timer::tsc();
    // Align to a tick edge, then count `ticks` ticks.
    let first = wait_ticks(timer::pit_ticks() + 1, start);
    let t0 = timer::tsc();
    let end = wait_ticks(first + ticks, start);
    let t1 = timer::tsc();
    // The HLT gate: each call returns after one interrupt.
    let before_hlt = timer::pit_ticks();
    for _ in 0..3 {
        gate::hlt();
    }
    let hlt_ticks = timer::pit_ticks() - before_hlt;
    timer::stop_pit();
    let mask = gate::in8(PIC1_DATA);
    let cycles = t1 - t0;
    let counted = end - first;
    let tsc_hz = cycles.saturating_mul(TIMER_HZ) / counted.max(1);
    let at_cpl3 = timer::irqs_at_cpl3() - cpl3_before;
    log!(
        Info,
        "timer: {counted} PIT ticks at {TIMER_HZ} Hz taken by the ring-0 stub and returned from ({at_cpl3} of {} interrupted CPL 3); {cycles} TSC cycles, TSC ~{} MHz",
        end,
        tsc_hz / 1_000_000
    );
    log!(
        Info,
        "timer: 3 HLT gates woke after {hlt_ticks} ticks; PIC mask reads back {mask:#x} through the IN8 gate"
    );
    if at_cpl3 == 0 {
        log!(
            Error,
            "timer: no interrupt arrived while the engine ran at CPL 3"
        );
        fail();
    }
    tsc_hz
}

/// Spins at CPL 3 until the PIT count reaches `target`; fails after [`TICK_WAIT_CYCLES`].
fn wait_ticks(target: u64, start: u64) -> u64 {
    loop {
        let now = timer::pit_ticks();
        if now >= target {
            return now;
        }
        if timer::tsc() - start > TICK_WAIT_CYCLES {
            log!(
                Error,
                "timer: only {now} of {target} PIT ticks arrived; is IRQ 0 delivered?"
            );
            fail();
        }
        core::hint::spin_loop();
    }
}

/// Times `n` NOP gates, CR3 reloads, an MSR write/read and an `invlpg`.
fn measure_gates(b: &AttachBlock, n: u64, tsc_hz: u64) {
    let ns = |cycles: u64| cycles.saturating_mul(1_000_000_000) / tsc_hz.max(1);
    let t0 = timer::tsc();
    for _ in 0..n {
        gate::nop();
    }
    let nop_cycles = timer::tsc() - t0;
    let per_ns = ns(nop_cycles) / n.max(1);
    log!(
        Info,
        "gate: {n} NOP round trips in {} us: {}.{:03} us each, {} per second",
        ns(nop_cycles) / 1000,
        per_ns / 1000,
        per_ns % 1000,
        1_000_000_000_u64.checked_div(per_ns).unwrap_or(0)
    );
    let m = (n / 4).max(1);
    let t0 = timer::tsc();
    let mut faults = 0;
    for _ in 0..m {
        if let probe::Outcome::Fault(..) = probe::read(UNMAPPED_VA) {
            faults += 1;
        }
    }
    let fault_ns = ns(timer::tsc() - t0) / m;
    log!(
        Info,
        "fault: {faults} of {m} #PF round trips (CPL 3 -> ring-0 trap path -> iretq) in {}.{:03} us each",
        fault_ns / 1000,
        fault_ns % 1000
    );
    let root = b.stolen_base + BOOT_PT_OFFSET;
    let t0 = timer::tsc();
    for _ in 0..m {
        // SAFETY: `root` is the root the VMM entered the engine with and still uses.
        unsafe { gate::load_cr3(root) };
        // Touch the ring so the reload has a TLB miss to serve.
        // SAFETY: the I/O ring header is mapped in the window.
        unsafe { core::ptr::read_volatile((WINDOW_VA + IO_RING_OFFSET) as *const u64) };
    }
    let cr3_ns = ns(timer::tsc() - t0) / m;
    log!(
        Info,
        "gate: {m} CR3 reloads ({root:#x}) in {}.{:03} us each",
        cr3_ns / 1000,
        cr3_ns % 1000
    );
    let probe = 0x1234_5678_9abc_def0_u64 & 0x0000_7fff_ffff_f000;
    // SAFETY: KERNEL_GS_BASE only matters after a `swapgs`, which nothing executes yet.
    unsafe { gate::wrmsr(MSR_KERNEL_GS_BASE, probe) };
    let back = gate::rdmsr(MSR_KERNEL_GS_BASE);
    // SAFETY: as above; restores the guest's value.
    unsafe { gate::wrmsr(MSR_KERNEL_GS_BASE, 0) };
    gate::invlpg(WINDOW_VA);
    let unknown = gate::unknown(0xdead);
    log!(
        Info,
        "gate: WRMSR/RDMSR KERNEL_GS_BASE {} ({back:#x}), INVLPG ok, unknown operation answers {unknown:#x}",
        if back == probe { "round-trips" } else { "MISMATCH" }
    );
    if back != probe || unknown != gate_op::UNKNOWN {
        fail();
    }
    measure_gs_base_switch(m, &ns);
}

/// The guest's GS base changes on every `swapgs`: times a switch the way the engine does
/// it (`vcpu::set_hw_base`: `wrgsbase` at CPL 3 with CR4.FSGSBASE) against the
/// gate's WRMSR, and checks that the hardware base took the value.
fn measure_gs_base_switch(m: u64, ns: &dyn Fn(u64) -> u64) {
    use kpin_abi::x86::msr::GS_BASE as MSR_GS_BASE;
    let t0 = timer::tsc();
    for k in 0..m {
        crate::run::vcpu::set_hw_base(false, k << 12);
    }
    let direct_ns = ns(timer::tsc() - t0) / m;
    let direct_ok = gate::rdmsr(MSR_GS_BASE) == (m - 1) << 12;
    let t0 = timer::tsc();
    for k in 0..m {
        // SAFETY: nothing uses the GS base before the guest runs (which resets it).
        unsafe { gate::wrmsr(MSR_GS_BASE, k << 12) };
    }
    let gate_ns = ns(timer::tsc() - t0) / m;
    crate::run::vcpu::set_hw_base(false, 0);
    // SAFETY: written once by `_start` before any CPL-3 code ran.
    let fsgsbase =
        unsafe { core::ptr::read_volatile(&raw const crate::ring0::entry::kpin_fsgsbase) };
    log!(
        Info,
        "fsgsbase: CR4.FSGSBASE {}: a GS-base switch takes {} ns the engine's way ({}, {}) and {}.{:03} us through the gate's WRMSR",
        if fsgsbase != 0 { "on" } else { "off (no CPUID 7.EBX[0])" },
        direct_ns,
        if fsgsbase != 0 { "wrgsbase at CPL 3" } else { "the gate" },
        if direct_ok { "RDMSR reads it back" } else { "MISMATCH" },
        gate_ns / 1000,
        gate_ns % 1000
    );
    if !direct_ok {
        fail();
    }
}

/// Loads the engine's own page tables and checks the physmap against the guest's zero
/// page (the boot protocol's "HdrS" magic at offset 0x202), which the VMM wrote.
fn switch_to_own_page_tables(b: &AttachBlock) {
    let m = paging::build_and_load(b);
    log!(
        Info,
        "paging: running on the engine's own page tables (CR3 {:#x}): window {} x 2 MiB, physmap {} x 2 MiB{}",
        m.cr3,
        m.window_pages,
        m.physmap_pages,
        if m.unmapped_bytes > 0 { " (guest memory beyond 8 GiB of physical space NOT mapped)" } else { "" }
    );
    let zero_page = b.regs.rsi;
    if zero_page != 0 && zero_page < b.ram_bytes {
        // SAFETY: the physmap maps every e820 range, and the zero page is guest RAM.
        let magic = unsafe {
            core::ptr::read_volatile((PHYSMAP_VA + zero_page + HDRS_OFFSET) as *const u32)
        };
        log!(
            Info,
            "paging: physmap reads the guest's zero page at {zero_page:#x}: header magic {:?}",
            core::str::from_utf8(&magic.to_le_bytes()).unwrap_or("?")
        );
    }
}

/// Probes every PML4 slot (but the physmap's) and logs, as ranges of slots, where CPL-3
/// reads work and where they fault.
fn probe_address_space(stolen_base: u64) {
    let window_slot = (WINDOW_VA >> 39) & 0x1ff;
    let physmap_slot = (kpin_abi::stolen::PHYSMAP_VA >> 39) & 0x1ff;
    // SAFETY: the first quadword of the image is code, readable in the window.
    let expected = unsafe { core::ptr::read_volatile((WINDOW_VA + ENGINE_OFFSET) as *const u64) };
    let classify = |slot: u64| {
        let outcome = if slot == window_slot {
            probe::read(probe::slot_va(slot, ENGINE_OFFSET))
        } else {
            // SAFETY: still on the boot tables, and `slot` is neither window nor physmap.
            unsafe { probe::probe_slot(stolen_base, slot) }
        };
        match outcome {
            probe::Outcome::Read(v) if v == expected => probe::Outcome::Read(0),
            other => other,
        }
    };
    let mut run: Option<(u64, u64, probe::Outcome)> = None;
    let report = |first: u64, last: u64, o: probe::Outcome| {
        let (a, b) = (
            probe::slot_va(first, 0),
            probe::slot_va(last, 0) + (1 << 39) - 1,
        );
        match o {
            probe::Outcome::Read(0) => {
                log!(Info, "probe: PML4 slots {first}-{last} ({a:#x}-{b:#x}): CPL-3 reads work")
            }
            probe::Outcome::Read(v) => log!(
                Warn,
                "probe: PML4 slots {first}-{last} ({a:#x}-{b:#x}): CPL-3 reads return {v:#x}, not the mapped page"
            ),
            probe::Outcome::Fault(vector, error) => log!(
                Info,
                "probe: PML4 slots {first}-{last} ({a:#x}-{b:#x}): CPL-3 reads fault: vector {vector}, error code {error:#x}{}",
                if vector == 14 && error & 8 != 0 { " (reserved bit)" } else { "" }
            ),
        }
    };
    for slot in (0..probe::SLOTS).filter(|&s| s != physmap_slot) {
        let o = classify(slot);
        run = match run {
            Some((first, last, prev)) if prev == o && last + 1 == slot => Some((first, slot, o)),
            Some((first, last, prev)) => {
                report(first, last, prev);
                Some((slot, slot, o))
            }
            None => Some((slot, slot, o)),
        };
    }
    if let Some((first, last, o)) = run {
        report(first, last, o);
    }
    log!(Info, "probe: slot {physmap_slot} (the physmap) not probed");
}

fn crash(c: Crash) -> ! {
    log!(Warn, "engine: faulting on purpose (bringup.crash)");
    log::flush();
    // SAFETY: each arm faults deliberately; the fault is reported by the trap path and the
    // run ends there, so nothing after it runs.
    unsafe {
        match c {
            Crash::Pf => {
                core::ptr::read_volatile(UNMAPPED_VA as *const u64);
            }
            Crash::Gp => asm!("cli"),
            Crash::Ud => asm!("ud2"),
            Crash::De => {
                asm!("xor edx, edx", "xor eax, eax", "div rcx", in("rcx") 0u64, out("rax") _, out("rdx") _)
            }
            Crash::Ring0 => {
                gate::rdmsr(NO_SUCH_MSR);
            }
            // The code cache is not .text: a return address there is refused.
            Crash::GateCaller => gate::call_from(WINDOW_VA + kpin_abi::stolen::CODE_CACHE_OFFSET),
            Crash::GateCr3 => gate::load_cr3(
                crate::ring0::gate::kpin_gate_stolen_base + kpin_abi::stolen::CODE_CACHE_OFFSET,
            ),
            Crash::GatePort => {
                gate::in8(kpin_abi::ports::ENGINE_FAILURE_PORT);
            }
            Crash::GateMsr => gate::wrmsr(kpin_abi::x86::msr::EFER, 0),
            Crash::GateNotify => gate::notify(kpin_abi::x86::COM1_PORT, b'!'),
            Crash::Nested => {
                crate::ring0::crash::fault_while_reporting();
                asm!("ud2");
            }
            Crash::Df => {
                // With TSS.RSP0 unmapped the #UD frame cannot be pushed (#PF), nor can the
                // #PF frame on its IST stack, unmapped too: the CPU raises #DF, which runs
                // on its own IST stack.
                descriptors::set_exception_stacks(UNMAPPED_VA);
                asm!("ud2");
            }
        }
    }
    log!(Error, "engine: the deliberate fault did not fault");
    fail()
}
