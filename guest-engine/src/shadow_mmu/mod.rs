//! The shadow MMU: a virtual TLB made of page tables the engine owns.
//!
//! All translated guest code (kernel and user) runs at hardware CPL 3 under *shadow*
//! tables filled on demand from the guest's tables when a shadow miss faults
//! ([`ShadowMmu::fill`]) and dropped when the guest does what would drop a real TLB entry
//! ([`ShadowMmu::write_cr3`], [`ShadowMmu::invlpg`], a CR4.PGE / CR0.WP / EFER.NXE /
//! CR4.SMEP change via [`ShadowMmu::set_control`]). Each guest address space (keyed by the
//! guest CR3's PML4 frame) has two shadow roots, one per [`View`]; a small LRU cache keeps
//! the roots of recently used spaces.
//!
//! With [`ShadowConfig::unified`], the user view of a space is its kernel root as long as
//! that root is *unified* — it maps no guest supervisor page in the lower half (below
//! [`USER_LIMIT`]), nothing from [`TOP_GUARD`] to the top of the address space, and
//! CR0.WP = 1 (so a user page is writable for the kernel only if it is for the user).
//! Then a change of the virtual CPL needs no CR3 load: translated user code may not reach
//! an address at or above [`USER_LIMIT`] natively (its memory operands are checked for
//! that, `arch/x86_64/isolate/`), and what lies below is the same in both views. The
//! first kernel-view leaf that breaks the rule splits that root from the user view for
//! its lifetime (a guest's own choice: Linux never does it in a process's space).
//!
//! With [`ShadowConfig::lend_roots`], a CR3 write to a space with no root of its own may
//! keep the loaded kernel root, if its lower half is empty: the root is lent to the new
//! space and goes home when the guest switches back (`lend.rs`). A CR3 write owes a
//! hardware flush only if the new space's root is another or a leaf of it was dropped or
//! narrowed.
//!
//! With [`ShadowConfig::prefetch`], a 4 KiB fill also shadows the other pages of its
//! aligned group that the guest has already accessed (`prefetch.rs`), so that pages
//! touched again after a CR3 write do not fault one by one.
//!
//! Invariants:
//! * every shadow root carries the engine's PML4 slots ([`ENGINE_SLOTS`]) copied from the
//!   engine's template root, and no guest mapping is ever installed in
//!   [`RESERVED_SLOTS`] (256–259: slot 256 faults at CPL 3 on this KVM, 259 is the
//!   guard above the physmap that translated code's isolation checks rely on, see
//!   `arch/x86_64/isolate/`); a fill there walks the guest's tables and answers with
//!   the guest's fault, or [`ShadowError::ReservedSlot`] if the guest maps the address
//!   (the embedder may then perform the access itself: [`ShadowMmu::translate_reserved`]);
//! * every shadow leaf has U = 1 and G = 0 (the engine reloads CR3 between views, unless
//!   they share one unified root);
//!   intermediate shadow entries are P|W|U and only the leaf restricts;
//! * a shadow leaf is writable only if the guest allows the write in that view, the
//!   guest leaf is dirty, and the frame is not a protected code frame;
//! * a user-view root never maps a guest supervisor page; a unified kernel root maps
//!   none below [`USER_LIMIT`] and nothing from [`TOP_GUARD`] up;
//! * shadow leaves are 4 KiB, or 2 MiB (with [`ShadowConfig::large_pages`]) where the
//!   guest maps the whole 2 MiB with one leaf and no frame in it is protected;
//! * every present shadow leaf is in the [`ReverseMap`];
//! * guest page tables are written only to set A/D bits, as hardware would.
//!
//! Guest code is never executed at its own VA (only its translation in the code cache),
//! so instruction-fetch permission is checked in software ([`ShadowMmu::translate`] with
//! [`Access::Fetch`]); with [`ShadowConfig::hw_nx`] shadow leaves are also NX.
//!
//! How the engine drives it:
//! 1. on entering guest code at virtual CPL `c`, load [`ShadowMmu::root`]`(View::for_cpl(c))`
//!    into the real CR3 (and pay [`ShadowMmu::take_hw_flush`] if the root is already loaded);
//! 2. on a hardware #PF from guest code, call [`ShadowMmu::on_page_fault`]: `Mapped` →
//!    re-execute; `GuestFault` → deliver it through the guest IDT (CR2 = `cr2`);
//!    `ProtectedCode` → invalidate the frame's traces, [`ShadowMmu::unprotect_code_frame`],
//!    re-execute;
//! 3. after translating code from a frame, [`ShadowMmu::protect_code_frame`];
//! 4. on guest `mov cr3` / `invlpg` / control-bit writes, the matching method, then pay
//!    [`ShadowMmu::take_hw_flush`];
//! 5. writes the engine itself makes to guest memory through the physmap (emulated
//!    instructions) bypass the shadow: check [`ShadowMmu::is_code_frame_protected`] first.

