//! Linux under the soak workload survives repeated `kpin attach`/`detach` cycles of
//! bbcount from the host (issue #14). The pinned Debian kernel starts resident under the
//! engine (`kpin run --resident`: tool null, no window; on this nested KVM a Linux booted
//! natively cannot be attached to), and once user space runs the test opens and closes
//! bbcount windows through the control socket. Each attach switches tools at a trace
//! boundary with a clean code cache, each detach finishes the window's files and returns
//! to no instrumentation. Must hold: every `KPIN-SOAK-ROUND` md5 right, no line where the
//! kernel noticed the engine (warnings, BUGs, stalls), a clean poweroff, one
//! `attach-<n>/bbcount.csv` per window whose instruction count is plausible for the
//! window's length. Prints attach and detach latencies (vCPU loop and client).
//!
//! `test_linux_soak_100_cycles` (ignored: minutes) is the latency measurement, and
//! `test_linux_soak_30_minutes` (ignored: half an hour; `KPIN_SOAK_SECONDS` changes the
//! length) the long soak of issue #24: a window every few seconds while a neighbour Linux
//! guest boots again and again, each window's files checked and removed as it closes, the
//! process's RSS sampled throughout and bounded after the first minutes (docs/soak.md):
//! `cargo test --release -p kpin-tests --test attach_linux_soak -- --ignored --nocapture`.

use std::path::Path;
use std::time::{Duration, Instant};

use kpin_tests::attach::{spawn_vm, Neighbour};
use kpin_tests::{engine_config, require_kvm, scratch_dir};
use kpin_tool_bbcount::parse_csv;
use vmm::control::client::{request, ClientError};
use vmm::control::protocol::{Reply, Request};
use vmm::control::SOCKET_NAME;
use vmm::guests::LINUX_CMDLINE;
use vmm::{ControlConfig, Outcome, RunReport, VmConfig};

/// Latencies of one window, in ms.
struct Cycle {
    attach_loop: f64,
    attach_client: f64,
    detach_loop: f64,
    detach_client: f64,
    /// Client time from the attach reply to the detach reply.
    window: Duration,
    /// Guest instructions the engine counted from before the attach to after the detach.
    engine_insns: u64,
}

/// Guest instructions each window must see executed before it is closed.
const WINDOW_MIN_INSNS: u64 = 200_000;

/// How many windows a soak opens.
enum Windows {
    /// This many, their files kept until the end and checked then.
    Count(u64),
    /// As many as fit before this much time has passed since the first; each window's
    /// files are checked and removed as it closes (the output stays bounded).
    For(Duration),
}

/// What a soak measured besides its windows.
struct Soak {
    cycles: Vec<Cycle>,
    /// (seconds since the first window, this process's RSS in KiB) at every window.
    rss: Vec<(f64, u64)>,
    /// Bytes of the windows' files, removed as they closed (`Windows::For`).
    window_bytes: u64,
    /// Bytes left in the output directory at the end.
    out_bytes: u64,
}

/// This process's resident set in KiB (`VmRSS`): the VMM, the guest's RAM it touched,
/// the daemon's buffers.
fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/self/status")
}

/// Bytes of the files below `dir`.
fn tree_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => tree_bytes(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}

