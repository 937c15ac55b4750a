//! `kpin`: run a guest under kpin's VMM, natively or under the guest engine (`--tool`).

use kpin_abi::output;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Parser;
use host_daemon::resolve::SpaceReserve;
use host_daemon::OutputFailure;
use kpin_tool_bbcount::report::{self, BbcountSummary, BlockNames};
use vmm::diag::kernel_symbols::KernelSymbols;
use vmm::guests::{
    LINUX_612_CMDLINE, LINUX_CMDLINE, MINIKERNEL_NATIVE_CMDLINE, USER_KERNEL_CMDLINE,
};
use vmm::input_check::{self, UsageError};
use vmm::layout::{MAX_MEM_MIB, MIN_MEM_MIB};
use vmm::vstate::vm::StopRequest;
use vmm::{control, ControlConfig, Outcome, Vm, VmConfig};

mod cli;
mod cmd;
mod run_record;
mod stop_signals;
mod tools_cmd;

use cli::{Cli, Command, Guest, RunArgs};
use run_record::{
    console_shortfall, hex_keys, unix_seconds, write_run_json, RunStarted, Summary, Verdict,
    OUTPUT_RESERVE_BYTES, STATUS_COMPLETE, STATUS_INCOMPLETE, STATUS_RUNNING,
};

/// Exit status of a clean guest poweroff.
const EXIT_CLEAN: u8 = 0;
/// Exit status when kpin itself fails (bad input, no KVM, images cannot be built).
const EXIT_HOST_ERROR: u8 = 1;
/// Exit status for a bad command line (clap's own errors use it too).
const EXIT_USAGE: u8 = 2;
/// Exit status when the guest crashes (triple fault, KVM emulation failure, unhandled
/// I/O, kernel panic).
const EXIT_GUEST_CRASH: u8 = 3;
/// Exit status when the run's timeout expires.
const EXIT_TIMEOUT: u8 = 4;
/// Exit status when the output directory could not be written (file system full or
/// read-only, an I/O error): the run's results are incomplete. (A run stopped by SIGINT or
/// SIGTERM exits with 128 + the signal: 130, 143.)
const EXIT_OUTPUT_FAILED: u8 = 5;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Images { dir, generic_612 } => {
            cmd::images::images(dir, generic_612).map(|()| EXIT_CLEAN)
        }
        Command::Run(args) => run(*args),
        Command::Attach {
            run,
            tool,
            tool_option,
        } => cmd::control::attach(&run, tool, &tool_option),
        Command::Detach { run } => Ok(cmd::control::detach(&run)),
        Command::Status { run } => Ok(cmd::control::status(&run)),
        Command::Trace {
            run,
            limit,
            kernel,
            system_map,
        } => cmd::trace::trace(&run, limit, kernel.as_deref(), system_map.as_deref())
            .map(|()| EXIT_CLEAN),
        Command::Tools => {
            print!("{}", tools_cmd::render());
            Ok(EXIT_CLEAN)
        }
    };
    match result {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("kpin: error: {e:#}");
            if e.downcast_ref::<UsageError>().is_some() {
                ExitCode::from(EXIT_USAGE)
            } else {
                ExitCode::from(EXIT_HOST_ERROR)
            }
        }
    }
}

/// Says what kpin is doing, on stderr (`kpin: <line>`).
fn progress(line: &str) {
    eprintln!("kpin: {line}");
}

