//! The ring-0 gate from CPL 3 (protocol in `entry.rs`'s header): the ring-0 half of the
//! gate (entered by the `int` at `kpin_gate_insn` and the operations' own), and safe
//! wrappers, one per operation. Each call is one `int`/`iretq` round trip.
//!
//! **What the gate serves** (issue #11): the ring-0 half checks, before any operation,
//! that the return address its caller pushed lies in the engine's `.text`
//! (`__image_start..__kpin_text_end`; not the code cache, heap or stacks), and then its
//! arguments: LOAD_CR3 only of a page-aligned root the engine built (a frame of the
//! shadow-table area, the VMM's boot root or the engine's own root, relative to the stolen
//! region's base that `_start` derives from the boot CR3); port I/O (OUT*/IN*) never on
//! the engine's own ports, which only NOTIFY writes (and NOTIFY only those); WRMSR only of
//! `kpin_abi::x86::msr::GATE_WRITABLE`: the MSRs the virtual CPU may pass through
//! (`MsrFile::passes_through`, a unit test keeps it inside the set) and the
//! FS/GS/KERNEL_GS bases. A refused call
//! sets `kpin_gate_refused` (`layout::gate_refusal`) and takes the unexpected-exception
//! path as a #GP at the gate's `int`: `engine.log` names the refusal and the registers
//! (RAX = operation, RDI/RSI = arguments), the VMM dumps the state, the run ends.
//! These checks stop calls from anywhere but the engine's code and arguments the engine
//! never passes; they cannot stop code that can already write the engine's memory (it
//! could forge a return address or the stored bounds): keeping guest code out of the
//! engine's memory is the translator's job.

use core::arch::{asm, global_asm};
use core::sync::atomic::{AtomicU64, Ordering};

use guest_engine::profile;
use kpin_abi::ports::DOORBELL_PORT;
use kpin_abi::stolen::{
    BOOT_PT_OFFSET, LAYOUT_BYTES, SHADOW_TABLES_BYTES, SHADOW_TABLES_OFFSET, WINDOW_VA,
};
use kpin_abi::x86::msr;

use crate::ring0::entry::{kpin_gate, kpin_gate_cr3};
use crate::ring0::layout::{gate_op, gate_refusal, VEC_GP};

extern "C" {
    /// The stolen region's guest-physical base, stored by `_start` from the boot CR3.
    pub static kpin_gate_stolen_base: u64;
    /// Why the gate refused a call (`layout::gate_refusal`), 0 if it never did.
    pub static kpin_gate_refused: u64;
}

/// Why the gate refused a call, if it did (read by the fault reporter).
pub fn refusal() -> Option<&'static str> {
    // SAFETY: written only by the ring-0 gate, before the report this feeds runs.
    let r = unsafe { core::ptr::read_volatile(&raw const kpin_gate_refused) };
    Some(match r {
        0 => return None,
        gate_refusal::CALLER => "the caller's return address is not in the engine's .text",
        gate_refusal::CR3 => "LOAD_CR3 of a root the engine did not build (RDI)",
        gate_refusal::PORT => "port I/O on one of the engine's own ports (RDI)",
        gate_refusal::MSR => "WRMSR of an MSR the virtual CPU never passes through (RDI)",
        gate_refusal::NOTIFY => "NOTIFY of a port that is not the engine's (RDI)",
        _ => "unknown reason",
    })
}

