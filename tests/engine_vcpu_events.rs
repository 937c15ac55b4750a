//! The engine's virtual CPU delivers events through the guest's own IDT: hand-assembled
//! guests install a GDT, a TSS and an IDT, raise exceptions, take PIT interrupts and
//! `hlt`, and cross between CPL 0 and 3 with `syscall`/`sysretq`; their handlers print
//! what the CPU gave them (vector, error code, CS, saved RSP, IF, the handler's RSP). Where
//! KVM can run the guest natively the engine's console must equal the native one; where
//! it cannot (`syscall` from CPL 3 triple-faults here) the test states the values.

use iced_x86::code_asm::{
    al, ax, bx, byte_ptr, cr0, cr2, cr3, cr4, cs, dr0, dr6, dr7, ds, dword_ptr, dx, eax, ebx, ecx,
    edx, es, qword_ptr, r11, r14, r15, rax, rbx, rcx, rdi, rdx, rsi, rsp, ss, xmm0, xmm1,
    CodeAssembler, CodeLabel,
};
use kpin_tests::{require_kvm, run_tiny_guest, TINY_LOAD_ADDR};
use vmm::Outcome;

const GDTR: u64 = 0x20_0f00;
const IDTR: u64 = 0x20_0f10;
const GDT: u64 = 0x20_1000;
const IDT: u64 = 0x20_2000;
const TSS: u64 = 0x20_3000;
/// Page tables of the guests that build their own (PML4, PDPT, PD, PT).
const PML4: u64 = 0x21_0000;
const KERNEL_STACK: u64 = 0x28_0000;
const USER_STACK: u64 = 0x29_0000;
const IST1_STACK: u64 = 0x2a_0000;
/// Vectors with an IDT entry.
const IDT_VECTORS: u64 = 48;

const KERNEL_CS: u64 = 0x08;
const KERNEL_DS: u64 = 0x10;
const USER_DS: u64 = 0x18 | 3;
const USER_CS: u64 = 0x20 | 3;
const TSS_SEL: u64 = 0x28;

/// `base`/`limit`/`type` into the low half of a 16-byte system descriptor (present).
fn system_low(base: u64, limit: u64, ty: u64) -> u64 {
    limit | (base & 0xff_ffff) << 16 | (0x80 | ty) << 40 | (base >> 24 & 0xff) << 56
}

/// null, 0x08 kernel code, 0x10 kernel data, 0x18 user data, 0x20 user code (the
/// `sysret` order), 0x28 TSS; then extra entries.
fn gdt_entries() -> Vec<u64> {
    vec![
        0,
        0x00af_9a00_0000_ffff,
        0x00cf_9200_0000_ffff,
        0x00cf_f200_0000_ffff,
        0x00af_fa00_0000_ffff,
        system_low(TSS, 0x67, 9),
        0,
        // 0x38: a data descriptor that is not present.
        0x00cf_1200_0000_ffff,
    ]
}

/// A guest under construction, with its print routines.
struct Guest {
    a: CodeAssembler,
    /// Prints the low 16 bits of RAX as 4 hex digits (all registers preserved).
    hex16: CodeLabel,
    /// Prints AL (RDX preserved).
    putc: CodeLabel,
}

impl Guest {
    /// Stack, GDT (`lgdt`, `retfq` to 0x08, data segments 0x10), TSS (RSP0, IST1; `ltr`)
    /// and an empty IDT (`lidt`).
    fn new() -> Self {
        let mut a = CodeAssembler::new(64).unwrap();
        let hex16 = a.create_label();
        let putc = a.create_label();
        let mut after = a.create_label();
        a.mov(rsp, KERNEL_STACK).unwrap();
        let gdt = gdt_entries();
        for (k, e) in gdt.iter().enumerate() {
            a.mov(rax, *e).unwrap();
            a.mov(qword_ptr(GDT + 8 * k as u64), rax).unwrap();
        }
        a.mov(rax, (GDT << 16) | (8 * gdt.len() as u64 - 1))
            .unwrap();
        a.mov(qword_ptr(GDTR), rax).unwrap();
        a.mov(qword_ptr(GDTR + 8), 0).unwrap();
        a.lgdt(qword_ptr(GDTR)).unwrap();
        a.push(KERNEL_CS as i32).unwrap();
        a.lea(rax, qword_ptr(after)).unwrap();
        a.push(rax).unwrap();
        a.db(&[0x48, 0xcb]).unwrap();
        a.set_label(&mut after).unwrap();
        a.nop().unwrap();
        a.mov(ax, KERNEL_DS as u32).unwrap();
        a.mov(ds, ax).unwrap();
        a.mov(es, ax).unwrap();
        a.mov(ss, ax).unwrap();
        a.mov(rax, KERNEL_STACK).unwrap();
        a.mov(qword_ptr(TSS + 4), rax).unwrap();
        a.mov(rax, IST1_STACK).unwrap();
        a.mov(qword_ptr(TSS + 0x24), rax).unwrap();
        a.mov(ax, TSS_SEL as u32).unwrap();
        a.ltr(ax).unwrap();
        a.mov(rax, (IDT << 16) | (16 * IDT_VECTORS - 1)).unwrap();
        a.mov(qword_ptr(IDTR), rax).unwrap();
        a.mov(qword_ptr(IDTR + 8), 0).unwrap();
        a.lidt(qword_ptr(IDTR)).unwrap();
        Self { a, hex16, putc }
    }

