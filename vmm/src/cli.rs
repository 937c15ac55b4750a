//! `kpin`'s command line (clap): the subcommands, their options and their help texts.
//! What each command does is in `cmd/`.

use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};
use kpin_tool::host_side::DEFAULT_TOP;

#[derive(Parser)]
#[command(
    name = "kpin",
    version,
    about = "Whole-system dynamic binary instrumentation for x86-64 Linux guests on KVM",
    long_about = "Whole-system dynamic binary instrumentation for x86-64 Linux guests on KVM.\n\n\
        kpin boots guests natively under its own VMM. With --tool the vCPU starts in the guest \
        engine instead, which runs all guest code, kernel and user, from its code cache under \
        the tool (`kpin tools` lists them) and \
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
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Subcommand)]
pub(crate) enum Command {
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
        /// Also build the Debian bookworm guest (`kpin run --guest debian`): a root file
        /// system from Debian's packages made with mmdebstrap, a 2 GiB ext4 disk image,
        /// initrds for both kernels (needs root and Debian's mirror; minutes when cold).
        #[arg(long)]
        debian: bool,
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
        /// The tool (as for `kpin run --tool`; `kpin tools` lists them).
        #[arg(long, long_help = format!("The tool: {} (as for `kpin run --tool`; `kpin tools` lists their options).", crate::tools_cmd::names()))]
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
    /// Write a working skeleton of a tool crate of your own into DIR (a new directory,
    /// anywhere): a per-CPL instruction counter writing NAME.csv, to change as you like and
    /// run with `kpin run --tool-crate DIR --tool NAME` (docs/writing-a-tool.md).
    NewTool {
        /// The directory to create.
        dir: PathBuf,
        /// The tool's name (`--tool NAME`): letters, digits, `-` and `_`.
        #[arg(long)]
        name: String,
    },
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

/// `kpin run --help`'s text for --disk.
const DISK_HELP: &str = "\
Attach a raw image file as a virtio-blk disk over virtio-mmio (repeatable, up to 4: the \
guest's /dev/vda, /dev/vdb, ... in the order given). PATH,ro attaches it read-only: the \
guest sees a read-only disk and every write fails with an I/O error. The file must be a \
regular file, readable (and writable without ,ro), at least 512 bytes; a length that is \
not a multiple of 512 is rounded down, with a note. kpin locks the file for the run. \
Flushes from the guest are fdatasync()s of the file. The devices are declared in the ACPI \
tables (LNRO0005); the guest kernel needs virtio_mmio and virtio_blk, built in or as \
modules (with --guest linux the initramfs carries them and loads them). A virtio-rng is \
added too (--rng).";

#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum Guest {
    /// The pinned Debian cloud kernel with the busybox initramfs (built by `kpin images`).
    Linux,
    /// The second pinned kernel, Debian's 6.12 cloud kernel (vmlinux), with the same
    /// initramfs and the distribution's command line (`console=ttyS0 panic=-1`).
    #[value(name = "linux-6.12")]
    Linux612,
    /// Debian bookworm with systemd on the pinned 6.1 kernel (`kpin images --debian`, built
    /// on demand: root, mmdebstrap, minutes): a copy of its ext4 disk image in the output
    /// directory as /dev/vda, its initrd, `root=/dev/vda rw console=ttyS0 panic=-1`; a
    /// unit runs the workload (python3, gcc, sqlite3, a disk read) and powers off.
    Debian,
    /// The same Debian bookworm system on the second pinned kernel, Debian's 6.12 cloud
    /// kernel (the image holds both kernels' modules and an initrd for each).
    #[value(name = "debian-6.12")]
    Debian612,
    /// The mini-kernel test guest (built by `kpin images`). Run natively, its default
    /// command line skips the steps this KVM cannot run natively (`kpin.skip=native-unsafe`);
    /// with --tool it runs every step.
    Minikernel,
}