global_asm!(
    r#"
    .pushsection .text, "ax"
    // Stack: RIP (the `ret` after the `int`), CS, RFLAGS, RSP, SS. First the caller: the
    // return address the `call kpin_gate` pushed must lie in the engine's .text (a bad
    // RSP faults here, at ring 0, and that fault is reported like any other).
    .macro kpin_gate_caller_check
    mov rdx, [rsp + 24]
    mov rdx, [rdx]
    sub rdx, [rip + kpin_gate_text_lo]
    cmp rdx, offset __kpin_text_len
    jae 90f
    .endm

    // LOAD_CR3 through its own `int` (`kpin_gate_cr3`): the same caller check, then a
    // shadow-table root (page-aligned, no PCD/PWT: a misaligned value rotates out of
    // range) is loaded at once; anything else takes the full check below. Each ring-0
    // instruction is emulated here (~0.6 µs on a Zen 5 host, against ~5.4 µs for the
    // `int` and the `iretq`), and a boot makes ~10 000 of these loads: this path runs 12
    // instructions where the general one runs 24 (both subtract bounds `_start` stored,
    // one memory operand each). First, RDI = 0 (never a root) reads CR2 for the CPL-3
    // #PF handler's engine (`read_cr2`): three instructions, no check (CR2 is the
    // engine's own to read).
    .global kpin_gate_cr3_entry
kpin_gate_cr3_entry:
    // ZF: `kpin_gate_cr3` tested RDI, and RDI = 0 asks for CR2 (`read_cr2`).
    jz 80f
    kpin_gate_caller_check
    mov rdx, rdi
    sub rdx, [rip + kpin_gate_shadow_lo]
    ror rdx, 12
    cmp rdx, {shadow_pages}
    jae 23f
    mov cr3, rdi
    iretq
80:
    mov rax, cr2
    iretq

    // The other operations, most frequent first (INVLPG: re-protecting code frames, the
    // guest's own; WRMSR: the guest's EOIs and TSC deadlines). First the RIP: only the
    // `int 3` at `kpin_gate_insn` is the gate; an `int3` anywhere else (padding the
    // engine should never run) is an unexpected #BP.
    .global kpin_gate_entry
kpin_gate_entry:
    push rax
    lea rax, [rip + kpin_gate_insn + 2]
    cmp rax, [rsp + 8]
    pop rax
    jne 91f
    kpin_gate_caller_check
    cmp rax, {op_invlpg}
    je 26f
    cmp rax, {op_wrmsr}
    je 24f
    cmp rax, {op_out8}
    je 21f
    cmp rax, {op_in8}
    je 22f
    cmp rax, {op_notify}
    je 35f
    cmp rax, {op_nop}
    je 20f
    cmp rax, {op_cr3}
    je 23f
    cmp rax, {op_rdmsr}
    je 25f
    cmp rax, {op_hlt}
    je 27f
    cmp rax, {op_out16}
    je 29f
    cmp rax, {op_out32}
    je 30f
    cmp rax, {op_in16}
    je 31f
    cmp rax, {op_in32}
    je 32f
    cmp rax, {op_cr4_sse}
    je 33f
    cmp rax, {op_rdmsr_safe}
    je 34f
    mov rax, -1
    iretq
    // NOTIFY: `out` of one byte to the engine's own ports (doorbell, failure) only.
35:
    mov edx, edi
    sub edx, {doorbell}
    cmp edx, 2
    jae 95f
    mov edx, edi
    mov eax, esi
    out dx, al
    xor eax, eax
    iretq
34:
    mov ecx, edi
    .global kpin_gate_rdmsr_insn
kpin_gate_rdmsr_insn:
    rdmsr
    shl rdx, 32
    or rax, rdx
    xor edx, edx
    iretq
    .global kpin_gate_rdmsr_fault
kpin_gate_rdmsr_fault:
    mov edx, 1
    iretq
33:
    mov rax, cr4
    and rax, {cr4_sse_clear}
    or rax, rdi
    mov cr4, rax
    xor eax, eax
    iretq
29:
    mov edx, edi
    sub edx, {doorbell}
    cmp edx, 2
    jb 93f
    mov edx, edi
    mov eax, esi
    out dx, ax
    xor eax, eax
    iretq
30:
    mov edx, edi
    sub edx, {doorbell}
    cmp edx, 2
    jb 93f
    mov edx, edi
    mov eax, esi
    out dx, eax
    xor eax, eax
    iretq
31:
    mov edx, edi
    sub edx, {doorbell}
    cmp edx, 2
    jb 93f
    mov edx, edi
    xor eax, eax
    in ax, dx
    iretq
32:
    mov edx, edi
    sub edx, {doorbell}
    cmp edx, 2
    jb 93f
    mov edx, edi
    in eax, dx
    iretq
20:
    xor eax, eax
    iretq
21:
    mov edx, edi
    sub edx, {doorbell}
    cmp edx, 2
    jb 93f
    mov edx, edi
    mov eax, esi
    out dx, al
    xor eax, eax
    iretq
22:
    mov edx, edi
    sub edx, {doorbell}
    cmp edx, 2
    jb 93f
    mov edx, edi
    xor eax, eax
    in al, dx
    iretq
    // LOAD_CR3: a page-aligned root (no PCD/PWT) that the engine built: a frame of the
    // shadow-table area, the VMM's boot root, or the engine's own root.
23:
    test edi, 0xfff
    jnz 92f
    mov rdx, rdi
    sub rdx, [rip + kpin_gate_stolen_base]
    cmp rdx, {shadow_lo}
    jb 1f
    cmp rdx, {layout_bytes}
    jb 2f
1:
    cmp rdx, {boot_pt}
    je 2f
    lea rcx, [rip + {engine_root}]
    sub rcx, rdx
    movabs rdx, {window_va}
    cmp rcx, rdx
    jne 92f
2:
    mov cr3, rdi
    xor eax, eax
    iretq
    // WRMSR: only `kpin_abi::x86::msr::GATE_WRITABLE` (the MSRs the virtual CPU may pass
    // through, whatever CPUID offers, and the FS/GS bases), most frequent first (x2APIC:
    // the guest's EOIs; then the TSC deadline).
24:
    mov edx, edi
    sub edx, {w0_lo}
    cmp edx, {w0_n}
    jb 3f
    mov edx, edi
    sub edx, {w1_lo}
    cmp edx, {w1_n}
    jb 3f
    mov edx, edi
    sub edx, {w2_lo}
    cmp edx, {w2_n}
    jb 3f
    mov edx, edi
    sub edx, {w3_lo}
    cmp edx, {w3_n}
    jb 3f
    mov edx, edi
    sub edx, {w4_lo}
    cmp edx, {w4_n}
    jb 3f
    mov edx, edi
    sub edx, {w5_lo}
    cmp edx, {w5_n}
    jb 3f
    mov edx, edi
    sub edx, {w6_lo}
    cmp edx, {w6_n}
    jb 3f
    mov edx, edi
    sub edx, {w7_lo}
    cmp edx, {w7_n}
    jb 3f
    mov edx, edi
    sub edx, {w8_lo}
    cmp edx, {w8_n}
    jb 3f
    jmp 94f
3:
    mov ecx, edi
    mov eax, esi
    mov rdx, rsi
    shr rdx, 32
    wrmsr
    xor eax, eax
    iretq
    // INVLPG of any address: it only drops TLB entries; RAX is returned unchanged.
26:
    invlpg [rdi]
    iretq
25:
    mov ecx, edi
    rdmsr
    shl rdx, 32
    or rax, rdx
    iretq
27:
    mov rax, [rip + kpin_irq_pending]
    or rax, [rip + kpin_irq_pending + 8]
    or rax, [rip + kpin_irq_pending + 16]
    or rax, [rip + kpin_irq_pending + 24]
    jnz 28f
    sti
    hlt
    cli
28:
    xor eax, eax
    iretq

    // Refusals: RDX = the reason (`gate_refusal`); the call ends as an unexpected #GP
    // at the gate's `int`, reported with the registers (RAX = the operation, RDI and RSI
    // its arguments) by the trap path.
90:
    mov edx, {refused_caller}
    jmp kpin_gate_refuse_args
91:
    push 0
    push {vec_bp}
    jmp kpin_trap_common
92:
    mov eax, {op_cr3}
    mov edx, {refused_cr3}
    jmp kpin_gate_refuse_args
93:
    mov edx, {refused_port}
    jmp kpin_gate_refuse_args
94:
    mov edx, {refused_msr}
    jmp kpin_gate_refuse_args
95:
    mov eax, {op_notify}
    mov edx, {refused_notify}
kpin_gate_refuse_args:
    // Stack: RIP past the two-byte `int`, CS, RFLAGS, RSP, SS: back to the `int`, and an
    // error code 0.
    sub qword ptr [rsp], 2
    push 0
    mov [rip + kpin_gate_refused], rdx
    push {vec_gp}
    jmp kpin_trap_common
    .popsection

    .pushsection .bss, "aw", @nobits
    .balign 8
    .global kpin_gate_stolen_base
kpin_gate_stolen_base:
    .skip 8
    .global kpin_gate_shadow_lo
kpin_gate_shadow_lo:
    .skip 8
    .global kpin_gate_text_lo
kpin_gate_text_lo:
    .skip 8
    .global kpin_gate_refused
kpin_gate_refused:
    .skip 8
    .popsection
"#,
    op_nop = const gate_op::NOP,
    op_invlpg = const gate_op::INVLPG,
    op_out8 = const gate_op::OUT8,
    op_in8 = const gate_op::IN8,
    op_cr3 = const gate_op::LOAD_CR3,
    op_wrmsr = const gate_op::WRMSR,
    op_rdmsr = const gate_op::RDMSR,
    op_hlt = const gate_op::HLT,
    op_out16 = const gate_op::OUT16,
    op_out32 = const gate_op::OUT32,
    op_in16 = const gate_op::IN16,
    op_in32 = const gate_op::IN32,
    op_cr4_sse = const gate_op::CR4_SSE,
    op_rdmsr_safe = const gate_op::RDMSR_SAFE,
    op_notify = const gate_op::NOTIFY,
    cr4_sse_clear = const !(crate::ring0::layout::CR4_SSE_BITS as i64) as i32,
    doorbell = const DOORBELL_PORT,
    shadow_lo = const SHADOW_TABLES_OFFSET,
    shadow_pages = const SHADOW_TABLES_BYTES / 4096,
    layout_bytes = const LAYOUT_BYTES,
    boot_pt = const BOOT_PT_OFFSET,
    engine_root = sym crate::ring0::page_tables::TABLES,
    window_va = const WINDOW_VA,
    w0_lo = const msr::GATE_WRITABLE[0].0,
    w0_n = const msr::GATE_WRITABLE[0].1 - msr::GATE_WRITABLE[0].0 + 1,
    w1_lo = const msr::GATE_WRITABLE[1].0,
    w1_n = const msr::GATE_WRITABLE[1].1 - msr::GATE_WRITABLE[1].0 + 1,
    w2_lo = const msr::GATE_WRITABLE[2].0,
    w2_n = const msr::GATE_WRITABLE[2].1 - msr::GATE_WRITABLE[2].0 + 1,
    w3_lo = const msr::GATE_WRITABLE[3].0,
    w3_n = const msr::GATE_WRITABLE[3].1 - msr::GATE_WRITABLE[3].0 + 1,
    w4_lo = const msr::GATE_WRITABLE[4].0,
    w4_n = const msr::GATE_WRITABLE[4].1 - msr::GATE_WRITABLE[4].0 + 1,
    w5_lo = const msr::GATE_WRITABLE[5].0,
    w5_n = const msr::GATE_WRITABLE[5].1 - msr::GATE_WRITABLE[5].0 + 1,
    w6_lo = const msr::GATE_WRITABLE[6].0,
    w6_n = const msr::GATE_WRITABLE[6].1 - msr::GATE_WRITABLE[6].0 + 1,
    w7_lo = const msr::GATE_WRITABLE[7].0,
    w7_n = const msr::GATE_WRITABLE[7].1 - msr::GATE_WRITABLE[7].0 + 1,
    w8_lo = const msr::GATE_WRITABLE[8].0,
    w8_n = const msr::GATE_WRITABLE[8].1 - msr::GATE_WRITABLE[8].0 + 1,
    refused_caller = const gate_refusal::CALLER,
    refused_cr3 = const gate_refusal::CR3,
    refused_port = const gate_refusal::PORT,
    refused_msr = const gate_refusal::MSR,
    refused_notify = const gate_refusal::NOTIFY,
    vec_gp = const VEC_GP,
    vec_bp = const kpin_abi::x86::vector::BP,
);

