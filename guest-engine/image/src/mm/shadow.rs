//! The shadow MMU in the engine image: `guest_engine::shadow_mmu::ShadowMmu` over the
//! physmap (guest RAM) and the stolen region (its own tables), plus the hardware side the
//! library leaves to its embedder — shadow roots in the real CR3, hardware TLB flushes
//! through the ring-0 gate — and the list of what the translator must be told (code frames
//! written, mappings dropped), which the run loop acts on (`run/mod.rs`).
//!
//! Invariants:
//! * from [`Shadow::enter`] on, the real CR3 holds a shadow root of the guest's current
//!   address space; every shadow root maps the engine window and the physmap exactly as
//!   the engine's own root (`ring0/page_tables.rs`, the template) does, so switching roots is
//!   invisible to the engine;
//! * no method returns with hardware-flush debt outstanding: guest code never runs on a
//!   stale TLB entry (a W bit dropped to protect code, a leaf dropped by `invlpg`);
//! * the root in the real CR3 is never handed out as a new table while it is loaded
//!   ([`StolenMem::pin`]), even if the library evicts it;
//! * an engine failure ([`ShadowError`]) is sticky ([`Shadow::failure`]): whatever the
//!   access that hit it answered, the virtual CPU and the run loop stop the run at their
//!   next check;
//! * a code frame the engine or the guest wrote is unprotected at once and listed in
//!   [`EngineWork`]; the run loop invalidates its traces before guest code runs again.

use alloc::vec::Vec;
use core::fmt;

use guest_engine::isolation::PageRights;
use guest_engine::shadow_mmu::{
    Access, FillOutcome, GuestFault, HwFlush, PagingControl, PhysMem, ShadowConfig, ShadowError,
    ShadowMmu, ShadowStats, View, PF_FETCH, PF_USER, PF_WRITE,
};
use guest_engine::{GuestPhys, GuestVirt};
use kpin_abi::attach::AttachBlock;
use kpin_abi::stolen::{PHYSMAP_VA, SHADOW_TABLES_BYTES, SHADOW_TABLES_OFFSET, WINDOW_VA};

use crate::json::JsonObject;
use crate::ring0::{gate, page_tables as paging};

/// Shadow roots kept (two views per guest address space).
const MAX_ROOTS: usize = 16;
/// Pages per prefetch group: a fill also shadows the group's pages the guest has already
/// accessed (see `guest_engine::shadow_mmu`), sparing a #PF round trip (~117 µs) each.
const PREFETCH_PAGES: usize = 16;
/// MAXPHYADDR assumed when the CPUID table has no leaf 0x8000_0008.
const DEFAULT_PHYS_ADDR_BITS: u32 = 36;
const PAGE: u64 = 4096;
/// Vector of #GP: what a non-canonical data address raises instead of #PF.
pub const GP_VECTOR: u8 = kpin_abi::x86::vector::GP;

/// Guest-physical memory for the shadow MMU: guest RAM through the physmap, the stolen
/// region (shadow tables, the template root) through the window, and the frame allocator
/// for shadow tables in `SHADOW_TABLES_OFFSET..` of the stolen region.
pub struct StolenMem {
    stolen_base: u64,
    stolen_bytes: u64,
    /// Guest memory (e820 ranges of any type) the guest may map and the physmap reaches:
    /// `[start, end)`, sorted.
    ram: Vec<(u64, u64)>,
    /// Offset (in the stolen region) of the next never-used table frame.
    next: u64,
    free: Vec<u64>,
    /// Per table frame handed out (indexed from `SHADOW_TABLES_OFFSET`), bit `g` set if an
    /// entry in `8g..8g + 8` (one cache line) may be present: `next_present` reads only
    /// those lines. A shadow table is mostly empty and seldom in the cache, and the scans
    /// (every CR3 write's revalidation, a lent root's unpark) read 512 entries otherwise.
    /// Invariant: a present entry's bit is set — every write of a shadow entry goes through
    /// `write_u64`, and `alloc_table` zeroes the frame and its summary.
    present: Vec<u64>,
    /// The root in the real CR3, and a frame freed while it was loaded.
    pinned: u64,
    deferred: Option<u64>,
}

