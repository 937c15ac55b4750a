//! The translator emits the same bytes for the same input: a corpus of real code (every
//! 8th function of the pinned Linux kernel and of busybox, `examples/translate_cost`)
//! translated with the null tool and with block counters, against the digests the
//! translator produced before its host-cost work (issue #25). A deliberate change to the
//! emitted code updates them (with the Linux md5 tests run).

#[path = "../examples/translate_cost/corpus.rs"]
mod corpus;

use corpus::{read_text, tool, workspace_path, TextMemory, Translator, BUSYBOX, VMLINUX};

/// (tool, traces, guest instructions, FNV-1a of the emitted code).
const EXPECTED: [(&str, u64, u64, u64); 2] = [
    ("null", 59_947, 450_184, 0x0cb7_165d_4ea6_88ed),
    ("bbcount", 59_947, 450_184, 0xfcbc_7442_4292_65de),
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
