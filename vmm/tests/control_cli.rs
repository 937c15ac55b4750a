//! `kpin attach|detach|status` on runs that do not exist and on a live run that refuses:
//! a one-line error and exit status 1 (no such run) or 2 (refused), never a panic; slow
//! clients on the same socket do not hold the commands off.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use kpin_tests::{require_kvm, scratch_dir};

fn kpin(args: &[&str], run: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kpin"))
        .args(args)
        .arg(run)
        .output()
        .expect("run kpin")
}

fn assert_error(o: &Output, status: i32, what: &str) {
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(status), "stderr: {err}");
    assert!(!err.contains("panicked"), "kpin panicked: {err}");
    let lines: Vec<&str> = err
        .lines()
        .filter(|l| l.starts_with("kpin: error:"))
        .collect();
    assert_eq!(lines.len(), 1, "want one error line: {err}");
    assert!(lines[0].contains(what), "{:?} lacks {what:?}", lines[0]);
}

#[test]
fn test_commands_on_a_missing_run_exit_1() {
    let dir = scratch_dir("control-cli-missing");
    for args in [
        &["attach", "--tool", "bbcount"][..],
        &["detach"],
        &["status"],
    ] {
        assert_error(&kpin(args, &dir), 1, "no running kpin run");
    }
    // A stale socket file nobody listens on is "ended", too.
    std::os::unix::net::UnixListener::bind(dir.join("control.sock")).expect("bind");
    assert_error(&kpin(&["status"], &dir), 1, "has ended");
}

/// Kills the child run if the test fails half-way.
struct Run(Child);

impl Drop for Run {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn test_a_live_run_refuses_detach_while_detached_and_unknown_tools_with_status_2() {
    require_kvm!();
    let dir = scratch_dir("control-cli-live");
    // The mini-kernel waits for an attach before its known loop: it stays alive.
    let child = Command::new(env!("CARGO_BIN_EXE_kpin"))
        .args([
            "run",
            "--guest",
            "minikernel",
            "--append",
            "kpin.wait_attach=1",
            "--timeout",
            "300",
            "-q",
            "--out",
        ])
        .arg(&dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start kpin run");
    let mut run = Run(child);
    let start = Instant::now();
    while !dir.join("control.sock").exists() {
        assert!(
            start.elapsed() < Duration::from_secs(600),
            "no control socket"
        );
        assert!(run.0.try_wait().expect("wait").is_none(), "the run ended");
        std::thread::sleep(Duration::from_millis(100));
    }
    // A silent client and one that sent half a line hold off no one: the status below is
    // answered while both still wait for their deadline's error.
    let mut silent = UnixStream::connect(dir.join("control.sock")).expect("connect");
    let mut partial = UnixStream::connect(dir.join("control.sock")).expect("connect");
    partial.write_all(b"{\"cmd\":\"sta").expect("send");
    let status = kpin(&["status"], &dir);
    assert_eq!(status.status.code(), Some(0));
    for s in [&mut silent, &mut partial] {
        s.set_nonblocking(true).expect("nonblocking");
        let mut b = [0u8; 1];
        let early = s.read(&mut b);
        assert!(
            matches!(&early, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
            "a slow client was answered before the status: {early:?}"
        );
    }
    for mut s in [silent, partial] {
        s.set_nonblocking(false).expect("blocking");
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        assert!(out.contains("no complete request within"), "{out}");
    }
    let s: serde_json::Value = serde_json::from_slice(&status.stdout).expect("status JSON");
    assert_eq!(s["attached"], false, "{s}");
    assert_eq!(s["windows"], 0, "{s}");
    assert_eq!(s["state"], "native", "{s}");
    assert_eq!(
        s["guest_instructions"], 0,
        "nothing ran under the engine: {s}"
    );
    assert!(s["uptime_s"].as_f64().is_some_and(|t| t > 0.0), "{s}");
    assert_error(&kpin(&["detach"], &dir), 2, "not attached");
    assert_error(
        &kpin(&["attach", "--tool", "nosuch"], &dir),
        2,
        "unknown tool",
    );
    assert_error(
        &kpin(
            &["attach", "--tool", "bbcount", "--tool-option", "depth=3"],
            &dir,
        ),
        2,
        "unknown --tool-option key",
    );
    // Now let it finish: attach null, and the run powers off cleanly.
    let a = kpin(&["attach", "--tool", "null"], &dir);
    assert_eq!(
        a.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&a.stderr)
    );
    assert_error(
        &kpin(&["attach", "--tool", "null"], &dir),
        2,
        "already attached",
    );
    let code = run.0.wait().expect("the run ends");
    assert_eq!(code.code(), Some(0));
    assert!(!dir.join("control.sock").exists(), "socket removed");
}