/// The local APIC's default base (APIC_BASE cannot move it: see `guest_engine::vcpu`'s `msr.rs`).
pub const LAPIC_FRAME: u64 = guest_engine::vcpu::LAPIC_FRAME;
/// The IOAPIC's default base.
pub const IOAPIC_FRAME: u64 = 0xfec0_0000;

impl StolenMem {
    fn new(b: &AttachBlock) -> Self {
        let mut ram: Vec<(u64, u64)> = Vec::new();
        let n = (b.e820_count as usize).min(b.e820.len());
        // Every e820 range, RAM or reserved: a reserved range the VMM lists (the BIOS
        // hole, 0x9fc00–0x100000) is backed by the RAM memslot, and a native guest reads
        // it as memory (Linux scans it for the EBDA, iBFT, MP tables). The stolen region
        // is never listed; MMIO (the local APIC, the IOAPIC) is not in the map.
        for e in &b.e820[..n] {
            let end = e.addr.saturating_add(e.size);
            let mut at = e.addr;
            // Only what the physmap maps (it covers whole 2 MiB pages of e820 ranges).
            while at < end {
                let chunk_end = ((at | ((2 << 20) - 1)) + 1).min(end);
                if paging::physmap_maps(b, at) {
                    match ram.last_mut() {
                        Some(last) if last.1 == at => last.1 = chunk_end,
                        _ => ram.push((at, chunk_end)),
                    }
                }
                at = chunk_end;
            }
        }
        ram.sort_unstable();
        Self {
            stolen_base: b.stolen_base,
            stolen_bytes: b.stolen_bytes,
            ram,
            next: SHADOW_TABLES_OFFSET,
            free: Vec::new(),
            present: Vec::new(),
            pinned: u64::MAX,
            deferred: None,
        }
    }

    /// The index in `present` of the shadow-table frame holding `pa`.
    fn table_frame(&self, pa: u64) -> usize {
        ((pa - self.stolen_base - SHADOW_TABLES_OFFSET) / PAGE) as usize
    }

    /// Keeps `present` true after `value` was written at `pa` in the shadow-table area
    /// (engine address `va`): a present entry sets its line's bit; a cleared one clears
    /// it if its whole line (just written, so in the cache) is now empty.
    fn note_entry(&mut self, pa: u64, va: u64, value: u64) {
        let frame = self.table_frame(pa);
        let line = ((pa % PAGE) / 64) as u32;
        let Some(lines) = self.present.get_mut(frame) else {
            return;
        };
        if value & 1 != 0 {
            *lines |= 1 << line;
            return;
        }
        let first = (va & !63) as *const u64;
        // SAFETY: the 64-byte line of the shadow-table entry just written through the
        // window (`write_u64`), inside its 4 KiB frame.
        let empty = (0..8).all(|k| unsafe { first.add(k).read_volatile() } & 1 == 0);
        if empty {
            *lines &= !(1 << line);
        }
    }

    /// Whether `[pa, pa + len)` is guest RAM (inside one e820 RAM range the physmap maps).
    fn is_ram(&self, pa: u64, len: u64) -> bool {
        let end = pa.saturating_add(len);
        self.ram.iter().any(|&(s, e)| s <= pa && end <= e)
    }

    /// Where `[pa, pa + len)` is in the engine's address space: guest RAM in the physmap,
    /// the stolen region in the window; `None` for anything else.
    fn engine_va(&self, pa: u64, len: u64) -> Option<u64> {
        let stolen_end = self.stolen_base + self.stolen_bytes;
        if pa >= self.stolen_base && pa.saturating_add(len) <= stolen_end {
            return Some(WINDOW_VA + (pa - self.stolen_base));
        }
        self.is_ram(pa, len).then_some(PHYSMAP_VA + pa)
    }

    /// The engine address of guest RAM `[pa, pa + len)` (never the stolen region).
    pub fn guest_ptr(&self, pa: u64, len: usize) -> Option<*mut u8> {
        self.is_ram(pa, len as u64)
            .then_some((PHYSMAP_VA + pa) as *mut u8)
    }

