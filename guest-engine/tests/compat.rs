//! 32-bit guest code (`Mode::compat`) translated into 64-bit code and run in the host
//! process: the stack forms (`push`/`pop` of registers, immediates and memory, `call`,
//! `ret`, `leave`), `loop` in ECX, `inc`/`dec`'s one-byte forms, 32-bit address
//! arithmetic (an operand that wraps at 4 GiB) and 32-bit indirect branches compute what a
//! CPU in compatibility mode computes (worked out by hand below), traces of one mode never
//! serve the other, and what has no translation (`pusha`) leaves as sensitive.

mod common;

use common::{HostMemory, HostPlatform, Region, Rig};
use guest_engine::{Config, Gpr, GuestVirt, Mode, NullTool, SensitiveKind, Stop};
use iced_x86::code_asm::*;

/// Where the 32-bit code, its data and its stack live (below 4 GiB, as in a 32-bit
/// process).
const BASE: u64 = 0x4000_0000;
/// An address below 4 GiB outside the guest's memory: jumping there ends a run.
const OUT: u64 = 0x1000;

fn asm32(f: impl FnOnce(&mut CodeAssembler)) -> Vec<u8> {
    let mut a = CodeAssembler::new(32).unwrap();
    f(&mut a);
    a.assemble(BASE).unwrap()
}

/// One test at a time owns the page at BASE.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

struct Guest {
    region: Region,
    _one: std::sync::MutexGuard<'static, ()>,
}

impl Guest {
    /// Code at BASE, a data page at BASE + 0x2000, the stack below BASE + 0x4000.
    fn new(code: &[u8]) -> Self {
        let one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        let region = Region::map(0x4000, BASE);
        assert_eq!(region.addr(), BASE, "the 32-bit guest's page below 4 GiB");
        region.slice()[..code.len()].copy_from_slice(code);
        Guest { region, _one: one }
    }

    fn memory(&self) -> HostMemory {
        HostMemory::new(vec![(BASE, BASE + 0x4000)])
    }

    fn run(&self, rig: &mut Rig, regs: &[(Gpr, u64)]) -> Stop {
        let r = rig.engine.regs_mut();
        r.gpr = [0; 16];
        r.set(Gpr::Rsp, BASE + 0x4000);
        r.rflags = 0x202;
        for &(g, v) in regs {
            r.set(g, v);
        }
        rig.engine.set_rip(GuestVirt(BASE));
        let mut mem = self.memory();
        rig.engine
            .run(&mut mem, &mut HostPlatform::default(), &mut NullTool)
    }

    fn dword(&self, at: u64) -> u32 {
        let off = (at - BASE) as usize;
        u32::from_le_bytes(self.region.slice()[off..off + 4].try_into().unwrap())
    }
}

#[test]
fn test_32_bit_stack_calls_loops_and_addresses_compute_as_in_compatibility_mode() {
    let code = asm32(|a| {
        let mut top = a.create_label();
        let mut f = a.create_label();
        let mut g = a.create_label();
        a.mov(ecx, 5).unwrap();
        a.xor(eax, eax).unwrap();
        a.set_label(&mut top).unwrap();
        a.push(ecx).unwrap();
        a.call(f).unwrap();
        a.pop(edx).unwrap();
        a.add(eax, edx).unwrap();
        a.loop_(top).unwrap();
        a.inc(eax).unwrap(); // 0x40: a REX prefix in 64-bit mode
        a.dec(ebx).unwrap();
        a.push(0x1234).unwrap();
        a.pop(esi).unwrap();
        a.mov(edi, (BASE + 0x2000) as u32).unwrap();
        a.mov(dword_ptr(edi), 7).unwrap();
        a.push(dword_ptr(edi)).unwrap();
        a.pop(dword_ptr(edi + 4)).unwrap();
        // [ebp - 0x2000 + 0x2008] with EBP = BASE + 0x2000 - 0x1_0000_0000 (mod 2^32):
        // the sum wraps to BASE + 0x2008 only in 32 bits.
        a.mov(ebp, (BASE as u32).wrapping_add(0x2000)).unwrap();
        a.mov(dword_ptr(ebp + 8), 0x55).unwrap();
        a.call(g).unwrap();
        // An absolute address and a 32-bit indirect jump through a register.
        a.mov(dword_ptr((BASE + 0x2010) as u32), OUT as u32)
            .unwrap();
        a.mov(edx, (BASE + 0x2010) as u32).unwrap();
        a.jmp(dword_ptr(edx)).unwrap();
        a.set_label(&mut f).unwrap();
        a.add(eax, dword_ptr(esp + 4)).unwrap();
        a.ret().unwrap();
        a.set_label(&mut g).unwrap();
        a.push(ebp).unwrap();
        a.mov(ebp, esp).unwrap();
        a.sub(esp, 16).unwrap();
        a.mov(dword_ptr(ebp - 4), 9).unwrap();
        a.leave().unwrap();
        a.ret_1(0).unwrap();
    });
    let guest = Guest::new(&code);
    let mut rig = Rig::new(Config {
        mode: Mode::USER.compat(),
        ..Config::default()
    });
    let stop = guest.run(&mut rig, &[(Gpr::Rbx, 0x10)]);
    assert_eq!(stop, Stop::FetchFault(GuestVirt(OUT)));
    let r = *rig.engine.regs();
    // Each iteration adds ECX twice (f reads the pushed copy, then the pop): 2·15 + 1.
    assert_eq!(r.get(Gpr::Rax), 31);
    assert_eq!(r.get(Gpr::Rcx), 0, "loop counted ECX down");
    assert_eq!(r.get(Gpr::Rbx), 0xf, "dec ebx");
    assert_eq!(r.get(Gpr::Rsi), 0x1234, "push imm; pop");
    assert_eq!(guest.dword(BASE + 0x2004), 7, "push [mem]; pop [mem]");
    assert_eq!(guest.dword(BASE + 0x2008), 0x55);
    assert_eq!(
        r.get(Gpr::Rbp),
        (BASE + 0x2000) & 0xffff_ffff,
        "leave restored EBP"
    );
    assert_eq!(
        r.get(Gpr::Rsp),
        BASE + 0x4000,
        "every push popped, 4 bytes at a time"
    );
}

