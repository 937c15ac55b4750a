//! Steps `cr3`, `user-pf` and `smc`: address spaces, demand paging from ring 3, and code
//! written through one mapping and executed through another.

use crate::console::{newline, print, print_dec, print_hex, print_ok};
use crate::cpu::{read_cr3, write_cr3};
use crate::layout::{AS_TEST_VA, SMC_W_VA, SMC_X_VA, USER_DEMAND_OFFSET, USER_DEMAND_VA};
use crate::paging::{
    alloc_frame, clone_root, kernel_root, map_4k, PTE_PRESENT, PTE_USER, PTE_WRITABLE,
};
use crate::traps::{
    clear_trap_log, trap_log, trap_log_len, DemandPage, DEMAND, PF_USER, USER_REPORT_RBX, VEC_PF,
};
use crate::user::{self, Program};

/// What address space A holds at [`AS_TEST_VA`].
const AS_A_VALUE: u64 = 0xaaaa_0000_0000_000a;
/// What address space B holds at [`AS_TEST_VA`].
const AS_B_VALUE: u64 = 0xbbbb_0000_0000_000b;

fn read_test_va() -> u64 {
    // SAFETY: both roots map AS_TEST_VA to a frame holding a qword.
    unsafe { (AS_TEST_VA as *const u64).read_volatile() }
}

fn switch_to(root: u64) -> bool {
    // SAFETY: both roots share every PML4 entry except AS_TEST_VA's (see `clone_root`).
    unsafe { write_cr3(root) };
    read_cr3() == root
}

/// Step `cr3`: two PML4 roots map the same VA to different frames; read it in A, B, A, B.
pub fn two_address_spaces() {
    let a = kernel_root();
    let b = clone_root(a);
    for (root, value) in [(a, AS_A_VALUE), (b, AS_B_VALUE)] {
        let frame = alloc_frame();
        // SAFETY: a fresh identity-mapped frame owned by this step.
        unsafe { (frame as *mut u64).write_volatile(value) };
        map_4k(root, AS_TEST_VA, frame, PTE_PRESENT | PTE_WRITABLE);
    }
    let mut cr3_ok = true;
    print("va ");
    print_hex(AS_TEST_VA);
    for (name, root) in [("a", a), ("b", b), ("a", a), ("b", b)] {
        cr3_ok &= switch_to(root);
        print(" ");
        print(name);
        print("=");
        print_hex(read_test_va());
    }
    cr3_ok &= switch_to(a);
    print(" cr3-readback ");
    print_ok(cr3_ok);
    newline();
}

/// Step `user-pf`: ring-3 code writes an unmapped user page; the #PF handler (error code
/// with the U bit) maps a fresh zeroed frame and the write is retried; the program reads
/// the value back and a second qword of the page, and reports both.
pub fn user_page_fault() {
    DEMAND.set(DemandPage {
        va: USER_DEMAND_VA,
        flags: PTE_PRESENT | PTE_WRITABLE | PTE_USER,
        user: true,
        fill: 0,
    });
    clear_trap_log();
    let value = user::run(
        Program::PageFault,
        USER_DEMAND_VA + USER_DEMAND_OFFSET,
        None,
    );
    let other = USER_REPORT_RBX.get();
    match trap_log(0) {
        Some(t) if t.vector == VEC_PF => {
            print("vector=14 err=");
            print_hex(t.error);
            print(" cr2=");
            print_hex(t.cr2);
            print(if t.cs & 3 == 3 && t.error & PF_USER != 0 {
                " from cpl3"
            } else {
                " NOT-from-cpl3"
            });
        }
        _ => print("no-user-pf BAD"),
    }
    print(" traps=");
    print_dec(trap_log_len() as u64);
    print(" user read back ");
    print_hex(value);
    print(" rest-of-page ");
    print_hex(other);
    newline();
}

/// `mov eax, imm32` opcode.
const MOV_EAX_IMM32: u8 = 0xb8;
/// `ret` opcode.
const RET: u8 = 0xc3;
/// Immediate of the first version of the generated function.
const SMC_FIRST: u32 = 0x1234_5678;
/// Immediate patched in through the alias.
const SMC_SECOND: u32 = 0x9abc_def0;

fn write_alias(offset: u64, bytes: &[u8]) {
    for (i, &b) in bytes.iter().enumerate() {
        // SAFETY: SMC_W_VA maps the step's code frame writable; offsets stay in the page.
        unsafe { ((SMC_W_VA + offset + i as u64) as *mut u8).write_volatile(b) };
    }
}

fn call_x_view() -> u32 {
    // SAFETY: SMC_X_VA maps a frame holding `mov eax, imm32; ret`, a complete function with
    // the C ABI that touches only EAX.
    let f: extern "C" fn() -> u32 = unsafe { core::mem::transmute(SMC_X_VA as usize) };
    f()
}

/// Step `smc`: one frame mapped read-only at an execute view and writable at an alias;
/// write `mov eax, imm32; ret` through the alias, call it through the execute view, patch the
/// immediate through the alias, call again.
pub fn self_modifying_code() {
    let frame = alloc_frame();
    let root = kernel_root();
    map_4k(root, SMC_X_VA, frame, PTE_PRESENT);
    map_4k(root, SMC_W_VA, frame, PTE_PRESENT | PTE_WRITABLE);
    let first = SMC_FIRST.to_le_bytes();
    write_alias(
        0,
        &[MOV_EAX_IMM32, first[0], first[1], first[2], first[3], RET],
    );
    let r1 = call_x_view();
    write_alias(1, &SMC_SECOND.to_le_bytes());
    // SAFETY: SMC_X_VA maps the same frame readable.
    let x_byte = unsafe { ((SMC_X_VA + 1) as *const u8).read_volatile() };
    let r2 = call_x_view();
    print("call=");
    print_hex(u64::from(r1));
    print(" patched via alias, x-view sees it ");
    print_ok(x_byte == SMC_SECOND.to_le_bytes()[0]);
    print(" call=");
    print_hex(u64::from(r2));
    newline();
}