    /// `root` is now in the real CR3: a table frame freed while the previous root was
    /// loaded (that root itself; never handed out since, so never `root`) may be reused.
    fn pin(&mut self, root: u64) {
        self.pinned = root;
        self.free.extend(self.deferred.take());
    }

    /// Table frames available (never handed out, or returned).
    fn free_frames(&self) -> u64 {
        (SHADOW_TABLES_BYTES - (self.next - SHADOW_TABLES_OFFSET)) / PAGE + self.free.len() as u64
    }
}

impl PhysMem for StolenMem {
    fn read_u64(&mut self, pa: GuestPhys) -> Option<u64> {
        if !pa.0.is_multiple_of(8) {
            return None;
        }
        let va = self.engine_va(pa.0, 8)?;
        // SAFETY: `va` maps guest RAM (physmap) or the stolen region (window), both mapped
        // in every root the engine runs on; aligned. Volatile: the guest owns its tables.
        Some(unsafe { core::ptr::read_volatile(va as *const u64) })
    }

    fn write_u64(&mut self, pa: GuestPhys, value: u64) -> bool {
        // Of the stolen region, only the shadow tables are ever written (never the engine).
        let tables = self.stolen_base + SHADOW_TABLES_OFFSET;
        let in_tables = pa.0 >= tables && pa.0 < tables + SHADOW_TABLES_BYTES;
        if !pa.0.is_multiple_of(8) || (!in_tables && !self.is_ram(pa.0, 8)) {
            return false;
        }
        let Some(va) = self.engine_va(pa.0, 8) else {
            return false;
        };
        // SAFETY: as in `read_u64`; the library writes only shadow entries (stolen region)
        // and the guest's A/D bits (guest RAM), as hardware would.
        unsafe { core::ptr::write_volatile(va as *mut u64, value) };
        if in_tables {
            self.note_entry(pa.0, va, value);
        }
        true
    }

    fn next_present(
        &mut self,
        table: GuestPhys,
        from: usize,
        end: usize,
    ) -> Result<Option<(usize, u64)>, GuestPhys> {
        let tables = self.stolen_base + SHADOW_TABLES_OFFSET;
        let in_tables = table.0 >= tables && table.0 + PAGE <= tables + SHADOW_TABLES_BYTES;
        if !in_tables || !table.0.is_multiple_of(PAGE) || end > 512 {
            return Err(table);
        }
        let at = (WINDOW_VA + (table.0 - self.stolen_base)) as *const u64;
        let frame = self.table_frame(table.0);
        // A frame never handed out has no summary: read it all (nothing calls that).
        let mut lines = self.present.get(frame).copied().unwrap_or(u64::MAX);
        lines &= u64::MAX << (from / 8).min(63);
        while lines != 0 {
            let g = lines.trailing_zeros() as usize;
            lines &= lines - 1;
            for i in (8 * g).max(from)..(8 * g + 8).min(end) {
                // SAFETY: a 4 KiB-aligned frame of the shadow-table area (checked above),
                // mapped by the window; `i < 512`. The engine's own memory: the CPU sets
                // A/D bits in it only while guest code runs, never during this scan.
                let e = unsafe { at.add(i).read() };
                if e & 1 != 0 {
                    return Ok(Some((i, e)));
                }
            }
            if 8 * g + 8 >= end {
                break;
            }
        }
        Ok(None)
    }

    fn alloc_table(&mut self) -> Option<GuestPhys> {
        let pa = match self.free.pop() {
            Some(pa) => pa,
            None if self.next + PAGE <= SHADOW_TABLES_OFFSET + SHADOW_TABLES_BYTES => {
                let pa = self.stolen_base + self.next;
                self.next += PAGE;
                self.present.push(0);
                pa
            }
            None => return None,
        };
        let frame = self.table_frame(pa);
        self.present[frame] = 0;
        // SAFETY: a table frame of the stolen region (mapped by the window), owned by the
        // allocator and not in use (never handed out, or returned and not loaded).
        unsafe {
            core::ptr::write_bytes(
                (WINDOW_VA + (pa - self.stolen_base)) as *mut u8,
                0,
                PAGE as usize,
            )
        };
        Some(GuestPhys(pa))
    }

