//! Step `user-probe` (issue #11): a ring-3 task reads and writes the first address of every
//! PML4 slot, both halves, and [`user::PROBE_TARGETS`] (the engine window, the engine's
//! physmap, non-canonical addresses); none is mapped for user mode here, so each access
//! must fault as the CPU defines it: #PF with CR2 = the address and the error code's U/S
//! and W/R bits as the access (the P and RSVD bits are not printed: the native KVM of
//! DESIGN.md §2 reports slot 256 with RSVD set), or #GP(0) for a non-canonical address.
//! The kernel checks each fault when it is taken and continues after it; the step prints
//! only counts, so the line is the same natively and under the engine, where the engine's
//! own memory lies in these slots.
//!
//! The probe runs only with `kpin.probe=1` on the command line, after step 18 (it is not
//! in `expected.txt`): the transcript of every other run stays exactly as it was, and
//! `tests/minikernel_probe.rs` compares this line, natively and under the engine.

use crate::console::{newline, print, print_dec, print_ok};
use crate::global::Global;
use crate::traps::{TrapFrame, VEC_GP, VEC_PF};
use crate::user::{self, Program, PROBE_SLOTS_PER_RUN, PROBE_TARGETS};

/// #PF error code bits: W/R, U/S, I/D.
const PF_WRITE: u64 = 1 << 1;
const PF_USER: u64 = 1 << 2;
const PF_FETCH: u64 = 1 << 4;

/// Faults that were the #PF the access called for.
static PF_OK: Global<u64> = Global::new(0);
/// Faults that were the #GP(0) a non-canonical access calls for.
static GP_OK: Global<u64> = Global::new(0);
/// Faults at a probe instruction that were anything else.
static WRONG: Global<u64> = Global::new(0);
/// Set while the probe's ring-3 task runs.
static ACTIVE: Global<bool> = Global::new(false);

fn canonical(va: u64) -> bool {
    ((va << 16) as i64 >> 16) as u64 == va
}

/// Called for every exception from CPL 3 before it is fixed up: checks and counts a fault
/// of a probe access (RDI holds its address).
pub fn note_user_fault(frame: &TrapFrame, cr2: u64) {
    if !ACTIVE.get() {
        return;
    }
    let (read, write) = user::probe_access_vas();
    if frame.rip != read && frame.rip != write {
        return;
    }
    let addr = frame.rdi;
    let good = if canonical(addr) {
        let want_write = if frame.rip == write { PF_WRITE } else { 0 };
        frame.vector == VEC_PF
            && cr2 == addr
            && frame.error & (PF_WRITE | PF_USER | PF_FETCH) == want_write | PF_USER
    } else {
        frame.vector == VEC_GP && frame.error == 0
    };
    let counter = match (good, frame.vector) {
        (true, VEC_PF) => &PF_OK,
        (true, _) => &GP_OK,
        (false, _) => &WRONG,
    };
    counter.set(counter.get() + 1);
}

/// Step `user-probe`.
pub fn user_probe() {
    PF_OK.set(0);
    GP_OK.set(0);
    WRONG.set(0);
    ACTIVE.set(true);
    let mut unfaulted = 0;
    let mut slot = 0;
    while slot < 512 {
        unfaulted += user::run(Program::ProbeSlots, slot, None);
        slot += PROBE_SLOTS_PER_RUN;
    }
    unfaulted += user::run(Program::ProbeList, 0, None);
    ACTIVE.set(false);
    let accesses = 2 * (512 + PROBE_TARGETS.len() as u64);
    print_dec(accesses);
    print(" accesses: pf=");
    print_dec(PF_OK.get());
    print(" gp=");
    print_dec(GP_OK.get());
    print(" wrong=");
    print_dec(WRONG.get());
    print(" not-faulted=");
    print_dec(unfaulted);
    print(" all-faulted ");
    print_ok(PF_OK.get() + GP_OK.get() == accesses && unfaulted == 0);
    newline();
}
