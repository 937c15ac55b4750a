//! All hand-written ring-0 assembly of the engine: the boot entry, the IDT stubs, the
//! ring-0 gate and the path that turns an unexpected exception into a CPL-3 fault report.
//! Ring-0 code runs through KVM's instruction emulator here (~1–2 µs per instruction, and
//! some instructions fail there), so it is kept short and to plain integer instructions.
//!
//! **Entry** (`_start`, from the VMM): ring 0, long mode, the VMM's boot page tables
//! (stolen region at `WINDOW_VA`, user-accessible; guest RAM at `PHYSMAP_VA`), RSP = a
//! boot stack below the image, RDI = the attach block, interrupts off, no IDT. `_start`
//! switches to the ring-0 stack, calls `ring0_setup` (Rust: fills the GDT, TSS and IDT),
//! sets CR4.FSGSBASE if CPUID 7.EBX[0] has it (`kpin_fsgsbase`), loads GDTR/IDTR/TR, remaps the PIC to vectors 0x20–0x2f with every IRQ masked, and
//! `iretq`s to `kpin_engine_main(attach)` (`run/bringup.rs`) at CPL 3 with IF = 1 on the main stack.
//!
//! **Register convention of the gate** (`kpin_gate`, called from CPL 3): RAX = operation
//! (`layout::gate_op`), RDI = first argument, RSI = second; returns RAX; clobbers RCX, RDX
//! and flags; every other register is preserved. The gate is the `int 3` at
//! `kpin_gate_insn`, through a DPL-3 interrupt gate (`layout::VEC_GATE`) straight to the
//! ring-0 half in `gate.rs`, which checks that RIP, performs the operation and `iretq`s to
//! the `ret` after the `int`. LOAD_CR3, the most frequent operation, has an `int 4` of its
//! own (`kpin_gate_cr3`, `VEC_GATE_CR3`) and a shorter path, which with RDI = 0 returns
//! CR2 instead (`gate::read_cr2`; `kpin_gate_cr3` tests RDI natively and the ring-0 side
//! branches on ZF, one emulated instruction). A software interrupt is the
//! cheapest way to ring 0 here: an `int` and an `iretq` with nothing between took 5.4 µs
//! on a Zen 5 host under `kvm_pvm`, where the #GP of a `hlt` (the gate until 2026-11-28)
//! costs ~10 µs more. Translated code never runs an `int` (the translator emulates every
//! one), so only the engine's code reaches the gate's vectors. Operations: NOP,
//! OUT8/OUT16/OUT32 (port RDI, value RSI), IN8/IN16/IN32 (port RDI), LOAD_CR3 (RDI), WRMSR
//! (index RDI, value RSI), RDMSR (index RDI), INVLPG (RDI; RAX returned unchanged),
//! HLT (`sti; hlt`: back after one interrupt was handled), CR4_SSE (CR4.OSFXSR and
//! CR4.OSXMMEXCPT := those bits of RDI, which holds no others: the guest's SSE enables,
//! mirrored because translated code runs its SSE instructions verbatim), RDMSR_SAFE (index
//! RDI; RAX = value and RDX = 0, or RDX = 1 if the `rdmsr` raised #GP, which the #GP stub
//! recognises by its RIP, `kpin_gate_rdmsr_insn`), NOTIFY (`out` of RSI's low byte to the
//! engine's own port RDI: the doorbell or the failure port). An unknown operation returns
//! `u64::MAX`. The ring-0 half of the gate, and the checks it makes of its caller and its
//! arguments before any operation (a refused call ends the run), are in `gate.rs`.
//!
//! **IDT vectors**: 0–31 exception stubs (a zero error code is pushed where the CPU pushes
//! none, then the vector), but the gate's two vectors; 32–255 interrupt stubs. Every
//! entry is an interrupt gate, DPL 0 (so `int n` from CPL 3 is a #GP) but the gate's, DPL
//! 3, and #PF's: a trap gate to `USER_CS`, whose handler runs at CPL 3 (see "Faults in
//! translated code"). Before the guest runs, the PIC is the
//! engine's (vectors 0x20–0x2f): a stub counts the IRQ in `kpin_irq_counts[irq]` (and in
//! `kpin_irq_at_cpl3` when it interrupted CPL 3), sends the PIC an EOI and `iretq`s. Once
//! the guest runs (`kpin_guest_irqs` set by `irq::hand_over`) the guest programs the PIC
//! itself through the gate, so a stub only records the vector in `kpin_irq_pending`, sets
//! the translator's attention byte (`kpin_attention_at`) and `iretq`s without an EOI: the
//! guest's handler sends it. The HLT gate skips its `hlt` if a vector is already pending.
//!
//! **IST stacks**: IST1 #DF, IST2 NMI, IST3 #MC, IST4 #PF (a CPL-3 stack: without an IST
//! an exception to CPL 3 would push its frame on the interrupted stack, the guest's).
//! TSS.RSP0 = the ring-0 stack (`kpin_ring0_stack_top`, also the boot stack after the
//! first instruction).
//!
//! **The probe** (`kpin_probe_read`, CPL 3): RDI = an address; the `mov rdx, [rdi]` at
//! `kpin_probe_insn` either reads (RAX = 0, RDX = the value) or faults, and then the
//! #PF handler (or `kpin_trap_common`, first thing, for another vector) sees that RIP and
//! resumes at `kpin_probe_fault` with RDX = vector and RCX = error code (RAX = 1).
//! Clobbers RAX, RCX, RDX.
//!
//! **Faults in translated code**: when the faulting RIP lies in the code cache
//! (`kpin_cache_lo`, `kpin_cache_len`, set by `run/mod.rs` from
//! `guest_engine::Engine::fault_redirect`), the trap path stores that RIP in
//! `kpin_cache_fault_rip` (the engine reads it there: `Engine::take_fault_pc_from`), the
//! vector (#PF's handler leaves #PF in place) and error code in `kpin_cache_fault_*` (read
//! by [`take_cache_fault`]), and goes on at the cache's fault exit (CPL 3: it stores the
//! FAULT exit word and enters the exit routine) with the guest's registers untouched:
//! `Engine::run` returns `Stop::Fault { guest_pc, .. }` with the guest state before the
//! faulting instruction. #PF, the most frequent (every shadow-MMU fill and every guest
//! page fault), is handled at CPL 3 (`kpin_exc_14`), natively, where this KVM emulates
//! every ring-0 instruction: a fault run took ~107 k TSC cycles with a 13-instruction
//! ring-0 stub and takes ~62 k. CPL 3 cannot read CR2: the engine finds the address from
//! the faulting instruction and the shadow tables
//! (`guest_engine::isolation::page_fault_address`, 24 faults in 25 on a Linux boot),
//! else reads CR2 through LOAD_CR3's entry with RDI = 0 (`gate::read_cr2`). Other vectors
//! take `kpin_trap_common` at ring 0 and `iretq` to the fault exit.
//!
//! **Unexpected exceptions** (every other exception vector, and a #GP not of RDMSR_SAFE): `kpin_trap_common`
//! saves the GPRs, vector, error code, iret frame and CR2 into `FAULT` and `iretq`s to
//! `kpin_fault_report` at CPL 3 (IF = 0, on the fault stack; an engine #PF's handler does
//! the same at CPL 3, IF still set, and jumps there), which logs the record to the
//! I/O ring and reports through the failure port. A fault while a report is in progress
//! writes the failure port directly from ring 0 (`kpin_trap_nested`): never a hang.
//!
//! **Failure codes** (the byte written to the failure port, `layout::fail_code`): 1 the
//! CPL-3 engine reported through `engine.log`; 2 a fault during a fault report (ring 0);
//! 3 a panic at ring 0.