    fn free_table(&mut self, frame: GuestPhys) {
        if frame.0 == self.pinned {
            // Still the real CR3 (an evicted root): reuse only after the next load.
            self.deferred = Some(frame.0);
        } else {
            self.free.push(frame.0);
        }
    }

    fn guest_may_map(&self, frame: GuestPhys) -> bool {
        self.is_ram(frame.0, PAGE)
    }

    fn guest_may_map_range(&self, base: GuestPhys, bytes: u64) -> bool {
        self.is_ram(base.0, bytes)
    }

    /// The local APIC and IOAPIC pages at their default bases: KVM's in-kernel devices
    /// (the VMM creates the in-kernel irqchip), which emulate an access from CPL 3 as
    /// from ring 0, so the guest's accesses in translated code go to them unchanged.
    /// (The engine itself uses neither: its interrupts come through the 8259.) And the
    /// VMM's virtio-mmio window (`kpin_abi::mmio`): no memslot backs it, so KVM decodes
    /// the CPL-3 access and the VMM's device model serves it as a normal MMIO exit, in
    /// program order; a page of the window with no device reads all ones, as natively.
    fn guest_may_map_device(&self, frame: GuestPhys) -> bool {
        frame.0 == LAPIC_FRAME
            || frame.0 == IOAPIC_FRAME
            || kpin_abi::mmio::is_device_frame(frame.0)
    }
}

/// What the translator must hear about before guest code runs again (the run loop does it
/// through `guest_engine::Engine`, which the shadow cannot reach).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EngineWork {
    /// Code frames written (already unprotected): `Engine::invalidate_code_page` each.
    pub code_frames: Vec<GuestPhys>,
    /// Pages whose mapping the guest dropped (`invlpg`): `Engine::invalidate_page` each.
    pub pages: Vec<GuestVirt>,
    /// Every VA → PA mapping may have changed (a paging-control change, or a CR3 write
    /// with CR4.PGE = 0).
    pub all_mappings: bool,
    /// Every mapping of a non-global page may have changed (a CR3 write).
    pub nonglobal_mappings: bool,
}

impl EngineWork {
    fn is_empty(&self) -> bool {
        self.code_frames.is_empty()
            && self.pages.is_empty()
            && !self.all_mappings
            && !self.nonglobal_mappings
    }
}

/// The image's own counters of shadow-MMU work (the library's are [`ShadowStats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShadowCounters {
    /// Hardware #PFs from translated code handed to the shadow MMU.
    pub page_faults: u64,
    /// Guest faults handed to the exception-delivery seam (`run::reflect_guest_fault`).
    pub reflected: u64,
    /// Writes (by guest code or by the engine) that hit a code frame: SMC invalidations.
    pub code_writes: u64,
    /// Fragments those invalidations dropped.
    pub fragments_invalidated: u64,
    /// Stores into the storing instruction's own code frame, emulated (`run/cache_page_fault.rs`).
    pub emulated_stores: u64,
    /// Hardware TLB flushes paid with `invlpg` (one gate round trip each).
    pub invlpgs: u64,
    /// Real CR3 loads (root switches and full hardware flushes; one gate round trip each).
    pub cr3_loads: u64,
    /// Times every shadow leaf was dropped because table frames ran out.
    pub table_reclaims: u64,
    /// Guest CR3 writes.
    pub guest_cr3_writes: u64,
    /// Guest `invlpg`s.
    pub guest_invlpgs: u64,
    /// Translated memory operands stopped by the isolation check (`Stop::Isolation`).
    pub isolation_hits: u64,
    /// Accesses to the reserved zone through the guest's own mapping, performed on its
    /// frame (`run::zone_access`).
    pub zone_emulations: u64,
    /// User-view fills made on the return to user mode after a user data fault the guest
    /// handled (`Shadow::enter`): each saves the retried access's shadow-miss trip.
    pub retry_fills: u64,
    /// Page faults in translated code whose address came from the faulting instruction
    /// (`guest_engine::isolation::page_fault_address`), and those for which CR2 was read
    /// at ring 0 instead.
    pub fault_addresses_derived: u64,
    /// See `fault_addresses_derived`.
    pub fault_addresses_read: u64,
}

