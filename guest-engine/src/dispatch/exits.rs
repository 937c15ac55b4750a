//! The dispatcher's exit handlers: `Engine::run_inner`'s loop enters the cache, and one
//! method here per exit kind decides what runs next ([`Next`]) or why the run stops
//! (`Err(Stop)`).
//!
//! Invariants: as `dispatch.rs`'s. This is the hot path (every cache exit: unlinked
//! direct branches, IBL misses, buffer flushes, analysis calls), so the handlers are
//! `#[inline(always)]` into the loop, as when they were one function: no allocation, no
//! dynamic dispatch beyond the `Tool`/`Platform`/`GuestMemory` calls the loop always made.
//! `tp` is `Engine::run`'s tool holder: every `&mut **tp` formed here ends before the next
//! cache entry, the only other user of the tool.

use alloc::vec::Vec;

use super::{Engine, Next, Stop};
use crate::addr::{CachePc, GuestVirt};
use crate::arch::cache_enter;
use crate::arch::x86_64::entry::{
    split_exit_word, EXIT_ANALYSIS_CALL, EXIT_ATTENTION, EXIT_BUFFER_FULL, EXIT_DIRECT, EXIT_FAULT,
    EXIT_HOIST_MISS, EXIT_IBL_MISS, EXIT_PA_MISMATCH, EXIT_SENSITIVE,
};
use crate::error::EngineError;
use crate::fragment::ExitKind;
use crate::guest_memory::{GuestMemory, Mode};
use crate::instrument::{resolve_pa, IArg, Tool};
use crate::platform::{Emulation, Platform, SensitiveInsn};
use crate::profile;

impl Engine {
    /// Runs the cache from `target` until it exits; returns the exit word's kind and
    /// index (the exit counted in `Stats::exits`).
    #[inline(always)]
    pub(super) fn enter_cache(&mut self, target: CachePc) -> (u32, u32) {
        profile::switch(profile::TRANSLATED);
        // SAFETY: `target` is a fragment body or a resume PC inside the cache,
        // produced by the translator for the current context; the context holds a
        // guest state that code expects (the state at that point).
        unsafe { cache_enter(&self.cache.gen, self.cache.context(), target.0) };
        let (kind, idx) = split_exit_word(self.ctx().exit_word);
        if (kind as usize) < self.stats.exits.len() {
            self.stats.exits[kind as usize] += 1;
        }
        (kind, idx)
    }

    /// Enters fragment `id`'s body next, unless the attention byte is set: then the next
    /// turn is a lookup, which stops at `rip` before running anything.
    #[inline(always)]
    fn enter_unless_attention(&mut self, id: u32) -> Next {
        if self.ctx().attention != 0 {
            Next::Lookup
        } else {
            self.note_entered(id);
            Next::Enter(self.cache.fragments[id as usize].body())
        }
    }

    /// Handles the cache exit `(kind, idx)` that `enter_cache` returned.
    #[inline(always)]
    pub(super) fn on_exit(
        &mut self,
        kind: u32,
        idx: u32,
        mem: &mut dyn GuestMemory,
        platform: &mut dyn Platform,
        tp: *mut &mut dyn Tool,
        args: &mut Vec<u64>,
    ) -> Result<Next, Stop> {
        if kind == EXIT_FAULT {
            profile::switch_charging(profile::TRANSLATED_TO_FAULT, profile::DISPATCH);
            return Err(self.stop_at_fault());
        }
        profile::switch(profile::exit_slot(kind));
        // An IBL miss has no exit record: its target is in the context.
        if kind == EXIT_IBL_MISS {
            return self.on_ibl_miss(mem, platform, tp);
        }
        let Some(rec) = self.cache.exits.get(idx as usize).copied() else {
            return Err(Stop::Error(EngineError::MissingExitRecord {
                kind,
                index: idx,
            }));
        };
        let frag_start = self.cache.fragments[rec.fragment as usize].start;
        match (kind, rec.kind) {
            (
                EXIT_DIRECT,
                ExitKind::Direct {
                    target, patch_at, ..
                },
            ) => self.on_direct(mem, platform, tp, idx, rec.fragment, target, patch_at),
            (EXIT_SENSITIVE, ExitKind::Sensitive(s)) => self.on_sensitive(mem, platform, tp, s),
            (EXIT_ATTENTION, ExitKind::Attention) => {
                self.rip = frag_start;
                Err(Stop::Attention(frag_start))
            }
            (EXIT_PA_MISMATCH, ExitKind::PaMismatch) => {
                self.rip = frag_start;
                // A stale fragment (links undone) is looked up again.
                if self.revalidate(mem, rec.fragment) {
                    Ok(self.enter_unless_attention(rec.fragment))
                } else {
                    Ok(Next::Lookup)
                }
            }
            (EXIT_BUFFER_FULL, ExitKind::BufferFull { resume, held }) => {
                // The records of the instruction about to run stay: if it faults,
                // they are taken back (`drop_records_of`), never delivered.
                // SAFETY: see the module header.
                self.deliver_buffer_holding(mem, unsafe { &mut **tp }, usize::from(held));
                Ok(Next::Enter(resume))
            }
            (EXIT_HOIST_MISS, ExitKind::HoistMiss) => {
                // Rare (a guest base register near the zone): the trace is built
                // again without hoisting, where the check names the instruction.
                self.rip = frag_start;
                self.no_hoist.insert((frag_start.0, self.mode.0));
                self.drop_fragment(rec.fragment);
                Ok(Next::Lookup)
            }
            (EXIT_ANALYSIS_CALL, ExitKind::Call { call, resume }) => {
                let routine = self.eval_args(mem, platform, rec.fragment, call, args);
                // SAFETY: see the module header.
                unsafe { (**tp).analyze(routine, args) };
                Ok(Next::Enter(resume))
            }
            _ => Err(Stop::Error(EngineError::ExitKindMismatch {
                kind,
                index: idx,
            })),
        }
    }

