//! Which guest task runs, learned at the events where it may have changed, and the guest
//! instructions charged to each task (issue #27's first slice; `docs/processes.md`).
//!
//! The virtual CPU calls [`TaskWatch::on_user_entry`] whenever the guest enters CPL 3
//! (`sysretq`, `iretq`, any transition through `Vcpu::cpl_changed`): the task that runs is
//! final there. With the kernel's types ([`KernelTypes`], from its BTF, in the attach
//! block) the watch reads `current` (the per-CPU `struct task_struct *` at the kernel's
//! per-CPU base, which at CPL 3 is in KERNEL_GS_BASE) and the task's `comm` (a task may
//! rename itself at any time), and, only when one of them or the address space changed,
//! its `pid` and `tgid`; without them it keys tasks by address space (CR3 without PCID
//! and the PTI bit, [`address_space`]). When a task gets a row of its own, the watch also
//! reads the path of its executable file (`task->mm->exe_file->f_path.dentry`, its name
//! and up to [`EXE_COMPONENTS`] components up `d_parent`: [`read_exe`]); busybox's applets
//! show `busybox` there while `comm` is the applet's name.
//!
//! Code origins (`origins.rs`, `vmas.rs`): the engine tells the watch of every user trace
//! it translates ([`TaskWatch::on_user_code`]); a physical page not yet known as mapped
//! there is looked up in the running task's VMAs (the maple tree `mm->mm_mt`) and its file
//! and file offset remembered, for the host to name user code by physical address.
//! Task records: at each change of the running row the watch leaves the row's index for
//! the engine ([`TaskWatch::take_switch`]), which puts an `access::TASK` record among the
//! records of a tool that takes them (`Tool::task_records`).
//!
//! Charging rule: at each change the guest instructions executed since the last change
//! (per CPL, from the engine's own counters, [`InsnCounts`]) go to the task that ran
//! until then; the first task's predecessor is the boot row (the kernel before the first
//! entry to user mode). So a task's kernel instructions are those from its own return to
//! user mode until the next different task's return to user mode: kernel threads and
//! the idle loop, which never return to user mode, are charged to the user task before
//! them. Every instruction is charged to exactly one row: the rows' sums equal the
//! engine's totals.
//!
//! Invariants: nothing here runs per guest instruction, only at CPL-3 entries (two guest
//! reads, `current` and its `comm`; more reads and a row lookup only at a change, the
//! executable's at most `3 + 4 * EXE_COMPONENTS` only for a new row), and at translations
//! of user traces (a lookup; a walk only for a page not known there); a read that faults
//! is skipped and counted ([`WatchStats::reads_failed`], [`WatchStats::exe_reads_failed`],
//! [`WatchStats::origin_walk_failures`]), never delivered to the guest; the table never
//! grows past [`MAX_TASKS`] rows (the rest share an overflow row).

use alloc::string::String;
use alloc::vec::Vec;
use core::fmt::Write;

use kpin_abi::attach::KernelTypes;

use crate::guest_memory::Mode;
use crate::layout::INSN_COUNTER_SPREAD;
use crate::vcpu::{MODE_KERNEL, MODE_USER};
use crate::Engine;

mod exe;
mod origins;
#[cfg(test)]
mod test_guest;
#[cfg(test)]
mod tests;
mod vmas;

pub use exe::{read_exe, ExePath, Unreadable, EXE_BYTES, EXE_COMPONENTS};
pub use origins::{CodeOrigin, CodeOrigins, Noted, ANON, MAX_CODE_PAGES, MAX_OBJECTS, VDSO};
pub use vmas::{find_vma, Vma, VmaMiss, MAX_DEPTH};

/// Rows the table holds, the boot row and the overflow row included.
pub const MAX_TASKS: usize = 512;
/// Bytes of a task's name kept (`TASK_COMM_LEN`).
pub const COMM_BYTES: usize = 16;
/// Lowest kernel (upper-half) address.
const KERNEL_HALF: u64 = 0xffff_8000_0000_0000;
/// `cr3` without PCID (bits 0–11), the PTI user/kernel bit (12) and the no-flush bit
/// (63): one value per address space.
pub const fn address_space(cr3: u64) -> u64 {
    cr3 & 0x000f_ffff_ffff_e000
}

