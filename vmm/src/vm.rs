//! One VM with one vCPU: built from a [`VmConfig`], run to an [`Outcome`].
//!
//! The run loop is a small state machine: `KVM_RUN`, classify the exit in
//! [`handle_exit`] into "keep running" or a final [`Outcome`], repeat. Every outcome other
//! than a clean poweroff carries a guest-state dump.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::PathBuf;
use std::rc::Rc;
use std::time::{Duration, Instant};

use host_daemon::Daemon;
use kpin_abi::io_ring::{self, Consumer};
use kpin_abi::stolen::{IO_RING_BYTES, IO_RING_OFFSET};
use kvm_bindings::{kvm_pit_config, CpuId, KVM_PIT_SPEAKER_DUMMY};
use kvm_ioctls::{Kvm, VcpuExit, VcpuFd, VmFd};
use vm_superio::Serial;
use vmm_sys_util::eventfd::EventFd;

use crate::boot::{self, BootInfo};
use crate::cpuid;
use crate::devices::acpi_pm::{AcpiPm, ResetRegister, PM_PORT_SPAN};
use crate::devices::bus::{DeviceAction, PortBus, Routed};
use crate::devices::engine_ports::{EnginePorts, ENGINE_PORTS_BASE, ENGINE_PORTS_SPAN};
use crate::devices::i8042::{I8042, I8042_DATA_PORT, I8042_PORT_SPAN};
use crate::devices::serial::{
    Com1, ConsoleSink, ConsoleWatch, IrqTrigger, COM1_IRQ, COM1_PORT, COM1_PORT_SPAN,
};
use crate::dump;
use crate::engine_boot::{self, EngineConfig, EngineEntry};
use crate::error::{Result, VmmError};
use crate::layout::{IO_RING_BATCH_BYTES, MMIO_GAP_END};
use crate::memory::GuestMemory;
use crate::symbols::Symbols;
use crate::watchdog::Watchdog;
use kpin_abi::ports::{ACPI_PM1A_EVT_PORT, ACPI_RESET_PORT};

/// Local APIC register offsets and delivery modes for the LINT pins.
const APIC_LVT0: usize = 0x350;
const APIC_LVT1: usize = 0x360;
const APIC_MODE_EXTINT: u32 = 0x7 << 8;
const APIC_MODE_NMI: u32 = 0x4 << 8;
const APIC_LVT_DELIVERY_MASK: u32 = 0x7 << 8;
const APIC_LVT_MASKED: u32 = 1 << 16;
/// `KVM_SYSTEM_EVENT_*` types.
const SYSTEM_EVENT_SHUTDOWN: u32 = 1;
const SYSTEM_EVENT_RESET: u32 = 2;

/// What to boot and how.
#[derive(Clone, Debug)]
pub struct VmConfig {
    /// Kernel image: ELF64 or bzImage.
    pub kernel: PathBuf,
    /// Optional initrd.
    pub initrd: Option<PathBuf>,
    /// Kernel command line.
    pub cmdline: String,
    /// Guest RAM in MiB.
    pub mem_mib: u64,
    /// Stop the guest after this long.
    pub timeout: Option<Duration>,
    /// Copy the console to this file.
    pub console_file: Option<PathBuf>,
    /// Echo the console to stdout.
    pub echo_console: bool,
    /// Kernel `System.map`, to name addresses in the guest-state dump.
    pub system_map: Option<PathBuf>,
    /// Run the guest under the engine (`--tool`): the vCPU starts in the engine, which
    /// finds the guest's boot state in the attach block.
    pub engine: Option<EngineConfig>,
}

/// How a run ended, from the guest's point of view.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The guest reset or powered off the machine: a clean end.
    Poweroff,
    /// The guest kernel panicked (seen on its console: Linux's or the mini-kernel's mark).
    KernelPanic,
    /// Triple fault / shutdown.
    TripleFault,
    /// KVM could not emulate an instruction or deliver an event.
    InternalError {
        /// `KVM_INTERNAL_ERROR_*` sub-error.
        suberror: u32,
        /// Sub-error data words.
        data: Vec<u64>,
    },
    /// VM entry failed.
    FailEntry {
        /// Hardware entry-failure reason.
        reason: u64,
    },
    /// An MMIO access above 4 GiB outside guest RAM and the in-kernel devices (below
    /// 4 GiB such an access reads all ones and is counted, as on a PC).
    UnhandledMmio {
        /// Guest-physical address.
        addr: u64,
        /// Write (true) or read.
        write: bool,
        /// Access size in bytes.
        size: usize,
    },
    /// Another exit kpin does not expect.
    UnexpectedExit(String),
    /// The engine reported a failure through its failure port.
    EngineFailure,
    /// The run's timeout expired.
    Timeout,
}

