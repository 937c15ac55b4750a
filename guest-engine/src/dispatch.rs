//! The dispatcher, the `Engine` hub (DynamoRIO's `dispatch.c`): looks up or builds
//! fragments, enters the cache, and handles every exit (direct exits are linked through
//! `link.rs`, IBL misses fill the lookup tables, sensitive instructions go to the
//! `Platform`, buffers and analysis calls to the `Tool`, `PA_MISMATCH` to `softtlb.rs`,
//! `FAULT` to `recover.rs`).
//!
//! Invariants: whenever control is in the dispatcher, `CacheContext::regs` holds the
//! guest's complete integer state and `Engine::rip` the guest RIP it belongs to (or, for
//! resumable exits, the state at the recorded resume PC). Code running in the cache
//! belongs to fragments of the engine's current mode (a mode changes only while the
//! dispatcher has control, and lookups and links never cross modes), so an IBL miss fills
//! the current mode's tables. The dispatcher caches no VA → PA translation of its own:
//! every lookup asks `GuestMemory::translate`.

mod exits;

use core::sync::atomic::AtomicU64;

use alloc::collections::BTreeSet;
use alloc::vec::Vec;

use crate::addr::{CachePc, GuestPhys, GuestVirt};
use crate::arch::x86_64::entry::EXIT_KINDS;
use crate::arch::{decode_trace, translate_trace, DecodedTrace, EmitEnv, Scratch, Translated};
use crate::code_cache::CodeCache;
use crate::context::{CacheContext, GuestRegs};
use crate::error::EngineError;
use crate::fragment::{EntryOffsets, ExitKind, ExitRecord, Fragment};
use crate::guest_memory::{GuestMemory, Mode};
use crate::insn_count::ENGINE_COUNTER_SLOTS;
use crate::instrument::{
    access, Action, CallSpec, CounterAlloc, CounterId, IPoint, Insertion, MemRecord, Tool,
    TraceInstrumenter,
};
use crate::layout::{COUNTER_SLOTS, RECENT_TRACES};
use crate::pc_map::PcMap;
use crate::platform::{Platform, SensitiveInsn};
use crate::profile;
use crate::softtlb::SoftTlb;

/// Start pages whose lookups an invalidation clears one by one; more and the lookup
/// tables are emptied whole.
const MAX_PAGE_CLEARS: usize = 8;

/// Engine configuration.
#[derive(Clone, Copy, Debug)]
pub struct Config {
    /// Link direct exits (off: every direct branch goes through the dispatcher).
    pub link_direct: bool,
    /// Fill the indirect-branch lookup table (off: every indirect branch misses).
    pub fill_ibl: bool,
    /// Run analysis calls without leaving the cache (calls with `IArg::MemPa` always exit).
    pub inline_calls: bool,
    /// The tool's analysis routines leave x87/SSE/AVX state alone, so inline calls need
    /// not save it even when `save_extended_state` is set (always true for the soft-float
    /// in-guest build; on the host only for routines that provably use no vector code).
    pub analysis_preserves_vector_state: bool,
    /// Translate `ret` through the return cache (else through the hash lookup).
    pub return_cache: bool,
    /// Count IBL lookups in generated code (costs a few instructions per lookup).
    pub count_ibl_lookups: bool,
    /// Swap x87/SSE/AVX state at cache entry/exit (needed when the engine itself uses
    /// vector registers, as host builds do).
    pub save_extended_state: bool,
    /// Initial translation mode (`Engine::set_mode` changes it).
    pub mode: Mode,
    /// The engine counts the guest instructions it executes, per mode
    /// (`Engine::executed_insns`): one inline counter increment per basic block.
    pub count_insns: bool,
    /// Memory-reference buffer capacity in records.
    pub record_buffer_records: usize,
    /// Fill `MemRecord::pa` before handing buffers to the tool.
    pub records_need_pa: bool,
    /// Optional monotonic clock in nanoseconds, used for translation-time statistics.
    pub clock_ns: Option<fn() -> u64>,
    /// Optional memory-pressure test, asked before each new translation: `true` flushes
    /// the cache whole first, as a full cache does (an embedder with a fixed heap bounds
    /// the fragment and exit tables, which keep invalidated fragments until a flush).
    pub memory_pressure: Option<fn() -> bool>,
    /// Check every translated memory operand that may reach the reserved zone, PML4
    /// slots 256–259 (`arch::x86_64::isolate`); a hit is a #UD at the instruction
    /// (`Stop::Fault`), which `isolation::classify_fault` explains.
    pub isolate: bool,
    /// Translate `cli`, `sti` (unless a `hlt` follows), `pushfq` and `popfq` of virtual
    /// CPL 0 inline against the virtual IF and IOPL in the cache context
    /// (`Engine::set_virtual_flags`), instead of exits to the platform; the platform sees
    /// them through `Platform::set_virtual_flags` / `virtual_flags` around every
    /// emulation.
    pub inline_virtual_flags: bool,
    /// Undefined flags the CPU that runs the translations in fact writes
    /// ([`crate::host_flags::probe`]); flags liveness treats them as written. The default
    /// claims nothing.
    pub host_flags: crate::HostFlags,
    /// The key of the hash that tells a dropped trace's guest bytes unchanged (revival,
    /// `crate::revive`): draw it at random (e.g. from the TSC) so that guest code cannot
    /// construct a collision.
    pub code_hash_key: [u64; 2],
}

