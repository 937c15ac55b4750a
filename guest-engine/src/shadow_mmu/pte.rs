//! Bits of x86-64 4-level paging entries (the architectural ones from
//! `kpin_abi::x86::pte`, as the guest writes them and as the shadow tables use them), plus
//! the software bits the shadow MMU keeps in the bits hardware ignores, and the geometry.
//!
//! Invariant: a `SW_*` bit is only ever set in a *shadow* leaf, never in a guest entry.

pub use kpin_abi::x86::pte::{
    ACCESSED, ADDR_MASK, DIRTY, GLOBAL, LARGE_PAT, NO_EXECUTE, PAGE_SIZE, PCD, PRESENT, PTE_PAT,
    PWT, USER, WRITABLE,
};

/// Software bit 9 of a shadow leaf: the guest allows the write for this view and its leaf
/// is dirty, so the shadow would be writable if the frame were not code-protected.
pub const SW_WRITABLE: u64 = 1 << 9;
/// Software bit 10 of a shadow leaf: the guest leaf is global and CR4.PGE = 1.
pub const SW_GLOBAL: u64 = 1 << 10;
/// Software bit 9 of a shadow *table* entry (levels 4-2, not a leaf; ignored by the
/// hardware there): leaves were installed below it since a CR3 write last found only
/// global leaves there. Without it the subtree holds only global leaves, which a CR3 write
/// keeps, so the write's zap skips it (Linux's kernel half, shared by every process).
pub const SW_NONGLOBAL_BELOW: u64 = 1 << 9;
/// Software bit 11 of a shadow leaf: the guest allows user accesses (U/S = 1 on all levels).
pub const SW_GUEST_USER: u64 = 1 << 11;
/// Software bit 52 of a shadow leaf: the guest forbids instruction fetch (XD with NXE).
pub const SW_GUEST_NX: u64 = 1 << 52;

/// Number of entries in one paging structure.
pub const ENTRIES: usize = 512;
/// Bytes of one paging-structure entry.
pub const ENTRY_BYTES: u64 = 8;
/// Bytes of one paging structure (and of a 4 KiB page).
pub const TABLE_BYTES: u64 = 4096;
/// Address bits translated per level.
pub const BITS_PER_LEVEL: u32 = 9;
/// Bits of the page offset of a 4 KiB page.
pub const PAGE_SHIFT: u32 = 12;
/// Number of levels in 4-level paging (PML4 = 4, PDPT = 3, PD = 2, PT = 1).
pub const LEVELS: u8 = 4;
/// Highest physical-address width x86-64 allows (bits 51:0).
pub const MAX_PHYS_ADDR_BITS: u32 = 52;
/// Lowest physical-address width accepted in [`super::ShadowConfig`] (any x86-64 CPU has
/// at least 36).
pub const MIN_PHYS_ADDR_BITS: u32 = 32;
/// Width of a canonical 4-level virtual address.
pub const VIRT_ADDR_BITS: u32 = 48;

/// Index into the paging structure at `level` (4 = PML4 … 1 = PT) for `va`.
pub const fn index(va: u64, level: u8) -> usize {
    ((va >> (PAGE_SHIFT + BITS_PER_LEVEL * (level as u32 - 1))) & (ENTRIES as u64 - 1)) as usize
}

/// Bytes mapped by one leaf at `level` (1 → 4 KiB, 2 → 2 MiB, 3 → 1 GiB).
pub const fn level_page_bytes(level: u8) -> u64 {
    1 << (PAGE_SHIFT + BITS_PER_LEVEL * (level as u32 - 1))
}

/// Whether `va` is canonical for 4-level paging (bits 63:47 all equal).
pub const fn is_canonical(va: u64) -> bool {
    let top = (va as i64) >> (VIRT_ADDR_BITS - 1);
    top == 0 || top == -1
}

/// Mask of the physical-address bits at or above `phys_addr_bits` (reserved in every entry).
pub const fn phys_reserved_mask(phys_addr_bits: u32) -> u64 {
    ADDR_MASK & !((1u64 << phys_addr_bits) - 1)
}

/// Reserved bits 20:13 of a 2 MiB leaf (between the PAT bit and the frame address).
pub const LARGE_2M_RESERVED: u64 = ((1 << 21) - 1) & !((1 << 13) - 1);
/// Reserved bits 29:13 of a 1 GiB leaf.
pub const LARGE_1G_RESERVED: u64 = ((1 << 30) - 1) & !((1 << 13) - 1);

/// Bytes of a 2 MiB page (the largest shadow leaf: this KVM offers no 1 GiB pages).
pub const LARGE_PAGE_BYTES: u64 = 1 << 21;

/// The physical base of the leaf `e` at `level` (1 = 4 KiB PTE, 2 = 2 MiB PDE, 3 = 1 GiB
/// PDPTE); for a large leaf bit 12 (PAT) and the low address bits are not address bits.
pub const fn leaf_base(e: u64, level: u8) -> u64 {
    e & ADDR_MASK & !(level_page_bytes(level) - 1)
}
