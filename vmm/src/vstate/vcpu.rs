//! The vCPU run loop and what each exit means.
//!
//! The loop is a small state machine: `KVM_RUN`, classify the exit in `handle_exit` into
//! a `Step` ("keep running", "drain the I/O ring, then keep running", "read the internal
//! error", or a final [`Outcome`]), act on it, repeat. `handle_exit` sees only the exit
//! and the two buses (ports, and MMIO: the virtio-mmio devices), so it is unit-tested
//! with exits built by hand, without KVM.

use std::collections::BTreeMap;
use std::time::Duration;

use host_daemon::Daemon;
use kpin_abi::io_ring::Consumer;
use kvm_ioctls::{VcpuExit, VcpuFd};

use crate::boot::layout::MMIO_GAP_END;
use crate::devices::bus::{DeviceAction, PortBus, Routed};
use crate::devices::mmio::{MmioAction, MmioBus, MmioRouted};
use crate::devices::serial::ConsoleWatch;
use crate::engine::host_sim::RecordRoom;
use crate::error::{Result, VmmError};
use crate::vstate::watchdog::Watchdog;

/// `KVM_SYSTEM_EVENT_*` types.
const SYSTEM_EVENT_SHUTDOWN: u32 = 1;
const SYSTEM_EVENT_RESET: u32 = 2;

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
    /// 4 GiB such an access reads all ones and is counted, as on a PC), or an access to a
    /// virtio-mmio device in a form its registers do not have (a width or alignment).
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
    /// kpin was asked to stop (a [`StopRequest`](super::vm::StopRequest): SIGINT or
    /// SIGTERM); the guest was stopped where it was.
    Interrupted {
        /// The signal number.
        signal: i32,
    },
    /// The host daemon stopped serving the I/O ring: a corrupt ring (the engine's end is
    /// in the guest's VM) or a failed write to the output directory.
    HostDaemon(String),
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
            Outcome::Interrupted { signal } => {
                format!("interrupted by {}", super::vm::signal_name(*signal))
            }
            Outcome::HostDaemon(why) => format!("the host daemon stopped the run: {why}"),
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
    /// MMIO accesses a device on the MMIO bus (virtio-mmio) served.
    pub mmio_device: u64,
    /// I/O-ring doorbells.
    pub doorbells: u64,
    /// Of those, the engine's waits for room in the record ring (the host simulator's).
    pub record_room_waits: u64,
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
    /// The virtio devices' counters (`run.json`'s `devices`).
    pub devices: Vec<crate::devices::virtio::DeviceRecord>,
}

/// Runs the vCPU until the run ends: the guest stops, `watchdog` expires, `stop` is
/// requested, or the console shows a kernel panic. A doorbell has `daemon` serve `ring`;
/// one asking for record room also waits on `record_room` (the host simulator's ring)
/// before the vCPU runs again. Every exit is counted in `exits`. Before every `KVM_RUN`,
/// `between` runs (the control channel's commands: it may change the vCPU's state). An
/// `Err` is a host failure (`KVM_RUN` itself, the daemon, or `between`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn run_loop(
    vcpu: &mut VcpuFd,
    bus: &mut PortBus,
    mmio: &mut MmioBus,
    console: &ConsoleWatch,
    ring: &mut Consumer,
    daemon: &mut Daemon,
    watchdog: &Watchdog,
    stop: &super::vm::StopRequest,
    record_room: Option<&RecordRoom>,
    exits: &mut ExitCounters,
    between: &mut dyn FnMut(&mut VcpuFd, &mut Daemon, &mut Consumer, &ExitCounters) -> Result<()>,
) -> Result<Outcome> {
    loop {
        if watchdog.expired() {
            return Ok(Outcome::Timeout);
        }
        if let Some(signal) = stop.requested() {
            return Ok(Outcome::Interrupted { signal });
        }
        between(vcpu, daemon, ring, exits)?;
        exits.total += 1;
        let step = handle_exit(vcpu.run(), bus, mmio, exits)?;
        if console.panicked.get() {
            return Ok(Outcome::KernelPanic);
        }
        match step {
            Step::Continue => {}
            Step::DrainRing | Step::WaitForRecordRoom => {
                exits.doorbells += 1;
                if let Err(e) = daemon.serve(ring) {
                    return Ok(Outcome::HostDaemon(error_chain(&e)));
                }
                if step == Step::WaitForRecordRoom {
                    exits.record_room_waits += 1;
                    if let Some(room) = record_room {
                        room.wait(|| watchdog.expired() || stop.requested().is_some());
                    }
                }
            }
            Step::InternalError => {
                let run = vcpu.get_kvm_run();
                // SAFETY: KVM filled the `internal` member of the exit union for a
                // KVM_EXIT_INTERNAL_ERROR exit, which is what `Step::InternalError` means.
                let internal = unsafe { run.__bindgen_anon_1.internal };
                let n = (internal.ndata as usize).min(internal.data.len());
                return Ok(Outcome::InternalError {
                    suberror: internal.suberror,
                    data: internal.data[..n].to_vec(),
                });
            }
            Step::End(o) => return Ok(o),
        }
    }
}

