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
//! executable's at most `3 + 4 * EXE_COMPONENTS` only for a new row); a read that faults is
//! skipped and counted ([`WatchStats::reads_failed`], [`WatchStats::exe_reads_failed`]),
//! never delivered to the guest; the table never grows past [`MAX_TASKS`] rows (the rest
//! share an overflow row).

use alloc::string::String;
use alloc::vec::Vec;
use core::fmt::Write;

use kpin_abi::attach::KernelTypes;

use crate::guest_memory::Mode;
use crate::layout::INSN_COUNTER_SPREAD;
use crate::vcpu::{MODE_KERNEL, MODE_USER};
use crate::Engine;

/// Rows the table holds, the boot row and the overflow row included.
pub const MAX_TASKS: usize = 512;
/// Bytes of a task's name kept (`TASK_COMM_LEN`).
pub const COMM_BYTES: usize = 16;
/// Lowest kernel (upper-half) address.
const KERNEL_HALF: u64 = 0xffff_8000_0000_0000;
/// Bytes of an executable's path kept (a longer path keeps its end, after `...`).
pub const EXE_BYTES: usize = 96;
/// Path components read up from the executable's dentry: its name and 7 directories
/// (a deeper path starts with `...`).
pub const EXE_COMPONENTS: usize = 8;
/// Bytes of one path component read (a longer name is cut).
const COMPONENT_BYTES: usize = 64;
/// What marks a path that does not reach its file system's root.
const CUT: &[u8] = b"...";

/// The path of a task's executable, as far as [`read_exe`] walked it: `/bin/busybox`, or
/// `.../lib/x` when cut, relative to the root of the file system that holds it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct ExePath {
    bytes: [u8; EXE_BYTES],
    len: u8,
}

impl ExePath {
    /// The path's bytes.
    pub fn path(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }

    /// The file's own name: the path's last component.
    pub fn name(&self) -> &[u8] {
        let p = self.path();
        p.rsplit(|&b| b == b'/').next().unwrap_or(p)
    }
}

impl core::fmt::Debug for ExePath {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "ExePath({:?})", core::str::from_utf8(self.path()))
    }
}

/// A path built from its end: components are put in front.
struct PathFromEnd {
    buf: [u8; EXE_BYTES],
    start: usize,
}

impl PathFromEnd {
    fn new() -> Self {
        PathFromEnd {
            buf: [0; EXE_BYTES],
            start: EXE_BYTES,
        }
    }

    /// Puts `/name` in front, keeping room for [`CUT`]; false if it does not fit.
    fn push(&mut self, name: &[u8]) -> bool {
        if self.start < name.len() + 1 + CUT.len() {
            return false;
        }
        self.start -= name.len();
        self.buf[self.start..self.start + name.len()].copy_from_slice(name);
        self.start -= 1;
        self.buf[self.start] = b'/';
        true
    }

    /// The path; `cut`: it did not reach the root, so it starts with [`CUT`].
    fn finish(mut self, cut: bool) -> ExePath {
        if cut {
            self.start -= CUT.len();
            self.buf[self.start..self.start + CUT.len()].copy_from_slice(CUT);
        }
        let len = EXE_BYTES - self.start;
        let mut bytes = [0; EXE_BYTES];
        bytes[..len].copy_from_slice(&self.buf[self.start..]);
        ExePath {
            bytes,
            len: len as u8,
        }
    }
}

/// A read on the way to an executable faulted, or a pointer was not a kernel address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Unreadable;

