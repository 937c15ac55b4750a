//! Ring-3 code and the kernel side of running it.
//!
//! The programs live in `.user_text` (one page, position independent: they only use
//! relative branches) and are mapped read-only+user at `USER_CODE_VA`. A program receives
//! its argument in RDI and a stack at `USER_STACK_VA`; it ends either with the `exit`
//! syscall or by jumping to `user_exit_gate` (a `ud2` the #UD handler recognizes at CPL 3),
//! which hands RAX (and RBX, see `traps::USER_REPORT_RBX`) back to the kernel. The gate
//! needs no SYSCALL, so steps that only need ring 3 work where SYSCALL does not.
//!
//! Deliberately faulting user instructions are listed in `__ex_table` at their *link*
//! addresses; `traps::lookup_fixup` translates.

use core::arch::global_asm;
use core::ptr::addr_of;

use crate::entry::{run_user, run_user_sysret};
use crate::layout::{PAGE_SIZE, USER_CODE_VA, USER_SHARED_VA, USER_STACK_VA};
use crate::paging::{alloc_frame, kernel_root, map_4k, PTE_PRESENT, PTE_USER, PTE_WRITABLE};
use crate::pic;
use crate::syscall::{SYS_ADD, SYS_EXIT, SYS_WRITE};

/// Ticks a ring-3 run may take before the watchdog reports it (5 s at 1 kHz).
const USER_WATCHDOG_TICKS: u64 = 5000;

extern "C" {
    static __user_start: u8;
    static __user_end: u8;
    static user_exit_gate: u8;
    static user_prog_syscall: u8;
    static user_prog_pf: u8;
    static user_prog_priv: u8;
    static user_prog_irq: u8;
    static user_prog_selectors: u8;
    static user_prog_hang: u8;
    static user_priv_hlt: u8;
    static user_priv_cli: u8;
    static user_priv_rdmsr: u8;
    static user_priv_movcr3: u8;
    static user_prog_probe_slots: u8;
    static user_prog_probe_list: u8;
    static user_probe_read: u8;
    static user_probe_write: u8;
}

/// PML4 slots the `user-probe` slots program probes per ring-3 run (each run has its own
/// watchdog).
pub const PROBE_SLOTS_PER_RUN: u64 = 64;

/// Addresses the `user-probe` list program reads and writes, besides one per PML4 slot
/// (the engine window's start, its engine image and code cache, the engine's physmap at
/// guest-physical 0, the zero page and this kernel's image, non-canonical addresses;
/// `gen_expected.py` counts them).
pub const PROBE_TARGETS: [u64; 8] = [
    0xffff_8080_0000_0000,
    0xffff_8080_0020_0000,
    0xffff_8080_0480_0000,
    0xffff_8100_0000_0000,
    0xffff_8100_0000_7000,
    0xffff_8100_0010_0000,
    0x0000_8000_0000_0000,
    0x8000_0000_0000_0000,
];

