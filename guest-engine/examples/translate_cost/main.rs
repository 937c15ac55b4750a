//! Host cost of translation on real code (issue #25): translates a trace at every
//! function of the pinned Linux kernel's `.text` (kernel mode) and of busybox's (user
//! mode) through `Engine::pretranslate` — the dispatcher's own translation path — with
//! the engine image's configuration.
//!
//! `cargo run --release -p guest-engine --example translate_cost -- [--tool null|bbcount]
//! [--stride N] [--passes N]`
//!
//! `--dump HEXVA` instead prints the code emitted for the one trace at that address
//! (a debugging aid: what the glue around real code looks like).
//!
//! Deterministic instruction counts of the translation alone (docs/benchmarks.md):
//!
//! ```text
//! valgrind --tool=callgrind --collect-atstart=no --toggle-collect='*Engine*pretranslate*' \
//!     target/release/examples/translate_cost --tool null --passes 1
//! ```

mod corpus;

use std::time::Instant;

use corpus::{read_text, tool, workspace_path, TextMemory, Translator, BUSYBOX, VMLINUX};

fn arg(name: &str) -> Option<String> {
    std::env::args().skip_while(|a| a != name).nth(1)
}

fn main() {
    let tool_name = arg("--tool").unwrap_or_else(|| "null".into());
    let stride: usize = arg("--stride").map_or(4, |s| s.parse().expect("--stride N"));
    let passes: usize = arg("--passes").map_or(3, |s| s.parse().expect("--passes N"));
    let texts = [VMLINUX, BUSYBOX]
        .iter()
        .map(|p| {
            let path = workspace_path(p);
            read_text(&path)
                .unwrap_or_else(|e| panic!("{}: {e} (run `kpin images`)", path.display()))
        })
        .collect();
    let mut mem = TextMemory::new(texts);
    let mut t = Translator::new();
    let mut tool = tool(&tool_name);
    if let Some(va) = arg("--dump") {
        let va = u64::from_str_radix(va.trim_start_matches("0x"), 16).expect("--dump HEXVA");
        let (at, code) = t.dump(&mut mem, &mut *tool, va);
        print_code(at, &code);
        return;
    }
    for pass in 0..passes {
        let s0 = t.engine.stats();
        let start = Instant::now();
        let traces = t.pass(&mut mem, &mut *tool, stride);
        let dt = start.elapsed().as_secs_f64();
        let s = t.engine.stats();
        // A pass starts with a flush; one more would come if it filled the fragment table
        // (`MAX_FRAGMENTS`), which a corpus of every function no longer does.
        assert!(s.flushes > s0.flushes, "a pass starts with a flush");
        let insns = s.guest_insns - s0.guest_insns;
        println!(
            "pass {pass} ({tool_name}, every {stride}th function): {traces} traces, {insns} guest instructions ({:.1}/trace), {} cache bytes; {:.0} ns/trace (wall, noisy); code digest {:016x}",
            insns as f64 / traces as f64,
            s.cache_bytes - s0.cache_bytes,
            dt * 1e9 / traces as f64,
            t.code_digest()
        );
    }
}

/// Disassembles `code`, emitted at `at`.
fn print_code(at: u64, code: &[u8]) {
    use iced_x86::{Decoder, DecoderOptions, Formatter, NasmFormatter};
    let mut decoder = Decoder::with_ip(64, code, at, DecoderOptions::NONE);
    let mut formatter = NasmFormatter::new();
    let mut text = String::new();
    for insn in &mut decoder {
        text.clear();
        formatter.format(&insn, &mut text);
        println!("{:016x}  {text}", insn.ip());
    }
    println!("{} bytes", code.len());
}
