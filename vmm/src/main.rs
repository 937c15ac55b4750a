//! `kpin`: run a guest under kpin's VMM, natively or under the guest engine (`--tool`).

use kpin_abi::output;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Parser, Subcommand, ValueEnum};
use host_daemon::resolve::SpaceReserve;
use host_daemon::OutputFailure;
use kpin_tool_bbcount::report::{self, BbcountSummary, BlockNames, DEFAULT_TOP};
use vmm::diag::kernel_symbols::KernelSymbols;
use vmm::guests::{
    LINUX_612_CMDLINE, LINUX_CMDLINE, MINIKERNEL_NATIVE_CMDLINE, USER_KERNEL_CMDLINE,
};
use vmm::input_check::{self, UsageError};
use vmm::layout::{MAX_MEM_MIB, MIN_MEM_MIB};
use vmm::vstate::vm::StopRequest;
use vmm::{control, ControlConfig, Outcome, Vm, VmConfig};

mod run_record;
mod stop_signals;
mod tools_cmd;

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

#[derive(Parser)]
#[command(
    name = "kpin",
    version,
    about = "Whole-system dynamic binary instrumentation for x86-64 Linux guests on KVM",
    long_about = "Whole-system dynamic binary instrumentation for x86-64 Linux guests on KVM.\n\n\
        kpin boots guests natively under its own VMM. With --tool the vCPU starts in the guest \
        engine instead, which runs all guest code, kernel and user, from its code cache under \
        the tool (null, bbcount, cachesim, memtrace or insmix; see `kpin run --help`) and \
        logs to engine.log; guests that need what the engine \
        does not emulate yet stop with exit status 3 and the engine naming it.\n\n\
        Exit status of `kpin run`: 0 the guest powered off cleanly; 1 kpin failed (bad input, \
        no /dev/kvm, images could not be built); 2 bad command line; 3 the guest crashed \
        (triple fault, KVM emulation failure, MMIO above 4 GiB, kernel panic, engine failure); \
        4 the timeout \
        expired; 5 the output directory could not be written (file system full or read-only): \
        the results are incomplete; 130 / 143 kpin was stopped by SIGINT / SIGTERM. \
        On 3 and 4 a guest-state dump goes to stderr and the output directory."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Fetch and build the guest images (Debian kernel, busybox initramfs, mini-kernel)
    /// and the engine image into the image directory; cached, so a second run is fast.
    Images {
        /// Image directory [default: images/out in the source tree].
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Also fetch Debian's generic (non-cloud) 6.12 kernel, for the side-by-side
        /// benchmark only (about 110 MB to download).
        #[arg(long)]
        generic_612: bool,
    },
    /// Boot a guest and run it to poweroff, crash or timeout.
    #[command(after_help = RUN_AFTER_HELP)]
    Run(Box<RunArgs>),
    /// Attach a tool to a running guest (RUN: the run's output directory): the engine
    /// takes over at the next safe point; the window's files go to RUN/attach-<n>/.
    /// Exit status 1: no such run; 2: the run refused (already attached, unknown tool).
    Attach {
        /// The run's output directory (it holds control.sock while the run lives).
        run: PathBuf,
        /// Tool: null, bbcount, cachesim, memtrace or insmix (as for `kpin run --tool`).
        #[arg(long)]
        tool: String,
        /// A tool option KEY=VALUE (repeatable).
        #[arg(long, value_name = "KEY=VALUE")]
        tool_option: Vec<String>,
    },
    /// Detach the tool from a running guest at the engine's next safe point: the tool's
    /// files are finished in RUN/attach-<n>/, and the guest goes back to native execution
    /// (a window opened on a natively running guest) or stays under the engine with no
    /// instrumentation (a run started with --tool or --resident). Exit status 1: no such
    /// run; 2: refused (not attached, another request in progress).
    Detach {
        /// The run's output directory.
        run: PathBuf,
    },
    /// Print a running guest's state as JSON: state (native, attached, resident), tool,
    /// guest instructions under the engine so far, progress (advancing, idle, or stalled:
    /// no guest instruction while exits climb, with the numbers), windows, uptime.
    Status {
        /// The run's output directory.
        run: PathBuf,
    },
    /// Print a `--tool memtrace` run's memtrace.bin as CSV in the column order of QEMU's
    /// mem plugin: insn_vaddr,insn_symbol,mem_vaddr,mem_paddr,access_size,access_type.
    Trace {
        /// The run's output directory.
        run: PathBuf,
        /// Print at most this many records.
        #[arg(long, value_name = "N")]
        limit: Option<u64>,
        /// The run's kernel, to name instruction addresses (its ELF symbols, or
        /// --system-map's); without it insn_symbol is empty.
        #[arg(long)]
        kernel: Option<PathBuf>,
        /// System.map for --kernel.
        #[arg(long, requires = "kernel")]
        system_map: Option<PathBuf>,
    },
    /// List the tools `--tool` selects: what each does, its host-side part and its
    /// `--tool-option` keys with their help and defaults.
    Tools,
}

