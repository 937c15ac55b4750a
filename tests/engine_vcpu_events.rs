//! The engine's virtual CPU delivers events through the guest's own IDT: hand-assembled
//! guests install a GDT, a TSS and an IDT, raise exceptions, take PIT interrupts and
//! `hlt`, and cross between CPL 0 and 3 with `syscall`/`sysretq`; their handlers print
//! what the CPU gave them (vector, error code, CS, saved RSP, IF, the handler's RSP). Where
//! KVM can run the guest natively the engine's console must equal the native one; where
//! it cannot (`syscall` from CPL 3 triple-faults here) the test states the values.

use iced_x86::code_asm::{
    al, ax, byte_ptr, cr2, cr3, cs, ds, eax, ecx, edx, es, qword_ptr, r11, r14, rax, rbx, rcx, rdi,
    rdx, rsi, rsp, ss,
};
use kpin_tests::guest_asm::*;
use kpin_tests::{require_kvm, run_tiny_guest};
use vmm::Outcome;

/// Builds page tables at [`PML4`]: 0–64 MiB identity, user-accessible and writable, in
/// 2 MiB pages except the first 2 MiB (4 KiB pages; `unmapped` pages left out), and
/// loads them.
fn own_page_tables(g: &mut Guest, unmapped: &[u64]) {
    let a = &mut g.a;
    let (pdpt, pd, pt) = (PML4 + 0x1000, PML4 + 0x2000, PML4 + 0x3000);
    let mut lp = a.create_label();
    a.mov(rax, pdpt | 7).unwrap();
    a.mov(qword_ptr(PML4), rax).unwrap();
    a.mov(rax, pd | 7).unwrap();
    a.mov(qword_ptr(pdpt), rax).unwrap();
    a.mov(rax, pt | 7).unwrap();
    a.mov(qword_ptr(pd), rax).unwrap();
    // PD[1..32]: 2 MiB pages; PT[0..512]: 4 KiB pages.
    a.xor(ecx, ecx).unwrap();
    a.set_label(&mut lp).unwrap();
    a.mov(rax, rcx).unwrap();
    a.shl(rax, 12).unwrap();
    a.or(rax, 7).unwrap();
    a.mov(rdi, pt).unwrap();
    a.mov(qword_ptr(rdi + rcx * 8), rax).unwrap();
    a.mov(rax, rcx).unwrap();
    a.shl(rax, 21).unwrap();
    a.or(rax, 0x87).unwrap();
    a.cmp(ecx, 32).unwrap();
    let mut skip = a.create_label();
    a.jae(skip).unwrap();
    a.test(ecx, ecx).unwrap();
    a.jz(skip).unwrap();
    a.mov(rdi, pd).unwrap();
    a.mov(qword_ptr(rdi + rcx * 8), rax).unwrap();
    a.set_label(&mut skip).unwrap();
    a.inc(ecx).unwrap();
    a.cmp(ecx, 512).unwrap();
    a.jb(lp).unwrap();
    for &page in unmapped {
        a.mov(qword_ptr(pt + (page >> 12) * 8), 0).unwrap();
    }
    a.mov(rax, PML4).unwrap();
    a.mov(cr3, rax).unwrap();
}

#[test]
fn test_de_ud_gp_and_segment_faults_are_delivered_to_the_guest_handler_and_iretq_resumes() {
    require_kvm!();
    // (Only what KVM can run natively here: a non-present data segment in DS or a code
    // segment in SS ends a native run with an emulation failure; see the next test.)
    let mut g = Guest::new();
    let mut main = g.a.create_label();
    g.a.jmp(main).unwrap();
    let stubs = exception_handlers(&mut g, &[(0, false), (6, false), (11, true), (13, true)]);
    g.a.set_label(&mut main).unwrap();
    for (v, stub) in [0u64, 6, 11, 13].into_iter().zip(stubs) {
        g.gate(v, stub, 0, 0, false);
    }
    // Each fault with RSP 8 off 16-byte alignment (the frame is aligned down), then a
    // character after the `iretq` proves the resume point.
    g.a.mov(rsp, KERNEL_STACK - 0x108).unwrap();
    // #DE: div ecx (2 bytes).
    g.a.xor(ecx, ecx).unwrap();
    fault(&mut g, |a| a.div(ecx));
    g.print(b'a');
    // #UD.
    fault(&mut g, |a| a.ud2());
    g.print(b'b');
    // #GP(0): a non-canonical load.
    g.a.mov(rbx, 0x8000_0000_0000_0000u64).unwrap();
    fault(&mut g, |a| a.mov(rax, qword_ptr(rbx)));
    g.print(b'c');
    // #GP(0x40): a selector beyond the GDT limit.
    g.a.mov(ax, 0x40).unwrap();
    fault(&mut g, |a| a.mov(es, ax));
    g.print(b'd');
    g.reset();
    let console = same_as_native("engine-events-exc", &g.finish());
    // vector/error/CS/frame RSP/handler RSP: RSP 0x27fef8 is aligned down to 0x27fef0,
    // the frame is five or six words below it, the stub pushed two more.
    assert_eq!(
        console,
        "0000/0000/0008/fef8/feb8 a0006/0000/0008/fef8/feb8 b000d/0000/0008/fef8/feb8 c\
         000d/0040/0008/fef8/feb8 d\n",
        "the native reference changed"
    );
}

