//! Steps that need no memory-management or interrupt setup of their own: `boot`, `cpuid`,
//! `flags`, `loop`, `msr`.

use core::arch::asm;
use core::hint::black_box;
use core::ptr::addr_of;

use crate::bootinfo::ram_covers_kernel;
use crate::console::{newline, print, print_dec, print_hex, print_ok, put_byte};
use crate::cpu::{
    cpuid, rdmsr, read_cr3, read_fs_qword0, read_gs_qword0, swapgs, wrmsr, MSR_FS_BASE,
    MSR_GS_BASE, MSR_KERNEL_GS_BASE, MSR_LSTAR, MSR_SFMASK, MSR_STAR, RFLAGS_IF,
};
use crate::layout::{FRAME_POOL_END, IMAGE_BASE};
use crate::{paging, pic};

/// Step `boot`: what the kernel set up before the first step.
pub fn boot() {
    print("e820 ram covers ");
    print_hex(IMAGE_BASE);
    print("-");
    print_hex(FRAME_POOL_END);
    print(if ram_covers_kernel() { " yes" } else { " NO" });
    print(", own gdt+tss+idt loaded, own page tables cr3 ");
    print_ok(read_cr3() == paging::kernel_root());
    print(", pic at 0x20/0x28 imr=");
    print_hex(u64::from(pic::master_imr()));
    print("/");
    print_hex(u64::from(pic::slave_imr()));
    newline();
}

/// CPUID leaf 1 EDX feature bits printed by step `cpuid`.
const LEAF1_EDX_BITS: [(&str, u32); 5] =
    [("fpu", 0), ("tsc", 4), ("msr", 5), ("pae", 6), ("apic", 9)];
/// CPUID leaf 0x8000_0001 EDX feature bits printed by step `cpuid`.
const EXT1_EDX_BITS: [(&str, u32); 3] = [("syscall", 11), ("nx", 20), ("lm", 29)];

fn print_bits(edx: u32, bits: &[(&str, u32)]) {
    for &(name, bit) in bits {
        print(" ");
        print(name);
        print(if edx & (1 << bit) != 0 { "=1" } else { "=0" });
    }
}

/// Step `cpuid`: vendor, max basic leaf, and a few stable feature bits.
pub fn cpuid_step() {
    let [max_basic, ebx, ecx, edx] = cpuid(0, 0);
    print("vendor=");
    for reg in [ebx, edx, ecx] {
        for b in reg.to_le_bytes() {
            put_byte(if b.is_ascii_graphic() { b } else { b'?' });
        }
    }
    print(" max-basic-leaf=");
    print_hex(u64::from(max_basic));
    print_bits(cpuid(1, 0)[3], &LEAF1_EDX_BITS);
    let max_ext = cpuid(0x8000_0000, 0)[0];
    let ext1_edx = if max_ext >= 0x8000_0001 {
        cpuid(0x8000_0001, 0)[3]
    } else {
        0
    };
    print_bits(ext1_edx, &EXT1_EDX_BITS);
    newline();
}

fn print_if(rflags: u64) {
    print(if rflags & RFLAGS_IF != 0 {
        "if=1"
    } else {
        "if=0"
    });
}

/// Step `flags`: IF as `pushfq` sees it after `cli`, after `sti`, and after `popfq` of each
/// saved value. All IRQs are masked at the PIC, so `sti` lets nothing in.
pub fn flags() {
    let (after_cli, after_sti, popf_cleared, popf_set): (u64, u64, u64, u64);
    // SAFETY: only RFLAGS.IF changes (every PIC input is masked, so no interrupt arrives), and
    // the sequence ends with interrupts off again; the pushes and pops are balanced.
    unsafe {
        asm!(
            "cli",
            "pushfq",
            "pop {a}",
            "sti",
            "pushfq",
            "pop {b}",
            "push {a}",
            "popfq",
            "pushfq",
            "pop {c}",
            "push {b}",
            "popfq",
            "pushfq",
            "pop {d}",
            "cli",
            a = out(reg) after_cli,
            b = out(reg) after_sti,
            c = out(reg) popf_cleared,
            d = out(reg) popf_set,
        )
    };
    print("cli ");
    print_if(after_cli);
    print(", sti ");
    print_if(after_sti);
    print(", popf(saved after cli) ");
    print_if(popf_cleared);
    print(", popf(saved after sti) ");
    print_if(popf_set);
    newline();
}

/// Seed of [`known_loop_1000`] in step `loop`.
const LOOP_SEED: u64 = 0x1234;