impl Default for Config {
    fn default() -> Self {
        Self {
            link_direct: true,
            fill_ibl: true,
            return_cache: true,
            inline_calls: true,
            analysis_preserves_vector_state: false,
            count_ibl_lookups: false,
            save_extended_state: false,
            mode: Mode::KERNEL,
            count_insns: false,
            record_buffer_records: 4096,
            records_need_pa: false,
            clock_ns: None,
            memory_pressure: None,
            isolate: true,
            inline_virtual_flags: false,
            host_flags: crate::HostFlags {
                logic_af_written: false,
            },
            code_hash_key: [0x6b70_696e_5f6b_6579, 0x636f_6465_5f68_6173],
        }
    }
}

/// Counters of what the engine did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Fragments built.
    pub fragments: u64,
    /// Guest instructions translated.
    pub guest_insns: u64,
    /// Guest code bytes translated.
    pub guest_bytes: u64,
    /// Code-cache bytes produced.
    pub cache_bytes: u64,
    /// Whole-cache flushes.
    pub flushes: u64,
    /// Of them, flushes for `Config::memory_pressure`.
    pub pressure_flushes: u64,
    /// Exits by kind (index = exit code).
    pub exits: [u64; EXIT_KINDS],
    /// Direct links made.
    pub links: u64,
    /// Nanoseconds spent translating (if a clock was configured).
    pub translate_ns: u64,
    /// With `Config::count_insns`: sensitive instructions the platform emulated, or the
    /// translation ran inline in its place (an `iretq` of virtual CPL 0; counted in
    /// `Engine::executed_insns`, outside any block counter).
    pub emulated_insns: u64,
    /// With `Config::count_insns`: instructions taken back from block counts because a
    /// fault left the rest of their block unexecuted.
    pub insns_taken_back: u64,
    /// Fragments dropped by a write to their frame and looked up again, their guest
    /// bytes unchanged, instead of retranslated (`crate::revive`).
    pub revived: u64,
}

