//! The record buffer between translated code and the tool: its reset, its delivery
//! (with physical addresses resolved for a tool that needs them), the fetch records of
//! emulated instructions, and the records a fault takes back.

use crate::addr::GuestVirt;
use crate::dispatch::Engine;
use crate::guest_memory::GuestMemory;
use crate::instrument::{access, resolve_pa, MemRecord, Tool};
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
            // No mapping changes during one delivery: remember the pages resolved so far
            // (direct-mapped by page number; tag = page | fetch bit), as a TLB would.
            const MEMO: usize = 64;
            let mut memo = [(u64::MAX, 0u64); MEMO];
            for r in &mut self.buffer[..n] {
                let fetch = r.access & access::FETCH != 0;
                if fetch {
                    // Written at the append, from the trace's frame.
                    continue;
                }
                let page = r.ea & !0xfff;
                let tag = page | u64::from(fetch);
                let slot = &mut memo[(r.ea >> 12) as usize % MEMO];
                if slot.0 != tag {
                    *slot = (tag, resolve_pa(mem, mode, page, fetch));
                }
                r.pa = match slot.1 {
                    u64::MAX => u64::MAX,
                    pa => pa + (r.ea & 0xfff),
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
        if n != before {
            self.ctx_mut().buf_ptr = start + (n * MEM_RECORD_BYTES) as u64;
        }
    }
}