/// Step `loop`'s function. The bbcount tool test looks this symbol up by name
/// (`known_loop_1000`) and checks that its loop body (`2:` .. `jnz 2b`, one basic block)
/// executes exactly 1000 times per call; it is written in assembly so the compiler cannot
/// unroll or fold it. Body: `acc = (acc * 31 + i) ^ 0x55` for i = 1000 down to 1.
/// Returns (acc, iterations counted inside the loop).
#[no_mangle]
#[inline(never)]
pub fn known_loop_1000(seed: u64) -> (u64, u64) {
    let mut acc = seed;
    let iterations: u64;
    // SAFETY: pure register arithmetic.
    unsafe {
        asm!(
            "mov ecx, 1000",
            "xor {n:e}, {n:e}",
            "2:",
            "imul {acc}, {acc}, 31",
            "add {acc}, rcx",
            "xor {acc}, 0x55",
            "inc {n}",
            "dec ecx",
            "jnz 2b",
            acc = inout(reg) acc,
            n = out(reg) iterations,
            out("ecx") _,
            options(nomem, nostack),
        )
    };
    (acc, iterations)
}

/// Step `loop`.
pub fn known_loop() {
    let (result, iterations) = known_loop_1000(black_box(LOOP_SEED));
    print("known_loop_1000(");
    print_hex(LOOP_SEED);
    print(") iterations=");
    print_dec(iterations);
    print(" result=");
    print_hex(result);
    newline();
}

/// Values step `msr` writes and reads back (all canonical where the MSR requires it).
const MSR_VALUES: [(&str, u32, u64); 6] = [
    ("fs_base", MSR_FS_BASE, 0x0000_1111_2222_3000),
    ("gs_base", MSR_GS_BASE, 0x0000_4444_5555_6000),
    ("kernel_gs_base", MSR_KERNEL_GS_BASE, 0xffff_8888_9999_a000),
    ("lstar", MSR_LSTAR, 0xffff_ffff_8123_4560),
    ("star", MSR_STAR, 0x0018_0008_0000_0000),
    ("sfmask", MSR_SFMASK, 0x0004_7700),
];

/// What `fs:[0]` must read in step `msr`.
static FS_PROBE: u64 = 0xf5f5_0000_0000_0001;
/// What `gs:[0]` reads with GS base = this probe.
static GS_PROBE_A: u64 = 0x6565_0000_0000_000a;
/// What `gs:[0]` reads after `swapgs` (KERNEL_GS_BASE = this probe).
static GS_PROBE_B: u64 = 0x6565_0000_0000_000b;

/// Step `msr`: write/read back six MSRs, then show FS/GS bases take effect and that
/// `swapgs` exchanges GS base and KERNEL_GS_BASE (and a second `swapgs` restores them).
pub fn msrs_and_swapgs() {
    for &(name, msr, value) in &MSR_VALUES {
        // SAFETY: no FS/GS-relative access and no SYSCALL happens until step `msr` and step
        // `syscall` set these MSRs to the values they need.
        unsafe { wrmsr(msr, value) };
        print(name);
        print("=");
        print_hex(rdmsr(msr));
        print(" ");
    }
    let fs_probe = addr_of!(FS_PROBE) as u64;
    let (gs_a, gs_b) = (addr_of!(GS_PROBE_A) as u64, addr_of!(GS_PROBE_B) as u64);
    // SAFETY: as above; the bases point at readable statics.
    unsafe {
        wrmsr(MSR_FS_BASE, fs_probe);
        wrmsr(MSR_GS_BASE, gs_a);
        wrmsr(MSR_KERNEL_GS_BASE, gs_b);
    }
    // SAFETY: FS/GS bases were just set to readable statics.
    let (fs0, gs0) = unsafe { (read_fs_qword0(), read_gs_qword0()) };
    print("fs:[0]=");
    print_hex(fs0);
    print(" gs:[0]=");
    print_hex(gs0);
    swapgs();
    // SAFETY: `swapgs` made GS base = GS_PROBE_B's address, also readable.
    let gs_swapped = unsafe { read_gs_qword0() };
    let exchanged = rdmsr(MSR_GS_BASE) == gs_b && rdmsr(MSR_KERNEL_GS_BASE) == gs_a;
    print(" swapgs gs:[0]=");
    print_hex(gs_swapped);
    print(" bases-exchanged ");
    print_ok(exchanged);
    swapgs();
    // SAFETY: GS base is GS_PROBE_A's address again.
    let gs_back = unsafe { read_gs_qword0() };
    let restored = rdmsr(MSR_GS_BASE) == gs_a && rdmsr(MSR_KERNEL_GS_BASE) == gs_b;
    print(" swapgs gs:[0]=");
    print_hex(gs_back);
    print(" bases-restored ");
    print_ok(restored);
    // SAFETY: nothing uses FS/GS bases after this step.
    unsafe {
        wrmsr(MSR_FS_BASE, 0);
        wrmsr(MSR_GS_BASE, 0);
        wrmsr(MSR_KERNEL_GS_BASE, 0);
    }
    newline();
}
