//! The counts and records the instrumentation API produces equal an independent
//! reference: the same workload single-stepped natively under ptrace in a forked child.

mod common;

use std::collections::BTreeMap;

use common::corpus::{corpus, Harness};
use common::diff::Prepared;
use common::ptrace::{single_step, Step};
use common::tools::{BblCount, EaCalls, MemTrace, TraceCalls};
use common::{Region, Rig};
use guest_engine::instrument::access;
use guest_engine::{Config, Engine, MemRecord, Mode};
use iced_x86::{Decoder, DecoderOptions, Instruction, InstructionInfoFactory, OpAccess, Register};

fn decode_at(rip: u64) -> Instruction {
    // SAFETY: rip is an address the child executed, in a mapping shared with the parent.
    let b = unsafe { std::slice::from_raw_parts(rip as *const u8, 15) };
    Decoder::with_ip(64, b, rip, DecoderOptions::NONE).decode()
}

fn is_rep_string(i: &Instruction) -> bool {
    (i.has_rep_prefix() || i.has_repne_prefix())
        && matches!(
            format!("{:?}", i.mnemonic()).as_str(),
            "Movsb"
                | "Movsw"
                | "Movsd"
                | "Movsq"
                | "Stosb"
                | "Stosw"
                | "Stosd"
                | "Stosq"
                | "Lodsb"
                | "Lodsw"
                | "Lodsd"
                | "Lodsq"
                | "Cmpsb"
                | "Cmpsw"
                | "Cmpsd"
                | "Cmpsq"
                | "Scasb"
                | "Scasw"
                | "Scasd"
                | "Scasq"
        )
}

/// Executions per instruction address; a rep string instruction's iterations count once.
fn reference_counts(steps: &[Step]) -> BTreeMap<u64, u64> {
    let mut m = BTreeMap::new();
    let mut prev = u64::MAX;
    for s in steps {
        if s.rip == prev && is_rep_string(&decode_at(s.rip)) {
            continue;
        }
        *m.entry(s.rip).or_insert(0) += 1;
        prev = s.rip;
    }
    m
}

/// Instructions the engine counted (`Config::count_insns`) since `before`.
fn counted_since(e: &Engine, before: u64) -> u64 {
    assert_eq!(e.executed_insns(Mode::USER), 0, "nothing ran in user mode");
    e.executed_insns(Mode::KERNEL) - before
}

fn reg_value(s: &Step, r: Register) -> Option<u64> {
    if r == Register::FS {
        return Some(s.fs_base);
    }
    if r == Register::GS {
        return Some(s.gs_base);
    }
    if r.is_segment_register() {
        return Some(0);
    }
    let full = r.full_register();
    let n = full as usize - Register::RAX as usize;
    let v = *s.gpr.get(n)?;
    Some(match r.size() {
        8 => v,
        4 => v & 0xFFFF_FFFF,
        2 => v & 0xFFFF,
        _ => v & 0xFF,
    })
}

/// Memory references per executed instruction (rep strings: one set per iteration).
fn reference_records(steps: &[Step]) -> Vec<MemRecord> {
    let mut f = InstructionInfoFactory::new();
    let mut out = Vec::new();
    for s in steps {
        let mut i = decode_at(s.rip);
        if is_rep_string(&i) {
            if s.gpr[1] == 0 {
                continue;
            }
            // one iteration = the instruction without its prefix
            // SAFETY: rip is executed code in a mapping shared with the parent.
            let b = unsafe { std::slice::from_raw_parts(s.rip as *const u8, i.len()) };
            let stripped: Vec<u8> = b
                .iter()
                .copied()
                .filter(|x| *x != 0xF2 && *x != 0xF3)
                .collect();
            i = Decoder::with_ip(64, &stripped, s.rip, DecoderOptions::NONE).decode();
        }
        let size_hint = i.memory_size().size() as u32;
        for m in f.info(&i).used_memory() {
            let acc = match m.access() {
                OpAccess::Read | OpAccess::CondRead => access::READ,
                OpAccess::Write | OpAccess::CondWrite => access::WRITE,
                OpAccess::ReadWrite | OpAccess::ReadCondWrite => access::READ | access::WRITE,
                _ => continue,
            };
            let ea = m.virtual_address(0, |r, _, _| reg_value(s, r)).expect("ea");
            let size = match m.memory_size().size() {
                0 => size_hint,
                n => n as u32,
            };
            out.push(MemRecord {
                ip: s.rip,
                ea,
                size,
                access: acc,
                pa: 0,
            });
        }
    }
    out
}