/// The engine's guest-instruction counters, readable without the `Engine` (the virtual
/// CPU reads them at a task change, inside a run). Valid as long as the engine that made
/// it lives (its code-cache region does).
#[derive(Clone, Copy, Debug)]
pub struct InsnCounts {
    /// The first of the user mode's counter slots, then the kernel mode's.
    slots: [*const u64; 2],
}

impl InsnCounts {
    /// Counters at `user` and `kernel`, each [`INSN_COUNTER_SPREAD`] `u64`s.
    ///
    /// # Safety
    ///
    /// Both must point to that many readable `u64`s for as long as the value is used.
    pub unsafe fn from_raw(user: *const u64, kernel: *const u64) -> Self {
        InsnCounts {
            slots: [user, kernel],
        }
    }

    /// Guest instructions executed so far, `[user (CPL 3), kernel (CPL 0)]`: what
    /// `Engine::executed_insns` says for `MODE_USER` and `MODE_KERNEL`.
    pub fn read(&self) -> [u64; 2] {
        self.slots.map(|p| {
            (0..INSN_COUNTER_SPREAD).fold(0u64, |sum, h| {
                // SAFETY: `from_raw`'s contract: INSN_COUNTER_SPREAD readable slots.
                sum.wrapping_add(unsafe { p.add(h).read_volatile() })
            })
        })
    }
}

impl Engine {
    /// The engine's instruction counters for a [`TaskWatch`] (`None` without
    /// `Config::count_insns`).
    pub fn insn_counts(&self) -> Option<InsnCounts> {
        let base = self.insn_counters?;
        let at = |mode: Mode| -> Option<*const u64> {
            let slot = base.0 as usize + mode.slot()? * INSN_COUNTER_SPREAD;
            Some((self.cache.counters() + 8 * slot as u64) as *const u64)
        };
        // SAFETY: the engine's own counter slots lie in the counter area of its region,
        // which lives as long as the engine (`executed_insns` reads the same slots).
        Some(unsafe { InsnCounts::from_raw(at(MODE_USER)?, at(MODE_KERNEL)?) })
    }
}

/// What a row of the table stands for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowKind {
    /// The kernel before the first entry to user mode.
    Boot,
    /// A task, named from its `task_struct`.
    Task,
    /// An address space (no kernel types).
    AddressSpace,
    /// The tasks seen after the table was full.
    Overflow,
}

impl RowKind {
    /// Its name in `processes.json`.
    pub fn name(self) -> &'static str {
        match self {
            RowKind::Boot => "boot",
            RowKind::Task => "task",
            RowKind::AddressSpace => "address_space",
            RowKind::Overflow => "overflow",
        }
    }
}

/// Who ran: a task (its `task_struct` address, pid, tgid, name) or an address space.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TaskKey {
    /// Row kind ([`RowKind::Task`] or [`RowKind::AddressSpace`] for a key looked up).
    pub kind: RowKind,
    /// The `task_struct`'s guest-virtual address (0 for an address space).
    pub task: u64,
    /// The address space ([`address_space`]) when first seen (the key of an address-space
    /// row).
    pub space: u64,
    /// `task_struct.pid` (-1: unknown).
    pub pid: i32,
    /// `task_struct.tgid` (-1: unknown).
    pub tgid: i32,
    /// `task_struct.comm`, NUL-padded.
    pub comm: [u8; COMM_BYTES],
}

impl TaskKey {
    fn same(&self, other: &TaskKey) -> bool {
        match self.kind {
            RowKind::AddressSpace => {
                other.kind == RowKind::AddressSpace && self.space == other.space
            }
            // One task_struct may be reused by a new task (another pid) and renamed by an
            // exec (another comm): each is a row of its own.
            _ => {
                self.kind == other.kind
                    && self.task == other.task
                    && self.pid == other.pid
                    && self.tgid == other.tgid
                    && self.comm == other.comm
            }
        }
    }

