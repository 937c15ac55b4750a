//! All ring-0 assembly of the mini-kernel: the boot entry, the IDT stubs and the common trap
//! path, the SYSCALL entry, and the switch into and back out of a ring-3 task.
//!
//! Register and stack convention:
//! * `_start`: entered by the VMM in long mode with RSI = boot_params; sets RSP to
//!   `kernel_stack_top`, zeroes `.bss` and calls `kmain(boot_params)` (never returns).
//! * Trap stubs (`trap_stub_N`, listed in `trap_stub_table`): push a zero error code when the
//!   CPU pushes none, push the vector, and jump to `trap_common`, which saves all 15 GPRs
//!   to form a [`crate::traps::TrapFrame`] and calls `trap_dispatch(&mut frame)`, then
//!   restores them and `iretq`s (so a handler may edit the frame, e.g. RIP).
//! * Stacks: `kernel_stack_top` (boot and all steps), `trap_stack_top` (TSS.RSP0 for traps
//!   from ring 3, and the SYSCALL entry), `df_stack_top` (IST1, #DF only). Each stack sits
//!   above an unmapped guard page (see `paging::GUARD_PAGES`).
//! * `syscall_entry` (LSTAR): RAX = number, RDI/RSI = arguments; switches to the trap stack,
//!   builds a [`crate::syscall::SyscallFrame`], calls `syscall_dispatch(&mut frame)` and
//!   returns its RAX with `sysretq`. RCX/R11 are clobbered as the architecture says; every
//!   other register is preserved.
//! * `run_user(rip, rsp, arg) -> u64`: saves the kernel's callee-saved registers and RSP in
//!   `kernel_ctx_rsp`, then `iretq`s to ring 3 at `rip` with RSP = `rsp`, RDI = `arg`,
//!   RFLAGS = IF|1 and all other GPRs zero. `user_return(value) -> !` (called from a trap or
//!   syscall handler) abandons the handler's stack, reloads kernel data segments, and makes
//!   that `run_user` call return `value`.
//! * `run_user_sysret(rip, rsp, arg) -> u64`: the same, but enters ring 3 with `sysretq`
//!   (RCX = `rip`, R11 = IF|1, RSP loaded by hand while IF is still 0); needs EFER.SCE and
//!   STAR, see `steps::ring3::enable_syscall`.

use core::arch::global_asm;

use crate::layout::{
    DF_STACK_BYTES, KERNEL_DS, KERNEL_STACK_BYTES, TRAP_STACK_BYTES, USER_CS, USER_DS,
};

extern "C" {
    /// Top of the trap stack (TSS.RSP0, SYSCALL entry).
    pub static trap_stack_top: u8;
    /// Top of the #DF stack (TSS IST1).
    pub static df_stack_top: u8;
    /// Bottom of the boot/kernel stack (its guard page is just below).
    pub static kernel_stack_bottom: u8;
    /// Bottom of the trap stack.
    pub static trap_stack_bottom: u8;
    /// Bottom of the #DF stack.
    pub static df_stack_bottom: u8;
    /// Entry address of trap stub N, for N in 0..TRAP_VECTORS.
    pub static trap_stub_table: [u64; crate::layout::TRAP_VECTORS];
    /// The LSTAR target.
    pub fn syscall_entry();
    /// Runs ring-3 code; see the module header.
    pub fn run_user(rip: u64, rsp: u64, arg: u64) -> u64;
    /// Runs ring-3 code entered with `sysretq`; see the module header.
    pub fn run_user_sysret(rip: u64, rsp: u64, arg: u64) -> u64;
    /// Ends the current ring-3 task; see the module header.
    pub fn user_return(value: u64) -> !;
}

// Boot entry and stacks.
global_asm!(
    r#"
    .pushsection .text.boot, "ax"
    .global _start
_start:
    cli
    cld
    lea rsp, [rip + kernel_stack_top]
    mov r12, rsi
    lea rdi, [rip + __bss_start]
    lea rcx, [rip + __bss_end]
    sub rcx, rdi
    xor eax, eax
    rep stosb
    mov rdi, r12
    call {kmain}
2:
    cli
    hlt
    jmp 2b
    .popsection

    .pushsection .stacks, "aw", @nobits
    .balign 4096
    .skip 4096
    .global kernel_stack_bottom
kernel_stack_bottom:
    .skip {kstack}
    .global kernel_stack_top
kernel_stack_top:
    .skip 4096
    .global trap_stack_bottom
trap_stack_bottom:
    .skip {tstack}
    .global trap_stack_top
trap_stack_top:
    .skip 4096
    .global df_stack_bottom
df_stack_bottom:
    .skip {dfstack}
    .global df_stack_top
df_stack_top:
    .popsection
"#,
    kmain = sym crate::kmain,
    kstack = const KERNEL_STACK_BYTES,
    tstack = const TRAP_STACK_BYTES,
    dfstack = const DF_STACK_BYTES,
);