#[test]
fn test_bbl_counts_and_records_match_single_step_on_random_programs() {
    let mut rig = Rig::new(Config {
        record_buffer_records: 64,
        count_insns: true,
        ..Config::default()
    });
    let block = Region::map(1 << 20, 0);
    let mut insns = 0usize;
    let seeds = 150;
    for seed in 300_000..300_000 + seeds {
        let prep = Prepared::new(&rig, &block, seed, 40);
        prep.reset(&block);
        *rig.native.regs_mut() = prep.init;
        let steps = single_step(&mut rig.native, prep.p.entry);
        insns += steps.len();

        let want_counts = reference_counts(&steps);
        let want_insns: u64 = want_counts.values().sum();
        let c0 = rig.engine.executed_insns(Mode::KERNEL);
        let mut bbl = BblCount::default();
        prep.run_translated(&mut rig, &block, &mut bbl);
        assert_eq!(
            bbl.per_instruction(&rig.engine),
            want_counts,
            "seed {seed}: block counts"
        );
        assert_eq!(
            counted_since(&rig.engine, c0),
            want_insns,
            "seed {seed}: engine instruction count next to a block-counting tool"
        );

        let c0 = rig.engine.executed_insns(Mode::KERNEL);
        let mut mt = MemTrace {
            keep: true,
            ..MemTrace::default()
        };
        prep.run_translated(&mut rig, &block, &mut mt);
        let want = reference_records(&steps);
        assert_eq!(mt.records.len(), want.len(), "seed {seed}: record count");
        assert!(mt.records == want, "seed {seed}: records differ");
        assert_eq!(counted_since(&rig.engine, c0), want_insns, "seed {seed}");

        let c0 = rig.engine.executed_insns(Mode::KERNEL);
        let mut tc = TraceCalls::default();
        prep.run_translated(&mut rig, &block, &mut tc);
        assert_eq!(counted_since(&rig.engine, c0), want_insns, "seed {seed}");
        let mut prev = u64::MAX;
        let want: Vec<(u64, u64, u64)> = steps
            .iter()
            .filter(|s| {
                let dup = s.rip == prev && is_rep_string(&decode_at(s.rip));
                prev = s.rip;
                !dup
            })
            .map(|s| (s.rip, s.gpr[4], s.gpr[0]))
            .collect();
        assert!(
            tc.seen == want,
            "seed {seed}: analysis-call arguments differ"
        );

        let mut ec = EaCalls::default();
        prep.run_translated(&mut rig, &block, &mut ec);
        let want: Vec<(u64, u64, u64)> = steps
            .iter()
            .filter(|s| !is_rep_string(&decode_at(s.rip)))
            .filter_map(|s| {
                let r = reference_records(std::slice::from_ref(s));
                r.first().map(|m| (m.ip, m.ea, u64::from(m.size)))
            })
            .collect();
        assert!(
            ec.seen == want,
            "seed {seed}: effective-address arguments differ"
        );
    }
    common::report(&format!("{seeds} programs, {insns} single-stepped instructions: block counts, engine instruction counts, records and call arguments equal"));
}

#[test]
fn test_bbl_counts_and_records_match_single_step_on_corpus() {
    let mut h = Harness::new(Config {
        record_buffer_records: 1000,
        count_insns: true,
        ..Config::default()
    });
    for (name, f) in corpus() {
        let n = 14;
        let steps = h.single_step(f, 5, n);
        let want_counts = reference_counts(&steps);
        let want_insns: u64 = want_counts.values().sum();
        let c0 = h.rig.engine.executed_insns(Mode::KERNEL);
        let mut bbl = BblCount::default();
        h.run(f, 5, n, &mut bbl);
        let got = bbl.per_instruction(&h.rig.engine);
        assert_eq!(got, want_counts, "{name}: block counts");
        assert_eq!(
            counted_since(&h.rig.engine, c0),
            want_insns,
            "{name}: engine instruction count next to a block-counting tool"
        );
        let c0 = h.rig.engine.executed_insns(Mode::KERNEL);
        h.run(f, 5, n, &mut guest_engine::NullTool);
        assert_eq!(
            counted_since(&h.rig.engine, c0),
            want_insns,
            "{name}: engine instruction count alone"
        );
        let mut mt = MemTrace {
            keep: true,
            ..MemTrace::default()
        };
        h.run(f, 5, n, &mut mt);
        let want = reference_records(&steps);
        assert_eq!(mt.records.len(), want.len(), "{name}: record count");
        assert!(mt.records == want, "{name}: records differ");
        println!(
            "{name}: {} instructions, {} records match the single-step reference",
            steps.len(),
            want.len()
        );
    }
}
