//! The IDT and the Rust half of every trap: exception fix-ups, demand paging, the ring-3
//! exit gate, IRQ routing, and the `MINIKERNEL-PANIC` report for anything unplanned.
//!
//! Invariants:
//! * A fault is *planned* iff (a) its RIP is listed in `__ex_table` (then RIP becomes the
//!   fix-up address), or (b) it is a not-present #PF on the page armed in [`DEMAND`] with
//!   the expected U/S bit (then a frame is mapped and the instruction retried), or (c) it is
//!   the `ud2` at `user_exit_gate` executed at CPL 3 (then the ring-3 task ends). Anything
//!   else, including every fault while handling a fault, is reported and powers off.
//! * Every exception is recorded in [`LAST_TRAP`] and appended to the trap log *before* it
//!   is handled, so a step can print exactly what the CPU reported.

use core::arch::asm;
use core::ptr::addr_of;

use crate::console::{fresh_line, print, print_dec, print_hex};
use crate::cpu::{invlpg, poweroff, read_cr2, read_cr3};
use crate::entry::{trap_stub_table, user_return};
use crate::gdt::DescriptorPointer;
use crate::global::Global;
use crate::layout::{DF_IST, KERNEL_CS, PAGE_SIZE, TIMER_VECTOR, TRAP_VECTORS};
use crate::{paging, pic, user};

/// #UD.
pub const VEC_UD: u64 = 6;
/// #DF.
pub const VEC_DF: u64 = 8;
/// #GP.
pub const VEC_GP: u64 = 13;
/// #PF.
pub const VEC_PF: u64 = 14;
/// #PF error code bit 0: the page was present (protection violation).
pub const PF_PRESENT: u64 = 1 << 0;
/// #PF error code bit 2: the access was made at CPL 3.
pub const PF_USER: u64 = 1 << 2;

/// Interrupt gate (type 0xE), present, DPL 0, in bits 40..48 of the low qword.
const GATE_INTERRUPT: u64 = 0x8e << 40;
/// Number of IDT entries (all 256 exist; those without a stub are not present).
const IDT_ENTRIES: usize = 256;
/// Entries kept in the trap log.
pub const TRAP_LOG_LEN: usize = 8;

/// What the CPU pushed, plus every GPR; built by `trap_common` in `entry.rs`.
#[repr(C)]
pub struct TrapFrame {
    pub r15: u64,
    pub r14: u64,
    pub r13: u64,
    pub r12: u64,
    pub r11: u64,
    pub r10: u64,
    pub r9: u64,
    pub r8: u64,
    pub rbp: u64,
    pub rdi: u64,
    pub rsi: u64,
    pub rdx: u64,
    pub rcx: u64,
    pub rbx: u64,
    pub rax: u64,
    /// Vector number pushed by the stub.
    pub vector: u64,
    /// The CPU's error code, or 0 for vectors without one.
    pub error: u64,
    pub rip: u64,
    pub cs: u64,
    pub rflags: u64,
    pub rsp: u64,
    pub ss: u64,
}

/// One exception as the CPU reported it.
#[derive(Clone, Copy, Default)]
pub struct TrapRecord {
    pub vector: u64,
    pub error: u64,
    pub rip: u64,
    pub cs: u64,
    pub rflags: u64,
    pub ss: u64,
    /// CR2 for #PF, else 0.
    pub cr2: u64,
}

/// The page that the next not-present #PF may map (step `pf`, step `user-pf`).
#[derive(Clone, Copy)]
pub struct DemandPage {
    /// Page-aligned VA, or 0 when nothing is armed.
    pub va: u64,
    /// Leaf PTE flags for the new mapping.
    pub flags: u64,
    /// Whether the fault must come from CPL 3 (error code bit 2).
    pub user: bool,
    /// Qword stored in the fresh frame at the faulting offset (0: leave the frame zeroed).
    pub fill: u64,
}

