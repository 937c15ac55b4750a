//! The engine's virtual CPU emulates the sensitive instructions a guest kernel runs, and
//! what they read is what the same guest reads natively: port I/O of every size (also
//! through the gate to the VMM's devices), control and debug registers, MSRs, the local
//! APIC, `cpuid`, and the descriptor-table registers (`sgdt`/`lgdt`/`sidt`). Each guest
//! prints what it read over COM1; the console under `--tool null` must equal the native
//! one. (Segment loads: `engine_vcpu_segments.rs`; exceptions and interrupts:
//! `engine_vcpu_events.rs`.)

use iced_x86::code_asm::{
    al, ax, byte_ptr, cr0, cr4, dr0, dr6, dr7, dword_ptr, dx, eax, ebx, ecx, edx, qword_ptr, rax,
    rbx, rdi, rsi, rsp, xmm0, xmm1,
};
use kpin_tests::guest_asm::*;
use kpin_tests::{require_kvm, run_tiny_guest};
use vmm::Outcome;

#[test]
fn test_16_and_32_bit_port_io_reads_and_writes_like_natively() {
    require_kvm!();
    // Port 0xcf8 (the PCI address register: a dword write reads back, a word access
    // reads all ones). `in eax` zero-extends into RAX, `in ax` keeps RAX's upper bits.
    let mut g = Guest::new();
    g.a.mov(dx, 0xcf8).unwrap();
    g.a.mov(eax, 0x8000_0000u32).unwrap();
    g.a.out(dx, eax).unwrap();
    g.a.out(dx, ax).unwrap();
    g.a.mov(rax, 0x1234_5678_0000_0000u64).unwrap();
    g.a.in_(eax, dx).unwrap();
    for shift in [0, 16, 32, 48] {
        g.a.mov(rbx, rax).unwrap();
        g.a.shr(rax, shift).unwrap();
        g.hex();
        g.a.mov(rax, rbx).unwrap();
    }
    g.print(b' ');
    g.a.mov(rax, 0x1234_5678_0000_0000u64).unwrap();
    g.a.in_(ax, dx).unwrap();
    for shift in [0, 16, 32, 48] {
        g.a.mov(rbx, rax).unwrap();
        g.a.shr(rax, shift).unwrap();
        g.hex();
        g.a.mov(rax, rbx).unwrap();
    }
    g.reset();
    let console = same_as_native("engine-events-port", &g.finish());
    assert_eq!(
        console, "0000800000000000 ffff000056781234\n",
        "the native reference changed"
    );
}

