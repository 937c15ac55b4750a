//! The engine runs guest code through the shadow MMU: hand-assembled tiny guests that
//! build their own page tables (4 KiB pages, a high-half mapping), switch CR3 and read,
//! write and remap (`invlpg`) through them; that patch their own code (from another page
//! and from the same page) and run the new code; that touch an unmapped or read-only
//! page; and that need more shadow tables than the engine has — each under `--tool null`
//! exactly as natively: the same console output, the same accessed/dirty bits in their
//! page tables, and a fault delivered to the guest's #PF handler with the error code and
//! CR2 it sees natively; a guest that maps PML4 slots 256–257 itself reads and writes its
//! pages there. What the engine cannot do (a guest mapping the stolen region, a non-`mov` store
//! into the storing instruction's own code frame) ends the run naming why, never a hang.

use iced_x86::code_asm::{
    al, byte_ptr, cr0, cr2, cr3, dword_ptr, dx, eax, ecx, edi, ptr, qword_ptr, r10, r11, r8, r8d,
    r9, rax, rbp, rbx, rcx, rdi, rsi, rsp, word_ptr, CodeAssembler, CodeLabel,
};
use kpin_tests::guest_asm::{hex_digit, native_and_null, reset};
use kpin_tests::{require_kvm, run_tiny_guest, TINY_LOAD_ADDR};
use vmm::Outcome;

/// The guest's own page tables (identity-mapped RAM below 2 MiB, above the tiny guest).
const PML4: u64 = 0x18_0000;
const PDPT_LOW: u64 = 0x18_1000;
const PD_LOW: u64 = 0x18_2000;
const PT_LOW: u64 = 0x18_3000;
const PDPT_HIGH: u64 = 0x18_4000;
const PD_HIGH: u64 = 0x18_5000;
const PT_HIGH: u64 = 0x18_6000;
/// Frames the high-half mapping points at.
const FRAME_A: u64 = 0x19_0000;
const FRAME_B: u64 = 0x19_1000;
/// The high-half VA (PML4 slot 511, PDPT 510): FRAME_A writable; +0x1000: FRAME_A
/// read-only.
const HIGH_VA: u64 = 0xffff_ffff_8000_0000;
/// Where the fault-reporting guests put their IDT and stack.
const IDT: u64 = 0x3000;
const IDTR: u64 = 0x2f00;
const STACK: u64 = 0x8ff0;
/// The VMM's boot code selector.
const BOOT_CS: u64 = 0x10;

/// `print_hex`: prints R8 as 16 hex digits and a newline on COM1 (clobbers RAX, RCX, RDX,
/// R8).
fn emit_print_hex(a: &mut CodeAssembler, label: &mut CodeLabel) {
    let mut next = a.create_label();
    a.set_label(label).unwrap();
    a.mov(dx, 0x3f8_u32).unwrap();
    a.mov(ecx, 16_u32).unwrap();
    a.set_label(&mut next).unwrap();
    a.rol(r8, 4_u32).unwrap();
    a.mov(eax, r8d).unwrap();
    a.and(eax, 0xf_u32).unwrap();
    hex_digit(a);
    a.out(dx, al).unwrap();
    a.dec(ecx).unwrap();
    a.jnz(next).unwrap();
    a.mov(al, 10_u32).unwrap();
    a.out(dx, al).unwrap();
    a.ret().unwrap();
}

/// Prints the qword at `addr` (through the current page tables).
fn print_qword_at(a: &mut CodeAssembler, print: CodeLabel, addr: u64) {
    a.mov(rax, addr).unwrap();
    a.mov(r8, qword_ptr(rax)).unwrap();
    a.call(print).unwrap();
}

fn store_qword(a: &mut CodeAssembler, addr: u64, value: u64) {
    a.mov(rax, value).unwrap();
    a.mov(rdi, addr).unwrap();
    a.mov(qword_ptr(rdi), rax).unwrap();
}

/// Sets up the stack, zeroes the guest's seven tables and maps 0–2 MiB identically with
/// 4 KiB pages (PML4 slot 0 still to be linked by the caller).
fn identity_map_low_2mib(a: &mut CodeAssembler) {
    let mut fill = a.create_label();
    a.mov(rsp, STACK).unwrap();
    a.mov(rdi, PML4).unwrap();
    a.xor(eax, eax).unwrap();
    a.mov(ecx, (7 * 512) as u32).unwrap();
    a.rep().stosq().unwrap();
    a.mov(rdi, PT_LOW).unwrap();
    a.mov(eax, 3_u32).unwrap();
    a.mov(ecx, 512_u32).unwrap();
    a.set_label(&mut fill).unwrap();
    a.mov(qword_ptr(rdi), rax).unwrap();
    a.add(rax, 0x1000_i32).unwrap();
    a.add(rdi, 8_i32).unwrap();
    a.dec(ecx).unwrap();
    a.jnz(fill).unwrap();
    store_qword(a, PD_LOW, PT_LOW | 3);
    store_qword(a, PDPT_LOW, PD_LOW | 3);
}