global_asm!(
    r#"
    .pushsection .user_text, "ax"
    .balign 16
    .global user_exit_gate
user_exit_gate:
    ud2

    // Step `syscall`: add(40, 2), four writes, then exit(sum of everything + 100).
    .balign 16
    .global user_prog_syscall
user_prog_syscall:
    mov eax, {sys_add}
    mov edi, 40
    mov esi, 2
    syscall
    mov r12, rax
    xor r13d, r13d
    mov eax, {sys_write}
    mov rdi, r12
    syscall
    add r13, rax
    xor edi, edi
    mov di, cs
    mov eax, {sys_write}
    syscall
    add r13, rax
    xor edi, edi
    mov di, ss
    mov eax, {sys_write}
    syscall
    add r13, rax
    pushfq
    pop rdi
    and edi, 0x200
    mov eax, {sys_write}
    syscall
    add r13, rax
    lea rdi, [r12 + r13 + 100]
    mov eax, {sys_exit}
    syscall
    ud2

    // Step `user-pf`: RDI = an unmapped user address. Write, read back, report.
    .balign 16
    .global user_prog_pf
user_prog_pf:
    movabs rax, 0x0123456789abcdef
    mov [rdi], rax
    mov rax, [rdi]
    mov rbx, [rdi + 0x100]
    jmp user_exit_gate

    // Step `user-priv`: four privileged instructions, each must #GP(0) at CPL 3; the kernel
    // continues after each one through __ex_table.
    .balign 16
    .global user_prog_priv
user_prog_priv:
    mov ecx, 0xc0000080
    .global user_priv_hlt
user_priv_hlt:
    hlt
    .global user_priv_cli
user_priv_cli:
    cli
    .global user_priv_rdmsr
user_priv_rdmsr:
    rdmsr
    .global user_priv_movcr3
user_priv_movcr3:
    mov rax, cr3
user_priv_done:
    mov eax, 0x600d
    jmp user_exit_gate
    .pushsection __ex_table, "a"
    .balign 8
    .quad user_priv_hlt, user_priv_cli
    .quad user_priv_cli, user_priv_rdmsr
    .quad user_priv_rdmsr, user_priv_movcr3
    .quad user_priv_movcr3, user_priv_done
    .popsection

    // Step `user-irq`: RDI = a user page the tick handler counts into; spin until it reads 3.
    .balign 16
    .global user_prog_irq
user_prog_irq:
2:
    mov rax, [rdi]
    cmp rax, 3
    jb 2b
    jmp user_exit_gate

    // Steps `selectors`, `sysret`: report (SS << 16 | CS) in RAX and RFLAGS.IF in RBX.
    .balign 16
    .global user_prog_selectors
user_prog_selectors:
    // The assembler encodes `mov ax, sreg` as `mov eax, sreg` (8C /r without 66), which
    // zero-extends into RAX: read the two selectors into separate registers.
    mov eax, ss
    shl eax, 16
    mov ecx, cs
    or eax, ecx
    pushfq
    pop rbx
    and ebx, 0x200
    jmp user_exit_gate

    // Step `user-probe`: reads and writes addresses the task has no access to; each must
    // fault (the kernel checks and counts it, `steps::probe`) and continues through
    // __ex_table. `slots`: the first address of PML4 slots RDI..RDI+PROBE_SLOTS_PER_RUN;
    // `list`: the PROBE_TARGETS table. RAX = accesses that did not fault.
    .balign 16
    .global user_prog_probe_slots
user_prog_probe_slots:
    xor ebx, ebx
    mov r12, rdi
    mov r13d, {slots_per_run}
2:
    test r13, r13
    jz 3f
    mov rdi, r12
    shl rdi, 39
    cmp r12, 256
    jb 4f
    movabs rax, 0xffff000000000000
    or rdi, rax
4:
    call user_probe_access
    inc r12
    dec r13
    jmp 2b
3:
    mov rax, rbx
    jmp user_exit_gate

    .balign 16
    .global user_prog_probe_list
user_prog_probe_list:
    xor ebx, ebx
    lea r12, [rip + user_probe_targets]
    mov r13d, {n_targets}
2:
    mov rdi, [r12]
    call user_probe_access
    add r12, 8
    dec r13
    jnz 2b
    mov rax, rbx
    jmp user_exit_gate

    // RDI = an address: read it, then write back what was read (a write that wrongly
    // succeeds changes nothing); RBX counts the accesses that did not fault.
user_probe_access:
    xor eax, eax
    .global user_probe_read
user_probe_read:
    mov rax, [rdi]
    inc rbx
user_probe_read_done:
    .global user_probe_write
user_probe_write:
    mov [rdi], rax
    inc rbx
user_probe_write_done:
    ret
    .pushsection __ex_table, "a"
    .balign 8
    .quad user_probe_read, user_probe_read_done
    .quad user_probe_write, user_probe_write_done
    .popsection

    .balign 8
user_probe_targets:
    .quad {t0}, {t1}, {t2}, {t3}, {t4}, {t5}, {t6}, {t7}

    // Crash self-test `user-hang`: never comes back (the watchdog must report it).
    .balign 16
    .global user_prog_hang
user_prog_hang:
2:
    jmp 2b
    .popsection
"#,
    sys_add = const SYS_ADD,
    sys_write = const SYS_WRITE,
    sys_exit = const SYS_EXIT,
    n_targets = const PROBE_TARGETS.len(),
    slots_per_run = const PROBE_SLOTS_PER_RUN,
    t0 = const PROBE_TARGETS[0],
    t1 = const PROBE_TARGETS[1],
    t2 = const PROBE_TARGETS[2],
    t3 = const PROBE_TARGETS[3],
    t4 = const PROBE_TARGETS[4],
    t5 = const PROBE_TARGETS[5],
    t6 = const PROBE_TARGETS[6],
    t7 = const PROBE_TARGETS[7],
);

/// A ring-3 program.
#[derive(Clone, Copy)]
pub enum Program {
    /// SYSCALL/SYSRET round trips.
    Syscall,
    /// Touches an unmapped user page.
    PageFault,
    /// Runs privileged instructions.
    Privileged,
    /// Spins until the timer has ticked three times.
    Irq,
    /// Reports the selectors and IF it was entered with.
    Selectors,
    /// Loops forever (crash self-test).
    Hang,
    /// Reads and writes the first address of PML4 slots RDI.. ([`PROBE_SLOTS_PER_RUN`]).
    ProbeSlots,
    /// Reads and writes each of [`PROBE_TARGETS`].
    ProbeList,
}

/// How the kernel enters ring 3.
#[derive(Clone, Copy)]
pub enum Entry {
    /// `iretq` with a CS/SS/RFLAGS/RSP frame.
    Iretq,
    /// `sysretq` (CS/SS from STAR).
    Sysretq,
}