/// The end of `kpin run --help`: exit statuses and what `run.json` says.
const RUN_AFTER_HELP: &str = "\
Exit status: 0 the guest powered off cleanly; 1 kpin failed (bad input, no /dev/kvm, \
images could not be built, the output directory cannot be written at the start); 2 bad \
command line; 3 the guest crashed (or the engine inside its VM failed); 4 the timeout \
expired; 5 the output directory could not be written during the run (file system full or \
read-only): the guest was stopped, the results are incomplete; 130 SIGINT, 143 SIGTERM \
(128 + the signal): the guest was stopped, its files so far kept; a second SIGINT ends \
kpin at once.

run.json is written when the run starts with \"complete\": false, \"status\": \"running\" \
(still there if kpin is killed), and rewritten whole at the end: \"complete\": true, or \
\"status\": \"incomplete\" with \"incomplete_reason\" (\"interrupted by SIGTERM\", \
\"output file system full: <file>\", ...) and \"unfinished_files\", the tool files the \
engine had not finished.";

#[derive(Clone, Copy, ValueEnum)]
enum Guest {
    /// The pinned Debian cloud kernel with the busybox initramfs (built by `kpin images`).
    Linux,
    /// The second pinned kernel, Debian's 6.12 cloud kernel (vmlinux), with the same
    /// initramfs and the distribution's command line (`console=ttyS0 panic=-1`).
    #[value(name = "linux-6.12")]
    Linux612,
    /// The mini-kernel test guest (built by `kpin images`). Run natively, its default
    /// command line skips the steps this KVM cannot run natively (`kpin.skip=native-unsafe`);
    /// with --tool it runs every step.
    Minikernel,
}

