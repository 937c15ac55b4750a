//! Small wrappers for single privileged instructions: port I/O, MSRs, control registers,
//! CPUID, RFLAGS, segment-relative loads, `swapgs`, `hlt`, and power off.
//!
//! Every instruction used here is a plain integer or system instruction that KVM's
//! instruction emulator handles at ring 0 (see DESIGN.md §2; `check_forbidden.py` enforces the
//! list of instructions that must never appear).

use core::arch::asm;

/// `IA32_EFER`.
pub const MSR_EFER: u32 = 0xc000_0080;
/// `IA32_STAR`: SYSCALL/SYSRET selector bases.
pub const MSR_STAR: u32 = 0xc000_0081;
/// `IA32_LSTAR`: 64-bit SYSCALL target.
pub const MSR_LSTAR: u32 = 0xc000_0082;
/// `IA32_FMASK`: RFLAGS bits cleared by SYSCALL.
pub const MSR_SFMASK: u32 = 0xc000_0084;
/// `IA32_FS_BASE`.
pub const MSR_FS_BASE: u32 = 0xc000_0100;
/// `IA32_GS_BASE`.
pub const MSR_GS_BASE: u32 = 0xc000_0101;
/// `IA32_KERNEL_GS_BASE` (exchanged with GS base by `swapgs`).
pub const MSR_KERNEL_GS_BASE: u32 = 0xc000_0102;
/// EFER.SCE: SYSCALL/SYSRET enable.
pub const EFER_SCE: u64 = 1 << 0;

/// RFLAGS.IF.
pub const RFLAGS_IF: u64 = 1 << 9;

/// i8042 command port; writing [`I8042_RESET`] resets the machine (the VMM's poweroff).
const I8042_COMMAND: u16 = 0x64;
/// i8042 "pulse reset line" command.
const I8042_RESET: u8 = 0xfe;

/// Reads a byte from `port`.
pub fn inb(port: u16) -> u8 {
    let value: u8;
    // SAFETY: the kernel only names ports of the devices the VMM provides (COM1, PIC, PIT);
    // a port read has no memory effects.
    unsafe {
        asm!("in al, dx", in("dx") port, out("al") value, options(nomem, nostack, preserves_flags))
    };
    value
}

/// Writes a byte to `port`.
pub fn outb(port: u16, value: u8) {
    // SAFETY: as in `inb`; the devices behind these ports do no DMA.
    unsafe {
        asm!("out dx, al", in("dx") port, in("al") value, options(nomem, nostack, preserves_flags))
    };
}

/// Reads MSR `msr`.
pub fn rdmsr(msr: u32) -> u64 {
    let (lo, hi): (u32, u32);
    // SAFETY: only architectural MSRs that exist on every x86-64 CPU are named by callers.
    unsafe {
        asm!("rdmsr", in("ecx") msr, out("eax") lo, out("edx") hi, options(nomem, nostack, preserves_flags))
    };
    (u64::from(hi) << 32) | u64::from(lo)
}

/// Writes MSR `msr`.
///
/// # Safety
/// The value must not break an invariant the running kernel relies on (EFER.LME/LMA, a
/// STAR/LSTAR that a later `syscall` would jump through, ...).
pub unsafe fn wrmsr(msr: u32, value: u64) {
    // SAFETY: the caller guarantees the new value keeps the kernel sound.
    unsafe {
        asm!("wrmsr", in("ecx") msr, in("eax") value as u32, in("edx") (value >> 32) as u32,
             options(nostack, preserves_flags))
    };
}

/// CR2: the linear address of the last page fault.
pub fn read_cr2() -> u64 {
    let v: u64;
    // SAFETY: reading CR2 has no side effects.
    unsafe { asm!("mov {}, cr2", out(reg) v, options(nomem, nostack, preserves_flags)) };
    v
}

