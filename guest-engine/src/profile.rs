//! Where the engine's time goes: TSC cycles attributed to activities (translated code,
//! the dispatcher per exit kind, translation, each emulation kind, and slots the embedder
//! names — the image's gate operations and its shadow-MMU work).
//!
//! One activity is current at any time; [`switch`] reads the TSC, charges the cycles
//! since the last switch to the activity that was current, makes another one current and
//! counts an entry into it. Time is therefore *exclusive*: a gate call made by an
//! emulation is charged to the gate operation, not to the emulation, and the activities
//! add up to the whole run. Nothing is measured in translated code itself: the dispatcher
//! switches around each entry into the cache, so a run of translated code includes
//! whatever interrupted it on the way (the ring-0 interrupt stubs, and for a run that
//! ends in a hardware fault, the fault's trip through ring 0 — that run is charged to
//! [`TRANSLATED_TO_FAULT`] instead).
//!
//! Off until [`start`]; each switch then costs one `rdtsc` and a few stores. The state is
//! global (one vCPU per engine); it is kept in relaxed atomics, so concurrent host tests
//! only blur each other's numbers.

use core::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use crate::platform::SensitiveKind;

/// Unattributed engine work (the run loop between runs of the translator).
pub const ENGINE: usize = 0;
/// Translated code, from an entry into the cache until it exits to the dispatcher.
pub const TRANSLATED: usize = 1;
/// Translated code of runs that ended in a hardware fault (includes the fault's trip
/// through ring 0 to the cache's exit routine).
pub const TRANSLATED_TO_FAULT: usize = 2;
/// The dispatcher: fragment lookup, entry bookkeeping, attention and fault exits.
pub const DISPATCH: usize = 3;
/// Decoding, instrumenting and emitting new traces.
pub const TRANSLATE: usize = 4;
/// Direct exits: finding the target and linking.
pub const EXIT_DIRECT: usize = 5;
/// Indirect-branch lookup misses.
pub const EXIT_IBL_MISS: usize = 6;
/// Cross-page entries whose PA check failed: revalidation.
pub const EXIT_PA_MISMATCH: usize = 7;
/// Tool work outside the cache: memory-record buffers and analysis calls.
pub const TOOL: usize = 8;
/// The first emulation slot: `EMULATE + SensitiveKind as usize`.
pub const EMULATE: usize = 9;
/// The first slot the embedder names ([`EMBEDDER_SLOTS`] of them).
pub const EMBEDDER: usize = EMULATE + SensitiveKind::COUNT;
/// Slots the embedder may use from [`EMBEDDER`] on.
pub const EMBEDDER_SLOTS: usize = 32;
/// All slots.
pub const SLOTS: usize = EMBEDDER + EMBEDDER_SLOTS;

static ON: AtomicBool = AtomicBool::new(false);
static CURRENT: AtomicUsize = AtomicUsize::new(ENGINE);
static LAST: AtomicU64 = AtomicU64::new(0);
static CYCLES: [AtomicU64; SLOTS] = [const { AtomicU64::new(0) }; SLOTS];
static ENTRIES: [AtomicU64; SLOTS] = [const { AtomicU64::new(0) }; SLOTS];

#[inline(always)]
fn tsc() -> u64 {
    // SAFETY: `rdtsc` has no side effects; it is allowed at CPL 3 unless CR4.TSD is set,
    // which neither the engine image nor a host process sets.
    unsafe { core::arch::x86_64::_rdtsc() }
}

#[inline(always)]
fn add(a: &AtomicU64, v: u64) {
    // A load and a store, not a locked add: one vCPU writes these.
    a.store(a.load(Ordering::Relaxed).wrapping_add(v), Ordering::Relaxed);
}

/// Starts profiling: from now on the current activity is [`ENGINE`].
pub fn start() {
    LAST.store(tsc(), Ordering::Relaxed);
    CURRENT.store(ENGINE, Ordering::Relaxed);
    ON.store(true, Ordering::Relaxed);
}

/// Whether [`start`] was called.
pub fn on() -> bool {
    ON.load(Ordering::Relaxed)
}

/// Charges the cycles since the last switch to the current activity, makes `slot`
/// current, counts an entry into it and returns the activity that was current (for a
/// matching `switch` back). Does nothing (and returns `slot`) while profiling is off.
#[inline]
pub fn switch(slot: usize) -> usize {
    if !ON.load(Ordering::Relaxed) {
        return slot;
    }
    let slot = slot.min(SLOTS - 1);
    let now = tsc();
    let prev = CURRENT.load(Ordering::Relaxed);
    add(
        &CYCLES[prev],
        now.wrapping_sub(LAST.load(Ordering::Relaxed)),
    );
    add(&ENTRIES[slot], 1);
    LAST.store(now, Ordering::Relaxed);
    CURRENT.store(slot, Ordering::Relaxed);
    prev
}

