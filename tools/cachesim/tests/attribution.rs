//! `attribute=on`: the events per task and code block sum to the simulation's counters
//! (whatever the records: runs, operand records carrying fetches, read-modify-writes,
//! unresolved addresses, task switches, a warmup, `sim_refs`), leave the simulation as it
//! was, and land in the right task and block; the report turns them into a per-process
//! table, a Cachegrind file `cg_annotate` reads with the same totals, and folded stacks
//! whose flame graph's root is the instruction count.

use std::collections::BTreeMap;
use std::path::Path;

use kpin_tool::host::{Error, Sink};
use kpin_tool::host_side::{BlockNames, UserCode, UserNames};
use kpin_tool::{access, MemRecord};
use kpin_tool_cachesim::attr::EVENTS;
use kpin_tool_cachesim::CacheSim;

const KERNEL: u64 = 0xffff_ffff_8100_0000;
const CPL3: u32 = 3 << access::CPL_SHIFT;

fn task(row: u64) -> MemRecord {
    MemRecord {
        ip: 0,
        ea: row,
        size: 0,
        access: access::TASK,
        pa: 0,
    }
}

fn fetch(ip: u64, pa: u64, len: u32, cpl: u32) -> MemRecord {
    MemRecord {
        ip,
        ea: ip,
        size: len,
        access: access::FETCH | cpl,
        pa,
    }
}

fn data(ip: u64, pa: u64, bits: u32, cpl: u32) -> MemRecord {
    MemRecord {
        ip,
        ea: 0,
        size: 8,
        access: bits | cpl,
        pa,
    }
}

/// A pseudo-random whole-system stream: kernel and user runs, operand records carrying
/// fetches, reads, writes and read-modify-writes (some unresolved), task switches.
fn stream(n: usize) -> Vec<MemRecord> {
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut out = Vec::new();
    for _ in 0..n {
        if next() % 40 == 0 {
            out.push(task(next() % 5));
        }
        let user = next() % 2 == 0;
        let cpl = if user { CPL3 } else { 0 };
        let start = (next() % 0x6000) & !1;
        let va = if user {
            0x40_0000 + start
        } else {
            KERNEL + start
        };
        let n = 1 + next() % 16;
        let (mut lens, mut at) = (0u64, start);
        for k in 0..n {
            let len = 1 + next() % 15;
            lens |= len << (4 * k);
            at += len;
        }
        out.push(MemRecord {
            ip: va,
            ea: lens,
            size: n as u32,
            access: access::FETCH | access::FETCH_RUN | cpl,
            pa: start,
        });
        let bits = match next() % 3 {
            0 => access::READ,
            1 => access::WRITE,
            _ => access::READ | access::WRITE,
        };
        let ip = va + (at - start);
        let dpa = if next() % 50 == 0 {
            u64::MAX
        } else {
            0x10_0000 + (next() % 0x3000)
        };
        let len = 1 + next() % 15;
        out.push(MemRecord {
            ea: at,
            access: bits | cpl | access::WITH_FETCH | (len as u32) << access::FETCH_LEN_SHIFT,
            ..data(ip, dpa, 0, 0)
        });
        if next() % 3 == 0 {
            out.push(data(ip, 0x10_0000 + (next() % 0x3000), access::READ, cpl));
        }
    }
    out
}

/// The counters in Cachegrind's sums: Ir, Dr + Dw, L1 misses, memory-side misses.
fn counter_sums(s: &CacheSim) -> [u64; 4] {
    let h = s.hierarchy();
    let misses = |st: kpin_tool_cachesim::sim::Stats| st.misses[0] + st.misses[1];
    let l1: u64 = misses(h.l1i().stats) + misses(h.l1d().stats);
    let mem: u64 = h
        .caches()
        .zip(h.parents())
        .filter(|(_, p)| p.is_none())
        .map(|((_, c), _)| misses(c.stats))
        .sum();
    [h.fetch_refs.iter().sum(), h.data_refs.iter().sum(), l1, mem]
}

fn event_sums(t: [u64; 9]) -> [u64; 4] {
    [t[0], t[3] + t[6], t[1] + t[4] + t[7], t[2] + t[5] + t[8]]
}

fn stats(s: &CacheSim) -> Vec<String> {
    s.hierarchy()
        .caches()
        .map(|(n, c)| format!("{n} {:?}", c.stats))
        .chain([format!(
            "{:?} {:?}",
            s.hierarchy().fetch_refs,
            s.hierarchy().data_refs
        )])
        .collect()
}