/// Privileged instructions of [`Program::Privileged`], in order.
#[derive(Clone, Copy)]
pub enum PrivInsn {
    Hlt,
    Cli,
    Rdmsr,
    MovFromCr3,
}

fn link_addr(sym: *const u8) -> u64 {
    sym as u64
}

fn user_start() -> u64 {
    link_addr(addr_of!(__user_start))
}

fn user_end() -> u64 {
    link_addr(addr_of!(__user_end))
}

/// The user VA of a symbol in `.user_text`.
fn user_va(sym: *const u8) -> u64 {
    USER_CODE_VA + (link_addr(sym) - user_start())
}

/// The link address of a user RIP inside the mapped `.user_text`, if it is inside.
pub fn user_va_to_link(rip: u64) -> Option<u64> {
    let len = user_end() - user_start();
    (rip >= USER_CODE_VA && rip < USER_CODE_VA + len).then(|| rip - USER_CODE_VA + user_start())
}

/// The user VA of `user_exit_gate`.
pub fn exit_gate_va() -> u64 {
    user_va(addr_of!(user_exit_gate))
}

/// The user VA of one of [`Program::Privileged`]'s instructions.
pub fn priv_insn_va(insn: PrivInsn) -> u64 {
    user_va(match insn {
        PrivInsn::Hlt => addr_of!(user_priv_hlt),
        PrivInsn::Cli => addr_of!(user_priv_cli),
        PrivInsn::Rdmsr => addr_of!(user_priv_rdmsr),
        PrivInsn::MovFromCr3 => addr_of!(user_priv_movcr3),
    })
}

fn entry_va(program: Program) -> u64 {
    user_va(match program {
        Program::Syscall => addr_of!(user_prog_syscall),
        Program::PageFault => addr_of!(user_prog_pf),
        Program::Privileged => addr_of!(user_prog_priv),
        Program::Irq => addr_of!(user_prog_irq),
        Program::Selectors => addr_of!(user_prog_selectors),
        Program::Hang => addr_of!(user_prog_hang),
        Program::ProbeSlots => addr_of!(user_prog_probe_slots),
        Program::ProbeList => addr_of!(user_prog_probe_list),
    })
}

/// The user VAs of the `user-probe` programs' read and write instructions.
pub fn probe_access_vas() -> (u64, u64) {
    (
        user_va(addr_of!(user_probe_read)),
        user_va(addr_of!(user_probe_write)),
    )
}

/// Physical frame of the page shared with the tick handler ([`USER_SHARED_VA`]).
static SHARED_FRAME: crate::global::Global<u64> = crate::global::Global::new(0);

/// Maps the user code (read-only), the user stack and the shared page into the kernel root.
pub fn init() {
    let root = kernel_root();
    let mut link = user_start();
    while link < user_end() {
        map_4k(
            root,
            USER_CODE_VA + (link - user_start()),
            link,
            PTE_PRESENT | PTE_USER,
        );
        link += PAGE_SIZE;
    }
    map_4k(
        root,
        USER_STACK_VA,
        alloc_frame(),
        PTE_PRESENT | PTE_WRITABLE | PTE_USER,
    );
    let shared = alloc_frame();
    SHARED_FRAME.set(shared);
    map_4k(
        root,
        USER_SHARED_VA,
        shared,
        PTE_PRESENT | PTE_WRITABLE | PTE_USER,
    );
}

/// Physical address of the shared page.
pub fn shared_frame() -> u64 {
    SHARED_FRAME.get()
}

/// Runs `program` at CPL 3 with RDI = `arg` until it exits; returns its RAX (or exit code).
///
/// IRQ 0 is unmasked for the duration (interrupts are on in ring 3) with a watchdog, so a
/// task that never comes back is reported instead of hanging the VM; `ticks` = `Some(n)`
/// masks IRQ 0 again after exactly `n` ticks.
pub fn run(program: Program, arg: u64, ticks: Option<u64>) -> u64 {
    run_entered_by(Entry::Iretq, program, arg, ticks)
}

/// [`run`], entering ring 3 the way `entry` says ([`Entry::Sysretq`] needs EFER.SCE and STAR).
pub fn run_entered_by(entry: Entry, program: Program, arg: u64, ticks: Option<u64>) -> u64 {
    pic::pit_start();
    pic::arm_watchdog(USER_WATCHDOG_TICKS);
    pic::arm_timer(ticks);
    let (rip, rsp) = (entry_va(program), USER_STACK_VA + PAGE_SIZE);
    // SAFETY: the user code, stack and every page the programs touch are mapped user in the
    // current root, TSS.RSP0 and the IDT are loaded, and `user_return` is the only way back;
    // for SYSRETQ the caller enabled SCE and set STAR to the GDT's user selectors.
    let result = unsafe {
        match entry {
            Entry::Iretq => run_user(rip, rsp, arg),
            Entry::Sysretq => run_user_sysret(rip, rsp, arg),
        }
    };
    pic::mask_timer();
    pic::disarm_watchdog();
    result
}