impl Outcome {
    /// Whether this is a clean end of the guest.
    pub fn is_clean(&self) -> bool {
        *self == Outcome::Poweroff
    }

    /// One line describing the outcome.
    pub fn describe(&self) -> String {
        match self {
            Outcome::Poweroff => "guest powered off".into(),
            Outcome::KernelPanic => "guest kernel panicked".into(),
            Outcome::TripleFault => "guest triple-faulted (shutdown)".into(),
            Outcome::InternalError { suberror, data } => format!(
                "KVM internal error, suberror {suberror} ({}), data {data:x?}",
                internal_error_name(*suberror)
            ),
            Outcome::FailEntry { reason } => format!("VM entry failed, reason {reason:#x}"),
            Outcome::UnhandledMmio { addr, write, size } => format!(
                "unhandled MMIO {} of {size} byte(s) at {addr:#x}",
                if *write { "write" } else { "read" }
            ),
            Outcome::UnexpectedExit(what) => format!("unexpected exit: {what}"),
            Outcome::EngineFailure => "the engine reported a failure (see engine.log)".into(),
            Outcome::Timeout => "timeout expired".into(),
        }
    }
}

fn internal_error_name(suberror: u32) -> &'static str {
    match suberror {
        1 => "instruction emulation failed",
        2 => "simultaneous exceptions",
        3 => "delivery event failed",
        4 => "unexpected exit reason",
        _ => "unknown",
    }
}

/// Exit counts per kind, for the run summary.
#[derive(Clone, Debug, Default)]
pub struct ExitCounters {
    /// Port writes handled by a device.
    pub io_out: u64,
    /// Port reads handled by a device.
    pub io_in: u64,
    /// Accesses to known-absent legacy ports (`devices::bus::ABSENT_PORTS`).
    pub io_absent: u64,
    /// Accesses to any other port no device serves, by port: as on a PC, reads return
    /// all ones and writes are dropped (generic kernels probe Super I/O chips, watchdogs
    /// and legacy controllers).
    pub unpopulated_ports: BTreeMap<u16, u64>,
    /// MMIO accesses below 4 GiB that hit no memory and no device (reads all ones,
    /// writes dropped), by page, for at most [`MAX_MMIO_PAGES_COUNTED`] distinct pages.
    pub unbacked_mmio: BTreeMap<u64, u64>,
    /// All unbacked MMIO accesses below 4 GiB, including pages beyond the map's cap.
    pub unbacked_mmio_total: u64,
    /// I/O-ring doorbells.
    pub doorbells: u64,
    /// Returns from `KVM_RUN` because of a signal.
    pub interrupted: u64,
    /// All `KVM_RUN` returns.
    pub total: u64,
}

/// The result of a run.
#[derive(Debug)]
pub struct RunReport {
    /// How it ended.
    pub outcome: Outcome,
    /// The guest-state dump, for every outcome but a clean one.
    pub dump: Option<String>,
    /// Wall time from the first `KVM_RUN`.
    pub wall: Duration,
    /// Exit counts.
    pub exits: ExitCounters,
    /// Bytes the guest wrote to its console.
    pub console_bytes: u64,
}

/// A VM ready to run.
pub struct Vm {
    // Field order matters: the vCPU and VM fds drop before the memory they map.
    vcpu: VcpuFd,
    _vm: VmFd,
    ring: Consumer,
    mem: GuestMemory,
    bus: PortBus,
    console: Rc<ConsoleWatch>,
    timeout: Option<Duration>,
    symbols: Option<Symbols>,
    /// Where the kernel was loaded and entered.
    pub boot: BootInfo,
    /// The CPUID table the guest sees.
    pub cpuid: CpuId,
    /// Where the engine was entered, when instrumenting.
    pub engine: Option<EngineEntry>,
}

