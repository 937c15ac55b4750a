//! The Pin-shaped instrumentation API tools use at translation time.
//!
//! A tool implements [`Tool`]. When the engine forms a trace it calls
//! [`Tool::instrument_trace`] with a [`TraceInstrumenter`] that describes the trace's basic
//! blocks and instructions (arch-neutral [`InsInfo`]) and collects insertions:
//!
//! * [`TraceInstrumenter::insert_counter`] — an inline 64-bit counter increment
//!   (`add [rip+slot], n` where EFLAGS are dead, a flag-free `lea` sequence elsewhere);
//! * [`TraceInstrumenter::insert_mem_records`] — an inline append of one [`MemRecord`] per
//!   memory operand (explicit, implicit stack and string operands; `rep` string
//!   instructions record every iteration) to the per-vCPU buffer, handed to
//!   [`Tool::buffer_full`] when full and when the run stops;
//! * [`TraceInstrumenter::insert_call`] — a call of [`Tool::analyze`] with [`IArg`]
//!   arguments evaluated at run time.
//!
//! Invariants: insertions never change guest-visible state; `IPoint::After` is only
//! honoured on an instruction's fall-through path (ignored for unconditional transfers).

use alloc::vec::Vec;

use crate::addr::{GuestPhys, GuestVirt};
use crate::context::{Gpr, GuestRegs};
use crate::error::EngineError;
use crate::guest_memory::Mode;
use crate::layout::COUNTER_SLOTS;

/// Memory access bits of a [`MemOperand`] / [`MemRecord`].
pub mod access {
    /// The operand is read.
    pub const READ: u32 = 1;
    /// The operand is written.
    pub const WRITE: u32 = 2;
    /// An instruction fetch record ([`super::Tool::records_fetches`]): `ea` is the
    /// instruction's address, `size` its length.
    pub const FETCH: u32 = 4;
    /// With [`FETCH`], for a tool answering [`super::Tool::fetch_runs`]: the record stands
    /// for the fetches of `size` consecutive instructions from `ip` (`pa` the first one's),
    /// whose lengths are the 4-bit fields of `ea` from bit 0 up (at most 16).
    pub const FETCH_RUN: u32 = 16;
    /// On the first operand record of an instruction, for a tool answering
    /// [`super::Tool::fetch_runs`] and [`super::Tool::records_need_pa`]: the record also
    /// stands for the instruction's fetch, which comes before its data access. Its length
    /// is in bits [`FETCH_LEN_SHIFT`].. (4 bits), and once delivered, `ea` holds the
    /// instruction's physical address (the data access's is in `pa` as usual).
    pub const WITH_FETCH: u32 = 32;
    /// Shift of the instruction length in the `access` of a [`WITH_FETCH`] record.
    pub const FETCH_LEN_SHIFT: u32 = 12;
    /// Not an access: a record the engine inserts where the running task changes (the
    /// task watch's charging point, `guest-engine/src/tasks/mod.rs`), for a tool whose records
    /// go to the host ([`super::Tool::task_records`]). From this record on, the records
    /// belong to row `ea` of `processes.json`'s `processes` (0: the kernel before the first
    /// process); `ip`, `size` and `pa` are 0. Only with the kernel's types or address-space
    /// keying on. The first comes at the first change after the tool started: the records
    /// before it belong to the row that ran when it started (row 0 for a tool chosen at
    /// boot). It comes after every record of the instructions before the change and
    /// before the fetch record of the emulated `sysretq`/`iretq` at which the change was
    /// seen (that instruction counts for the new row, as in the task watch's charging).
    pub const TASK: u32 = 64;
    /// Shift of the record's virtual CPL (bits 8–9: the mode its code was translated for,
    /// or ran in when the platform emulated it).
    pub const CPL_SHIFT: u32 = 8;
    /// On a record that stands for a `call`'s fetch (a [`FETCH`] record, a [`FETCH_RUN`]
    /// that ends with it, or a [`WITH_FETCH`] operand record), for a tool answering
    /// [`super::Tool::fetch_runs`]: the instruction is a `call`, direct or indirect. It
    /// returns to the instruction's end; the next fetch of its mode is its target; a
    /// [`WITH_FETCH`] record of its stack write has the return address's slot in `pa`.
    /// For a tool answering [`super::Tool::call_stack_records`], the fetch always has a
    /// [`FETCH`] record of its own, and the stack write's record (the last of its
    /// operands') keeps the slot's virtual address in `ea`. For shadow call stacks kept
    /// from the record stream (cachesim's `attribute=on`).
    pub const CALL: u32 = 1 << 16;
    /// As [`CALL`], for a `ret`: the next fetch of its mode is where it returned to; its
    /// stack read's record has the slot it took the address from.
    pub const RET: u32 = 1 << 17;