#[test]
fn test_faults_kvm_cannot_run_natively_and_int3_are_delivered_with_the_cpus_error_codes() {
    require_kvm!();
    let mut g = Guest::new();
    let mut main = g.a.create_label();
    g.a.jmp(main).unwrap();
    let stubs = exception_handlers(&mut g, &[(3, false), (11, true), (13, true)]);
    g.a.set_label(&mut main).unwrap();
    for (v, stub) in [3u64, 11, 13].into_iter().zip(stubs) {
        g.gate(v, stub, 0, 0, false);
    }
    g.a.mov(rsp, KERNEL_STACK - 0x108).unwrap();
    // #BP: a trap (the CPU's frame points after the `int3`, where the handler resumes).
    fault(&mut g, |a| a.int3());
    g.print(b'a');
    // #NP(0x38): a data descriptor that is not present.
    g.a.mov(ax, 0x38).unwrap();
    fault(&mut g, |a| a.mov(ds, ax));
    g.print(b'b');
    // #GP(0x8): a code segment in SS.
    g.a.mov(ax, 0x08).unwrap();
    fault(&mut g, |a| a.mov(ss, ax));
    g.print(b'c');
    // #GP(0x10): a data descriptor in TR.
    g.a.mov(ax, 0x10).unwrap();
    fault(&mut g, |a| a.ltr(ax));
    g.print(b'd');
    // #GP(0x8): a far return to RPL 3 through the DPL-0 code descriptor (the fault leaves
    // RSP 16 lower, as it was; the resume point drops the two words).
    g.a.mov(ax, 0x0b).unwrap();
    g.a.push(rax).unwrap();
    g.a.push(rax).unwrap();
    fault(&mut g, |a| a.db(&[0x48, 0xcb]));
    g.a.add(rsp, 16).unwrap();
    g.print(b'e');
    g.reset();
    let (report, console, log, _) =
        run_tiny_guest("engine-events-exc-engine", &g.finish(), Some("null"));
    assert_eq!(report.outcome, Outcome::Poweroff, "{log}");
    assert_eq!(
        console,
        "0003/0000/0008/fef8/feb8 a000b/0038/0008/fef8/feb8 b000d/0008/0008/fef8/feb8 c\
         000d/0010/0008/fef8/feb8 d000d/0008/0008/fee8/fea8 e\n",
        "{log}"
    );
}