impl Vm {
    /// Creates the VM, loads the guest and prepares the vCPU at its entry point.
    pub fn new(cfg: &VmConfig) -> Result<Self> {
        let kvm = Kvm::new().map_err(VmmError::KvmOpen)?;
        let vm = kvm
            .create_vm()
            .map_err(|e| VmmError::Kvm("KVM_CREATE_VM", e))?;
        // Both must exist before the vCPU does.
        vm.create_irq_chip()
            .map_err(|e| VmmError::Kvm("KVM_CREATE_IRQCHIP", e))?;
        let pit = kvm_pit_config {
            flags: KVM_PIT_SPEAKER_DUMMY,
            ..Default::default()
        };
        vm.create_pit2(pit)
            .map_err(|e| VmmError::Kvm("KVM_CREATE_PIT2", e))?;
        let mem = GuestMemory::new(&vm, cfg.mem_mib)?;
        let boot = boot::load(&mem, &cfg.kernel, cfg.initrd.as_deref(), &cfg.cmdline)?;
        let ring_base = mem.stolen_host_address(IO_RING_OFFSET)?;
        let ring_bytes = usize::try_from(IO_RING_BYTES).expect("the ring size fits usize");
        // SAFETY: the ring lies inside the stolen region's mapping (IO_RING_OFFSET +
        // IO_RING_BYTES is within STOLEN_SIZE_BYTES), which `mem` keeps mapped for the VM's
        // lifetime and which is page-aligned; nothing is attached to the ring yet.
        unsafe { io_ring::format(ring_base, ring_bytes, IO_RING_BATCH_BYTES) }
            .map_err(VmmError::Ring)?;
        // SAFETY: as above; the VMM is the ring's only consumer, and `ring` is declared
        // before `mem` in `Vm`, so it is dropped before the mapping is.
        let ring = unsafe { Consumer::attach(ring_base, ring_bytes) }.map_err(VmmError::Ring)?;

        let vcpu = vm
            .create_vcpu(0)
            .map_err(|e| VmmError::Kvm("KVM_CREATE_VCPU", e))?;
        let mut cpuid = cpuid::guest_cpuid(&kvm)?;
        vcpu.set_cpuid2(&cpuid)
            .map_err(|e| VmmError::Kvm("KVM_SET_CPUID2", e))?;
        if cpuid::hide_unreadable_msrs(&mut cpuid, &vcpu) {
            vcpu.set_cpuid2(&cpuid)
                .map_err(|e| VmmError::Kvm("KVM_SET_CPUID2", e))?;
        }
        let sregs = vcpu
            .get_sregs()
            .map_err(|e| VmmError::Kvm("KVM_GET_SREGS", e))?;
        vcpu.set_sregs(&boot::initial_sregs(sregs))
            .map_err(|e| VmmError::Kvm("KVM_SET_SREGS", e))?;
        vcpu.set_regs(&boot::initial_regs(boot.entry))
            .map_err(|e| VmmError::Kvm("KVM_SET_REGS", e))?;
        vcpu.set_fpu(&boot::initial_fpu())
            .map_err(|e| VmmError::Kvm("KVM_SET_FPU", e))?;
        set_lint_pins(&vcpu)?;
        // The guest's state is now exactly its native boot state; the engine gets a copy.
        let engine = match &cfg.engine {
            Some(e) => Some(engine_boot::enter(&vcpu, &mem, &cpuid, e)?),
            None => None,
        };

        let console = Rc::new(ConsoleWatch::default());
        let file = match &cfg.console_file {
            Some(p) => Some(File::create(p).map_err(|e| VmmError::ConsoleFile(p.clone(), e))?),
            None => None,
        };
        let irq = EventFd::new(libc::EFD_NONBLOCK)
            .map_err(|e| VmmError::Host("creating the COM1 eventfd", e))?;
        vm.register_irqfd(&irq, COM1_IRQ)
            .map_err(|e| VmmError::Kvm("KVM_IRQFD", e))?;
        let sink = ConsoleSink::new(cfg.echo_console, file, console.clone());
        let mut bus = PortBus::default();
        bus.insert(
            COM1_PORT,
            COM1_PORT_SPAN,
            Box::new(Com1(Serial::new(IrqTrigger(irq), sink))),
        );
        bus.insert(I8042_DATA_PORT, I8042_PORT_SPAN, Box::new(I8042::default()));
        bus.insert(
            ACPI_PM1A_EVT_PORT,
            PM_PORT_SPAN,
            Box::new(AcpiPm::default()),
        );
        bus.insert(ACPI_RESET_PORT, 1, Box::new(ResetRegister));
        bus.insert(ENGINE_PORTS_BASE, ENGINE_PORTS_SPAN, Box::new(EnginePorts));

        let symbols = match &cfg.system_map {
            Some(p) => Some(Symbols::load(p).map_err(|e| VmmError::ReadFile(p.clone(), e))?),
            None => None,
        };
        Ok(Vm {
            vcpu,
            _vm: vm,
            ring,
            mem,
            bus,
            console,
            timeout: cfg.timeout,
            symbols,
            boot,
            cpuid,
            engine,
        })
    }

