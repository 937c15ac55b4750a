//! The task watch's host tests: charging, rows, executables, JSON.

use super::test_guest::TYPES;
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

#[test]
fn test_user_code_is_attributed_through_the_running_tasks_vmas() {
    use super::test_guest::{root, with_vmas, Mem, LEAF};
    let t = with_vmas(TYPES);
    let c = Counters::new();
    let mut g = Guest::default();
    let (task, mm, leaf, vma) = (
        0xffff_8880_0100_0000,
        0xffff_8880_1000_0000u64,
        0xffff_8880_2000_0000,
        0xffff_8880_3000_0000,
    );
    g.task(task, 1, "init");
    g.exe(task, mm, &["bin", "busybox"]);
    // `exe` puts the executable's `struct file` there; the text maps the same file.
    let file = mm + 0x1_0000;
    let mut m = Mem::default();
    m.word(mm + 8, root(leaf, LEAF));
    m.node(leaf, LEAF, mm | 1, &[0x3f_ffff, 0x40_ffff], &[0, vma, 0], 2);
    m.vma(vma, 0x40_0000, 0x41_0000, 0, file);
    g.0.extend(m.0);
    g.run(task);
    let mut w = TaskWatch::new(&t, c.view());
    assert!(w.records_origins());
    w.on_user_entry(0x1000, [0, PERCPU], &mut g.reader());
    assert_eq!(w.take_switch(), Some(1), "init's row");
    assert_eq!(w.take_switch(), None, "taken");
    w.on_user_code(0x40_1234, 0x7_7234, 0x1000, [0, PERCPU], &mut g.reader());
    w.on_user_code(0x40_1000, 0x7_7000, 0x1000, [0, PERCPU], &mut g.reader());
    // Code outside any VMA, then no per-CPU base: counted, not recorded.
    w.on_user_code(0x50_0000, 0x8_8000, 0x1000, [0, PERCPU], &mut g.reader());
    w.on_user_code(0x40_2000, 0x9_9000, 0x1000, [0, 0], &mut g.reader());
    let s = w.stats;
    assert_eq!(
        (s.origin_walks, s.origin_walk_failures, s.origins_dropped),
        (3, 2, 0)
    );
    let o = w.origins().unwrap();
    assert_eq!(
        o.page(0x77).map(|p| (p.object, p.offset)),
        Some((0, 0x1000))
    );
    let j = w.to_json();
    assert!(
        j.contains("\"origin_walks\":3,\"origin_walk_failures\":2,\"origins_dropped\":0,"),
        "{j}"
    );
    assert!(
        j.ends_with("],\"objects\":[\"/bin/busybox\"],\"code_pages\":[[119,0,4096]]}\n"),
        "{j}"
    );
    // Without the VMAs' types: nothing walked, empty lists.
    let mut w = TaskWatch::new(&TYPES, c.view());
    assert!(!w.records_origins());
    w.on_user_code(0x40_1234, 0x7_7234, 0x1000, [0, PERCPU], &mut g.reader());
    assert_eq!(w.stats.origin_walks, 0);
    let j = w.to_json();
    assert!(j.ends_with("],\"objects\":[],\"code_pages\":[]}\n"), "{j}");
}

#[test]
fn test_a_change_of_the_running_row_is_left_for_the_engine() {
    let mut c = Counters::new();
    let mut g = Guest::default();
    let (a, b) = (0xffff_8880_0100_0000, 0xffff_8880_0200_0000);
    g.task(a, 1, "init");
    g.task(b, 7, "sh");
    let mut w = TaskWatch::new(&TYPES, c.view());
    assert_eq!(
        w.take_switch(),
        None,
        "row 0 runs from the start: no record"
    );
    g.run(a);
    w.on_user_entry(0x1000, [0, PERCPU], &mut g.reader());
    g.run(b);
    w.on_user_entry(0x2000, [0, PERCPU], &mut g.reader());
    // Not taken in between: the latest row.
    assert_eq!(w.take_switch(), Some(2));
    c.run(5, 5);
    g.run(a);
    w.on_user_entry(0x1000, [0, PERCPU], &mut g.reader());
    assert_eq!(w.take_switch(), Some(1), "back to init's row");
    w.on_user_entry(0x1000, [0, PERCPU], &mut g.reader());
    assert_eq!(w.take_switch(), None, "the same task: no change");
    // By address space too.
    let mut w = TaskWatch::new(&KernelTypes::UNKNOWN, c.view());
    w.on_user_entry(0x5000, [0, 0], &mut g.reader());
    assert_eq!(w.take_switch(), Some(1));
}
