//! Helpers for the tests of `kpin attach`/`detach` on the mini-kernel: starting it with
//! a control socket, waiting on the guest's marks, and counting its known loop in a
//! window's `bbcount.csv`.
//!
//! The mini-kernel's `kpin.attach_cycles=N` goes through N windows: in each it runs its
//! known loop once, then marks that on the attach-status port; it tells a new window from
//! the last one by the port's window count, so a detach and an attach that both land
//! before the guest next runs (a busy host) cannot hang it.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use iced_x86::{Decoder, DecoderOptions, FlowControl};
use kpin_tool_bbcount::{parse_csv, Row};
use vmm::control::client::request;
use vmm::control::protocol::{Reply, Request};
use vmm::control::SOCKET_NAME;
use vmm::symbols::Symbols;
use vmm::{ControlConfig, Outcome, RunReport, Vm, VmConfig};

use crate::{
    compare_minikernel_transcript, engine_config, kpin_bin, minikernel_elf, minikernel_expected,
};

/// How long a test waits for the guest to reach a mark or a socket to appear: generous,
/// for a loaded host; the guest's own progress ends the wait, not this.
pub const GUEST_PROGRESS_BUDGET: Duration = Duration::from_secs(300);

/// Waits until the run in `dir` listens on its control socket.
pub fn wait_for_socket(dir: &Path) {
    let start = Instant::now();
    while !dir.join(SOCKET_NAME).exists() {
        assert!(
            start.elapsed() < GUEST_PROGRESS_BUDGET,
            "no control socket in {}",
            dir.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The bytes of the loaded image at `va` (the mini-kernel's PT_LOAD segments).
fn code_at(elf: &[u8], va: u64, len: usize) -> Option<&[u8]> {
    let u16_at = |o: usize| u16::from_le_bytes(elf[o..o + 2].try_into().unwrap());
    let u64_at = |o: usize| u64::from_le_bytes(elf[o..o + 8].try_into().unwrap());
    let phoff = u64_at(0x20) as usize;
    for i in 0..usize::from(u16_at(0x38)) {
        let ph = phoff + i * usize::from(u16_at(0x36));
        let (off, vaddr, filesz) = (u64_at(ph + 8), u64_at(ph + 0x10), u64_at(ph + 0x20));
        if va >= vaddr && va + len as u64 <= vaddr + filesz {
            let start = (off + va - vaddr) as usize;
            return elf.get(start..start + len);
        }
    }
    None
}

/// How many times the body of `known_loop_1000` ran, by `rows`.
pub fn known_loop_runs(rows: &[Row]) -> u64 {
    let elf = std::fs::read(minikernel_elf()).expect("read the mini-kernel");
    let symbols = Symbols::from_elf(&elf).expect("the mini-kernel's symbol table");
    let known = symbols.find("known_loop_1000").expect("known_loop_1000");
    let (func, size) = (known.address, known.size.expect("its size"));
    let code = code_at(&elf, func, size as usize).expect("its bytes");
    let body = Decoder::with_ip(64, code, func, DecoderOptions::NONE)
        .into_iter()
        .find(|i| {
            i.flow_control() == FlowControl::ConditionalBranch && i.near_branch_target() < i.ip()
        })
        .expect("the loop's backward branch")
        .near_branch_target();
    let mut runs = 0;
    for r in rows {
        if r.address < func || r.address >= func + size {
            continue;
        }
        let Some(bytes) = code_at(&elf, r.address, (func + size - r.address) as usize) else {
            continue;
        };
        if Decoder::with_ip(64, bytes, r.address, DecoderOptions::NONE)
            .into_iter()
            .take(r.instructions as usize)
            .any(|i| i.ip() == body)
        {
            runs += r.count;
        }
    }
    runs
}

/// How many times the body of `known_loop_1000` ran, by the `bbcount.csv` in `window`
/// (panics naming the file if it is missing or malformed).
pub fn window_known_loop_runs(window: &Path) -> u64 {
    let path = window.join("bbcount.csv");
    let csv = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let rows = parse_csv(&csv).unwrap_or_else(|line| panic!("{} line {line}", path.display()));
    known_loop_runs(&rows)
}

/// Runs `cfg` with the control channel `control` on a thread of its own, the host daemon
/// writing to `out`; returns the thread, whose result is the run's report.
pub fn spawn_vm(cfg: VmConfig, control: ControlConfig, out: PathBuf) -> JoinHandle<RunReport> {
    std::thread::spawn(move || {
        let mut daemon = host_daemon::Daemon::new(&out);
        let report = Vm::new(&cfg)
            .expect("create VM")
            .run_with_control(&mut daemon, Some(control))
            .expect("run VM");
        daemon.finish().expect("finish output files");
        report
    })
}

/// Joins the mini-kernel's VM thread and checks that it powered off having printed its
/// transcript (`console`); returns the number of steps it skipped. `log` (the engine
/// log that matters) is shown on a failure.
pub fn join_with_transcript(vm_thread: JoinHandle<RunReport>, console: &Path, log: &str) -> usize {
    let report = vm_thread.join().expect("the VM thread");
    let text = std::fs::read_to_string(console).unwrap_or_default();
    assert_eq!(
        report.outcome,
        Outcome::Poweroff,
        "console:\n{text}\nengine log:\n{log}\ndump:\n{}",
        report.dump.unwrap_or_default()
    );
    compare_minikernel_transcript(&text, &minikernel_expected())
        .unwrap_or_else(|e| panic!("{e}\n{text}"))
}

/// Waits until the guest has made `n` marks on the attach-status port.
pub fn wait_marks(dir: &Path, n: u64) -> Reply {
    let start = Instant::now();
    loop {
        let s = request(dir, &Request::Status).expect("status");
        if s.guest_marks == Some(n) {
            return s;
        }
        assert!(
            start.elapsed() < GUEST_PROGRESS_BUDGET,
            "no mark {n}: {s:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Starts the mini-kernel with `cmdline` and a control socket in `dir`, natively or
/// under `boot_tool` from its first instruction; returns the VM thread and the console
/// path once the socket exists.
pub fn start_minikernel(
    dir: &Path,
    cmdline: &str,
    boot_tool: Option<&str>,
) -> (std::thread::JoinHandle<RunReport>, PathBuf) {
    let console = dir.join("console.log");
    let cfg = VmConfig {
        cmdline: cmdline.to_owned(),
        timeout: Some(Duration::from_secs(300)),
        console_file: Some(console.clone()),
        engine: boot_tool.map(|t| engine_config(t, "")),
        ..VmConfig::new(minikernel_elf())
    };
    let control = ControlConfig {
        socket: dir.join(SOCKET_NAME),
        out_dir: dir.to_owned(),
        engine_image: Some(engine_config("null", "").image),
        boot_tool: boot_tool.map(str::to_owned),
        boot_resident: false,
        kernel: None,
    };
    let vm_thread = spawn_vm(cfg, control, dir.to_owned());
    wait_for_socket(dir);
    (vm_thread, console)
}

/// A Linux guest booting again and again (the `kpin` binary, tool null) until dropped:
/// a neighbour whose exits and translations compete with the mini-kernels.
pub struct Neighbour(Arc<AtomicBool>, Option<JoinHandle<u64>>);

impl Neighbour {
    /// Starts booting in `dir` (one `boot-<n>/` at a time, removed after each boot).
    pub fn start(dir: PathBuf) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut boots = 0;
            while !flag.load(Ordering::Relaxed) {
                let out = dir.join(format!("boot-{boots}"));
                let status = std::process::Command::new(kpin_bin())
                    .args(["run", "--tool", "null", "--quiet", "--out"])
                    .arg(&out)
                    .stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::null())
                    .status()
                    .expect("run kpin");
                assert!(status.success(), "the neighbour's boot {boots}: {status}");
                let _ = std::fs::remove_dir_all(&out);
                boots += 1;
            }
            boots
        });
        Neighbour(stop, Some(thread))
    }

    /// Stops after the boot in progress; returns how many finished.
    pub fn stop(mut self) -> u64 {
        self.0.store(true, Ordering::Relaxed);
        self.1
            .take()
            .map_or(0, |t| t.join().expect("the neighbour"))
    }
}

impl Drop for Neighbour {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}