#[test]
fn test_control_and_debug_registers_msrs_the_local_apic_and_string_self_patching_match_the_native_run(
) {
    require_kvm!();
    // What Linux's boot does to the virtual CPU before it reaches user space: CR0.AM/WP,
    // CR4.OSFXSR/OSXMMEXCPT (then SSE must run: the engine mirrors them into the real
    // CR4), debug registers, `smsw`, MSRs the virtual CPU
    // does not keep (read from KVM: MTRRcap; FEATURE_CONTROL is a #GP there too), the
    // local APIC's version register through its MMIO page (KVM's in-kernel APIC serves
    // the CPL-3 access under the engine), and a `rep movsb` that patches an instruction
    // in its own code page (`text_poke`'s `memcpy`).
    let mut g = Guest::new();
    let mut main = g.a.create_label();
    g.a.jmp(main).unwrap();
    let stubs = exception_handlers(&mut g, &[(6, false), (13, true)]);
    g.a.set_label(&mut main).unwrap();
    for (v, stub) in [6u64, 13].into_iter().zip(stubs) {
        g.gate(v, stub, 0, 0, false);
    }
    g.a.mov(rsp, KERNEL_STACK - 0x108).unwrap();
    // CR0.WP | CR0.AM.
    g.a.mov(rax, cr0).unwrap();
    g.a.or(rax, 0x5_0000).unwrap();
    g.a.mov(cr0, rax).unwrap();
    g.a.mov(rax, cr0).unwrap();
    g.a.shr(rax, 16).unwrap();
    g.hex();
    g.print(b' ');
    // CR4.OSFXSR | CR4.OSXMMEXCPT, then an SSE instruction.
    g.a.mov(rax, cr4).unwrap();
    g.a.or(rax, 0x600).unwrap();
    g.a.mov(cr4, rax).unwrap();
    g.a.movaps(xmm1, xmm0).unwrap();
    g.a.mov(rax, cr4).unwrap();
    g.hex();
    g.print(b' ');
    // (Setting CR4.OSXSAVE, which CPUID hides, is #GP(0) under the engine as the SDM
    // says; this KVM's ring-0 emulation accepts it, so it is not compared here.)
    g.print(b'a');
    // DR0 round trip, DR6 and DR7 at reset.
    g.a.mov(rax, 0x1234_u64).unwrap();
    g.a.mov(dr0, rax).unwrap();
    g.a.xor(eax, eax).unwrap();
    g.a.mov(rax, dr0).unwrap();
    g.hex();
    g.print(b' ');
    g.a.mov(rax, dr6).unwrap();
    g.hex();
    g.print(b' ');
    g.a.mov(rax, dr7).unwrap();
    g.hex();
    g.print(b' ');
    // smsw: CR0's low bits.
    g.a.smsw(eax).unwrap();
    g.hex();
    g.print(b' ');
    // MTRRcap (0xfe) from KVM.
    g.a.mov(ecx, 0xfe).unwrap();
    g.a.rdmsr().unwrap();
    g.hex();
    g.print(b' ');
    // FEATURE_CONTROL (0x3a): KVM has none for this vCPU, #GP(0).
    g.a.mov(ecx, 0x3a).unwrap();
    fault(&mut g, |a| a.rdmsr());
    g.print(b'b');
    // The local APIC's version register.
    g.a.mov(eax, dword_ptr(0xfee0_0030_u64)).unwrap();
    g.hex();
    g.print(b' ');
    // rep movsb patches the immediate of the `mov al, imm8` at `site` (same page).
    let mut site = g.a.create_label();
    g.a.mov(byte_ptr(0x20_0f40_u64), u32::from(b'P')).unwrap();
    g.a.mov(rsi, 0x20_0f40_u64).unwrap();
    g.a.lea(rdi, qword_ptr(site)).unwrap();
    g.a.inc(rdi).unwrap();
    g.a.mov(ecx, 1).unwrap();
    g.a.rep().movsb().unwrap();
    g.a.set_label(&mut site).unwrap();
    g.a.mov(al, u32::from(b'X')).unwrap();
    g.a.call(g.putc).unwrap();
    g.reset();
    let console = same_as_native("engine-vcpu-control", &g.finish());
    // CR0 bits 16-31 (PG, AM, WP), CR4's low bits (OSXMMEXCPT, OSFXSR, PAE).
    assert!(console.starts_with("8005 0620 "), "{console}");
    assert!(console.contains("a1234 0ff0 0400 0033 "), "{console}");
    assert!(console.ends_with("P\n"), "{console}");
}

/// Known difference (2026-11-22): natively, KVM here answers leaf 1 ECX 0xf7f81203 /
/// EDX 0x1f8bfbff (HT, SSE3…SSE4.2, POPCNT, XSAVE, AVX), leaf 7 EBX 0xf1bf2bfb and leaf
/// 0xd EBX 0x240, while the table the VMM builds from `KVM_GET_SUPPORTED_CPUID` (and
/// gives both KVM and the engine) says ECX 0x81200000 / EDX 0x0f8bfbff, EBX 0x01802852,
/// 0xa80: KVM's ring-0 emulation does not answer from the table it was given, so the two
/// runs see different CPUs (Linux prints `CPU0: Hyper-Threading is disabled` only
/// natively). Which CPU both should see is the VMM's decision; until then this test
/// documents the difference.
#[test]
#[ignore = "native CPUID differs from the VMM's table (see the comment)"]
fn test_cpuid_leaves_read_the_same_as_natively() {
    require_kvm!();
    // The engine answers CPUID from the table the VMM gives KVM; KVM adjusts some
    // leaves at run time (APIC and OSXSAVE bits, topology), which the guest must see
    // the same under the engine.
    let mut g = Guest::new();
    let leaves: &[(u32, u32)] = &[
        (0, 0),
        (1, 0),
        (4, 0),
        (6, 0),
        (7, 0),
        (0xb, 0),
        (0xb, 1),
        (0xd, 0),
        (0x1f, 0),
        (0x4000_0000, 0),
        (0x4000_0001, 0),
        (0x8000_0000, 0),
        (0x8000_0001, 0),
        (0x8000_0008, 0),
        (0x99, 0),
    ];
    for &(leaf, sub) in leaves {
        g.a.mov(eax, leaf).unwrap();
        g.a.mov(ecx, sub).unwrap();
        g.a.cpuid().unwrap();
        for r in [eax, ebx, ecx, edx] {
            g.a.push(rax).unwrap();
            g.a.mov(eax, r).unwrap();
            g.a.shr(eax, 16).unwrap();
            g.hex();
            g.a.pop(rax).unwrap();
            g.a.push(rax).unwrap();
            g.a.mov(eax, r).unwrap();
            g.hex();
            g.a.pop(rax).unwrap();
            g.print(b' ');
        }
        g.print(b'|');
    }
    g.reset();
    same_as_native("engine-cpuid", &g.finish());
}

