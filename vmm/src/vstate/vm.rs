//! One VM with one vCPU, built from a [`VmConfig`]: the KVM VM with its in-kernel PIC,
//! IOAPIC and PIT, guest memory (RAM and the stolen region) in its memory slots, the I/O
//! ring formatted in the stolen region, the guest loaded and the vCPU at its entry (or at
//! the engine's), and the devices on the port bus. [`Vm::run`] drives the vCPU loop of
//! [`super::vcpu`] to an [`Outcome`](super::vcpu::Outcome); every outcome other than a
//! clean poweroff carries a guest-state dump. A [`StopRequest`] stops a running guest
//! from another thread (`kpin run` makes one of SIGINT and SIGTERM).

use std::path::PathBuf;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use host_daemon::Daemon;
use kpin_abi::io_ring::{self, Consumer};
use kpin_abi::ports::{ACPI_PM1A_EVT_PORT, ACPI_RESET_PORT, ATTACH_STATUS_PORT, DETACH_PORT};
use kpin_abi::stolen::{IO_RING_BYTES, IO_RING_OFFSET};
use kvm_bindings::{kvm_pit_config, CpuId, KVM_PIT_SPEAKER_DUMMY};
use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use vm_superio::Serial;
use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::signal::SIGRTMIN;

use crate::boot::layout::IO_RING_BATCH_BYTES;
use crate::boot::{self, lint, BootInfo};
use crate::control::server::ControlServer;
use crate::control::windows::Windows;
use crate::devices::acpi_pm::{AcpiPm, ResetRegister, PM_PORT_SPAN};
use crate::devices::bus::PortBus;
use crate::devices::engine_ports::{EnginePorts, ENGINE_PORTS_BASE, ENGINE_PORTS_SPAN};
use crate::devices::i8042::{
    I8042, I8042_AUX_IRQ, I8042_DATA_PORT, I8042_KBD_IRQ, I8042_PORT_SPAN,
};
use crate::devices::pci::{
    PciConfig, PCI_CONFIG_ADDRESS_PORT, PCI_CONFIG_DATA_PORT, PCI_CONFIG_DATA_SPAN,
};
use crate::devices::serial::{
    Com1, ConsoleSink, ConsoleWatch, IrqTrigger, COM1_IRQ, COM1_PORT, COM1_PORT_SPAN,
};
use crate::devices::virtio::disk::DiskConfig;
use crate::devices::virtio::{self, VirtioDevices};
use crate::diag::dump;
use crate::diag::symbols::Symbols;
use crate::engine::host_sim::{HostSim, Planned};
use crate::engine::{self, EngineConfig, EngineEntry};
use crate::error::{Result, VmmError};
use crate::vstate::cpuid;
use crate::vstate::memory::VmMemory;
use crate::vstate::vcpu::{self, ExitCounters, Outcome, RunReport};
use crate::vstate::watchdog::Watchdog;

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
    /// Raw image files the guest sees as virtio-blk disks (`--disk`), `vda` first.
    pub disks: Vec<DiskConfig>,
    /// Give the guest a virtio-rng.
    pub rng: bool,
}

impl VmConfig {
    /// A run of `kernel` natively with 256 MiB, no initrd, an empty command line, no
    /// timeout, the console neither copied nor echoed and no `System.map`; set the rest
    /// with struct update syntax: `VmConfig { mem_mib: 64, ..VmConfig::new(kernel) }`.
    pub fn new(kernel: impl Into<PathBuf>) -> Self {
        VmConfig {
            kernel: kernel.into(),
            initrd: None,
            cmdline: String::new(),
            mem_mib: 256,
            timeout: None,
            console_file: None,
            echo_console: false,
            system_map: None,
            engine: None,
            disks: Vec::new(),
            rng: false,
        }
    }
}

/// The control socket of a run (see [`Vm::run_with_control`]).
#[derive(Clone, Debug)]
pub struct ControlConfig {
    /// Where to listen (must not exist).
    pub socket: PathBuf,
    /// The run's output directory: window `n` writes to `attach-<n>/` beneath it.
    pub out_dir: PathBuf,
    /// The engine image attach loads (`None`: the run cannot attach).
    pub engine_image: Option<PathBuf>,
    /// The `--tool` the run started with.
    pub boot_tool: Option<String>,
    /// The run started under the engine with no window (`kpin run --resident`).
    pub boot_resident: bool,
    /// The guest's kernel: a native attach reads its BTF to name processes (`None`: by
    /// address space).
    pub kernel: Option<PathBuf>,
}