fn run(args: RunArgs) -> anyhow::Result<u8> {
    // The command line first (exit status 2), before any image is built or file read.
    if let Some(tool) = &args.tool {
        input_check::check_tool(tool, &args.tool_option)?;
    }
    if args.kernel.is_none() && (args.initrd.is_some() || args.system_map.is_some()) {
        return Err(UsageError(
            "--initrd and --system-map apply only to --kernel: the built-in guests bring their own"
                .into(),
        )
        .into());
    }
    if !(MIN_MEM_MIB..=MAX_MEM_MIB).contains(&args.mem) {
        bail!(vmm::VmmError::MemSize {
            requested_mib: args.mem,
            min_mib: MIN_MEM_MIB,
            max_mib: MAX_MEM_MIB,
        });
    }
    if args.max_open_files == 0 {
        return Err(UsageError("--max-open-files must be at least 1".into()).into());
    }
    let image_dir = args
        .images
        .clone()
        .unwrap_or_else(kpin_images::default_out_dir);
    let (kernel, initrd, system_map, default_cmdline) = match (&args.kernel, args.guest) {
        (Some(k), _) => (
            k.clone(),
            args.initrd.clone(),
            args.system_map.clone(),
            USER_KERNEL_CMDLINE.to_string(),
        ),
        (None, Some(Guest::Minikernel)) => (
            kpin_images::ensure_minikernel(&image_dir, &mut progress)?,
            None,
            None,
            // Instrumented, every step must run; natively, skip what this KVM cannot run.
            if args.tool.is_some() {
                String::new()
            } else {
                MINIKERNEL_NATIVE_CMDLINE.to_string()
            },
        ),
        (None, Some(Guest::Linux612)) => {
            let l = kpin_images::ensure_linux_kernel(
                kpin_images::GuestKernel::Debian612,
                &image_dir,
                &mut progress,
            )?;
            let cmdline = LINUX_612_CMDLINE.to_string();
            (l.vmlinux, Some(l.initramfs), Some(l.system_map), cmdline)
        }
        (None, Some(Guest::Linux) | None) => {
            let l = kpin_images::ensure_linux(&image_dir, &mut progress)?;
            (
                l.vmlinux,
                Some(l.initramfs),
                Some(l.system_map),
                LINUX_CMDLINE.to_string(),
            )
        }
    };
    // Then the files (exit status 1): regular files whose headers hold, that fit.
    input_check::check_kernel(&kernel, args.mem)?;
    if let Some(initrd) = &initrd {
        input_check::check_initrd(initrd, args.mem)?;
    }
    let mut cmdline = args.cmdline.clone().unwrap_or(default_cmdline);
    if let Some(extra) = &args.append {
        if !cmdline.is_empty() {
            cmdline.push(' ');
        }
        cmdline.push_str(extra);
    }

    let engine_tool = args
        .tool
        .clone()
        .or_else(|| args.resident.then(|| "null".to_owned()));
    let engine = match engine_tool {
        Some(tool) => Some(vmm::EngineConfig {
            image: kpin_images::ensure_engine(&image_dir, &mut progress)?,
            tool: tool.clone(),
            options: input_check::engine_options(&tool, &args.tool_option)?,
            host_sim: !args.sim_in_engine,
        }),
        None => None,
    };

    let out = args.out.clone().unwrap_or_else(default_run_dir);
    std::fs::create_dir_all(&out)
        .with_context(|| format!("cannot create output directory {}", out.display()))?;
    // kpin's own files are never written through a link left in the directory.
    for name in host_daemon::RESERVED_NAMES {
        let p = out.join(name);
        if std::fs::symlink_metadata(&p).is_ok_and(|m| m.file_type().is_symlink()) {
            bail!(
                "{} is a symbolic link; kpin does not write through links: remove it or choose another --out",
                p.display()
            );
        }
    }
    // From here on SIGINT and SIGTERM stop the guest and keep its files so far.
    let stop = StopRequest::new();
    stop_signals::install(&stop).context("cannot install the SIGINT and SIGTERM handlers")?;
    let mut reserve = SpaceReserve::hold(&out, OUTPUT_RESERVE_BYTES).map_err(|e| {
        if matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)) {
            anyhow::anyhow!(
                "the file system of {} lacks {} KiB for kpin's own last files (run.json, dump.txt): {e}: free some space or choose another --out",
                out.display(),
                OUTPUT_RESERVE_BYTES >> 10
            )
        } else {
            anyhow::anyhow!("cannot write to output directory {}: {e}", out.display())
        }
    })?;
    let run = Prepared {
        out,
        image_dir,
        kernel,
        initrd,
        system_map,
        cmdline,
    };
    let started = RunStarted {
        complete: false,
        status: STATUS_RUNNING,
        incomplete_reason: "the run is in progress, or kpin was killed before it ended (a run that ends rewrites this file)".into(),
        pid: std::process::id(),
        started_unix_seconds: unix_seconds(),
        kernel: &run.kernel,
        initrd: run.initrd.as_deref(),
        cmdline: &run.cmdline,
        mem_mib: args.mem,
        tool: args.tool.as_deref(),
    };
    write_run_json(&run.out, &started)?;
    run_guest(&args, &run, engine, stop, &mut reserve).inspect_err(|e| {
        // run.json must not keep saying "running" after kpin gave up.
        let failed = RunStarted {
            status: STATUS_INCOMPLETE,
            incomplete_reason: format!("kpin failed before the run ended: {e:#}"),
            ..started
        };
        reserve.take();
        if let Err(e) = write_run_json(&run.out, &failed) {
            progress(&format!("{e:#}; it still says the run is running"));
        }
    })
}