#[test]
fn blocks_sum_to_the_counters_and_change_no_result() {
    let records = stream(30_000);
    let geometry =
        "L1I_size=1K L1I_assoc=2 L1D_size=1K L1D_assoc=2 LL_size=8K LL_assoc=4 line_size=32";
    for extra in [
        "",
        "L2_size=4K L2_assoc=4",
        "warmup_refs=5000",
        "sim_refs=40000 interval_refs=7",
    ] {
        let opts = format!("{geometry} {extra}");
        let mut plain = CacheSim::new(&opts).unwrap();
        let mut attributed = CacheSim::new(&format!("{opts} attribute=on")).unwrap();
        assert!(plain.attribution().is_none());
        plain.feed_all(&records);
        attributed.feed_all(&records);
        assert_eq!(stats(&plain), stats(&attributed), "{extra}");
        let at = attributed.attribution().unwrap();
        assert_eq!(
            event_sums(at.totals()),
            counter_sums(&attributed),
            "{extra}"
        );
        // Tasks 0–4 all ran, kernel and user.
        let tasks: std::collections::BTreeSet<(u32, bool)> =
            at.blocks().iter().map(|b| (b.task, b.user)).collect();
        assert_eq!(tasks.len(), 10, "{extra}");
        assert!(at.totals()[0] > 30_000 && at.totals()[8] > 0, "{extra}");
    }
}

#[test]
fn events_go_to_the_running_task_and_block() {
    let mut s = CacheSim::new("attribute=on").unwrap();
    let ui = 0x40_1000;
    let records = [
        task(1),
        // User: a cold fetch (I1 and LL miss), a cold read, a write that hits it, a
        // read-modify-write of a cold line (the read misses, the write hits).
        fetch(ui, 0x1000, 4, CPL3),
        data(ui, 0x2000, access::READ, CPL3),
        fetch(ui + 4, 0x1004, 3, CPL3),
        data(ui + 4, 0x2000, access::WRITE, CPL3),
        MemRecord {
            ea: 0x1007,
            ..data(
                ui + 7,
                0x3000,
                access::READ | access::WRITE | access::WITH_FETCH | 2 << access::FETCH_LEN_SHIFT,
                CPL3,
            )
        },
        task(2),
        // The kernel for task 2: a run of three instructions in the line the user code
        // fetched (hits), a read of the user's line (a hit).
        MemRecord {
            ip: KERNEL,
            ea: 0x342,
            size: 3,
            access: access::FETCH | access::FETCH_RUN,
            pa: 0x1010,
        },
        data(KERNEL + 9, 0x2000, access::READ, 0),
        // A jump back to the user code's start: the same block again (its physical
        // address) for task 2 now.
        fetch(ui, 0x1000, 4, CPL3),
    ];
    s.feed_all(&records);
    let blocks: BTreeMap<(u32, bool, u64), [u64; 9]> = s
        .attribution()
        .unwrap()
        .blocks()
        .iter()
        .filter(|b| b.counts != [0; 9])
        .map(|b| ((b.task, b.user, b.code), b.counts))
        .collect();
    assert_eq!(
        blocks,
        BTreeMap::from([
            ((1, true, 0x1000), [3, 1, 1, 2, 2, 2, 2, 0, 0]),
            ((2, false, KERNEL), [3, 0, 0, 1, 0, 0, 0, 0, 0]),
            ((2, true, 0x1000), [1, 0, 0, 0, 0, 0, 0, 0, 0]),
        ])
    );
    assert_eq!(
        event_sums(s.attribution().unwrap().totals()),
        counter_sums(&s)
    );
}

#[test]
fn a_full_table_keeps_counting_in_each_tasks_overflow_block() {
    let mut s = CacheSim::with_capacities("attribute=on", 64, 3, 16).unwrap();
    let mut records = vec![task(1)];
    for k in 0..10 {
        records.push(fetch(KERNEL + 0x100 * k, 0x1000 + 0x100 * k, 4, 0));
    }
    s.feed_all(&records);
    let at = s.attribution().unwrap();
    assert!(at.blocks().len() <= 5, "{:?}", at.blocks());
    assert_eq!(at.totals()[0], 10);
    assert!(at
        .blocks()
        .iter()
        .any(|b| b.task == 1 && b.code == u64::MAX && b.counts[0] > 0));
}

/// Writes the tool's files into a directory, as the host's side does.
struct DirSink<'a>(&'a Path, Vec<std::fs::File>);

