//! The record buffer between translated code and the tool: its reset, its delivery
//! (with physical addresses resolved for a tool that needs them), the fetch records of
//! emulated instructions, and the records a fault takes back.

use alloc::vec::Vec;

use crate::addr::GuestVirt;
use crate::dispatch::Engine;
use crate::guest_memory::GuestMemory;
use crate::instrument::{
    access, resolve_pa, Action, Bbl, IPoint, InsInfo, Insertion, MemRecord, Tool,
};
use crate::layout::MEM_RECORD_BYTES;
use crate::platform::SensitiveInsn;

impl Engine {
    pub(crate) fn reset_buffer(&mut self) {
        let start = self.buffer.as_mut_ptr() as u64;
        let end = start + (self.buffer.len() * MEM_RECORD_BYTES) as u64;
        let c = self.ctx_mut();
        c.buf_ptr = start;
        c.buf_neg_end = end.wrapping_neg();
    }

    pub(crate) fn deliver_buffer(&mut self, mem: &mut dyn GuestMemory, tool: &mut dyn Tool) {
        self.deliver_buffer_holding(mem, tool, 0);
    }

    /// Delivers the buffer but its last `held` records (those of the instruction about to
    /// run, which may still fault), which move to its start.
    pub(crate) fn deliver_buffer_holding(
        &mut self,
        mem: &mut dyn GuestMemory,
        tool: &mut dyn Tool,
        held: usize,
    ) {
        let start = self.buffer.as_ptr() as u64;
        let total = ((self.ctx().buf_ptr - start) as usize) / MEM_RECORD_BYTES;
        // Holding everything would free nothing (a buffer smaller than one instruction's
        // records): then all go.
        let held = if held < total { held } else { 0 };
        let n = total - held;
        if n == 0 {
            return;
        }
        if self.config.records_need_pa || tool.records_need_pa() {
            let mode = self.mode;
            // No mapping changes during one delivery: remember the data pages resolved so
            // far (direct-mapped by page number), as a TLB would.
            const MEMO: usize = 64;
            let mut memo = [(u64::MAX, 0u64); MEMO];
            for r in &mut self.buffer[..n] {
                if r.access & access::FETCH != 0 {
                    // Written at the append, from the trace's frame.
                    continue;
                }
                let data = if r.access & access::WITH_FETCH != 0 {
                    // The instruction's physical address, written at the append, moves
                    // to `ea`; `pa` is resolved from the data address.
                    core::mem::replace(&mut r.ea, r.pa)
                } else {
                    r.ea
                };
                let page = data & !0xfff;
                let slot = &mut memo[(data >> 12) as usize % MEMO];
                if slot.0 != page {
                    *slot = (page, resolve_pa(mem, mode, page, false));
                }
                r.pa = match slot.1 {
                    u64::MAX => u64::MAX,
                    pa => pa + (data & 0xfff),
                };
            }
        }
        tool.buffer_full(&self.buffer[..n]);
        self.reset_buffer();
        if held != 0 {
            self.buffer.copy_within(n..total, 0);
            self.ctx_mut().buf_ptr = start + (held * MEM_RECORD_BYTES) as u64;
        }
    }

    /// Before the platform emulates `s`: delivers the pending records (emulation may
    /// change mappings) and, for a tool that records fetches, makes `s`'s fetch record
    /// (resolved now, delivered by [`Engine::deliver_fetch`] once `s` is emulated).
    pub(crate) fn emulated_fetch(
        &mut self,
        mem: &mut dyn GuestMemory,
        tool: &mut dyn Tool,
        s: &SensitiveInsn,
    ) -> Option<MemRecord> {
        self.deliver_buffer(mem, tool);
        if !tool.records_fetches() {
            return None;
        }
        let mut r = MemRecord {
            ip: s.pc.0,
            ea: s.pc.0,
            size: u32::from(s.len),
            access: access::FETCH | u32::from(self.mode.cpl()) << access::CPL_SHIFT,
            pa: 0,
        };
        if self.config.records_need_pa || tool.records_need_pa() {
            r.pa = resolve_pa(mem, self.mode, r.ea, true);
        }
        Some(r)
    }

