//! x86-64 architectural bits the VMM writes when it sets up a vCPU (control registers,
//! EFER, RFLAGS, page-table entries) and the flat long-mode segments both boot paths use.

use kvm_bindings::{kvm_segment, kvm_sregs};

/// CR0.PE: protected mode.
pub const CR0_PE: u64 = 1 << 0;
/// CR0.MP: monitor coprocessor.
pub const CR0_MP: u64 = 1 << 1;
/// CR0.ET: extension type (always 1).
pub const CR0_ET: u64 = 1 << 4;
/// CR0.NE: native x87 error reporting.
pub const CR0_NE: u64 = 1 << 5;
/// CR0.WP: supervisor writes honour read-only pages.
pub const CR0_WP: u64 = 1 << 16;
/// CR0.PG: paging.
pub const CR0_PG: u64 = 1 << 31;
/// CR4.PAE: physical-address extension (required for long mode).
pub const CR4_PAE: u64 = 1 << 5;
/// EFER.LME: long mode enable.
pub const EFER_LME: u64 = 1 << 8;
/// EFER.LMA: long mode active.
pub const EFER_LMA: u64 = 1 << 10;
/// RFLAGS bit 1 is always set.
pub const RFLAGS_RESERVED: u64 = 1 << 1;

/// Page-table entry: present.
pub const PTE_PRESENT: u64 = 1 << 0;
/// Page-table entry: writable.
pub const PTE_WRITABLE: u64 = 1 << 1;
/// Page-table entry: user-accessible.
pub const PTE_USER: u64 = 1 << 2;
/// Page-table entry: large page (2 MiB in a PD).
pub const PTE_PAGE_SIZE: u64 = 1 << 7;
/// A 2 MiB page.
pub const TWO_MIB: u64 = 0x20_0000;

/// Loads flat ring-0 long-mode segments into `s`: a 64-bit code segment with selector
/// `cs` and data segments with selector `ds` in DS, ES, FS, GS and SS.
pub fn set_flat_long_mode_segments(s: &mut kvm_sregs, cs: u16, ds: u16) {
    let code = kvm_segment {
        base: 0,
        limit: 0xffff_ffff,
        selector: cs,
        type_: 0xb,
        present: 1,
        dpl: 0,
        db: 0,
        s: 1,
        l: 1,
        g: 1,
        avl: 0,
        unusable: 0,
        padding: 0,
    };
    let data = kvm_segment {
        selector: ds,
        type_: 0x3,
        db: 1,
        l: 0,
        ..code
    };
    s.cs = code;
    s.ds = data;
    s.es = data;
    s.fs = data;
    s.gs = data;
    s.ss = data;
}