mod lend;
mod phys;
mod prefetch;
mod pte;
mod revalidate;
pub mod reverse_map;
mod tables;
mod translate;
mod walk;

use alloc::vec::Vec;
use core::ops::RangeInclusive;

pub use phys::PhysMem;
pub use walk::{
    GuestLeaf, Rights, PF_FETCH, PF_PRESENT, PF_RESERVED, PF_USER, PF_VECTOR, PF_WRITE,
};

use crate::addr::{GuestPhys, GuestVirt};
use reverse_map::{ReverseMap, ShadowMapping};

/// PML4 slots that belong to the engine and are copied from the template into every
/// shadow root: 257 = engine window (`kpin_abi::stolen::WINDOW_VA`), 258 = physmap
/// (`kpin_abi::stolen::PHYSMAP_VA`).
pub const ENGINE_SLOTS: RangeInclusive<usize> =
    kpin_abi::stolen::WINDOW_SLOT..=kpin_abi::stolen::PHYSMAP_SLOT;
/// PML4 slots a guest may not use: the engine slots, slot 256, which faults with a
/// reserved-bit error at CPL 3 on this KVM (`kvm_pvm`), and slot 259, the guard that
/// keeps stack and downward string accesses from reaching the physmap unchecked
/// (`arch/x86_64/isolate/`). Never present in a shadow root for the guest.
pub const RESERVED_SLOTS: RangeInclusive<usize> = kpin_abi::stolen::RESERVED_SLOTS;
/// Translated user code reaches addresses below this natively (the lower half); at and
/// above it, its memory operands are checked (`arch/x86_64/isolate/`).
pub const USER_LIMIT: u64 = 1 << 47;
/// Start of the top 2 MiB of the address space, never mapped by a unified root: a user access just
/// below address 0 (a small base with a negative displacement, a downward string) wraps
/// into it and faults into the engine.
pub const TOP_GUARD: u64 = 0u64.wrapping_sub(pte::LARGE_PAGE_BYTES);
/// Most hardware-flush VAs remembered before [`HwFlush`] degrades to a full flush.
pub const MAX_HW_FLUSH_PAGES: usize = 16;

/// A kind of memory access.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Access {
    /// Data read.
    Read,
    /// Data write.
    Write,
    /// Instruction fetch.
    Fetch,
}

/// Which shadow view: chosen by the *virtual* CPL of the guest code that runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum View {
    /// Virtual CPL 0–2: guest supervisor and user pages are reachable.
    Kernel,
    /// Virtual CPL 3: guest supervisor pages are not present.
    User,
}

impl View {
    /// The view for virtual CPL `cpl`.
    pub fn for_cpl(cpl: u8) -> View {
        if cpl == 3 {
            View::User
        } else {
            View::Kernel
        }
    }
}

/// The guest control bits that change translations.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PagingControl {
    /// CR0.WP: supervisor writes honour R/W.
    pub wp: bool,
    /// EFER.NXE: XD bits are honoured (else bit 63 is reserved).
    pub nxe: bool,
    /// CR4.PGE: global leaves survive CR3 writes.
    pub pge: bool,
    /// CR4.SMEP: supervisor fetches from user pages fault.
    pub smep: bool,
}

/// Fixed parameters of the shadow MMU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShadowConfig {
    /// The engine's own PML4; its [`ENGINE_SLOTS`] are copied into every shadow root.
    pub template_root: GuestPhys,
    /// Most shadow roots kept (two per address space); at least 2.
    pub max_roots: usize,
    /// MAXPHYADDR the guest sees (CPUID 0x8000_0008 EAX bits 7:0); higher address bits in a
    /// guest entry are reserved.
    pub phys_addr_bits: u32,
    /// Set NX on every shadow leaf (requires the real EFER.NXE = 1).
    pub hw_nx: bool,
    /// Shadow a guest 2 MiB or 1 GiB page with 2 MiB shadow leaves where the whole 2 MiB
    /// has uniform protection (no protected code frame, all of it mappable by the guest);
    /// otherwise (and when false) with 4 KiB leaves.
    pub large_pages: bool,
    /// Pages per prefetch group (0 or 1: no prefetch; else a power of two up to 512):
    /// a 4 KiB fill also shadows the other pages of its aligned group that the guest has
    /// already accessed (see `prefetch.rs`).
    pub prefetch: usize,
    /// The user view of a space shares its kernel root while that root stays unified
    /// (module header); the embedder's translated user code must then check its memory
    /// operands against [`USER_LIMIT`].
    pub unified: bool,
    /// A guest CR3 write keeps the new space's leaves that the guest's tables still map
    /// alike (`revalidate.rs`) instead of dropping every non-global one.
    pub revalidate_on_cr3_write: bool,
    /// A guest CR3 write to a space whose kernel half the current space shares may keep
    /// the current kernel root, if its lower half is empty: the root is *lent* to the
    /// new space, and goes home when the guest switches back (`lend.rs`). No real CR3
    /// load is needed either way out (Linux's `text_poke` switches to `poking_mm` and
    /// back for every patched instruction).
    pub lend_roots: bool,
}