/// Builds the guest's tables (0–2 MiB identity with 4 KiB pages; `HIGH_VA` → FRAME_A
/// writable, `HIGH_VA + 0x1000` → FRAME_A read-only) and loads CR3 with them.
fn build_tables_and_switch(a: &mut CodeAssembler) {
    identity_map_low_2mib(a);
    store_qword(a, PML4, PDPT_LOW | 3);
    store_qword(a, PML4 + 511 * 8, PDPT_HIGH | 3);
    store_qword(a, PDPT_HIGH + 510 * 8, PD_HIGH | 3);
    store_qword(a, PD_HIGH, PT_HIGH | 3);
    store_qword(a, PT_HIGH, FRAME_A | 3);
    store_qword(a, PT_HIGH + 8, FRAME_A | 1);
    a.mov(rax, PML4).unwrap();
    a.mov(cr3, rax).unwrap();
}

/// The page-table guest: switches to its own tables, writes through the high-half VA,
/// reads back through the read-only alias, prints CR3 and its table entries (with the
/// A/D bits the accesses set), then remaps the page to FRAME_B with `invlpg` and reads.
fn page_table_guest() -> Vec<u8> {
    let mut a = CodeAssembler::new(64).unwrap();
    let mut print = a.create_label();
    store_qword(&mut a, FRAME_B, 0x5555_6666_7777_8888);
    build_tables_and_switch(&mut a);
    a.mov(rbx, HIGH_VA).unwrap();
    a.mov(rax, 0x1122_3344_5566_7788_u64).unwrap();
    a.mov(qword_ptr(rbx), rax).unwrap();
    a.mov(r8, qword_ptr(rbx + 0x1000)).unwrap();
    a.call(print).unwrap();
    a.mov(r8, cr3).unwrap();
    a.call(print).unwrap();
    for entry in [
        PML4 + 511 * 8,
        PDPT_HIGH + 510 * 8,
        PD_HIGH,
        PT_HIGH,
        PT_HIGH + 8,
    ] {
        print_qword_at(&mut a, print, entry);
    }
    store_qword(&mut a, PT_HIGH, FRAME_B | 3);
    a.mov(rbx, HIGH_VA).unwrap();
    a.invlpg(ptr(rbx)).unwrap();
    a.mov(r8, qword_ptr(rbx)).unwrap();
    a.call(print).unwrap();
    reset(&mut a);
    emit_print_hex(&mut a, &mut print);
    a.assemble(TINY_LOAD_ADDR).unwrap()
}

#[test]
fn test_guest_page_tables_cr3_write_and_invlpg_behave_as_natively() {
    require_kvm!();
    let code = page_table_guest();
    let (native, native_console, _, _) = run_tiny_guest("shadow-pt-native", &code, None);
    assert_eq!(native.outcome, Outcome::Poweroff, "{:?}", native.dump);
    let want = "1122334455667788\n0000000000180000\n";
    assert!(native_console.starts_with(want), "{native_console}");
    assert!(
        native_console.ends_with("5555666677778888\n"),
        "{native_console}"
    );
    let (report, console, log, dir) = run_tiny_guest("shadow-pt-null", &code, Some("null"));
    assert_eq!(
        report.outcome,
        Outcome::Poweroff,
        "{log}\n{:?}",
        report.dump
    );
    assert_eq!(console, native_console, "{log}");
    let shadow = log
        .lines()
        .find(|l| l.contains("engine: shadow: "))
        .unwrap_or_else(|| panic!("no shadow stats line: {log}"));
    assert!(shadow.contains(" guest_cr3_writes=1 "), "{shadow}");
    assert!(shadow.contains(" guest_invlpgs=1"), "{shadow}");
    // The same counters in counters.json.
    let text = std::fs::read_to_string(dir.join("counters.json")).unwrap_or_default();
    let c: serde_json::Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("counters.json: {e}\n{text}"));
    for (name, want) in [("guest_cr3_writes", 1), ("guest_invlpgs", 1)] {
        let got = c
            .pointer(&format!("/shadow/{name}"))
            .and_then(|v| v.as_u64());
        assert_eq!(got, Some(want), "{name} in {text}");
    }
    assert!(
        c.pointer("/shadow/fills").and_then(|v| v.as_u64()) > Some(0),
        "{text}"
    );
    // Every #PF's address came from its instruction or from CR2; this guest's (plain
    // 64-bit loads and stores into pages the shadow did not map yet) from the instruction.
    let count = |name: &str| {
        c.pointer(&format!("/shadow/{name}"))
            .and_then(|v| v.as_u64())
            .unwrap_or_else(|| panic!("no {name} in {text}"))
    };
    let (faults, derived) = (count("page_faults"), count("fault_addresses_derived"));
    assert_eq!(derived + count("fault_addresses_read"), faults, "{text}");
    assert!(derived > 0, "{text}");
    println!("native:\n{native_console}{shadow}");
}

