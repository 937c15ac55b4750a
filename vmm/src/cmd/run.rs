//! `kpin run`: boot a guest and run it to poweroff, crash or timeout, in named steps —
//! check the inputs ([`check_command_line`], [`choose_guest`], [`engine_config`]),
//! prepare the output directory ([`prepare_out_dir`], [`hold_reserve`]), record the
//! start and boot ([`boot_and_run`]), collect what the run left ([`finish_output`],
//! [`write_dump`]), post-process it ([`post_process`]), write the final record and say
//! the exit status ([`record_the_end`]).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};
use host_daemon::resolve::SpaceReserve;
use host_daemon::{DaemonStats, OutputFailure};
use kpin_abi::output;
use vmm::devices::virtio::disk::DiskConfig;
use vmm::diag::kernel_types::Pending;
use vmm::guests::{
    DEBIAN_CMDLINE, LINUX_612_CMDLINE, LINUX_CMDLINE, MINIKERNEL_NATIVE_CMDLINE,
    USER_KERNEL_CMDLINE,
};
use vmm::input_check::{self, UsageError};
use vmm::layout::{MAX_MEM_MIB, MIN_MEM_MIB};
use vmm::vstate::vm::StopRequest;
use vmm::{control, ControlConfig, Outcome, RunReport, Vm, VmConfig};

use super::reports::{
    append_engine_log_tail, read_engine_counters, tool_reports, GuestSources, ToolEntries,
};
use crate::cli::{Guest, RunArgs};
use crate::run_record::{
    console_shortfall, unix_seconds, write_run_json, RunStarted, Verdict, OUTPUT_RESERVE_BYTES,
    STATUS_COMPLETE, STATUS_INCOMPLETE, STATUS_RUNNING,
};
use crate::summary::{GuestRecord, Summary};
use crate::{progress, stop_signals, EXIT_CLEAN, EXIT_GUEST_CRASH, EXIT_TIMEOUT};