// The ports NOTIFY accepts and OUT/IN refuse are the two starting at the doorbell.
const _: () = assert!(kpin_abi::ports::ENGINE_FAILURE_PORT == DOORBELL_PORT + 1);
// The WRMSR check above tests exactly nine ranges.
const _: () = assert!(msr::GATE_WRITABLE.len() == 9);

/// Profile slots (`guest_engine::profile`) of the gate's operations: port I/O by device
/// (each a round trip through ring 0 plus the VM exit to the VMM or KVM's in-kernel
/// device), the rest by operation.
pub mod slot {
    use guest_engine::profile::EMBEDDER;
    use kpin_abi::x86::COM1_PORT;

    /// The first gate slot; the run loop's own slots are below it.
    pub const FIRST: usize = EMBEDDER + 8;
    /// NOP and unknown operations.
    pub const NOP: usize = FIRST;
    /// CR3 loads.
    pub const LOAD_CR3: usize = FIRST + 1;
    /// WRMSR.
    pub const WRMSR: usize = FIRST + 2;
    /// RDMSR and RDMSR_SAFE.
    pub const RDMSR: usize = FIRST + 3;
    /// INVLPG.
    pub const INVLPG: usize = FIRST + 4;
    /// HLT until an interrupt.
    pub const HLT: usize = FIRST + 5;
    /// CR4's SSE bits.
    pub const CR4_SSE: usize = FIRST + 6;
    /// Port I/O to the 8259 PICs (0x20-0x21, 0xa0-0xa1, ELCR 0x4d0-0x4d1).
    pub const PORT_PIC: usize = FIRST + 7;
    /// Port I/O to the PIT (0x40-0x43) and port 0x61.
    pub const PORT_PIT: usize = FIRST + 8;
    /// Port I/O to COM1 (0x3f8-0x3ff).
    pub const PORT_COM1: usize = FIRST + 9;
    /// The engine's own ports (doorbell, failure, attach status: 0xf10-0xf1f).
    pub const PORT_ENGINE: usize = FIRST + 10;
    /// Any other port.
    pub const PORT_OTHER: usize = FIRST + 11;
    /// One past the last gate slot.
    pub const END: usize = FIRST + 12;
    const _: () = assert!(END <= guest_engine::profile::SLOTS);