#[derive(clap::Args)]
struct RunArgs {
    /// Which built-in guest to boot [default: linux unless --kernel is given].
    #[arg(long, conflicts_with = "kernel")]
    guest: Option<Guest>,
    /// Boot this kernel instead (ELF64 vmlinux or bzImage).
    #[arg(long)]
    kernel: Option<PathBuf>,
    /// Initrd for --kernel.
    #[arg(long, requires = "kernel")]
    initrd: Option<PathBuf>,
    /// System.map for --kernel, to name code addresses in the guest-state dump and the
    /// bbcount report (without it, an ELF kernel's own symbols name them in the report).
    #[arg(long, requires = "kernel")]
    system_map: Option<PathBuf>,
    /// Replace the guest's default kernel command line (with --kernel the default is
    /// "console=ttyS0", so the kernel's messages reach the console).
    #[arg(long)]
    cmdline: Option<String>,
    /// Append to the kernel command line (e.g. "kpin.workload=smoke").
    #[arg(long)]
    append: Option<String>,
    /// Guest RAM in MiB.
    #[arg(long, default_value_t = 256)]
    mem: u64,
    /// Stop the guest after this many seconds (exit status 4). 0 means no timeout.
    #[arg(long, default_value_t = 600)]
    timeout: u64,
    /// Also copy the guest console to this file.
    #[arg(long)]
    console: Option<PathBuf>,
    /// Output directory for the run's console log and summary [default: kpin-out/run-<time>-<pid>].
    #[arg(long)]
    out: Option<PathBuf>,
    /// Run the guest fully instrumented from its first instruction: the engine runs every
    /// guest instruction from its code cache under this tool: null (translation only);
    /// bbcount (per-block counts in <out>/bbcount.csv, and <out>/bbcount-report.txt: the
    /// user/kernel split and the hottest blocks named from the System.map or the kernel
    /// ELF's symbols, moved by the KASLR slide the blocks show); cachesim (a drcachesim-style L1I/L1D/[L2]/LL cache simulation over
    /// guest-physical addresses, kernel and user: cachesim.txt, cachesim.json,
    /// cachesim-timeline.svg; options L1I_size, L1I_assoc, L1D_size, L1D_assoc, L2_size,
    /// L2_assoc, LL_size, LL_assoc, line_size, replace_policy=LRU|FIFO|RANDOM,
    /// warmup_refs, sim_refs through --tool-option, or config_file=PATH in drcachesim's
    /// configuration-file format for deeper hierarchies); insmix (dynamic and static counts per mnemonic,
    /// kernel/user: insmix.txt, insmix.json); memtrace (every data access with instruction
    /// VA, data VA and PA, size, load/store and CPL in <out>/memtrace.bin, counts in
    /// memtrace-summary.txt; options cpl=0|3|all, limit=N records; `kpin trace` prints it
    /// as CSV). It logs to <out>/engine.log and writes <out>/counters.json; an
    /// instruction or device it cannot handle yet ends the run with status 3 and the
    /// guest's state in dump.txt.
    #[arg(long)]
    tool: Option<String>,
    /// Start the guest under the engine with no instrumentation (tool null, no window
    /// open): `kpin attach` then switches tools at a trace boundary with a clean code
    /// cache, and `kpin detach` returns to no instrumentation instead of native execution.
    /// This is how to instrument Linux in windows on a host whose KVM emulates guest ring 0
    /// (a Linux booted natively cannot be attached to there). A run without --tool or
    /// --resident runs natively and detaches back to native.
    #[arg(long, conflicts_with = "tool")]
    resident: bool,
    /// cachesim: simulate inside the engine, on the guest's core, instead of on a host
    /// thread fed through the record ring (the default; it uses a second core). For
    /// comparing the two: the counters are the same, but the engine's per-instruction
    /// table is smaller, so more misses may end up unranked in the report.
    #[arg(long)]
    sim_in_engine: bool,
    /// A tool option KEY=VALUE for --tool (repeatable), e.g. bringup.crash=pf to make the
    /// engine fault on purpose. A key neither the engine nor the tool knows is refused
    /// (exit status 2) with the list of known keys.
    #[arg(long, requires = "tool", value_name = "KEY=VALUE")]
    tool_option: Vec<String>,
    /// How many of the hottest blocks bbcount-report.txt lists (--tool bbcount).
    #[arg(long, requires = "tool", value_name = "N", default_value_t = DEFAULT_TOP)]
    top: usize,
    /// Image directory for --guest [default: images/out in the source tree].
    #[arg(long)]
    images: Option<PathBuf>,
    /// Do not echo the guest console to stdout.
    #[arg(long, short)]
    quiet: bool,
    /// Most bytes the engine and the tool may write to the output directory in the run
    /// (tool files and engine.log together); later writes are dropped and counted.
    #[arg(long, value_name = "BYTES", default_value_t = host_daemon::DaemonConfig::DEFAULT_MAX_OUTPUT_BYTES)]
    max_output_bytes: u64,
    /// Most tool files open at once; further opens are refused and logged.
    #[arg(long, value_name = "N", default_value_t = host_daemon::DaemonConfig::DEFAULT_MAX_OPEN_FILES)]
    max_open_files: usize,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Images { dir, generic_612 } => images(dir, generic_612).map(|()| EXIT_CLEAN),
        Command::Run(args) => run(*args),
        Command::Attach {
            run,
            tool,
            tool_option,
        } => match parse_tool_options(&tool_option) {
            Ok(options) => Ok(control::client::command(
                &run,
                &control::protocol::Request::Attach { tool, options },
            )),
            Err(e) => Err(e),
        },
        Command::Detach { run } => Ok(control::client::command(
            &run,
            &control::protocol::Request::Detach,
        )),
        Command::Status { run } => Ok(control::client::command(
            &run,
            &control::protocol::Request::Status,
        )),
        Command::Trace {
            run,
            limit,
            kernel,
            system_map,
        } => trace(&run, limit, kernel.as_deref(), system_map.as_deref()).map(|()| EXIT_CLEAN),
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

/// `--tool-option` KEY=VALUE pairs of `kpin attach`, as the request's map.
fn parse_tool_options(raw: &[String]) -> anyhow::Result<BTreeMap<String, String>> {
    raw.iter()
        .map(|o| match o.split_once('=') {
            Some((k, v)) if !k.is_empty() && !o.contains(' ') => Ok((k.to_owned(), v.to_owned())),
            _ => Err(UsageError(format!(
                "bad --tool-option {o:?}: expected KEY=VALUE without spaces"
            ))
            .into()),
        })
        .collect()
}

fn progress(line: &str) {
    eprintln!("kpin: {line}");
}

/// `kpin trace`: a memtrace run's records as CSV on stdout.
fn trace(
    run: &Path,
    limit: Option<u64>,
    kernel: Option<&Path>,
    system_map: Option<&Path>,
) -> anyhow::Result<()> {
    let mut symbols = match kernel {
        Some(k) => KernelSymbols::load(k, system_map)?,
        None => None,
    };
    let bin = run.join(kpin_tool_memtrace::BIN_NAME);
    let bytes = std::fs::read(&bin).with_context(|| format!("cannot read {}", bin.display()))?;
    // Where the kernel's instructions ran tells a KASLR slide (a bzImage boot).
    if let (Some(s), Ok(t)) = (
        symbols.as_mut(),
        kpin_tool_memtrace::format::Trace::parse(&bytes),
    ) {
        if let Some(found) = s.find_slide(t.records().map(|r| r.insn_vaddr)) {
            if found.slide != 0 {
                eprintln!("kpin: names from {}", s.source);
            }
        }
    }
    let name = |a: u64| symbols.as_ref().and_then(|s| s.describe(a));
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    match kpin_tool_memtrace::reader::write_csv(&bytes, limit, &name, &mut out) {
        Ok(_) => {}
        // `kpin trace … | head` closes the pipe early: not an error.
        Err(kpin_tool_memtrace::reader::ReadError::Io(e))
            if e.kind() == std::io::ErrorKind::BrokenPipe => {}
        Err(e) => bail!("{}: {e}", run.join(kpin_tool_memtrace::BIN_NAME).display()),
    }
    match std::io::Write::flush(&mut out) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}

fn images(dir: Option<PathBuf>, generic_612: bool) -> anyhow::Result<()> {
    let dir = dir.unwrap_or_else(kpin_images::default_out_dir);
    let linux = kpin_images::ensure_linux(&dir, &mut progress)?;
    let mk = kpin_images::ensure_minikernel(&dir, &mut progress)?;
    let engine = kpin_images::ensure_engine(&dir, &mut progress)?;
    println!("kernel (bzImage): {}", linux.bzimage.display());
    println!("kernel (vmlinux): {}", linux.vmlinux.display());
    println!("System.map:       {}", linux.system_map.display());
    println!("config:           {}", linux.config.display());
    println!("initramfs:        {}", linux.initramfs.display());
    println!("mini-kernel:      {}", mk.display());
    println!("engine image:     {}", engine.display());
    if generic_612 {
        let generic = kpin_images::ensure_linux_generic_612(&dir, &mut progress)?;
        println!("generic 6.12:     {}", generic.vmlinux.display());
    }
    Ok(())
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