/// The code a guest patches: `patchme: mov eax, 0x11111111; ret` (the immediate at +1).
fn emit_patchme(a: &mut CodeAssembler) {
    a.mov(eax, 0x1111_1111_u32).unwrap();
    a.ret().unwrap();
}

/// A self-modifying guest: calls `patchme` at `patch_at`, prints EAX, stores 0x22222222
/// over its immediate, calls it again and prints EAX. `same_page`: `patchme` follows
/// the code on its page; else it starts the next page.
fn smc_guest(same_page: bool) -> (Vec<u8>, u64) {
    let mut a = CodeAssembler::new(64).unwrap();
    let mut print = a.create_label();
    let mut patchme = a.create_label();
    let far = TINY_LOAD_ADDR + 0x1000;
    a.mov(rsp, STACK).unwrap();
    let call = |a: &mut CodeAssembler| {
        if same_page {
            a.call(patchme).unwrap();
        } else {
            a.call(far).unwrap();
        }
    };
    call(&mut a);
    a.mov(r8, rax).unwrap();
    a.call(print).unwrap();
    // (A label operand cannot take a displacement in code_asm: address it through RDI.)
    if same_page {
        a.lea(rdi, ptr(patchme)).unwrap();
    } else {
        a.mov(rdi, far).unwrap();
    }
    a.mov(dword_ptr(rdi + 1), 0x2222_2222_u32).unwrap();
    call(&mut a);
    a.mov(r8, rax).unwrap();
    a.call(print).unwrap();
    reset(&mut a);
    emit_print_hex(&mut a, &mut print);
    a.set_label(&mut patchme).unwrap();
    emit_patchme(&mut a);
    let mut code = a.assemble(TINY_LOAD_ADDR).unwrap();
    if !same_page {
        assert!(code.len() < 0x1000);
        code.resize(0x1000, 0xcc);
        let mut b = CodeAssembler::new(64).unwrap();
        emit_patchme(&mut b);
        code.extend(b.assemble(far).unwrap());
    }
    (code, far)
}

fn smc_run(name: &str, same_page: bool) -> String {
    let (code, _) = smc_guest(same_page);
    let (console, log) = native_and_null(name, &code);
    assert_eq!(console, "0000000011111111\n0000000022222222\n", "{console}");
    log.lines()
        .find(|l| l.contains("engine: shadow: "))
        .unwrap_or_else(|| panic!("no shadow stats line: {log}"))
        .to_string()
}

#[test]
fn test_self_modifying_code_on_another_page_runs_the_new_code_after_one_invalidation() {
    require_kvm!();
    let shadow = smc_run("shadow-smc-far", false);
    assert!(shadow.contains(" write_protect_faults=1 "), "{shadow}");
    assert!(shadow.contains(" code_writes=1 "), "{shadow}");
    assert!(shadow.contains(" emulated_stores=0 "), "{shadow}");
    assert!(!shadow.contains(" fragments_invalidated=0 "), "{shadow}");
    println!("{shadow}");
}

#[test]
fn test_self_modifying_code_on_the_storing_page_emulates_the_store_once() {
    require_kvm!();
    let shadow = smc_run("shadow-smc-near", true);
    assert!(shadow.contains(" write_protect_faults=1 "), "{shadow}");
    assert!(shadow.contains(" code_writes=1 "), "{shadow}");
    assert!(shadow.contains(" emulated_stores=1 "), "{shadow}");
    println!("{shadow}");
}

