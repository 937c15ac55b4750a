//! The flat long-mode segments both boot paths give the vCPU. The architectural bits
//! (control registers, EFER, RFLAGS, page-table entries) are `kpin_abi::x86`'s, the one
//! table shared with the engine.

use kvm_bindings::{kvm_segment, kvm_sregs};

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