use core::arch::global_asm;
use core::cell::UnsafeCell;
use core::mem::offset_of;
use core::sync::atomic::AtomicU64;

use kpin_abi::ports::ENGINE_FAILURE_PORT;

use crate::ring0::layout::{
    FAULT_STACK_BYTES, IST_STACK_BYTES, MAIN_STACK_BYTES, PIC1_CMD, PIC1_DATA, PIC2_CMD, PIC2_DATA,
    PIC2_VECTOR_BASE, PIC_EOI, PIC_VECTOR_BASE, RFLAGS_FIXED, RFLAGS_IF, RING0_STACK_BYTES,
    TSS_SEL, USER_CS, USER_DS, VEC_GATE, VEC_GATE_CR3, VEC_GP, VEC_PF,
};

/// What the ring-0 trap path saved about an unexpected exception.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct FaultRecord {
    /// RAX, RBX, RCX, RDX, RSI, RDI, RBP, R8–R15, in that order.
    pub gprs: [u64; 15],
    /// Exception vector.
    pub vector: u64,
    /// Error code (0 when the exception has none).
    pub error: u64,
    /// Faulting RIP.
    pub rip: u64,
    /// CS at the fault.
    pub cs: u64,
    /// RFLAGS at the fault.
    pub rflags: u64,
    /// RSP at the fault.
    pub rsp: u64,
    /// SS at the fault.
    pub ss: u64,
    /// CR2 when the trap path ran.
    pub cr2: u64,
}