    fn special(kind: RowKind) -> Self {
        TaskKey {
            kind,
            task: 0,
            space: 0,
            pid: -1,
            tgid: -1,
            comm: [0; COMM_BYTES],
        }
    }
}

/// One row: who, when, and the instructions charged to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TaskRow {
    /// Who.
    pub key: TaskKey,
    /// Guest instructions (both CPLs) executed when it first ran.
    pub first_seen: u64,
    /// Guest instructions (both CPLs) executed when it last stopped running (or at the
    /// report).
    pub last_seen: u64,
    /// Times it became the running row.
    pub entries: u64,
    /// Instructions charged at CPL 3.
    pub user: u64,
    /// Instructions charged at CPL 0.
    pub kernel: u64,
    /// The path of its executable, read when the row was made (`None`: none, not read, or
    /// unreadable).
    pub exe: Option<ExePath>,
}

/// The rows and which one runs; pure bookkeeping (host-tested).
#[derive(Clone, Debug)]
pub struct TaskTable {
    rows: Vec<TaskRow>,
    current: usize,
    /// The counts `[user, kernel]` already charged.
    charged: [u64; 2],
}

impl TaskTable {
    /// A table whose boot row runs from `counts` on.
    pub fn new(counts: [u64; 2]) -> Self {
        let mut rows = Vec::with_capacity(MAX_TASKS);
        let at = counts[0].wrapping_add(counts[1]);
        rows.push(TaskRow {
            key: TaskKey::special(RowKind::Boot),
            first_seen: at,
            last_seen: at,
            entries: 1,
            user: 0,
            kernel: 0,
            exe: None,
        });
        TaskTable {
            rows,
            current: 0,
            charged: counts,
        }
    }

    /// Charges the instructions executed since the last charge (`counts` now) to the
    /// running row.
    pub fn charge(&mut self, counts: [u64; 2]) {
        let row = &mut self.rows[self.current];
        row.user = row
            .user
            .wrapping_add(counts[0].wrapping_sub(self.charged[0]));
        row.kernel = row
            .kernel
            .wrapping_add(counts[1].wrapping_sub(self.charged[1]));
        row.last_seen = counts[0].wrapping_add(counts[1]);
        self.charged = counts;
    }

    /// `key` runs from `counts` on: the instructions until now go to the row that ran.
    /// True if `key` got a row of its own just now.
    pub fn switch_to(&mut self, key: &TaskKey, counts: [u64; 2]) -> bool {
        self.charge(counts);
        if self.rows[self.current].key.same(key) {
            return false;
        }
        let rows = self.rows.len();
        let at = counts[0].wrapping_add(counts[1]);
        let found = self.rows.iter().rposition(|r| r.key.same(key));
        let i = match found {
            Some(i) => i,
            None if self.rows.len() < MAX_TASKS - 1 => self.add(*key, at),
            None => match self
                .rows
                .iter()
                .position(|r| r.key.kind == RowKind::Overflow)
            {
                Some(i) => i,
                None => self.add(TaskKey::special(RowKind::Overflow), at),
            },
        };
        self.rows[i].entries += 1;
        self.rows[i].last_seen = at;
        self.current = i;
        self.rows.len() > rows && self.rows[i].key.same(key)
    }

    /// Sets the running row's executable.
    pub fn set_exe(&mut self, exe: Option<ExePath>) {
        self.rows[self.current].exe = exe;
    }

    fn add(&mut self, key: TaskKey, at: u64) -> usize {
        self.rows.push(TaskRow {
            key,
            first_seen: at,
            last_seen: at,
            entries: 0,
            user: 0,
            kernel: 0,
            exe: None,
        });
        self.rows.len() - 1
    }

    /// The rows, the boot row first, then in the order first seen.
    pub fn rows(&self) -> &[TaskRow] {
        &self.rows
    }

    /// The counts charged so far, `[user, kernel]`.
    pub fn charged(&self) -> [u64; 2] {
        self.charged
    }
}