    /// The slot of port I/O to `port`.
    pub fn port(port: u16) -> usize {
        match port {
            0x20 | 0x21 | 0xa0 | 0xa1 | 0x4d0 | 0x4d1 => PORT_PIC,
            0x40..=0x43 | 0x61 => PORT_PIT,
            p if (COM1_PORT..COM1_PORT + 8).contains(&p) => PORT_COM1,
            0xf10..=0xf1f => PORT_ENGINE,
            _ => PORT_OTHER,
        }
    }

    /// The slot of gate operation `op` (port I/O: [`port`]).
    pub fn op(op: u64) -> usize {
        use crate::ring0::layout::gate_op as g;
        match op {
            g::LOAD_CR3 => LOAD_CR3,
            g::WRMSR => WRMSR,
            g::RDMSR | g::RDMSR_SAFE => RDMSR,
            g::INVLPG => INVLPG,
            g::HLT => HLT,
            g::CR4_SSE => CR4_SSE,
            _ => NOP,
        }
    }

    /// The name of gate slot `s`, `None` outside [`FIRST`]..[`END`].
    pub fn name(s: usize) -> Option<&'static str> {
        Some(match s {
            NOP => "gate: nop",
            LOAD_CR3 => "gate: load CR3",
            WRMSR => "gate: wrmsr",
            RDMSR => "gate: rdmsr",
            INVLPG => "gate: invlpg",
            HLT => "gate: hlt (waiting for an interrupt)",
            CR4_SSE => "gate: CR4 SSE bits",
            PORT_PIC => "gate+exit: port I/O, PIC",
            PORT_PIT => "gate+exit: port I/O, PIT/port 0x61",
            PORT_COM1 => "gate+exit: port I/O, COM1",
            PORT_ENGINE => "gate+exit: port I/O, engine doorbell",
            PORT_OTHER => "gate+exit: port I/O, other ports",
            _ => return None,
        })
    }
}