/// A page fault the guest must see, as a real CPU at the virtual CPL would raise it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GuestFault {
    /// Exception vector (always [`PF_VECTOR`]).
    pub vector: u8,
    /// Error code (`PF_*` bits).
    pub error_code: u32,
    /// The faulting linear address (the guest's CR2).
    pub cr2: GuestVirt,
}

impl GuestFault {
    /// A #PF at `va` with `error_code`.
    pub fn page_fault(va: GuestVirt, error_code: u32) -> Self {
        GuestFault {
            vector: PF_VECTOR,
            error_code,
            cr2: va,
        }
    }
}

/// What a fill did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FillOutcome {
    /// The shadow now maps the page; `pa` is the translation of the faulting address.
    Mapped {
        /// Guest-physical address of `va`.
        pa: GuestPhys,
    },
    /// The guest's tables forbid the access: deliver this fault to the guest.
    GuestFault(GuestFault),
    /// A write to a protected code frame: invalidate the frame's traces, call
    /// [`ShadowMmu::unprotect_code_frame`] and re-execute the write. The guest's A/D bits
    /// are already set; the shadow maps the page read-only.
    ProtectedCode {
        /// The protected 4 KiB frame.
        frame: GuestPhys,
        /// Guest-physical address of `va`.
        pa: GuestPhys,
    },
}

/// Hardware TLB invalidation the embedder owes before guest code runs again, because
/// shadow entries of the loaded root were dropped or lost their W bit.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum HwFlush {
    /// Nothing to do.
    #[default]
    None,
    /// `invlpg` each of these pages (or reload CR3).
    Pages(Vec<GuestVirt>),
    /// Reload CR3.
    All,
}

/// Failures of the shadow MMU itself (guest faults are [`FillOutcome::GuestFault`]).
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum ShadowError {
    /// The guest's own tables map an address in PML4 slots 256–259, which the engine
    /// reserves (an access the guest's tables deny is a guest fault, not this error).
    #[error("the guest's page tables map {:#x}, in PML4 slots 256-259 that the engine reserves; guest accesses there are not supported", .0.0)]
    ReservedSlot(GuestVirt),
    /// The guest address is not canonical (the guest gets #GP, not #PF).
    #[error("guest address {:#x} is not canonical", .0.0)]
    NonCanonical(GuestVirt),
    /// A guest paging-structure entry lies outside backed guest memory.
    #[error("guest paging-structure entry at {:#x} is not backed", .0.0)]
    GuestTableUnbacked(GuestPhys),
    /// The guest maps a frame it may not map (e.g. the stolen region).
    #[error("guest maps {:#x} to frame {:#x}, which the guest may not map", .va.0, .frame.0)]
    ForbiddenFrame {
        /// The guest virtual address.
        va: GuestVirt,
        /// The frame the guest's tables name.
        frame: GuestPhys,
    },
    /// A guest paging structure (or CR3) lies in a frame the guest may not map; the walk
    /// would read, and set A/D bits in, engine memory.
    #[error("guest paging structure at {:#x} lies in a frame the guest may not map", .0.0)]
    ForbiddenTable(GuestPhys),
    /// No frame left for a shadow table.
    #[error("out of frames for shadow page tables")]
    OutOfTables,
    /// A shadow table or the template root is not backed.
    #[error("shadow table entry at {:#x} is not backed", .0.0)]
    ShadowTableUnbacked(GuestPhys),
    /// [`ShadowConfig::phys_addr_bits`] is outside 32..=52.
    #[error("guest physical-address width {0} is outside 32..=52")]
    PhysAddrBits(u32),
    /// [`ShadowConfig::max_roots`] is below 2.
    #[error("shadow root cache must hold at least the two views of one space")]
    TooFewRoots,
    /// [`ShadowConfig::prefetch`] is not 0, 1 or a power of two up to 512.
    #[error("prefetch group of {0} pages is not a power of two up to 512")]
    Prefetch(usize),
}

