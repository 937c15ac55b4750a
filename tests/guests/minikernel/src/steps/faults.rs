//! Steps `de`, `ud`, `gp`, `pf`: ring-0 exceptions whose handlers fix up and continue.
//!
//! Each faulting instruction is labelled in its `asm!` block; the block also returns the
//! label's address so the step can check that the CPU reported exactly that RIP. `de`,
//! `ud` and `gp` continue through `__ex_table`; `pf` is retried after the handler maps
//! the page.

use core::arch::asm;

use crate::console::{newline, print, print_dec, print_hex, print_ok};
use crate::layout::{
    BAD_SELECTOR, KERNEL_DEMAND_OFFSET, KERNEL_DEMAND_VA, KERNEL_DS, NON_CANONICAL_VA,
};
use crate::paging::{PTE_PRESENT, PTE_WRITABLE};
use crate::traps::{DemandPage, TrapRecord, DEMAND, LAST_TRAP, TRAP_COUNT};

/// The qword the #PF handler stores into the page it maps for step `pf`.
pub const KERNEL_DEMAND_FILL: u64 = 0x600d_cafe_0000_0006;

/// Runs `f` (which returns the address of its faulting instruction); returns that address
/// and the trap record if exactly one exception was taken.
fn one_trap(f: impl FnOnce() -> u64) -> (u64, Option<TrapRecord>) {
    let before = TRAP_COUNT.get();
    let fault_rip = f();
    let taken = TRAP_COUNT.get() - before;
    (fault_rip, (taken == 1).then(|| LAST_TRAP.get()))
}

/// Prints `vector=N[ err=0x..]` (or `no-single-trap BAD`); returns whether the trap was
/// reported at `fault_rip` in ring 0.
fn report(fault_rip: u64, trap: Option<TrapRecord>, with_error: bool) -> bool {
    let Some(t) = trap else {
        print("no-single-trap BAD");
        return false;
    };
    print("vector=");
    print_dec(t.vector);
    if with_error {
        print(" err=");
        print_hex(t.error);
    }
    t.rip == fault_rip && t.cs & 3 == 0
}

/// Prints ` rip-fixup ok|BAD`.
fn print_fixup(ok: bool) {
    print(" rip-fixup ");
    print_ok(ok);
}

/// Step `de`: `div` by zero.
pub fn divide_error() {
    let (rip, trap) = one_trap(|| {
        let fault_rip: u64;
        // SAFETY: the `div` faults and `__ex_table` resumes at `3:`; only the named registers
        // are clobbered.
        unsafe {
            asm!(
                "lea {f}, [rip + 2f]",
                "mov eax, 100",
                "xor edx, edx",
                "xor ecx, ecx",
                "2:",
                "div ecx",
                "3:",
                ".pushsection __ex_table, \"a\"",
                ".balign 8",
                ".quad 2b, 3b",
                ".popsection",
                f = out(reg) fault_rip,
                out("eax") _,
                out("ecx") _,
                out("edx") _,
                options(nomem, nostack),
            )
        };
        fault_rip
    });
    print_fixup(report(rip, trap, false));
    newline();
}

/// Step `ud`: `ud2`.
pub fn invalid_opcode() {
    let (rip, trap) = one_trap(|| {
        let fault_rip: u64;
        // SAFETY: the `ud2` faults and `__ex_table` resumes at `3:`.
        unsafe {
            asm!(
                "lea {f}, [rip + 2f]",
                "2:",
                "ud2",
                "3:",
                ".pushsection __ex_table, \"a\"",
                ".balign 8",
                ".quad 2b, 3b",
                ".popsection",
                f = out(reg) fault_rip,
                options(nomem, nostack),
            )
        };
        fault_rip
    });
    print_fixup(report(rip, trap, false));
    newline();
}

/// Step `gp`: a load from a non-canonical address (#GP(0)), then loading DS with a selector
/// beyond the GDT limit (#GP(selector)).
pub fn general_protection() {
    let (rip, trap) = one_trap(|| {
        let fault_rip: u64;
        // SAFETY: the load faults (non-canonical) and `__ex_table` resumes at `3:`.
        unsafe {
            asm!(
                "lea {f}, [rip + 2f]",
                "2:",
                "mov {v}, qword ptr [{p}]",
                "3:",
                ".pushsection __ex_table, \"a\"",
                ".balign 8",
                ".quad 2b, 3b",
                ".popsection",
                f = out(reg) fault_rip,
                p = in(reg) NON_CANONICAL_VA,
                v = out(reg) _,
                options(readonly, nostack),
            )
        };
        fault_rip
    });
    print("non-canonical load ");
    print_fixup(report(rip, trap, true));

    let (rip, trap) = one_trap(|| {
        let fault_rip: u64;
        // SAFETY: the segment load faults and `__ex_table` resumes at `3:`; DS is reloaded
        // with the kernel data selector either way.
        unsafe {
            asm!(
                "lea {f}, [rip + 2f]",
                "mov {s:e}, {bad}",
                "2:",
                "mov ds, {s:x}",
                "3:",
                "mov {s:e}, {kds}",
                "mov ds, {s:x}",
                ".pushsection __ex_table, \"a\"",
                ".balign 8",
                ".quad 2b, 3b",
                ".popsection",
                f = out(reg) fault_rip,
                s = out(reg) _,
                bad = const BAD_SELECTOR,
                kds = const KERNEL_DS,
                options(nomem, nostack),
            )
        };
        fault_rip
    });
    print(", mov ds,");
    print_hex(u64::from(BAD_SELECTOR));
    print(" ");
    print_fixup(report(rip, trap, true));
    newline();
}

/// Step `pf`: read an unmapped kernel address; the handler maps a fresh frame holding
/// [`KERNEL_DEMAND_FILL`] at that offset and the load is retried.
pub fn kernel_page_fault() {
    DEMAND.set(DemandPage {
        va: KERNEL_DEMAND_VA,
        flags: PTE_PRESENT | PTE_WRITABLE,
        user: false,
        fill: KERNEL_DEMAND_FILL,
    });
    let mut value = 0;
    let (rip, trap) = one_trap(|| {
        let fault_rip: u64;
        // SAFETY: the load faults once; the #PF handler maps the (armed) page and the load is
        // retried and succeeds. No fix-up entry: a second fault would be a panic.
        unsafe {
            asm!(
                "lea {f}, [rip + 2f]",
                "2:",
                "mov {v}, qword ptr [{p}]",
                f = out(reg) fault_rip,
                p = in(reg) KERNEL_DEMAND_VA + KERNEL_DEMAND_OFFSET,
                v = out(reg) value,
                options(readonly, nostack),
            )
        };
        fault_rip
    });
    let cr2 = trap.map_or(0, |t| t.cr2);
    let rip_ok = report(rip, trap, true);
    print(" cr2=");
    print_hex(cr2);
    print(" mapped+retried rip ");
    print_ok(rip_ok);
    print(" read ");
    print_hex(value);
    newline();
}