/// Names of [`FaultRecord::gprs`], in order.
pub const GPR_NAMES: [&str; 15] = [
    "rax", "rbx", "rcx", "rdx", "rsi", "rdi", "rbp", "r8", "r9", "r10", "r11", "r12", "r13", "r14",
    "r15",
];

/// The fault record, written by ring-0 asm and read by the CPL-3 reporter.
#[repr(transparent)]
pub struct FaultCell(pub UnsafeCell<FaultRecord>);
// SAFETY: one vCPU; the ring-0 path writes the record only while no report is in progress
// (`kpin_fault_active`), and the reporter reads it only after that write.
unsafe impl Sync for FaultCell {}

/// The one fault record.
pub static FAULT: FaultCell = FaultCell(UnsafeCell::new(FaultRecord {
    gprs: [0; 15],
    vector: 0,
    error: 0,
    rip: 0,
    cs: 0,
    rflags: 0,
    rsp: 0,
    ss: 0,
    cr2: 0,
}));

extern "C" {
    /// The gate; see the module header. Never call it directly: use `crate::ring0::gate`.
    pub fn kpin_gate();
    /// LOAD_CR3's own entry to the gate. Use `crate::ring0::gate::load_cr3`.
    pub fn kpin_gate_cr3();
    /// The probe; see the module header. Use `crate::ring0::probe`.
    pub fn kpin_probe_read();
    /// IRQ counts per PIC line (16 entries).
    pub static kpin_irq_counts: [u64; 16];
    /// Interrupts that arrived while the CPU was at CPL 3.
    pub static kpin_irq_at_cpl3: u64;
    /// Non-zero when `_start` enabled CR4.FSGSBASE (`wrfsbase`/`wrgsbase` work at CPL 3).
    pub static kpin_fsgsbase: u64;
    /// Non-zero once the guest owns the PIC: vectors 32–255 are recorded in
    /// [`kpin_irq_pending`] and set the attention byte instead of being EOI'd.
    pub static mut kpin_guest_irqs: u64;
    /// Address of the translator's attention byte (0: none yet).
    pub static mut kpin_attention_at: u64;
    /// Pending guest interrupt vectors, a 256-bit bitmap (bit v of word v / 64).
    pub static kpin_irq_pending: [u64; 4];
    /// TSC read by `_start` at its first instruction.
    pub static kpin_boot_tsc: u64;
    /// Stub addresses for IDT vectors 0..256.
    pub static kpin_idt_stubs: [u64; crate::ring0::layout::IDT_VECTORS];
    /// Top of the ring-0 stack (TSS.RSP0).
    pub static kpin_ring0_stack_top: u8;
    /// Top of the IST1 (#DF) stack.
    pub static kpin_ist1_top: u8;
    /// Top of the IST2 (NMI) stack.
    pub static kpin_ist2_top: u8;
    /// Top of the IST3 (#MC) stack.
    pub static kpin_ist3_top: u8;
    /// Top of the IST4 (#PF) stack.
    pub static kpin_ist4_top: u8;
    /// Start of the code cache (`guest_engine::FaultRedirect::region`); with
    /// [`kpin_cache_len`] 0 (until the engine runs guest code) no fault is redirected.
    pub static mut kpin_cache_lo: u64;
    /// Bytes of the code cache.
    pub static mut kpin_cache_len: u64;
    /// The faulting cache PC of the last redirected fault (the engine's
    /// `Engine::take_fault_pc_from` cell).
    pub static kpin_cache_fault_rip: AtomicU64;
    /// The cache's fault exit (it stores the FAULT exit word).
    pub static mut kpin_cache_exit_routine: u64;
    /// Vector of the last redirected fault (#PF unless the common path stored another).
    pub static mut kpin_cache_fault_vector: u64;
    /// Error code of the last redirected fault.
    pub static kpin_cache_fault_error: u64;
}