    /// Runs the guest until it powers off, crashes, or the timeout expires. `daemon`
    /// serves the host I/O ring on every doorbell and once more at the end.
    pub fn run(mut self, daemon: &mut Daemon) -> Result<RunReport> {
        let watchdog = Watchdog::arm(self.timeout)?;
        let start = Instant::now();
        let mut exits = ExitCounters::default();
        let outcome = loop {
            if watchdog.expired() {
                break Outcome::Timeout;
            }
            exits.total += 1;
            let step = handle_exit(self.vcpu.run(), &mut self.bus, &mut exits);
            let step = match step {
                Ok(s) => s,
                Err(e) => {
                    watchdog.finish();
                    return Err(e);
                }
            };
            if self.console.panicked.get() {
                break Outcome::KernelPanic;
            }
            match step {
                Step::Continue => {}
                Step::DrainRing => {
                    exits.doorbells += 1;
                    if let Err(e) = daemon.serve(&mut self.ring) {
                        watchdog.finish();
                        return Err(VmmError::Daemon(e));
                    }
                }
                Step::InternalError => {
                    let run = self.vcpu.get_kvm_run();
                    // SAFETY: KVM filled the `internal` member of the exit union for a
                    // KVM_EXIT_INTERNAL_ERROR exit, which is what `Step::InternalError` means.
                    let internal = unsafe { run.__bindgen_anon_1.internal };
                    let n = (internal.ndata as usize).min(internal.data.len());
                    break Outcome::InternalError {
                        suberror: internal.suberror,
                        data: internal.data[..n].to_vec(),
                    };
                }
                Step::End(o) => break o,
            }
        };
        watchdog.finish();
        let wall = start.elapsed();
        // Whatever the engine wrote before the end (its last log lines on a failure).
        daemon.serve(&mut self.ring).map_err(VmmError::Daemon)?;
        let dump = (!outcome.is_clean()).then(|| {
            dump::guest_state(
                &outcome.describe(),
                &self.vcpu,
                &self.mem,
                self.symbols.as_ref(),
            )
        });
        Ok(RunReport {
            outcome,
            dump,
            wall,
            exits,
            console_bytes: self.console.bytes.get(),
        })
    }
}

/// What the loop does after one exit.
enum Step {
    Continue,
    /// Drain the I/O ring, then continue.
    DrainRing,
    /// Read the internal-error details from the run structure, then end.
    InternalError,
    End(Outcome),
}