/// The shadow MMU of the one vCPU, with its hardware side.
pub struct Shadow {
    mmu: ShadowMmu<StolenMem>,
    /// The view whose root is (or will be, at [`Shadow::enter`]) in the real CR3.
    view: View,
    /// The root in the real CR3, once entered.
    loaded: Option<GuestPhys>,
    work: EngineWork,
    failure: Option<ShadowError>,
    /// A user data #PF delivered to the guest, `(va, guest CR3)`: the guest's handler
    /// usually maps the page and returns to the faulting instruction, whose retry would
    /// miss the shadow and cost a second ring-0 trip; the next entry to the user view
    /// of that space fills it first.
    retry: Option<(u64, u64)>,
    /// Counters of this module and its callers.
    pub counters: ShadowCounters,
}

impl Shadow {
    /// The shadow MMU for the guest in `b` (its CR3, CR0/CR4/EFER, MAXPHYADDR from the
    /// CPUID table), copying the engine slots of `template_root`. Loads nothing yet.
    pub fn new(b: &AttachBlock, template_root: u64) -> Result<Self, ShadowError> {
        let s = &b.sregs;
        let bits = b.cpuid(0x8000_0008, 0)[0] & 0xff;
        let config = ShadowConfig {
            template_root: GuestPhys(template_root),
            max_roots: MAX_ROOTS,
            phys_addr_bits: if bits == 0 {
                DEFAULT_PHYS_ADDR_BITS
            } else {
                bits
            },
            // Guest code never runs at its own VA (only translations do), so NX in the
            // shadow would buy nothing; fetch rights are checked in software.
            hw_nx: false,
            large_pages: true,
            prefetch: PREFETCH_PAGES,
            // Translated user code checks its operands against the upper half
            // (`guest_engine::isolation`), so a CPL change needs no CR3 load.
            unified: true,
            // A process's pages survive a context switch back to it (checked against
            // its tables), which saves a shadow-miss trip per page touched again.
            revalidate_on_cr3_write: true,
            // `text_poke`'s switches to `poking_mm` and back cost one real CR3 load, not two.
            lend_roots: true,
        };
        let control = guest_engine::vcpu::paging_control(s.cr0, s.cr4, s.efer);
        Ok(Self {
            mmu: ShadowMmu::new(StolenMem::new(b), config, control, s.cr3)?,
            view: View::Kernel,
            loaded: None,
            work: EngineWork::default(),
            failure: None,
            retry: None,
            counters: ShadowCounters::default(),
        })
    }

    /// Loads the root of `view` (of the current space) into the real CR3 if it is not
    /// there, and pays any hardware-flush debt. Call when the virtual CPL changes view.
    pub fn enter(&mut self, view: View) -> Result<(), ShadowError> {
        self.view = view;
        let root = self.with_tables(|m| m.root(view))?;
        if self.loaded != Some(root) {
            self.load(root);
            // A CR3 load drops every TLB entry of the old root (shadow leaves are never
            // global), which pays any debt.
            let _ = self.mmu.take_hw_flush();
        }
        self.settle()?;
        if view == View::User {
            if let Some((va, cr3)) = self.retry.take() {
                // A read fill, as a walk by the retried access would start: it sets the
                // guest's Accessed bit (which a CPU may set speculatively) but never
                // Dirty, and maps the page writable only if the guest's leaf is dirty
                // already (Linux marks it so for a write fault it handled). A page the
                // guest left unmapped stays so (its fault comes again, and is the guest's).
                // Only in the lower half, where a user page can be (no reserved slot), and
                // any refusal left for the retry to meet as before.
                let va = GuestVirt(va);
                if cr3 == self.cr3() && va.0 < 1 << 47 {
                    let filled = self.with_tables(|m| {
                        if m.lookup(va, Access::Read, View::User)?.is_some() {
                            return Ok(false);
                        }
                        Ok(matches!(
                            m.fill(va, Access::Read, View::User)?,
                            FillOutcome::Mapped { .. }
                        ))
                    });
                    if filled == Ok(true) {
                        self.counters.retry_fills += 1;
                    }
                }
            }
        }
        Ok(())
    }