    /// An indirect branch missed the IBL table: find or build its target, fill the
    /// current mode's tables (and return cache) so the next time stays in the cache.
    #[inline(always)]
    fn on_ibl_miss(
        &mut self,
        mem: &mut dyn GuestMemory,
        platform: &mut dyn Platform,
        tp: *mut &mut dyn Tool,
    ) -> Result<Next, Stop> {
        let va = GuestVirt(self.ctx().ibl_target);
        self.rip = va;
        if self.mode.is_stepping() {
            // The indirect branch completed: its trap comes before the target's
            // fetch (which may fault).
            return Err(Stop::Stepped(va));
        }
        // SAFETY: see the module header.
        let id = self.fragment_for(mem, platform, unsafe { &mut **tp }, va)?;
        if self.config.fill_ibl {
            let f = &self.cache.fragments[id as usize];
            let (entry, ret_entry) = (f.entry(), f.ret_entry());
            let global = self.lookup_global;
            self.cache.ibl_insert(self.table_slot, va, entry, global);
            if self.config.return_cache {
                self.cache.rc_insert(self.table_slot, va, ret_entry, global);
            }
        }
        Ok(self.enter_unless_attention(id))
    }

    /// An unlinked direct branch of fragment `from` (exit `idx`, branch at `patch_at`)
    /// left for `target`: find or build it and link the branch to it, unless the cache
    /// was flushed while translating (the exit then belongs to a dropped fragment).
    #[inline(always)]
    // The dispatcher's three (memory, platform, tool) and the exit record's four: inlined
    // into the loop, a struct of them would only be taken apart again.
    #[allow(clippy::too_many_arguments)]
    fn on_direct(
        &mut self,
        mem: &mut dyn GuestMemory,
        platform: &mut dyn Platform,
        tp: *mut &mut dyn Tool,
        idx: u32,
        from: u32,
        target: GuestVirt,
        patch_at: CachePc,
    ) -> Result<Next, Stop> {
        self.rip = target;
        if self.mode.is_stepping() {
            // One instruction done; nothing is linked while stepping.
            return Err(Stop::Stepped(target));
        }
        let gen = self.cache.generation;
        // SAFETY: see the module header.
        let id = self.fragment_for(mem, platform, unsafe { &mut **tp }, target)?;
        if self.config.link_direct && gen == self.cache.generation {
            self.link(idx, from, id, patch_at, self.lookup_global);
        }
        Ok(self.enter_unless_attention(id))
    }

    /// A sensitive instruction `s`: the platform emulates it (or stops the run on it);
    /// its fetch record goes to the tool only once it has run.
    #[inline(always)]
    fn on_sensitive(
        &mut self,
        mem: &mut dyn GuestMemory,
        platform: &mut dyn Platform,
        tp: *mut &mut dyn Tool,
        s: SensitiveInsn,
    ) -> Result<Next, Stop> {
        self.rip = s.pc;
        // Emulation may change mappings (CR3, INVLPG, mode): the pending
        // records resolve their PAs under the ones their accesses used.
        // SAFETY: see the module header.
        let fetch = self.emulated_fetch(mem, unsafe { &mut **tp }, &s);
        profile::switch(profile::emulation_slot(s.kind));
        let emulation = self.emulate(platform, &s);
        profile::switch(profile::DISPATCH);
        // The running task changed at this instruction: the tool's records so far (all
        // delivered above) were the old task's; the instruction's fetch is the new one's.
        if let Some(row) = platform.take_task_switch() {
            // SAFETY: see the module header.
            Self::deliver_task(unsafe { &mut **tp }, row);
        }
        match emulation {
            Emulation::Continue(n) => {
                // SAFETY: see the module header.
                Self::deliver_fetch(unsafe { &mut **tp }, fetch);
                self.count_emulated();
                self.rip = n;
                if self.mode.is_stepping() {
                    return Err(Stop::Stepped(n));
                }
                Ok(Next::Lookup)
            }
            Emulation::Switch {
                next,
                mode,
                invalidate_mappings,
            } => {
                // SAFETY: see the module header.
                Self::deliver_fetch(unsafe { &mut **tp }, fetch);
                self.count_emulated();
                self.switch_after_emulation(mem, tp, next, mode, invalidate_mappings)
            }
            Emulation::Stop => {
                self.held_fetch = fetch;
                Err(Stop::Sensitive(s))
            }
        }
    }