/// The last fault redirected to the cache's fault exit: (vector, error code). Puts #PF
/// back as the vector, which the #PF handler does not store. (A #PF's address is found
/// by `cache_page_fault::fault_address`.)
pub fn take_cache_fault() -> (u64, u64) {
    // SAFETY: written by the trap path before it redirected the fault to the exit
    // routine, which ran before the caller's run returned; one vCPU, and no fault is being
    // redirected while CPL-3 code runs here.
    unsafe {
        let vector = core::ptr::read_volatile(&raw const kpin_cache_fault_vector);
        core::ptr::write_volatile(&raw mut kpin_cache_fault_vector, u64::from(VEC_PF));
        (
            vector,
            core::ptr::read_volatile(&raw const kpin_cache_fault_error),
        )
    }
}

// Boot entry: ring 0 → CPL 3.
extern "C" {
    /// The CPL-3 main flow `_start` returns to with `iretq` (`run/bringup.rs`), by
    /// symbol so that the ring-0 code does not import the rest of the image.
    fn kpin_engine_main(attach: *const kpin_abi::attach::AttachBlock) -> !;
}

global_asm!(
    r#"
    .pushsection .text.entry, "ax"
    .global _start
_start:
    cli
    cld
    mov r12, rdi
    rdtsc
    shl rdx, 32
    or rax, rdx
    mov [rip + kpin_boot_tsc], rax
    // The stolen region's base, for the gate's LOAD_CR3 check: the VMM enters with CR3 =
    // its boot root, at BOOT_PT_OFFSET in the region.
    mov rax, cr3
    and rax, -4096
    sub rax, {boot_pt}
    mov [rip + kpin_gate_stolen_base], rax
    // The gate's fast LOAD_CR3 and caller checks subtract these, one memory operand each.
    add rax, {shadow_lo}
    mov [rip + kpin_gate_shadow_lo], rax
    lea rax, [rip + __image_start]
    mov [rip + kpin_gate_text_lo], rax
    lea rsp, [rip + kpin_ring0_stack_top]
    call {setup}
    // CR4.FSGSBASE when the CPU has it (CPUID 7.0 EBX[0]): CPL-3 code can then switch the
    // guest's FS/GS bases with `wrfsbase`/`wrgsbase` instead of the gate's WRMSR.
    mov eax, 7
    xor ecx, ecx
    cpuid
    test ebx, 1
    jz 5f
    mov rax, cr4
    or rax, {cr4_fsgsbase}
    mov cr4, rax
    mov qword ptr [rip + kpin_fsgsbase], 1
5:
    lgdt [rip + {gdtr}]
    lidt [rip + {idtr}]
    mov ax, {tss_sel}
    ltr ax
    xor eax, eax
    mov ds, ax
    mov es, ax
    mov fs, ax
    mov gs, ax
    mov al, 0x11
    out {pic1_cmd}, al
    out {pic2_cmd}, al
    mov al, {pic1_base}
    out {pic1_data}, al
    mov al, {pic2_base}
    out {pic2_data}, al
    mov al, 4
    out {pic1_data}, al
    mov al, 2
    out {pic2_data}, al
    mov al, 1
    out {pic1_data}, al
    out {pic2_data}, al
    mov al, 0xff
    out {pic1_data}, al
    out {pic2_data}, al
    push {user_ds}
    lea rax, [rip + kpin_main_stack_top]
    push rax
    push {rflags}
    push {user_cs}
    lea rax, [rip + {main}]
    push rax
    mov rdi, r12
    iretq
    .popsection
"#,
    setup = sym crate::ring0::engine_tables::ring0_setup,
    gdtr = sym crate::ring0::engine_tables::GDTR,
    idtr = sym crate::ring0::engine_tables::IDTR,
    tss_sel = const TSS_SEL,
    pic1_base = const PIC_VECTOR_BASE,
    pic1_cmd = const PIC1_CMD,
    pic1_data = const PIC1_DATA,
    pic2_cmd = const PIC2_CMD,
    pic2_data = const PIC2_DATA,
    pic2_base = const PIC2_VECTOR_BASE,
    user_ds = const USER_DS,
    user_cs = const USER_CS,
    rflags = const RFLAGS_IF | RFLAGS_FIXED,
    main = sym kpin_engine_main,
    cr4_fsgsbase = const 1u64 << 16,
    boot_pt = const kpin_abi::stolen::BOOT_PT_OFFSET,
    shadow_lo = const kpin_abi::stolen::SHADOW_TABLES_OFFSET,
);