/// The path of the executable of the task at `task` (`Ok(None)`: it has none: no `mm`, as
/// a kernel thread or an exiting task, or no `exe_file`; `Err`: a read faulted or a
/// pointer was not a kernel address). Reads `mm`, `exe_file` and its dentry, then per
/// component its name's length, pointer and bytes and `d_parent`, up to
/// [`EXE_COMPONENTS`] components or the root (the dentry that is its own parent).
pub fn read_exe(
    t: &KernelTypes,
    task: u64,
    read: &mut dyn FnMut(u64, &mut [u8]) -> bool,
) -> Result<Option<ExePath>, Unreadable> {
    let word = |read: &mut dyn FnMut(u64, &mut [u8]) -> bool, va: u64| -> Result<u64, Unreadable> {
        let mut b = [0u8; 8];
        if read(va, &mut b) {
            Ok(u64::from_le_bytes(b))
        } else {
            Err(Unreadable)
        }
    };
    let kernel = |p: u64| {
        if p >= KERNEL_HALF {
            Ok(p)
        } else {
            Err(Unreadable)
        }
    };
    let mm = word(read, task.wrapping_add(u64::from(t.task_mm)))?;
    if mm == 0 {
        return Ok(None);
    }
    let file = word(read, kernel(mm)?.wrapping_add(u64::from(t.mm_exe_file)))?;
    if file == 0 {
        return Ok(None);
    }
    let mut dentry = kernel(word(
        read,
        kernel(file)?.wrapping_add(u64::from(t.file_dentry)),
    )?)?;
    let mut path = PathFromEnd::new();
    let mut cut = true;
    for _ in 0..EXE_COMPONENTS {
        let parent = kernel(word(read, dentry.wrapping_add(u64::from(t.dentry_parent)))?)?;
        if parent == dentry && path.start < EXE_BYTES {
            // The root (its name is `/`), below the file itself.
            cut = false;
            break;
        }
        let mut four = [0u8; 4];
        if !read(dentry.wrapping_add(u64::from(t.dentry_name_len)), &mut four) {
            return Err(Unreadable);
        }
        let len = (u32::from_le_bytes(four) as usize).min(COMPONENT_BYTES);
        let at = kernel(word(read, dentry.wrapping_add(u64::from(t.dentry_name)))?)?;
        let mut name = [0u8; COMPONENT_BYTES];
        if !read(at, &mut name[..len]) {
            return Err(Unreadable);
        }
        if !path.push(&name[..len]) {
            break;
        }
        if parent == dentry {
            cut = false;
            break;
        }
        dentry = parent;
    }
    Ok(Some(path.finish(cut)))
}

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
            stats: WatchStats::default(),
        }
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
        self.table.switch_to(key, self.counts.read())
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
            "{{\"by\":\"{}\",\"user_instructions\":{user},\"kernel_instructions\":{kernel},\"user_entries\":{},\"switches\":{},\"reads_failed\":{},\"exe_reads_failed\":{},\"watch_cycles\":{},\"processes\":[",
            if self.by_task() { "task" } else { "address_space" },
            s.user_entries,
            s.switches,
            s.reads_failed,
            s.exe_reads_failed,
            s.cycles
        );
        for (i, r) in table.rows().iter().enumerate() {
            if i > 0 {
                j.push(',');
            }
            row_json(&mut j, r);
        }
        j.push_str("]}\n");
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

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::boxed::Box;
    use alloc::collections::BTreeMap;

    /// Counters the test sets, as the engine's would be.
    struct Counters(Box<[u64; 2 * INSN_COUNTER_SPREAD]>);

    impl Counters {
        fn new() -> Self {
            Counters(Box::new([0; 2 * INSN_COUNTER_SPREAD]))
        }
        fn view(&self) -> InsnCounts {
            let p = self.0.as_ptr();
            // SAFETY: the box holds both modes' slots and outlives the watch in each test.
            unsafe { InsnCounts::from_raw(p, p.add(INSN_COUNTER_SPREAD)) }
        }
        /// Runs `user` and `kernel` more instructions (spread over slots as blocks are).
        fn run(&mut self, user: u64, kernel: u64) {
            self.0[(user % 7) as usize] += user;
            self.0[INSN_COUNTER_SPREAD + (kernel % 11) as usize] += kernel;
        }
    }

    const TYPES: KernelTypes = KernelTypes {
        current_task: 0x1fb80,
        task_pid: 0x970,
        task_tgid: 0x974,
        task_comm: 0xba0,
        comm_bytes: 16,
        task_mm: 0x8e0,
        mm_exe_file: 0x3b0,
        file_dentry: 0x18,
        dentry_name_len: 0x24,
        dentry_name: 0x28,
        dentry_parent: 0x10,
    };
    const PERCPU: u64 = 0xffff_8880_0f00_0000;

    /// A guest memory of u8s at addresses.
    #[derive(Default)]
    struct Guest(BTreeMap<u64, u8>);

    impl Guest {
        fn put(&mut self, va: u64, bytes: &[u8]) {
            for (i, &b) in bytes.iter().enumerate() {
                self.0.insert(va + i as u64, b);
            }
        }
        fn task(&mut self, task: u64, pid: i32, comm: &str) {
            self.put(task + 0x970, &pid.to_le_bytes());
            self.put(task + 0x974, &pid.to_le_bytes());
            let mut c = [0u8; 16];
            c[..comm.len()].copy_from_slice(comm.as_bytes());
            self.put(task + 0xba0, &c);
        }
        fn run(&mut self, task: u64) {
            self.put(PERCPU + 0x1fb80, &task.to_le_bytes());
        }
        /// A dentry at `d` named `name` under `parent` (itself for a root).
        fn dentry(&mut self, d: u64, name: &str, parent: u64) {
            self.put(d + 0x10, &parent.to_le_bytes());
            self.put(d + 0x24, &(name.len() as u32).to_le_bytes());
            self.put(d + 0x28, &(d + 0x1000).to_le_bytes());
            self.put(d + 0x1000, name.as_bytes());
        }
        /// Gives the task at `task` an mm whose exe_file is at the dentries `path` (the
        /// root first), placed from `at` on; returns the file's dentry.
        fn exe(&mut self, task: u64, at: u64, path: &[&str]) -> u64 {
            let (mm, file) = (at, at + 0x1_0000);
            self.put(task + 0x8e0, &mm.to_le_bytes());
            self.put(mm + 0x3b0, &file.to_le_bytes());
            let mut parent = at + 0x2_0000;
            self.dentry(parent, "/", parent);
            for (i, name) in path.iter().enumerate() {
                let d = at + 0x3_0000 + i as u64 * 0x2000;
                self.dentry(d, name, parent);
                parent = d;
            }
            self.put(file + 0x18, &parent.to_le_bytes());
            parent
        }
        fn reader(&mut self) -> impl FnMut(u64, &mut [u8]) -> bool + '_ {
            |va, out| {
                for (i, o) in out.iter_mut().enumerate() {
                    match self.0.get(&(va + i as u64)) {
                        Some(&b) => *o = b,
                        None => return false,
                    }
                }
                true
            }
        }
    }

    fn comm(r: &TaskRow) -> &str {
        let n = r
            .key
            .comm
            .iter()
            .position(|&b| b == 0)
            .unwrap_or(COMM_BYTES);
        core::str::from_utf8(&r.key.comm[..n]).unwrap()
    }

    #[test]
    fn test_rows_sum_to_the_totals_and_charge_the_task_that_ran() {
        let mut c = Counters::new();
        let mut g = Guest::default();
        let (a, b) = (0xffff_8880_0100_0000, 0xffff_8880_0200_0000);
        g.task(a, 1, "init");
        g.task(b, 7, "sh");
        c.run(0, 1000); // the boot
        let mut w = TaskWatch::new(&TYPES, c.view());
        c.run(0, 500);
        g.run(a);
        w.on_user_entry(0x1000, [0, PERCPU], &mut g.reader());
        c.run(300, 40);
        w.on_user_entry(0x1000, [0, PERCPU], &mut g.reader()); // same task: nothing
        c.run(200, 60);
        g.run(b);
        w.on_user_entry(0x2000 | 5, [0x7f00_0000, PERCPU], &mut g.reader());
        c.run(50, 5);
        g.run(a);
        w.on_user_entry(0x1001, [0, PERCPU], &mut g.reader()); // PCID bits differ only
        c.run(11, 22);
        let t = w.report_table();
        let rows = t.rows();
        assert_eq!(rows.len(), 3);
        assert_eq!(rows[0].key.kind, RowKind::Boot);
        assert_eq!((rows[0].user, rows[0].kernel), (0, 500));
        assert_eq!((comm(&rows[1]), rows[1].key.pid), ("init", 1));
        assert_eq!(
            (rows[1].user, rows[1].kernel),
            (300 + 200 + 11, 40 + 60 + 22)
        );
        assert_eq!(
            (comm(&rows[2]), rows[2].user, rows[2].kernel),
            ("sh", 50, 5)
        );
        assert_eq!(rows[1].entries, 2);
        assert_eq!(rows[1].first_seen, 1500);
        assert_eq!(rows[2].last_seen, 1000 + 500 + 300 + 40 + 200 + 60 + 55);
        let total = c.view().read();
        assert_eq!(
            rows.iter()
                .fold([0, 0], |s, r| [s[0] + r.user, s[1] + r.kernel]),
            [total[0], total[1] - 1000],
            "every instruction since the watch began is charged once"
        );
        assert_eq!(w.stats.switches, 3);
        assert_eq!(w.stats.user_entries, 4);
        // A later report charges what ran since, to the same row.
        c.run(1, 1);
        assert_eq!(w.report_table().rows()[1].user, 512);
    }

    #[test]
    fn test_an_exec_and_a_reused_task_struct_are_new_rows() {
        let mut c = Counters::new();
        let mut g = Guest::default();
        let a = 0xffff_8880_0100_0000;
        g.task(a, 5, "sh");
        let mut w = TaskWatch::new(&TYPES, c.view());
        g.run(a);
        w.on_user_entry(0x1000, [0, PERCPU], &mut g.reader());
        c.run(10, 10);
        // exec: same task_struct, new address space and name.
        g.task(a, 5, "ls");
        w.on_user_entry(0x3000, [0, PERCPU], &mut g.reader());
        c.run(20, 20);
        // The task exited, its task_struct went to pid 9 with the same name.
        g.task(a, 9, "ls");
        w.on_user_entry(0x5000, [0, PERCPU], &mut g.reader());
        let t = w.report_table();
        let names: Vec<(&str, i32)> = t.rows()[1..].iter().map(|r| (comm(r), r.key.pid)).collect();
        assert_eq!(names, [("sh", 5), ("ls", 5), ("ls", 9)]);
    }

    #[test]
    fn test_a_task_that_renames_itself_is_a_new_row() {
        let c = Counters::new();
        let mut g = Guest::default();
        let a = 0xffff_8880_0100_0000;
        g.task(a, 5, "init");
        g.run(a);
        let mut w = TaskWatch::new(&TYPES, c.view());
        w.on_user_entry(0x1000, [0, PERCPU], &mut g.reader());
        // prctl(PR_SET_NAME): same task, same address space.
        g.task(a, 5, "awk");
        w.on_user_entry(0x1000, [0, PERCPU], &mut g.reader());
        w.on_user_entry(0x1000, [0, PERCPU], &mut g.reader());
        let t = w.report_table();
        let names: Vec<&str> = t.rows()[1..].iter().map(comm).collect();
        assert_eq!(names, ["init", "awk"]);
        assert_eq!(w.stats.switches, 2);
    }

    #[test]
    fn test_faulting_reads_are_skipped_and_counted() {
        let c = Counters::new();
        let mut g = Guest::default();
        let mut w = TaskWatch::new(&TYPES, c.view());
        // No per-CPU base among the GS bases.
        w.on_user_entry(0x1000, [0, 0x7fff_0000], &mut g.reader());
        // `current` unreadable.
        w.on_user_entry(0x1000, [0, PERCPU], &mut g.reader());
        // A task pointer whose fields are unreadable, then a user address.
        g.run(0xffff_8880_0300_0000);
        w.on_user_entry(0x1000, [0, PERCPU], &mut g.reader());
        g.run(0x1234);
        w.on_user_entry(0x1000, [0, PERCPU], &mut g.reader());
        assert_eq!(w.stats.reads_failed, 4);
        assert_eq!(w.report_table().rows().len(), 1, "only the boot row");
        // The GS base itself, if KERNEL_GS_BASE is not a kernel address.
        assert_eq!(kernel_percpu_base([PERCPU, 0]), Some(PERCPU));
        assert_eq!(kernel_percpu_base([1, PERCPU]), Some(PERCPU));
    }

    #[test]
    fn test_without_types_tasks_are_address_spaces() {
        let mut c = Counters::new();
        let mut g = Guest::default();
        let mut w = TaskWatch::new(&KernelTypes::UNKNOWN, c.view());
        assert!(!w.by_task());
        for (cr3, n) in [
            (0x1000, 3),
            (0x1000 | 1 << 12 | 1 << 63, 4),
            (0x4000, 5),
            (0x1000, 6),
        ] {
            w.on_user_entry(cr3, [0, 0], &mut g.reader());
            c.run(n, n);
        }
        let t = w.report_table();
        let rows = t.rows();
        assert_eq!(rows.len(), 3);
        assert_eq!(rows[1].key.kind, RowKind::AddressSpace);
        assert_eq!((rows[1].key.space, rows[1].user), (0x0, 3 + 4 + 6));
        assert_eq!((rows[2].key.space, rows[2].user), (0x4000, 5));
        assert_eq!(address_space(0x8000_0000_0123_5fff), 0x0123_4000);
    }

    #[test]
    fn test_a_full_table_charges_new_tasks_to_the_overflow_row() {
        let mut t = TaskTable::new([0, 0]);
        for i in 0..(MAX_TASKS as u64 + 10) {
            let key = TaskKey {
                task: KERNEL_HALF + i * 0x1000,
                pid: i as i32,
                ..TaskKey::special(RowKind::Task)
            };
            t.switch_to(&key, [i, i]);
        }
        t.charge([1_000_000, 1_000_000]);
        assert_eq!(t.rows().len(), MAX_TASKS);
        let last = t.rows().last().unwrap();
        assert_eq!(last.key.kind, RowKind::Overflow);
        assert_eq!(last.entries, 12);
        let sum = t
            .rows()
            .iter()
            .fold([0, 0], |s, r| [s[0] + r.user, s[1] + r.kernel]);
        assert_eq!(sum, [1_000_000, 1_000_000]);
    }

    fn exe(r: &TaskRow) -> Option<&str> {
        r.exe
            .as_ref()
            .map(|e| core::str::from_utf8(e.path()).unwrap())
    }

    #[test]
    fn test_a_new_rows_executable_is_read_once() {
        let mut c = Counters::new();
        let mut g = Guest::default();
        let (a, b) = (0xffff_8880_0100_0000, 0xffff_8880_0200_0000);
        g.task(a, 1, "init");
        g.exe(a, 0xffff_8880_1000_0000, &["bin", "busybox"]);
        g.task(b, 7, "kpin-test");
        g.exe(b, 0xffff_8880_2000_0000, &["usr", "bin", "kpin-test"]);
        let mut w = TaskWatch::new(&TYPES, c.view());
        assert!(w.reads_exe());
        let mut reads = 0;
        let entry = |w: &mut TaskWatch, g: &mut Guest, task: u64, reads: &mut u32| {
            g.run(task);
            let mut r = g.reader();
            w.on_user_entry(0x1000, [0, PERCPU], &mut |va, out| {
                *reads += 1;
                r(va, out)
            });
        };
        entry(&mut w, &mut g, a, &mut reads);
        // current, comm, pid, tgid; mm, exe_file, dentry; 2 components (parent, len,
        // name pointer, name), the root's parent.
        assert_eq!(reads, 4 + 3 + 2 * 4 + 1);
        c.run(5, 5);
        entry(&mut w, &mut g, b, &mut reads);
        c.run(5, 5);
        reads = 0;
        // Back to a: its row exists, only current, comm, pid and tgid are read.
        entry(&mut w, &mut g, a, &mut reads);
        assert_eq!(reads, 4);
        // busybox renames itself for an applet: a new row, the same executable.
        g.task(a, 1, "sort");
        entry(&mut w, &mut g, a, &mut reads);
        let t = w.report_table();
        let rows: Vec<(&str, Option<&str>)> = t.rows().iter().map(|r| (comm(r), exe(r))).collect();
        assert_eq!(
            rows,
            [
                ("", None),
                ("init", Some("/bin/busybox")),
                ("kpin-test", Some("/usr/bin/kpin-test")),
                ("sort", Some("/bin/busybox")),
            ]
        );
        assert_eq!(t.rows()[3].exe.unwrap().name(), b"busybox");
        let j = w.to_json();
        assert!(
            j.contains("\"exe\":\"kpin-test\",\"exe_path\":\"/usr/bin/kpin-test\""),
            "{j}"
        );
        assert!(j.contains("\"exe\":null,\"exe_path\":null"), "{j}");
        assert!(j.contains("\"exe_reads_failed\":0"), "{j}");
    }

    #[test]
    fn test_no_mm_is_no_executable_and_faults_are_counted() {
        let c = Counters::new();
        let mut g = Guest::default();
        let (a, b, d) = (
            0xffff_8880_0100_0000,
            0xffff_8880_0200_0000,
            0xffff_8880_0300_0000,
        );
        g.task(a, 2, "kthreadd");
        g.put(a + 0x8e0, &0u64.to_le_bytes());
        g.task(b, 3, "gone");
        g.put(b + 0x8e0, &0xffff_8880_0900_0000u64.to_le_bytes()); // mm unreadable
        g.task(d, 4, "odd");
        let dentry = g.exe(d, 0xffff_8880_1000_0000, &["x"]);
        g.put(dentry + 0x28, &0x1000u64.to_le_bytes()); // a user-space name pointer
        let mut w = TaskWatch::new(&TYPES, c.view());
        for task in [a, b, d] {
            g.run(task);
            w.on_user_entry(0x1000, [0, PERCPU], &mut g.reader());
        }
        assert_eq!(w.stats.reads_failed, 0, "the entries themselves were seen");
        assert_eq!(w.stats.exe_reads_failed, 2);
        let t = w.report_table();
        assert_eq!(t.rows().len(), 4);
        assert!(t.rows().iter().all(|r| r.exe.is_none()));
        // Types without the executable's offsets read no executable.
        let old = KernelTypes {
            task_mm: 0,
            ..TYPES
        };
        let w = TaskWatch::new(&old, c.view());
        assert!(w.by_task() && !w.reads_exe());
    }

    #[test]
    fn test_deep_and_long_paths_keep_their_end() {
        let mut g = Guest::default();
        let a = 0xffff_8880_0100_0000;
        let deep = ["a", "b", "c", "d", "e", "f", "g", "h", "i", "prog"];
        g.exe(a, 0xffff_8880_1000_0000, &deep);
        let e = read_exe(&TYPES, a, &mut g.reader()).unwrap().unwrap();
        assert_eq!(e.path(), b".../c/d/e/f/g/h/i/prog");
        assert_eq!(e.name(), b"prog");
        // Exactly EXE_COMPONENTS deep: the root is reached.
        let b = 0xffff_8880_0200_0000;
        g.exe(b, 0xffff_8880_2000_0000, &deep[3..]);
        let e = read_exe(&TYPES, b, &mut g.reader()).unwrap().unwrap();
        assert_eq!(e.path(), b"/d/e/f/g/h/i/prog");
        // Long names: each cut to 64 bytes, the path to what fits, the name kept.
        let long = "n".repeat(80);
        let c = 0xffff_8880_0300_0000;
        g.exe(c, 0xffff_8880_3000_0000, &[&long, &long, "tool"]);
        let e = read_exe(&TYPES, c, &mut g.reader()).unwrap().unwrap();
        assert_eq!(e.name(), b"tool");
        assert!(e.path().starts_with(b".../nnnn"), "{e:?}");
        assert_eq!(e.path().len(), 3 + 1 + 64 + 5);
    }

    #[test]
    fn test_json_escapes_names() {
        let c = Counters::new();
        let mut g = Guest::default();
        let a = 0xffff_8880_0100_0000;
        g.task(a, 3, "a\"b\\c\u{1}");
        g.run(a);
        let mut w = TaskWatch::new(&TYPES, c.view());
        w.on_user_entry(0x1000, [0, PERCPU], &mut g.reader());
        let j = w.to_json();
        assert!(
            j.starts_with("{\"by\":\"task\",\"user_instructions\":0,"),
            "{j}"
        );
        assert!(j.contains("\"comm\":\"a\\\"b\\\\c\\u0001\""), "{j}");
        assert!(j.contains("{\"kind\":\"boot\",\"pid\":null"), "{j}");
        assert!(j.contains("\"task\":\"0xffff888001000000\""), "{j}");
        assert!(j.ends_with("]}\n"));
    }
}
