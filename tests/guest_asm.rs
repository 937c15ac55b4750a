//! Building blocks of the hand-assembled tiny guests (iced-x86's `CodeAssembler`): the
//! reset and hex-digit sequences every test guest uses, and [`Guest`], a guest with its
//! own GDT, TSS and IDT and print routines, for the engine's virtual-CPU tests; plus
//! [`same_as_native`], which runs a guest natively and under `--tool null` and compares.
//!
//! Guests are assembled at [`TINY_LOAD_ADDR`] and run by [`run_tiny_guest`]; they use the
//! VMM's boot identity map and write only at the addresses below (or their own).

use iced_x86::code_asm::{
    al, ax, bx, ds, dx, eax, ebx, ecx, es, qword_ptr, r15, rax, rbx, rcx, rdx, rsp, ss,
    CodeAssembler, CodeLabel,
};
use vmm::Outcome;

use crate::{run_tiny_guest, TINY_LOAD_ADDR};

/// `mov al, 0xfe; out 0x64, al; hlt`: the i8042 reset line, the tiny guests' poweroff.
pub fn reset(a: &mut CodeAssembler) {
    a.mov(al, 0xfe_u32).unwrap();
    a.out(0x64_u32, al).unwrap();
    a.hlt().unwrap();
}

/// Turns the nibble in AL (0-15) into its lower-case hex digit in AL.
pub fn hex_digit(a: &mut CodeAssembler) {
    let mut digit = a.create_label();
    a.cmp(al, 10).unwrap();
    a.jb(digit).unwrap();
    a.add(al, i32::from(b'a' - b'0' - 10)).unwrap();
    a.set_label(&mut digit).unwrap();
    a.add(al, i32::from(b'0')).unwrap();
}

/// Where [`Guest`] keeps the `lgdt` operand.
pub const GDTR: u64 = 0x20_0f00;
/// Where [`Guest`] keeps the `lidt` operand.
pub const IDTR: u64 = 0x20_0f10;
/// [`Guest`]'s GDT ([`gdt_entries`]).
pub const GDT: u64 = 0x20_1000;
/// [`Guest`]'s IDT ([`IDT_VECTORS`] 16-byte gates, filled by [`Guest::gate`]).
pub const IDT: u64 = 0x20_2000;
/// [`Guest`]'s TSS (RSP0 = [`KERNEL_STACK`], IST1 = [`IST1_STACK`]).
pub const TSS: u64 = 0x20_3000;
/// Page tables of the guests that build their own (PML4, PDPT, PD, PT).
pub const PML4: u64 = 0x21_0000;
/// [`Guest`]'s CPL-0 stack top (also the TSS's RSP0).
pub const KERNEL_STACK: u64 = 0x28_0000;
/// A CPL-3 stack top for guests that drop to user mode.
pub const USER_STACK: u64 = 0x29_0000;
/// The TSS's IST1 stack top.
pub const IST1_STACK: u64 = 0x2a_0000;
/// Vectors with an IDT entry.
pub const IDT_VECTORS: u64 = 48;

/// Kernel code selector in [`gdt_entries`].
pub const KERNEL_CS: u64 = 0x08;
/// Kernel data selector in [`gdt_entries`].
pub const KERNEL_DS: u64 = 0x10;
/// User data selector (RPL 3) in [`gdt_entries`].
pub const USER_DS: u64 = 0x18 | 3;
/// User code selector (RPL 3) in [`gdt_entries`] (the `sysret` order).
pub const USER_CS: u64 = 0x20 | 3;
/// TSS selector in [`gdt_entries`].
pub const TSS_SEL: u64 = 0x28;

/// `base`/`limit`/`type` into the low half of a 16-byte system descriptor (present).
pub fn system_low(base: u64, limit: u64, ty: u64) -> u64 {
    limit | (base & 0xff_ffff) << 16 | (0x80 | ty) << 40 | (base >> 24 & 0xff) << 56
}

/// null, 0x08 kernel code, 0x10 kernel data, 0x18 user data, 0x20 user code (the
/// `sysret` order), 0x28 TSS; then extra entries.
pub fn gdt_entries() -> Vec<u64> {
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
pub struct Guest {
    /// The assembler; emit the guest's own code through it.
    pub a: CodeAssembler,
    /// Prints the low 16 bits of RAX as 4 hex digits (all registers preserved).
    pub hex16: CodeLabel,
    /// Prints AL (RDX preserved).
    pub putc: CodeLabel,
}

impl Default for Guest {
    fn default() -> Self {
        Self::new()
    }
}

impl Guest {
    /// Stack, GDT (`lgdt`, `retfq` to 0x08, data segments 0x10), TSS (RSP0, IST1; `ltr`)
    /// and an empty IDT (`lidt`).
    pub fn new() -> Self {
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
    pub fn gate(&mut self, v: u64, target: CodeLabel, ist: u64, dpl: u64, trap: bool) {
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
    pub fn print(&mut self, c: u8) {
        self.a.mov(al, u32::from(c)).unwrap();
        self.a.call(self.putc).unwrap();
    }

    /// Prints RAX's low 16 bits in hex.
    pub fn hex(&mut self) {
        self.a.call(self.hex16).unwrap();
    }

    /// `out 0x64, 0xfe; hlt`.
    pub fn reset(&mut self) {
        self.print(b'\n');
        reset(&mut self.a);
    }

    /// The print routines, then the bytes.
    pub fn finish(mut self) -> Vec<u8> {
        let a = &mut self.a;
        let mut lp = a.create_label();
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
        hex_digit(a);
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

/// The common exception handler: prints `<vector>/<error>/<CS>/<frame RSP>/<handler
/// RSP>` (low 16 bits each) and a space, makes R15 the saved RIP (the resume point the
/// test chose) and `iretq`s. Stack on entry: vector, error code, the CPU's frame.
pub fn exception_handlers(g: &mut Guest, vectors: &[(u64, bool)]) -> Vec<CodeLabel> {
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
pub fn fault(
    g: &mut Guest,
    insn: impl FnOnce(&mut CodeAssembler) -> Result<(), iced_x86::IcedError>,
) {
    let mut resume = g.a.create_label();
    g.a.lea(r15, qword_ptr(resume)).unwrap();
    insn(&mut g.a).unwrap();
    g.a.set_label(&mut resume).unwrap();
    g.a.nop().unwrap();
}

/// Runs `code` natively and under `--tool null`; both must power off with the same
/// console, which is returned.
pub fn same_as_native(name: &str, code: &[u8]) -> String {
    native_and_null(name, code).0
}

/// Runs `code` natively and under `--tool null`; both must power off with the same
/// console. Returns that console and the engine's log.
pub fn native_and_null(name: &str, code: &[u8]) -> (String, String) {
    let (native, native_console, _, _) = run_tiny_guest(&format!("{name}-native"), code, None);
    assert_eq!(
        native.outcome,
        Outcome::Poweroff,
        "{name}: {:?}",
        native.dump
    );
    let (report, console, log, _) = run_tiny_guest(&format!("{name}-null"), code, Some("null"));
    assert_eq!(
        report.outcome,
        Outcome::Poweroff,
        "{name}: {log}\n{:?}",
        report.dump
    );
    assert_eq!(console, native_console, "{name}: {log}");
    (console, log)
}
