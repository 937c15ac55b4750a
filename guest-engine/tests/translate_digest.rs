//! The translator emits the same bytes for the same input: a corpus of real code (every
//! 8th function of the pinned Linux kernel and of busybox, `examples/translate_cost`)
//! translated with the null tool and with block counters, against recorded digests: the
//! translator's host-cost work (issue #25) kept them; a deliberate change to the emitted
//! code updates them (with the Linux md5 tests run) — last, the engine's block counts
//! moved to each block's count point (`insn_count.rs`), then selector reads ran inline
//! (`vflags.rs`), then the engine took one more counter slot before the tool's (inline
//! `iretq`s, `insn_count.rs`: bbcount's counters moved), then the fragment table got a
//! fixed size (`code_cache::MAX_FRAGMENTS`: a full one flushes mid-corpus, so later
//! traces sit elsewhere), then a fragment's PC map became a byte stream (`pc_map.rs`: a
//! smaller `Fragment`, so that flush comes later), then `Fragment` shrank to 120 bytes
//! (entry points as offsets: the null pass no longer fills the table). The corpus translates with the default `Config::host_flags` (nothing
//! claimed), so the digests do not depend on the host CPU.

#[path = "../examples/translate_cost/corpus.rs"]
mod corpus;

use corpus::{read_text, tool, workspace_path, TextMemory, Translator, BUSYBOX, VMLINUX};

/// (tool, traces, guest instructions, FNV-1a of the emitted code).
const EXPECTED: [(&str, u64, u64, u64); 2] = [
    ("null", 59_934, 450_191, 0x971e_8b79_85dc_d3f4),
    ("bbcount", 59_934, 450_191, 0x7a13_2271_5c70_7fbe),
];

#[test]
fn test_corpus_translates_to_the_recorded_bytes() {
    let paths = [workspace_path(VMLINUX), workspace_path(BUSYBOX)];
    if let Some(p) = paths.iter().find(|p| !p.exists()) {
        eprintln!("SKIPPED: {} absent (`kpin images` builds it)", p.display());
        return;
    }
    let texts = paths
        .iter()
        .map(|p| read_text(p).expect("read image"))
        .collect();
    let mut mem = TextMemory::new(texts);
    let mut t = Translator::new();
    for (name, traces, insns, digest) in EXPECTED {
        let before = t.engine.stats().guest_insns;
        let n = t.pass(&mut mem, &mut *tool(name), 8);
        let got = (n, t.engine.stats().guest_insns - before, t.code_digest());
        assert_eq!(
            got,
            (traces, insns, digest),
            "{name}: (traces, insns, digest)"
        );
    }
}
