//! `kpin attach` on a natively running guest (issue #14): the mini-kernel boots natively
//! with `kpin.wait_attach=1`, so it spins before its known loop until a window is open;
//! the test attaches bbcount through the run's control socket mid-run. The transcript
//! must still be exactly the native one, and the window's `bbcount.csv` (in
//! `<out>/attach-1/`) must count the body of `known_loop_1000` exactly 1000 times.
//! Prints the attach latency.
//!
//! The second test detaches too: with `kpin.attach_cycles=2` the mini-kernel goes through
//! two windows before its steps (in each: the known loop once, a mark on the attach-status
//! port, then a wait for the window to close). The test attaches bbcount to the native
//! guest, waits for the mark, detaches (the engine hands the guest's state back and the
//! VMM resumes it natively), and does it again; each window's `bbcount.csv` must count
//! the loop body exactly 1000 times, and the rest of the run (natively) must print the
//! native transcript. Prints attach and detach latencies.

use std::time::{Duration, Instant};

use kpin_tests::attach::{
    join_with_transcript, spawn_vm, start_minikernel, wait_for_socket, wait_marks,
    window_known_loop_runs, GUEST_PROGRESS_BUDGET,
};
use kpin_tests::{engine_config, minikernel_elf, require_kvm, scratch_dir};
use vmm::control::client::request;
use vmm::control::protocol::Request;
use vmm::control::SOCKET_NAME;
use vmm::guests::MINIKERNEL_NATIVE_CMDLINE;
use vmm::{ControlConfig, Outcome, VmConfig};

#[test]
fn test_attach_bbcount_to_the_native_minikernel_mid_run_counts_its_known_loop() {
    require_kvm!();
    let dir = scratch_dir("attach-minikernel");
    let image = engine_config("null", "").image;
    let console = dir.join("console.log");
    let cfg = VmConfig {
        cmdline: format!("{MINIKERNEL_NATIVE_CMDLINE} kpin.wait_attach=1"),
        timeout: Some(Duration::from_secs(300)),
        console_file: Some(console.clone()),
        ..VmConfig::new(minikernel_elf())
    };
    let control = ControlConfig {
        socket: dir.join(SOCKET_NAME),
        out_dir: dir.clone(),
        engine_image: Some(image),
        boot_tool: None,
        boot_resident: false,
        kernel: None,
    };
    let vm_thread = spawn_vm(cfg, control, dir.clone());
    wait_for_socket(&dir);
    let status = request(&dir, &Request::Status).expect("status");
    assert!(status.ok, "{status:?}");
    assert_eq!(
        (status.attached, status.windows),
        (Some(false), Some(0)),
        "{status:?}"
    );
    let t = Instant::now();
    let attach = request(
        &dir,
        &Request::Attach {
            tool: "bbcount".into(),
            options: Default::default(),
        },
    )
    .expect("attach");
    let round_trip = t.elapsed();
    assert!(attach.ok, "{attach:?}");
    println!(
        "attach latency: {:.2} ms in the vCPU loop, {:.2} ms client round trip",
        attach.latency_ms.unwrap_or(f64::NAN),
        round_trip.as_secs_f64() * 1e3
    );
    let window = dir.join("attach-1");
    let log = std::fs::read_to_string(window.join("engine.log")).unwrap_or_default();
    let skipped = join_with_transcript(vm_thread, &console, &log);
    assert!(
        skipped > 0,
        "the native command line skips native-unsafe steps"
    );
    assert!(!dir.join(SOCKET_NAME).exists(), "the socket is removed");
    assert_eq!(window_known_loop_runs(&window), 1000);
    assert!(
        !dir.join("bbcount.csv").exists(),
        "the window's files go to attach-1/"
    );
}

