//! The stolen region: guest-physical memory the guest OS does not know about (absent from
//! e820), owned by the engine, and mapped by the engine's page tables at [`WINDOW_VA`].
//!
//! | offset              | bytes                 | content                                   |
//! |---------------------|-----------------------|-------------------------------------------|
//! | [`ATTACH_OFFSET`]   | [`ATTACH_BYTES`]      | the attach block ([`crate::attach`])      |
//! | [`BOOT_PT_OFFSET`]  | [`BOOT_PT_BYTES`]     | page tables the VMM builds to enter the engine |
//! | [`IO_RING_OFFSET`]  | [`IO_RING_BYTES`]     | the host I/O ring ([`crate::io_ring`])    |
//! | [`ENGINE_OFFSET`]   | [`ENGINE_BYTES`]      | the engine image (code, data, `.bss`: stacks, its page tables) |
//! | [`HEAP_OFFSET`]     | [`HEAP_BYTES`]        | the engine's heap (its global allocator)  |
//! | [`CODE_CACHE_OFFSET`] | [`CODE_CACHE_BYTES`] | the code cache (`guest_engine::Engine::new`'s region: context, lookup tables, traces) |
//! | [`SHADOW_TABLES_OFFSET`] | [`SHADOW_TABLES_BYTES`] | frames for the shadow page tables (the engine image's `mm/shadow.rs` allocates them) |
//! | [`RECORD_RING_OFFSET`] | [`RECORD_RING_BYTES`] (to the region end) | the record ring ([`crate::record_ring`]): a tool's records to a simulator on the host |
//!
//! The engine image is linked at `WINDOW_VA + ENGINE_OFFSET`; the VMM loads each ELF
//! segment at `stolen_base + (p_vaddr - WINDOW_VA)`.

/// The PML4 slot an address lies in (bits 47:39).
pub const fn pml4_slot(va: u64) -> usize {
    ((va >> 39) & 0x1ff) as usize
}

/// The first address of PML4 slot `slot` (0-511), sign-extended in the upper half.
pub const fn slot_va(slot: usize) -> u64 {
    let va = (slot as u64) << 39;
    if slot >= 256 {
        va | 0xffff_0000_0000_0000
    } else {
        va
    }
}

/// The engine window's PML4 slot ([`WINDOW_VA`]).
pub const WINDOW_SLOT: usize = 257;
/// The physmap's PML4 slot ([`PHYSMAP_VA`]).
pub const PHYSMAP_SLOT: usize = 258;
/// The PML4 slots a guest may not use, first to last: 256 (faults at CPL 3 on this KVM),
/// the window, the physmap, and 259, a guard above the physmap (the shadow MMU keeps
/// them out of every guest root; the isolation checks fence them off).
pub const RESERVED_SLOTS: core::ops::RangeInclusive<usize> = 256..=259;
const _: () =
    assert!(*RESERVED_SLOTS.start() < WINDOW_SLOT && PHYSMAP_SLOT < *RESERVED_SLOTS.end());
const _: () = assert!(PHYSMAP_SLOT == WINDOW_SLOT + 1);