/// What `run` settled before the guest is created.
struct Prepared {
    out: PathBuf,
    image_dir: PathBuf,
    kernel: PathBuf,
    initrd: Option<PathBuf>,
    system_map: Option<PathBuf>,
    cmdline: String,
}

/// Boots and runs the guest, then writes its results; the exit status.
fn run_guest(
    args: &RunArgs,
    run: &Prepared,
    engine: Option<vmm::EngineConfig>,
    stop: StopRequest,
    reserve: &mut Option<SpaceReserve>,
) -> anyhow::Result<u8> {
    let Prepared {
        out,
        image_dir,
        kernel,
        initrd,
        system_map,
        cmdline,
    } = run;
    let console_file = args
        .console
        .clone()
        .unwrap_or_else(|| out.join(output::CONSOLE_LOG));
    let cfg = VmConfig {
        kernel: kernel.clone(),
        initrd: initrd.clone(),
        cmdline: cmdline.clone(),
        mem_mib: args.mem,
        timeout: (args.timeout > 0).then(|| Duration::from_secs(args.timeout)),
        console_file: Some(console_file.clone()),
        echo_console: !args.quiet,
        system_map: system_map.clone(),
        engine,
    };
    let mut vm = Vm::new(&cfg)?;
    vm.set_stop_request(stop);
    let entry = vm.boot.entry;
    progress(&format!(
        "booting {} ({:?}, entry {entry:#x}) with {} MiB, cmdline \"{cmdline}\"",
        kernel.display(),
        vm.boot.format,
        args.mem
    ));
    if let (Some(e), Some(tool)) = (&vm.engine, &cfg.engine.as_ref().map(|c| &c.tool)) {
        progress(&format!(
            "starting the engine at {:#x} (CR3 {:#x}) with tool {tool}; guest RIP {:#x}, CR3 {:#x} in the attach block",
            e.entry, e.cr3, e.guest_rip, e.guest_cr3
        ));
    }
    let mut daemon = host_daemon::Daemon::with_config(
        out,
        host_daemon::DaemonConfig {
            max_open_files: args.max_open_files,
            max_output_bytes: args.max_output_bytes,
            ..Default::default()
        },
    );
    let mut control = attach_control(out, image_dir, args.tool.as_deref(), cfg.engine.as_ref());
    control.boot_resident = args.resident;
    let report = vm.run_with_control(&mut daemon, Some(control))?;

    // What the run left unfinished, and the first file that could not be written.
    let unfinished: Vec<PathBuf> = daemon.unfinished_files();
    let mut failure = daemon.output_failure().cloned();
    let fallback = daemon.stats().clone();
    let ring = daemon.finish().unwrap_or_else(|e| {
        progress(&format!(
            "cannot finish the run's output files: {}",
            vmm::vstate::vcpu::error_chain(&e)
        ));
        if failure.is_none() {
            failure = OutputFailure::of(&e);
        }
        fallback
    });
    // Before the space kept is given back, which may make a full file system look fine.
    let console_short = console_shortfall(&console_file, report.console_bytes);
    // kpin's own last files get the space kept for them.
    if let Some(r) = reserve.as_mut() {
        r.release();
    }
    let interrupted = match report.outcome {
        Outcome::Interrupted { signal } => Some(signal),
        _ => None,
    };

    let mut dump = report.dump.clone();
    if let (Outcome::EngineFailure, Some(d)) = (&report.outcome, &mut dump) {
        append_engine_log_tail(d, &out.join(output::ENGINE_LOG));
    }
    if let Some(dump) = &dump {
        let path = out.join(output::DUMP_TXT);
        if interrupted.is_some() {
            progress(&format!(
                "the guest's state when it was stopped: {}",
                path.display()
            ));
        } else {
            eprint!("{dump}");
        }
        if let Err(e) = host_daemon::resolve::write_output_file(&path, dump.as_bytes()) {
            progress(&format!("cannot write {}: {e}", path.display()));
            failure.get_or_insert_with(|| OutputFailure::new(&path, &e));
        }
    }
    // The reports read what the tool wrote: not after a stop, nor from unfinished files.
    let reports = interrupted.is_none() && failure.is_none();
    let finished = |name: &str| reports && !unfinished.contains(&out.join(name));
    let engine_counters = finished(output::ENGINE_COUNTERS)
        .then(|| read_engine_counters(out))
        .flatten();
    if let Some(c) = &engine_counters {
        progress(&format!(
            "engine counters ({}):\n{}",
            out.join(output::ENGINE_COUNTERS).display(),
            serde_json::to_string_pretty(c).unwrap_or_default()
        ));
    }
    // Only a bbcount run has bbcount's results: another tool's run may leave a file of
    // that name, which is the guest's, not a report.
    let bbcount = (args.tool.as_deref() == Some(BBCOUNT) && finished(kpin_tool_bbcount::CSV_NAME))
        .then(|| bbcount_report(out, kernel, system_map.as_deref(), args.top, &mut failure))
        .flatten();
    let cachesim_done = !unfinished
        .iter()
        .any(|p| p.strip_prefix(out).is_ok_and(|r| r.starts_with("cachesim")));
    if args.tool.as_deref() == Some("cachesim") && reports && cachesim_done {
        cachesim_report(out, kernel, system_map.as_deref());
    }

    let verdict = Verdict {
        outcome: &report.outcome,
        interrupted,
        failure,
        console_short,
        unfinished: unfinished
            .iter()
            .map(|p| p.strip_prefix(out).unwrap_or(p).display().to_string())
            .collect(),
    };
    let reasons = verdict.reasons();
    let complete = reasons.is_empty();
    let summary = Summary {
        complete,
        status: if complete {
            STATUS_COMPLETE
        } else {
            STATUS_INCOMPLETE
        },
        incomplete_reason: (!complete).then(|| reasons.join("; ")),
        unfinished_files: verdict.unfinished.clone(),
        outcome: report.outcome.describe(),
        clean: report.outcome.is_clean(),
        kernel,
        initrd: initrd.as_deref(),
        cmdline,
        mem_mib: args.mem,
        entry: format!("{entry:#x}"),
        tool: args.tool.as_deref(),
        wall_seconds: report.wall.as_secs_f64(),
        console_bytes: report.console_bytes,
        exits_total: report.exits.total,
        exits_io_in: report.exits.io_in,
        exits_io_out: report.exits.io_out,
        exits_io_absent: report.exits.io_absent,
        unpopulated_ports: hex_keys(&report.exits.unpopulated_ports),
        unbacked_mmio_total: report.exits.unbacked_mmio_total,
        unbacked_mmio_pages: hex_keys(&report.exits.unbacked_mmio),
        exits_interrupted: report.exits.interrupted,
        ring_doorbells: report.exits.doorbells,
        ring_records: ring.records,
        files_written: ring.files_opened,
        files_refused: ring.files_refused,
        writes_dropped: ring.writes_dropped,
        output_bytes_dropped: ring.bytes_dropped,
        engine_log_lines: ring.log_lines,
        engine_log_lines_dropped: ring.log_lines_dropped,
        engine_counters,
        bbcount,
    };
    let written = write_run_json(out, &summary);
    progress(&format!(
        "{} after {:.2} s ({} exits: {} port in, {} port out, {} absent-device); output in {}",
        report.outcome.describe(),
        report.wall.as_secs_f64(),
        report.exits.total,
        report.exits.io_in,
        report.exits.io_out,
        report.exits.io_absent,
        out.display()
    ));
    if let Some(status) = verdict.tell(out, &written) {
        return Ok(status);
    }
    Ok(match report.outcome {
        Outcome::Poweroff => EXIT_CLEAN,
        Outcome::Timeout => EXIT_TIMEOUT,
        _ => EXIT_GUEST_CRASH,
    })
}