impl Sink for DirSink<'_> {
    fn open(&mut self, name: &str) -> Result<u16, Error> {
        self.1
            .push(std::fs::File::create(self.0.join(name)).map_err(|_| Error::Transport)?);
        Ok(self.1.len() as u16 - 1)
    }
    fn write(&mut self, file: u16, data: &[u8]) -> Result<(), Error> {
        use std::io::Write;
        self.1[file as usize]
            .write_all(data)
            .map_err(|_| Error::Transport)
    }
    fn close(&mut self, _file: u16) -> Result<(), Error> {
        Ok(())
    }
}

struct Kernel;
impl BlockNames for Kernel {
    fn source(&self) -> String {
        "a test map".into()
    }
    fn name(&self, addr: u64) -> Option<String> {
        (addr >= KERNEL).then(|| format!("kfunc{}+0x{:x}", (addr - KERNEL) >> 12, addr & 0xfff))
    }
}

struct User;
impl UserNames for User {
    fn source(&self) -> String {
        "test ELF files".into()
    }
    fn name(&self, pa: u64) -> Option<UserCode> {
        // Below 0x4000 /bin/busybox, in functions of 4 KiB; above, a stripped library.
        Some(if pa < 0x4000 {
            UserCode {
                object: "/bin/busybox".into(),
                offset: pa,
                // As the VMM's UserNames give it: the covering symbol and the offset.
                function: Some(format!("ufunc{}+0x{:x}", pa >> 12, pa & 0xfff)),
            }
        } else {
            UserCode {
                object: "/lib/libstripped.so".into(),
                offset: pa,
                function: None,
            }
        })
    }
}

fn processes_json() -> &'static str {
    // The engine's shape (`docs/processes.md`): the counts do not matter here.
    r#"{"by":"task","user_instructions":0,"kernel_instructions":0,"processes":[
        {"kind":"boot","pid":null,"comm":null,"cr3":"0x0","user_instructions":0,"kernel_instructions":0},
        {"kind":"task","pid":1,"comm":"init","cr3":"0x1000","user_instructions":0,"kernel_instructions":0},
        {"kind":"task","pid":7,"comm":"sort","cr3":"0x2000","user_instructions":0,"kernel_instructions":0},
        {"kind":"task","pid":8,"comm":"a;b\nc","cr3":"0x3000","user_instructions":0,"kernel_instructions":0}
    ]}"#
}