    /// The running task changed to row `row`: an [`access::TASK`] record for a tool that
    /// takes them (the buffer is empty here: delivered before the emulation).
    pub(crate) fn deliver_task(tool: &mut dyn Tool, row: u64) {
        if tool.task_records() {
            let r = MemRecord {
                ip: 0,
                ea: row,
                size: 0,
                access: access::TASK,
                pa: 0,
            };
            tool.buffer_full(core::slice::from_ref(&r));
        }
    }

    /// Delivers an emulated instruction's fetch record (see [`Engine::emulated_fetch`]).
    pub(crate) fn deliver_fetch(tool: &mut dyn Tool, fetch: Option<MemRecord>) {
        if let Some(r) = fetch {
            tool.buffer_full(core::slice::from_ref(&r));
        }
    }

    /// The instruction at `guest_pc` faulted: its pending records (its fetch record and
    /// its operands', at the end of the buffer) describe accesses that did not happen.
    /// (For a `rep` string instruction, the iterations done before the fault lose their
    /// records too.)
    pub(crate) fn drop_records_of(&mut self, guest_pc: GuestVirt) {
        let start = self.buffer.as_ptr() as u64;
        let mut n = ((self.ctx().buf_ptr - start) as usize) / MEM_RECORD_BYTES;
        let before = n;
        while n > 0 && self.buffer[n - 1].ip == guest_pc.0 {
            n -= 1;
        }
        // A run of fetches that the faulting instruction is part of (not its first, whose
        // record went above) keeps only the instructions before it.
        if n > 0 {
            let r = &mut self.buffer[n - 1];
            let run = access::FETCH | access::FETCH_RUN;
            if r.access & run == run {
                let mut at = r.ip;
                for k in 0..r.size {
                    if at == guest_pc.0 {
                        r.size = k;
                        // The run's last instruction, a `call` or `ret`, did not run.
                        r.access &= !(access::CALL | access::RET);
                        break;
                    }
                    at += (r.ea >> (4 * k)) & 0xf;
                }
                if r.size == 0 {
                    n -= 1;
                }
            }
        }
        if n != before {
            self.ctx_mut().buf_ptr = start + (n * MEM_RECORD_BYTES) as u64;
        }
    }
}

/// Most instructions one fetch-run record stands for (4-bit lengths in a u64).
const MAX_RUN: usize = 16;

/// The fetch insertions of a trace for a tool answering `Tool::fetch_runs`: one record per
/// run of consecutive instructions of a basic block that have none of the tool's
/// `insertions` (so no record or call comes between their fetches) and are not `rep`
/// strings (whose fetch follows their loop). With `merge` (the tool's records get
/// physical addresses), an instruction with operand records has its fetch carried by the
/// first of them, but for a `call` or `ret` with `split_flow` (`Tool::call_stack_records`);
/// any other instruction gets its own record.
pub(crate) fn fetch_runs(
    info: &[InsInfo],
    bbls: &[Bbl],
    insertions: &[Insertion],
    merge: bool,
    split_flow: bool,
) -> Vec<Insertion> {
    let busy = |i: usize| info[i].rep || insertions.iter().any(|x| x.ins == i);
    let records = |i: usize| {
        insertions
            .iter()
            .any(|x| x.ins == i && x.action == Action::MemRecords)
    };
    let mut out = Vec::new();
    for b in bbls {
        let end = b.first + b.count;
        let mut i = b.first;
        while i < end {
            let mut n = 1;
            let mut lens = u64::from(info[i].len);
            if !busy(i) {
                while n < MAX_RUN && i + n < end && !busy(i + n) {
                    lens |= u64::from(info[i + n].len) << (4 * n);
                    n += 1;
                }
            }
            // Only a block's last instruction can be a `call` or `ret`: a run's last.
            let flow = access::flow(info[i + n - 1].kind);
            let action = if n > 1 {
                Action::FetchRun {
                    n: n as u8,
                    lens,
                    flow,
                }
            } else if merge && !info[i].rep && records(i) && !(split_flow && flow != 0) {
                Action::FetchInRecords { flow }
            } else if flow != 0 {
                Action::FetchFlowRecord { flow }
            } else {
                Action::FetchRecord
            };
            out.push(Insertion {
                ins: i,
                point: IPoint::Before,
                action,
            });
            i += n;
        }
    }
    out
}
