//! The engine's own GDT, TSS and IDT, filled at ring 0 by `ring0_setup` (called once from
//! `_start`, before anything else runs; Rust at ring 0 is emulated here, so this is a few
//! short loops of plain integer code) and loaded by `_start`.
//!
//! Invariant: after `_start` the CPU uses only these tables; CPL-3 code may read (and, for
//! the deliberate #DF test, write) them because the whole window is user-accessible in
//! the boot page tables.

use core::cell::UnsafeCell;

use crate::ring0::entry::{
    kpin_idt_stubs, kpin_ist1_top, kpin_ist2_top, kpin_ist3_top, kpin_ist4_top,
    kpin_ring0_stack_top,
};
use crate::ring0::layout::{
    GDT_ENTRIES, IDT_VECTORS, IST_DF, IST_MC, IST_NMI, IST_PF, KERNEL_CS, USER_CS, VEC_DF,
    VEC_GATE, VEC_GATE_CR3, VEC_MC, VEC_NMI, VEC_PF,
};

/// 64-bit code, DPL 0, present, long mode.
const KERNEL_CODE: u64 = 0x00af_9b00_0000_ffff;
/// Data, DPL 0, present, writable.
const KERNEL_DATA: u64 = 0x00cf_9300_0000_ffff;
/// Data, DPL 3.
const USER_DATA: u64 = 0x00cf_f300_0000_ffff;
/// 64-bit code, DPL 3.
const USER_CODE: u64 = 0x00af_fb00_0000_ffff;
/// TSS size minus one.
const TSS_LIMIT: u64 = 103;
/// Type/attribute byte of an available 64-bit TSS, present, DPL 0.
const TSS_TYPE: u64 = 0x89;
/// Type/attribute byte of a 64-bit interrupt gate, present, DPL 0.
const INTERRUPT_GATE: u64 = 0x8e;
/// The same, DPL 3: the gate's vectors, which CPL 3 reaches with `int n`.
const USER_INTERRUPT_GATE: u64 = 0xee;
/// A 64-bit trap gate, present, DPL 0 (IF stays as it was).
const TRAP_GATE: u64 = 0x8f;
/// TSS words (104 bytes as 26 u32s, avoiding a packed struct).
const TSS_WORDS: usize = 26;
/// Word index of TSS.RSP0.
const TSS_RSP0_WORD: usize = 1;
/// Word index of TSS.IST1.
const TSS_IST1_WORD: usize = 9;
/// Word holding the I/O-map base in its upper half.
const TSS_IOMAP_WORD: usize = 25;

/// The tables, 16-byte aligned.
#[repr(C, align(16))]
pub struct Tables {
    /// GDT: null, kernel code, kernel data, user data, user code, TSS (two slots).
    pub gdt: [u64; GDT_ENTRIES],
    /// Padding to keep the TSS 8-aligned.
    pad: u64,
    /// The TSS.
    pub tss: [u32; TSS_WORDS],
    /// IDT: two words per vector.
    pub idt: [u64; IDT_VECTORS * 2],
}

/// A descriptor-table pointer as `lgdt`/`lidt` read it.
#[repr(C, packed)]
pub struct TablePointer {
    limit: u16,
    base: u64,
}

/// Interior-mutable static storage for the single vCPU.
#[repr(transparent)]
pub struct Racy<T>(pub UnsafeCell<T>);
// SAFETY: one vCPU; the tables are written once at ring 0 before any other code runs,
// and later only by the deliberate-#DF test, which runs alone.
unsafe impl<T> Sync for Racy<T> {}

/// The engine's GDT, TSS and IDT.
pub static TABLES: Racy<Tables> = Racy(UnsafeCell::new(Tables {
    gdt: [0; GDT_ENTRIES],
    pad: 0,
    tss: [0; TSS_WORDS],
    idt: [0; IDT_VECTORS * 2],
}));
/// GDTR image.
pub static GDTR: Racy<TablePointer> = Racy(UnsafeCell::new(TablePointer { limit: 0, base: 0 }));
/// IDTR image.
pub static IDTR: Racy<TablePointer> = Racy(UnsafeCell::new(TablePointer { limit: 0, base: 0 }));