    /// The [`CALL`]/[`RET`] bit of an instruction of kind `kind` (0 for the others).
    pub(crate) fn flow(kind: super::InsKind) -> u32 {
        use super::InsKind as K;
        match kind {
            K::Call | K::IndirectCall => CALL,
            K::Return => RET,
            _ => 0,
        }
    }
}

/// Segment override of a memory operand that changes its linear address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SegBase {
    /// Flat (CS/DS/ES/SS in 64-bit mode).
    Flat,
    /// FS-relative.
    Fs,
    /// GS-relative.
    Gs,
}

/// One memory operand of an instruction, explicit or implicit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemOperand {
    /// Base register, if any (RIP-relative operands are turned into absolute `disp`).
    pub base: Option<Gpr>,
    /// Index register, if any.
    pub index: Option<Gpr>,
    /// Index scale (1, 2, 4, 8).
    pub scale: u8,
    /// Displacement (two's complement).
    pub disp: u64,
    /// Access size in bytes (per element for string instructions).
    pub size: u32,
    /// [`access`] bits.
    pub access: u32,
    /// Segment base that applies.
    pub seg: SegBase,
}

impl MemOperand {
    /// Effective address from guest registers at the instruction's start, without the
    /// FS/GS base (see `Platform::segment_base`).
    pub fn effective_address(&self, regs: &GuestRegs) -> u64 {
        let b = self.base.map_or(0, |r| regs.get(r));
        let i = self
            .index
            .map_or(0, |r| regs.get(r).wrapping_mul(u64::from(self.scale)));
        b.wrapping_add(i).wrapping_add(self.disp)
    }
}

impl MemOperand {
    const EMPTY: MemOperand = MemOperand {
        base: None,
        index: None,
        scale: 1,
        disp: 0,
        size: 0,
        access: 0,
        seg: SegBase::Flat,
    };
}

/// Most memory operands one x86 instruction has (explicit + implicit, e.g. `push [m]`).
pub const MAX_MEM_OPERANDS: usize = 4;

/// The memory operands of an instruction (a fixed-capacity list; dereferences to a slice).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemOps {
    ops: [MemOperand; MAX_MEM_OPERANDS],
    len: u8,
}

impl Default for MemOps {
    fn default() -> Self {
        Self {
            ops: [MemOperand::EMPTY; MAX_MEM_OPERANDS],
            len: 0,
        }
    }
}

impl MemOps {
    /// Appends an operand; returns `false` (and drops it) when full.
    pub fn push(&mut self, m: MemOperand) -> bool {
        let n = usize::from(self.len);
        if n >= MAX_MEM_OPERANDS {
            return false;
        }
        self.ops[n] = m;
        self.len += 1;
        true
    }
}

impl core::ops::Deref for MemOps {
    type Target = [MemOperand];
    fn deref(&self) -> &[MemOperand] {
        &self.ops[..usize::from(self.len)]
    }
}

/// Coarse kind of an instruction, for tools.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InsKind {
    /// Falls through.
    Plain,
    /// `jcc`, `loop*`, `jrcxz`.
    CondBranch,
    /// Direct `jmp`.
    Jump,
    /// Direct `call`.
    Call,
    /// `jmp r/m`.
    IndirectJump,
    /// `call r/m`.
    IndirectCall,
    /// `ret`.
    Return,
}

/// An instruction of a trace as tools see it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InsInfo {
    /// Guest address.
    pub address: GuestVirt,
    /// Length in bytes.
    pub len: u8,
    /// Kind.
    pub kind: InsKind,
    /// Memory operands, explicit and implicit (for `rep` string instructions, one element).
    pub mem: MemOps,
    /// Has a `rep`/`repe`/`repne` prefix and is a string instruction.
    pub rep: bool,
    /// Opcode class (the decoder's mnemonic number), for instruction-mix tools.
    pub opcode: u16,
}

/// A basic block: a run of instructions with one entry, ending at a branch or trace end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bbl {
    /// Index of its first instruction in the trace.
    pub first: usize,
    /// Number of instructions.
    pub count: usize,
    /// Guest address of the first instruction.
    pub address: GuestVirt,
}

/// One memory-reference record, as appended inline by generated code.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct MemRecord {
    /// Guest address of the instruction.
    pub ip: u64,
    /// Effective virtual address.
    pub ea: u64,
    /// Access size in bytes.
    pub size: u32,
    /// [`access`] bits.
    pub access: u32,
    /// Physical address, when the tool asked for physical addresses
    /// (`Config::records_need_pa` or [`Tool::records_need_pa`]): resolved by the engine
    /// before anything can change the mapping the access used (records are delivered
    /// before every emulated instruction and whenever the engine stops), `u64::MAX` if
    /// the address does not translate; else unspecified.
    pub pa: u64,
}