fn wait_for(what: &str, budget: Duration, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < budget, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn ok(r: Result<Reply, ClientError>, what: &str) -> Reply {
    let r = r.unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(r.ok, "{what}: {r:?}");
    r
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn max(v: &[f64]) -> f64 {
    v.iter().copied().fold(0.0, f64::max)
}

/// Boots Linux resident with the soak workload for `soak_s` guest seconds, opens and
/// closes bbcount windows (`windows`) of `window` with gaps of `gap`, checks the run and
/// every window.
fn soak(name: &str, windows: Windows, soak_s: u64, window: Duration, gap: Duration) -> Soak {
    let images = kpin_images::default_out_dir();
    let linux = kpin_images::ensure_linux(&images, &mut |l| eprintln!("images: {l}"))
        .expect("fetch and build the Linux images");
    let dir = scratch_dir(name);
    let console = dir.join("console.log");
    let mut engine = engine_config("null", "");
    // As `kpin run --resident` does: the windows name the processes they saw run.
    engine.kernel_types = vmm::diag::kernel_types::Pending::ready(
        vmm::diag::kernel_types::from_kernel(&linux.vmlinux)
            .expect("the kernel's BTF")
            .0,
    );
    let cfg = VmConfig {
        initrd: Some(linux.initramfs.clone()),
        cmdline: format!("{LINUX_CMDLINE} kpin.workload=soak kpin.soak={soak_s}"),
        timeout: Some(Duration::from_secs(soak_s + 600)),
        console_file: Some(console.clone()),
        system_map: Some(linux.system_map.clone()),
        engine: Some(engine.clone()),
        ..VmConfig::new(linux.vmlinux.clone())
    };
    let control = ControlConfig {
        socket: dir.join(SOCKET_NAME),
        out_dir: dir.clone(),
        engine_image: Some(engine.image),
        boot_tool: None,
        boot_resident: true,
        kernel: Some(linux.vmlinux.clone()),
    };
    let vm_thread = spawn_vm(cfg, control, dir.clone());
    let read_console = || std::fs::read_to_string(&console).unwrap_or_default();
    wait_for("user space", Duration::from_secs(240), || {
        read_console().contains("KPIN-USERSPACE-OK")
    });
    let s = ok(request(&dir, &Request::Status), "status");
    assert_eq!(
        (s.state.as_deref(), s.attached, s.windows),
        (Some("resident"), Some(false), Some(0)),
        "{s:?}"
    );
    assert!(s.guest_instructions.unwrap_or(0) > 0, "{s:?}");
    let e = request(&dir, &Request::Detach).expect("detach while resident");
    assert!(!e.ok, "{e:?}");
    let bbcount = Request::Attach {
        tool: "bbcount".into(),
        options: Default::default(),
    };
    let insns = |r: &Reply| {
        r.guest_instructions
            .expect("status counts guest instructions")
    };
    let mut done = Vec::new();
    let (mut rss, mut window_bytes) = (Vec::new(), 0);
    let first = Instant::now();
    for n in 1.. {
        let more = match windows {
            Windows::Count(c) => n <= c,
            Windows::For(d) => first.elapsed() < d,
        };
        if !more {
            break;
        }
        let before = insns(&ok(request(&dir, &Request::Status), "status"));
        let t = Instant::now();
        let a = ok(request(&dir, &bbcount), "attach");
        let attach_client = t.elapsed();
        assert_eq!((a.windows, a.state.as_deref()), (Some(n), Some("attached")));
        let opened = Instant::now();
        if n == 1 {
            let again = request(&dir, &bbcount).expect("attach while attached");
            assert!(!again.ok, "{again:?}");
        }
        std::thread::sleep(window);
        // However slow the host, the window covers some guest work: the count must move
        // on by WINDOW_MIN_INSNS from where it stood at the switch (the engine published
        // it then; later it lags by at most a progress sample, a second).
        let opened_at = insns(&ok(request(&dir, &Request::Status), "status"));
        wait_for(
            "the guest to run in the window",
            Duration::from_secs(300),
            || {
                insns(&ok(request(&dir, &Request::Status), "status"))
                    >= opened_at + WINDOW_MIN_INSNS
            },
        );
        let t = Instant::now();
        let d = ok(request(&dir, &Request::Detach), "detach");
        let detach_client = t.elapsed();
        assert_eq!(d.state.as_deref(), Some("resident"), "{d:?}");
        // Published when the engine served the detach: covers the whole window.
        let after = insns(&ok(request(&dir, &Request::Status), "status"));
        done.push(Cycle {
            attach_loop: a.latency_ms.unwrap_or(f64::NAN),
            attach_client: attach_client.as_secs_f64() * 1e3,
            detach_loop: d.latency_ms.unwrap_or(f64::NAN),
            detach_client: detach_client.as_secs_f64() * 1e3,
            window: opened.elapsed(),
            engine_insns: after - before,
        });
        rss.push((first.elapsed().as_secs_f64(), rss_kib()));
        if let Windows::For(_) = windows {
            let w = dir.join(format!("attach-{n}"));
            check_window(&w, done.last().expect("just pushed"));
            window_bytes += tree_bytes(&w);
            std::fs::remove_dir_all(&w).expect("remove a checked window");
        }
        std::thread::sleep(gap);
    }
    let report: RunReport = vm_thread.join().expect("the VM thread");
    let text = read_console();
    check_run(&report, &text, &dir);
    if let Windows::Count(_) = windows {
        for (i, c) in done.iter().enumerate() {
            check_window(&dir.join(format!("attach-{}", i + 1)), c);
        }
    }
    Soak {
        cycles: done,
        rss,
        window_bytes,
        out_bytes: tree_bytes(&dir),
    }
}

/// Poweroff, every soak round's md5 right, nothing on the console that shows the kernel
/// noticed the engine.
fn check_run(report: &RunReport, text: &str, dir: &Path) {
    let engine_log = std::fs::read_to_string(dir.join(host_daemon::ENGINE_LOG)).unwrap_or_default();
    let tail: Vec<&str> = engine_log.lines().rev().take(40).collect();
    assert_eq!(
        report.outcome,
        Outcome::Poweroff,
        "console:\n{text}\nengine.log (newest first):\n{}\ndump:\n{}",
        tail.join("\n"),
        report.dump.clone().unwrap_or_default()
    );
    let md5 = kpin_images::workload_expected_md5();
    let rounds: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("KPIN-SOAK-ROUND "))
        .collect();
    assert!(!rounds.is_empty(), "{text}");
    for r in &rounds {
        assert!(r.ends_with(&format!(" {md5}")), "`{r}`: md5 {md5} expected");
    }
    assert!(
        text.contains(&format!("KPIN-WORKLOAD-DONE {md5}")),
        "{text}"
    );
    if let Some(line) = kpin_tests::noticed_the_engine(text) {
        panic!("`{line}` on the console\n{text}");
    }
    println!("{} soak rounds, all md5 {md5}", rounds.len());
}

/// The window's bbcount.csv counts a plausible number of instructions: the kernel ran in
/// it (timer interrupts at least), more than half of [`WINDOW_MIN_INSNS`] (the window
/// stayed open until the engine's count moved on by that much, counted from before the
/// attach), and no more than the engine counted from before the attach to after the
/// detach (with a margin for blocks cut short by faults, which the engine takes back).
fn check_window(window: &Path, c: &Cycle) {
    let csv = std::fs::read_to_string(window.join("bbcount.csv"))
        .unwrap_or_else(|e| panic!("{}/bbcount.csv: {e}", window.display()));
    let rows = parse_csv(&csv).unwrap_or_else(|line| panic!("bbcount.csv line {line}"));
    let total: u64 = rows
        .iter()
        .map(|r| r.count * u64::from(r.instructions))
        .sum();
    let kernel: u64 = rows
        .iter()
        .filter(|r| r.cpl == 0)
        .map(|r| r.count * u64::from(r.instructions))
        .sum();
    println!(
        "{}: {total} guest instructions ({kernel} at CPL 0) in {:.2} s ({} blocks; the engine counted {})",
        window.display(),
        c.window.as_secs_f64(),
        rows.len(),
        c.engine_insns
    );
    assert!(
        kernel > 0 && total > WINDOW_MIN_INSNS / 2 && total <= c.engine_insns + c.engine_insns / 10,
        "{}: {total} instructions ({kernel} at CPL 0); the engine counted {} around the window",
        window.display(),
        c.engine_insns
    );
    assert!(window.join("counters.json").exists());
    check_processes(window);
}

/// The window's `processes.json` names tasks (the resident engine's kernel types) and its
/// rows add up to the window's `counters.json` exactly (both cover the engine's run so far,
/// written at the same instant); busybox's applets show `busybox` as their executable.
fn check_processes(window: &Path) {
    let text = std::fs::read_to_string(window.join("processes.json"))
        .unwrap_or_else(|e| panic!("{}/processes.json: {e}", window.display()));
    let p: serde_json::Value = serde_json::from_str(&text).expect("processes.json parses");
    assert_eq!(p["by"], "task", "{}", window.display());
    let rows = p["processes"].as_array().expect("rows");
    let counters = kpin_tests::engine_counters(window);
    for (key, cpl) in [
        ("user_instructions", "cpl3"),
        ("kernel_instructions", "cpl0"),
    ] {
        let sum: u64 = rows.iter().filter_map(|r| r[key].as_u64()).sum();
        assert_eq!(
            sum,
            kpin_tests::json_u64(&counters, &format!("/guest_instructions/{cpl}")),
            "{}: {key}",
            window.display()
        );
    }
    assert!(
        rows.iter()
            .any(|r| r["exe"] == "busybox" && r["comm"] != "busybox"),
        "{}: no busybox applet among {} rows",
        window.display(),
        rows.len()
    );
}

fn print_latencies(cycles: &[Cycle]) {
    let col = |f: fn(&Cycle) -> f64| cycles.iter().map(f).collect::<Vec<_>>();
    for (name, v) in [
        ("attach, vCPU loop", col(|c| c.attach_loop)),
        ("attach, client round trip", col(|c| c.attach_client)),
        ("detach, vCPU loop", col(|c| c.detach_loop)),
        ("detach, client round trip", col(|c| c.detach_client)),
    ] {
        println!(
            "{name}: median {:.2} ms, max {:.2} ms over {} cycles",
            median(v.clone()),
            max(&v),
            v.len()
        );
    }
}

#[test]
fn test_linux_soak_survives_three_bbcount_attach_detach_cycles() {
    require_kvm!();
    let soak = soak(
        "attach-linux-soak",
        Windows::Count(3),
        25,
        Duration::from_millis(1500),
        Duration::from_millis(500),
    );
    print_latencies(&soak.cycles);
}

#[test]
#[ignore = "minutes: the 100-cycle soak measurement (docs/benchmarks.md)"]
fn test_linux_soak_100_cycles() {
    require_kvm!();
    let soak = soak(
        "attach-linux-soak-100",
        Windows::Count(100),
        150,
        Duration::from_millis(500),
        Duration::from_millis(200),
    );
    print_latencies(&soak.cycles);
}

/// RSS growth allowed after the first [`RSS_SETTLED_S`] seconds of windows: the guest
/// has touched its working set by then; what grows after is a leak.
const RSS_GROWTH_KIB: u64 = 32 * 1024;
const RSS_SETTLED_S: f64 = 180.0;

#[test]
#[ignore = "half an hour: the long soak of issue #24 (docs/soak.md)"]
fn test_linux_soak_30_minutes() {
    require_kvm!();
    let secs: u64 = std::env::var("KPIN_SOAK_SECONDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1800);
    let neighbour = Neighbour::start(scratch_dir("attach-linux-soak-neighbour"));
    // The guest's soak outlasts the windows: they stop a minute before it ends.
    let soak = soak(
        "attach-linux-soak-30min",
        Windows::For(Duration::from_secs(secs.saturating_sub(60).max(30))),
        secs,
        Duration::from_millis(2000),
        Duration::from_millis(2000),
    );
    let boots = neighbour.stop();
    print_latencies(&soak.cycles);
    println!("minute  windows  RSS (MiB)");
    let mut minute = 0;
    for (i, &(t, kib)) in soak.rss.iter().enumerate() {
        if t >= f64::from(minute) * 60.0 {
            println!("{minute:>6}  {:>7}  {:>9.1}", i + 1, kib as f64 / 1024.0);
            minute += 1;
        }
    }
    let settled = soak
        .rss
        .iter()
        .find(|(t, _)| *t >= RSS_SETTLED_S)
        .map_or(0, |&(_, k)| k);
    let last = soak.rss.last().map_or(0, |&(_, k)| k);
    println!(
        "{} windows; RSS {:.1} MiB after {RSS_SETTLED_S} s, {:.1} MiB at the end; the windows wrote {:.1} MiB (checked and removed as they closed), {:.1} MiB left in the output directory; the neighbour booted Linux {boots} times",
        soak.cycles.len(),
        settled as f64 / 1024.0,
        last as f64 / 1024.0,
        soak.window_bytes as f64 / (1 << 20) as f64,
        soak.out_bytes as f64 / (1 << 20) as f64
    );
    if settled > 0 {
        assert!(
            last <= settled + RSS_GROWTH_KIB,
            "RSS grew from {settled} KiB to {last} KiB after the first {RSS_SETTLED_S} s"
        );
    }
}