/// Why `Engine::run` returned. Guest events are values, not errors.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Stop {
    /// The guest transferred control to an address it cannot fetch from.
    FetchFault(GuestVirt),
    /// A sensitive instruction the platform did not emulate.
    Sensitive(SensitiveInsn),
    /// The attention byte was set; the guest is stopped before `GuestVirt`.
    Attention(GuestVirt),
    /// In a stepping mode (`Mode::stepping`): one guest instruction completed, the
    /// guest is stopped before `GuestVirt` (the single-step trap is the embedder's).
    Stepped(GuestVirt),
    /// An emulated instruction switched to a stepping mode: the guest is stopped before
    /// `GuestVirt`, the first instruction to step.
    EnteredStepping(GuestVirt),
    /// A synchronous fault in translated code, mapped back to the guest: the guest state
    /// (registers in `Engine::regs`, RIP) is exactly that before `guest_pc` executes.
    Fault {
        /// The faulting guest instruction.
        guest_pc: GuestVirt,
        /// Where in the cache it faulted.
        cache_pc: CachePc,
    },
    /// An engine failure.
    Error(EngineError),
}

/// One vCPU's translator, code cache and dispatcher. (Fields are crate-visible because
/// the `impl Engine` blocks of `recover`, `link`, `insn_count`, `attention` and `softtlb`
/// use them; outside the crate only the methods exist.)
pub struct Engine {
    pub(crate) cache: CodeCache,
    /// The SoftTLB table in the cache region (`softtlb.rs`).
    pub(crate) softtlb: SoftTlb,
    pub(crate) config: Config,
    pub(crate) mode: Mode,
    /// `mode.slot()`: the mode's counters.
    pub(crate) slot: usize,
    /// `mode.table_slot()`: the mode's lookup tables.
    pub(crate) table_slot: usize,
    pub(crate) counters: CounterAlloc,
    /// First of the `MODE_SLOTS × INSN_COUNTER_SPREAD` counters of executed guest
    /// instructions (`Config::count_insns`).
    pub(crate) insn_counters: Option<CounterId>,
    /// Fragments last entered from the dispatcher: a ring indexed by `recent_n`.
    recent: [(GuestVirt, Mode); RECENT_TRACES],
    recent_n: usize,
    pub(crate) buffer: Vec<MemRecord>,
    /// The fetch record of the instruction the platform last stopped on (`insn_count.rs`).
    pub(crate) held_fetch: Option<MemRecord>,
    /// Traces (start, mode) whose hoisted isolation checks hit once: built without
    /// hoisting from then on.
    pub(crate) no_hoist: BTreeSet<(u64, u32)>,
    /// `PcMap::encode`'s buffer, kept across traces.
    pc_map_scratch: Vec<u8>,
    /// The block counts of the trace being registered (`insn_count::encode_block_counts`),
    /// kept across traces.
    block_counts_scratch: Vec<u8>,
    /// Whether the page of the VA `fragment_for` last looked up is global (the lookup
    /// tables it fills then keep the entry across `invalidate_nonglobal_mappings`).
    pub(crate) lookup_global: bool,
    pub(crate) rip: GuestVirt,
    pub(crate) stats: Stats,
    pub(crate) scratch: Scratch,
    /// Where a fault handler stores the faulting cache PC, if not `ctx.fault_pc`
    /// ([`Engine::take_fault_pc_from`]).
    pub(crate) fault_pc_cell: Option<&'static AtomicU64>,
}

enum Next {
    /// Look up / translate at `rip` and enter its body.
    Lookup,
    /// Enter at a cache PC.
    Enter(CachePc),
}

