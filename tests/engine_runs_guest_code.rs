//! The engine runs guest code from its code cache (issue #4, first slice): a
//! hand-assembled tiny guest — console output, `cpuid`, a counted loop around a
//! `call`/`ret`, a store and a load in low memory, a conditional branch, an i8042 reset —
//! prints under `--tool null` exactly what it prints natively and powers off cleanly;
//! `bbcount` counts its blocks into `bbcount.csv`; a guest that reaches a sensitive
//! instruction the virtual CPU does not emulate yet ends as an engine failure naming the
//! instruction and its RIP, and a fault in translated code is mapped back to the guest
//! instruction and delivered there (these guests have no IDT: a triple fault, reported
//! with that RIP) — never a hang.

use std::path::Path;

use kpin_tests::{require_kvm, run_tiny_guest, TINY_LOAD_ADDR};
use vmm::Outcome;

/// At `TINY_LOAD_ADDR` (offsets in the comments):
/// ```text
///  0: mov dx,0x3f8; mov al,'O'; out dx,al; mov al,'K'; out dx,al; mov al,10; out dx,al
///  d: xor eax,eax; cpuid; mov al,bl; mov dx,0x3f8; out dx,al     ; vendor's first byte
/// 18: mov ecx,100; xor ebx,ebx
/// 1f: call add3; dec ecx; jnz 0x1f                               ; 100 iterations
/// 28: mov [0x200000],rbx; mov rax,[0x200000]; cmp rax,300; jne 0x44
/// 40: mov al,'Y'; jmp 0x46
/// 44: mov al,'N'
/// 46: mov dx,0x3f8; out dx,al; mov al,10; out dx,al; mov al,0xfe; out 0x64,al; hlt
/// 53: add3: add rbx,3; ret
/// ```
const LOOP_GUEST: &[u8] = &[
    0x66, 0xba, 0xf8, 0x03, 0xb0, 0x4f, 0xee, 0xb0, 0x4b, 0xee, 0xb0, 0x0a, 0xee, 0x31, 0xc0, 0x0f,
    0xa2, 0x88, 0xd8, 0x66, 0xba, 0xf8, 0x03, 0xee, 0xb9, 0x64, 0x00, 0x00, 0x00, 0x31, 0xdb, 0xe8,
    0x2f, 0x00, 0x00, 0x00, 0xff, 0xc9, 0x75, 0xf7, 0x48, 0x89, 0x1c, 0x25, 0x00, 0x00, 0x20, 0x00,
    0x48, 0x8b, 0x04, 0x25, 0x00, 0x00, 0x20, 0x00, 0x48, 0x3d, 0x2c, 0x01, 0x00, 0x00, 0x75, 0x04,
    0xb0, 0x59, 0xeb, 0x02, 0xb0, 0x4e, 0x66, 0xba, 0xf8, 0x03, 0xee, 0xb0, 0x0a, 0xee, 0xb0, 0xfe,
    0xe6, 0x64, 0xf4, 0x48, 0x83, 0xc3, 0x03, 0xc3,
];
/// Offset of `add3` in [`LOOP_GUEST`].
const ADD3_OFFSET: u64 = 0x53;

/// `mov dx,0x3f8; mov al,'O'; out dx,al; mov al,'K'; out dx,al; mov al,10; out dx,al`
const PRINT_OK: &[u8] = &[
    0x66, 0xba, 0xf8, 0x03, 0xb0, b'O', 0xee, 0xb0, b'K', 0xee, 0xb0, 0x0a, 0xee,
];

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_default()
}

#[test]
fn test_tiny_guest_under_null_tool_prints_what_it_prints_natively_and_powers_off() {
    require_kvm!();
    let (native, native_console, _, _) = run_tiny_guest("engine-run-native", LOOP_GUEST, None);
    assert_eq!(native.outcome, Outcome::Poweroff, "{:?}", native.dump);
    assert!(native_console.starts_with("OK\n"), "{native_console:?}");
    assert!(native_console.ends_with("Y\n"), "{native_console:?}");

    let (report, console, log, dir) = run_tiny_guest("engine-run-null", LOOP_GUEST, Some("null"));
    assert_eq!(
        report.outcome,
        Outcome::Poweroff,
        "{log}\n{:?}",
        report.dump
    );
    assert!(report.dump.is_none());
    assert_eq!(console, native_console, "{log}");
    assert!(
        log.contains("engine: running the guest from 0x100000 under tool null"),
        "{log}"
    );
    assert!(
        log.contains("engine: guest memory through the shadow MMU"),
        "{log}"
    );
    let stats = log
        .lines()
        .find(|l| l.contains("engine: stats: "))
        .unwrap_or_else(|| panic!("no stats line: {log}"));
    assert!(stats.contains(" traces translated ("), "{stats}");
    assert!(stats.contains("1 cpuid"), "{stats}");
    assert!(
        log.contains("writes 0xfe to port 0x64 (poweroff or reset)"),
        "{log}"
    );
    println!("{stats}\nwall {:?} (native {:?})", report.wall, native.wall);

    // The counters the engine writes at the end of every run.
    let text = read(&dir.join("counters.json"));
    let c: serde_json::Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("counters.json: {e}\n{text}"));
    let n = |path: &str| {
        c.pointer(path)
            .and_then(serde_json::Value::as_u64)
            .unwrap_or_else(|| panic!("no {path} in {text}"))
    };
    assert!(n("/translation/traces") > 0, "{text}");
    assert!(n("/translation/code_cache_bytes") > 0, "{text}");
    assert_eq!(n("/emulated/cpuid"), 1, "{text}");
    // 7 console bytes; the final i8042 write is passed on after the report.
    assert_eq!(n("/emulated/port_out"), 7, "{text}");
    assert!(n("/gate_calls") >= 7, "{text}");
    assert!(n("/ring_doorbells") > 0, "{text}");
}