#[derive(clap::Args)]
pub(crate) struct RunArgs {
    /// Which built-in guest to boot [default: linux unless --kernel is given].
    #[arg(long, conflicts_with = "kernel")]
    pub(crate) guest: Option<Guest>,
    /// Boot this kernel instead (ELF64 vmlinux or bzImage).
    #[arg(long)]
    pub(crate) kernel: Option<PathBuf>,
    /// Initrd for --kernel.
    #[arg(long, requires = "kernel")]
    pub(crate) initrd: Option<PathBuf>,
    /// System.map for --kernel, to name code addresses in the guest-state dump and the
    /// bbcount report (without it, an ELF kernel's own symbols name them in the report).
    #[arg(long, requires = "kernel")]
    pub(crate) system_map: Option<PathBuf>,
    /// Replace the guest's default kernel command line (with --kernel the default is
    /// "console=ttyS0", so the kernel's messages reach the console).
    #[arg(long)]
    pub(crate) cmdline: Option<String>,
    /// Append to the kernel command line (e.g. "kpin.workload=smoke").
    #[arg(long)]
    pub(crate) append: Option<String>,
    /// Guest RAM in MiB.
    #[arg(long, default_value_t = 256)]
    pub(crate) mem: u64,
    /// Stop the guest after this many seconds (exit status 4). 0 means no timeout.
    #[arg(long, default_value_t = 600)]
    pub(crate) timeout: u64,
    /// Also copy the guest console to this file.
    #[arg(long)]
    pub(crate) console: Option<PathBuf>,
    /// Output directory for the run's console log and summary [default: kpin-out/run-<time>-<pid>].
    #[arg(long)]
    pub(crate) out: Option<PathBuf>,
    /// Run the guest fully instrumented from its first instruction under this tool (`kpin
    /// tools` lists them).
    #[arg(long, long_help = crate::tools_cmd::run_tool_help())]
    pub(crate) tool: Option<String>,
    /// Build an engine image that also holds the out-of-tree tool crate in DIR (it exports
    /// `SPEC` and `new_tool`: docs/writing-a-tool.md) and run under it; --tool names that
    /// crate's tool (or any other). Nothing in the kpin tree changes: the image is built
    /// under the image directory's tool-builds/. The crate checks its own options in the
    /// engine: a bad one ends the run with status 3 and its message in engine.log.
    #[arg(long, value_name = "DIR", requires = "tool")]
    pub(crate) tool_crate: Option<PathBuf>,
    /// Start the guest under the engine with no instrumentation (tool null, no window
    /// open): `kpin attach` then switches tools at a trace boundary with a clean code
    /// cache, and `kpin detach` returns to no instrumentation instead of native execution.
    /// This is how to instrument Linux in windows on a host whose KVM emulates guest ring 0
    /// (a Linux booted natively cannot be attached to there). A run without --tool or
    /// --resident runs natively and detaches back to native.
    #[arg(long, conflicts_with = "tool")]
    pub(crate) resident: bool,
    /// cachesim: simulate inside the engine, on the guest's core, instead of on a host
    /// thread fed through the record ring (the default; it uses a second core). For
    /// comparing the two: the counters are the same, but the engine's per-instruction
    /// table is smaller, so more misses may end up unranked in the report.
    #[arg(long)]
    pub(crate) sim_in_engine: bool,
    /// A tool option KEY=VALUE for --tool (repeatable), e.g. bringup.crash=pf to make the
    /// engine fault on purpose. A key neither the engine nor the tool knows is refused
    /// (exit status 2) with the list of known keys.
    #[arg(long, requires = "tool", value_name = "KEY=VALUE")]
    pub(crate) tool_option: Vec<String>,
    /// How many of the hottest blocks bbcount-report.txt lists (--tool bbcount).
    #[arg(long, requires = "tool", value_name = "N", default_value_t = DEFAULT_TOP)]
    pub(crate) top: usize,
    /// Attach a raw image file as a virtio-blk disk (repeatable, up to 4: the guest's
    /// /dev/vda, /dev/vdb, ...), read-write, or read-only with ",ro". With --guest linux
    /// the initramfs carries the virtio modules (`kpin.workload=virtio` tests the disk).
    #[arg(long, value_name = "PATH[,ro]", long_help = DISK_HELP)]
    pub(crate) disk: Vec<String>,
    /// Give the guest a virtio-rng (its /dev/hwrng, entropy from the host's getrandom).
    /// On whenever a --disk is given; this adds it without one.
    #[arg(long)]
    pub(crate) rng: bool,
    /// Image directory for --guest [default: images/out in the source tree].
    #[arg(long)]
    pub(crate) images: Option<PathBuf>,
    /// Do not echo the guest console to stdout.
    #[arg(long, short)]
    pub(crate) quiet: bool,
    /// Most bytes the engine and the tool may write to the output directory in the run
    /// (tool files and engine.log together); later writes are dropped and counted.
    #[arg(long, value_name = "BYTES", default_value_t = host_daemon::DaemonConfig::DEFAULT_MAX_OUTPUT_BYTES)]
    pub(crate) max_output_bytes: u64,
    /// Most tool files open at once; further opens are refused and logged.
    #[arg(long, value_name = "N", default_value_t = host_daemon::DaemonConfig::DEFAULT_MAX_OPEN_FILES)]
    pub(crate) max_open_files: usize,
}