impl Engine {
    /// Creates an engine over the raw region `base..base+len`.
    ///
    /// # Safety
    /// The region must be readable, writable and executable, page aligned, owned by the
    /// engine for its lifetime and smaller than 2 GiB.
    pub unsafe fn new(base: *mut u8, len: usize, config: Config) -> Result<Self, EngineError> {
        let unknown = EngineError::UnknownMode(config.mode.0);
        let slot = config.mode.slot().ok_or(unknown.clone())?;
        let table_slot = config.mode.table_slot().ok_or(unknown)?;
        // SAFETY: forwarded caller contract.
        let cache = unsafe { CodeCache::new(base, len, config.save_extended_state)? };
        // SAFETY: `CodeCache::new` accepted the region, so it is carved per `layout`; the
        // engine owns it for its lifetime (caller contract).
        let softtlb = unsafe { SoftTlb::new(base as u64) };
        let records = config.record_buffer_records.max(1);
        // The engine's own counters are ordinary counter slots (zeroed with the region),
        // allocated before any tool's.
        let mut counters = CounterAlloc::default();
        let insn_counters = config.count_insns.then(|| {
            // Each mode's spread counters, then the inline emulations'.
            counters.next = ENGINE_COUNTER_SLOTS;
            CounterId(0)
        });
        let mut e = Self {
            cache,
            softtlb,
            config,
            mode: config.mode,
            slot,
            table_slot,
            counters,
            insn_counters,
            recent: [(GuestVirt(0), Mode::KERNEL); RECENT_TRACES],
            recent_n: 0,
            buffer: alloc::vec![MemRecord::default(); records],
            held_fetch: None,
            no_hoist: BTreeSet::new(),
            pc_map_scratch: Vec::new(),
            block_counts_scratch: Vec::new(),
            lookup_global: false,
            rip: GuestVirt(0),
            stats: Stats::default(),
            scratch: Scratch::new(),
            fault_pc_cell: None,
        };
        e.reset_buffer();
        Ok(e)
    }

    pub(crate) fn ctx(&self) -> &CacheContext {
        // SAFETY: the context lies at the start of the region we own; the cache is not
        // running while the dispatcher holds `&self`.
        unsafe { &*self.cache.context() }
    }

    pub(crate) fn ctx_mut(&mut self) -> &mut CacheContext {
        // SAFETY: as in `ctx`, and `&mut self` makes the access exclusive.
        unsafe { &mut *self.cache.context() }
    }

    /// Guest registers (valid between runs).
    pub fn regs(&self) -> &GuestRegs {
        &self.ctx().regs
    }

    /// Mutable guest registers.
    pub fn regs_mut(&mut self) -> &mut GuestRegs {
        &mut self.ctx_mut().regs
    }

    /// Guest RIP.
    pub fn rip(&self) -> GuestVirt {
        self.rip
    }

    /// Sets the guest RIP.
    pub fn set_rip(&mut self, rip: GuestVirt) {
        self.rip = rip;
    }

    /// Statistics so far.
    pub fn stats(&self) -> Stats {
        let mut s = self.stats;
        s.emulated_insns += self.inline_emulated();
        s
    }

    /// The translation mode of the next lookups and translations.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Sets the translation mode (the embedder calls this when the guest's virtual CPL
    /// changes between runs; inside a run, `Emulation::Switch` does it). Cheap: each mode
    /// has its own lookup tables, nothing is cleared.
    pub fn set_mode(&mut self, mode: Mode) -> Result<(), EngineError> {
        self.slot = mode.slot().ok_or(EngineError::UnknownMode(mode.0))?;
        self.table_slot = mode.table_slot().ok_or(EngineError::UnknownMode(mode.0))?;
        self.mode = mode;
        Ok(())
    }

