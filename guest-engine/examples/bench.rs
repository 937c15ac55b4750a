//! Translator benchmark (not a test): native vs translated host workloads.
//!
//! `cargo run --release -p guest-engine --example bench`
//!
//! For each workload and tool (none / basic-block counter / memory-reference buffer /
//! analysis calls; `+cnt`: the same with the engine's own instruction counting) it
//! reports, measured in one process run: slowdown vs native (steady state, and including
//! translation), translation throughput, code-cache bytes per guest code byte, and the
//! indirect-branch lookup hit rate; then the cost of `invalidate_all_mappings`.
//! `--only <workload>` and `--tools a,b,...` select rows.

#[path = "../tests/common/mod.rs"]
#[allow(unused_imports)]
mod common;

use std::time::Instant;

use common::tools::{BblCount, MemTrace};
use common::{HostMemory, HostPlatform, Region, Rig};
use guest_engine::{Config, GuestRegs, GuestVirt, Mode, NullTool, Stop, Tool};

type Work = extern "sysv64" fn(*mut u64, u64) -> u64;

#[inline(never)]
extern "sysv64" fn compute_loop(_buf: *mut u64, n: u64) -> u64 {
    let mut x = 0x1234_5678_9abc_def0u64;
    let mut acc = 0u64;
    for i in 0..n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        acc = acc.wrapping_add(x.wrapping_mul(i | 1)).rotate_left(5);
    }
    acc
}

#[inline(never)]
extern "sysv64" fn sieve(buf: *mut u64, n: u64) -> u64 {
    // SAFETY: buf holds BUF_WORDS words; we use it as bytes.
    let v = unsafe { std::slice::from_raw_parts_mut(buf.cast::<u8>(), BUF_WORDS * 8) };
    let mut total = 0;
    for _ in 0..n {
        v.fill(1);
        let mut i = 2;
        while i * i < v.len() {
            if v[i] != 0 {
                let mut j = i * i;
                while j < v.len() {
                    v[j] = 0;
                    j += i;
                }
            }
            i += 1;
        }
        total += v.iter().filter(|b| **b != 0).count() as u64;
    }
    total
}

#[inline(never)]
extern "sysv64" fn quicksort(buf: *mut u64, n: u64) -> u64 {
    // SAFETY: buf holds BUF_WORDS words.
    let v = unsafe { std::slice::from_raw_parts_mut(buf, BUF_WORDS) };
    #[inline(never)]
    fn qs(v: &mut [u64]) {
        if v.len() <= 1 {
            return;
        }
        let last = v.len() - 1;
        v.swap(v.len() / 2, last);
        let p = v[last];
        let mut s = 0;
        for i in 0..last {
            if v[i] < p {
                v.swap(i, s);
                s += 1;
            }
        }
        v.swap(s, last);
        let (a, b) = v.split_at_mut(s);
        qs(a);
        qs(&mut b[1..]);
    }
    let mut h = 0;
    let mut x = 88172645463325252u64;
    for _ in 0..n {
        for e in v.iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *e = x;
        }
        qs(v);
        h ^= v[7];
    }
    h
}

#[inline(never)]
extern "sysv64" fn interpreter(buf: *mut u64, n: u64) -> u64 {
    // SAFETY: buf holds BUF_WORDS words; the program is its bytes.
    let code = unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), 4096) };
    let mut acc: u64 = 1;
    let mut stack = [0u64; 16];
    let mut sp = 0usize;
    for _ in 0..n {
        for (pc, op) in code.iter().enumerate() {
            acc = match op % 12 {
                0 => acc.wrapping_add(u64::from(*op)),
                1 => acc.wrapping_mul(3),
                2 => acc ^ (acc >> 7),
                3 => {
                    stack[sp % 16] = acc;
                    sp = sp.wrapping_add(1);
                    acc
                }
                4 => {
                    sp = sp.wrapping_sub(1);
                    acc.wrapping_add(stack[sp % 16])
                }
                5 => acc.rotate_left(u32::from(*op)),
                6 => acc.wrapping_sub(pc as u64),
                7 => !acc,
                8 => acc / (u64::from(*op) + 1),
                9 => acc.wrapping_shl(3) | 1,
                10 => (acc.count_ones() as u64).wrapping_add(acc),
                _ => acc.swap_bytes(),
            };
        }
    }
    acc
}

const BUF_WORDS: usize = 8192;

/// Counts basic blocks with an inline analysis call per block (Pin's classic `docount`).
#[derive(Default)]
struct BblCalls {
    count: u64,
}

impl Tool for BblCalls {
    fn instrument_trace(&mut self, t: &mut guest_engine::TraceInstrumenter<'_>) {
        let firsts: Vec<usize> = t.bbls().iter().map(|b| b.first).collect();
        for f in firsts {
            t.insert_call(
                f,
                guest_engine::IPoint::Before,
                0,
                &[guest_engine::IArg::InstPtr],
            );
        }
    }
    fn analyze(&mut self, _routine: u32, args: &[u64]) {
        self.count = self.count.wrapping_add(args[0] & 1).wrapping_add(1);
    }
}