/// A guest with a #PF handler (IDT vector 14) that prints the error code and CR2 and
/// resets, running `body` (which faults) after `lidt`.
fn fault_guest(body: fn(&mut CodeAssembler)) -> Vec<u8> {
    let mut a = CodeAssembler::new(64).unwrap();
    let mut print = a.create_label();
    let mut handler = a.create_label();
    a.mov(rsp, STACK).unwrap();
    // IDT entry 14: a 64-bit interrupt gate to `handler`, filled in at run time (the
    // handler's address is known only after assembly: lea + shifts).
    a.lea(rax, ptr(handler)).unwrap();
    a.mov(rcx, rax).unwrap();
    a.and(ecx, 0xffff_u32).unwrap();
    a.mov(rdi, BOOT_CS << 16 | 0x8e00 << 32).unwrap();
    a.or(rcx, rdi).unwrap();
    a.mov(rdi, rax).unwrap();
    a.shr(rdi, 16_u32).unwrap();
    a.and(edi, 0xffff_u32).unwrap();
    a.shl(rdi, 48_u32).unwrap();
    a.or(rcx, rdi).unwrap();
    a.mov(qword_ptr(IDT + 14 * 16), rcx).unwrap();
    a.shr(rax, 32_u32).unwrap();
    a.mov(qword_ptr(IDT + 14 * 16 + 8), rax).unwrap();
    a.mov(rax, (IDT << 16) | (15 * 16 - 1)).unwrap();
    a.mov(qword_ptr(IDTR), rax).unwrap();
    a.lidt(ptr(IDTR)).unwrap();
    body(&mut a);
    a.hlt().unwrap();
    a.set_label(&mut handler).unwrap();
    a.pop(r8).unwrap();
    a.call(print).unwrap();
    a.mov(r8, cr2).unwrap();
    a.call(print).unwrap();
    reset(&mut a);
    emit_print_hex(&mut a, &mut print);
    a.assemble(TINY_LOAD_ADDR).unwrap()
}

/// Runs `code` natively and under the engine: the shadow MMU reflects the guest fault
/// and the virtual CPU delivers it to the guest's handler, which prints the error code
/// and CR2 — the same two lines as natively. Returns the console.
fn fault_run(name: &str, code: &[u8]) -> String {
    let (console, log) = native_and_null(name, code);
    assert_eq!(console.lines().count(), 2, "{console}");
    assert!(log.contains(" guest_faults_reflected=1 "), "{log}");
    console
}

#[test]
fn test_write_to_an_unmapped_page_delivers_the_native_error_code_and_cr2() {
    require_kvm!();
    // 4 GiB: beyond the VMM's boot identity map of 0–4 GiB.
    let code = fault_guest(|a| {
        a.mov(rax, 0x1_0000_0000_u64).unwrap();
        a.mov(qword_ptr(rax), rcx).unwrap();
    });
    let console = fault_run("shadow-pf-unmapped", &code);
    assert_eq!(console, "0000000000000002\n0000000100000000\n");
}

#[test]
fn test_write_to_a_read_only_page_with_cr0_wp_delivers_the_native_error_code_and_cr2() {
    require_kvm!();
    let code = fault_guest(|a| {
        build_tables_and_switch(a);
        a.mov(rax, cr0).unwrap();
        a.or(eax, 1_u32 << 16).unwrap();
        a.mov(cr0, rax).unwrap();
        a.mov(rbx, HIGH_VA + 0x1000).unwrap();
        a.mov(qword_ptr(rbx), rcx).unwrap();
    });
    let console = fault_run("shadow-pf-readonly", &code);
    assert_eq!(console, "0000000000000003\nffffffff80001000\n");
}

#[test]
fn test_jump_to_an_unmapped_page_delivers_the_native_error_code_and_cr2() {
    require_kvm!();
    let code = fault_guest(|a| {
        a.mov(rax, 0x1_0000_0000_u64).unwrap();
        a.jmp(rax).unwrap();
    });
    let console = fault_run("shadow-pf-fetch", &code);
    // No EFER.NXE: a fetch fault has no I/D bit.
    assert_eq!(console, "0000000000000000\n0000000100000000\n");
}

/// Issue #11: guest kernel code touching the engine window (slot 257), the physmap
/// (258) or the slot-259 guard gets the #PF its own page tables call for — they map
/// none of it — exactly as natively, never the engine's memory and never an engine
/// failure (the translator's isolation check traps, the engine walks the guest's tables).
#[test]
fn test_guest_accesses_to_the_engine_window_physmap_and_guard_fault_as_natively() {
    require_kvm!();
    let load_window = fault_guest(|a| {
        a.mov(rbx, kpin_abi::stolen::WINDOW_VA).unwrap();
        a.mov(rax, qword_ptr(rbx + 0x40)).unwrap();
    });
    let console = fault_run("isolation-window-load", &load_window);
    assert_eq!(console, "0000000000000000\nffff808000000040\n");
    let store_physmap = fault_guest(|a| {
        a.mov(rbx, kpin_abi::stolen::PHYSMAP_VA).unwrap();
        a.mov(rcx, 0x200_u64).unwrap();
        a.mov(qword_ptr(rbx + rcx * 8), rcx).unwrap();
    });
    let console = fault_run("isolation-physmap-store", &store_physmap);
    assert_eq!(console, "0000000000000002\nffff810000001000\n");
    let load_guard = fault_guest(|a| {
        a.mov(rax, qword_ptr(0xffff_8180_0000_0008_u64)).unwrap();
    });
    let console = fault_run("isolation-guard-load", &load_guard);
    assert_eq!(console, "0000000000000000\nffff818000000008\n");
}