#[test]
fn test_attach_detach_attach_on_the_native_minikernel_counts_each_window_exactly() {
    require_kvm!();
    let dir = scratch_dir("attach-detach-minikernel");
    let cmdline = format!("{MINIKERNEL_NATIVE_CMDLINE} kpin.attach_cycles=2");
    let (vm_thread, console) = start_minikernel(&dir, &cmdline, None);
    let bbcount = Request::Attach {
        tool: "bbcount".into(),
        options: Default::default(),
    };
    let e = request(&dir, &Request::Detach).expect("detach");
    assert!(!e.ok && e.error.as_deref() == Some("not attached"), "{e:?}");
    for window in 1..=2u64 {
        let t = Instant::now();
        let a = request(&dir, &bbcount).expect("attach");
        let attach_rt = t.elapsed();
        assert!(a.ok, "{a:?}");
        assert_eq!(
            (a.windows, a.state.as_deref()),
            (Some(window), Some("attached"))
        );
        let again = request(&dir, &bbcount).expect("attach again");
        assert!(
            !again.ok
                && again
                    .error
                    .as_deref()
                    .is_some_and(|e| e.contains("already attached")),
            "{again:?}"
        );
        // The guest marks the end of its loop in the window.
        let start = Instant::now();
        loop {
            let s = request(&dir, &Request::Status).expect("status");
            assert_eq!(s.state.as_deref(), Some("attached"), "{s:?}");
            // The live count is published from the engine's run loop, which the mark's
            // port exit does not pass through: it may trail the mark until the VMM's
            // next progress sample nudges the engine (every second).
            if s.guest_marks == Some(window) && s.guest_instructions.unwrap_or(0) >= 1000 * 6 {
                break;
            }
            if s.guest_marks == Some(window) {
                assert!(
                    start.elapsed() < GUEST_PROGRESS_BUDGET,
                    "mark {window} but the live count stays below the loop's 6000: {s:?}"
                );
            }
            assert!(
                start.elapsed() < GUEST_PROGRESS_BUDGET,
                "no mark {window}: {s:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let t = Instant::now();
        let d = request(&dir, &Request::Detach).expect("detach");
        let detach_rt = t.elapsed();
        assert!(d.ok, "{d:?}");
        assert_eq!(d.state.as_deref(), Some("native"), "{d:?}");
        println!(
            "window {window}: attach {:.2} ms in the vCPU loop, {:.2} ms round trip; \
             detach {:.2} ms in the vCPU loop, {:.2} ms round trip",
            a.latency_ms.unwrap_or(f64::NAN),
            attach_rt.as_secs_f64() * 1e3,
            d.latency_ms.unwrap_or(f64::NAN),
            detach_rt.as_secs_f64() * 1e3
        );
        let s = request(&dir, &Request::Status).expect("status");
        assert_eq!(
            (s.state.as_deref(), s.attached, s.windows),
            (Some("native"), Some(false), Some(window)),
            "{s:?}"
        );
    }
    let log = |w: u64| {
        std::fs::read_to_string(dir.join(format!("attach-{w}/engine.log"))).unwrap_or_default()
    };
    join_with_transcript(vm_thread, &console, &format!("{}\n{}", log(1), log(2)));
    for w in 1..=2 {
        let window = dir.join(format!("attach-{w}"));
        assert_eq!(
            window_known_loop_runs(&window),
            1000,
            "window {w}: {}",
            log(w)
        );
        assert!(
            log(w).contains("the guest continues natively"),
            "window {w}: {}",
            log(w)
        );
        assert!(window.join("counters.json").exists(), "window {w}");
    }
}

/// A run started under `--tool bbcount` (window 0, in `<out>/`) detaches to a resident
/// engine (not to native execution: it never ran natively), then an attach switches the
/// resident engine to bbcount again (window `attach-1/`, a clean code cache and fresh
/// counters) and a detach closes it. With `kpin.attach_cycles=2` the guest runs its known
/// loop once in each window: both `bbcount.csv` count its body exactly 1000 times, and
/// the transcript is the full instrumented one.
#[test]
fn test_a_tool_run_detaches_to_resident_and_switches_tools_with_exact_counts() {
    require_kvm!();
    let dir = scratch_dir("attach-resident-minikernel");
    let (vm_thread, console) = start_minikernel(&dir, "kpin.attach_cycles=2", Some("bbcount"));
    let bbcount = Request::Attach {
        tool: "bbcount".into(),
        options: Default::default(),
    };
    let s = wait_marks(&dir, 1);
    assert_eq!(
        (s.state.as_deref(), s.windows),
        (Some("attached"), Some(1)),
        "{s:?}"
    );
    let d = request(&dir, &Request::Detach).expect("detach");
    assert!(d.ok, "{d:?}");
    assert_eq!(d.state.as_deref(), Some("resident"), "{d:?}");
    let e = request(&dir, &Request::Detach).expect("detach again");
    assert!(!e.ok, "{e:?}");
    let a = request(&dir, &bbcount).expect("attach");
    assert!(a.ok, "{a:?}");
    assert_eq!(
        (a.state.as_deref(), a.windows),
        (Some("attached"), Some(2)),
        "{a:?}"
    );
    assert!(
        a.window_dir
            .as_deref()
            .is_some_and(|d| d.ends_with("attach-1")),
        "{a:?}"
    );
    wait_marks(&dir, 2);
    let d = request(&dir, &Request::Detach).expect("detach");
    assert!(d.ok, "{d:?}");
    println!(
        "resident: attach (tool switch) {:.2} ms, detach {:.2} ms in the vCPU loop",
        a.latency_ms.unwrap_or(f64::NAN),
        d.latency_ms.unwrap_or(f64::NAN)
    );
    let log = std::fs::read_to_string(dir.join("engine.log")).unwrap_or_default();
    let skipped = join_with_transcript(vm_thread, &console, &log);
    assert_eq!(skipped, 0, "every step ran under the engine");
    for window in [dir.clone(), dir.join("attach-1")] {
        assert_eq!(
            window_known_loop_runs(&window),
            1000,
            "{}: {log}",
            window.display()
        );
    }
    assert!(!dir.join("attach-2").exists());
}

/// cachesim started with the run simulates on a host thread; its window ends with a
/// detach, and its files must land in window 0's directory (`<out>/`), written by the
/// host when the engine closed the record ring, with the host's summary line in
/// `<out>/engine.log` (kept when the log returns there after the last window). The next
/// window's cachesim simulates in the engine (`attach-1/`, its summary line in that
/// window's log). Each window's L1I references are positive and its records all had a
/// physical address.
#[test]
fn test_cachesim_on_the_host_writes_window_0_files_into_its_directory() {
    require_kvm!();
    let dir = scratch_dir("attach-cachesim-minikernel");
    let (vm_thread, console) = start_minikernel(&dir, "kpin.attach_cycles=2", Some("cachesim"));
    wait_marks(&dir, 1);
    let d = request(&dir, &Request::Detach).expect("detach");
    assert!(d.ok, "{d:?}");
    let a = request(
        &dir,
        &Request::Attach {
            tool: "cachesim".into(),
            options: Default::default(),
        },
    )
    .expect("attach");
    assert!(a.ok, "{a:?}");
    wait_marks(&dir, 2);
    let d = request(&dir, &Request::Detach).expect("detach");
    assert!(d.ok, "{d:?}");
    let report = vm_thread.join().expect("the VM thread");
    let text = std::fs::read_to_string(&console).unwrap_or_default();
    let log = std::fs::read_to_string(dir.join("engine.log")).unwrap_or_default();
    assert_eq!(
        report.outcome,
        Outcome::Poweroff,
        "console:\n{text}\nengine.log:\n{log}\ndump:\n{}",
        report.dump.unwrap_or_default()
    );
    // (A one-core host simulates in the engine.)
    if vmm::engine::host_sim::HostSim::worthwhile() {
        assert!(log.contains("[Info] host: cachesim: "), "{log}");
    }
    for window in [dir.clone(), dir.join("attach-1")] {
        let path = window.join(kpin_tool_cachesim::COUNTERS_NAME);
        let counters = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{}: {e}\n{log}", path.display()));
        let c = kpin_tool_cachesim::files::parse_counters(&counters)
            .unwrap_or_else(|l| panic!("line {l}:\n{counters}"));
        assert!(c.fetch_refs[0] > 0 && c.unresolved == 0, "{c:?}");
    }
    let log1 = std::fs::read_to_string(dir.join("attach-1/engine.log")).unwrap_or_default();
    assert!(
        log1.lines()
            .any(|l| l.starts_with("[Info] cachesim: ") && l.contains("references simulated")),
        "{log1}"
    );
}

/// A detach the engine cannot take is withdrawn, and the window goes on. With
/// `kpin.hold_irq=1` the guest, in its window, keeps a timer interrupt pending with
/// interrupts disabled while it makes 100 000 port exits: no safe point for the engine
/// (an interrupt the guest has not taken could not be handed back). A detach posted then
/// must come back as an error once the VMM's bound (`PENDING_MAX_EXITS`) passes, leaving
/// the guest attached; after the guest takes the interrupt, a detach goes through, and
/// the window still counts the known loop exactly 1000 times.
#[test]
fn test_a_detach_the_engine_cannot_take_is_withdrawn_and_the_window_goes_on() {
    require_kvm!();
    let dir = scratch_dir("attach-withdrawn-minikernel");
    let cmdline = format!("{MINIKERNEL_NATIVE_CMDLINE} kpin.attach_cycles=1 kpin.hold_irq=1");
    let (vm_thread, console) = start_minikernel(&dir, &cmdline, None);
    let a = request(
        &dir,
        &Request::Attach {
            tool: "bbcount".into(),
            options: Default::default(),
        },
    )
    .expect("attach");
    assert!(a.ok, "{a:?}");
    // The interrupt is pending from the first mark until the second.
    wait_marks(&dir, 1);
    let d = request(&dir, &Request::Detach).expect("detach");
    assert!(
        !d.ok && d.error.as_deref().is_some_and(|e| e.contains("withdrawn")),
        "{d:?}"
    );
    let s = request(&dir, &Request::Status).expect("status");
    assert_eq!(
        (s.state.as_deref(), s.windows, s.guest_marks),
        (Some("attached"), Some(1), Some(1)),
        "the guest still held its interrupt and the window stayed open: {s:?}"
    );
    wait_marks(&dir, 2);
    let d = request(&dir, &Request::Detach).expect("detach");
    assert!(d.ok, "{d:?}");
    assert_eq!(d.state.as_deref(), Some("native"), "{d:?}");
    let log = std::fs::read_to_string(dir.join("attach-1/engine.log")).unwrap_or_default();
    join_with_transcript(vm_thread, &console, &log);
    assert_eq!(window_known_loop_runs(&dir.join("attach-1")), 1000, "{log}");
}