// Exception and interrupt stubs, the stub table.
global_asm!(
    r#"
    .pushsection .text, "ax"
    // Saves the GPRs (RAX as it was) and the stack's vector, error code and iret frame
    // into the fault record: the unexpected-exception path's, at ring 0 and (for #PF)
    // at CPL 3. Stack: vector, error code, RIP, CS, RFLAGS, RSP, SS. Clobbers RAX.
.macro kpin_record_fault
    mov [rip + {rec} + 0], rax
    mov [rip + {rec} + 8], rbx
    mov [rip + {rec} + 16], rcx
    mov [rip + {rec} + 24], rdx
    mov [rip + {rec} + 32], rsi
    mov [rip + {rec} + 40], rdi
    mov [rip + {rec} + 48], rbp
    mov [rip + {rec} + 56], r8
    mov [rip + {rec} + 64], r9
    mov [rip + {rec} + 72], r10
    mov [rip + {rec} + 80], r11
    mov [rip + {rec} + 88], r12
    mov [rip + {rec} + 96], r13
    mov [rip + {rec} + 104], r14
    mov [rip + {rec} + 112], r15
    mov rax, [rsp]
    mov [rip + {rec} + {off_vector}], rax
    mov rax, [rsp + 8]
    mov [rip + {rec} + {off_error}], rax
    mov rax, [rsp + 16]
    mov [rip + {rec} + {off_rip}], rax
    mov rax, [rsp + 24]
    mov [rip + {rec} + {off_cs}], rax
    mov rax, [rsp + 32]
    mov [rip + {rec} + {off_rflags}], rax
    mov rax, [rsp + 40]
    mov [rip + {rec} + {off_rsp}], rax
    mov rax, [rsp + 48]
    mov [rip + {rec} + {off_ss}], rax
.endm

.macro kpin_exc n, err
kpin_exc_\n:
  .if \err == 0
    push 0
  .endif
    push \n
    jmp kpin_trap_common
.endm

.macro kpin_vec num
kpin_vec_\num:
    push rax
    mov eax, \num
    cmp qword ptr [rip + kpin_guest_irqs], 0
    jne kpin_irq_guest
  .if \num < 48
    inc qword ptr [rip + kpin_irq_counts + 8 * (\num - 32)]
    test byte ptr [rsp + 16], 3
    jz 1f
    inc qword ptr [rip + kpin_irq_at_cpl3]
1:
    mov al, {eoi}
    .if \num >= 40
    out {pic2_cmd}, al
    .endif
    out {pic1_cmd}, al
  .endif
    pop rax
    iretq
.endm

.irp n, 0,1,2,5,6,7,9,15,16,18,19,20,22,23,24,25,26,27,28,31
    kpin_exc \n, 0
.endr
    // The gate's vectors (`layout::VEC_GATE*`) enter the gate itself.
    .set kpin_exc_{vec_gate_cr3}, kpin_gate_cr3_entry
    .set kpin_exc_{vec_gate}, kpin_gate_entry
.irp n, 8,10,11,12,17,21,29,30
    kpin_exc \n, 1
.endr
.irp n, 32,33,34,35,36,37,38,39,40,41,42,43,44,45,46,47,48,49,50,51,52,53,54,55,56,57,58,59,60,61,62,63,64,65,66,67,68,69,70,71,72,73,74,75,76,77,78,79,80,81,82,83,84,85,86,87,88,89,90,91,92,93,94,95,96,97,98,99,100,101,102,103,104,105,106,107,108,109,110,111,112,113,114,115,116,117,118,119,120,121,122,123,124,125,126,127,128,129,130,131,132,133,134,135,136,137,138,139,140,141,142,143,144,145,146,147,148,149,150,151,152,153,154,155,156,157,158,159,160,161,162,163,164,165,166,167,168,169,170,171,172,173,174,175,176,177,178,179,180,181,182,183,184,185,186,187,188,189,190,191,192,193,194,195,196,197,198,199,200,201,202,203,204,205,206,207,208,209,210,211,212,213,214,215,216,217,218,219,220,221,222,223,224,225,226,227,228,229,230,231,232,233,234,235,236,237,238,239,240,241,242,243,244,245,246,247,248,249,250,251,252,253,254,255
    kpin_vec \n
.endr

    // #PF, the most frequent exception (every shadow-MMU fill), runs here at CPL 3 on
    // IST4 through a trap gate whose selector is USER_CS (`engine_tables.rs`): natively,
    // where ring-0 code is emulated instruction by instruction. A fault in the code cache
    // goes to the cache's fault exit (see "Faults in translated code") with its error
    // code and cache PC in cells; its address is the engine's to find
    // (`cache_page_fault::fault_address`). The way back is not an `iretq` (one at CPL 3
    // runs in hardware, beneath this KVM's view of the vCPU's mode): the flags with
    // `popfq` (IF stays set: a trap gate does not clear it), RAX from the stack, RSP from
    // the frame, then a jump through a cell; no other register is touched.
    // Stack: error code, RIP, CS, RFLAGS, RSP, SS.
    // The way back from the #PF handler with its RAX saved on the frame: the frame's
    // flags, RAX, then the frame's RSP; the caller's jump follows.
.macro kpin_pf_unwind
    push qword ptr [rsp + 32]
    popfq
    pop rax
    mov rsp, [rsp + 32]
.endm
kpin_exc_14:
    push rax
    mov rax, [rsp + 8]
    mov [rip + kpin_cache_fault_error], rax
    mov rax, [rsp + 16]
    mov [rip + kpin_cache_fault_rip], rax
    sub rax, [rip + kpin_cache_lo]
    cmp rax, [rip + kpin_cache_len]
    jae 1f
    kpin_pf_unwind
    jmp [rip + kpin_cache_exit_routine]
1:
    // The probe's read: back at its fault path with RDX = #PF, RCX = the error code.
    lea rax, [rip + kpin_probe_insn]
    cmp rax, [rsp + 16]
    jne 2f
    mov edx, {vec_pf}
    mov rcx, [rsp + 8]
    kpin_pf_unwind
    jmp kpin_probe_fault
2:
    // The engine's own fault: its report (a fault while reporting: the #UD of `ud2`
    // takes the ring-0 path, which ends the run from there).
    cmp qword ptr [rip + kpin_fault_active], 0
    jne 3f
    mov qword ptr [rip + kpin_fault_active], 1
    pop rax
    push {vec_pf}
    kpin_record_fault
    xor edi, edi
    int {vec_gate_cr3}
    mov [rip + {rec} + {off_cr2}], rax
    lea rsp, [rip + kpin_fault_stack_top]
    jmp {report}
3:
    ud2

    // An interrupt once the guest owns the PIC (`kpin_guest_irqs` set): record vector EAX
    // as pending for the guest, set the translator's attention byte, no EOI (the guest
    // sends its own). Stack: saved RAX, then the iret frame.
kpin_irq_guest:
    push rcx
    push rdx
    mov ecx, eax
    and ecx, 63
    mov edx, 1
    shl rdx, cl
    shr eax, 6
    lea rcx, [rip + kpin_irq_pending]
    or [rcx + rax * 8], rdx
    mov rcx, [rip + kpin_attention_at]
    test rcx, rcx
    jz 1f
    or byte ptr [rcx], {att_irq}
1:
    pop rdx
    pop rcx
    pop rax
    iretq

    // #GP: RDMSR_SAFE's `rdmsr`, or an unexpected #GP.
kpin_exc_13:
    // A #GP from the RDMSR_SAFE operation's `rdmsr` (ring 0, nested in the gate):
    // resume at its fault path, which reports the failure.
    push rax
    lea rax, [rip + kpin_gate_rdmsr_insn]
    cmp rax, [rsp + 16]
    jne 1f
    lea rax, [rip + kpin_gate_rdmsr_fault]
    mov [rsp + 16], rax
    pop rax
    add rsp, 8
    iretq
1:
    pop rax
    push {vec_gp}
    jmp kpin_trap_common


    // Stack: vector, error code, RIP, CS, RFLAGS, RSP, SS.
    .global kpin_trap_common
kpin_trap_common:
    push rax
    lea rax, [rip + kpin_probe_insn]
    cmp rax, [rsp + 24]
    jne 3f
    lea rax, [rip + kpin_probe_fault]
    mov [rsp + 24], rax
    mov rdx, [rsp + 8]
    mov rcx, [rsp + 16]
    pop rax
    add rsp, 16
    iretq
3:
    // A fault in the code cache (translated guest code): redirect it to the cache's
    // exit routine as a FAULT exit (see "Faults in translated code" above).
    // Stack: rax, vector, error code, RIP, CS, RFLAGS, RSP, SS.
    mov rax, [rsp + 24]
    mov [rip + kpin_cache_fault_rip], rax
    sub rax, [rip + kpin_cache_lo]
    cmp rax, [rip + kpin_cache_len]
    jae 4f
    mov rax, [rsp + 8]
    mov [rip + kpin_cache_fault_vector], rax
    mov rax, [rsp + 16]
    mov [rip + kpin_cache_fault_error], rax
    mov rax, [rip + kpin_cache_exit_routine]
    mov [rsp + 24], rax
    pop rax
    add rsp, 16
    iretq
4:
    pop rax
    cmp qword ptr [rip + kpin_fault_active], 0
    jne kpin_trap_nested
    mov qword ptr [rip + kpin_fault_active], 1
    kpin_record_fault
    mov rax, cr2
    mov [rip + {rec} + {off_cr2}], rax
    add rsp, 16
    lea rax, [rip + {report}]
    mov [rsp], rax
    mov qword ptr [rsp + 8], {user_cs}
    mov qword ptr [rsp + 16], {rflags}
    lea rax, [rip + kpin_fault_stack_top]
    mov [rsp + 24], rax
    mov qword ptr [rsp + 32], {user_ds}
    iretq

kpin_trap_nested:
    mov dx, {fail_port}
    mov al, {nested_code}
    out dx, al
2:
    cli
    hlt
    jmp 2b

    // The probe (CPL 3): RDI = address. Returns RAX = 0 and RDX = the quadword read, or
    // RAX = 1, RDX = vector, RCX = error code when the read faulted.
    .global kpin_probe_read
kpin_probe_read:
    xor eax, eax
kpin_probe_insn:
    mov rdx, [rdi]
    ret
kpin_probe_fault:
    mov eax, 1
    ret

    // The gate (CPL 3 only).
    .global kpin_gate
    .global kpin_gate_insn
kpin_gate:
kpin_gate_insn:
    // `int 3` (CD 03), not `int3` (CC): the gate's path checks for this RIP.
    .byte 0xcd, {vec_gate}
    ret
    // LOAD_CR3's own entry to the gate (same convention; RAX = LOAD_CR3), which also
    // reads CR2 for RDI = 0: the `test`, native here, leaves ZF for the ring-0 side's
    // one `jz` (flags survive the `int`).
    .global kpin_gate_cr3
kpin_gate_cr3:
    test rdi, rdi
    int {vec_gate_cr3}
    ret
    .popsection

    .pushsection .rodata, "a"
    .balign 8
    .global kpin_idt_stubs
kpin_idt_stubs:
.irp n, 0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27,28,29,30,31
    .quad kpin_exc_\n
.endr
.irp n, 32,33,34,35,36,37,38,39,40,41,42,43,44,45,46,47,48,49,50,51,52,53,54,55,56,57,58,59,60,61,62,63,64,65,66,67,68,69,70,71,72,73,74,75,76,77,78,79,80,81,82,83,84,85,86,87,88,89,90,91,92,93,94,95,96,97,98,99,100,101,102,103,104,105,106,107,108,109,110,111,112,113,114,115,116,117,118,119,120,121,122,123,124,125,126,127,128,129,130,131,132,133,134,135,136,137,138,139,140,141,142,143,144,145,146,147,148,149,150,151,152,153,154,155,156,157,158,159,160,161,162,163,164,165,166,167,168,169,170,171,172,173,174,175,176,177,178,179,180,181,182,183,184,185,186,187,188,189,190,191,192,193,194,195,196,197,198,199,200,201,202,203,204,205,206,207,208,209,210,211,212,213,214,215,216,217,218,219,220,221,222,223,224,225,226,227,228,229,230,231,232,233,234,235,236,237,238,239,240,241,242,243,244,245,246,247,248,249,250,251,252,253,254,255
    .quad kpin_vec_\n
.endr
    .popsection

    // The last redirected fault's vector: #PF unless the common path stored another
    // (the #PF stub does not store it; `take_cache_fault` puts #PF back).
    .pushsection .data, "aw"
    .balign 8
    .global kpin_cache_fault_vector
kpin_cache_fault_vector:
    .quad {vec_pf}
    .popsection

    .pushsection .bss, "aw", @nobits
    .balign 16
    .global kpin_irq_counts
kpin_irq_counts:
    .skip 8 * 16
    .global kpin_irq_at_cpl3
kpin_irq_at_cpl3:
    .skip 8
    .global kpin_boot_tsc
kpin_boot_tsc:
    .skip 8
    .global kpin_fsgsbase
kpin_fsgsbase:
    .skip 8
    .global kpin_guest_irqs
kpin_guest_irqs:
    .skip 8
    .global kpin_attention_at
kpin_attention_at:
    .skip 8
    .global kpin_irq_pending
kpin_irq_pending:
    .skip 32
kpin_fault_active:
    .skip 8
    .global kpin_cache_lo
kpin_cache_lo:
    .skip 8
    .global kpin_cache_len
kpin_cache_len:
    .skip 8
    .global kpin_cache_fault_rip
kpin_cache_fault_rip:
    .skip 8
    .global kpin_cache_exit_routine
kpin_cache_exit_routine:
    .skip 8
    .global kpin_cache_fault_error
kpin_cache_fault_error:
    .skip 8
    .balign 4096
    .skip {ring0_stack}
    .global kpin_ring0_stack_top
kpin_ring0_stack_top:
    .skip {ist_stack}
    .global kpin_ist1_top
kpin_ist1_top:
    .skip {ist_stack}
    .global kpin_ist2_top
kpin_ist2_top:
    .skip {ist_stack}
    .global kpin_ist3_top
kpin_ist3_top:
    .skip {ist_stack}
    .global kpin_ist4_top
kpin_ist4_top:
    .skip {main_stack}
kpin_main_stack_top:
    .skip {fault_stack}
kpin_fault_stack_top:
    .popsection
"#,
    eoi = const PIC_EOI,
    att_irq = const guest_engine::attention::reason::INTERRUPT,
    pic1_cmd = const PIC1_CMD,
    pic2_cmd = const PIC2_CMD,
    vec_gp = const VEC_GP,
    vec_pf = const VEC_PF,
    vec_gate = const VEC_GATE,
    vec_gate_cr3 = const VEC_GATE_CR3,
    rec = sym FAULT,
    off_vector = const offset_of!(FaultRecord, vector),
    off_error = const offset_of!(FaultRecord, error),
    off_rip = const offset_of!(FaultRecord, rip),
    off_cs = const offset_of!(FaultRecord, cs),
    off_rflags = const offset_of!(FaultRecord, rflags),
    off_rsp = const offset_of!(FaultRecord, rsp),
    off_ss = const offset_of!(FaultRecord, ss),
    off_cr2 = const offset_of!(FaultRecord, cr2),
    report = sym crate::ring0::crash::kpin_fault_report,
    user_cs = const USER_CS,
    user_ds = const USER_DS,
    rflags = const RFLAGS_FIXED,
    fail_port = const ENGINE_FAILURE_PORT,
    nested_code = const crate::ring0::layout::fail_code::NESTED_FAULT,
    ring0_stack = const RING0_STACK_BYTES,
    ist_stack = const IST_STACK_BYTES,
    main_stack = const MAIN_STACK_BYTES,
    fault_stack = const FAULT_STACK_BYTES,
);

const _: () = assert!(offset_of!(FaultRecord, vector) == 120);