/// The run's control socket (`<out>/control.sock`, for `kpin attach|detach|status`); a
/// native run builds the engine image now so it can be attached later (if that fails the
/// run goes on, unattachable).
fn attach_control(
    out: &Path,
    image_dir: &Path,
    tool: Option<&str>,
    engine: Option<&vmm::EngineConfig>,
) -> ControlConfig {
    let engine_image = match engine {
        Some(e) => Some(e.image.clone()),
        None => kpin_images::ensure_engine(image_dir, &mut progress)
            .map_err(|e| progress(&format!("kpin attach will not work: {e:#}")))
            .ok(),
    };
    let socket = out.join(control::SOCKET_NAME);
    progress(&format!("control socket: {}", socket.display()));
    ControlConfig {
        socket,
        out_dir: out.to_owned(),
        engine_image,
        boot_tool: tool.map(str::to_owned),
        boot_resident: false,
    }
}

/// Lines of `engine.log` an engine failure's dump ends with: the engine's report (what
/// stopped it, the guest's virtual state, the recent traces) comes last in the log.
const ENGINE_LOG_TAIL_LINES: usize = 80;
/// Bytes of `engine.log` read for its tail (80 lines of at most 1 KiB).
const ENGINE_LOG_TAIL_BYTES: u64 = 96 << 10;
/// Largest `counters.json` kpin reads back.
const MAX_COUNTERS_BYTES: u64 = 16 << 20;
/// The tool whose results `bbcount-report.txt` summarises.
const BBCOUNT: &str = "bbcount";