#[test]
fn test_32_bit_code_without_a_translation_leaves_as_sensitive() {
    let code = asm32(|a| {
        a.mov(eax, 1).unwrap();
        a.pushad().unwrap();
    });
    let guest = Guest::new(&code);
    let mut rig = Rig::new(Config {
        mode: Mode::USER.compat(),
        ..Config::default()
    });
    match guest.run(&mut rig, &[]) {
        Stop::Sensitive(s) => {
            assert_eq!(s.pc, GuestVirt(BASE + 5));
            assert_eq!(s.kind, SensitiveKind::Other);
        }
        other => panic!("expected the pushad to leave, got {other:?}"),
    }
    assert_eq!(rig.engine.regs().get(Gpr::Rax), 1, "the mov before it ran");
}

#[test]
fn test_the_same_bytes_in_64_bit_mode_are_other_instructions() {
    // 0x40 0x90: `inc eax; nop` in 32-bit code, `rex nop` (xchg eax... a nop) in 64-bit.
    let code = [0x40, 0x90, 0xE9, 0, 0, 0, 0];
    let mut code = code.to_vec();
    // jmp rel32 to OUT from BASE + 2 (+5).
    let rel = (OUT as i64 - (BASE as i64 + 7)) as i32;
    code[3..7].copy_from_slice(&rel.to_le_bytes());
    let guest = Guest::new(&code);
    let mut rig = Rig::new(Config {
        mode: Mode::USER.compat(),
        ..Config::default()
    });
    assert_eq!(guest.run(&mut rig, &[]), Stop::FetchFault(GuestVirt(OUT)));
    assert_eq!(rig.engine.regs().get(Gpr::Rax), 1, "inc eax in 32-bit code");
    rig.engine.set_mode(Mode::USER).unwrap();
    let stop = guest.run(&mut rig, &[]);
    assert_eq!(
        rig.engine.regs().get(Gpr::Rax),
        0,
        "a REX-prefixed nop in 64-bit code"
    );
    assert!(matches!(stop, Stop::FetchFault(_)), "{stop:?}");
}

#[test]
fn test_a_gs_relative_offset_near_4_gib_wraps_as_in_compatibility_mode() {
    // i386 TLS: `mov eax, gs:[-0x10]` with the thread pointer in GS reads 16 bytes below
    // it; 64-bit addressing would add the zero-extended offset and land 4 GiB above.
    let code = asm32(|a| {
        a.mov(eax, dword_ptr(0xffff_fff0u32).gs()).unwrap();
        a.mov(dword_ptr(0xffff_fff4u32).gs(), ecx).unwrap();
        a.mov(edx, 0xffff_fff8u32).unwrap();
        a.push(dword_ptr(edx).gs()).unwrap();
        a.pop(ebx).unwrap();
        a.jmp(OUT).unwrap();
    });
    let guest = Guest::new(&code);
    let tp = BASE + 0x3000;
    guest.region.slice()[0x2ff0..0x2ff4].copy_from_slice(&0x1234_5678u32.to_le_bytes());
    guest.region.slice()[0x2ff8..0x2ffc].copy_from_slice(&0x0bad_cafeu32.to_le_bytes());
    let mut rig = Rig::new(Config {
        mode: Mode::USER.compat(),
        ..Config::default()
    });
    // SAFETY: this process does not use GS (glibc's x86-64 TLS is FS); restored below.
    unsafe { std::arch::asm!("wrgsbase {}", in(reg) tp) };
    let stop = guest.run(&mut rig, &[(Gpr::Rcx, 0x77)]);
    // SAFETY: as above.
    unsafe { std::arch::asm!("wrgsbase {}", in(reg) 0u64) };
    assert_eq!(stop, Stop::FetchFault(GuestVirt(OUT)));
    let r = rig.engine.regs();
    assert_eq!(r.get(Gpr::Rax), 0x1234_5678);
    assert_eq!(guest.dword(tp - 0xc), 0x77);
    assert_eq!(r.get(Gpr::Rbx), 0x0bad_cafe, "push gs:[edx]; pop");
    assert_eq!(r.get(Gpr::Rsp), BASE + 0x4000);
}