/// Like [`switch`], but the cycles since the last switch (and the entry counted then)
/// are charged to `instead` rather than to the current activity: for work whose kind is
/// known only at its end (a cache run that ended in a fault, a page fault that turned out
/// to be self-modifying code). With `slot == instead` the work goes on there as the same
/// entry.
#[inline]
pub fn switch_charging(instead: usize, slot: usize) {
    if !ON.load(Ordering::Relaxed) {
        return;
    }
    let instead = instead.min(SLOTS - 1);
    let slot = slot.min(SLOTS - 1);
    let now = tsc();
    let prev = CURRENT.load(Ordering::Relaxed);
    if prev != instead {
        let e = &ENTRIES[prev];
        e.store(
            e.load(Ordering::Relaxed).saturating_sub(1),
            Ordering::Relaxed,
        );
        add(&ENTRIES[instead], 1);
    }
    add(
        &CYCLES[instead],
        now.wrapping_sub(LAST.load(Ordering::Relaxed)),
    );
    if slot != instead {
        // Else the work goes on in `instead`, as the entry just moved there.
        add(&ENTRIES[slot], 1);
    }
    LAST.store(now, Ordering::Relaxed);
    CURRENT.store(slot, Ordering::Relaxed);
}

/// The emulation slot of `kind`.
pub fn emulation_slot(kind: SensitiveKind) -> usize {
    EMULATE + kind as usize
}

/// Cycles and entries of one slot so far (the current activity's open interval is
/// charged first).
pub fn read(slot: usize) -> (u64, u64) {
    if slot >= SLOTS {
        return (0, 0);
    }
    (
        CYCLES[slot].load(Ordering::Relaxed),
        ENTRIES[slot].load(Ordering::Relaxed),
    )
}

/// Charges the open interval to the current activity (before reading a final profile).
pub fn settle() {
    if on() {
        let cur = CURRENT.load(Ordering::Relaxed);
        switch(cur);
        let e = &ENTRIES[cur];
        e.store(
            e.load(Ordering::Relaxed).saturating_sub(1),
            Ordering::Relaxed,
        );
    }
}

/// The library's name of `slot`, `None` for an embedder slot.
pub fn name(slot: usize) -> Option<&'static str> {
    Some(match slot {
        ENGINE => "engine: run loop, other",
        TRANSLATED => "translated code",
        TRANSLATED_TO_FAULT => "translated code, runs ending in a fault (incl. ring-0 trip)",
        DISPATCH => "dispatcher: lookup, attention, entry",
        TRANSLATE => "translation (decode, instrument, emit)",
        EXIT_DIRECT => "exit: direct (lookup, link)",
        EXIT_IBL_MISS => "exit: IBL miss (lookup, table fill)",
        EXIT_PA_MISMATCH => "exit: PA mismatch (revalidate)",
        TOOL => "tool: buffers and analysis calls",
        s if (EMULATE..EMBEDDER).contains(&s) => EMULATION_NAMES[s - EMULATE],
        _ => return None,
    })
}

const EMULATION_NAMES: [&str; SensitiveKind::COUNT] = [
    "emulate: cli/sti",
    "emulate: pushf/popf",
    "emulate: iret/far transfer",
    "emulate: syscall/sysret",
    "emulate: swapgs/fs-gs base",
    "emulate: control register",
    "emulate: debug register",
    "emulate: segment register",
    "emulate: descriptor table",
    "emulate: lar/lsl/verr/verw",
    "emulate: rdmsr/wrmsr",
    "emulate: port I/O",
    "emulate: hlt",
    "emulate: invlpg/cache",
    "emulate: cpuid",
    "emulate: int n",
    "emulate: ud/undecodable",
    "emulate: xgetbv/xsetbv",
    "emulate: pkru",
    "emulate: rdtscp/rdpid/rdpmc",
    "emulate: other",
];

/// The profile slot of the dispatcher's work after an exit of `kind`.
pub(crate) fn exit_slot(kind: u32) -> usize {
    use crate::arch::x86_64::entry as e;
    match kind {
        e::EXIT_DIRECT => EXIT_DIRECT,
        e::EXIT_IBL_MISS => EXIT_IBL_MISS,
        e::EXIT_PA_MISMATCH => EXIT_PA_MISMATCH,
        e::EXIT_BUFFER_FULL | e::EXIT_ANALYSIS_CALL => TOOL,
        _ => DISPATCH,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_every_emulation_kind_has_a_name_in_order() {
        assert_eq!(EMULATION_NAMES.len(), SensitiveKind::COUNT);
        assert_eq!(
            name(emulation_slot(SensitiveKind::Cpuid)),
            Some("emulate: cpuid")
        );
        assert_eq!(
            name(emulation_slot(SensitiveKind::Other)),
            Some("emulate: other")
        );
        assert_eq!(name(EMBEDDER), None);
    }
}