/// Issue #11: a guest kernel that maps pages of its own in PML4 slots 256 and 257 (where
/// the engine keeps its guard and its window) reads and writes them with plain `mov`s:
/// under the engine the accesses reach the guest's frame (the isolation check traps,
/// the engine performs them on the frame the guest's tables name), with the same
/// console output — values and the A/D bits the accesses set — as natively.
fn own_zone_mapping_guest() -> Vec<u8> {
    const SLOT_256: u64 = 0xffff_8000_0000_0000;
    let window = kpin_abi::stolen::WINDOW_VA;
    let mut a = CodeAssembler::new(64).unwrap();
    let mut print = a.create_label();
    build_tables_and_switch(&mut a);
    // Slots 256 and 257 → PDPT_HIGH[0] → PD_HIGH → PT_HIGH: +0 FRAME_A writable,
    // +0x1000 FRAME_A read-only (as at HIGH_VA).
    store_qword(&mut a, PDPT_HIGH, PD_HIGH | 3);
    store_qword(&mut a, PML4 + 256 * 8, PDPT_HIGH | 3);
    store_qword(&mut a, PML4 + 257 * 8, PDPT_HIGH | 3);
    a.mov(rax, cr3).unwrap();
    a.mov(cr3, rax).unwrap();
    store_qword(&mut a, HIGH_VA, 0x1122_3344_5566_7788);
    // Loads through slot 256 (the read-only alias) and the window.
    a.mov(rbx, SLOT_256 + 0x1000).unwrap();
    a.mov(r8, qword_ptr(rbx)).unwrap();
    a.call(print).unwrap();
    a.mov(rbx, window).unwrap();
    a.mov(r8, 0x7777_u64).unwrap();
    a.mov(r8d, dword_ptr(rbx + 4)).unwrap();
    a.call(print).unwrap();
    a.movzx(r8, word_ptr(rbx + 2)).unwrap();
    a.call(print).unwrap();
    a.movsx(r8, byte_ptr(rbx)).unwrap();
    a.call(print).unwrap();
    // Stores through the window (register) and slot 256 (immediate), read back through
    // the ordinary mapping.
    a.mov(rax, 0xaabb_ccdd_eeff_0011_u64).unwrap();
    a.mov(qword_ptr(rbx + 8), rax).unwrap();
    a.mov(rcx, SLOT_256).unwrap();
    a.mov(qword_ptr(rcx + 0x10), -2_i32).unwrap();
    print_qword_at(&mut a, print, HIGH_VA + 8);
    print_qword_at(&mut a, print, HIGH_VA + 0x10);
    // Other instructions there (run on a copy of the operand): ALU read-modify-write,
    // a locked exchange, a bit set, a page-crossing load (the writable page then its
    // read-only alias), a multiply from memory.
    a.mov(rbx, window).unwrap();
    a.mov(rcx, SLOT_256).unwrap();
    a.add(qword_ptr(rbx + 8), 5_i32).unwrap();
    a.mov(rax, 3_u64).unwrap();
    a.lock().xadd(qword_ptr(rcx + 0x10), rax).unwrap();
    a.mov(r8, rax).unwrap();
    a.call(print).unwrap();
    a.bts(qword_ptr(rbx + 0x18), 63_i32).unwrap();
    a.mov(r8, qword_ptr(rbx + 0xffc)).unwrap();
    a.call(print).unwrap();
    a.imul_3(r8, qword_ptr(rbx + 8), 3_i32).unwrap();
    a.call(print).unwrap();
    for at in [8, 0x10, 0x18] {
        print_qword_at(&mut a, print, HIGH_VA + at);
    }
    // String instructions and the stack there (emulated through the guest's tables):
    // `rep stosq` into the window, `rep movsb` from the read-only alias in slot 256 into
    // the window, then push/pop/call/ret with RSP in the window.
    a.cld().unwrap();
    a.mov(rdi, window + 0x100).unwrap();
    a.mov(rax, 0x0102_0304_0506_0708_u64).unwrap();
    a.mov(ecx, 4_u32).unwrap();
    a.rep().stosq().unwrap();
    a.mov(rsi, SLOT_256 + 0x1100).unwrap();
    a.mov(rdi, window + 0x200).unwrap();
    a.mov(ecx, 3_u32).unwrap();
    a.rep().movsb().unwrap();
    let mut sub = a.create_label();
    let mut over = a.create_label();
    a.mov(r9, rsp).unwrap();
    a.mov(rsp, window + 0x800).unwrap();
    a.push(0x1234_i32).unwrap();
    a.push(rax).unwrap();
    a.pop(r10).unwrap();
    a.pop(r11).unwrap();
    a.call(sub).unwrap();
    a.jmp(over).unwrap();
    a.set_label(&mut sub).unwrap();
    a.ret().unwrap();
    a.set_label(&mut over).unwrap();
    a.mov(rsp, r9).unwrap();
    for r in [r10, r11] {
        a.mov(r8, r).unwrap();
        a.call(print).unwrap();
    }
    for at in [0x118, 0x200, 0x7f0] {
        print_qword_at(&mut a, print, HIGH_VA + at);
    }
    // A call through a function pointer kept there, `lodsq` and `leave` there, and code
    // that runs from there (`mov eax, 0x4242; ret` written through the ordinary mapping).
    let mut sub2 = a.create_label();
    let mut over2 = a.create_label();
    a.lea(rax, ptr(sub2)).unwrap();
    a.mov(rdi, HIGH_VA + 0x300).unwrap();
    a.mov(qword_ptr(rdi), rax).unwrap();
    a.mov(rbx, window).unwrap();
    a.call(qword_ptr(rbx + 0x300)).unwrap();
    a.jmp(over2).unwrap();
    a.set_label(&mut sub2).unwrap();
    a.mov(r10, 0x5151_u64).unwrap();
    a.ret().unwrap();
    a.set_label(&mut over2).unwrap();
    a.mov(r8, r10).unwrap();
    a.call(print).unwrap();
    a.mov(rsi, window + 0x100).unwrap();
    a.lodsq().unwrap();
    a.mov(r8, rax).unwrap();
    a.call(print).unwrap();
    store_qword(&mut a, HIGH_VA + 0x880, 0x7777);
    a.mov(r9, rsp).unwrap();
    a.mov(r11, rbp).unwrap();
    a.mov(rbp, window + 0x880).unwrap();
    a.leave().unwrap();
    a.mov(r8, rbp).unwrap();
    a.mov(r10, rsp).unwrap();
    a.mov(rsp, r9).unwrap();
    a.mov(rbp, r11).unwrap();
    a.call(print).unwrap();
    a.mov(r8, r10).unwrap();
    a.call(print).unwrap();
    // push qword [rdi] with RDI outside the zone and the stack in it, then pop there;
    // xlat through the window.
    a.mov(r9, rsp).unwrap();
    a.mov(rsp, window + 0x900).unwrap();
    a.mov(rdi, HIGH_VA).unwrap();
    a.push(qword_ptr(rdi)).unwrap();
    a.pop(r10).unwrap();
    a.mov(rsp, r9).unwrap();
    a.mov(r8, r10).unwrap();
    a.call(print).unwrap();
    a.mov(rbx, window).unwrap();
    a.mov(eax, 5_u32).unwrap();
    a.xlatb().unwrap();
    a.mov(r8, rax).unwrap();
    a.call(print).unwrap();
    // repe cmpsb between the window and the ordinary mapping of the same frame (equal all
    // the way: RCX 0), repne scasb for 0x05 among 08 07 06 05 there (RCX 16 - 4).
    a.cld().unwrap();
    a.mov(rsi, window + 0x100).unwrap();
    a.mov(rdi, HIGH_VA + 0x100).unwrap();
    a.mov(ecx, 32_u32).unwrap();
    a.repe().cmpsb().unwrap();
    a.mov(r8, rcx).unwrap();
    a.call(print).unwrap();
    a.mov(rdi, window + 0x100).unwrap();
    a.mov(eax, 5_u32).unwrap();
    a.mov(ecx, 16_u32).unwrap();
    a.repne().scasb().unwrap();
    a.mov(r8, rcx).unwrap();
    a.call(print).unwrap();
    store_qword(&mut a, HIGH_VA + 0x500, 0x0000_c300_0042_42b8);
    a.mov(rax, window + 0x500).unwrap();
    a.call(rax).unwrap();
    a.mov(r8, rax).unwrap();
    a.call(print).unwrap();
    for entry in [PML4 + 256 * 8, PML4 + 257 * 8, PT_HIGH, PT_HIGH + 8] {
        print_qword_at(&mut a, print, entry);
    }
    reset(&mut a);
    emit_print_hex(&mut a, &mut print);
    a.assemble(TINY_LOAD_ADDR).unwrap()
}