/// What the watch did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WatchStats {
    /// Entries to CPL 3 seen.
    pub user_entries: u64,
    /// Changes of the running task (or address space) charged.
    pub switches: u64,
    /// Guest reads that faulted, or a kernel per-CPU base or task pointer that was not a
    /// kernel address: that entry was skipped.
    pub reads_failed: u64,
    /// New rows whose executable could not be read (a read faulted or a pointer was not a
    /// kernel address): the row has no `exe`.
    pub exe_reads_failed: u64,
    /// TSC cycles spent in the watch (its whole cost), as the embedder measured them.
    pub cycles: u64,
    /// Walks of the running task's VMAs for a user code page not known there.
    pub origin_walks: u64,
    /// Walks that found no VMA containing the page (a read faulted, a node or pointer was
    /// not what it should be, a gap): the page's origin is unchanged.
    pub origin_walk_failures: u64,
    /// Pages (or new objects) not recorded because the table was full
    /// ([`MAX_CODE_PAGES`], [`MAX_OBJECTS`]).
    pub origins_dropped: u64,
}

/// The task watch the virtual CPU drives (`Vcpu::tasks`).
#[derive(Debug)]
pub struct TaskWatch {
    /// The kernel's types (`None`: keyed by address space).
    types: Option<KernelTypes>,
    counts: InsnCounts,
    /// The rows, charged up to the last change.
    table: TaskTable,
    last_task: u64,
    last_space: u64,
    last_comm: [u8; COMM_BYTES],
    /// Where user code came from (`None`: the types do not locate VMAs).
    origins: Option<CodeOrigins>,
    /// The row that runs since the last change not yet taken ([`TaskWatch::take_switch`]).
    switched: Option<u64>,
    /// What it did.
    pub stats: WatchStats,
}

impl TaskWatch {
    /// A watch over the engine's `counts`, naming tasks from `types` if they are known.
    pub fn new(types: &KernelTypes, counts: InsnCounts) -> Self {
        TaskWatch {
            types: types.is_known().then_some(*types),
            counts,
            table: TaskTable::new(counts.read()),
            last_task: 0,
            last_space: u64::MAX,
            last_comm: [0; COMM_BYTES],
            origins: types.knows_vmas().then(CodeOrigins::new),
            switched: None,
            stats: WatchStats::default(),
        }
    }

    /// Whether the origins of user code are recorded (the types locate VMAs).
    pub fn records_origins(&self) -> bool {
        self.origins.is_some()
    }

    /// The origins of user code recorded so far.
    pub fn origins(&self) -> Option<&CodeOrigins> {
        self.origins.as_ref()
    }

    /// The engine translated a user trace at `va` (physical `pa`) with `cr3`; `gs_bases`
    /// and `read` as for [`TaskWatch::on_user_entry`]. A page not known as mapped there
    /// is looked up in the running task's VMAs (`current->mm`), and its origin recorded.
    pub fn on_user_code(
        &mut self,
        va: u64,
        pa: u64,
        cr3: u64,
        gs_bases: [u64; 2],
        read: &mut dyn FnMut(u64, &mut [u8]) -> bool,
    ) {
        let (Some(origins), Some(t)) = (&mut self.origins, &self.types) else {
            return;
        };
        let space = address_space(cr3);
        if origins.known(pa >> 12, space, va & !0xfff) {
            return;
        }
        self.stats.origin_walks += 1;
        let mm = kernel_percpu_base(gs_bases)
            .and_then(|base| {
                let mut w = [0u8; 8];
                read(base.wrapping_add(t.current_task), &mut w).then(|| u64::from_le_bytes(w))
            })
            .filter(|&task| task >= KERNEL_HALF)
            .and_then(|task| {
                let mut w = [0u8; 8];
                read(task.wrapping_add(u64::from(t.task_mm)), &mut w).then(|| u64::from_le_bytes(w))
            });
        let Some(mm) = mm else {
            self.stats.origin_walk_failures += 1;
            return;
        };
        match origins.note(t, va, pa, space, mm, read) {
            Noted::Known | Noted::Recorded => {}
            Noted::Dropped => self.stats.origins_dropped += 1,
            Noted::Failed(_) => self.stats.origin_walk_failures += 1,
        }
    }