    /// `platform.emulate(s)`, with the virtual IF/IOPL that inline-flag code keeps in the
    /// cache context handed to the platform before and taken back after, and the
    /// selectors inline `mov r, sreg` reads taken back after.
    #[inline(always)]
    fn emulate(&mut self, platform: &mut dyn Platform, s: &SensitiveInsn) -> Emulation {
        if self.config.inline_virtual_flags {
            let (vif, iopl) = self.virtual_flags();
            platform.set_virtual_flags(vif, iopl);
        }
        let emulation = platform.emulate(s, &mut self.ctx_mut().regs);
        if let Some((vif, iopl)) = platform
            .virtual_flags()
            .filter(|_| self.config.inline_virtual_flags)
        {
            self.set_virtual_flags(vif, iopl);
        }
        if let Some(sel) = platform
            .selectors()
            .filter(|_| self.config.inline_virtual_flags)
        {
            self.set_selectors(sel);
        }
        emulation
    }

    /// After an emulated instruction that changed the mode or the mappings
    /// (`Emulation::Switch`): continue at `next` in `mode`.
    #[inline(always)]
    fn switch_after_emulation(
        &mut self,
        mem: &mut dyn GuestMemory,
        tp: *mut &mut dyn Tool,
        next: GuestVirt,
        mode: Mode,
        invalidate_mappings: bool,
    ) -> Result<Next, Stop> {
        self.rip = next;
        // The trap follows the TF the instruction began with.
        let stepped = self.mode.is_stepping();
        if mode != self.mode {
            // Pending records resolve their PAs in their own mode.
            // SAFETY: see the module header.
            self.deliver_buffer(mem, unsafe { &mut **tp });
            self.set_mode(mode).map_err(Stop::Error)?;
        }
        if invalidate_mappings {
            self.invalidate_all_mappings();
        }
        if stepped {
            return Err(Stop::Stepped(next));
        }
        if self.mode.is_stepping() {
            // The embedder checks around every stepped instruction
            // and needs the state before the first.
            return Err(Stop::EnteredStepping(next));
        }
        Ok(Next::Lookup)
    }

    /// The arguments of analysis call `call` of fragment `frag`, evaluated against the
    /// guest state at the exit, into `out`; returns the routine to call.
    fn eval_args(
        &self,
        mem: &mut dyn GuestMemory,
        platform: &mut dyn Platform,
        frag: u32,
        call: usize,
        out: &mut Vec<u64>,
    ) -> u32 {
        let f = &self.cache.fragments[frag as usize];
        let c = &f.calls[call];
        let regs = &self.ctx().regs;
        out.clear();
        let mut ea = |m: &crate::instrument::MemOperand| {
            m.effective_address(regs)
                .wrapping_add(platform.segment_base(m.seg))
        };
        for a in &c.args {
            let v = match *a {
                IArg::InstPtr => c.ins.address.0,
                IArg::MemEa(n) => c.ins.mem.get(usize::from(n)).map_or(0, &mut ea),
                IArg::MemPa(n) => c
                    .ins
                    .mem
                    .get(usize::from(n))
                    .map_or(u64::MAX, |m| resolve_pa(mem, self.mode, ea(m), false)),
                IArg::MemSize(n) => c
                    .ins
                    .mem
                    .get(usize::from(n))
                    .map_or(0, |m| u64::from(m.size)),
                IArg::Reg(r) => regs.get(r),
                IArg::Const(k) => k,
            };
            out.push(v);
        }
        c.routine
    }

    /// Drops fragment `id` from lookup and undoes the links into it.
    fn drop_fragment(&mut self, id: u32) {
        let f = &self.cache.fragments[id as usize];
        let key = (f.start.0, f.pa.0, f.mode.0);
        self.cache.remove_key(&key);
        self.unlink_incoming(id);
        self.cache.clear_lookups();
    }
}