/// Counters of the shadow MMU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShadowStats {
    /// Fills that installed a shadow leaf.
    pub fills: u64,
    /// Shadow leaves installed by prefetch (not counted in `fills`).
    pub prefetched: u64,
    /// Guest faults reflected (from fills and translations).
    pub guest_faults: u64,
    /// Guest entries whose A or D bit was set.
    pub ad_updates: u64,
    /// Invalidation requests: CR3 writes, `invlpg`s, full flushes.
    pub invalidations: u64,
    /// Shadow leaves dropped by invalidations and evictions.
    pub leaves_dropped: u64,
    /// Non-global shadow leaves a CR3 write kept because the guest's tables still map
    /// them alike ([`ShadowConfig::revalidate_on_cr3_write`]).
    pub leaves_kept: u64,
    /// Non-global shadow leaves a CR3 write moved to the frame the guest's tables map
    /// now (`revalidate.rs`).
    pub leaves_moved: u64,
    /// Writes that faulted on a protected code frame.
    pub write_protect_faults: u64,
    /// Code frames currently protected.
    pub protected_frames: u64,
    /// Shadow roots evicted from the cache.
    pub roots_evicted: u64,
    /// Kernel roots lent to another space on a CR3 write ([`ShadowConfig::lend_roots`]).
    pub roots_lent: u64,
    /// Lent roots that went back to the space they were built for.
    pub roots_returned: u64,
    /// Shadow tables currently allocated (roots included).
    pub tables: u64,
}

/// One cached shadow root.
#[derive(Clone, Copy, Debug)]
struct RootSlot {
    /// The guest space: PML4 frame of the guest CR3.
    space: u64,
    /// The space the root served before it was last lent (the one it was built for if
    /// never lent); differs from `space` while the root is lent.
    home: u64,
    view: View,
    root: GuestPhys,
    last_use: u64,
    /// Leaves were installed since the last CR3-write flush of this root, so the next CR3
    /// write must walk it (else it holds nothing a CR3 write drops and is skipped).
    filled: bool,
    /// A kernel root that installed a leaf the user view may not see (module header): the
    /// space's user view has a root of its own from then on.
    split: bool,
    /// The lower half of the space this root was last lent to, kept for its next loan
    /// (`lend.rs`).
    parked: lend::Parked,
}

/// The shadow MMU of one vCPU.
pub struct ShadowMmu<M: PhysMem> {
    mem: M,
    config: ShadowConfig,
    control: PagingControl,
    cr3: u64,
    roots: Vec<RootSlot>,
    clock: u64,
    rmap: ReverseMap,
    stats: ShadowStats,
    hw_flush: HwFlush,
    /// A present shadow entry was dropped or rewritten (or a table freed) since the
    /// last guest CR3 write began: the loaded root's TLB entries may be stale.
    narrowed: bool,
}

impl<M: PhysMem> ShadowMmu<M> {
    /// A shadow MMU for a guest whose CR3 is `cr3`; no root is built until one is asked for.
    pub fn new(
        mem: M,
        config: ShadowConfig,
        control: PagingControl,
        cr3: u64,
    ) -> Result<Self, ShadowError> {
        if config.max_roots < 2 {
            return Err(ShadowError::TooFewRoots);
        }
        if !(pte::MIN_PHYS_ADDR_BITS..=pte::MAX_PHYS_ADDR_BITS).contains(&config.phys_addr_bits) {
            return Err(ShadowError::PhysAddrBits(config.phys_addr_bits));
        }
        if config.prefetch > pte::ENTRIES
            || (config.prefetch > 1 && !config.prefetch.is_power_of_two())
        {
            return Err(ShadowError::Prefetch(config.prefetch));
        }
        let mut mmu = ShadowMmu {
            mem,
            config,
            control,
            cr3,
            roots: Vec::new(),
            clock: 0,
            rmap: ReverseMap::new(),
            stats: ShadowStats::default(),
            hw_flush: HwFlush::None,
            narrowed: false,
        };
        for slot in ENGINE_SLOTS {
            mmu.read(Self::slot_addr(config.template_root, slot))?;
        }
        Ok(mmu)
    }

    /// The platform.
    pub fn mem(&self) -> &M {
        &self.mem
    }

    /// The platform, mutably (the guest's memory is the embedder's).
    pub fn mem_mut(&mut self) -> &mut M {
        &mut self.mem
    }

    /// Counters.
    pub fn stats(&self) -> ShadowStats {
        ShadowStats {
            protected_frames: self.rmap.protected_count() as u64,
            ..self.stats
        }
    }

    /// The reverse map (read-only).
    pub fn reverse_map(&self) -> &ReverseMap {
        &self.rmap
    }

    /// Number of protected code frames.
    pub fn protected_frames(&self) -> usize {
        self.rmap.protected_count()
    }

    /// The guest's CR3.
    pub fn cr3(&self) -> u64 {
        self.cr3
    }

    /// The guest control bits in force.
    pub fn control(&self) -> PagingControl {
        self.control
    }

    /// Takes the hardware TLB invalidation owed since the last call.
    pub fn take_hw_flush(&mut self) -> HwFlush {
        core::mem::take(&mut self.hw_flush)
    }