fn addr<T>(r: &T) -> u64 {
    r as *const T as u64
}

/// Fills the GDT, TSS and IDT and their pointers. Runs at ring 0 from `_start`.
pub extern "C" fn ring0_setup() {
    // SAFETY: called once from `_start` before any other engine code; nothing else holds
    // a reference to the tables or the pointers.
    let (t, gdtr, idtr) = unsafe { (&mut *TABLES.0.get(), &mut *GDTR.0.get(), &mut *IDTR.0.get()) };
    let tss_base = addr(&t.tss);
    t.gdt = [
        0,
        KERNEL_CODE,
        KERNEL_DATA,
        USER_DATA,
        USER_CODE,
        (TSS_LIMIT & 0xffff)
            | ((tss_base & 0xff_ffff) << 16)
            | (TSS_TYPE << 40)
            | (((TSS_LIMIT >> 16) & 0xf) << 48)
            | (((tss_base >> 24) & 0xff) << 56),
        tss_base >> 32,
    ];
    // SAFETY: the stack tops are symbols defined in entry.rs; only their addresses are used.
    let (rsp0, ist) = unsafe {
        (
            addr(&kpin_ring0_stack_top),
            [
                addr(&kpin_ist1_top),
                addr(&kpin_ist2_top),
                addr(&kpin_ist3_top),
                addr(&kpin_ist4_top),
            ],
        )
    };
    set_tss_u64(&mut t.tss, TSS_RSP0_WORD, rsp0);
    for (i, top) in ist.iter().enumerate() {
        set_tss_u64(&mut t.tss, TSS_IST1_WORD + 2 * i, *top);
    }
    t.tss[TSS_IOMAP_WORD] = ((TSS_LIMIT as u32) + 1) << 16;
    // SAFETY: `kpin_idt_stubs` is a read-only table of IDT_VECTORS addresses in entry.rs.
    let stubs = unsafe { &kpin_idt_stubs };
    for (v, &handler) in stubs.iter().enumerate() {
        let ist = match v as u8 {
            VEC_DF => IST_DF,
            VEC_NMI => IST_NMI,
            VEC_MC => IST_MC,
            VEC_PF => IST_PF,
            _ => 0,
        };
        let kind = match v as u8 {
            VEC_GATE | VEC_GATE_CR3 => USER_INTERRUPT_GATE,
            VEC_PF => TRAP_GATE,
            _ => INTERRUPT_GATE,
        };
        let cs = if v as u8 == VEC_PF {
            USER_CS
        } else {
            KERNEL_CS
        };
        t.idt[2 * v] = (handler & 0xffff)
            | (u64::from(cs) << 16)
            | (u64::from(ist) << 32)
            | (kind << 40)
            | (((handler >> 16) & 0xffff) << 48);
        t.idt[2 * v + 1] = handler >> 32;
    }
    *gdtr = TablePointer {
        limit: (GDT_ENTRIES * 8 - 1) as u16,
        base: addr(&t.gdt),
    };
    *idtr = TablePointer {
        limit: (IDT_VECTORS * 16 - 1) as u16,
        base: addr(&t.idt),
    };
}

fn set_tss_u64(tss: &mut [u32; TSS_WORDS], word: usize, v: u64) {
    tss[word] = v as u32;
    tss[word + 1] = (v >> 32) as u32;
}

/// Points TSS.RSP0 and the #PF handler's IST stack at `top`: the deliberate-#DF test uses
/// an unmapped address so that the next exception from CPL 3 cannot push its frame, nor
/// the #PF that raises.
pub fn set_exception_stacks(top: u64) {
    // SAFETY: single vCPU, called from CPL-3 code with no other reference to the TSS
    // alive; the CPU reads the TSS only when it delivers an event.
    let t = unsafe { &mut *TABLES.0.get() };
    set_tss_u64(&mut t.tss, TSS_RSP0_WORD, top);
    set_tss_u64(&mut t.tss, TSS_IST1_WORD + 2 * usize::from(IST_PF - 1), top);
}