/// Gate round trips made (for the run's counters).
static CALLS: AtomicU64 = AtomicU64::new(0);

/// Gate round trips made so far.
pub fn calls() -> u64 {
    CALLS.load(Ordering::Relaxed)
}

/// One gate call: `op` with arguments `a` and `b`; returns RAX. Its time is charged to
/// the operation's profile slot.
#[inline(always)]
fn call(op: u64, a: u64, b: u64) -> u64 {
    call_as(slot::op(op), op, a, b)
}

/// [`call`] charged to profile slot `prof`.
#[inline(always)]
fn call_as(prof: usize, op: u64, a: u64, b: u64) -> u64 {
    let prev = profile::switch(prof);
    CALLS.fetch_add(1, Ordering::Relaxed);
    let ret: u64;
    // SAFETY: `kpin_gate` is the gate of entry.rs: it preserves every register but RAX
    // (result), RCX and RDX, and the stack below RSP (the call pushes a return address; the
    // target has no red zone). Memory is treated as clobbered (CR3/MSR changes).
    unsafe {
        asm!(
            "call {gate}",
            gate = sym kpin_gate,
            inout("rax") op => ret,
            in("rdi") a,
            in("rsi") b,
            out("rcx") _,
            out("rdx") _,
        );
    }
    profile::switch(prev);
    ret
}

