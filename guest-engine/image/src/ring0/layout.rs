//! Every constant of the engine's bring-up: selectors, vectors, IST slots, stack sizes,
//! gate operations, PIC/PIT ports. `entry.rs` (the ring-0 asm) and the CPL-3 Rust code
//! both take their numbers from here.

/// Kernel (CPL 0) 64-bit code selector.
pub const KERNEL_CS: u16 = 0x08;
/// User (CPL 3) data selector, RPL 3 (GDT index 3: the `sysret` order, data before code).
pub const USER_DS: u16 = 0x18 | 3;
/// User (CPL 3) 64-bit code selector, RPL 3 (GDT index 4).
pub const USER_CS: u16 = 0x20 | 3;
/// TSS selector (GDT indices 5 and 6: a 16-byte system descriptor).
pub const TSS_SEL: u16 = 0x28;
/// GDT entries (8 bytes each).
pub const GDT_ENTRIES: usize = 7;

/// Vectors with an IDT entry: all 256 (32 exceptions, 224 interrupts).
pub const IDT_VECTORS: usize = 256;
/// First vector of the remapped master PIC (IRQ 0 = the PIT).
pub const PIC_VECTOR_BASE: u8 = 0x20;
/// First vector of the remapped slave PIC.
pub const PIC2_VECTOR_BASE: u8 = 0x28;

/// NMI.
pub const VEC_NMI: u8 = kpin_abi::x86::vector::NMI;
/// #DF.
pub const VEC_DF: u8 = kpin_abi::x86::vector::DF;
/// #GP.
pub const VEC_GP: u8 = kpin_abi::x86::vector::GP;
/// #PF.
pub const VEC_PF: u8 = kpin_abi::x86::vector::PF;
/// #MC.
pub const VEC_MC: u8 = kpin_abi::x86::vector::MC;

/// The gate's vectors (`int n` at CPL 3 through DPL-3 interrupt gates, `entry.rs`): the
/// two that this `kvm_pvm` delivers as fast as an exception's stub can run (#BP and #OF,
/// the host kernel's own user-callable vectors; any other `int n` it turns into a #UD),
/// which no 64-bit CPU raises but for an `int3`/`int 3` or `into` (invalid in 64-bit mode),
/// and a local APIC never delivers (vectors 0–15 are illegal there). LOAD_CR3's own entry
/// (`int 4`, which no compiler emits).
pub const VEC_GATE_CR3: u8 = 4;
/// Every other operation (`int 3`; its path checks the RIP, so that a stray `int3` of
/// padding is an unexpected #BP, never a call).
pub const VEC_GATE: u8 = 3;

/// IST slot of #DF.
pub const IST_DF: u8 = 1;
/// IST slot of NMI.
pub const IST_NMI: u8 = 2;
/// IST slot of #MC.
pub const IST_MC: u8 = 3;
/// IST slot of #PF.
pub const IST_PF: u8 = 4;

/// Ring-0 stack (TSS.RSP0: interrupts and gates from CPL 3; also the boot stack).
pub const RING0_STACK_BYTES: usize = 16 << 10;
/// Each IST stack.
pub const IST_STACK_BYTES: usize = 8 << 10;
/// The engine's CPL-3 main stack.
pub const MAIN_STACK_BYTES: usize = 128 << 10;
/// The CPL-3 stack the fault reporter runs on.
pub const FAULT_STACK_BYTES: usize = 32 << 10;

/// CR4.OSFXSR | CR4.OSXMMEXCPT: the CR4 bits the guest's writes reach the real CR4 with
/// (gate operation `CR4_SSE`), because translated guest code runs SSE verbatim.
pub const CR4_SSE_BITS: u64 = kpin_abi::x86::cr4::SSE_BITS;