    fn load(&mut self, root: GuestPhys) {
        // SAFETY: every shadow root carries the engine slots (window, physmap) copied from
        // the engine's own root, so the engine's code, stacks and tables stay mapped.
        unsafe { gate::load_cr3(root.0) };
        self.mmu.mem_mut().pin(root.0);
        self.loaded = Some(root);
        self.counters.cr3_loads += 1;
    }

    /// Pays the hardware-flush debt: `invlpg` per page, or a CR3 reload (which also
    /// switches to the current space's root if the space changed).
    fn settle(&mut self) -> Result<(), ShadowError> {
        match self.mmu.take_hw_flush() {
            HwFlush::None => {}
            HwFlush::Pages(pages) if self.loaded.is_some() => {
                for va in pages {
                    gate::invlpg(va.0);
                    self.counters.invlpgs += 1;
                }
            }
            HwFlush::Pages(_) => {}
            HwFlush::All => {
                if self.loaded.is_some() {
                    let root = self.mmu.root(self.view)?;
                    self.load(root);
                    // Building the root cannot owe more: it drops nothing.
                    let _ = self.mmu.take_hw_flush();
                }
            }
        }
        Ok(())
    }

    /// Runs `f`; if shadow tables ran out, drops every shadow leaf (a virtual TLB may
    /// forget anything) and runs it once more.
    fn with_tables<T>(
        &mut self,
        mut f: impl FnMut(&mut ShadowMmu<StolenMem>) -> Result<T, ShadowError>,
    ) -> Result<T, ShadowError> {
        let r = match f(&mut self.mmu) {
            Err(ShadowError::OutOfTables) => {
                self.counters.table_reclaims += 1;
                self.mmu.flush_all()?;
                f(&mut self.mmu)
            }
            r => r,
        };
        self.settle()?;
        r
    }

    /// Records an engine failure (the first one stays).
    pub fn record(&mut self, e: ShadowError) {
        if self.failure.is_none() {
            self.failure = Some(e);
        }
    }

    /// The engine failure recorded, if any.
    pub fn failure(&self) -> Option<&ShadowError> {
        self.failure.as_ref()
    }

    /// Takes what the translator must hear about.
    pub fn take_work(&mut self) -> EngineWork {
        core::mem::take(&mut self.work)
    }

    /// Whether the translator must hear about something before guest code runs again.
    pub fn has_work(&self) -> bool {
        !self.work.is_empty()
    }

    /// The guest's CR3 (the virtual CR3).
    pub fn cr3(&self) -> u64 {
        self.mmu.cr3()
    }

    /// The library's counters.
    pub fn stats(&self) -> ShadowStats {
        self.mmu.stats()
    }

    /// Guest memory and the table allocator.
    pub fn mem(&self) -> &StolenMem {
        self.mmu.mem()
    }

    /// A hardware #PF from translated code at `cr2` with hardware error code `error`
    /// (taken under the loaded view).
    pub fn page_fault(&mut self, cr2: u64, error: u32) -> Result<FillOutcome, ShadowError> {
        self.counters.page_faults += 1;
        let view = self.view;
        self.with_tables(|m| m.on_page_fault(GuestVirt(cr2), error, view))
    }

    /// What the tables in the real CR3 give `va` (for the address of a fault taken under
    /// them, `guest_engine::isolation::page_fault_address`).
    pub fn hardware_rights(&mut self, va: u64) -> PageRights {
        let Some(root) = self.loaded else {
            return PageRights::Unknown;
        };
        match self.mmu.hardware_rights(root, GuestVirt(va)) {
            Ok(None) => PageRights::Absent,
            Ok(Some(false)) => PageRights::ReadOnly,
            Ok(Some(true)) => PageRights::Writable,
            Err(_) => PageRights::Unknown,
        }
    }

    /// Whether the shadow maps `va` in `view` as a global page (`ShadowMmu::is_global`;
    /// `false` on any doubt).
    pub fn is_global(&mut self, va: u64, view: View) -> bool {
        self.mmu.is_global(GuestVirt(va), view).unwrap_or(false)
    }