    /// The last (up to `layout::RECENT_TRACES`) fragments the dispatcher entered, oldest
    /// first, for failure dumps. Transitions inside the cache (links, IBL and
    /// return-cache hits) are not seen.
    pub fn recent_traces(&self) -> impl Iterator<Item = (GuestVirt, Mode)> + '_ {
        let n = self.recent_n;
        (n.saturating_sub(RECENT_TRACES)..n).map(|i| self.recent[i % RECENT_TRACES])
    }

    fn note_entered(&mut self, id: u32) {
        let f = &self.cache.fragments[id as usize];
        self.recent[self.recent_n % RECENT_TRACES] = (f.start, f.mode);
        self.recent_n += 1;
    }

    /// Fragments currently reachable by lookup (all modes).
    pub fn fragment_count(&self) -> usize {
        self.cache.live_fragments()
    }

    /// IBL lookups counted by generated code (`Config::count_ibl_lookups`).
    pub fn ibl_lookups(&self) -> u64 {
        self.ctx().ibl_lookups
    }

    /// Code-cache bytes currently holding fragments.
    pub fn cache_used_bytes(&self) -> usize {
        self.cache.used_bytes()
    }

    /// Value of an inline counter.
    pub fn counter(&self, id: CounterId) -> u64 {
        if id.0 as usize >= COUNTER_SLOTS {
            return 0;
        }
        // SAFETY: the slot lies in the counter area of the region.
        unsafe { ((self.cache.counters() + 8 * u64::from(id.0)) as *const u64).read() }
    }

    /// Drops every translation (whole-cache flush).
    pub fn flush(&mut self) {
        self.cache.flush();
        self.stats.flushes += 1;
    }

    fn now(&self) -> u64 {
        self.config.clock_ns.map_or(0, |c| c())
    }

    /// Finds or builds the fragment for `va` in the current mode: [`Engine::lookup`], else
    /// decode and [`Engine::instrument`], [`Engine::emit`], [`Engine::register`].
    fn fragment_for(
        &mut self,
        mem: &mut dyn GuestMemory,
        platform: &mut dyn Platform,
        tool: &mut dyn Tool,
        va: GuestVirt,
    ) -> Result<u32, Stop> {
        let pa = match self.lookup(mem, va)? {
            Ok(id) => return Ok(id),
            Err(pa) => pa,
        };
        if let Some(id) = self.revive(mem, va, pa) {
            return Ok(id);
        }
        if self.config.memory_pressure.is_some_and(|f| f()) {
            self.flush();
            self.stats.pressure_flushes += 1;
        }
        let t0 = self.now();
        let prof_prev = profile::switch(profile::TRANSLATE);
        let mode = self.mode;
        let inline_flags = self.config.inline_virtual_flags;
        let decoded = decode_trace(mem, va, pa, mode, inline_flags, &mut self.scratch)
            .map_err(|f| Stop::FetchFault(f.0))?;
        // (The fetch buffer still holds the bytes decoded.)
        let code = decoded.code_len().map_or((0, 0), |n| {
            let bytes = &self.scratch.fetch_buf()[..usize::from(n)];
            (
                n,
                crate::revive::code_hash(self.config.code_hash_key, bytes),
            )
        });
        if mode.cpl() == 3 {
            // Where user code came from, per physical page (`crate::tasks`).
            platform.user_code(va, pa);
        }
        // Once for the engine's count points and the translation.
        let mut live = core::mem::take(&mut self.scratch.live);
        crate::arch::flags_liveness(&decoded, &mut live, self.config.host_flags);
        let (insertions, calls) = self.instrument(tool, va, &decoded, &live);
        // An emulated instruction's fetch record is the dispatcher's: a tool that takes
        // them keeps every `iretq` emulated.
        let inline_iret = self.config.inline_virtual_flags
            && mode.cpl() == 0
            && !mode.is_stepping()
            && !mode.is_compat()
            && !tool.records_fetches();
        let tr = self.emit(va, &decoded, &live, &insertions, &calls, inline_iret);
        let mut block_counts = core::mem::take(&mut self.block_counts_scratch);
        block_counts.clear();
        if self.insn_counters.is_some() {
            crate::insn_count::encode_block_counts(
                &decoded.bbls,
                &decoded.info,
                &live,
                va.0,
                &mut block_counts,
            );
        }
        self.scratch.live = live;
        let tr = tr?;
        let id = self.register(va, pa, code, &tr, &block_counts, calls);
        self.block_counts_scratch = block_counts;
        self.stats.guest_insns += decoded.insns.len() as u64;
        self.stats.guest_bytes += decoded.guest_bytes;
        // The next translation reuses their storage.
        self.scratch.tx.recycle(tr);
        self.scratch.recycle_trace(decoded);
        self.scratch.insertions = insertions;
        self.stats.translate_ns += self.now().wrapping_sub(t0);
        profile::switch(prof_prev);
        Ok(id)
    }

    /// The fragment already translated for `va` in the current mode (`Ok(Ok(id))`), else
    /// the physical address its trace starts at (`Ok(Err(pa))`); a `FetchFault` when `va`
    /// is not mapped for a fetch.
    fn lookup(
        &mut self,
        mem: &mut dyn GuestMemory,
        va: GuestVirt,
    ) -> Result<Result<u32, GuestPhys>, Stop> {
        let mode = self.mode;
        if let Some((pa, id, global)) = self.cache.fast.get(va, mode) {
            self.note_mapping(va, pa, global);
            self.lookup_global = global;
            return Ok(Ok(id));
        }
        let (pa_page, global) = mem
            .translate_global(va.page(), mode)
            .ok_or(Stop::FetchFault(va))?;
        let pa = GuestPhys(pa_page.0 + (va.0 - va.page().0));
        self.note_mapping(va, pa, global);
        self.lookup_global = global;
        if let Some(id) = self.cache.lookup(va, pa, mode) {
            self.cache.fast.put(va, mode, pa, id, global);
            return Ok(Ok(id));
        }
        Ok(Err(pa))
    }

    /// What runs around the trace's instructions: the engine's block counts first at each
    /// block start, the tool's fetch records, then the tool's own insertions; and the
    /// tool's analysis calls.
    fn instrument(
        &mut self,
        tool: &mut dyn Tool,
        va: GuestVirt,
        decoded: &DecodedTrace,
        live: &[u32],
    ) -> (Vec<Insertion>, Vec<CallSpec>) {
        // The kept storage of the previous trace's list (`fragment_for` returns it).
        let mut insertions = core::mem::take(&mut self.scratch.insertions);
        insertions.clear();
        self.block_count_insertions(&decoded.bbls, live, &mut insertions);
        let mut ti = TraceInstrumenter::new(
            va,
            decoded.pa,
            self.mode,
            &decoded.info,
            &decoded.bbls,
            &mut self.counters,
        );
        tool.instrument_trace(&mut ti);
        if tool.records_fetches() && tool.fetch_runs() {
            insertions.extend(crate::records::fetch_runs(
                &decoded.info,
                &decoded.bbls,
                &ti.insertions,
                self.config.records_need_pa || tool.records_need_pa(),
                tool.call_stack_records(),
            ));
        } else if tool.records_fetches() {
            insertions.extend((0..decoded.info.len()).map(|ins| Insertion {
                ins,
                point: IPoint::Before,
                action: Action::FetchRecord,
            }));
        }
        insertions.append(&mut ti.insertions);
        let calls = core::mem::take(&mut ti.calls);
        (insertions, calls)
    }

    /// Translates the instrumented trace for the cache's current end, flushing the cache
    /// once if it does not fit.
    fn emit(
        &mut self,
        va: GuestVirt,
        decoded: &DecodedTrace,
        live: &[u32],
        insertions: &[Insertion],
        calls: &[CallSpec],
        inline_iret: bool,
    ) -> Result<Translated, Stop> {
        let mode = self.mode;
        let mut flushed = false;
        loop {
            let (base, room) = self.cache.cursor();
            let env = EmitEnv {
                base,
                ctx: self.cache.ctx,
                gen: self.cache.gen,
                ibl_table: self.cache.ibl_table(self.table_slot),
                ibl_shared: self.cache.gen.ibl_shared[self.table_slot],
                softtlb_slot: self.softtlb.slot(va),
                counters: self.cache.counters(),
                count_ibl: self.config.count_ibl_lookups,
                rc_table: self.cache.rc_table(self.table_slot),
                // A stepping `ret` goes through the (empty) hash table: it must leave;
                // 32-bit code's returns go through the hash table too.
                return_cache: self.config.return_cache && !mode.is_stepping() && !mode.is_compat(),
                inline_calls: self.config.inline_calls,
                call_xsave: (self.config.save_extended_state
                    && !self.config.analysis_preserves_vector_state)
                    .then(|| self.cache.xsave_guest()),
                exit_base: self.cache.exits.len() as u32,
                record_bits: u32::from(mode.cpl()) << access::CPL_SHIFT,
                upper_half: va.0 >> 63 == 1,
                isolate: self.config.isolate,
                fence: crate::arch::Fence::for_cpl(mode.cpl()),
                hoist: !self.no_hoist.contains(&(va.0, mode.0)) && !mode.is_stepping(),
                compat: mode.is_compat(),
                inline_iret,
                iret_counters: self.inline_iret_counters(),
            };
            let tr = translate_trace(decoded, live, insertions, calls, &env, &mut self.scratch)
                .map_err(Stop::Error)?;
            let (fragments, exits) = (self.cache.fragments.len(), self.cache.exits.len());
            if tr.code.len() <= room
                && fragments < crate::code_cache::MAX_FRAGMENTS
                && exits + tr.exits.len() <= crate::code_cache::MAX_EXITS
            {
                return Ok(tr);
            }
            if flushed {
                return Err(Stop::Error(EngineError::TraceTooLarge(va)));
            }
            self.flush();
            flushed = true;
        }
    }

    /// Commits `tr` to the cache as a new fragment with its exit records and
    /// `block_counts` (kept in its PC map for the fault path), and makes it findable;
    /// returns its id.
    fn register(
        &mut self,
        va: GuestVirt,
        pa: GuestPhys,
        code: (u16, u64),
        tr: &Translated,
        block_counts: &[u8],
        calls: Vec<CallSpec>,
    ) -> u32 {
        let mode = self.mode;
        let base = self.cache.commit(&tr.code);
        let id = self.cache.fragments.len() as u32;
        let at = |off: usize| CachePc(base.0 + off as u64);
        for e in &tr.exits {
            let kind = ExitKind::committed(*e, at);
            self.cache.exits.push(ExitRecord { fragment: id, kind });
        }
        let off = |o: usize| u32::try_from(o).expect("a trace's code is far below 4 GiB");
        let offsets = EntryOffsets {
            checked_entry: off(tr.checked_entry),
            ret_entry: off(tr.ret_entry),
            entry: off(tr.entry),
            body: off(tr.body),
            loop_entry: tr
                .loop_entry
                .map(|o| core::num::NonZeroU32::new(off(o)).expect("past the PA check")),
        };
        self.cache.fragments.push(Fragment {
            start: va,
            pa,
            code_hash: code.1,
            base,
            mode,
            len: off(tr.code.len()),
            offsets,
            code_len: code.0,
            pc_map: PcMap::encode(&tr.marks, va.0, block_counts, &mut self.pc_map_scratch),
            calls: calls.into_boxed_slice(),
            incoming: Vec::new(),
        });
        self.cache.insert_key((va.0, pa.0, mode.0), id);
        self.cache.fast.put(va, mode, pa, id, self.lookup_global);
        self.stats.fragments += 1;
        self.stats.cache_bytes += tr.code.len() as u64;
        id
    }

    /// Translates (if needed) the trace at `va` without running it; returns the number of
    /// guest bytes the trace covers (for pre-translation and throughput measurement).
    pub fn pretranslate(
        &mut self,
        mem: &mut dyn GuestMemory,
        tool: &mut dyn Tool,
        va: GuestVirt,
    ) -> Result<u64, Stop> {
        let before = self.stats.guest_bytes;
        self.fragment_for(mem, &mut crate::platform::StopPlatform, tool, va)?;
        Ok(self.stats.guest_bytes - before)
    }

    /// Runs the guest from `rip()` under translation until it stops.
    pub fn run(
        &mut self,
        mem: &mut dyn GuestMemory,
        platform: &mut dyn Platform,
        tool: &mut dyn Tool,
    ) -> Stop {
        // Inline analysis calls reach the tool through this holder while the cache runs;
        // the dispatcher only forms short-lived references to it between cache entries.
        let mut holder: &mut dyn Tool = tool;
        let tp: *mut &mut dyn Tool = &mut holder;
        self.ctx_mut().tool = tp as u64;
        let stop = self.run_inner(mem, platform, tp);
        self.ctx_mut().tool = 0;
        // SAFETY: `tp` points at `holder`, live for this whole function; no other
        // reference to it exists now that the cache is not running.
        self.deliver_buffer(mem, unsafe { &mut **tp });
        stop
    }

    /// The dispatch loop: look up (or translate) and enter, run the cache until it exits,
    /// handle the exit (`exits.rs`), until a handler stops the run.
    fn run_inner(
        &mut self,
        mem: &mut dyn GuestMemory,
        platform: &mut dyn Platform,
        tp: *mut &mut dyn Tool,
    ) -> Stop {
        // `tp` is live for the whole run; each reference to the tool formed from it ends
        // before the next cache entry, the only other user of the tool.
        let mut args = Vec::new();
        let mut next = Next::Lookup;
        loop {
            let target = match next {
                Next::Lookup => match self.enter_at_rip(mem, platform, tp) {
                    Ok(pc) => pc,
                    Err(s) => return s,
                },
                Next::Enter(pc) => pc,
            };
            let (kind, idx) = self.enter_cache(target);
            next = match self.on_exit(kind, idx, mem, platform, tp, &mut args) {
                Ok(n) => n,
                Err(s) => return s,
            };
        }
    }

    /// `Next::Lookup`: the body of the fragment at `rip` (translated if needed), or a
    /// stop for a pending attention or a fetch fault.
    #[inline(always)]
    fn enter_at_rip(
        &mut self,
        mem: &mut dyn GuestMemory,
        platform: &mut dyn Platform,
        tp: *mut &mut dyn Tool,
    ) -> Result<CachePc, Stop> {
        if self.ctx().attention != 0 {
            return Err(Stop::Attention(self.rip));
        }
        // SAFETY: see the top of `run_inner`.
        let id = self.fragment_for(mem, platform, unsafe { &mut **tp }, self.rip)?;
        self.note_entered(id);
        Ok(self.cache.fragments[id as usize].body())
    }

    /// The guest wrote to (or unmapped) the code frame `pa_page`: every fragment translated
    /// from it is dropped from lookup (and buried, `crate::revive`), links into it are
    /// undone and the lookups of their start pages are cleared. Returns the number of
    /// fragments invalidated. (Fragments whose last instruction straddles into the frame
    /// from the previous page are not found.)
    pub fn invalidate_code_page(&mut self, pa_page: GuestPhys) -> usize {
        let page = pa_page.page();
        let victims: Vec<u32> = self.cache.on_frame(page).collect();
        let mut pages: Vec<GuestVirt> = Vec::new();
        for id in &victims {
            let f = &self.cache.fragments[*id as usize];
            let (key, start, code_len) = ((f.start.0, f.pa.0, f.mode.0), f.start, f.code_len);
            if !pages.contains(&start.page()) {
                pages.push(start.page());
            }
            self.cache.remove_key(&key);
            if code_len != 0 {
                if self.cache.buried.len() >= crate::revive::MAX_BURIED {
                    self.cache.buried.clear();
                }
                self.cache.buried.insert(key, *id);
            }
            self.unlink_incoming(*id);
        }
        // A fragment is looked up only by its start VA (IBL tables, return caches, front
        // cache): clearing those pages' entries drops every lookup that leads to a
        // victim, and the rest of the tables stays warm. Many pages: one whole clear.
        if pages.len() > MAX_PAGE_CLEARS {
            self.cache.clear_lookups();
        } else {
            for p in pages {
                self.cache.clear_lookups_page(p);
            }
        }
        victims.len()
    }
}