/// A request to stop a running guest, from any thread (`kpin run` makes one of SIGINT and
/// SIGTERM). The vCPU loop checks it before every `KVM_RUN` and ends the run with
/// [`Outcome::Interrupted`]; while [`Vm::run`] runs, a thread kicks the vCPU thread out of
/// `KVM_RUN` with SIGRTMIN (the watchdog's signal) every [`STOP_KICK_INTERVAL`] from the
/// request until the loop has ended, so a guest that never exits to the VMM stops too.
#[derive(Clone, Debug, Default)]
pub struct StopRequest(Arc<StopShared>);

#[derive(Debug, Default)]
struct StopShared {
    /// The signal of the first request; 0 while there is none.
    signal: AtomicI32,
    /// Held while the flags change, for `changed`.
    lock: Mutex<()>,
    /// Notified on a request and at the end of each run.
    changed: Condvar,
}

/// How often the stop thread re-kicks a vCPU that has not noticed the request yet (a kick
/// that lands just before `KVM_RUN` is entered is otherwise lost).
pub const STOP_KICK_INTERVAL: Duration = Duration::from_millis(20);

impl StopRequest {
    /// A request not made yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Asks the run to stop because of `signal` (a signal number, or any non-zero cause).
    /// The first request is the one kept; returns whether this was it.
    pub fn request(&self, signal: i32) -> bool {
        let first = self
            .0
            .signal
            .compare_exchange(0, signal.max(1), Ordering::SeqCst, Ordering::SeqCst)
            .is_ok();
        // Taking the lock orders the store before a waiter's next check.
        drop(self.0.lock.lock().unwrap_or_else(|p| p.into_inner()));
        self.0.changed.notify_all();
        first
    }

    /// The signal of the request, if one was made.
    pub fn requested(&self) -> Option<i32> {
        match self.0.signal.load(Ordering::SeqCst) {
            0 => None,
            s => Some(s),
        }
    }
}

/// The name of a signal number (`SIGTERM`), for messages and `run.json`.
pub fn signal_name(signal: i32) -> String {
    match signal {
        libc::SIGINT => "SIGINT".into(),
        libc::SIGTERM => "SIGTERM".into(),
        libc::SIGHUP => "SIGHUP".into(),
        libc::SIGQUIT => "SIGQUIT".into(),
        n => format!("signal {n}"),
    }
}