struct Bench {
    rig: Rig,
    stack: Region,
    buf: Region,
    mem: HostMemory,
}

impl Bench {
    fn fill(&self) {
        let w = self.buf.ptr.cast::<u64>();
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for i in 0..BUF_WORDS {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // SAFETY: inside the buffer.
            unsafe { *w.add(i) = x };
        }
    }

    fn regs(&self, n: u64) -> GuestRegs {
        let top = self.stack.addr() + self.stack.len as u64 - 4096;
        // SAFETY: inside the stack mapping.
        unsafe { *((top - 8) as *mut u64) = self.rig.native.exit_address() };
        let mut g = GuestRegs {
            gpr: [0; 16],
            rflags: 0x202,
        };
        g.gpr[7] = self.buf.addr();
        g.gpr[6] = n;
        g.gpr[4] = top - 8;
        g
    }

    fn native(&mut self, f: Work, n: u64) -> (f64, u64) {
        self.fill();
        *self.rig.native.regs_mut() = self.regs(n);
        let t = Instant::now();
        // SAFETY: f returns to the exit routine via the prepared return slot.
        unsafe { self.rig.native.run(f as usize as u64) };
        (t.elapsed().as_secs_f64(), self.rig.native.regs().gpr[0])
    }

    fn translated(&mut self, f: Work, n: u64, tool: &mut dyn Tool) -> (f64, u64) {
        self.fill();
        *self.rig.engine.regs_mut() = self.regs(n);
        self.rig.engine.set_rip(GuestVirt(f as usize as u64));
        let mut plat = HostPlatform::default();
        let t = Instant::now();
        let stop = self.rig.engine.run(&mut self.mem, &mut plat, tool);
        let dt = t.elapsed().as_secs_f64();
        assert_eq!(
            stop,
            Stop::FetchFault(GuestVirt(self.rig.native.exit_address()))
        );
        (dt, self.rig.engine.regs().gpr[0])
    }
}

/// Translation throughput over this binary's whole text: translate trace after trace.
fn translation_throughput() {
    let mut rig = Rig::new(Config::default());
    let mut mem = HostMemory::executable_mappings();
    let cache = rig.cache.addr();
    mem.ranges.retain(|&(s, _)| s != cache);
    let exe = std::fs::read_link("/proc/self/exe").expect("exe");
    let maps = std::fs::read_to_string("/proc/self/maps").expect("maps");
    let (lo, hi) = maps
        .lines()
        .filter(|l| l.contains(" r-xp ") && l.ends_with(exe.to_str().expect("utf8")))
        .map(|l| {
            let r = l.split_whitespace().next().expect("range");
            let (a, b) = r.split_once('-').expect("dash");
            (
                u64::from_str_radix(a, 16).expect("hex"),
                u64::from_str_radix(b, 16).expect("hex"),
            )
        })
        .next()
        .expect("text mapping");
    let t = Instant::now();
    let mut va = lo;
    while va < hi {
        match rig
            .engine
            .pretranslate(&mut mem, &mut NullTool, GuestVirt(va))
        {
            Ok(n) => va += n.max(1),
            Err(_) => va += 1,
        }
        if t.elapsed().as_secs_f64() > 3.0 {
            break;
        }
    }
    let dt = t.elapsed().as_secs_f64();
    let s = rig.engine.stats();
    println!(
        "translation: {} guest instructions ({} bytes, {} traces) in {:.3} s = {:.2} M instr/s; {:.2} cache bytes per guest byte; {} flushes",
        s.guest_insns,
        s.guest_bytes,
        s.fragments,
        dt,
        s.guest_insns as f64 / dt / 1e6,
        s.cache_bytes as f64 / s.guest_bytes as f64,
        s.flushes
    );
}