#[test]
fn test_guest_mapping_slots_256_and_257_itself_reads_and_writes_its_own_pages() {
    require_kvm!();
    let code = own_zone_mapping_guest();
    let (console, log) = native_and_null("isolation-own-zone", &code);
    let want = "1122334455667788\n0000000011223344\n0000000000005566\nffffffffffffff88\naabbccddeeff0011\nfffffffffffffffe\n";
    assert!(console.starts_with(want), "{console}");
    let lines: Vec<&str> = console.lines().collect();
    assert_eq!(lines[6], "fffffffffffffffe", "xadd's old value");
    assert!(
        lines[7].starts_with("55667788"),
        "page-crossing load: {}",
        lines[7]
    );
    assert_eq!(lines[8], "00336699ccfd0042", "imul from the zone");
    assert_eq!(&lines[9..11], ["aabbccddeeff0016", "0000000000000001"]);
    assert!(lines[11].starts_with('8'), "bts set bit 63: {}", lines[11]);
    assert_eq!(
        &lines[12..17],
        [
            "0102030405060708",
            "0000000000001234",
            "0102030405060708",
            "0000000000060708",
            "0102030405060708"
        ],
        "pushed and popped, stored with rep stosq, copied with rep movsb, the stack slot"
    );
    let leave_rsp = format!("{:016x}", kpin_abi::stolen::WINDOW_VA + 0x888);
    assert_eq!(
        &lines[17..26],
        [
            "0000000000005151",
            "0102030405060708",
            "0000000000007777",
            leave_rsp.as_str(),
            "1122334455667788",
            "0000000000000033",
            "0000000000000000",
            "000000000000000c",
            "0000000000004242"
        ],
        "call through a pointer there, lodsq, leave, push [mem] and pop with the stack \
         there, xlat, repe cmpsb, repne scasb, code run from there"
    );
    let shadow = log
        .lines()
        .find(|l| l.contains("engine: shadow: "))
        .unwrap_or_else(|| panic!("no shadow stats line: {log}"));
    assert!(shadow.contains(" zone_emulations=27"), "{shadow}");
    println!("{console}{shadow}");
}

