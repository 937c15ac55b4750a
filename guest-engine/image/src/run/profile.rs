//! The run's cycle profile (`guest_engine::profile`): the image's own slots (the run
//! loop's shadow-MMU and delivery work; the gate's in `ring0/gate.rs`), the `profile`
//! object of `counters.json` and `profile.txt`, a table of where the cycles went.
//!
//! Profiling is always on: one `rdtsc` (~20-40 cycles) per switch, a few per exit, none in
//! translated code.

use alloc::string::String;
use alloc::vec::Vec;
use core::fmt::Write;

use guest_engine::profile::{self, EMBEDDER};

use crate::json::JsonObject;
use crate::ring0::gate::slot as gate_slot;

/// Hardware #PFs in translated code that the shadow MMU filled (a shadow miss).
pub const SHADOW_FILL: usize = EMBEDDER;
/// Write-protect faults on code frames (self-modifying code): invalidation, protection
/// dropped, or the store emulated.
pub const SMC_FAULT: usize = EMBEDDER + 1;
/// Guest faults: reflection and delivery through the guest's IDT (hardware faults in
/// translated code, fetch faults).
pub const GUEST_FAULT: usize = EMBEDDER + 2;
/// Interrupt delivery at an attention exit.
pub const INTERRUPT: usize = EMBEDDER + 3;
/// Applying the shadow MMU's work to the translator before a run (SMC invalidation of
/// frames written by emulations, dropped mappings).
pub const SHADOW_WORK: usize = EMBEDDER + 4;
/// The end-of-run report (statistics, tool files).
pub const REPORT: usize = EMBEDDER + 5;

/// The name of every slot, `None` for unused ones.
fn name(slot: usize) -> Option<&'static str> {
    if let Some(n) = profile::name(slot) {
        return Some(n);
    }
    if let Some(n) = gate_slot::name(slot) {
        return Some(n);
    }
    Some(match slot {
        SHADOW_FILL => "page fault: shadow fill",
        SMC_FAULT => "page fault: write to a code frame (SMC)",
        GUEST_FAULT => "guest fault: reflect and deliver",
        INTERRUPT => "interrupt delivery",
        SHADOW_WORK => "SMC/mapping invalidation before a run",
        REPORT => "final report",
        _ => return None,
    })
}

/// A JSON key for a slot name: lowercase letters and digits, `_` for the rest.
fn key(name: &str) -> String {
    let mut k = String::new();
    let mut gap = false;
    for c in name.chars() {
        if c.is_ascii_alphanumeric() {
            if gap && !k.is_empty() {
                k.push('_');
            }
            gap = false;
            k.push(c.to_ascii_lowercase());
        } else {
            gap = true;
        }
    }
    k
}

/// The slots with cycles, hottest first: (slot, cycles, entries).
fn rows() -> Vec<(usize, u64, u64)> {
    profile::settle();
    let mut rows: Vec<_> = (0..profile::SLOTS)
        .filter_map(|s| {
            let (c, n) = profile::read(s);
            (c > 0 && name(s).is_some()).then_some((s, c, n))
        })
        .collect();
    rows.sort_by_key(|r| core::cmp::Reverse(r.1));
    rows
}

/// Adds the `profile` object (`total_cycles`, then per slot `cycles` and `count`, the
/// entries into it) to `j`, and returns `profile.txt`'s table.
pub fn write(j: &mut JsonObject) -> String {
    let rows = rows();
    let total: u64 = rows.iter().map(|r| r.1).sum();
    j.begin("profile").u64("total_cycles", total);
    for &(s, c, n) in &rows {
        let name = name(s).unwrap_or("?");
        j.begin(&key(name)).u64("cycles", c).u64("count", n).end();
    }
    j.end();
    let mut t = String::new();
    let _ = writeln!(
        t,
        "kpin engine profile: TSC cycles by activity (exclusive: a gate call made by an emulation is the gate's)"
    );
    let _ = writeln!(t, "total {total} cycles");
    let _ = writeln!(
        t,
        "{:<62} {:>7} {:>16} {:>10} {:>10}",
        "activity", "%", "cycles", "count", "cyc/each"
    );
    for &(s, c, n) in &rows {
        let pct_x100 = if total == 0 {
            0
        } else {
            (u128::from(c) * 10_000 / u128::from(total)) as u64
        };
        let _ = writeln!(
            t,
            "{:<62} {:>4}.{:02} {:>16} {:>10} {:>10}",
            name(s).unwrap_or("?"),
            pct_x100 / 100,
            pct_x100 % 100,
            c,
            n,
            c.checked_div(n).unwrap_or(0)
        );
    }
    t
}