#[test]
fn test_pit_interrupts_are_delivered_to_the_guest_handler_and_wake_hlt() {
    require_kvm!();
    let mut g = Guest::new();
    let mut main = g.a.create_label();
    let mut handler = g.a.create_label();
    let mut wait = g.a.create_label();
    g.a.jmp(main).unwrap();
    // IRQ 0 at vector 0x20: print 'T', the IF the frame saved and the IF inside (0:
    // an interrupt gate), count in R14, EOI, iretq.
    g.a.set_label(&mut handler).unwrap();
    g.a.push(rax).unwrap();
    g.print(b'T');
    g.a.mov(rax, qword_ptr(rsp + 24)).unwrap();
    g.a.shr(eax, 9).unwrap();
    g.a.and(eax, 1).unwrap();
    g.hex();
    g.a.pushfq().unwrap();
    g.a.pop(rax).unwrap();
    g.a.shr(eax, 9).unwrap();
    g.a.and(eax, 1).unwrap();
    g.hex();
    g.a.inc(r14).unwrap();
    g.a.mov(al, 0x20).unwrap();
    g.a.out(0x20_u32, al).unwrap();
    g.a.pop(rax).unwrap();
    g.a.iretq().unwrap();
    g.a.set_label(&mut main).unwrap();
    g.gate(0x20, handler, 0, 0, false);
    // PIC: vectors 0x20/0x28, only IRQ 0 unmasked; PIT channel 0 at ~100 Hz (each port
    // write of the handler is a ~45 us gate round trip plus the VMM exit under the engine:
    // at 1 kHz the next tick would already be pending at the handler's `iretq`).
    for (port, v) in [
        (0x20, 0x11),
        (0xa0, 0x11),
        (0x21, 0x20),
        (0xa1, 0x28),
        (0x21, 4),
        (0xa1, 2),
        (0x21, 1),
        (0xa1, 1),
        (0x21, 0xfe),
        (0xa1, 0xff),
        (0x43, 0x34),
        (0x40, 11932 & 0xff),
        (0x40, 11932 >> 8),
    ] as [(u32, u32); 13]
    {
        g.a.mov(al, v).unwrap();
        g.a.out(port, al).unwrap();
    }
    g.a.xor(r14, r14).unwrap();
    g.a.set_label(&mut wait).unwrap();
    g.a.sti().unwrap();
    g.a.hlt().unwrap();
    g.a.cli().unwrap();
    g.print(b'w');
    g.a.cmp(r14, 3).unwrap();
    g.a.jb(wait).unwrap();
    g.a.mov(al, 0xff).unwrap();
    g.a.out(0x21_u32, al).unwrap();
    g.a.mov(rax, r14).unwrap();
    g.hex();
    g.reset();
    let console = same_as_native("engine-events-irq", &g.finish());
    assert_eq!(
        console, "T00010000wT00010000wT00010000w0003\n",
        "the native reference changed"
    );
}

#[test]
fn test_syscall_and_sysretq_round_trip_between_cpl0_and_cpl3() {
    require_kvm!();
    let mut g = Guest::new();
    let mut main = g.a.create_label();
    let mut entry = g.a.create_label();
    let mut user = g.a.create_label();
    let mut after_syscall = g.a.create_label();
    let mut ud = g.a.create_label();
    g.a.jmp(main).unwrap();
    // LSTAR: prints 'S', CS, SS, IF (masked by SFMASK: 0), R11's IF (1) and RCX minus the
    // address after the `syscall` (0), then returns RDI + RSI with `sysretq`.
    g.a.set_label(&mut entry).unwrap();
    g.print(b'S');
    g.a.mov(ax, cs).unwrap();
    g.hex();
    g.a.mov(ax, ss).unwrap();
    g.hex();
    g.a.pushfq().unwrap();
    g.a.pop(rax).unwrap();
    g.a.shr(eax, 9).unwrap();
    g.a.and(eax, 1).unwrap();
    g.hex();
    g.a.mov(rax, r11).unwrap();
    g.a.shr(eax, 9).unwrap();
    g.a.and(eax, 1).unwrap();
    g.hex();
    g.a.lea(rdx, qword_ptr(after_syscall)).unwrap();
    g.a.mov(rax, rcx).unwrap();
    g.a.sub(rax, rdx).unwrap();
    g.hex();
    g.a.mov(rax, rdi).unwrap();
    g.a.add(rax, rsi).unwrap();
    g.a.sysretq().unwrap();
    // #UD (the user program's exit): prints 'U', the frame's CS, SS, IF and the user's RAX.
    g.a.set_label(&mut ud).unwrap();
    g.a.push(rax).unwrap();
    g.print(b'U');
    for off in [16, 40, 24] {
        g.a.mov(rax, qword_ptr(rsp + off)).unwrap();
        if off == 24 {
            g.a.shr(eax, 9).unwrap();
            g.a.and(eax, 1).unwrap();
        }
        g.hex();
    }
    g.a.pop(rax).unwrap();
    g.hex();
    g.reset();
    // CPL 3: one syscall, then the exit.
    g.a.set_label(&mut user).unwrap();
    g.a.mov(rdi, 0x1234u64).unwrap();
    g.a.mov(rsi, 0x1111u64).unwrap();
    g.a.syscall().unwrap();
    g.a.set_label(&mut after_syscall).unwrap();
    g.a.ud2().unwrap();
    g.a.set_label(&mut main).unwrap();
    g.gate(6, ud, 0, 0, false);
    own_page_tables(&mut g, &[]);
    // EFER.SCE, STAR (kernel 0x08, user base 0x10), LSTAR, SFMASK = IF.
    g.a.mov(ecx, 0xc000_0080u32).unwrap();
    g.a.rdmsr().unwrap();
    g.a.or(eax, 1).unwrap();
    g.a.wrmsr().unwrap();
    g.a.mov(ecx, 0xc000_0081u32).unwrap();
    g.a.xor(eax, eax).unwrap();
    g.a.mov(rdx, KERNEL_DS << 16 | KERNEL_CS).unwrap();
    g.a.wrmsr().unwrap();
    g.a.mov(ecx, 0xc000_0082u32).unwrap();
    g.a.lea(rax, qword_ptr(entry)).unwrap();
    g.a.xor(edx, edx).unwrap();
    g.a.wrmsr().unwrap();
    g.a.mov(ecx, 0xc000_0084u32).unwrap();
    g.a.mov(eax, 0x200).unwrap();
    g.a.xor(edx, edx).unwrap();
    g.a.wrmsr().unwrap();
    // To CPL 3 with sysretq (IF = 1 from R11).
    g.a.lea(rcx, qword_ptr(user)).unwrap();
    g.a.mov(r11, 0x202u64).unwrap();
    g.a.mov(rsp, USER_STACK).unwrap();
    g.a.sysretq().unwrap();
    let code = g.finish();
    let (report, console, log, _) = run_tiny_guest("engine-events-syscall", &code, Some("null"));
    assert_eq!(report.outcome, Outcome::Poweroff, "{log}");
    // Kernel: CS 0x08, SS 0x10, IF 0, R11.IF 1, RCX = after the syscall. User: CS 0x23,
    // SS 0x1b, IF 1, RAX = 0x1234 + 0x1111.
    assert_eq!(
        console,
        format!(
            "S{:04x}{:04x}000000010000U{USER_CS:04x}{USER_DS:04x}00012345\n",
            KERNEL_CS, KERNEL_DS
        ),
        "{log}"
    );
}