    /// The shadow root to load into the real CR3 for the current space and `view`,
    /// built (engine slots copied, nothing else mapped) if it is not cached.
    pub fn root(&mut self, view: View) -> Result<GuestPhys, ShadowError> {
        let view = self.backing_view(view);
        let space = self.cr3 & pte::ADDR_MASK;
        self.clock += 1;
        let clock = self.clock;
        if let Some(r) = self
            .roots
            .iter_mut()
            .find(|r| r.space == space && r.view == view)
        {
            r.last_use = clock;
            return Ok(r.root);
        }
        while self.roots.len() >= self.config.max_roots {
            self.evict_lru(space)?;
        }
        let root = self.alloc_table()?;
        for slot in ENGINE_SLOTS {
            let e = self.read(Self::slot_addr(self.config.template_root, slot))?;
            self.write(Self::slot_addr(root, slot), e)?;
        }
        self.roots.push(RootSlot {
            space,
            home: space,
            view,
            root,
            last_use: clock,
            filled: false,
            split: false,
            parked: lend::Parked::default(),
        });
        Ok(root)
    }

    /// The view whose root serves `view` in the current space: the kernel's for the user
    /// view while the space's kernel root is unified (or not built yet).
    fn backing_view(&self, view: View) -> View {
        if view == View::Kernel || !self.config.unified || !self.control.wp {
            return view;
        }
        let space = self.cr3 & pte::ADDR_MASK;
        let split = self
            .roots
            .iter()
            .any(|r| r.space == space && r.view == View::Kernel && r.split);
        if split {
            View::User
        } else {
            View::Kernel
        }
    }

    /// Whether the user view of the current space shares the kernel root.
    pub fn is_unified(&self) -> bool {
        self.backing_view(View::User) == View::Kernel
    }

    /// A leaf for `va` with guest user rights `user` is about to enter the kernel view of
    /// the current space: split that root from the user view if the leaf breaks the rule
    /// of a unified root.
    pub(super) fn note_kernel_leaf(&mut self, va: GuestVirt, user: bool, view: View) {
        if view != View::Kernel || !((va.0 < USER_LIMIT && !user) || va.0 >= TOP_GUARD) {
            return;
        }
        let space = self.cr3 & pte::ADDR_MASK;
        if let Some(r) = self
            .roots
            .iter_mut()
            .find(|r| r.space == space && r.view == View::Kernel)
        {
            r.split = true;
        }
    }

    /// The guest writes CR3: switch spaces and drop the new space's non-global shadow
    /// leaves (all of them if CR4.PGE = 0), as the real TLB would be flushed — or, with
    /// [`ShadowConfig::revalidate_on_cr3_write`], keep those the guest's tables still map
    /// alike (`revalidate.rs`). A hardware flush is owed if the new space's kernel root
    /// is not the old one's (the embedder loads it) or a leaf of it was dropped or
    /// narrowed; with [`ShadowConfig::lend_roots`] the old kernel root may serve the new
    /// space (`lend.rs`).
    pub fn write_cr3(&mut self, cr3: u64) -> Result<(), ShadowError> {
        self.stats.invalidations += 1;
        let old_space = self.cr3 & pte::ADDR_MASK;
        let space = cr3 & pte::ADDR_MASK;
        let old_root = self.kernel_root_of(old_space);
        self.cr3 = cr3;
        self.narrowed = false;
        let lent = if self.config.lend_roots && space != old_space {
            self.lend_or_return(old_space, space)?
        } else {
            None
        };
        let keep_global = self.control.pge;
        let mut roots = Vec::new();
        for r in self
            .roots
            .iter_mut()
            .filter(|r| r.space == space && r.filled)
        {
            r.filled = false;
            roots.push((r.root, r.view));
        }
        for (root, view) in roots {
            if self.config.revalidate_on_cr3_write {
                let all = Rights {
                    writable: true,
                    user: true,
                    no_execute: false,
                };
                let guest = cr3 & pte::ADDR_MASK;
                let (_, nonglobal) =
                    self.revalidate_table(root, pte::LEVELS, 0, Some(guest), all, view)?;
                if let Some(r) = self.roots.iter_mut().find(|r| r.root == root) {
                    r.filled = nonglobal;
                }
            } else {
                self.zap_table(root, pte::LEVELS, keep_global)?;
            }
        }
        let root = self.kernel_root_of(space);
        if self.narrowed || root.is_none() || root != old_root {
            self.hw_flush = HwFlush::All;
        }
        if let Some(root) = lent {
            // After the revalidation above, which then had no lower half to walk: what
            // this drops or frees was in no real CR3 since its last load.
            self.unpark(root, space)?;
        }
        Ok(())
    }