/// The last exception taken.
pub static LAST_TRAP: Global<TrapRecord> = Global::new(TrapRecord {
    vector: 0,
    error: 0,
    rip: 0,
    cs: 0,
    rflags: 0,
    ss: 0,
    cr2: 0,
});
/// Number of exceptions taken so far (IRQs excluded).
pub static TRAP_COUNT: Global<u64> = Global::new(0);
/// The first [`TRAP_LOG_LEN`] exceptions since the last [`clear_trap_log`].
static TRAP_LOG: [Global<TrapRecord>; TRAP_LOG_LEN] = [const {
    Global::new(TrapRecord {
        vector: 0,
        error: 0,
        rip: 0,
        cs: 0,
        rflags: 0,
        ss: 0,
        cr2: 0,
    })
}; TRAP_LOG_LEN];
static TRAP_LOG_USED: Global<usize> = Global::new(0);
/// Armed demand page.
pub static DEMAND: Global<DemandPage> = Global::new(DemandPage {
    va: 0,
    flags: 0,
    user: false,
    fill: 0,
});
/// RBX of the ring-3 task when it last left through the exit gate.
pub static USER_REPORT_RBX: Global<u64> = Global::new(0);
/// Set while a trap is being handled; a trap that finds it set is a nested fault.
static IN_EXCEPTION: Global<bool> = Global::new(false);

static IDT: Global<[u64; IDT_ENTRIES * 2]> = Global::new([0; IDT_ENTRIES * 2]);

extern "C" {
    static __ex_table_start: ExEntry;
    static __ex_table_end: ExEntry;
}

/// One `__ex_table` entry: a deliberately faulting instruction and where to continue.
#[repr(C)]
struct ExEntry {
    fault: u64,
    fixup: u64,
}

/// Fills the IDT with the stubs of vectors 0..TRAP_VECTORS (the #DF gate on IST1) and loads it.
pub fn init() {
    let idt = IDT.as_ptr().cast::<u64>();
    // SAFETY: `trap_stub_table` is an initialized, never-written table in entry.rs.
    let stubs: &[u64; TRAP_VECTORS] = unsafe { &trap_stub_table };
    for (vector, &handler) in stubs.iter().enumerate() {
        let ist = if vector as u64 == VEC_DF {
            u64::from(DF_IST)
        } else {
            0
        };
        let low = (handler & 0xffff)
            | (u64::from(KERNEL_CS) << 16)
            | (ist << 32)
            | GATE_INTERRUPT
            | (((handler >> 16) & 0xffff) << 48);
        // SAFETY: `vector < 256`, so both qwords lie inside the static IDT.
        unsafe {
            idt.add(vector * 2).write_volatile(low);
            idt.add(vector * 2 + 1).write_volatile(handler >> 32);
        }
    }
    let idtr = DescriptorPointer {
        limit: (IDT_ENTRIES * 16 - 1) as u16,
        base: idt as u64,
    };
    // SAFETY: the IDT is a static that lives forever and every present gate points at a stub.
    unsafe { asm!("lidt [{}]", in(reg) &idtr, options(readonly, nostack, preserves_flags)) };
}

/// Forgets the trap log.
pub fn clear_trap_log() {
    TRAP_LOG_USED.set(0);
}

/// The `i`-th entry of the trap log, if that many traps were logged.
pub fn trap_log(i: usize) -> Option<TrapRecord> {
    (i < TRAP_LOG_USED.get()).then(|| TRAP_LOG[i].get())
}

/// Number of entries in the trap log.
pub fn trap_log_len() -> usize {
    TRAP_LOG_USED.get()
}

/// Called by `trap_common` for every vector with a stub.
pub extern "C" fn trap_dispatch(frame: &mut TrapFrame) {
    if frame.vector == TIMER_VECTOR {
        pic::on_timer(frame);
    } else if frame.vector > TIMER_VECTOR {
        pic::on_other_irq(frame.vector);
    } else {
        on_exception(frame);
    }
}