#[test]
fn test_a_delivery_whose_third_push_faults_is_rolled_back_and_becomes_a_double_fault() {
    require_kvm!();
    // The stack's top 16 bytes sit at the bottom of a mapped page above an unmapped one:
    // delivering #PF pushes SS and RSP, then faults on RFLAGS. The CPU then raises #DF
    // (a #PF during #PF delivery), on IST1; the handler prints the two stack words (still
    // the markers: the partial frame was rolled back), CR2 and the #DF error code.
    const HOLE: u64 = 0x1f_e000;
    let mut g = Guest::new();
    let mut main = g.a.create_label();
    let mut pf = g.a.create_label();
    let mut df = g.a.create_label();
    g.a.jmp(main).unwrap();
    g.a.set_label(&mut pf).unwrap();
    g.print(b'P');
    g.reset();
    g.a.set_label(&mut df).unwrap();
    g.print(b'D');
    for at in [HOLE + 0x1000, HOLE + 0x1008] {
        g.a.mov(rax, qword_ptr(at)).unwrap();
        g.hex();
    }
    g.a.mov(rax, cr2).unwrap();
    g.hex();
    g.a.mov(rax, qword_ptr(rsp)).unwrap();
    g.hex();
    g.reset();
    g.a.set_label(&mut main).unwrap();
    g.gate(14, pf, 0, 0, false);
    g.gate(8, df, 1, 0, false);
    own_page_tables(&mut g, &[HOLE]);
    g.a.mov(rax, 0x1111u64).unwrap();
    g.a.mov(qword_ptr(HOLE + 0x1000), rax).unwrap();
    g.a.mov(rax, 0x2222u64).unwrap();
    g.a.mov(qword_ptr(HOLE + 0x1008), rax).unwrap();
    g.a.mov(rsp, HOLE + 0x1010).unwrap();
    g.a.mov(byte_ptr(HOLE + 8), 1).unwrap();
    g.reset();
    let code = g.finish();
    let (report, console, log, _) = run_tiny_guest("engine-events-undo", &code, Some("null"));
    assert_eq!(report.outcome, Outcome::Poweroff, "{log}");
    // Markers intact, CR2 = the failed RFLAGS push (0x1feff8: low 16 bits eff8), #DF
    // error code 0.
    assert_eq!(console, "D11112222eff80000\n", "{log}");
    // For the record: natively this KVM (its ring-0 delivery is emulated) leaves the
    // partial frame (RSP and SS) on the stack and CR2 at the first fault.
    let (native, native_console, _, _) = run_tiny_guest("engine-events-undo-native", &code, None);
    println!(
        "native run of the same guest: {:?}, console {native_console:?}",
        native.outcome
    );
}