impl MemRecord {
    /// The virtual CPL the access was made at (0 kernel, 3 user).
    pub fn cpl(&self) -> u8 {
        (self.access >> access::CPL_SHIFT & 3) as u8
    }
}

/// Where an insertion goes relative to its instruction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IPoint {
    /// Before the instruction executes.
    Before,
    /// After it, on the fall-through path.
    After,
}

/// An argument of an analysis call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IArg {
    /// The instruction's guest address.
    InstPtr,
    /// Effective virtual address (FS/GS base included) of memory operand `n`.
    MemEa(u8),
    /// Physical address of memory operand `n` (resolved by the engine: "needs PA").
    MemPa(u8),
    /// Size of memory operand `n`.
    MemSize(u8),
    /// Value of a guest register before the instruction.
    Reg(Gpr),
    /// A constant.
    Const(u64),
}

impl IArg {
    /// Whether evaluating this argument needs a physical address.
    pub fn needs_pa(self) -> bool {
        matches!(self, IArg::MemPa(_))
    }
}

/// An inline counter slot allocated in the code-cache region.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CounterId(pub u32);

/// A planned analysis call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CallSpec {
    /// Routine number passed to [`Tool::analyze`].
    pub routine: u32,
    /// Arguments.
    pub args: Vec<IArg>,
    /// Instruction the call belongs to.
    pub ins: InsInfo,
}

/// What an insertion does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Action {
    Counter {
        id: CounterId,
        amount: i32,
    },
    MemRecords,
    /// A fetch record for the instruction (`Tool::records_fetches`).
    FetchRecord,
    /// A fetch record for a `call` or `ret` (`Tool::fetch_runs`): `flow` is its
    /// `access::CALL`/`access::RET` bit.
    FetchFlowRecord {
        flow: u32,
    },
    /// One fetch record for the instruction and the `n − 1` after it, of lengths `lens`
    /// (4 bits each; `Tool::fetch_runs`); `flow`: the last one's `access::CALL`/`RET` bit.
    FetchRun {
        n: u8,
        lens: u64,
        flow: u32,
    },
    /// The instruction's fetch goes into its first operand record (`access::WITH_FETCH`;
    /// a fetch record of its own if it appends none); `flow`: its `access::CALL`/`RET`
    /// bit.
    FetchInRecords {
        flow: u32,
    },
    Call(usize),
}

/// One insertion request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Insertion {
    pub ins: usize,
    pub point: IPoint,
    pub action: Action,
}

/// Counter slots allocated so far (never reset by a cache flush).
#[derive(Debug, Default)]
pub(crate) struct CounterAlloc {
    pub next: u32,
}

/// The view of one trace handed to a tool, and the sink of its insertions.
pub struct TraceInstrumenter<'a> {
    address: GuestVirt,
    physical: GuestPhys,
    mode: Mode,
    insns: &'a [InsInfo],
    bbls: &'a [Bbl],
    counters: &'a mut CounterAlloc,
    pub(crate) insertions: Vec<Insertion>,
    pub(crate) calls: Vec<CallSpec>,
}

impl<'a> TraceInstrumenter<'a> {
    pub(crate) fn new(
        address: GuestVirt,
        physical: GuestPhys,
        mode: Mode,
        insns: &'a [InsInfo],
        bbls: &'a [Bbl],
        counters: &'a mut CounterAlloc,
    ) -> Self {
        Self {
            address,
            physical,
            mode,
            insns,
            bbls,
            counters,
            insertions: Vec::new(),
            calls: Vec::new(),
        }
    }

    /// Guest address of the trace's first instruction.
    pub fn address(&self) -> GuestVirt {
        self.address
    }

    /// Guest physical address of the trace's first instruction, as the trace was
    /// translated from (traces are keyed by it: the same code at another physical address
    /// is another trace). Every instruction of a trace starts on that first page, so an
    /// instruction's physical address is this plus its offset from
    /// [`TraceInstrumenter::address`]. The same file page is the same code whatever
    /// process or virtual address runs it: user code is named by it
    /// (`processes.json`'s `code_pages`).
    pub fn physical(&self) -> GuestPhys {
        self.physical
    }

    /// The mode the trace is translated for (its virtual CPL: [`Mode::cpl`]); the same
    /// code translated in another mode is another trace.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// The trace's instructions in order.
    pub fn instructions(&self) -> &[InsInfo] {
        self.insns
    }

    /// The trace's basic blocks in order.
    pub fn bbls(&self) -> &[Bbl] {
        self.bbls
    }

    /// Allocates a new zeroed inline counter.
    pub fn alloc_counter(&mut self) -> Result<CounterId, EngineError> {
        if self.counters.next as usize >= COUNTER_SLOTS {
            return Err(EngineError::CountersExhausted);
        }
        self.counters.next += 1;
        Ok(CounterId(self.counters.next - 1))
    }