#[test]
fn test_bbcount_counts_the_loop_blocks_into_a_csv() {
    require_kvm!();
    let (report, console, log, dir) =
        run_tiny_guest("engine-run-bbcount", LOOP_GUEST, Some("bbcount"));
    assert_eq!(
        report.outcome,
        Outcome::Poweroff,
        "{log}\n{:?}",
        report.dump
    );
    assert!(console.ends_with("Y\n"), "{console:?}");
    let csv = read(&dir.join("bbcount.csv"));
    assert!(
        csv.starts_with("address,cpl,instructions,count,physical\n"),
        "{csv}\n{log}"
    );
    // `add3` (2 instructions) ran once per iteration, at CPL 0 (the guest never leaves it).
    let add3 = format!("\n{:#x},0,2,100,", TINY_LOAD_ADDR + ADD3_OFFSET);
    assert!(csv.contains(&add3), "{csv}");
    assert!(log.contains("bbcount: "), "{log}");
    assert!(
        log.contains(" guest instructions executed (CPL 0: "),
        "{log}"
    );
}

#[test]
fn test_unsupported_sensitive_instruction_ends_as_engine_failure_naming_it() {
    require_kvm!();
    // mov cr0, rax (RAX = 10: clears CR0.PG)
    let mov_cr0 = [0x0f, 0x22, 0xc0];
    // mov eax, 0x2000; mov dr7, rax: general detect (breakpoints themselves are
    // virtualized)
    let mov_dr7_gd = [0xb8, 0x00, 0x20, 0x00, 0x00, 0x0f, 0x23, 0xf8];
    // rdpmc at CPL 0: performance counters are not virtualized (from CPL 3 it would be
    // the process's #GP or #UD)
    let rdpmc = [0x0f, 0x33];
    // mov ecx, 0x3a; rdmsr: FEATURE_CONTROL, which neither the virtual CPU nor KVM has
    // for this vCPU (the engine asks KVM for MSRs it does not keep), so #GP(0), which
    // this guest has no IDT for: #GP(0x6a) for the IDT limit, #DF, #GP(0x42): a triple
    // fault.
    let rdmsr0 = [0xb9, 0x3a, 0x00, 0x00, 0x00, 0x0f, 0x32];
    let at = TINY_LOAD_ADDR + PRINT_OK.len() as u64;
    for (name, code, want) in [
        (
            "movdr",
            [PRINT_OK, &mov_dr7_gd[..]].concat(),
            format!(
                "unsupported sensitive instruction `mov` (DebugRegister) at guest RIP {:#x}: a DR7 write that enables general detect",
                at + 5
            ),
        ),
        (
            "movcr0",
            [PRINT_OK, &mov_cr0[..]].concat(),
            format!("unsupported sensitive instruction `mov` (ControlRegister) at guest RIP {at:#x}: a CR0 write that changes PE or PG"),
        ),
        (
            "rdpmc",
            [PRINT_OK, &rdpmc[..]].concat(),
            format!("unsupported sensitive instruction `rdpmc` (Timestamp) at guest RIP {at:#x}: performance counters are not virtualized"),
        ),
        (
            "triple",
            [PRINT_OK, &rdmsr0[..]].concat(),
            format!(
                "the guest triple-faulted at RIP {:#x}: #GP (vector 13, error code 0x42) while delivering #DF",
                at + 5
            ),
        ),
        (
            "hlt",
            vec![0xf4],
            format!(
                "unsupported sensitive instruction `hlt` (Halt) at guest RIP {TINY_LOAD_ADDR:#x}: guest halted with interrupts disabled"
            ),
        ),
    ] {
        let (report, console, log, _) =
            run_tiny_guest(&format!("engine-run-{name}"), &code, Some("null"));
        assert_eq!(report.outcome, Outcome::EngineFailure, "{name}: {log}");
        assert!(log.contains(&want), "{name}: {log}");
        assert!(log.contains("engine: stats: "), "{name}: {log}");
        if name != "hlt" {
            assert_eq!(console, "OK\n", "{name}");
        }
        assert!(report.dump.is_some());
    }
}

#[test]
fn test_fault_in_translated_code_is_mapped_back_to_the_guest_instruction() {
    require_kvm!();
    let at = TINY_LOAD_ADDR + PRINT_OK.len() as u64;
    // movabs rax, [0x100000000]: 4 GiB, beyond the boot identity map (and the stolen
    // region's guest-physical address, which the engine never maps for the guest).
    let load = [0x48, 0xa1, 0x00, 0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00];
    // xor ecx, ecx; div ecx
    let div = [0x31, 0xc9, 0xf7, 0xf1];
    for (name, code, want) in [
        (
            "pf",
            [PRINT_OK, &load[..]].concat(),
            format!("the guest triple-faulted: #PF (vector 14) at RIP {at:#x}, then #GP (vector 13, error code 0x42) while delivering #DF"),
        ),
        (
            "de",
            [PRINT_OK, &div[..]].concat(),
            format!("the guest triple-faulted: #DE (vector 0) at RIP {:#x}, then", at + 2),
        ),
    ] {
        let (report, console, log, _) = run_tiny_guest(&format!("engine-run-fault-{name}"), &code, Some("null"));
        assert_eq!(report.outcome, Outcome::EngineFailure, "{name}: {log}");
        assert!(log.contains(&want), "{name}: {log}");
        assert!(!log.contains("unexpected exception"), "{name}: {log}");
        assert_eq!(console, "OK\n", "{name}");
    }
}