    /// `va` in the reserved zone for `access` in `view` as the guest's own tables say
    /// (`ShadowMmu::translate_reserved`; nothing enters the shadow).
    pub fn translate_reserved(
        &mut self,
        va: u64,
        access: Access,
        view: View,
    ) -> Result<Result<GuestPhys, GuestFault>, ShadowError> {
        self.with_tables(|m| m.translate_reserved(GuestVirt(va), access, view))
    }

    /// `va` for `access` in `view`, as the guest's tables say (A/D bits set as hardware
    /// would, the shadow filled, except in the reserved zone): the guest-physical address,
    /// or the fault the guest would take. A non-canonical `va` is #GP(0) (`cr2` then only names the address); an
    /// engine failure is recorded and answered with the #PF a refused mapping would be.
    pub fn access(&mut self, va: u64, access: Access, view: View) -> Result<GuestPhys, GuestFault> {
        let va = GuestVirt(va);
        let r = self.with_tables(|m| {
            if let Some(pa) = m.lookup(va, access, view)? {
                return Ok(Ok(pa));
            }
            Ok(match m.fill(va, access, view) {
                // The guest's own mapping in the reserved zone never enters the shadow:
                // the access goes to the frame its tables name.
                Err(ShadowError::ReservedSlot(_)) => m.translate_reserved(va, access, view)?,
                r => match r? {
                    FillOutcome::Mapped { pa } | FillOutcome::ProtectedCode { pa, .. } => Ok(pa),
                    FillOutcome::GuestFault(f) => Err(f),
                },
            })
        });
        match r {
            Ok(r) => r,
            Err(ShadowError::NonCanonical(_)) => Err(GuestFault {
                vector: GP_VECTOR,
                error_code: 0,
                cr2: va,
            }),
            Err(e) => {
                self.record(e);
                let mut code = if view == View::User { PF_USER } else { 0 };
                if access == Access::Write {
                    code |= PF_WRITE;
                }
                Err(GuestFault::page_fault(va, code))
            }
        }
    }

    /// The translator read guest code from `[pa, pa + len)`: protect every frame of it.
    pub fn protect_code(&mut self, pa: GuestPhys, len: usize) -> Result<(), ShadowError> {
        if len == 0 {
            return Ok(());
        }
        let first = pa.0 & !(PAGE - 1);
        let last = (pa.0 + len as u64 - 1) & !(PAGE - 1);
        let mut frame = first;
        while frame <= last {
            self.mmu.protect_code_frame(GuestPhys(frame))?;
            frame += PAGE;
        }
        self.settle()
    }

    /// Whether `frame` holds translated code (is write-protected).
    pub fn is_code_frame(&self, frame: GuestPhys) -> bool {
        self.mmu.is_code_frame_protected(frame.page())
    }

    /// `frame` (holding translated code) is being written by the engine: drop its
    /// protection and list it for trace invalidation ([`Shadow::take_work`]).
    pub fn code_frame_written(&mut self, frame: GuestPhys) -> Result<(), ShadowError> {
        let frame = frame.page();
        self.counters.code_writes += 1;
        if !self.work.code_frames.contains(&frame) {
            self.work.code_frames.push(frame);
        }
        self.mmu.unprotect_code_frame(frame)?;
        self.settle()
    }

    /// The guest wrote `frame` and the caller invalidated its `fragments` traces: drop
    /// its protection.
    pub fn code_invalidated(
        &mut self,
        frame: GuestPhys,
        fragments: usize,
    ) -> Result<(), ShadowError> {
        self.counters.code_writes += 1;
        self.counters.fragments_invalidated += fragments as u64;
        self.mmu.unprotect_code_frame(frame.page())?;
        self.settle()
    }