/// A round trip that does nothing.
pub fn nop() {
    call(gate_op::NOP, 0, 0);
}

/// `out port, value` (8 bits).
pub fn out8(port: u16, value: u8) {
    call_as(
        slot::port(port),
        gate_op::OUT8,
        u64::from(port),
        u64::from(value),
    );
}

/// `out port, value` (8 bits) to one of the engine's own ports (the doorbell, the failure
/// port): the only way to reach them (OUT8 refuses them).
pub fn notify(port: u16, value: u8) {
    call(gate_op::NOTIFY, u64::from(port), u64::from(value));
}

/// Calls the gate from outside the engine's `.text`: the return address it pushes is
/// `fake_return` (a deliberate refusal, `bringup.crash=gate-caller`).
pub fn call_from(fake_return: u64) -> ! {
    // SAFETY: the gate refuses the call (the return address is not in .text) and the run
    // ends in the fault report; nothing returns here.
    unsafe {
        asm!(
            "push {ret}",
            "jmp {gate}",
            ret = in(reg) fake_return,
            gate = sym kpin_gate,
            in("rax") gate_op::NOP,
            options(noreturn),
        );
    }
}

/// `in port` (8 bits).
pub fn in8(port: u16) -> u8 {
    call_as(slot::port(port), gate_op::IN8, u64::from(port), 0) as u8
}

/// `out port, value` of `size` bytes (1, 2 or 4; the low bytes of `value`).
pub fn out(port: u16, size: u8, value: u32) {
    let op = match size {
        1 => gate_op::OUT8,
        2 => gate_op::OUT16,
        _ => gate_op::OUT32,
    };
    call_as(slot::port(port), op, u64::from(port), u64::from(value));
}

/// `in port` of `size` bytes (1, 2 or 4), zero-extended.
pub fn input(port: u16, size: u8) -> u32 {
    let op = match size {
        1 => gate_op::IN8,
        2 => gate_op::IN16,
        _ => gate_op::IN32,
    };
    call_as(slot::port(port), op, u64::from(port), 0) as u32
}

/// Loads CR3.
///
/// # Safety
/// `root` is a page-table root that maps the engine window, stacks and tables exactly as
/// the current one does.
pub unsafe fn load_cr3(root: u64) {
    // SAFETY: `kpin_gate_cr3` is LOAD_CR3's own entry (RAX holds the operation for its
    // full check); the caller vouches for `root`.
    unsafe {
        call_own_entry(
            slot::op(gate_op::LOAD_CR3),
            kpin_gate_cr3,
            gate_op::LOAD_CR3,
            root,
        )
    }
}