    /// IDT entry `v`: a 64-bit interrupt (`trap` false) or trap gate to `target` in
    /// kernel CS, with `ist` and `dpl`.
    fn gate(&mut self, v: u64, target: CodeLabel, ist: u64, dpl: u64, trap: bool) {
        let a = &mut self.a;
        let ty = if trap { 0xf } else { 0xe };
        a.lea(rax, qword_ptr(target)).unwrap();
        a.mov(rcx, rax).unwrap();
        a.and(eax, 0xffff).unwrap();
        a.shr(rcx, 16).unwrap();
        a.shl(rcx, 48).unwrap();
        a.or(rax, rcx).unwrap();
        a.mov(
            rcx,
            KERNEL_CS << 16 | ist << 32 | (0x80 | dpl << 5 | ty) << 40,
        )
        .unwrap();
        a.or(rax, rcx).unwrap();
        a.mov(qword_ptr(IDT + 16 * v), rax).unwrap();
        a.mov(qword_ptr(IDT + 16 * v + 8), 0).unwrap();
    }

    /// Prints the byte `c`.
    fn print(&mut self, c: u8) {
        self.a.mov(al, u32::from(c)).unwrap();
        self.a.call(self.putc).unwrap();
    }

    /// Prints RAX's low 16 bits in hex.
    fn hex(&mut self) {
        self.a.call(self.hex16).unwrap();
    }

    /// `out 0x64, 0xfe; hlt`.
    fn reset(&mut self) {
        self.print(b'\n');
        self.a.mov(al, 0xfe_u32).unwrap();
        self.a.out(0x64_u32, al).unwrap();
        self.a.hlt().unwrap();
    }

    /// The print routines, then the bytes.
    fn finish(mut self) -> Vec<u8> {
        let a = &mut self.a;
        let mut lp = a.create_label();
        let mut digit = a.create_label();
        a.set_label(&mut self.hex16).unwrap();
        a.push(rax).unwrap();
        a.push(rbx).unwrap();
        a.push(rcx).unwrap();
        a.mov(rbx, rax).unwrap();
        a.mov(ecx, 4).unwrap();
        a.set_label(&mut lp).unwrap();
        a.rol(bx, 4).unwrap();
        a.mov(eax, ebx).unwrap();
        a.and(al, 0xf).unwrap();
        a.cmp(al, 10).unwrap();
        a.jb(digit).unwrap();
        a.add(al, i32::from(b'a' - b'0' - 10)).unwrap();
        a.set_label(&mut digit).unwrap();
        a.add(al, i32::from(b'0')).unwrap();
        a.call(self.putc).unwrap();
        a.dec(ecx).unwrap();
        a.jnz(lp).unwrap();
        a.pop(rcx).unwrap();
        a.pop(rbx).unwrap();
        a.pop(rax).unwrap();
        a.ret().unwrap();
        a.set_label(&mut self.putc).unwrap();
        a.push(rdx).unwrap();
        a.mov(dx, 0x3f8).unwrap();
        a.out(dx, al).unwrap();
        a.pop(rdx).unwrap();
        a.ret().unwrap();
        a.assemble(TINY_LOAD_ADDR).unwrap()
    }
}

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

/// Runs `code` natively and under `--tool null`; both must power off with the same
/// console, which is returned.
fn same_as_native(name: &str, code: &[u8]) -> String {
    let (native, native_console, _, _) = run_tiny_guest(&format!("{name}-native"), code, None);
    assert_eq!(
        native.outcome,
        Outcome::Poweroff,
        "{name}: {:?}",
        native.dump
    );
    let (report, console, log, _) = run_tiny_guest(&format!("{name}-null"), code, Some("null"));
    assert_eq!(report.outcome, Outcome::Poweroff, "{name}: {log}");
    assert_eq!(console, native_console, "{name}: {log}");
    console
}

/// The common exception handler: prints `<vector>/<error>/<CS>/<frame RSP>/<handler
/// RSP>` (low 16 bits each) and a space, makes R15 the saved RIP (the resume point the
/// test chose) and `iretq`s. Stack on entry: vector, error code, the CPU's frame.
fn exception_handlers(g: &mut Guest, vectors: &[(u64, bool)]) -> Vec<CodeLabel> {
    let mut common = g.a.create_label();
    let mut stubs = Vec::new();
    for &(v, has_error) in vectors {
        let mut l = g.a.create_label();
        g.a.set_label(&mut l).unwrap();
        if !has_error {
            g.a.push(0).unwrap();
        }
        g.a.push(v as i32).unwrap();
        g.a.jmp(common).unwrap();
        stubs.push(l);
    }
    g.a.set_label(&mut common).unwrap();
    for off in [0, 8, 24, 40] {
        g.a.mov(rax, qword_ptr(rsp + off)).unwrap();
        g.hex();
        g.print(b'/');
    }
    g.a.mov(rax, rsp).unwrap();
    g.hex();
    g.print(b' ');
    g.a.mov(qword_ptr(rsp + 16), r15).unwrap();
    g.a.add(rsp, 16).unwrap();
    g.a.iretq().unwrap();
    stubs
}

/// Emits the faulting instruction with R15 = the address after it (the handler resumes
/// there).
fn fault(g: &mut Guest, insn: impl FnOnce(&mut CodeAssembler) -> Result<(), iced_x86::IcedError>) {
    let mut resume = g.a.create_label();
    g.a.lea(r15, qword_ptr(resume)).unwrap();
    insn(&mut g.a).unwrap();
    g.a.set_label(&mut resume).unwrap();
    g.a.nop().unwrap();
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

#[test]
fn test_16_and_32_bit_port_io_reads_and_writes_like_natively() {
    require_kvm!();
    // Port 0xcf8 (PCI configuration, absent: reads all ones, writes ignored). `in eax`
    // zero-extends into RAX, `in ax` keeps RAX's upper bits.
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
        console, "ffffffff00000000 ffff000056781234\n",
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