    /// The row (its index in `processes.json`'s `processes`) that runs since the last
    /// change of the running row, if it changed since the last call.
    pub fn take_switch(&mut self) -> Option<u64> {
        self.switched.take()
    }

    /// Whether tasks are named from the kernel's types (else keyed by address space).
    pub fn by_task(&self) -> bool {
        self.types.is_some()
    }

    /// Whether tasks' executables are read too.
    pub fn reads_exe(&self) -> bool {
        self.types.is_some_and(|t| t.knows_exe())
    }

    /// The guest has just entered CPL 3 with `cr3`; `gs_bases` are its GS base and
    /// KERNEL_GS_BASE, one of which is the kernel's per-CPU base; `read` reads guest
    /// memory as the kernel would (false: it faulted).
    pub fn on_user_entry(
        &mut self,
        cr3: u64,
        gs_bases: [u64; 2],
        read: &mut dyn FnMut(u64, &mut [u8]) -> bool,
    ) {
        self.stats.user_entries += 1;
        let space = address_space(cr3);
        let Some(t) = self.types else {
            if space != self.last_space {
                self.last_space = space;
                let key = TaskKey {
                    kind: RowKind::AddressSpace,
                    space,
                    ..TaskKey::special(RowKind::AddressSpace)
                };
                self.switch(&key);
            }
            return;
        };
        // At CPL 3 the kernel's base is in KERNEL_GS_BASE (after its `swapgs`); a kernel
        // that returned without one still has it in GS.
        let Some(base) = kernel_percpu_base(gs_bases) else {
            self.stats.reads_failed += 1;
            return;
        };
        let mut word = [0u8; 8];
        if !read(base.wrapping_add(t.current_task), &mut word) {
            self.stats.reads_failed += 1;
            return;
        }
        let task = u64::from_le_bytes(word);
        if task < KERNEL_HALF {
            self.stats.reads_failed += 1;
            return;
        }
        // The name too, every time: a task renames itself without another event
        // (`prctl(PR_SET_NAME)`, which busybox does for an applet it runs without exec).
        let mut comm = [0u8; COMM_BYTES];
        let n = (t.comm_bytes as usize).min(COMM_BYTES);
        if !read(task.wrapping_add(u64::from(t.task_comm)), &mut comm[..n]) {
            self.stats.reads_failed += 1;
            return;
        }
        if task == self.last_task && space == self.last_space && comm == self.last_comm {
            return;
        }
        match read_ids(&t, task, read) {
            Some((pid, tgid)) => {
                self.last_task = task;
                self.last_space = space;
                self.last_comm = comm;
                let key = TaskKey {
                    kind: RowKind::Task,
                    task,
                    space,
                    pid,
                    tgid,
                    comm,
                };
                if self.switch(&key) && t.knows_exe() {
                    match read_exe(&t, task, read) {
                        Ok(exe) => self.table.set_exe(exe),
                        Err(Unreadable) => self.stats.exe_reads_failed += 1,
                    }
                }
            }
            None => self.stats.reads_failed += 1,
        }
    }

    /// True if `key` got a new row.
    fn switch(&mut self, key: &TaskKey) -> bool {
        self.stats.switches += 1;
        let before = self.table.current;
        let new = self.table.switch_to(key, self.counts.read());
        if self.table.current != before {
            self.switched = Some(self.table.current as u64);
        }
        new
    }

    /// The table as a report sees it now: the instructions since the last change charged
    /// to the running row (the watch itself goes on unchanged, so a later report charges
    /// the same way).
    pub fn report_table(&self) -> TaskTable {
        let mut t = self.table.clone();
        t.charge(self.counts.read());
        t
    }