    /// The guest writes CR3 (bit 63 already cleared): switch spaces, drop the new space's
    /// non-global leaves, load its root.
    pub fn write_cr3(&mut self, cr3: u64) -> Result<(), ShadowError> {
        self.counters.guest_cr3_writes += 1;
        self.mmu.write_cr3(cr3)?;
        if self.mmu.control().pge {
            self.work.nonglobal_mappings = true;
        } else {
            self.work.all_mappings = true;
        }
        let view = self.view;
        let root = self.with_tables(|m| m.root(view))?;
        // A new root owes HwFlush::All, which `settle` (in `with_tables`) paid by loading
        // it; a lent one stays loaded (`ShadowConfig::lend_roots`), and the write owes a
        // flush only if it dropped or narrowed one of its leaves.
        if self.loaded.is_some() && self.loaded != Some(root) {
            self.load(root);
            let _ = self.mmu.take_hw_flush();
        }
        Ok(())
    }

    /// A #PF at `va` is being delivered to the guest: a CPU drops its TLB entries for
    /// the faulting address when it raises one (a handler may rely on that instead of
    /// `invlpg`), so the shadow drops its leaves for `va` too.
    pub fn page_fault_delivered(&mut self, va: u64, error_code: u32) -> Result<(), ShadowError> {
        if error_code & (PF_USER | PF_FETCH) == PF_USER {
            self.retry = Some((va, self.cr3()));
        }
        self.mmu.invlpg(GuestVirt(va))?;
        self.work.pages.push(GuestVirt(va));
        self.settle()
    }

    /// The guest executes `invlpg va`.
    pub fn invlpg(&mut self, va: u64) -> Result<(), ShadowError> {
        self.counters.guest_invlpgs += 1;
        self.mmu.invlpg(GuestVirt(va))?;
        self.work.pages.push(GuestVirt(va));
        self.settle()
    }

    /// The guest's CR0.WP, CR4.PGE/SMEP or EFER.NXE may have changed.
    pub fn set_control(&mut self, control: PagingControl) -> Result<(), ShadowError> {
        if control != self.mmu.control() {
            self.mmu.set_control(control)?;
            self.work.all_mappings = true;
        }
        self.settle()
    }
}

impl Shadow {
    /// Every counter, named as in the statistics line and `counters.json`.
    fn counter_fields(&self) -> [(&'static str, u64); 29] {
        let s = self.stats();
        let c = &self.counters;
        [
            ("fills", s.fills),
            ("prefetched", s.prefetched),
            ("page_faults", c.page_faults),
            ("guest_faults_reflected", c.reflected),
            ("write_protect_faults", s.write_protect_faults),
            ("code_writes", c.code_writes),
            ("fragments_invalidated", c.fragments_invalidated),
            ("emulated_stores", c.emulated_stores),
            ("protected_frames", s.protected_frames),
            ("ad_updates", s.ad_updates),
            ("invalidations", s.invalidations),
            ("leaves_dropped", s.leaves_dropped),
            ("leaves_kept_across_cr3_writes", s.leaves_kept),
            ("leaves_moved_at_cr3_writes", s.leaves_moved),
            ("roots_evicted", s.roots_evicted),
            ("roots_lent", s.roots_lent),
            ("roots_returned", s.roots_returned),
            ("tables", s.tables),
            ("free_table_frames", self.mem().free_frames()),
            ("table_reclaims", c.table_reclaims),
            ("hw_invlpgs", c.invlpgs),
            ("cr3_loads", c.cr3_loads),
            ("guest_cr3_writes", c.guest_cr3_writes),
            ("guest_invlpgs", c.guest_invlpgs),
            ("isolation_hits", c.isolation_hits),
            ("zone_emulations", c.zone_emulations),
            ("retry_fills", c.retry_fills),
            ("fault_addresses_derived", c.fault_addresses_derived),
            ("fault_addresses_read", c.fault_addresses_read),
        ]
    }

    /// Adds the counters to `counters.json` as the object `shadow`.
    pub fn write_json(&self, j: &mut JsonObject) {
        j.begin("shadow");
        for (name, value) in self.counter_fields() {
            j.u64(name, value);
        }
        j.end();
    }
}

impl fmt::Display for Shadow {
    /// The statistics line's body: `key=value` pairs.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (k, (name, value)) in self.counter_fields().iter().enumerate() {
            if k > 0 {
                f.write_str(" ")?;
            }
            write!(f, "{name}={value}")?;
        }
        Ok(())
    }
}