/// Appends the tail of the engine's log to a dump (the VMM's own dump shows the engine's
/// vCPU; the engine's report says where the guest was).
fn append_engine_log_tail(dump: &mut String, log: &Path) {
    use std::fmt::Write;
    let Ok(bytes) = host_daemon::resolve::read_output_tail(log, ENGINE_LOG_TAIL_BYTES) else {
        let _ = writeln!(dump, "\n(no engine log at {})", log.display());
        return;
    };
    // The daemon wrote the log without control characters; the tail may start mid-line.
    let text = String::from_utf8_lossy(&bytes);
    let mut lines: Vec<&str> = text.lines().collect();
    if bytes.len() as u64 == ENGINE_LOG_TAIL_BYTES && lines.len() > 1 {
        lines.remove(0);
    }
    let tail = &lines[lines.len().saturating_sub(ENGINE_LOG_TAIL_LINES)..];
    let _ = writeln!(
        dump,
        "\n--- the engine's report: last {} lines of {} ---",
        tail.len(),
        log.display()
    );
    for l in tail {
        let _ = writeln!(dump, "{l}");
    }
}

/// The engine's counters, if it wrote them; a file that does not parse is reported and
/// left out (it came from inside the guest).
fn read_engine_counters(out: &Path) -> Option<serde_json::Value> {
    let path = out.join(output::ENGINE_COUNTERS);
    std::fs::symlink_metadata(&path).ok()?;
    let text = match host_daemon::resolve::read_output_text(&path, MAX_COUNTERS_BYTES) {
        Ok(t) => t,
        Err(e) => {
            progress(&format!("ignoring {}: {e}", path.display()));
            return None;
        }
    };
    match serde_json::from_str(&text) {
        Ok(v) => Some(v),
        Err(e) => {
            progress(&format!("ignoring {}: not JSON ({e})", path.display()));
            None
        }
    }
}