/// CR2: the address of the last #PF, which code at CPL 3 cannot read. LOAD_CR3's own
/// entry answers RDI = 0 (never a root) with CR2 in RAX before any check: the value is
/// the engine's own to read, and the path runs three ring-0 instructions.
pub fn read_cr2() -> u64 {
    CALLS.fetch_add(1, Ordering::Relaxed);
    let cr2;
    // SAFETY: `kpin_gate_cr3` with RDI = 0 returns CR2 in RAX and clobbers nothing else
    // (the gate's convention, RCX and RDX declared clobbered as for any call of it); the
    // `call` pushes a return address in the engine's .text.
    unsafe {
        asm!(
            "call {entry}",
            entry = sym kpin_gate_cr3,
            lateout("rax") cr2,
            in("rdi") 0u64,
            out("rcx") _,
            out("rdx") _,
        );
    }
    cr2
}

/// Writes an MSR.
///
/// # Safety
/// Writing `index` with `value` does not break the engine (e.g. EFER, the APIC base).
pub unsafe fn wrmsr(index: u32, value: u64) {
    call(gate_op::WRMSR, u64::from(index), value);
}

/// Reads an MSR (an unknown index is a #GP at ring 0, reported as an engine fault).
pub fn rdmsr(index: u32) -> u64 {
    call(gate_op::RDMSR, u64::from(index), 0)
}

/// Reads an MSR, `None` if the `rdmsr` raised #GP (KVM does not have it).
pub fn rdmsr_safe(index: u32) -> Option<u64> {
    let prev = profile::switch(slot::RDMSR);
    CALLS.fetch_add(1, Ordering::Relaxed);
    let value: u64;
    let failed: u64;
    // SAFETY: as in `call`; this operation also returns RDX (0 = read, 1 = #GP).
    unsafe {
        asm!(
            "call {gate}",
            gate = sym kpin_gate,
            inout("rax") gate_op::RDMSR_SAFE => value,
            in("rdi") u64::from(index),
            in("rsi") 0u64,
            out("rcx") _,
            out("rdx") failed,
        );
    }
    profile::switch(prev);
    (failed == 0).then_some(value)
}

/// Invalidates the TLB entries for `va`.
pub fn invlpg(va: u64) {
    call(gate_op::INVLPG, va, 0);
}

/// One round trip through an operation's own entry to the gate (`kpin_gate_cr3`: an
/// `int` of its own vector, straight to its short path), with
/// `op` in RAX and `arg` in RDI; charged to profile slot `prof`.
///
/// # Safety
/// `entry` is the own entry of operation `op`, and what `op` does with `arg` keeps the
/// engine intact (as for [`load_cr3`]).
#[inline(always)]
unsafe fn call_own_entry(prof: usize, entry: unsafe extern "C" fn(), op: u64, arg: u64) {
    let prev = profile::switch(prof);
    CALLS.fetch_add(1, Ordering::Relaxed);
    // SAFETY: as in `call_as`: the entry is the same gate with the same register
    // convention (RAX returned, RCX and RDX clobbered, the stack below RSP untouched);
    // the `call` from this inlined code pushes a return address in the engine's .text.
    unsafe {
        asm!(
            "call {entry}",
            entry = in(reg) entry,
            inout("rax") op => _,
            in("rdi") arg,
            out("rcx") _,
            out("rdx") _,
        );
    }
    profile::switch(prev);
}

/// Sets CR4.OSFXSR/OSXMMEXCPT to those bits of `bits` (the guest's SSE enables).
pub fn cr4_sse(bits: u64) {
    call(
        gate_op::CR4_SSE,
        bits & crate::ring0::layout::CR4_SSE_BITS,
        0,
    );
}

/// Halts until an interrupt has been handled (with IF enabled for the halt).
pub fn hlt() {
    call(gate_op::HLT, 0, 0);
}

/// Calls an operation number the stub does not know; returns what the stub answered.
pub fn unknown(op: u64) -> u64 {
    call(op, 0, 0)
}