    /// `processes.json` now: how tasks were keyed, the totals charged, what the watch did,
    /// and the rows of [`TaskWatch::report_table`] (`docs/processes.md`).
    pub fn to_json(&self) -> String {
        let table = self.report_table();
        let mut j = String::new();
        let [user, kernel] = table.charged();
        let s = &self.stats;
        let _ = write!(
            j,
            "{{\"by\":\"{}\",\"user_instructions\":{user},\"kernel_instructions\":{kernel},\"user_entries\":{},\"switches\":{},\"reads_failed\":{},\"exe_reads_failed\":{},\"watch_cycles\":{},\"origin_walks\":{},\"origin_walk_failures\":{},\"origins_dropped\":{},\"processes\":[",
            if self.by_task() { "task" } else { "address_space" },
            s.user_entries,
            s.switches,
            s.reads_failed,
            s.exe_reads_failed,
            s.cycles,
            s.origin_walks,
            s.origin_walk_failures,
            s.origins_dropped
        );
        for (i, r) in table.rows().iter().enumerate() {
            if i > 0 {
                j.push(',');
            }
            row_json(&mut j, r);
        }
        j.push_str("],");
        match &self.origins {
            Some(o) => o.write_json(&mut j),
            None => j.push_str("\"objects\":[],\"code_pages\":[]"),
        }
        j.push_str("}\n");
        j
    }
}

/// One row as a JSON object.
fn row_json(j: &mut String, r: &TaskRow) {
    let k = &r.key;
    let _ = write!(j, "{{\"kind\":\"{}\",", k.kind.name());
    if k.kind == RowKind::Task {
        let _ = write!(j, "\"pid\":{},\"tgid\":{},\"comm\":", k.pid, k.tgid);
        json_string(j, &k.comm);
        let _ = write!(j, ",\"task\":\"{:#x}\",", k.task);
    } else {
        j.push_str("\"pid\":null,\"tgid\":null,\"comm\":null,\"task\":null,");
    }
    match &r.exe {
        Some(exe) => {
            j.push_str("\"exe\":");
            json_string(j, exe.name());
            j.push_str(",\"exe_path\":");
            json_string(j, exe.path());
            j.push(',');
        }
        None => j.push_str("\"exe\":null,\"exe_path\":null,"),
    }
    let _ = write!(
        j,
        "\"cr3\":\"{:#x}\",\"first_seen\":{},\"last_seen\":{},\"entries\":{},\"user_instructions\":{},\"kernel_instructions\":{}}}",
        k.space, r.first_seen, r.last_seen, r.entries, r.user, r.kernel
    );
}

/// `bytes` up to the first NUL as a JSON string: printable ASCII as is (quote and
/// backslash escaped), every other byte as `\u00XX` (a task names itself: any bytes).
fn json_string(j: &mut String, bytes: &[u8]) {
    j.push('"');
    for &b in bytes.iter().take_while(|&&b| b != 0) {
        match b {
            b'"' => j.push_str("\\\""),
            b'\\' => j.push_str("\\\\"),
            0x20..=0x7e => j.push(char::from(b)),
            _ => {
                let _ = write!(j, "\\u{b:04x}");
            }
        }
    }
    j.push('"');
}

/// The kernel's per-CPU base among the GS bases `[gs, kernel_gs]`: KERNEL_GS_BASE if it is
/// a kernel address, else GS if it is.
pub fn kernel_percpu_base(gs_bases: [u64; 2]) -> Option<u64> {
    let [gs, kernel_gs] = gs_bases;
    [kernel_gs, gs].into_iter().find(|&b| b >= KERNEL_HALF)
}

/// `pid` and `tgid` of the task at `task`.
fn read_ids(
    t: &KernelTypes,
    task: u64,
    read: &mut dyn FnMut(u64, &mut [u8]) -> bool,
) -> Option<(i32, i32)> {
    let mut four = [0u8; 4];
    read(task.wrapping_add(u64::from(t.task_pid)), &mut four).then_some(())?;
    let pid = i32::from_le_bytes(four);
    read(task.wrapping_add(u64::from(t.task_tgid)), &mut four).then_some(())?;
    Some((pid, i32::from_le_bytes(four)))
}