/// Writes and prints the bbcount report if the run left a `bbcount.csv`; a report that
/// cannot be made is said and left out (the CSV came from inside the guest), and one that
/// cannot be written because of the host's storage is the run's output `failure`.
fn bbcount_report(
    out: &Path,
    kernel: &Path,
    system_map: Option<&Path>,
    top: usize,
    failure: &mut Option<OutputFailure>,
) -> Option<BbcountSummary> {
    if !out.join(kpin_tool_bbcount::CSV_NAME).exists() {
        return None;
    }
    let made = KernelSymbols::load(kernel, system_map).and_then(|mut symbols| {
        // Where the kernel's blocks ran tells a KASLR slide (a bzImage boot).
        if let (Some(s), Ok(Some(rows))) = (symbols.as_mut(), report::read_rows(out)) {
            s.find_slide(rows.iter().filter(|r| r.cpl == 0).map(|r| r.address));
        }
        let names = symbols.as_ref().map(|s| s as &dyn BlockNames);
        report::write_report(out, names, top)
    });
    match made {
        Ok(Some((summary, path))) => {
            progress(&format!("{}:\n{}", path.display(), summary.render()));
            Some(summary)
        }
        Ok(None) => None,
        Err(e) => {
            progress(&format!("no bbcount report: {e:#}"));
            let io = e.chain().find_map(|c| c.downcast_ref::<std::io::Error>());
            if let Some(io) = io.filter(|io| host_daemon::resolve::is_host_fault(io)) {
                let path = out.join(report::REPORT_NAME);
                failure.get_or_insert_with(|| OutputFailure::new(&path, io));
            }
            None
        }
    }
}

/// Writes and prints cachesim's reports, its top-N instructions named from the kernel's
/// symbols (with the KASLR slide found from the kernel instructions that missed); a
/// report that cannot be made is said (the files came from inside the guest).
fn cachesim_report(out: &Path, kernel: &Path, system_map: Option<&Path>) {
    use kpin_tool_cachesim::report as cs;
    let symbols = match KernelSymbols::load(kernel, system_map) {
        Ok(s) => s,
        Err(e) => {
            progress(&format!("cachesim's instructions left unnamed: {e:#}"));
            None
        }
    };
    let symbols = symbols.map(|mut s| {
        if let Ok(Some(insns)) = cs::read_insns(out) {
            s.find_slide(insns.rows.iter().filter(|r| r.cpl == 0).map(|r| r.va));
        }
        s
    });
    let names = symbols.as_ref().map(|s| s as &dyn BlockNames);
    match cs::write_reports_named(out, names) {
        Ok(Some((r, files))) => progress(&format!("{}\ncachesim: {files:?}", r.text())),
        Ok(None) => {}
        Err(e) => progress(&format!("no cachesim report: {e}")),
    }
}

fn default_run_dir() -> PathBuf {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    PathBuf::from("kpin-out").join(format!("run-{secs}-{}", std::process::id()))
}
