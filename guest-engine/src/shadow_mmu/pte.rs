//! Bits of x86-64 4-level paging entries (each entry is 64 bits wide), as the guest writes
//! them and as the shadow tables use them, plus the software bits the shadow MMU keeps in
//! the bits hardware ignores.
//!
//! Invariant: a `SW_*` bit is only ever set in a *shadow* leaf, never in a guest entry.

/// Bit 0: the entry is present.
pub const PRESENT: u64 = 1 << 0;
/// Bit 1: writes allowed (R/W).
pub const WRITABLE: u64 = 1 << 1;
/// Bit 2: user-mode accesses allowed (U/S).
pub const USER: u64 = 1 << 2;
/// Bit 3: page-level write-through.
pub const PWT: u64 = 1 << 3;
/// Bit 4: page-level cache disable.
pub const PCD: u64 = 1 << 4;
/// Bit 5: accessed (set by the CPU on every entry it uses).
pub const ACCESSED: u64 = 1 << 5;
/// Bit 6: dirty (set by the CPU on the leaf on a write).
pub const DIRTY: u64 = 1 << 6;
/// Bit 7 of a PDPTE or PDE: the entry maps a 1 GiB / 2 MiB page (PS). Reserved in a PML4E.
pub const PAGE_SIZE: u64 = 1 << 7;
/// Bit 7 of a 4 KiB PTE: PAT index bit.
pub const PTE_PAT: u64 = 1 << 7;
/// Bit 8 of a leaf: global (survives CR3 writes when CR4.PGE = 1).
pub const GLOBAL: u64 = 1 << 8;
/// Bit 12 of a 2 MiB / 1 GiB leaf: PAT index bit.
pub const LARGE_PAT: u64 = 1 << 12;
/// Bit 63: execute disable (XD/NX); reserved unless EFER.NXE = 1.
pub const NO_EXECUTE: u64 = 1 << 63;
/// Bits 51:12: physical address of the next table or of the 4 KiB frame.
pub const ADDR_MASK: u64 = 0x000f_ffff_ffff_f000;

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