fn on_exception(frame: &mut TrapFrame) {
    let cr2 = if frame.vector == VEC_PF {
        read_cr2()
    } else {
        0
    };
    if IN_EXCEPTION.get() {
        panic_trap(frame, read_cr2(), "nested");
    }
    IN_EXCEPTION.set(true);
    let record = TrapRecord {
        vector: frame.vector,
        error: frame.error,
        rip: frame.rip,
        cs: frame.cs,
        rflags: frame.rflags,
        ss: frame.ss,
        cr2,
    };
    LAST_TRAP.set(record);
    TRAP_COUNT.set(TRAP_COUNT.get() + 1);
    let used = TRAP_LOG_USED.get();
    if used < TRAP_LOG_LEN {
        TRAP_LOG[used].set(record);
        TRAP_LOG_USED.set(used + 1);
    }

    let from_user = frame.cs & 3 == 3;
    if frame.vector == VEC_PF && try_demand_map(frame.error, cr2) {
        IN_EXCEPTION.set(false);
        return;
    }
    if from_user && frame.vector == VEC_UD && frame.rip == user::exit_gate_va() {
        USER_REPORT_RBX.set(frame.rbx);
        IN_EXCEPTION.set(false);
        // SAFETY: a ring-3 task started by `run_user` is running (the gate is only reachable
        // from ring 3), so the saved kernel context is valid.
        unsafe { user_return(frame.rax) };
    }
    if from_user {
        crate::steps::probe::note_user_fault(frame, cr2);
    }
    if let Some(fixup) = lookup_fixup(frame.rip, from_user) {
        frame.rip = fixup;
        IN_EXCEPTION.set(false);
        return;
    }
    panic_trap(frame, read_cr2(), "unexpected");
}

/// Maps the armed demand page if this fault is the planned one.
fn try_demand_map(error: u64, cr2: u64) -> bool {
    let demand = DEMAND.get();
    let page = cr2 & !(PAGE_SIZE - 1);
    if demand.va == 0 || page != demand.va || error & PF_PRESENT != 0 {
        return false;
    }
    if (error & PF_USER != 0) != demand.user {
        return false;
    }
    let frame = paging::alloc_frame();
    if demand.fill != 0 {
        // SAFETY: `frame` is a fresh, identity-mapped, exclusively owned 4 KiB frame and the
        // offset is 8-byte aligned and inside it.
        unsafe { ((frame + (cr2 & (PAGE_SIZE - 8))) as *mut u64).write_volatile(demand.fill) };
    }
    paging::map_4k(read_cr3(), demand.va, frame, demand.flags);
    invlpg(demand.va);
    DEMAND.set(DemandPage { va: 0, ..demand });
    true
}

/// The fix-up address for a faulting `rip` listed in `__ex_table`. Ring-3 code is listed at
/// its link address in `.user_text` and runs at `USER_CODE_VA`, so user RIPs are translated.
fn lookup_fixup(rip: u64, from_user: bool) -> Option<u64> {
    let (link_rip, delta) = if from_user {
        let link = user::user_va_to_link(rip)?;
        (link, rip.wrapping_sub(link))
    } else {
        (rip, 0)
    };
    let (start, end) = (addr_of!(__ex_table_start), addr_of!(__ex_table_end));
    let mut entry = start;
    while entry < end {
        // SAFETY: `entry` lies in [start, end), the linker-built table of whole entries.
        let e = unsafe { &*entry };
        if e.fault == link_rip {
            return Some(e.fixup.wrapping_add(delta));
        }
        // SAFETY: stays within or one past the end of the table.
        entry = unsafe { entry.add(1) };
    }
    None
}

/// Prints `MINIKERNEL-PANIC vector=.. err=.. rip=.. cr2=..` and powers off.
pub fn panic_trap(frame: &TrapFrame, cr2: u64, why: &str) -> ! {
    fresh_line();
    print("MINIKERNEL-PANIC vector=");
    print_dec(frame.vector);
    print(" err=");
    print_hex(frame.error);
    print(" rip=");
    print_hex(frame.rip);
    print(" cr2=");
    print_hex(cr2);
    print(" cs=");
    print_hex(frame.cs);
    print(" rsp=");
    print_hex(frame.rsp);
    print(" (");
    print(why);
    print(")\n");
    poweroff()
}