/// CR3: the current PML4 root (physical).
pub fn read_cr3() -> u64 {
    let v: u64;
    // SAFETY: reading CR3 has no side effects.
    unsafe { asm!("mov {}, cr3", out(reg) v, options(nomem, nostack, preserves_flags)) };
    v
}

/// Switches to the address space rooted at physical `pml4`.
///
/// # Safety
/// `pml4` must be a valid PML4 that maps the running code, its stack, every static, the
/// IDT/GDT/TSS and the frame pool exactly as the current root does.
pub unsafe fn write_cr3(pml4: u64) {
    // SAFETY: the caller guarantees the new root maps everything the kernel touches.
    unsafe { asm!("mov cr3, {}", in(reg) pml4, options(nostack, preserves_flags)) };
}

/// Drops any TLB entry for `va`.
pub fn invlpg(va: u64) {
    // SAFETY: invalidating a TLB entry is always safe (it only forces a fresh walk).
    unsafe { asm!("invlpg [{}]", in(reg) va, options(nostack, preserves_flags)) };
}

/// CPUID leaf `leaf`, subleaf `sub`: `[eax, ebx, ecx, edx]`.
pub fn cpuid(leaf: u32, sub: u32) -> [u32; 4] {
    let (a, b, c, d): (u32, u64, u32, u32);
    // SAFETY: CPUID has no side effects; RBX (reserved by LLVM) is saved and restored.
    unsafe {
        asm!("mov {b}, rbx", "cpuid", "xchg {b}, rbx",
             b = out(reg) b, inout("eax") leaf => a, inout("ecx") sub => c, out("edx") d,
             options(nomem, nostack, preserves_flags))
    };
    [a, b as u32, c, d]
}

/// RFLAGS as `pushfq` sees it.
pub fn rflags() -> u64 {
    let v: u64;
    // SAFETY: pushfq/pop only touch the stack slot they use.
    unsafe { asm!("pushfq", "pop {}", out(reg) v, options(nomem, preserves_flags)) };
    v
}

/// `sti; hlt; cli`: sleeps until one interrupt has been handled, then masks again. The
/// STI interrupt shadow guarantees the interrupt is taken at the HLT, not before it.
pub fn sti_hlt_cli() {
    // SAFETY: the IDT is loaded and every unmasked interrupt source has a handler.
    unsafe { asm!("sti", "hlt", "cli", options(nomem, nostack)) };
}

/// Executes `swapgs` (exchanges GS base and KERNEL_GS_BASE).
pub fn swapgs() {
    // SAFETY: the kernel never uses GS-relative addressing except in `read_gs_qword0`.
    unsafe { asm!("swapgs", options(nomem, nostack, preserves_flags)) };
}

/// The qword at `fs:[0]`.
///
/// # Safety
/// FS base must point at a readable qword.
pub unsafe fn read_fs_qword0() -> u64 {
    let v: u64;
    // SAFETY: the caller guarantees FS base is a readable address.
    unsafe {
        asm!("mov {}, qword ptr fs:[0]", out(reg) v, options(readonly, nostack, preserves_flags))
    };
    v
}

/// The qword at `gs:[0]`.
///
/// # Safety
/// GS base must point at a readable qword.
pub unsafe fn read_gs_qword0() -> u64 {
    let v: u64;
    // SAFETY: the caller guarantees GS base is a readable address.
    unsafe {
        asm!("mov {}, qword ptr gs:[0]", out(reg) v, options(readonly, nostack, preserves_flags))
    };
    v
}

/// Stops this CPU for good (`cli; hlt` forever).
pub fn halt_forever() -> ! {
    loop {
        // SAFETY: halting with interrupts masked has no effect on memory.
        unsafe { asm!("cli", "hlt", options(nomem, nostack)) };
    }
}

/// Powers the VM off through the i8042 reset line; never returns.
pub fn poweroff() -> ! {
    outb(I8042_COMMAND, I8042_RESET);
    halt_forever()
}
