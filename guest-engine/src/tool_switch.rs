//! Switching tools on a live engine (`kpin attach`/`detach` on a resident engine): the
//! old tool's translations and counters go, the engine's own stay.
//!
//! Invariant: after [`Engine::reset_for_new_tool`] no trace in the cache increments a
//! counter slot above the engine's own (the cache is flushed), and every such slot is
//! zero again, so the next tool's counters start from zero and slots are never exhausted
//! by a long series of windows.

use crate::dispatch::Engine;
use crate::insn_count::ENGINE_COUNTER_SLOTS;

impl Engine {
    /// Flushes the code cache and frees every counter slot a tool allocated (zeroed).
    /// The previous tool must not read its counters afterwards.
    pub fn reset_for_new_tool(&mut self) {
        self.flush();
        let first = self.insn_counters.map_or(0, |c| c.0 + ENGINE_COUNTER_SLOTS);
        let base = self.cache.counters();
        for slot in first..self.counters.next {
            // SAFETY: every slot below `counters.next` lies in the counter area of the
            // cache region (`alloc_counter` never hands out one beyond `COUNTER_SLOTS`);
            // no trace runs (the cache was just flushed) while it is zeroed.
            unsafe { ((base + 8 * u64::from(slot)) as *mut u64).write_volatile(0) };
        }
        self.counters.next = first;
    }
}