/// An error and its sources on one line.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
}

/// What the loop does after one exit.
#[derive(Debug, PartialEq, Eq)]
enum Step {
    /// Run the vCPU again.
    Continue,
    /// Drain the I/O ring, then continue.
    DrainRing,
    /// Drain the I/O ring, wait for room in the record ring, then continue.
    WaitForRecordRoom,
    /// Read the internal-error details from the run structure, then end.
    InternalError,
    /// The run is over.
    End(Outcome),
}

/// Classifies one `KVM_RUN` return and serves the I/O it asks for.
fn handle_exit(
    exit: std::result::Result<VcpuExit<'_>, kvm_ioctls::Error>,
    bus: &mut PortBus,
    mmio: &mut MmioBus,
    exits: &mut ExitCounters,
) -> Result<Step> {
    let step = match exit {
        Ok(VcpuExit::IoOut(port, data)) => port_step(bus.write(port, data), port, true, exits),
        Ok(VcpuExit::IoIn(port, data)) => port_step(bus.read(port, data), port, false, exits),
        Ok(VcpuExit::MmioRead(addr, data)) if !mmio.is_empty() => {
            let size = data.len();
            match mmio.read(addr, data) {
                MmioRouted::Device(a) => mmio_step(a, addr, false, size, exits),
                MmioRouted::Unclaimed => unclaimed_mmio_read(addr, data, exits),
            }
        }
        Ok(VcpuExit::MmioWrite(addr, data)) if !mmio.is_empty() => match mmio.write(addr, data) {
            MmioRouted::Device(a) => mmio_step(a, addr, true, data.len(), exits),
            MmioRouted::Unclaimed => unclaimed_mmio_write(addr, data.len(), exits),
        },
        Ok(VcpuExit::MmioRead(addr, data)) => unclaimed_mmio_read(addr, data, exits),
        Ok(VcpuExit::MmioWrite(addr, data)) => unclaimed_mmio_write(addr, data.len(), exits),
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

/// An MMIO read no device claims: all ones below 4 GiB (counted), the end of the run above.
fn unclaimed_mmio_read(addr: u64, data: &mut [u8], exits: &mut ExitCounters) -> Step {
    if addr < MMIO_GAP_END {
        data.fill(0xff);
        count_unbacked_mmio(addr, exits);
        Step::Continue
    } else {
        Step::End(Outcome::UnhandledMmio {
            addr,
            write: false,
            size: data.len(),
        })
    }
}

/// An MMIO write no device claims: dropped below 4 GiB (counted), the end of the run above.
fn unclaimed_mmio_write(addr: u64, size: usize, exits: &mut ExitCounters) -> Step {
    if addr < MMIO_GAP_END {
        count_unbacked_mmio(addr, exits);
        Step::Continue
    } else {
        Step::End(Outcome::UnhandledMmio {
            addr,
            write: true,
            size,
        })
    }
}

/// What a device's answer to an MMIO access means for the run loop: an access form the
/// device does not support ends the run naming it.
fn mmio_step(
    action: MmioAction,
    addr: u64,
    write: bool,
    size: usize,
    exits: &mut ExitCounters,
) -> Step {
    match action {
        MmioAction::Done => {
            exits.mmio_device += 1;
            Step::Continue
        }
        MmioAction::Unsupported => Step::End(Outcome::UnhandledMmio { addr, write, size }),
    }
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
        Routed::Device(DeviceAction::WaitForRecordRoom) => Step::WaitForRecordRoom,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::engine_ports::{EnginePorts, ENGINE_PORTS_BASE, ENGINE_PORTS_SPAN};
    use crate::devices::i8042::{I8042, I8042_DATA_PORT, I8042_PORT_SPAN};
    use kpin_abi::ports::{DOORBELL_PORT, ENGINE_FAILURE_PORT};

    /// The i8042 (its reset line), the engine's ports, and nothing else.
    fn bus() -> PortBus {
        let mut bus = PortBus::default();
        bus.insert(
            I8042_DATA_PORT,
            I8042_PORT_SPAN,
            Box::new(I8042::new((), ())),
        );
        bus.insert(ENGINE_PORTS_BASE, ENGINE_PORTS_SPAN, Box::new(EnginePorts));
        bus
    }

    fn step(exit: VcpuExit<'_>, exits: &mut ExitCounters) -> Step {
        handle_exit(Ok(exit), &mut bus(), &mut MmioBus::default(), exits)
            .expect("not a KVM_RUN failure")
    }

    #[test]
    fn test_device_port_accesses_continue_and_are_counted_by_direction() {
        let mut exits = ExitCounters::default();
        let mut data = [0u8; 1];
        assert_eq!(
            step(VcpuExit::IoIn(I8042_DATA_PORT + 4, &mut data), &mut exits),
            Step::Continue
        );
        assert_eq!(
            step(VcpuExit::IoOut(I8042_DATA_PORT, &[0]), &mut exits),
            Step::Continue
        );
        assert_eq!((exits.io_in, exits.io_out, exits.io_absent), (1, 1, 0));
    }

    #[test]
    fn test_absent_and_unpopulated_ports_read_all_ones_and_are_counted() {
        let mut exits = ExitCounters::default();
        // 0x80 is the POST-code port: absent, written by Linux as an I/O delay.
        assert_eq!(
            step(VcpuExit::IoOut(0x80, &[0]), &mut exits),
            Step::Continue
        );
        assert_eq!(exits.io_absent, 1);
        let mut data = [0u8; 4];
        for _ in 0..2 {
            assert_eq!(
                step(VcpuExit::IoIn(0x1234, &mut data), &mut exits),
                Step::Continue
            );
        }
        assert_eq!(data, [0xff; 4]);
        assert_eq!(
            step(VcpuExit::IoOut(0x2e, &[0x55]), &mut exits),
            Step::Continue
        );
        assert_eq!(exits.unpopulated_ports.get(&0x1234), Some(&2));
        assert_eq!(exits.unpopulated_ports.get(&0x2e), Some(&1));
        assert_eq!(exits.io_absent, 1);
    }

    #[test]
    fn test_device_actions_become_steps() {
        let mut exits = ExitCounters::default();
        // i8042 command 0xfe pulses the CPU reset line: the guest's way to power off.
        assert_eq!(
            step(VcpuExit::IoOut(I8042_DATA_PORT + 4, &[0xfe]), &mut exits),
            Step::End(Outcome::Poweroff)
        );
        assert_eq!(
            step(VcpuExit::IoOut(DOORBELL_PORT, &[0]), &mut exits),
            Step::DrainRing
        );
        assert_eq!(
            step(
                VcpuExit::IoOut(DOORBELL_PORT, &[kpin_abi::ports::DOORBELL_RECORD_ROOM]),
                &mut exits
            ),
            Step::WaitForRecordRoom
        );
        assert_eq!(
            step(VcpuExit::IoOut(ENGINE_FAILURE_PORT, &[1]), &mut exits),
            Step::End(Outcome::EngineFailure)
        );
        // The loop counts doorbells itself, after draining.
        assert_eq!((exits.io_out, exits.doorbells), (0, 0));
    }

    #[test]
    fn test_unbacked_mmio_below_4g_reads_all_ones_and_above_ends_the_run() {
        let mut exits = ExitCounters::default();
        let mut data = [0u8; 8];
        assert_eq!(
            step(VcpuExit::MmioRead(0xfed0_0010, &mut data), &mut exits),
            Step::Continue
        );
        assert_eq!(data, [0xff; 8]);
        assert_eq!(
            step(VcpuExit::MmioWrite(0xfed0_0000, &[0; 4]), &mut exits),
            Step::Continue
        );
        assert_eq!(exits.unbacked_mmio.get(&0xfed0_0000), Some(&2));
        assert_eq!(
            step(VcpuExit::MmioWrite(0x1_2000_0000, &[0; 4]), &mut exits),
            Step::End(Outcome::UnhandledMmio {
                addr: 0x1_2000_0000,
                write: true,
                size: 4
            })
        );
        // A guest touching many pages grows the map only to its cap.
        for page in 0..2 * MAX_MMIO_PAGES_COUNTED as u64 {
            step(
                VcpuExit::MmioWrite(0xd000_0000 + (page << 12), &[0]),
                &mut exits,
            );
        }
        assert_eq!(exits.unbacked_mmio.len(), MAX_MMIO_PAGES_COUNTED);
        assert_eq!(
            exits.unbacked_mmio_total,
            2 + 2 * MAX_MMIO_PAGES_COUNTED as u64
        );
    }

    /// Serves 4-byte accesses (reads 0x11), refuses others.
    struct FourBytes;
    impl crate::devices::mmio::MmioDevice for FourBytes {
        fn read(&mut self, _: u64, data: &mut [u8]) -> MmioAction {
            if data.len() != 4 {
                return MmioAction::Unsupported;
            }
            data.fill(0x11);
            MmioAction::Done
        }
        fn write(&mut self, _: u64, data: &[u8]) -> MmioAction {
            if data.len() == 4 {
                MmioAction::Done
            } else {
                MmioAction::Unsupported
            }
        }
    }

    #[test]
    fn test_mmio_devices_serve_their_window_and_an_unsupported_form_ends_the_run() {
        let mut exits = ExitCounters::default();
        let mut mmio = MmioBus::default();
        assert!(mmio.insert(0xd000_0000, 0x1000, Box::new(FourBytes)));
        let mut run = |exit: VcpuExit<'_>, exits: &mut ExitCounters| {
            handle_exit(Ok(exit), &mut bus(), &mut mmio, exits).unwrap()
        };
        let mut data = [0u8; 4];
        assert_eq!(
            run(VcpuExit::MmioRead(0xd000_0070, &mut data), &mut exits),
            Step::Continue
        );
        assert_eq!(data, [0x11; 4]);
        assert_eq!(
            run(VcpuExit::MmioWrite(0xd000_0050, &[0; 4]), &mut exits),
            Step::Continue
        );
        assert_eq!(exits.mmio_device, 2);
        // The next slot has no device: all ones, counted as unbacked.
        assert_eq!(
            run(VcpuExit::MmioRead(0xd000_1000, &mut data), &mut exits),
            Step::Continue
        );
        assert_eq!((data, exits.unbacked_mmio_total), ([0xff; 4], 1));
        assert_eq!(
            run(VcpuExit::MmioWrite(0xd000_0050, &[0; 8]), &mut exits),
            Step::End(Outcome::UnhandledMmio {
                addr: 0xd000_0050,
                write: true,
                size: 8
            })
        );
    }

    #[test]
    fn test_machine_exits_become_outcomes() {
        let mut exits = ExitCounters::default();
        assert_eq!(
            step(VcpuExit::Shutdown, &mut exits),
            Step::End(Outcome::TripleFault)
        );
        assert_eq!(
            step(VcpuExit::InternalError, &mut exits),
            Step::InternalError
        );
        assert_eq!(
            step(VcpuExit::FailEntry(0x21, 0), &mut exits),
            Step::End(Outcome::FailEntry { reason: 0x21 })
        );
        for kind in [SYSTEM_EVENT_SHUTDOWN, SYSTEM_EVENT_RESET] {
            assert_eq!(
                step(VcpuExit::SystemEvent(kind, &[]), &mut exits),
                Step::End(Outcome::Poweroff)
            );
        }
        // KVM_SYSTEM_EVENT_CRASH is not a poweroff.
        assert!(matches!(
            step(VcpuExit::SystemEvent(3, &[]), &mut exits),
            Step::End(Outcome::UnexpectedExit(_))
        ));
        assert_eq!(
            step(VcpuExit::Hlt, &mut exits),
            Step::End(Outcome::UnexpectedExit("Hlt".into()))
        );
    }

    #[test]
    fn test_signals_continue_and_other_kvm_run_errors_are_host_errors() {
        let mut exits = ExitCounters::default();
        assert_eq!(step(VcpuExit::Intr, &mut exits), Step::Continue);
        for errno in [libc::EINTR, libc::EAGAIN] {
            let s = handle_exit(
                Err(kvm_ioctls::Error::new(errno)),
                &mut bus(),
                &mut MmioBus::default(),
                &mut exits,
            );
            assert_eq!(s.expect("a signal is not an error"), Step::Continue);
        }
        assert_eq!(exits.interrupted, 3);
        let e = handle_exit(
            Err(kvm_ioctls::Error::new(libc::EFAULT)),
            &mut bus(),
            &mut MmioBus::default(),
            &mut exits,
        );
        assert!(matches!(e, Err(VmmError::Kvm("KVM_RUN", _))), "{e:?}");
    }
}