/// The thread that turns a [`StopRequest`] into kicks of the vCPU thread during one run.
/// Invariant: it only signals the vCPU thread while that thread is in [`Vm::run`], which
/// joins it ([`StopKicker::finish`]) before returning.
struct StopKicker {
    stop: StopRequest,
    over: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl StopKicker {
    /// Starts kicking the calling (vCPU) thread once `stop` is requested. The SIGRTMIN
    /// handler must be installed already (the watchdog installs it).
    fn start(stop: &StopRequest) -> Result<Self> {
        // SAFETY: pthread_self has no preconditions.
        let vcpu_thread = unsafe { libc::pthread_self() };
        let over = Arc::new(AtomicBool::new(false));
        let (shared, done) = (stop.0.clone(), over.clone());
        let thread = std::thread::Builder::new()
            .name("kpin-stop".into())
            .spawn(move || {
                let mut guard = shared.lock.lock().unwrap_or_else(|p| p.into_inner());
                while shared.signal.load(Ordering::SeqCst) == 0 && !done.load(Ordering::SeqCst) {
                    guard = shared
                        .changed
                        .wait(guard)
                        .unwrap_or_else(|p| p.into_inner());
                }
                while !done.load(Ordering::SeqCst) {
                    // SAFETY: the vCPU thread is alive: it joins this thread (in
                    // `finish`) before it leaves `Vm::run`, and sets `done` first.
                    unsafe { libc::pthread_kill(vcpu_thread, SIGRTMIN()) };
                    guard = shared
                        .changed
                        .wait_timeout(guard, STOP_KICK_INTERVAL)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
            })
            .map_err(|e| VmmError::Host("spawning the stop thread", e))?;
        Ok(StopKicker {
            stop: stop.clone(),
            over,
            thread: Some(thread),
        })
    }

    /// Stops the thread and waits for it.
    fn finish(mut self) {
        self.stop_and_join();
    }

    fn stop_and_join(&mut self) {
        self.over.store(true, Ordering::SeqCst);
        drop(self.stop.0.lock.lock().unwrap_or_else(|p| p.into_inner()));
        self.stop.0.changed.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for StopKicker {
    fn drop(&mut self) {
        self.stop_and_join();
    }
}

/// A VM ready to run.
pub struct Vm {
    // Field order matters: the vCPU and VM fds drop before the memory they map.
    vcpu: VcpuFd,
    _vm: VmFd,
    ring: Consumer,
    mem: VmMemory,
    bus: PortBus,
    /// The virtio-mmio devices and the MMIO bus they are on.
    virtio: VirtioDevices,
    console: Rc<ConsoleWatch>,
    /// COM1's transmitter for the daemon (console bytes the engine batched).
    console_tx: Option<host_daemon::ConsoleSink>,
    timeout: Option<Duration>,
    symbols: Option<Symbols>,
    /// Where the kernel was loaded and entered.
    pub boot: BootInfo,
    /// The CPUID table the guest sees.
    pub cpuid: CpuId,
    /// Where the engine was entered, when instrumenting.
    pub engine: Option<EngineEntry>,
    /// The tool and options whose simulation runs on a host thread ([`HostSim::plan`]:
    /// asked for, the tool's records may go to the host, and it has a second core).
    host_sim: Option<Planned>,
    /// Stops the run from another thread ([`Vm::set_stop_request`]).
    stop: StopRequest,
}

/// An eventfd that pulses ISA interrupt line `irq` of the in-kernel PIC when written.
fn irq_line(vm: &VmFd, irq: u32) -> Result<EventFd> {
    let fd = EventFd::new(libc::EFD_NONBLOCK)
        .map_err(|e| VmmError::Host("creating an interrupt eventfd", e))?;
    vm.register_irqfd(&fd, irq)
        .map_err(|e| VmmError::Kvm("KVM_IRQFD", e))?;
    Ok(fd)
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
        let mem = VmMemory::new(&vm, cfg.mem_mib)?;
        let disks = virtio::open_disks(&cfg.disks)?;
        let virtio =
            VirtioDevices::new(&mem.ram, disks, cfg.rng, &mut |irq| virtio::irqfd(&vm, irq))?;
        let boot = boot::load(
            &mem,
            &cfg.kernel,
            cfg.initrd.as_deref(),
            &cfg.cmdline,
            &virtio.windows,
        )?;
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
        lint::set_lint_pins(&vcpu)?;
        // The guest's state is now exactly its native boot state; the engine gets a copy.
        let engine = match &cfg.engine {
            Some(e) => Some(engine::enter::enter(&vcpu, &mem, &cpuid, e)?),
            None => None,
        };

        let console = Rc::new(ConsoleWatch::default());
        let file = match &cfg.console_file {
            // Never through a symlink or hard link left in the output directory.
            Some(p) => Some(
                host_daemon::resolve::create_output_file(p)
                    .map_err(|e| VmmError::ConsoleFile(p.clone(), e))?,
            ),
            None => None,
        };
        let irq = irq_line(&vm, COM1_IRQ)?;
        let sink = ConsoleSink::new(cfg.echo_console, file, console.clone());
        let mut bus = PortBus::default();
        let com1 = Com1::new(Serial::new(IrqTrigger(irq), sink));
        let console_tx: host_daemon::ConsoleSink = Box::new(com1.transmitter());
        bus.insert(COM1_PORT, COM1_PORT_SPAN, Box::new(com1));
        let i8042 = I8042::new(irq_line(&vm, I8042_KBD_IRQ)?, irq_line(&vm, I8042_AUX_IRQ)?);
        bus.insert(I8042_DATA_PORT, I8042_PORT_SPAN, Box::new(i8042));
        bus.insert(
            ACPI_PM1A_EVT_PORT,
            PM_PORT_SPAN,
            Box::new(AcpiPm::default()),
        );
        bus.insert(ACPI_RESET_PORT, 1, Box::new(ResetRegister));
        let (pci, pci_address) = PciConfig::new();
        bus.insert(PCI_CONFIG_ADDRESS_PORT, 1, Box::new(pci_address));
        bus.insert(PCI_CONFIG_DATA_PORT, PCI_CONFIG_DATA_SPAN, Box::new(pci));
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
            virtio,
            console,
            console_tx: Some(console_tx),
            timeout: cfg.timeout,
            symbols,
            boot,
            cpuid,
            engine,
            host_sim: cfg.engine.as_ref().and_then(HostSim::plan),
            stop: StopRequest::new(),
        })
    }

    /// Lets `stop` end the run: the guest is stopped where it is, the ring drained once
    /// more, and the run ends with [`Outcome::Interrupted`].
    pub fn set_stop_request(&mut self, stop: StopRequest) {
        self.stop = stop;
    }

    /// Runs the guest until it powers off, crashes, or the timeout expires. `daemon`
    /// serves the host I/O ring on every doorbell and once more at the end.
    pub fn run(self, daemon: &mut Daemon) -> Result<RunReport> {
        self.run_with_control(daemon, None)
    }

    /// [`Vm::run`], listening on a control socket while the guest runs (`kpin attach`,
    /// `detach`, `status`): the socket exists from the first `KVM_RUN` until the loop ends.
    pub fn run_with_control(
        mut self,
        daemon: &mut Daemon,
        control: Option<ControlConfig>,
    ) -> Result<RunReport> {
        if let Some(tx) = self.console_tx.take() {
            daemon.set_console(tx);
        }
        // Before the vCPU first runs: the engine looks for a formatted record ring.
        let mut host_sim = match &self.host_sim {
            Some(plan) => HostSim::start(&self.mem, plan)?,
            None => None,
        };
        // The engine's waits for room in the record ring sleep on this (the vCPU) thread.
        let record_room = host_sim.as_ref().map(HostSim::room).transpose()?;
        let watchdog = Watchdog::arm(self.timeout)?;
        // After the watchdog: it installs the SIGRTMIN handler the kicks need.
        let kicker = StopKicker::start(&self.stop)?;
        let start = Instant::now();
        let mut exits = ExitCounters::default();
        let (server, mut windows) = match control {
            Some(c) => {
                let (server, rx) = ControlServer::start(&c.socket)?;
                let windows =
                    Windows::new(rx, c.engine_image, c.out_dir, c.boot_tool, c.boot_resident)
                        .with_kernel(c.kernel);
                self.bus
                    .insert(ATTACH_STATUS_PORT, 1, Box::new(windows.status_port()));
                self.bus
                    .insert(DETACH_PORT, 1, Box::new(windows.detach_port()));
                (Some(server), Some(windows))
            }
            None => (None, None),
        };
        let (mem, cpuid) = (&self.mem, &self.cpuid);
        let mut between =
            |vcpu: &mut VcpuFd, daemon: &mut Daemon, ring: &mut Consumer, exits: &ExitCounters| {
                // The simulated tool's window ended (before a detach moves the output
                // directory on).
                if host_sim.as_ref().is_some_and(HostSim::closed) {
                    if let Some(h) = host_sim.take() {
                        h.finish(daemon);
                    }
                }
                match &mut windows {
                    Some(w) => w.poll(vcpu, mem, cpuid, daemon, ring, exits),
                    None => Ok(()),
                }
            };
        let outcome = vcpu::run_loop(
            &mut self.vcpu,
            &mut self.bus,
            &mut self.virtio.bus,
            &self.console,
            &mut self.ring,
            daemon,
            &watchdog,
            &self.stop,
            record_room.as_ref(),
            &mut exits,
            &mut between,
        );
        kicker.finish();
        if let Some(s) = server {
            s.shutdown();
        }
        watchdog.finish();
        let outcome = outcome?;
        let wall = start.elapsed();
        if let Some(h) = host_sim {
            h.finish(daemon);
        }
        // Whatever the engine wrote before the end (its last log lines on a failure); a
        // daemon that failed already leaves the ring alone. A clean end whose last records
        // cannot be written is not clean, and a corrupt ring is said; a run stopped for
        // another reason (timeout, signal, crash) keeps that outcome, and a failed write
        // stays in `daemon.output_failure()`.
        let outcome = match daemon.serve(&mut self.ring) {
            Err(e)
                if outcome == Outcome::Poweroff
                    || matches!(e, host_daemon::DaemonError::Ring(_)) =>
            {
                Outcome::HostDaemon(vcpu::error_chain(&e))
            }
            _ => outcome,
        };
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
            devices: self.virtio.records(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_the_first_stop_request_is_kept_and_signals_are_named() {
        let stop = StopRequest::new();
        assert_eq!(stop.requested(), None);
        assert!(stop.request(libc::SIGTERM));
        assert!(
            !stop.clone().request(libc::SIGINT),
            "a clone is the same request"
        );
        assert_eq!(stop.requested(), Some(libc::SIGTERM));
        assert_eq!(signal_name(libc::SIGTERM), "SIGTERM");
        assert_eq!(signal_name(libc::SIGINT), "SIGINT");
        assert_eq!(signal_name(40), "signal 40");
        assert_eq!(
            Outcome::Interrupted {
                signal: libc::SIGINT
            }
            .describe(),
            "interrupted by SIGINT"
        );
    }

    #[test]
    fn test_a_stop_request_from_another_thread_kicks_the_vcpu_thread_out_of_a_blocking_call() {
        // The watchdog installs the SIGRTMIN handler the kicks need.
        let watchdog = Watchdog::arm(None).expect("arm");
        let stop = StopRequest::new();
        let kicker = StopKicker::start(&stop).expect("start the stop thread");
        let requester = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                stop.request(libc::SIGTERM);
            })
        };
        // Stands in for KVM_RUN: a blocking call only a signal ends early. The kicks
        // repeat, so one landing before the call is made is not lost.
        let long = libc::timespec {
            tv_sec: 60,
            tv_nsec: 0,
        };
        // SAFETY: nanosleep with a valid timespec and no remainder pointer.
        let r = unsafe { libc::nanosleep(&long, std::ptr::null_mut()) };
        assert_eq!(r, -1, "the sleep was not interrupted");
        kicker.finish();
        requester.join().unwrap();
        watchdog.finish();
    }
}
