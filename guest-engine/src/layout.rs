//! Every constant of the engine's memory layout, documented once.
//!
//! The embedder hands the engine one raw region; the engine carves it as:
//!
//! | offset                 | size                         | content                         |
//! |------------------------|------------------------------|---------------------------------|
//! | 0                      | [`CONTEXT_BYTES`]            | `CacheContext` (guest regs, spill slots, attention byte, buffer pointers) and XSAVE areas |
//! | [`IBL_OFFSET`]         | [`TABLE_SLOTS`] × [`IBL_STRIDE`] | one indirect-branch lookup table per mode slot, one for stepping |
//! | [`RC_OFFSET`]          | [`TABLE_SLOTS`] × [`RC_BYTES`]   | one return cache (landing pads) per table slot  |
//! | [`SOFTTLB_OFFSET`]     | [`SOFTTLB_BYTES`]            | SoftTLB (`softtlb.rs`), read by PA checks |
//! | [`COUNTERS_OFFSET`]    | [`COUNTER_SLOTS`] × 8        | inline instrumentation counters |
//! | [`GENCODE_OFFSET`]     | [`GENCODE_BYTES`]            | enter / exit / IBL-miss routines|
//! | [`TRACES_OFFSET`]      | rest                         | translated traces               |
//!
//! Everything the generated code touches is addressed RIP-relatively, so the whole region
//! must be smaller than 2 GiB ([`MAX_REGION_BYTES`]).

/// Bytes reserved for the `CacheContext` and the two XSAVE areas at the start of the region.
pub const CONTEXT_BYTES: usize = 3 * 4096;
/// Offset of the guest's XSAVE area (x87/SSE/AVX/AVX-512 state while in the dispatcher).
pub const XSAVE_GUEST_OFFSET: usize = 4096;
/// Offset of the host's XSAVE area (the engine's own state while guest code runs).
pub const XSAVE_HOST_OFFSET: usize = 2 * 4096;
/// XSAVE component mask saved by the context switch: x87, SSE, AVX, AVX-512 (no MPX,
/// no AMX), whose standard-format size is below 4096 bytes.
pub const XSAVE_MASK: u32 = 0xE7;
/// log2 of the number of IBL buckets: the hash is the low 16 bits of the target
/// (`movzx eax, dx`), which is the widest flag-free mask x86 offers.
pub const IBL_HASH_BITS: u32 = 16;
/// Number of IBL buckets; one extra bucket lets the second probe skip a wrap check.
pub const IBL_ENTRIES: usize = (1 << IBL_HASH_BITS) + 1;
/// Bytes per IBL entry: `[-guest_va: u64, cache_pc: u64]`.
pub const IBL_ENTRY_BYTES: usize = 16;
/// Translation modes with their own IBL table and return cache (`Mode(0)` kernel,
/// `Mode(3)` user; see `Mode::slot`). Each mode's generated lookups embed its own tables,
/// so a lookup can never hit another mode's fragment and a mode switch clears nothing.
pub const MODE_SLOTS: usize = 2;
/// Lookup-table slots: one per mode slot, plus [`STEP_TABLE_SLOT`] and
/// [`COMPAT_TABLE_SLOT`].
pub const TABLE_SLOTS: usize = MODE_SLOTS + 2;
/// The lookup tables of 32-bit user code (`Mode::compat`).
pub const COMPAT_TABLE_SLOT: usize = MODE_SLOTS + 1;
/// The lookup tables of the stepping modes (`Mode::table_slot`): never filled, so every
/// indirect branch of a stepping trace misses and leaves to the dispatcher.
pub const STEP_TABLE_SLOT: usize = MODE_SLOTS;
/// Offset of the first mode's IBL table.
pub const IBL_OFFSET: usize = CONTEXT_BYTES;
/// Bytes of one IBL table.
pub const IBL_TABLE_BYTES: usize = IBL_ENTRIES * IBL_ENTRY_BYTES;
/// Distance between two modes' IBL tables (page aligned).
pub const IBL_STRIDE: usize = (IBL_TABLE_BYTES + 4095) & !4095;
/// Number of return-cache slots, indexed by the low 16 bits of the return address.
pub const RC_ENTRIES: usize = 1 << 16;
/// Offset of the first mode's return cache: slots of `ret_entry` cache PCs (0 = empty).
pub const RC_OFFSET: usize = IBL_OFFSET + TABLE_SLOTS * IBL_STRIDE;
/// Bytes of one return cache (also the distance between two modes' return caches).
pub const RC_BYTES: usize = RC_ENTRIES * 8;
/// Number of SoftTLB slots (direct mapped by virtual page number; `softtlb.rs`).
pub const SOFTTLB_ENTRIES: usize = 4096;
/// Offset of the SoftTLB: slots of `[va_page: u64, pa_page: u64]` (shared by all
/// modes: the kernel and user views of a VA map to the same frame).
pub const SOFTTLB_OFFSET: usize = RC_OFFSET + TABLE_SLOTS * RC_BYTES;
/// Bytes of the SoftTLB.
pub const SOFTTLB_BYTES: usize = SOFTTLB_ENTRIES * 16;
/// Number of 8-byte inline counters tools may allocate (2 MiB of the region: a Linux
/// boot translates ~100 000 distinct basic blocks, and one counter per block is what a
/// block-counting tool spends).
pub const COUNTER_SLOTS: usize = 1 << 18;
/// Offset of the counter area.
pub const COUNTERS_OFFSET: usize = SOFTTLB_OFFSET + SOFTTLB_BYTES;
/// Offset of the generated enter/exit routines.
pub const GENCODE_OFFSET: usize = COUNTERS_OFFSET + COUNTER_SLOTS * 8;
/// Bytes reserved for the generated routines.
pub const GENCODE_BYTES: usize = 4096;
/// Bytes at the end of the generated routines' area where `Engine::run_redirected`
/// writes the one instruction it runs.
pub const REDIRECT_CODE_BYTES: usize = 64;
/// Offset of the first trace.
pub const TRACES_OFFSET: usize = GENCODE_OFFSET + GENCODE_BYTES;
/// Smallest usable region: the fixed part (about 3.6 MiB) plus 64 KiB of traces.
pub const MIN_REGION_BYTES: usize = TRACES_OFFSET + 64 * 1024;
/// Largest region: RIP-relative displacements are signed 32-bit.
pub const MAX_REGION_BYTES: usize = 1 << 30;
/// Guest instructions per trace before it is cut with a fall-through exit.
pub const MAX_TRACE_INSNS: usize = 96;
/// Bytes of one memory-reference record (`MemRecord`).
pub const MEM_RECORD_BYTES: usize = 32;
/// Counter slots per mode for the engine's own instruction count
/// (`Config::count_insns`), taken from the counter area before any tool's.
pub const INSN_COUNTER_SPREAD: usize = 256;
/// Fragments remembered by `Engine::recent_traces`.
pub const RECENT_TRACES: usize = 32;
/// Largest x86 instruction.
pub const MAX_INSN_BYTES: usize = 15;