    /// Adds `amount` to counter `id` at `point` of instruction `ins`.
    pub fn insert_counter(&mut self, ins: usize, point: IPoint, id: CounterId, amount: i32) {
        if ins < self.insns.len() {
            self.insertions.push(Insertion {
                ins,
                point,
                action: Action::Counter { id, amount },
            });
        }
    }

    /// Adds `amount` to counter `id` each time basic block `bbl` executes.
    pub fn insert_bbl_counter(&mut self, bbl: usize, id: CounterId, amount: i32) {
        if let Some(b) = self.bbls.get(bbl) {
            let first = b.first;
            self.insert_counter(first, IPoint::Before, id, amount);
        }
    }

    /// Appends one [`MemRecord`] per memory operand of `ins` before it executes.
    pub fn insert_mem_records(&mut self, ins: usize) {
        if self.insns.get(ins).is_some_and(|i| !i.mem.is_empty()) {
            self.insertions.push(Insertion {
                ins,
                point: IPoint::Before,
                action: Action::MemRecords,
            });
        }
    }

    /// Calls `Tool::analyze(routine, args)` at `point` of instruction `ins`.
    pub fn insert_call(&mut self, ins: usize, point: IPoint, routine: u32, args: &[IArg]) {
        let Some(info) = self.insns.get(ins) else {
            return;
        };
        self.calls.push(CallSpec {
            routine,
            args: args.to_vec(),
            ins: info.clone(),
        });
        let idx = self.calls.len() - 1;
        self.insertions.push(Insertion {
            ins,
            point,
            action: Action::Call(idx),
        });
    }
}

/// A tool (pintool): instruments traces and receives analysis calls and buffers.
pub trait Tool {
    /// Called once per trace at translation time.
    fn instrument_trace(&mut self, trace: &mut TraceInstrumenter<'_>) {
        let _ = trace;
    }
    /// An analysis call inserted with [`TraceInstrumenter::insert_call`].
    fn analyze(&mut self, routine: u32, args: &[u64]) {
        let _ = (routine, args);
    }
    /// A batch of memory-reference records (buffer full, an instruction about to be
    /// emulated, or the run stopped). Records of an instruction that faulted are dropped
    /// before delivery (it did not execute; it records again when it runs again), except
    /// those already delivered because the buffer filled at that instruction.
    fn buffer_full(&mut self, records: &[MemRecord]) {
        let _ = records;
    }
    /// Whether the engine appends an [`access::FETCH`] record to the buffer before every
    /// guest instruction executes (translated or emulated), ahead of the instruction's
    /// memory records. Asked at each translation.
    fn records_fetches(&self) -> bool {
        false
    }
    /// With [`Tool::records_fetches`]: whether one record ([`access::FETCH_RUN`]) may stand
    /// for the fetches of a run of instructions of one basic block that have no other
    /// insertions (no memory records or calls), in order, so the stream of references is
    /// the same; fewer records to append and to feed. A fault inside a run trims it to the
    /// instructions before the faulting one.
    fn fetch_runs(&self) -> bool {
        false
    }
    /// Whether records carry physical addresses (as `Config::records_need_pa`).
    fn records_need_pa(&self) -> bool {
        false
    }
    /// With [`Tool::fetch_runs`]: whether a `call`'s or `ret`'s fetch has an
    /// [`access::FETCH`] record of its own ([`access::CALL`]/[`access::RET`]) even where
    /// its operand record could carry it, so that the stack access's record keeps the
    /// slot's virtual address: what names the stack a kernel call runs on (its
    /// `THREAD_SIZE`-aligned block), for a shadow call stack per kernel stack.
    fn call_stack_records(&self) -> bool {
        false
    }
    /// Whether the engine puts an [`access::TASK`] record among this tool's records where
    /// the running task changes: for a tool whose records go to the host, which has no
    /// other way to tell tasks apart (the engine image's wrapper of such a tool answers
    /// yes). Asked at each change.
    fn task_records(&self) -> bool {
        false
    }
}

/// The tool that inserts nothing (null translation).
#[derive(Debug, Default)]
pub struct NullTool;

impl Tool for NullTool {}

/// Physical address resolution used for `IArg::MemPa` and records: a data access at
/// `va`, or an instruction fetch when `fetch`.
pub(crate) fn resolve_pa<M: crate::guest_memory::GuestMemory + ?Sized>(
    mem: &mut M,
    mode: Mode,
    va: u64,
    fetch: bool,
) -> u64 {
    let page = GuestVirt(va).page();
    let pa = if fetch {
        mem.translate(page, mode)
    } else {
        mem.translate_data(page, mode)
    };
    pa.map_or(u64::MAX, |p: GuestPhys| p.0 + (va - page.0))
}