/// A guest whose tables alias one frame at the start of 2560 distinct 2 MiB regions
/// (five 1 GiB entries → one page directory → one page table → the frame) and adds 1
/// through each: the shadow needs a table per region, more than the engine's 2048.
fn many_regions_guest() -> Vec<u8> {
    const REGIONS_VA: u64 = 0x80_0000_0000;
    let mut a = CodeAssembler::new(64).unwrap();
    let mut print = a.create_label();
    let mut touch = a.create_label();
    identity_map_low_2mib(&mut a);
    store_qword(&mut a, PML4, PDPT_LOW | 3);
    store_qword(&mut a, PML4 + 8, PDPT_HIGH | 3);
    for g in 0..5 {
        store_qword(&mut a, PDPT_HIGH + g * 8, PD_HIGH | 3);
    }
    // Every PD entry → the same page table (RAX = PT_HIGH | 3 from the last store).
    let mut pd = a.create_label();
    a.mov(rax, PT_HIGH | 3).unwrap();
    a.mov(rdi, PD_HIGH).unwrap();
    a.mov(ecx, 512_u32).unwrap();
    a.set_label(&mut pd).unwrap();
    a.mov(qword_ptr(rdi), rax).unwrap();
    a.add(rdi, 8_i32).unwrap();
    a.dec(ecx).unwrap();
    a.jnz(pd).unwrap();
    store_qword(&mut a, PT_HIGH, FRAME_A | 3);
    store_qword(&mut a, FRAME_A, 0);
    a.mov(rax, PML4).unwrap();
    a.mov(cr3, rax).unwrap();
    a.mov(rbx, REGIONS_VA).unwrap();
    a.mov(ecx, 5 * 512_u32).unwrap();
    a.set_label(&mut touch).unwrap();
    a.add(qword_ptr(rbx), 1_i32).unwrap();
    a.add(rbx, 0x20_0000_i32).unwrap();
    a.dec(ecx).unwrap();
    a.jnz(touch).unwrap();
    print_qword_at(&mut a, print, REGIONS_VA);
    reset(&mut a);
    emit_print_hex(&mut a, &mut print);
    a.assemble(TINY_LOAD_ADDR).unwrap()
}

#[test]
fn test_running_out_of_shadow_tables_drops_the_shadow_and_carries_on() {
    require_kvm!();
    let code = many_regions_guest();
    let (native, native_console, _, _) = run_tiny_guest("shadow-reclaim-native", &code, None);
    assert_eq!(native.outcome, Outcome::Poweroff, "{:?}", native.dump);
    assert_eq!(native_console, "0000000000000a00\n");
    let (report, console, log, _) = run_tiny_guest("shadow-reclaim-null", &code, Some("null"));
    assert_eq!(
        report.outcome,
        Outcome::Poweroff,
        "{log}\n{:?}",
        report.dump
    );
    assert_eq!(console, native_console, "{log}");
    let shadow = log
        .lines()
        .find(|l| l.contains("engine: shadow: "))
        .unwrap_or_else(|| panic!("no shadow stats line: {log}"));
    assert!(!shadow.contains(" table_reclaims=0 "), "{shadow}");
    println!("{shadow}");
}

