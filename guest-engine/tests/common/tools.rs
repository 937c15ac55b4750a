//! Example tools written against the instrumentation API (also used by the benchmark).
#![allow(dead_code)]

use std::collections::BTreeMap;

use guest_engine::{
    CounterId, Engine, Gpr, IArg, IPoint, InsKind, MemRecord, Tool, TraceInstrumenter,
};

/// Counts basic-block executions with one inline counter per block.
#[derive(Default)]
pub struct BblCount {
    /// (block address, instruction count) → (counter, instruction addresses).
    pub blocks: BTreeMap<(u64, usize), (CounterId, Vec<u64>)>,
}

impl Tool for BblCount {
    fn instrument_trace(&mut self, t: &mut TraceInstrumenter<'_>) {
        let bbls = t.bbls().to_vec();
        for (k, b) in bbls.iter().enumerate() {
            let key = (b.address.0, b.count);
            let id = match self.blocks.get(&key) {
                Some((id, _)) => *id,
                None => {
                    let id = t.alloc_counter().expect("counter slots");
                    let addrs = t.instructions()[b.first..b.first + b.count]
                        .iter()
                        .map(|i| i.address.0)
                        .collect();
                    self.blocks.insert(key, (id, addrs));
                    id
                }
            };
            t.insert_bbl_counter(k, id, 1);
        }
    }
}

impl BblCount {
    /// Executions per instruction address.
    pub fn per_instruction(&self, e: &Engine) -> BTreeMap<u64, u64> {
        let mut m = BTreeMap::new();
        for (id, addrs) in self.blocks.values() {
            let c = e.counter(*id);
            if c == 0 {
                continue;
            }
            for a in addrs {
                *m.entry(*a).or_insert(0) += c;
            }
        }
        m
    }

    pub fn total_blocks(&self, e: &Engine) -> u64 {
        self.blocks.values().map(|(id, _)| e.counter(*id)).sum()
    }
}

/// Appends a record per memory operand of every instruction.
#[derive(Default)]
pub struct MemTrace {
    pub keep: bool,
    pub records: Vec<MemRecord>,
    pub count: u64,
    pub batches: u64,
}

impl Tool for MemTrace {
    fn instrument_trace(&mut self, t: &mut TraceInstrumenter<'_>) {
        for k in 0..t.instructions().len() {
            t.insert_mem_records(k);
        }
    }
    fn buffer_full(&mut self, records: &[MemRecord]) {
        self.count += records.len() as u64;
        self.batches += 1;
        if self.keep {
            self.records.extend_from_slice(records);
        }
    }
}

/// Calls an analysis routine before every instruction with (ip, rsp, rax).
#[derive(Default)]
pub struct TraceCalls {
    pub seen: Vec<(u64, u64, u64)>,
}

impl Tool for TraceCalls {
    fn instrument_trace(&mut self, t: &mut TraceInstrumenter<'_>) {
        for k in 0..t.instructions().len() {
            t.insert_call(
                k,
                IPoint::Before,
                7,
                &[IArg::InstPtr, IArg::Reg(Gpr::Rsp), IArg::Reg(Gpr::Rax)],
            );
        }
    }
    fn analyze(&mut self, routine: u32, args: &[u64]) {
        assert_eq!(routine, 7);
        self.seen.push((args[0], args[1], args[2]));
    }
}

/// Everything at once: block counters, an after-instruction counter, records, calls with
/// EA/size/PA arguments. Used to check that instrumentation never changes guest state.
#[derive(Default)]
pub struct Heavy {
    pub bbl: BblCount,
    pub mem: MemTrace,
    pub insns_after: Option<CounterId>,
    pub calls: u64,
}

impl Tool for Heavy {
    fn instrument_trace(&mut self, t: &mut TraceInstrumenter<'_>) {
        self.bbl.instrument_trace(t);
        self.mem.instrument_trace(t);
        let id = *self
            .insns_after
            .get_or_insert_with(|| t.alloc_counter().expect("slot"));
        let insns = t.instructions().to_vec();
        for (k, i) in insns.iter().enumerate() {
            if matches!(i.kind, InsKind::Plain | InsKind::CondBranch) {
                t.insert_counter(k, IPoint::After, id, 1);
            }
            if k % 5 == 0 && !i.mem.is_empty() {
                t.insert_call(
                    k,
                    IPoint::Before,
                    1,
                    &[
                        IArg::InstPtr,
                        IArg::MemEa(0),
                        IArg::MemSize(0),
                        IArg::MemPa(0),
                        IArg::Const(42),
                    ],
                );
            }
        }
    }
    fn analyze(&mut self, _routine: u32, args: &[u64]) {
        assert_eq!(args[4], 42);
        self.calls += 1;
    }
    fn buffer_full(&mut self, records: &[MemRecord]) {
        self.mem.buffer_full(records);
    }
}

/// Calls an analysis routine with (ip, EA, size) of the first memory operand of every
/// non-`rep` instruction that has one.
#[derive(Default)]
pub struct EaCalls {
    pub seen: Vec<(u64, u64, u64)>,
}

impl Tool for EaCalls {
    fn instrument_trace(&mut self, t: &mut TraceInstrumenter<'_>) {
        let insns = t.instructions().to_vec();
        for (k, i) in insns.iter().enumerate() {
            if !i.mem.is_empty() && !i.rep {
                t.insert_call(
                    k,
                    IPoint::Before,
                    3,
                    &[IArg::InstPtr, IArg::MemEa(0), IArg::MemSize(0)],
                );
            }
        }
    }
    fn analyze(&mut self, _routine: u32, args: &[u64]) {
        self.seen.push((args[0], args[1], args[2]));
    }
}