#[test]
fn test_port_reads_through_the_gate_see_what_native_reads() {
    require_kvm!();
    // mov dx,0x3fd; in al,dx (COM1 line status); mov dx,0x3f8; out dx,al; mov al,10;
    // out dx,al; mov al,0xfe; out 0x64,al; hlt
    let code = [
        0x66, 0xba, 0xfd, 0x03, 0xec, 0x66, 0xba, 0xf8, 0x03, 0xee, 0xb0, 0x0a, 0xee, 0xb0, 0xfe,
        0xe6, 0x64, 0xf4,
    ];
    let (native, native_console, _, _) = run_tiny_guest("engine-run-in-native", &code, None);
    assert_eq!(native.outcome, Outcome::Poweroff);
    assert_eq!(native_console.len(), 2, "{native_console:?}");
    let (report, console, log, _) = run_tiny_guest("engine-run-in-null", &code, Some("null"));
    assert_eq!(report.outcome, Outcome::Poweroff, "{log}");
    assert_eq!(console, native_console, "{log}");
    // Two characters and the reset.
    assert!(log.contains("3 out, 1 in, 0 cpuid"), "{log}");
}

#[test]
fn test_descriptor_table_registers_are_virtual_and_read_back_like_natively() {
    require_kvm!();
    // sgdt [0x3000]; lgdt [0x3000]; sgdt [0x3010]; sidt [0x3020]; print the bytes at
    // 0x3010 (GDT limit), 0x3013 (GDT base bits 8-15), 0x3020 (IDT limit) and a newline;
    // mov al,0xfe; out 0x64,al; hlt
    let code = [
        0x0f, 0x01, 0x04, 0x25, 0x00, 0x30, 0x00, 0x00, 0x0f, 0x01, 0x14, 0x25, 0x00, 0x30, 0x00,
        0x00, 0x0f, 0x01, 0x04, 0x25, 0x10, 0x30, 0x00, 0x00, 0x0f, 0x01, 0x0c, 0x25, 0x20, 0x30,
        0x00, 0x00, 0x66, 0xba, 0xf8, 0x03, 0x8a, 0x04, 0x25, 0x10, 0x30, 0x00, 0x00, 0xee, 0x8a,
        0x04, 0x25, 0x13, 0x30, 0x00, 0x00, 0xee, 0x8a, 0x04, 0x25, 0x20, 0x30, 0x00, 0x00, 0xee,
        0xb0, 0x0a, 0xee, 0xb0, 0xfe, 0xe6, 0x64, 0xf4,
    ];
    let (native, native_console, _, _) = run_tiny_guest("engine-run-gdt-native", &code, None);
    assert_eq!(native.outcome, Outcome::Poweroff, "{:?}", native.dump);
    // The VMM's boot GDT: 0x500, limit 0x1f.
    assert!(
        native_console.starts_with("\u{1f}\u{5}"),
        "{native_console:?}"
    );
    let (report, console, log, _) = run_tiny_guest("engine-run-gdt-null", &code, Some("null"));
    assert_eq!(report.outcome, Outcome::Poweroff, "{log}");
    assert_eq!(console, native_console, "{log}");
}