    /// The kernel-view root serving `space`, if one is cached.
    pub(super) fn kernel_root_of(&self, space: u64) -> Option<GuestPhys> {
        self.roots
            .iter()
            .find(|r| r.space == space && r.view == View::Kernel)
            .map(|r| r.root)
    }

    /// The guest changes CR0.WP, EFER.NXE, CR4.PGE or CR4.SMEP: if anything changed, every
    /// shadow leaf (global ones too) is dropped.
    pub fn set_control(&mut self, control: PagingControl) -> Result<(), ShadowError> {
        if control != self.control {
            self.control = control;
            self.flush_all()?;
        }
        Ok(())
    }

    /// The guest executes `invlpg va`: drop `va`'s leaves in both views of the current
    /// space, and its global leaves in every other cached space.
    pub fn invlpg(&mut self, va: GuestVirt) -> Result<(), ShadowError> {
        self.stats.invalidations += 1;
        if !pte::is_canonical(va.0) || RESERVED_SLOTS.contains(&pte::index(va.0, 4)) {
            return Ok(());
        }
        let space = self.cr3 & pte::ADDR_MASK;
        let roots: Vec<(GuestPhys, bool)> = self
            .roots
            .iter()
            .map(|r| (r.root, r.space == space))
            .collect();
        for (root, current) in roots {
            let Some(leaf) = self.find_leaf(root, va)? else {
                continue;
            };
            if current || leaf.entry & pte::SW_GLOBAL != 0 {
                self.forget_leaf(leaf.slot, leaf.entry, leaf.level, va)?;
            }
        }
        Ok(())
    }

    /// Drops every shadow leaf of every cached root (global ones too); tables are freed,
    /// roots kept.
    pub fn flush_all(&mut self) -> Result<(), ShadowError> {
        self.stats.invalidations += 1;
        let roots: Vec<GuestPhys> = self.roots.iter().map(|r| r.root).collect();
        for r in self.roots.iter_mut() {
            r.filled = false;
        }
        for root in roots {
            self.zap_table(root, pte::LEVELS, false)?;
            self.drop_parked(root)?;
        }
        self.hw_flush = HwFlush::All;
        Ok(())
    }

    /// `va` (in the reserved zone ([`RESERVED_SLOTS`]), or reached from a base register
    /// in it) for `access` in `view` as the guest's own tables say (A/D bits set as
    /// hardware would): the guest-physical address, or the fault the guest takes. Nothing
    /// is installed in the shadow (the zone stays the engine's); the embedder performs
    /// the access on that frame.
    pub fn translate_reserved(
        &mut self,
        va: GuestVirt,
        access: Access,
        view: View,
    ) -> Result<Result<GuestPhys, GuestFault>, ShadowError> {
        if !pte::is_canonical(va.0) {
            return Err(ShadowError::NonCanonical(va));
        }
        let leaf = match walk::walk(
            &mut self.mem,
            &self.control,
            self.config.phys_addr_bits,
            self.cr3,
            va,
            access,
            view,
        )? {
            Ok(leaf) => leaf,
            Err(fault) => {
                self.stats.guest_faults += 1;
                return Ok(Err(fault));
            }
        };
        self.stats.ad_updates += u64::from(leaf.ad_updates);
        if !self.mem.guest_may_map(leaf.frame) {
            return Err(ShadowError::ForbiddenFrame {
                va,
                frame: leaf.frame,
            });
        }
        Ok(Ok(GuestPhys(
            leaf.frame.0 | (va.0 & (pte::TABLE_BYTES - 1)),
        )))
    }