#[test]
fn the_report_tables_processes_and_writes_profiles_with_the_counters_totals() {
    let dir = std::env::temp_dir().join(format!("kpin-cachesim-attr-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut s = CacheSim::with_capacities(
        "L1D_size=1K L1D_assoc=2 attribute=on",
        64,
        kpin_tool_cachesim::attr::HOST_BLOCKS,
        kpin_tool_cachesim::attr::HOST_CONTEXTS,
    )
    .unwrap();
    s.feed_all(&stream(20_000));
    s.write_files(&mut DirSink(&dir, Vec::new())).unwrap();
    std::fs::write(dir.join("processes.json"), processes_json()).unwrap();
    let (report, files) =
        kpin_tool_cachesim::report::write_reports_attributed(&dir, Some(&Kernel), Some(&User))
            .unwrap()
            .unwrap();
    let a = report.attributed.as_ref().unwrap();
    assert!(a.totals_match_counters);
    let totals = s.attribution().unwrap().totals();
    assert_eq!(a.totals, totals);
    // Per process: the rows' instructions and misses add up to the totals; row 4 is
    // past processes.json and named by its index; row 3's name is made line-safe.
    let sum = |f: &dyn Fn(&kpin_tool_cachesim::profile::ProcessRow) -> u64| {
        a.processes.iter().map(f).sum::<u64>()
    };
    assert_eq!(sum(&|r| r.instructions), totals[0]);
    assert_eq!(sum(&|r| r.l1d_misses), totals[4] + totals[7]);
    assert_eq!(sum(&|r| r.ll_misses), totals[2] + totals[5] + totals[8]);
    let comms: Vec<(Option<u64>, &str)> = {
        let mut v: Vec<_> = a
            .processes
            .iter()
            .map(|r| (r.pid, r.comm.as_str()))
            .collect();
        v.sort();
        v
    };
    assert_eq!(
        comms,
        [
            (None, "[boot]"),
            (None, "row 4"),
            (Some(1), "init"),
            (Some(7), "sort"),
            (Some(8), "a;b?c")
        ]
    );
    // The user code with a function, and with an object only.
    assert!(a.user_instructions_named[0] > 0 && a.user_instructions_named[1] > 0);
    let text = std::fs::read_to_string(dir.join("cachesim.txt")).unwrap();
    assert!(
        text.contains("Processes (") && text.contains("sort"),
        "{text}"
    );
    assert!(text.contains("Cachegrind totals equal"), "{text}");

    // The Cachegrind file: its summary is the totals, its functions sum to them.
    let cg = std::fs::read_to_string(dir.join("cachegrind.out.cachesim")).unwrap();
    assert!(cg.contains(&format!("events: {}\n", EVENTS.join(" "))));
    let kernel = cg.split("fl=[kernel]\n").nth(1).unwrap();
    assert!(kernel.starts_with("fn=kfunc0\n0 "), "{cg}");
    assert!(cg.contains("fl=/bin/busybox\nfn=ufunc"), "{cg}");
    assert!(
        !cg.contains("+0x"),
        "a function is its symbol, without the offset: {cg}"
    );
    assert!(cg.contains("fl=/lib/libstripped.so\nfn=[unknown]"), "{cg}");
    let summary: Vec<u64> = cg
        .lines()
        .find_map(|l| l.strip_prefix("summary: "))
        .unwrap()
        .split(' ')
        .map(|n| n.parse().unwrap())
        .collect();
    assert_eq!(summary, totals);
    let mut lines_sum = [0u64; 9];
    for l in cg.lines().filter_map(|l| l.strip_prefix("0 ")) {
        for (t, n) in lines_sum.iter_mut().zip(l.split(' ')) {
            *t += n.parse::<u64>().unwrap();
        }
    }
    assert_eq!(lines_sum, totals);
    cg_annotate_totals(&dir.join("cachegrind.out.cachesim"), &totals);

    // Folded stacks: process;object;function (the stream has no calls), summing to the
    // instructions; the SVG's
    // root is the same number, and inferno reads the folded file back to it.
    let folded = std::fs::read_to_string(dir.join("cachesim.folded")).unwrap();
    let mut total = 0;
    for l in folded.lines() {
        let (stack, n) = l.rsplit_once(' ').unwrap();
        assert_eq!(stack.split(';').count(), 3, "{l}");
        total += n.parse::<u64>().unwrap();
    }
    assert_eq!(total, totals[0]);
    assert!(folded.contains("sort;[kernel];kfunc"), "{folded}");
    assert!(folded.contains("a:b?c;"), "{folded}");
    let svg = std::fs::read_to_string(dir.join("cachesim-flamegraph.svg")).unwrap();
    assert!(svg.contains(&format!("total_samples=\"{}\"", totals[0])));
    let mut redrawn = Vec::new();
    inferno::flamegraph::from_lines(
        &mut inferno::flamegraph::Options::default(),
        folded.lines(),
        &mut redrawn,
    )
    .unwrap();
    assert!(String::from_utf8(redrawn)
        .unwrap()
        .contains(&format!("total_samples=\"{}\"", totals[0])));
    let l1d = std::fs::read_to_string(dir.join("cachesim-l1d-flamegraph.svg")).unwrap();
    assert!(l1d.contains(&format!("total_samples=\"{}\"", totals[4] + totals[7])));
    assert!(files.iter().any(|f| f.ends_with("cachesim-l1d.folded")));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Runs `cg_annotate` (Valgrind's; CI installs it) on `file`: it reads it without error,
/// and its program totals and its functions' sum are `totals`.
pub fn cg_annotate_totals(file: &Path, totals: &[u64; 9]) {
    let Ok(out) = std::process::Command::new("cg_annotate")
        .arg("--threshold=0")
        .arg(file)
        .output()
    else {
        eprintln!("SKIPPED: cg_annotate is not installed (Debian's valgrind package)");
        return;
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "cg_annotate failed: {stderr}");
    assert!(!stderr.contains("WARNING"), "{stderr}");
    // Counts, each followed by its share in parentheses, then the name.
    let numbers = |l: &str| -> Vec<u64> {
        let mut depth = 0;
        let bare: String = l
            .chars()
            .filter(|&c| {
                depth += i32::from(c == '(');
                let keep = depth == 0;
                depth -= i32::from(c == ')');
                keep && c != ')'
            })
            .collect();
        bare.split_whitespace()
            .take_while(|w| w.chars().next().is_some_and(|c| c.is_ascii_digit()))
            .map(|w| w.replace(',', "").parse().unwrap())
            .collect()
    };
    let program = stdout
        .lines()
        .find(|l| l.contains("PROGRAM TOTALS"))
        .expect("program totals");
    assert_eq!(numbers(program), totals, "{stdout}");
    let mut sum = [0u64; 9];
    for l in stdout
        .lines()
        .filter(|l| l.contains(":") && !l.contains("PROGRAM"))
    {
        let n = numbers(l);
        if n.len() == 9 {
            for (s, v) in sum.iter_mut().zip(n) {
                *s += v;
            }
        }
    }
    assert_eq!(&sum, totals, "{stdout}");
}
