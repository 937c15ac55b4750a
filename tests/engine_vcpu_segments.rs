//! The engine's virtual CPU keeps the guest's segment state virtual: a hand-assembled
//! guest builds its own GDT, `lgdt`s it, far-returns (`retfq`, then a 32-bit `retf`) to
//! reload CS, loads DS/ES/SS/FS/GS, `ltr`s a TSS (busy-marked in its GDT, as hardware
//! does), `lldt`s an LDT, moves FS into GS through the stack (`push fs; pop gs`), reads
//! it all back (`mov ax, sreg`, `str`, `sldt`, `sgdt`, the descriptors' type bytes) and
//! prints it in hex over COM1 — under `--tool null` exactly as natively. (Loads that
//! fault are delivered to the guest: `engine_vcpu_events.rs`.)

use iced_x86::code_asm::{
    al, ax, byte_ptr, cs, ds, dword_ptr, dx, eax, es, fs, gs, ptr, rax, rsp, ss, CodeAssembler,
};
use iced_x86::IcedError;
use kpin_tests::guest_asm::{hex_digit, native_and_null, reset, system_low};
use kpin_tests::{require_kvm, TINY_LOAD_ADDR};

/// Emits one instruction.
type Emit = fn(&mut CodeAssembler) -> Result<(), IcedError>;

/// Where the guest builds its tables (identity-mapped RAM).
const GDT: u64 = 0x20_1000;
const GDTR: u64 = 0x20_0f00;
const SGDT_OUT: u64 = 0x20_0f10;
const TSS: u64 = 0x20_2000;
const LDT: u64 = 0x20_3000;
const STACK: u64 = 0x20_8000;

const CODE64: u64 = 0x00af_9a00_0000_ffff;
const DATA: u64 = 0x00cf_9200_0000_ffff;
const DATA_NOT_PRESENT: u64 = 0x00cf_1200_0000_ffff;

/// The GDT: null, 0x08 code64, 0x10 data, 0x18 data (not present), 0x20 TSS (16 bytes),
/// 0x30 LDT (16 bytes).
fn gdt_entries() -> Vec<u64> {
    vec![
        0,
        CODE64,
        DATA,
        DATA_NOT_PRESENT,
        system_low(TSS, 0x67, 9),
        0,
        system_low(LDT, 0xf, 2),
        0,
    ]
}

/// Stores the GDT and the `lgdt` operand, `lgdt`s it and sets a stack.
fn prologue(a: &mut CodeAssembler) {
    a.mov(rsp, STACK).unwrap();
    for (k, e) in gdt_entries().into_iter().enumerate() {
        a.mov(rax, e).unwrap();
        a.mov(ptr(GDT + 8 * k as u64), rax).unwrap();
    }
    a.mov(rax, (GDT << 16) | (8 * gdt_entries().len() as u64 - 1))
        .unwrap();
    a.mov(ptr(GDTR), rax).unwrap();
    a.mov(rax, GDT >> 48).unwrap();
    a.mov(ptr(GDTR + 8), rax).unwrap();
    a.lgdt(ptr(GDTR)).unwrap();
}

fn assemble(a: &mut CodeAssembler) -> Vec<u8> {
    a.assemble(TINY_LOAD_ADDR).unwrap()
}

/// The guest that loads everything and prints what it reads back.
fn segments_guest() -> Vec<u8> {
    let mut a = CodeAssembler::new(64).unwrap();
    let mut hex = a.create_label();
    let mut after_q = a.create_label();
    let mut after_d = a.create_label();
    prologue(&mut a);
    // retfq to 0x08.
    a.push(0x08).unwrap();
    a.lea(rax, ptr(after_q)).unwrap();
    a.push(rax).unwrap();
    a.db(&[0x48, 0xcb]).unwrap();
    a.set_label(&mut after_q).unwrap();
    a.nop().unwrap();
    // retf (32-bit operand size): EIP and CS as two dwords.
    a.lea(rax, ptr(after_d)).unwrap();
    a.sub(rsp, 8).unwrap();
    a.mov(dword_ptr(rsp), eax).unwrap();
    a.mov(dword_ptr(rsp + 4), 0x08).unwrap();
    a.db(&[0xcb]).unwrap();
    a.set_label(&mut after_d).unwrap();
    a.nop().unwrap();
    a.mov(ax, 0x10).unwrap();
    a.mov(ds, ax).unwrap();
    a.mov(es, ax).unwrap();
    a.mov(ss, ax).unwrap();
    a.mov(fs, ax).unwrap();
    a.mov(ax, 0x20).unwrap();
    a.ltr(ax).unwrap();
    a.mov(ax, 0x30).unwrap();
    a.lldt(ax).unwrap();
    a.push(fs).unwrap();
    a.pop(gs).unwrap();
    a.sgdt(ptr(SGDT_OUT)).unwrap();
    // Read back and print.
    let reads: [Emit; 8] = [
        |a| a.mov(ax, cs),
        |a| a.mov(ax, ds),
        |a| a.mov(ax, es),
        |a| a.mov(ax, ss),
        |a| a.mov(ax, fs),
        |a| a.mov(ax, gs),
        |a| a.str(ax),
        |a| a.sldt(ax),
    ];
    for read in reads {
        read(&mut a).unwrap();
        a.call(hex).unwrap();
    }
    // The type bytes: code (accessed), data (accessed), TSS (busy), and the `sgdt`
    // limit and base bits 8-15.
    for at in [
        GDT + 8 + 5,
        GDT + 16 + 5,
        GDT + 32 + 5,
        SGDT_OUT,
        SGDT_OUT + 3,
    ] {
        a.mov(al, byte_ptr(at)).unwrap();
        a.call(hex).unwrap();
    }
    a.mov(dx, 0x3f8).unwrap();
    a.mov(al, 10).unwrap();
    a.out(dx, al).unwrap();
    reset(&mut a);
    // hex: prints AL as two hex digits.
    a.set_label(&mut hex).unwrap();
    a.push(rax).unwrap();
    a.shr(al, 4).unwrap();
    nibble(&mut a);
    a.pop(rax).unwrap();
    a.and(al, 0xf).unwrap();
    nibble(&mut a);
    a.ret().unwrap();
    assemble(&mut a)
}

/// Prints the low nibble in AL (0-15) as a hex digit.
fn nibble(a: &mut CodeAssembler) {
    hex_digit(a);
    a.mov(dx, 0x3f8).unwrap();
    a.out(dx, al).unwrap();
}

#[test]
fn test_segment_loads_and_reads_under_the_engine_match_the_native_run() {
    require_kvm!();
    let code = segments_guest();
    let (console, _) = native_and_null("engine-seg", &code);
    // The low bytes of cs ds es ss fs gs tr ldtr; code 0x9b, data 0x93, TSS busy 0x8b; sgdt limit 0x3f,
    // base bits 8-15 0x10.
    assert_eq!(
        console, "08101010101020309b938b3f10\n",
        "the native reference changed"
    );
}