    /// Handles a shadow miss: walks the guest tables for `access` to `va` in `view`,
    /// sets A/D bits as hardware would, and installs the shadow leaf, or says which guest
    /// fault to deliver.
    pub fn fill(
        &mut self,
        va: GuestVirt,
        access: Access,
        view: View,
    ) -> Result<FillOutcome, ShadowError> {
        if !pte::is_canonical(va.0) {
            return Err(ShadowError::NonCanonical(va));
        }
        let reserved = RESERVED_SLOTS.contains(&pte::index(va.0, 4));
        let leaf = match walk::walk(
            &mut self.mem,
            &self.control,
            self.config.phys_addr_bits,
            self.cr3,
            va,
            access,
            view,
        )? {
            Ok(leaf) => leaf,
            Err(fault) => {
                self.stats.guest_faults += 1;
                return Ok(FillOutcome::GuestFault(fault));
            }
        };
        self.stats.ad_updates += u64::from(leaf.ad_updates);
        if reserved {
            return Err(ShadowError::ReservedSlot(va));
        }
        if !self.mem.guest_may_map(leaf.frame) && !self.mem.guest_may_map_device(leaf.frame) {
            return Err(ShadowError::ForbiddenFrame {
                va,
                frame: leaf.frame,
            });
        }
        let root = self.root(view)?;
        if let Some(r) = self.roots.iter_mut().find(|r| r.root == root) {
            r.filled = true;
        }
        self.note_kernel_leaf(va, leaf.user, view);
        let large = self.config.large_pages && leaf.level >= 2 && self.large_ok(leaf.frame);
        let level = if large { 2 } else { 1 };
        let slot = self.leaf_slot_alloc(root, va, level)?;
        let new = self.shadow_leaf(&leaf, view, large);
        let old = self.read(slot)?;
        if old & pte::PRESENT != 0 {
            if pte::leaf_base(old, level) != pte::leaf_base(new, level) {
                self.unlist_leaf(slot, old, level);
                self.note_hw_flush(va.page());
            } else if old & pte::WRITABLE != 0 && new & pte::WRITABLE == 0 {
                self.note_hw_flush(va.page());
            }
        }
        self.write(slot, new)?;
        let base = GuestPhys(pte::leaf_base(new, level));
        if large {
            let va = GuestVirt(va.0 & !(pte::LARGE_PAGE_BYTES - 1));
            self.rmap.insert_large(base, ShadowMapping { slot, va });
        } else {
            let va = va.page();
            self.rmap.insert(base, ShadowMapping { slot, va });
        }
        self.stats.fills += 1;
        if !large && self.config.prefetch > 1 {
            self.prefetch(&leaf, view, va, slot)?;
        }
        let pa = GuestPhys(leaf.frame.0 | (va.0 & (pte::TABLE_BYTES - 1)));
        if access == Access::Write && self.rmap.is_protected(leaf.frame) {
            self.stats.write_protect_faults += 1;
            return Ok(FillOutcome::ProtectedCode {
                frame: leaf.frame,
                pa,
            });
        }
        Ok(FillOutcome::Mapped { pa })
    }

    /// Handles a hardware #PF taken by guest code at `va` with hardware error code
    /// `hw_error_code` while `view` was loaded: the access kind comes from the W and I/D
    /// bits, then this is [`ShadowMmu::fill`]. A write to a protected code frame (through
    /// any alias) is reported as [`FillOutcome::ProtectedCode`].
    pub fn on_page_fault(
        &mut self,
        va: GuestVirt,
        hw_error_code: u32,
        view: View,
    ) -> Result<FillOutcome, ShadowError> {
        let access = if hw_error_code & PF_FETCH != 0 {
            Access::Fetch
        } else if hw_error_code & PF_WRITE != 0 {
            Access::Write
        } else {
            Access::Read
        };
        self.fill(va, access, view)
    }

    /// Marks `frame` as holding translated code: every shadow leaf mapping it (in every
    /// root and view) loses W now, and future fills map it read-only. `true` if newly
    /// protected.
    pub fn protect_code_frame(&mut self, frame: GuestPhys) -> Result<bool, ShadowError> {
        if !self.rmap.protect(frame) {
            return Ok(false);
        }
        let mappings: Vec<ShadowMapping> = self.rmap.mappings(frame).to_vec();
        for m in mappings {
            let e = self.read(m.slot)?;
            if e & pte::WRITABLE != 0 {
                self.write(m.slot, e & !pte::WRITABLE)?;
                self.note_hw_flush(m.va);
            }
        }
        // 2 MiB leaves covering the frame are dropped; refills use 4 KiB leaves.
        let base = GuestPhys(frame.0 & !(pte::LARGE_PAGE_BYTES - 1));
        let large: Vec<ShadowMapping> = self.rmap.large_mappings(base).to_vec();
        for m in large {
            let e = self.read(m.slot)?;
            self.forget_leaf(m.slot, e, 2, m.va)?;
        }
        Ok(true)
    }

    /// Drops the protection of `frame` (after its traces were invalidated): every shadow
    /// leaf whose guest entry allows the write regains W. `true` if it was protected.
    pub fn unprotect_code_frame(&mut self, frame: GuestPhys) -> Result<bool, ShadowError> {
        if !self.rmap.unprotect(frame) {
            return Ok(false);
        }
        let mappings: Vec<ShadowMapping> = self.rmap.mappings(frame).to_vec();
        for m in mappings {
            let e = self.read(m.slot)?;
            if e & pte::SW_WRITABLE != 0 {
                self.write(m.slot, e | pte::WRITABLE)?;
            }
        }
        Ok(true)
    }

    /// Drops every protection (after the embedder dropped every translation); returns
    /// how many frames were protected.
    pub fn unprotect_all_code_frames(&mut self) -> Result<usize, ShadowError> {
        let frames: Vec<GuestPhys> = self.rmap.protected_frames().collect();
        for f in &frames {
            self.unprotect_code_frame(*f)?;
        }
        Ok(frames.len())
    }

