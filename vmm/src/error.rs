//! The error type of the `vmm` crate boundary.

use std::path::PathBuf;

/// Everything that can stop the VMM from building or running a VM.
///
/// Guest misbehaviour (a triple fault, an unhandled port) is not an error: it is a
/// [`crate::Outcome`]. These errors are about the host side and the inputs.
#[derive(Debug, thiserror::Error)]
pub enum VmmError {
    /// `/dev/kvm` could not be opened.
    #[error("cannot open /dev/kvm (is KVM available and accessible to this user?)")]
    KvmOpen(#[source] kvm_ioctls::Error),
    /// A KVM ioctl failed.
    #[error("KVM call failed: {0}")]
    Kvm(&'static str, #[source] kvm_ioctls::Error),
    /// The requested guest memory size is out of range.
    #[error("guest memory of {requested_mib} MiB is out of range ({min_mib}..={max_mib} MiB)")]
    MemSize {
        /// What was asked for.
        requested_mib: u64,
        /// The smallest accepted size.
        min_mib: u64,
        /// The largest accepted size.
        max_mib: u64,
    },
    /// Guest memory could not be allocated.
    #[error("cannot allocate guest memory")]
    VmMemory(#[source] vm_memory::mmap::FromRangesError),
    /// A guest-memory access by the VMM fell outside guest RAM.
    #[error("VMM access to guest memory at {0:#x} failed")]
    GuestAccess(u64, #[source] vm_memory::GuestMemoryError),
    /// A kernel or initrd file could not be read.
    #[error("cannot read {}", .0.display())]
    ReadFile(PathBuf, #[source] std::io::Error),
    /// The kernel file is neither an ELF64 nor a bzImage.
    #[error("{} is not a kernel: neither an ELF64 executable nor a bzImage", .0.display())]
    KernelFormat(PathBuf),
    /// The kernel loader rejected the image (truncated, bad headers, does not fit).
    #[error("cannot load kernel {}", .0.display())]
    KernelLoad(PathBuf, #[source] linux_loader::loader::Error),
    /// The bzImage is too old for the 64-bit boot protocol.
    #[error("bzImage {} uses boot protocol {:#x}; 2.06 or later is required", .0.display(), .1)]
    BootProtocol(PathBuf, u16),
    /// The initrd does not fit into guest RAM.
    #[error(
        "initrd of {initrd_bytes} bytes does not fit in guest RAM above the kernel \
             ({free_bytes} bytes free below {limit:#x}); raise --mem"
    )]
    InitrdTooLarge {
        /// Size of the initrd.
        initrd_bytes: u64,
        /// Free bytes available for it.
        free_bytes: u64,
        /// Highest address the initrd may end at.
        limit: u64,
    },
    /// The command line is too long or contains a NUL.
    #[error("kernel command line is invalid or longer than {max} bytes")]
    Cmdline {
        /// The maximum length.
        max: usize,
    },
    /// The console file could not be created.
    #[error("cannot create console file {}", .0.display())]
    ConsoleFile(PathBuf, #[source] std::io::Error),
    /// The host I/O ring could not be set up in the stolen region.
    #[error("cannot set up the host I/O ring ({0:?})")]
    Ring(kpin_abi::io_ring::RingError),
    /// The record ring or cachesim's simulator thread could not be set up.
    #[error("cannot start cachesim's host simulation: {0}")]
    HostSim(String),
    /// The host daemon failed while serving the ring.
    #[error("host daemon failed")]
    Daemon(#[source] host_daemon::DaemonError),
    /// The host CPU lacks an instruction the engine's translated code uses.
    #[error(
        "the guest engine needs {0}, which this host CPU does not have (its isolation checks \
         use BMI2's rorx/sarx: Intel Haswell or later, AMD Zen or later); run without --tool"
    )]
    HostCpuLacks(&'static str),
    /// The engine image is not loadable.
    #[error("cannot load the engine image {}", .0.display())]
    EngineImage(PathBuf, #[source] crate::engine::loader::EngineLoadError),
    /// Guest RAM spans more guest-physical space than the engine's boot tables map.
    #[error(
        "instrumented runs map at most {mapped} GiB-slots of guest-physical memory at boot; \
         guest RAM ends at {ram_end:#x}: lower --mem"
    )]
    EngineRam {
        /// End of the RAM range that did not fit.
        ram_end: u64,
        /// GiB-slots the boot tables can map.
        mapped: u64,
    },
    /// A table does not fit in the attach block.
    #[error("the guest's {0} table has {1} entries; the attach block holds {2}")]
    AttachTable(&'static str, usize, usize),
    /// The tool name is empty, too long, or has characters other than `[A-Za-z0-9_-]`.
    #[error("bad tool name {0:?}: 1 to {1} characters of [A-Za-z0-9_-]")]
    ToolName(String, usize),
    /// The tool options are too long or not printable ASCII.
    #[error("tool options must be printable ASCII of at most {0} bytes")]
    ToolOptions(usize),
    /// An eventfd or signal handler could not be set up.
    #[error("host setup failed: {0}")]
    Host(&'static str, #[source] std::io::Error),
    /// The run's control socket could not be created.
    #[error("cannot listen on the control socket {}", .0.display())]
    ControlSocket(PathBuf, #[source] std::io::Error),
}

/// Shorthand for results in this crate.
pub type Result<T> = std::result::Result<T, VmmError>;