/// Virtual base of the engine window: PML4 slot 257, inside the range Linux leaves to
/// hypervisors (`0xffff_8000_0000_0000`–`0xffff_87ff_ffff_ffff`, slots 256–271), so no
/// guest mapping collides with it.
///
/// Not slot 256, where the design first put it: measured here (the engine's bring-up
/// probe reads through every PML4 slot at CPL 3), on this KVM (`kvm_pvm`) code at
/// hardware CPL 3 — where the engine runs — gets a #PF with the reserved-bit error code
/// (0xd on a read, 0x1d on a fetch) for any address in slot 256 whatever the page tables
/// say; every other slot, lower and upper half, works.
pub const WINDOW_VA: u64 = slot_va(WINDOW_SLOT);
/// Virtual base at which the engine maps all guest-physical memory: PML4 slot 258. Use
/// 2 MiB pages: this KVM offers no 1 GiB pages
/// (`pdpe1gb` is absent from `KVM_GET_SUPPORTED_CPUID`, and a 1 GiB PDPT entry faults
/// with the reserved-bit error code).
pub const PHYSMAP_VA: u64 = slot_va(PHYSMAP_SLOT);
const _: () = assert!(WINDOW_VA == 0xffff_8080_0000_0000 && PHYSMAP_VA == 0xffff_8100_0000_0000);
/// Attach block offset.
pub const ATTACH_OFFSET: u64 = 0;
/// Bytes reserved for the attach block.
pub const ATTACH_BYTES: u64 = 0x8000;
/// Offset of the VMM-built boot page tables.
pub const BOOT_PT_OFFSET: u64 = 0x8000;
/// Bytes reserved for the boot page tables (eight 4 KiB tables).
pub const BOOT_PT_BYTES: u64 = 0x8000;
/// Offset of the host I/O ring (header, then data).
pub const IO_RING_OFFSET: u64 = 0x10_0000;
/// Bytes of the host I/O ring: a 4 KiB header and 512 KiB of data (the data area must be
/// a power of two).
pub const IO_RING_BYTES: u64 = 0x1000 + 0x8_0000;
/// Offset at which the engine image is linked and loaded.
pub const ENGINE_OFFSET: u64 = 0x20_0000;

/// Bytes the engine image may occupy (`link.ld` asserts it).
pub const ENGINE_BYTES: u64 = 0x60_0000;
/// Offset of the engine's heap.
pub const HEAP_OFFSET: u64 = ENGINE_OFFSET + ENGINE_BYTES;
/// Bytes of the engine's heap (64 MiB: Linux's boot translates tens of thousands of
/// traces, whose fragment and exit tables live here; 16 MiB ran out during `ftrace:`).
pub const HEAP_BYTES: u64 = 0x400_0000;
/// Offset of the code cache (2 MiB aligned: one run of the window's 2 MiB pages, all
/// present, writable, user and executable).
pub const CODE_CACHE_OFFSET: u64 = HEAP_OFFSET + HEAP_BYTES;
/// Bytes of the code cache.
pub const CODE_CACHE_BYTES: u64 = 0x200_0000;
/// Offset of the frames for the shadow MMU's page tables (4 KiB each,
/// [`SHADOW_TABLES_BYTES`] of them).
pub const SHADOW_TABLES_OFFSET: u64 = CODE_CACHE_OFFSET + CODE_CACHE_BYTES;
/// Bytes for shadow page tables: 2048 frames.
pub const SHADOW_TABLES_BYTES: u64 = (112 << 20) - SHADOW_TABLES_OFFSET;
/// Offset of the record ring (header, then records).
pub const RECORD_RING_OFFSET: u64 = SHADOW_TABLES_OFFSET + SHADOW_TABLES_BYTES;
/// Bytes of the record ring: 8 MiB, ~262 k records (64 engine buffers' worth).
pub const RECORD_RING_BYTES: u64 = 8 << 20;
/// Bytes of the stolen region the layout above assumes (the VMM steals exactly this).
pub const LAYOUT_BYTES: u64 = RECORD_RING_OFFSET + RECORD_RING_BYTES;

const _: () = assert!(IO_RING_OFFSET + IO_RING_BYTES <= ENGINE_OFFSET);
const _: () = assert!(SHADOW_TABLES_OFFSET < RECORD_RING_OFFSET);
const _: () =
    assert!(RECORD_RING_OFFSET.is_multiple_of(2 << 20) && LAYOUT_BYTES.is_multiple_of(2 << 20));
const _: () = assert!(SHADOW_TABLES_OFFSET.is_multiple_of(4096));
const _: () = assert!(CODE_CACHE_OFFSET.is_multiple_of(2 << 20));
const _: () = assert!(BOOT_PT_OFFSET + BOOT_PT_BYTES <= IO_RING_OFFSET);
const _: () = assert!(ATTACH_OFFSET + ATTACH_BYTES <= BOOT_PT_OFFSET);