/// `kpin run`: the exit status, or the error `main` reports (status 2 for a
/// [`UsageError`], 1 otherwise).
pub(crate) fn run(args: RunArgs) -> anyhow::Result<u8> {
    // The command line first (exit status 2), before any image is built or file read.
    check_command_line(&args)?;
    let image_dir = args
        .images
        .clone()
        .unwrap_or_else(kpin_images::default_out_dir);
    let guest = choose_guest(&args, &image_dir)?;
    let engine = engine_config(&args, &image_dir, &guest.kernel)?;
    let out = prepare_out_dir(&args)?;
    // From here on SIGINT and SIGTERM stop the guest and keep its files so far.
    let stop = StopRequest::new();
    stop_signals::install(&stop).context("cannot install the SIGINT and SIGTERM handlers")?;
    let mut reserve = hold_reserve(&out)?;
    let disks = guest_disks(&args, guest.root_disk.as_deref(), &out)?;
    let run = Prepared {
        out,
        image_dir,
        kernel: guest.kernel,
        initrd: guest.initrd,
        system_map: guest.system_map,
        cmdline: guest.cmdline,
        disks,
    };
    let disks = run.disks.clone();
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
        disks: &disks,
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

/// The options that do not fit together or are out of range: usage errors (exit status
/// 2), except a memory size outside the VMM's range (1, as the VMM says it).
fn check_command_line(args: &RunArgs) -> anyhow::Result<()> {
    if let Some(tool) = &args.tool {
        if args.tool_crate.is_some() && kpin_tool_registry::find(tool).is_none() {
            // The out-of-tree crate's tool: it checks its own options in the engine.
            input_check::option_keys(&args.tool_option)?;
        } else {
            input_check::check_tool(tool, &args.tool_option)?;
        }
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
    let guest_disks = usize::from(matches!(args.guest, Some(Guest::Debian | Guest::Debian612)));
    if args.disk.len() + guest_disks > vmm::devices::virtio::MAX_DISKS {
        return Err(UsageError(format!(
            "--disk given {} times: at most {} disks ({guest_disks} taken by --guest)",
            args.disk.len(),
            vmm::devices::virtio::MAX_DISKS
        ))
        .into());
    }
    for d in &args.disk {
        DiskConfig::parse(d).map_err(UsageError)?;
    }
    if args.max_open_files == 0 {
        return Err(UsageError("--max-open-files must be at least 1".into()).into());
    }
    Ok(())
}

/// The guest to boot: its files and its command line.
struct GuestFiles {
    kernel: PathBuf,
    initrd: Option<PathBuf>,
    system_map: Option<PathBuf>,
    cmdline: String,
    /// The built-in guest's root disk image (`--guest debian`): a run boots a copy.
    root_disk: Option<PathBuf>,
}

/// `--kernel`'s files, or a built-in guest's (built into `image_dir` if missing), checked
/// (exit status 1: regular files whose headers hold, that fit), with the command line
/// (`--cmdline` or the guest's default, then `--append`).
fn choose_guest(args: &RunArgs, image_dir: &Path) -> anyhow::Result<GuestFiles> {
    let mut root_disk = None;
    let (kernel, initrd, system_map, default_cmdline) = match (&args.kernel, args.guest) {
        (Some(k), _) => (
            k.clone(),
            args.initrd.clone(),
            args.system_map.clone(),
            USER_KERNEL_CMDLINE.to_string(),
        ),
        (None, Some(Guest::Minikernel)) => (
            kpin_images::ensure_minikernel(image_dir, &mut progress)?,
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
            let l = linux_guest(kpin_images::GuestKernel::Debian612, args, image_dir)?;
            let cmdline = LINUX_612_CMDLINE.to_string();
            (l.vmlinux, Some(l.initramfs), Some(l.system_map), cmdline)
        }
        (None, Some(guest @ (Guest::Debian | Guest::Debian612))) => {
            let kernel = if matches!(guest, Guest::Debian) {
                kpin_images::GuestKernel::Debian61
            } else {
                kpin_images::GuestKernel::Debian612
            };
            let d = kpin_images::ensure_debian(kernel, image_dir, &mut progress)?;
            root_disk = Some(d.disk);
            let cmdline = DEBIAN_CMDLINE.to_string();
            (
                d.linux.vmlinux,
                Some(d.initrd),
                Some(d.linux.system_map),
                cmdline,
            )
        }
        (None, Some(Guest::Linux) | None) => {
            let l = linux_guest(kpin_images::GuestKernel::Debian61, args, image_dir)?;
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
    // The disks (exit status 1): usable raw images, opened now to say what is wrong.
    for d in disk_configs(args) {
        vmm::devices::virtio::disk::open(&d).map_err(anyhow::Error::msg)?;
    }
    let mut cmdline = args.cmdline.clone().unwrap_or(default_cmdline);
    if let Some(extra) = &args.append {
        if !cmdline.is_empty() {
            cmdline.push(' ');
        }
        cmdline.push_str(extra);
    }
    Ok(GuestFiles {
        kernel,
        initrd,
        system_map,
        cmdline,
        root_disk,
    })
}

/// A pinned kernel's busybox guest; with a disk, the initramfs that carries the kernel's
/// virtio modules.
fn linux_guest(
    kernel: kpin_images::GuestKernel,
    args: &RunArgs,
    image_dir: &Path,
) -> anyhow::Result<kpin_images::LinuxImages> {
    Ok(if args.disk.is_empty() {
        kpin_images::ensure_linux_kernel(kernel, image_dir, &mut progress)?
    } else {
        kpin_images::ensure_linux_virtio(kernel, image_dir, &mut progress)?
    })
}

/// The run's disks in the guest's order: the built-in guest's root disk first (copied into
/// the output directory, so that the run cannot change the cached image: a reflink or a
/// sparse copy, a second or two), then the `--disk`s.
fn guest_disks(
    args: &RunArgs,
    root_disk: Option<&Path>,
    out: &Path,
) -> anyhow::Result<Vec<DiskConfig>> {
    let mut disks = Vec::new();
    if let Some(image) = root_disk {
        let copy = out.join(output::GUEST_DISK_COPY);
        progress(&format!(
            "copying {} to {} (the run writes to it)",
            image.display(),
            copy.display()
        ));
        kpin_images::copy_disk(image, &copy)?;
        disks.push(DiskConfig {
            path: copy,
            read_only: false,
        });
    }
    disks.extend(disk_configs(args));
    Ok(disks)
}

/// The `--disk`s, parsed (checked by [`check_command_line`]).
fn disk_configs(args: &RunArgs) -> Vec<DiskConfig> {
    args.disk
        .iter()
        .filter_map(|d| DiskConfig::parse(d).ok())
        .collect()
}

/// The engine to start the guest under (`--tool`, or tool null for `--resident`), its
/// image built if missing and its options parsed, and `kernel`'s types being found; `None`
/// for a native run.
fn engine_config(
    args: &RunArgs,
    image_dir: &Path,
    kernel: &Path,
) -> anyhow::Result<Option<vmm::EngineConfig>> {
    let engine_tool = args.tool.clone().or_else(|| {
        args.resident
            .then(|| kpin_tool_registry::RESIDENT.name.to_owned())
    });
    Ok(match engine_tool {
        Some(tool) => Some(vmm::EngineConfig {
            // First: found while the engine image and the VM are built (~0.1 s for a
            // distribution kernel's BTF); the engine's entry waits for them.
            kernel_types: {
                let (kernel, cache) = (kernel.to_owned(), image_dir.join(KERNEL_TYPES_CACHE));
                Pending::start(move || kernel_types(&kernel, &cache))
            },
            image: match &args.tool_crate {
                Some(dir) => kpin_images::ensure_engine_with_tool(image_dir, dir, &mut progress)?,
                None => kpin_images::ensure_engine(image_dir, &mut progress)?,
            },
            tool: tool.clone(),
            options: input_check::engine_options(&tool, &args.tool_option)?,
            host_sim: !args.sim_in_engine,
        }),
        None => None,
    })
}

/// Where `kpin run` remembers each kernel's types, in its image directory.
const KERNEL_TYPES_CACHE: &str = ".kernel-types";

/// Where `kernel` keeps its running task, from its BTF (or what `cache` remembers of the
/// same file), for the engine's process table (`docs/processes.md`); a kernel without
/// usable BTF gets one warning line, and the engine then reports by address space (CR3).
fn kernel_types(kernel: &Path, cache: &Path) -> kpin_abi::attach::KernelTypes {
    match vmm::diag::kernel_types::from_kernel_cached(kernel, cache) {
        Ok((types, source)) => {
            progress(&format!("processes: the running task from the {source}"));
            if types.knows_exe() && !types.knows_vmas() {
                // The note above says why; user code stays unnamed.
                progress(
                    "warning: user code is not attributed to files: the kernel's BTF does not locate its VMAs",
                );
            }
            types
        }
        Err(why) => {
            progress(&format!(
                "warning: processes are reported by address space (CR3), not by name: {why}"
            ));
            kpin_abi::attach::KernelTypes::UNKNOWN
        }
    }
}

/// Creates the output directory (`--out`, or `kpin-out/run-<time>-<pid>`) and refuses
/// one where a name kpin writes is a symbolic link.
fn prepare_out_dir(args: &RunArgs) -> anyhow::Result<PathBuf> {
    let out = args.out.clone().unwrap_or_else(default_run_dir);
    std::fs::create_dir_all(&out)
        .with_context(|| format!("cannot create output directory {}", out.display()))?;
    // kpin's own files (and the tools' host-side reports) are never written through a
    // link left in the directory.
    let reports = kpin_tool_registry::host::HOST_TOOLS
        .iter()
        .flat_map(|h| h.report_files());
    for name in host_daemon::RESERVED_NAMES.iter().chain(reports) {
        let p = out.join(name);
        if std::fs::symlink_metadata(&p).is_ok_and(|m| m.file_type().is_symlink()) {
            bail!(
                "{} is a symbolic link; kpin does not write through links: remove it or choose another --out",
                p.display()
            );
        }
    }
    Ok(out)
}

/// Holds [`OUTPUT_RESERVE_BYTES`] on the output file system for kpin's own last files.
fn hold_reserve(out: &Path) -> anyhow::Result<Option<SpaceReserve>> {
    SpaceReserve::hold(out, OUTPUT_RESERVE_BYTES).map_err(|e| {
        if matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)) {
            anyhow::anyhow!(
                "the file system of {} lacks {} KiB for kpin's own last files (run.json, dump.txt): {e}: free some space or choose another --out",
                out.display(),
                OUTPUT_RESERVE_BYTES >> 10
            )
        } else {
            anyhow::anyhow!("cannot write to output directory {}: {e}", out.display())
        }
    })
}

fn default_run_dir() -> PathBuf {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    PathBuf::from("kpin-out").join(format!("run-{secs}-{}", std::process::id()))
}

/// What `run` settled before the guest is created.
struct Prepared {
    out: PathBuf,
    image_dir: PathBuf,
    kernel: PathBuf,
    initrd: Option<PathBuf>,
    system_map: Option<PathBuf>,
    cmdline: String,
    /// Every disk, the guest's own first.
    disks: Vec<DiskConfig>,
}

/// Boots and runs the guest, then writes its results; the exit status.
fn run_guest(
    args: &RunArgs,
    run: &Prepared,
    engine: Option<vmm::EngineConfig>,
    stop: StopRequest,
    reserve: &mut Option<SpaceReserve>,
) -> anyhow::Result<u8> {
    let out = &run.out;
    let Ran {
        report,
        daemon,
        console_file,
        entry,
    } = boot_and_run(args, run, engine, stop)?;
    let Output {
        unfinished,
        mut failure,
        ring,
        console_short,
    } = finish_output(daemon, &console_file, report.console_bytes, reserve);
    let interrupted = match report.outcome {
        Outcome::Interrupted { signal } => Some(signal),
        _ => None,
    };
    write_dump(out, &report, interrupted.is_some(), &mut failure);
    // The reports read what the tool wrote: not after a stop, nor from unfinished files.
    let reports = interrupted.is_none() && failure.is_none();
    let (engine_counters, tools) = post_process(args, run, reports, &unfinished, &mut failure);
    let processes = super::processes::read(
        out,
        reports && !unfinished.contains(&out.join(output::ENGINE_PROCESSES)),
    );
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
        guest: GuestRecord {
            kernel: &run.kernel,
            initrd: run.initrd.as_deref(),
            cmdline: &run.cmdline,
            mem_mib: args.mem,
        },
        entry: format!("{entry:#x}"),
        tool: args.tool.as_deref(),
        wall_seconds: report.wall.as_secs_f64(),
        console_bytes: report.console_bytes,
        exits: report.exits.clone(),
        devices: report.devices.clone(),
        ring,
        engine_counters,
        processes,
        tools,
    };
    Ok(record_the_end(out, &report, &verdict, &summary))
}

/// The guest's run, as it ended.
struct Ran {
    report: RunReport,
    daemon: host_daemon::Daemon,
    /// Where the guest's console went (`--console` or `<out>/console.log`).
    console_file: PathBuf,
    /// The guest's entry point.
    entry: u64,
}

/// Creates the VM, its host daemon and its control socket, and runs the guest to its end.
fn boot_and_run(
    args: &RunArgs,
    run: &Prepared,
    engine: Option<vmm::EngineConfig>,
    stop: StopRequest,
) -> anyhow::Result<Ran> {
    let Prepared {
        out,
        image_dir,
        kernel,
        initrd,
        system_map,
        cmdline,
        disks,
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
        disks: disks.clone(),
        rng: args.rng || !disks.is_empty(),
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
    for host in kpin_tool_registry::host::HOST_TOOLS {
        daemon.reserve(host.report_files());
    }
    let mut control = attach_control(out, image_dir, args.tool.as_deref(), cfg.engine.as_ref());
    control.boot_resident = args.resident;
    control.kernel = Some(cfg.kernel.clone());
    let report = vm.run_with_control(&mut daemon, Some(control))?;
    Ok(Ran {
        report,
        daemon,
        console_file,
        entry,
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
        kernel: None,
    }
}

/// What the run left in the output directory.
struct Output {
    /// The tool files the engine had not finished.
    unfinished: Vec<PathBuf>,
    /// The first file that could not be written.
    failure: Option<OutputFailure>,
    /// What the daemon did.
    ring: DaemonStats,
    /// Console bytes that did not reach the console file.
    console_short: Option<String>,
}

/// Finishes the daemon's files and notes what the run left unfinished and the first file
/// that could not be written; then gives back the space kept for kpin's own last files.
fn finish_output(
    daemon: host_daemon::Daemon,
    console_file: &Path,
    console_bytes: u64,
    reserve: &mut Option<SpaceReserve>,
) -> Output {
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
    let console_short = console_shortfall(console_file, console_bytes);
    // kpin's own last files get the space kept for them.
    if let Some(r) = reserve.as_mut() {
        r.release();
    }
    Output {
        unfinished,
        failure,
        ring,
        console_short,
    }
}

/// Writes the guest-state dump, if the run has one, to `dump.txt` (an engine failure's
/// with the engine log's tail) and shows it on stderr (after a stop, only where it is).
fn write_dump(
    out: &Path,
    report: &RunReport,
    interrupted: bool,
    failure: &mut Option<OutputFailure>,
) {
    let mut dump = report.dump.clone();
    if let (Outcome::EngineFailure, Some(d)) = (&report.outcome, &mut dump) {
        append_engine_log_tail(d, &out.join(output::ENGINE_LOG));
    }
    if let Some(dump) = &dump {
        let path = out.join(output::DUMP_TXT);
        if interrupted {
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
}

/// The engine's counters and the tools' reports, from the files the run finished (none
/// unless `reports`: not after a stop or a failed write).
fn post_process(
    args: &RunArgs,
    run: &Prepared,
    reports: bool,
    unfinished: &[PathBuf],
    failure: &mut Option<OutputFailure>,
) -> (Option<serde_json::Value>, ToolEntries) {
    let out = &run.out;
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
    let tools = if reports {
        let guest = GuestSources {
            kernel: &run.kernel,
            system_map: run.system_map.as_deref(),
            initrd: run.initrd.as_deref(),
            disks: run.disks.iter().map(|d| d.path.clone()).collect(),
        };
        let tool = args.tool.as_deref();
        tool_reports(tool, args.top, out, unfinished, &guest, failure)
    } else {
        ToolEntries::none()
    };
    (engine_counters, tools)
}

/// Writes the final `run.json`, says how the run ended, and gives the exit status: the
/// verdict's (5, or 128 + the signal) when the output is not whole, else the outcome's.
fn record_the_end(out: &Path, report: &RunReport, verdict: &Verdict, summary: &Summary) -> u8 {
    let written = write_run_json(out, summary);
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
        return status;
    }
    match report.outcome {
        Outcome::Poweroff => EXIT_CLEAN,
        Outcome::Timeout => EXIT_TIMEOUT,
        _ => EXIT_GUEST_CRASH,
    }
}