    /// Whether `frame` is protected.
    pub fn is_code_frame_protected(&self, frame: GuestPhys) -> bool {
        self.rmap.is_protected(frame)
    }

    /// The shadow leaf mapping `va` in `view` of the current space, if any, as the 4 KiB
    /// PTE it amounts to (a 2 MiB leaf is narrowed to `va`'s frame, PS dropped, PAT moved
    /// to bit 7) (for `translate`, diagnostics and tests).
    pub fn shadow_entry(&mut self, va: GuestVirt, view: View) -> Result<Option<u64>, ShadowError> {
        Ok(self.shadow_leaf_ref(va, view)?.map(|leaf| {
            if leaf.level == 1 {
                return leaf.entry;
            }
            let e = leaf.entry;
            let frame = pte::leaf_base(e, 2)
                + (va.0 & (pte::LARGE_PAGE_BYTES - 1) & !(pte::TABLE_BYTES - 1));
            let pat = if e & pte::LARGE_PAT != 0 {
                pte::PTE_PAT
            } else {
                0
            };
            frame | (e & !pte::ADDR_MASK & !pte::PAGE_SIZE) | pat
        }))
    }

    /// What the hardware finds for `va` walking the shadow tables from `root` (the real
    /// CR3's): `None` if no present leaf maps it, else whether every level allows writes.
    pub fn hardware_rights(
        &mut self,
        root: GuestPhys,
        va: GuestVirt,
    ) -> Result<Option<bool>, ShadowError> {
        Ok(self.find_leaf(root, va)?.map(|leaf| leaf.writable))
    }

    /// The level of the shadow leaf mapping `va` in `view` (1 = 4 KiB, 2 = 2 MiB), if any.
    pub fn shadow_leaf_level(
        &mut self,
        va: GuestVirt,
        view: View,
    ) -> Result<Option<u8>, ShadowError> {
        Ok(self.shadow_leaf_ref(va, view)?.map(|leaf| leaf.level))
    }

    fn shadow_leaf_ref(
        &mut self,
        va: GuestVirt,
        view: View,
    ) -> Result<Option<tables::LeafRef>, ShadowError> {
        if !pte::is_canonical(va.0) {
            return Err(ShadowError::NonCanonical(va));
        }
        if RESERVED_SLOTS.contains(&pte::index(va.0, 4)) {
            // Never a guest leaf there; a fill walks the guest's tables.
            return Ok(None);
        }
        let space = self.cr3 & pte::ADDR_MASK;
        let view = self.backing_view(view);
        let Some(root) = self
            .roots
            .iter()
            .find(|r| r.space == space && r.view == view)
            .map(|r| r.root)
        else {
            return Ok(None);
        };
        self.find_leaf(root, va)
    }

    /// Whether the 2 MiB around `frame` can be one shadow leaf: no protected code frame
    /// in it, and the guest may map all of it.
    fn large_ok(&self, frame: GuestPhys) -> bool {
        let base = GuestPhys(frame.0 & !(pte::LARGE_PAGE_BYTES - 1));
        !self.rmap.any_protected_in(base, pte::LARGE_PAGE_BYTES)
            && self.mem.guest_may_map_range(base, pte::LARGE_PAGE_BYTES)
    }

    // ---- internals ----

    /// The shadow leaf for a guest leaf in `view`: a 4 KiB PTE for `leaf.frame`, or with
    /// `large` a 2 MiB PDE for the 2 MiB around it (checked by [`Self::large_ok`]).
    pub(super) fn shadow_leaf(&self, leaf: &GuestLeaf, view: View, large: bool) -> u64 {
        let write_allowed = match view {
            View::User => leaf.user && leaf.writable,
            View::Kernel => leaf.writable || !self.control.wp,
        };
        let mut e = if large {
            let base = leaf.frame.0 & !(pte::LARGE_PAGE_BYTES - 1);
            let pat = if leaf.cache_bits & pte::PTE_PAT != 0 {
                pte::LARGE_PAT
            } else {
                0
            };
            base | pte::PAGE_SIZE | (leaf.cache_bits & !pte::PTE_PAT) | pat
        } else {
            leaf.frame.0 | leaf.cache_bits
        };
        e |= pte::PRESENT | pte::USER;
        if write_allowed && leaf.dirty {
            e |= pte::SW_WRITABLE;
            if !self.rmap.is_protected(leaf.frame) {
                e |= pte::WRITABLE;
            }
        }
        if leaf.global && self.control.pge {
            e |= pte::SW_GLOBAL;
        }
        if leaf.user {
            e |= pte::SW_GUEST_USER;
        }
        if leaf.no_execute {
            e |= pte::SW_GUEST_NX;
        }
        if self.config.hw_nx {
            e |= pte::NO_EXECUTE;
        }
        e
    }
}

#[cfg(test)]
mod tests;