// IDT stubs and the common trap path.
global_asm!(
    r#"
    .macro TRAP_NOERR vec
    .balign 16
trap_stub_\vec:
    push 0
    push \vec
    jmp trap_common
    .endm

    .macro TRAP_ERR vec
    .balign 16
trap_stub_\vec:
    push \vec
    jmp trap_common
    .endm

    .pushsection .text.traps, "ax"
    TRAP_NOERR 0
    TRAP_NOERR 1
    TRAP_NOERR 2
    TRAP_NOERR 3
    TRAP_NOERR 4
    TRAP_NOERR 5
    TRAP_NOERR 6
    TRAP_NOERR 7
    TRAP_ERR   8
    TRAP_NOERR 9
    TRAP_ERR   10
    TRAP_ERR   11
    TRAP_ERR   12
    TRAP_ERR   13
    TRAP_ERR   14
    TRAP_NOERR 15
    TRAP_NOERR 16
    TRAP_ERR   17
    TRAP_NOERR 18
    TRAP_NOERR 19
    TRAP_NOERR 20
    TRAP_ERR   21
    TRAP_NOERR 22
    TRAP_NOERR 23
    TRAP_NOERR 24
    TRAP_NOERR 25
    TRAP_NOERR 26
    TRAP_NOERR 27
    TRAP_NOERR 28
    TRAP_ERR   29
    TRAP_ERR   30
    TRAP_NOERR 31
    TRAP_NOERR 32
    TRAP_NOERR 33
    TRAP_NOERR 34
    TRAP_NOERR 35
    TRAP_NOERR 36
    TRAP_NOERR 37
    TRAP_NOERR 38
    TRAP_NOERR 39
    TRAP_NOERR 40
    TRAP_NOERR 41
    TRAP_NOERR 42
    TRAP_NOERR 43
    TRAP_NOERR 44
    TRAP_NOERR 45
    TRAP_NOERR 46
    TRAP_NOERR 47

    .balign 16
trap_common:
    push rax
    push rbx
    push rcx
    push rdx
    push rsi
    push rdi
    push rbp
    push r8
    push r9
    push r10
    push r11
    push r12
    push r13
    push r14
    push r15
    cld
    mov rdi, rsp
    call {dispatch}
    pop r15
    pop r14
    pop r13
    pop r12
    pop r11
    pop r10
    pop r9
    pop r8
    pop rbp
    pop rdi
    pop rsi
    pop rdx
    pop rcx
    pop rbx
    pop rax
    add rsp, 16
    iretq
    .popsection

    .pushsection .rodata.trap_stub_table, "a"
    .balign 8
    .global trap_stub_table
trap_stub_table:
    .irp v, 0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27,28,29,30,31,32,33,34,35,36,37,38,39,40,41,42,43,44,45,46,47
    .quad trap_stub_\v
    .endr
    .popsection
"#,
    dispatch = sym crate::traps::trap_dispatch,
);

// SYSCALL entry, ring-3 entry and return.
global_asm!(
    r#"
    .pushsection .bss.entry_scratch, "aw", @nobits
    .balign 8
syscall_user_rsp:
    .skip 8
kernel_ctx_rsp:
    .skip 8
    .popsection

    .pushsection .text.entry, "ax"
    .balign 16
    .global syscall_entry
syscall_entry:
    mov [rip + syscall_user_rsp], rsp
    lea rsp, [rip + trap_stack_top]
    push qword ptr [rip + syscall_user_rsp]
    push r11
    push rcx
    push rdi
    push rsi
    push rdx
    push r8
    push r9
    push r10
    push rax
    cld
    mov rdi, rsp
    call {sysdispatch}
    add rsp, 8
    pop r10
    pop r9
    pop r8
    pop rdx
    pop rsi
    pop rdi
    pop rcx
    pop r11
    pop rsp
    sysretq

    .balign 16
    .global run_user
run_user:
    push rbx
    push rbp
    push r12
    push r13
    push r14
    push r15
    mov [rip + kernel_ctx_rsp], rsp
    push {user_ds}
    push rsi
    push 0x202
    push {user_cs}
    push rdi
    mov rdi, rdx
    xor eax, eax
    xor ebx, ebx
    xor ecx, ecx
    xor edx, edx
    xor esi, esi
    xor ebp, ebp
    xor r8d, r8d
    xor r9d, r9d
    xor r10d, r10d
    xor r11d, r11d
    xor r12d, r12d
    xor r13d, r13d
    xor r14d, r14d
    xor r15d, r15d
    iretq

    .balign 16
    .global run_user_sysret
run_user_sysret:
    push rbx
    push rbp
    push r12
    push r13
    push r14
    push r15
    mov [rip + kernel_ctx_rsp], rsp
    mov rcx, rdi
    mov r11d, 0x202
    mov rsp, rsi
    mov rdi, rdx
    xor eax, eax
    xor ebx, ebx
    xor edx, edx
    xor esi, esi
    xor ebp, ebp
    xor r8d, r8d
    xor r9d, r9d
    xor r10d, r10d
    xor r12d, r12d
    xor r13d, r13d
    xor r14d, r14d
    xor r15d, r15d
    sysretq

    .balign 16
    .global user_return
user_return:
    mov rsp, [rip + kernel_ctx_rsp]
    mov ecx, {kernel_ds}
    mov ss, cx
    mov ds, cx
    mov es, cx
    mov rax, rdi
    pop r15
    pop r14
    pop r13
    pop r12
    pop rbp
    pop rbx
    ret
    .popsection
"#,
    sysdispatch = sym crate::syscall::syscall_dispatch,
    user_ds = const USER_DS,
    user_cs = const USER_CS,
    kernel_ds = const KERNEL_DS,
);