fn main() {
    if std::env::args().any(|a| a == "--translate-only") {
        translation_throughput();
        return;
    }
    let workloads: [(&str, Work, u64); 4] = [
        ("compute_loop", compute_loop, 100_000_000),
        ("sieve", sieve, 2000),
        ("quicksort", quicksort, 300),
        ("interpreter", interpreter, 12_000),
    ];
    let mut b = Bench {
        rig: Rig::new(Config::default()),
        stack: Region::map(8 << 20, 0),
        buf: Region::map(BUF_WORDS * 8, 0),
        mem: HostMemory::executable_mappings(),
    };
    let cache = b.rig.cache.addr();
    b.mem.ranges.retain(|&(s, _)| s != cache);
    translation_throughput();
    println!("kpin guest-engine benchmark: ratios vs native measured in this run");
    println!("  steady_x = best of 2 warm translated runs / best of 3 native runs taken around them; first_x = cold run incl. translation");
    println!(
        "{:<14} {:<11} {:>9} {:>9} {:>10} {:>12} {:>10} {:>9}",
        "workload",
        "tool",
        "native_s",
        "steady_x",
        "first_x",
        "transl_Mi/s",
        "cache_B/B",
        "ibl_hit"
    );
    let only: Option<String> = std::env::args().skip_while(|a| a != "--only").nth(1);
    let tools: Option<String> = std::env::args().skip_while(|a| a != "--tools").nth(1);
    let mut invalidations = Vec::new();
    for (name, f, n) in workloads {
        if only.as_deref().is_some_and(|o| o != name) {
            continue;
        }
        // Best of three native runs.
        let (tn0, rn) = b.native(f, n);
        for tool_name in [
            "null",
            "null+cnt",
            "bbcount",
            "bbcount+cnt",
            "memtrace",
            "bbcall",
            "bbcall-nv",
        ] {
            if tools
                .as_deref()
                .is_some_and(|t| !t.split(',').any(|t| t == tool_name))
            {
                continue;
            }
            // bbcall-nv: the analysis routine is declared vector-free (no XSAVE per call).
            let cfg = Config {
                analysis_preserves_vector_state: tool_name == "bbcall-nv",
                count_insns: tool_name.ends_with("+cnt"),
                // `--no-isolate`: without the memory-operand checks (`isolate.rs`), to
                // measure their cost.
                isolate: !std::env::args().any(|a| a == "--no-isolate"),
                ..Config::default()
            };
            b.rig = Rig::new(cfg);
            let cache = b.rig.cache.addr();
            b.mem = HostMemory::executable_mappings();
            b.mem.ranges.retain(|&(s, _)| s != cache);
            let mut tool: Box<dyn Tool> = match tool_name {
                "null" | "null+cnt" => Box::new(NullTool),
                "bbcount" | "bbcount+cnt" => Box::new(BblCount::default()),
                "memtrace" => Box::new(MemTrace::default()),
                _ => Box::new(BblCalls::default()),
            };
            let mut tn = tn0.min(b.native(f, n).0);
            let (t1, r1) = b.translated(f, n, &mut *tool);
            let s = b.rig.engine.stats();
            // Steady state: best of two further runs over the warm cache.
            let (mut t2, r2) = b.translated(f, n, &mut *tool);
            t2 = t2.min(b.translated(f, n, &mut *tool).0);
            // Native again right next to the translated runs (the machine is shared).
            tn = tn.min(b.native(f, n).0);
            if tool_name == "null+cnt" {
                let insns = b.rig.engine.executed_insns(Mode::KERNEL);
                assert_eq!(insns % 3, 0, "{name}: three identical runs");
            }
            if tool_name == "null" {
                // A CR3 write right after the workload filled the lookup tables, then
                // one right after another (nothing filled in between).
                let t = Instant::now();
                b.rig.engine.invalidate_all_mappings();
                let full = t.elapsed().as_secs_f64();
                let t = Instant::now();
                for _ in 0..1000 {
                    b.rig.engine.invalidate_all_mappings();
                }
                invalidations.push((name, full, t.elapsed().as_secs_f64() / 1000.0));
            }
            assert_eq!(
                (r1, r2),
                (rn, rn),
                "{name}/{tool_name}: result differs from native"
            );
            // IBL hit rate in a separate counting run (the counting costs cycles).
            b.rig = Rig::new(Config {
                count_ibl_lookups: true,
                ..cfg
            });
            let cache = b.rig.cache.addr();
            b.mem.ranges.retain(|&(s, _)| s != cache);
            let (_, r3) = b.translated(f, n / 4 + 1, &mut *tool);
            let _ = r3;
            let lookups = b.rig.engine.ibl_lookups();
            let misses =
                b.rig.engine.stats().exits[guest_engine::exit_code::EXIT_IBL_MISS as usize];
            let hit = if lookups == 0 {
                f64::NAN
            } else {
                1.0 - misses as f64 / lookups as f64
            };
            let mips = s.guest_insns as f64 / (s.translate_ns as f64 / 1e9) / 1e6;
            println!(
                "{:<14} {:<11} {:>9.3} {:>9.2} {:>10.2} {:>12.2} {:>10.2} {:>9.5}",
                name,
                tool_name,
                tn,
                t2 / tn,
                t1 / tn,
                mips,
                s.cache_bytes as f64 / s.guest_bytes as f64,
                hit
            );
        }
    }
    // What clearing every mode's IBL table and return cache whole would cost.
    let mut tables = vec![
        1u8;
        guest_engine::layout::MODE_SLOTS
            * (guest_engine::layout::IBL_TABLE_BYTES
                + guest_engine::layout::RC_BYTES)
    ];
    let t = Instant::now();
    for _ in 0..10 {
        // SAFETY: writes inside the vector.
        unsafe { std::ptr::write_bytes(tables.as_mut_ptr(), 0, tables.len()) };
        std::hint::black_box(&mut tables);
    }
    let whole = t.elapsed().as_secs_f64() / 10.0;
    for (name, full, empty) in invalidations {
        println!(
            "invalidate_all_mappings after {name}: {:.2} us (tables filled by the run), {:.2} us (empty); clearing all tables whole: {:.1} us",
            full * 1e6,
            empty * 1e6,
            whole * 1e6
        );
    }
}
