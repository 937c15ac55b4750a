//! The numbered steps and the runner.
//!
//! Each step prints exactly one line, `step NN name: ...`; a step named in `kpin.skip=`
//! (or marked `native_unsafe` when the list contains `native-unsafe`) prints
//! `step NN name: SKIPPED` instead. A step's values are ones the code chose or the
//! architecture defines, never build-dependent addresses or speed-dependent counts.
//!
//! `native_unsafe` marks steps that cannot run natively under the KVM of DESIGN.md §2 (ring 0
//! emulated); see README.md for the evidence behind each mark:
//! * `syscall`: SYSCALL at CPL 3 reaches LSTAR still at CPL 3 (#PF fetching the kernel page);
//! * `selectors`: `mov r16, cs/ss` at CPL 3 reads the host's selectors (0x33/0x0).

mod cpu;
mod faults;
mod memory;
pub mod probe;
mod ring3;
mod timer;

use crate::bootinfo::skip_requested;
use crate::console::{print, print_dec2};

/// One step of the transcript.
pub struct Step {
    /// Two-digit number printed on the line.
    pub number: u64,
    /// Name used in `kpin.skip=`.
    pub name: &'static str,
    /// Not runnable natively on the project's KVM (skipped by `kpin.skip=native-unsafe`).
    pub native_unsafe: bool,
    /// Prints the rest of the line after `step NN name: `, newline included.
    pub run: fn(),
}

/// Every step, in transcript order.
#[rustfmt::skip]
pub static STEPS: [Step; 19] = [
    Step { number: 0, name: "boot", native_unsafe: false, run: cpu::boot },
    Step { number: 1, name: "cpuid", native_unsafe: false, run: cpu::cpuid_step },
    Step { number: 2, name: "flags", native_unsafe: false, run: cpu::flags },
    Step { number: 3, name: "de", native_unsafe: false, run: faults::divide_error },
    Step { number: 4, name: "ud", native_unsafe: false, run: faults::invalid_opcode },
    Step { number: 5, name: "gp", native_unsafe: false, run: faults::general_protection },
    Step { number: 6, name: "pf", native_unsafe: false, run: faults::kernel_page_fault },
    Step { number: 7, name: "loop", native_unsafe: false, run: cpu::known_loop },
    Step { number: 8, name: "timer", native_unsafe: false, run: timer::ten_ticks },
    Step { number: 9, name: "msr", native_unsafe: false, run: cpu::msrs_and_swapgs },
    Step { number: 10, name: "syscall", native_unsafe: true, run: ring3::syscall_sysret },
    Step { number: 11, name: "cr3", native_unsafe: false, run: memory::two_address_spaces },
    Step { number: 12, name: "user-pf", native_unsafe: false, run: memory::user_page_fault },
    Step { number: 13, name: "smc", native_unsafe: false, run: memory::self_modifying_code },
    Step { number: 14, name: "hlt", native_unsafe: false, run: timer::hlt_wakeup },
    Step { number: 15, name: "user-priv", native_unsafe: false, run: ring3::privileged_at_cpl3 },
    Step { number: 16, name: "user-irq", native_unsafe: false, run: timer::irq_at_cpl3 },
    Step { number: 17, name: "selectors", native_unsafe: true, run: ring3::selectors_after_iretq },
    Step { number: 18, name: "sysret", native_unsafe: false, run: ring3::sysret_to_cpl3 },
];

/// Runs (or skips) every step in order. Step 0 (`boot`) always runs. With `kpin.probe=1`,
/// the opt-in step 19 (`user-probe`, `probe.rs`) follows; without it the transcript is
/// exactly `expected.txt`'s.
pub fn run_all() {
    for step in &STEPS {
        print("step ");
        print_dec2(step.number);
        print(" ");
        print(step.name);
        print(": ");
        if step.number == WAIT_ATTACH_BEFORE {
            wait_attach_if_requested();
        }
        if step.number != 0 && skip_requested(step.name, step.native_unsafe) {
            print("SKIPPED\n");
        } else {
            (step.run)();
        }
    }
    if crate::bootinfo::option("kpin.probe=") == Some(b"1") {
        print("step 19 user-probe: ");
        probe::user_probe();
    }
}

/// The step `kpin.wait_attach=1` waits before: the known loop, so that a window opened by
/// `kpin attach` covers it.
const WAIT_ATTACH_BEFORE: u64 = 7;
/// Port reading, in bit 0, whether a `kpin attach` window is open and, in bits 1-7, how
/// many have opened so far (`kpin_abi::ports`).
const ATTACH_STATUS_PORT: u16 = 0x0f12;

/// With `kpin.wait_attach=1`, spins until the VMM says an instrumentation window is open.
/// With `kpin.attach_cycles=N` (1-9), first goes through N windows: for each, waits until
/// a new one is open, calls the known loop once (1000 iterations of its body), marks that
/// with a write to the attach-status port, and waits until that window is over (closed, or
/// closed and another opened: a busy host may not run the guest in between). Nothing is
/// printed, so the transcript stays the native one.
fn wait_attach_if_requested() {
    let mut seen = 0;
    if let Some(&[n @ b'1'..=b'9']) = crate::bootinfo::option("kpin.attach_cycles=") {
        for _ in 0..n - b'0' {
            seen = wait_new_window(seen);
            let (_, iterations) = cpu::known_loop_1000(core::hint::black_box(0x1234));
            if crate::bootinfo::option("kpin.hold_irq=") == Some(b"1") {
                hold_an_interrupt(iterations as u8);
            }
            crate::cpu::outb(ATTACH_STATUS_PORT, iterations as u8);
            wait_window_over(seen);
        }
    }
    if crate::bootinfo::option("kpin.wait_attach=") == Some(b"1") {
        wait_new_window(seen);
    }
}

/// Port reads [`hold_an_interrupt`] makes with the interrupt held: well above the exits
/// after which the VMM withdraws a request the engine could not take (20 000).
const HELD_IRQ_READS: u32 = 100_000;

/// With `kpin.hold_irq=1`, in each window after the known loop: a timer interrupt made
/// pending while interrupts are disabled, a mark, [`HELD_IRQ_READS`] reads of the
/// attach-status port (exits) with it still pending — no safe point for the engine, so a
/// detach posted meanwhile is withdrawn — then the interrupt taken; the caller's mark
/// follows. The PIT ticks at 1 kHz: the first of the reads make sure it fired.
fn hold_an_interrupt(mark: u8) {
    crate::pic::pit_start();
    crate::pic::arm_timer(Some(1));
    for _ in 0..1000 {
        crate::cpu::inb(ATTACH_STATUS_PORT);
    }
    crate::cpu::outb(ATTACH_STATUS_PORT, mark);
    for _ in 0..HELD_IRQ_READS {
        crate::cpu::inb(ATTACH_STATUS_PORT);
    }
    crate::cpu::sti_hlt_cli();
}

/// The attach-status port: whether a window is open, and the windows opened so far.
fn window_status() -> (bool, u8) {
    let v = crate::cpu::inb(ATTACH_STATUS_PORT);
    (v & 1 != 0, v >> 1)
}

/// Spins until a window other than number `seen` is open; returns its number.
fn wait_new_window(seen: u8) -> u8 {
    loop {
        match window_status() {
            (true, n) if n != seen => return n,
            _ => core::hint::spin_loop(),
        }
    }
}

/// Spins until window number `n` is no longer the open one.
fn wait_window_over(n: u8) {
    while window_status() == (true, n) {
        core::hint::spin_loop();
    }
}