/// Gate operations, passed in RAX (see `entry.rs`).
pub mod gate_op {
    /// Do nothing (measures the round trip).
    pub const NOP: u64 = 0;
    /// `out dx, al`: RDI = port, RSI = value.
    pub const OUT8: u64 = 1;
    /// `in al, dx`: RDI = port; RAX = value.
    pub const IN8: u64 = 2;
    /// `mov cr3, rdi`.
    pub const LOAD_CR3: u64 = 3;
    /// `wrmsr`: RDI = index, RSI = value.
    pub const WRMSR: u64 = 4;
    /// `rdmsr`: RDI = index; RAX = value.
    pub const RDMSR: u64 = 5;
    /// `invlpg [rdi]`.
    pub const INVLPG: u64 = 6;
    /// `sti; hlt`: returns after the next interrupt has been handled.
    pub const HLT: u64 = 7;
    /// `out dx, ax`: RDI = port, RSI = value.
    pub const OUT16: u64 = 8;
    /// `out dx, eax`: RDI = port, RSI = value.
    pub const OUT32: u64 = 9;
    /// `in ax, dx`: RDI = port; RAX = value.
    pub const IN16: u64 = 10;
    /// `in eax, dx`: RDI = port; RAX = value.
    pub const IN32: u64 = 11;
    /// CR4.OSFXSR/OSXMMEXCPT := RDI's (RDI holds only those bits, `CR4_SSE_BITS`).
    pub const CR4_SSE: u64 = 12;
    /// `rdmsr` that survives a #GP: RDI = index; RAX = value, RDX = 0, or RDX = 1 on #GP.
    pub const RDMSR_SAFE: u64 = 13;
    /// `out dx, al` to one of the engine's own ports (the doorbell, the failure port), the
    /// only operation that may: RDI = port, RSI = value.
    pub const NOTIFY: u64 = 14;
    /// What an unknown operation returns in RAX.
    pub const UNKNOWN: u64 = u64::MAX;
}

/// Why the gate refused a call (`kpin_gate_refused`, 0 while none was): the call ends the
/// run as an engine failure with this reason and the caller's registers in `engine.log`.
pub mod gate_refusal {
    /// The return address the gate's caller pushed is not in the engine's `.text`.
    pub const CALLER: u64 = 1;
    /// LOAD_CR3 of a root the engine did not build.
    pub const CR3: u64 = 2;
    /// Port I/O on one of the engine's own ports through a port operation.
    pub const PORT: u64 = 3;
    /// WRMSR of an MSR the virtual CPU never passes through.
    pub const MSR: u64 = 4;
    /// NOTIFY of a port that is not the engine's.
    pub const NOTIFY: u64 = 5;
}

/// Byte written to the failure port (`kpin_abi::ports::ENGINE_FAILURE_PORT`), for the
/// dump reader; the VMM ends the run whatever the value.
pub mod fail_code {
    /// Reported through the log at CPL 3 (`log::fail`): see `engine.log`.
    pub const REPORTED: u8 = 1;
    /// A fault while a fault report was in progress, written from ring 0.
    pub const NESTED_FAULT: u8 = 2;
    /// A panic at ring 0 (in `ring0_setup`), written from ring 0.
    pub const RING0_PANIC: u8 = 3;
}

/// Master PIC command port.
pub const PIC1_CMD: u16 = 0x20;
/// Master PIC data (mask) port.
pub const PIC1_DATA: u16 = 0x21;
/// Slave PIC command port.
pub const PIC2_CMD: u16 = 0xa0;
/// Slave PIC data (mask) port.
pub const PIC2_DATA: u16 = 0xa1;
/// PIC end-of-interrupt command.
pub const PIC_EOI: u8 = 0x20;
/// PIT channel 0 data port.
pub const PIT_CH0: u16 = 0x40;
/// PIT mode/command port.
pub const PIT_CMD: u16 = 0x43;
/// PIT command: channel 0, lobyte/hibyte, mode 2 (rate generator), binary.
pub const PIT_MODE_RATE: u8 = 0x34;
/// PIT input clock in Hz.
pub const PIT_HZ: u64 = 1_193_182;
/// Timer rate used for bring-up measurements.
pub const TIMER_HZ: u64 = 1000;

/// RFLAGS.IF.
pub const RFLAGS_IF: u64 = kpin_abi::x86::rflags::IF;
/// RFLAGS bit 1 (always set).
pub const RFLAGS_FIXED: u64 = kpin_abi::x86::rflags::FIXED;

/// Default number of gate round trips measured at bring-up.
pub const DEFAULT_GATES: u64 = 2000;
/// Default number of timer ticks awaited at bring-up.
pub const DEFAULT_TICKS: u64 = 20;