/// Classifies one `KVM_RUN` return and serves the I/O it asks for.
fn handle_exit(
    exit: std::result::Result<VcpuExit<'_>, kvm_ioctls::Error>,
    bus: &mut PortBus,
    exits: &mut ExitCounters,
) -> Result<Step> {
    let step = match exit {
        Ok(VcpuExit::IoOut(port, data)) => port_step(bus.write(port, data), port, true, exits),
        Ok(VcpuExit::IoIn(port, data)) => port_step(bus.read(port, data), port, false, exits),
        Ok(VcpuExit::MmioRead(addr, data)) if addr < MMIO_GAP_END => {
            data.fill(0xff);
            count_unbacked_mmio(addr, exits);
            Step::Continue
        }
        Ok(VcpuExit::MmioWrite(addr, _)) if addr < MMIO_GAP_END => {
            count_unbacked_mmio(addr, exits);
            Step::Continue
        }
        Ok(VcpuExit::MmioRead(addr, data)) => Step::End(Outcome::UnhandledMmio {
            addr,
            write: false,
            size: data.len(),
        }),
        Ok(VcpuExit::MmioWrite(addr, data)) => Step::End(Outcome::UnhandledMmio {
            addr,
            write: true,
            size: data.len(),
        }),
        Ok(VcpuExit::Shutdown) => Step::End(Outcome::TripleFault),
        Ok(VcpuExit::InternalError) => Step::InternalError,
        Ok(VcpuExit::FailEntry(reason, _)) => Step::End(Outcome::FailEntry { reason }),
        Ok(VcpuExit::SystemEvent(kind, _))
            if kind == SYSTEM_EVENT_SHUTDOWN || kind == SYSTEM_EVENT_RESET =>
        {
            Step::End(Outcome::Poweroff)
        }
        Ok(VcpuExit::Intr) => {
            exits.interrupted += 1;
            Step::Continue
        }
        Ok(other) => Step::End(Outcome::UnexpectedExit(format!("{other:?}"))),
        Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
            exits.interrupted += 1;
            Step::Continue
        }
        Err(e) => return Err(VmmError::Kvm("KVM_RUN", e)),
    };
    Ok(step)
}

/// How many distinct unbacked MMIO pages [`ExitCounters::unbacked_mmio`] counts (a guest
/// touching more must not grow the VMM without bound).
pub const MAX_MMIO_PAGES_COUNTED: usize = 256;

fn count_unbacked_mmio(addr: u64, exits: &mut ExitCounters) {
    exits.unbacked_mmio_total += 1;
    let page = addr & !0xfff;
    if exits.unbacked_mmio.len() < MAX_MMIO_PAGES_COUNTED || exits.unbacked_mmio.contains_key(&page)
    {
        *exits.unbacked_mmio.entry(page).or_default() += 1;
    }
}

/// What a routed port access means for the run loop.
fn port_step(routed: Routed, port: u16, write: bool, exits: &mut ExitCounters) -> Step {
    match routed {
        Routed::Device(DeviceAction::Reset) => Step::End(Outcome::Poweroff),
        Routed::Device(DeviceAction::DrainRing) => Step::DrainRing,
        Routed::Device(DeviceAction::EngineFailure) => Step::End(Outcome::EngineFailure),
        Routed::Device(DeviceAction::None) => {
            if write {
                exits.io_out += 1;
            } else {
                exits.io_in += 1;
            }
            Step::Continue
        }
        Routed::Absent => {
            exits.io_absent += 1;
            Step::Continue
        }
        Routed::Unpopulated => {
            *exits.unpopulated_ports.entry(port).or_default() += 1;
            Step::Continue
        }
    }
}

/// Wires the local APIC's LINT0 to the 8259 (ExtINT) and LINT1 to NMI, as a PC BIOS
/// leaves them, so PIC interrupts reach a guest that never programs its local APIC.
fn set_lint_pins(vcpu: &VcpuFd) -> Result<()> {
    let mut lapic = vcpu
        .get_lapic()
        .map_err(|e| VmmError::Kvm("KVM_GET_LAPIC", e))?;
    for (reg, mode) in [(APIC_LVT0, APIC_MODE_EXTINT), (APIC_LVT1, APIC_MODE_NMI)] {
        let bytes: [u8; 4] = std::array::from_fn(|i| lapic.regs[reg + i] as u8);
        let v = u32::from_le_bytes(bytes);
        let v = (v & !(APIC_LVT_DELIVERY_MASK | APIC_LVT_MASKED)) | mode;
        for (i, b) in v.to_le_bytes().into_iter().enumerate() {
            lapic.regs[reg + i] = b as libc::c_char;
        }
    }
    vcpu.set_lapic(&lapic)
        .map_err(|e| VmmError::Kvm("KVM_SET_LAPIC", e))
}