/// Runs `code` under `--tool null` and returns the engine log, asserting an engine
/// failure (exit status 3 for `kpin run`) with a dump.
fn engine_failure(name: &str, code: &[u8]) -> String {
    let (report, _, log, _) = run_tiny_guest(name, code, Some("null"));
    assert_eq!(report.outcome, Outcome::EngineFailure, "{log}");
    assert!(report.dump.is_some());
    assert!(log.contains("engine: stats: "), "{log}");
    assert!(!log.contains("panic"), "{log}");
    log
}

#[test]
fn test_guest_mapping_the_stolen_region_ends_the_run_naming_the_shadow_failure() {
    require_kvm!();
    // The guest maps the stolen region's first 2 MiB (at its identity address, through a
    // page directory of its own) and reads it: the shadow MMU refuses the frame.
    let stolen = vmm::memory::stolen_base(64 << 20);
    let extra_pd = 0xf000;
    let mut a = CodeAssembler::new(64).unwrap();
    store_qword(&mut a, extra_pd, stolen | 0x83);
    store_qword(
        &mut a,
        vmm::layout::BOOT_PDPT_START + (stolen >> 30) * 8,
        extra_pd | 3,
    );
    a.mov(rax, cr3).unwrap();
    a.mov(cr3, rax).unwrap();
    a.mov(rax, stolen).unwrap();
    a.mov(rax, qword_ptr(rax)).unwrap();
    reset(&mut a);
    let code = a.assemble(TINY_LOAD_ADDR).unwrap();
    let log = engine_failure("shadow-stolen", &code);
    // The load is the instruction before the reset's 5 bytes.
    let load_at = TINY_LOAD_ADDR + code.len() as u64 - 5 - 3;
    let want = format!(
        "engine: shadow MMU failure at guest RIP {load_at:#x}: guest maps {stolen:#x} to frame {stolen:#x}, which the guest may not map"
    );
    assert!(log.contains(&want), "want {want:?}\n{log}");
}

#[test]
fn test_a_non_mov_write_into_the_writers_own_code_frame_stops_naming_it() {
    require_kvm!();
    let mut a = CodeAssembler::new(64).unwrap();
    let mut target = a.create_label();
    a.mov(rsp, STACK).unwrap();
    a.lea(rdi, ptr(target)).unwrap();
    a.add(dword_ptr(rdi), 1_i32).unwrap();
    reset(&mut a);
    a.set_label(&mut target).unwrap();
    a.dd(&[0]).unwrap();
    let code = a.assemble(TINY_LOAD_ADDR).unwrap();
    let (native, _, _, _) = run_tiny_guest("shadow-smc-add-native", &code, None);
    assert_eq!(native.outcome, Outcome::Poweroff, "{:?}", native.dump);
    let log = engine_failure("shadow-smc-add-null", &code);
    assert!(
        log.contains(
            "(Add) writes into its own code frame; only plain `mov` and `movs`/`stos` stores are emulated there"
        ),
        "{log}"
    );
}

/// Mini-kernel steps that need more of the virtual CPU than the shadow MMU (flags,
/// exception and interrupt delivery, MSRs, ring 3): skipped, so that the run reaches the
/// steps that are about memory.
const MINIKERNEL_SKIP_ALL_BUT_MEMORY: &str =
    "kpin.skip=flags,de,ud,gp,pf,timer,msr,syscall,user-pf,hlt,user-priv,user-irq,selectors,sysret";

#[test]
fn test_minikernel_address_space_and_smc_steps_match_expected_txt_under_the_engine() {
    require_kvm!();
    let (report, text, log, _) = kpin_tests::run_minikernel(
        "shadow-minikernel",
        MINIKERNEL_SKIP_ALL_BUT_MEMORY,
        Some("null"),
        std::time::Duration::from_secs(120),
    );
    assert_eq!(report.outcome, Outcome::Poweroff, "{text}\n{log}");
    let expected = kpin_tests::minikernel_expected();
    // Steps 00 (own page tables), 01, 07 (the known loop), 11 (two address spaces, CR3
    // switched A, B, A, B) and 13 (code patched through a writable alias) run.
    let skipped = kpin_tests::compare_minikernel_transcript(&text, &expected)
        .unwrap_or_else(|e| panic!("{e}\n{text}\n{log}"));
    assert_eq!(skipped, 14, "{text}");
    for step in ["step 11 cr3: va ", "step 13 smc: call="] {
        assert!(text.contains(step), "{text}");
    }
    let shadow = log
        .lines()
        .find(|l| l.contains("engine: shadow: "))
        .unwrap_or_else(|| panic!("no shadow stats line: {log}"));
    assert!(!shadow.contains(" write_protect_faults=0 "), "{shadow}");
    assert!(!shadow.contains(" guest_cr3_writes=0 "), "{shadow}");
    println!("{shadow}");
}
