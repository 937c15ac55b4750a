//! The vCPU loop's side of the control channel: instrumentation windows. Between two
//! `KVM_RUN`s the loop hands each pending [`Command`] to [`Windows::poll`], which answers
//! `status`, opens windows (`attach`) and closes them (`detach`).
//!
//! How the guest runs ([`State`]): natively, attached (a window with a tool), or resident
//! (under the engine with no instrumentation: tool `null`, a clean code cache). Which
//! way a detach goes is a rule, not a probe: a window opened on a guest that was running
//! natively hands the guest back to native execution (the guest ran natively before, so
//! it can again: the mini-kernel, or any guest on a host whose KVM runs guest ring 0
//! natively); a run that started under the engine (`kpin run --tool` or `--resident`,
//! which is how Linux runs on this nested KVM, where attaching to a natively booted Linux
//! fails: see docs/ARCHITECTURE.md) stays resident.
//!
//! Attach on a natively running guest happens at a safe point between guest instructions:
//! the vCPU is first run once with `immediate_exit` set, so KVM completes any port or
//! MMIO read the last exit left pending (which would otherwise land in the engine's
//! registers) and returns before entering the guest; then [`engine::enter::enter`] loads
//! the engine, captures the complete vCPU state into the attach block and points the vCPU
//! at the engine, exactly as at boot.
//!
//! Everything else is served by the running engine at its next safe point (a trace
//! boundary, no interrupt waiting): the loop posts the request in the attach control area
//! ([`engine::detach`]), sets the engine's attention bit, wakes a halted vCPU, and keeps
//! the client's reply until the engine writes the request's code to
//! [`DETACH_PORT`](kpin_abi::ports::DETACH_PORT). Then it drains the ring (the window's
//! files land in its directory), moves the output directory, and for a detach to native
//! loads the handed-back state into the vCPU.
//!
//! Window `n` (from 1) writes its tool files to `<out>/attach-<n>/`; a run started with
//! `--tool` is window 0, writing to `<out>/` as before; engine log lines outside windows
//! go to `<out>/engine.log`.

use std::cell::Cell;
use std::path::PathBuf;
use std::rc::Rc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use host_daemon::Daemon;
use kpin_abi::attach::KernelTypes;
use kpin_abi::attach_control::{
    Control, MAGIC, REQ_DETACH_NATIVE, REQ_DETACH_RESIDENT, REQ_NONE, REQ_SWITCH, REQ_TAKEN,
};
use kpin_abi::io_ring::Consumer;
use kpin_abi::output::ENGINE_COUNTERS;
use kvm_bindings::{kvm_xcrs, CpuId};
use kvm_ioctls::VcpuFd;

use super::progress::{judge_progress, Sample, PROGRESS_SAMPLE};
use super::protocol::{options_string, Reply, Request};
use super::server::Command;
use crate::devices::bus::{DeviceAction, PortDevice};
use crate::engine::{self, detach, EngineConfig};
use crate::error::{Result, VmmError};
use crate::vstate::memory::VmMemory;
use crate::vstate::vcpu::ExitCounters;

/// The largest `counters.json` a status reply includes (replies are bounded by
/// [`super::protocol::MAX_MESSAGE_BYTES`]; the engine's is a few KiB).
const MAX_STATUS_COUNTERS_BYTES: u64 = 32 * 1024;
/// A request the engine has not taken after this many exits is withdrawn. The engine
/// takes a request at its first trace boundary with no interrupt waiting for the guest;
/// posting sets its attention bit, so that is the next trace entry unless the guest runs
/// with interrupts disabled while one waits.
pub const PENDING_MAX_EXITS: u64 = 20_000;
/// ... or after this long (a guest spinning with interrupts disabled may make no exits at
/// all). Below the control server's wait for the loop, so the client gets this answer.
pub const PENDING_MAX_WAIT: Duration = Duration::from_secs(20);

/// How the guest runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum State {
    /// Natively; the engine is not loaded (or no longer used).
    Native,
    /// Under the engine with a window open.
    Attached {
        /// The window's tool.
        tool: String,
        /// Detach hands the guest back to native execution (else: resident).
        to_native: bool,
    },
    /// Under the engine with no instrumentation.
    Resident,
}

impl State {
    fn name(&self) -> &'static str {
        match self {
            State::Native => "native",
            State::Attached { .. } => "attached",
            State::Resident => "resident",
        }
    }
}

/// A request the engine has yet to serve.
struct Pending {
    request: u32,
    reply: Sender<Reply>,
    t0: Instant,
    /// `KVM_RUN` returns when it was posted.
    exits0: u64,
    /// For [`REQ_SWITCH`]: the new window's directory and tool.
    window: Option<(PathBuf, String)>,
}

/// What the run needs to open windows, and where it stands.
pub struct Windows {
    commands: Receiver<Command>,
    /// The engine image, if this run can attach (`None`: it could not be built).
    image: Option<PathBuf>,
    /// The run's output directory.
    out_dir: PathBuf,
    state: State,
    /// Windows opened so far (a `--tool` run's boot window counts).
    count: u64,
    /// 1 if the run started with a window (`--tool`: window 0, in `<out>/`), else 0:
    /// window `count + 1 - boot_window` is the next `attach-<n>/`.
    boot_window: u64,
    /// The open or last window's output directory.
    window_dir: PathBuf,
    start: Instant,
    /// What the attach-status port reads.
    status: Rc<Cell<WindowStatus>>,
    /// Writes to the attach-status port.
    marks: Rc<Cell<u64>>,
    /// The last code written to the detach port, not yet handled.
    acks: Rc<Cell<Option<u32>>>,
    pending: Option<Pending>,
    /// Guest instructions of engine instances that have ended (detached to native).
    insns_before: u64,
    /// The guest's XCRs at the last attach from native execution.
    xcrs: Option<kvm_xcrs>,
    /// The last two progress samples (older, newer).
    samples: [Option<Sample>; 2],
    /// The guest's kernel, whose BTF names a native attach's processes
    /// (`docs/processes.md`), and what was read from it (at the first native attach).
    kernel: Option<PathBuf>,
    kernel_types: Option<KernelTypes>,
}

impl Windows {
    /// Windows for a run writing to `out_dir`; `boot_tool` is the `--tool` the run
    /// started with, if any; `resident`: the run started under the engine with no window.
    pub fn new(
        commands: Receiver<Command>,
        image: Option<PathBuf>,
        out_dir: PathBuf,
        boot_tool: Option<String>,
        resident: bool,
    ) -> Self {
        let state = match boot_tool {
            Some(tool) => State::Attached {
                tool,
                to_native: false,
            },
            None if resident => State::Resident,
            None => State::Native,
        };
        Windows {
            commands,
            image,
            window_dir: out_dir.clone(),
            out_dir,
            count: u64::from(matches!(state, State::Attached { .. })),
            boot_window: u64::from(matches!(state, State::Attached { .. })),
            status: Rc::new(Cell::new(if matches!(state, State::Attached { .. }) {
                WindowStatus::default().opened()
            } else {
                WindowStatus::default()
            })),
            state,
            start: Instant::now(),
            marks: Rc::new(Cell::new(0)),
            acks: Rc::new(Cell::new(None)),
            pending: None,
            insns_before: 0,
            xcrs: None,
            samples: [None, None],
            kernel: None,
            kernel_types: None,
        }
    }

    /// The device for the attach-status port, sharing this run's window status.
    pub fn status_port(&self) -> AttachStatus {
        AttachStatus {
            status: self.status.clone(),
            marks: self.marks.clone(),
        }
    }

    /// The device for the engine's detach port.
    pub fn detach_port(&self) -> DetachPort {
        DetachPort(self.acks.clone())
    }

    /// Handles the engine's acknowledgement, then answers every pending command. An
    /// `Err` is a host failure that ends the run.
    #[allow(clippy::too_many_arguments)]
    pub fn poll(
        &mut self,
        vcpu: &mut VcpuFd,
        mem: &VmMemory,
        cpuid: &CpuId,
        daemon: &mut Daemon,
        ring: &mut Consumer,
        exits: &ExitCounters,
    ) -> Result<()> {
        if let Some(code) = self.acks.take() {
            self.on_ack(code, vcpu, mem, daemon, ring)?;
        }
        self.withdraw_overdue(mem, exits)?;
        self.sample(mem, exits)?;
        while let Ok(cmd) = self.commands.try_recv() {
            if let (Some(p), false) = (&self.pending, cmd.request == Request::Status) {
                let what = if p.request == REQ_SWITCH {
                    "an attach"
                } else {
                    "a detach"
                };
                let _ = cmd.reply.send(Reply::error(format!(
                    "busy: {what} is waiting for the engine's next safe point"
                )));
                continue;
            }
            let reply = match cmd.request {
                Request::Status => Some(self.status(mem, exits)),
                Request::Detach => self.detach(vcpu, mem, &cmd.reply, exits)?,
                Request::Attach { tool, options } => {
                    let options = options_string(&options);
                    let request = (tool.as_str(), options.as_str(), &cmd.reply);
                    self.attach(vcpu, mem, cpuid, daemon, ring, request, exits)?
                }
            };
            if let Some(r) = reply {
                let _ = cmd.reply.send(r);
            }
        }
        Ok(())
    }

    /// Guest instructions executed under the engine so far (native ones are not counted),
    /// as the engine last published them.
    fn guest_insns(&self, mem: &VmMemory) -> u64 {
        let live = match self.state {
            State::Native => 0,
            _ => detach::read_control(mem)
                .ok()
                .filter(|c| c.magic == MAGIC)
                .map_or(0, |c| c.guest_insns),
        };
        self.insns_before + live
    }

    /// Every [`PROGRESS_SAMPLE`], records a sample and nudges the engine so that its
    /// next one is current.
    fn sample(&mut self, mem: &VmMemory, exits: &ExitCounters) -> Result<()> {
        let now = Instant::now();
        if let Some(s) = &self.samples[1] {
            if now.duration_since(s.at) < PROGRESS_SAMPLE {
                return Ok(());
            }
        }
        let sample = Sample {
            at: now,
            exits: exits.total,
            insns: (self.state != State::Native).then(|| self.guest_insns(mem)),
        };
        self.samples = [self.samples[1], Some(sample)];
        if self.state != State::Native {
            detach::nudge(mem)?;
        }
        Ok(())
    }

    fn status(&self, mem: &VmMemory, exits: &ExitCounters) -> Reply {
        // The engine writes the file through the ring; one too big for a reply is left out.
        let path = self.window_dir.join(ENGINE_COUNTERS);
        let counters = std::fs::metadata(&path)
            .is_ok_and(|m| m.len() <= MAX_STATUS_COUNTERS_BYTES)
            .then(|| std::fs::read_to_string(&path).ok())
            .flatten()
            .and_then(|t| serde_json::from_str(&t).ok());
        // Nudged at the last sample: the engine's count is at most a sample old.
        let (progress, why) = judge_progress(self.samples[0], self.samples[1]);
        let tool = match &self.state {
            State::Attached { tool, .. } => Some(tool.clone()),
            _ => None,
        };
        Reply {
            attached: Some(tool.is_some()),
            tool,
            state: Some(self.state.name().to_owned()),
            engine_resident: Some(self.state != State::Native),
            windows: Some(self.count),
            window_dir: (self.count > 0).then(|| self.window_dir.display().to_string()),
            uptime_s: Some(self.start.elapsed().as_secs_f64()),
            exits: Some(exits.total),
            guest_instructions: Some(self.guest_insns(mem)),
            guest_marks: Some(self.marks.get()),
            progress: Some(progress.name().to_owned()),
            progress_reason: Some(why),
            engine_counters: counters,
            ..Reply::ok()
        }
    }

    /// Posts `request` to the engine and keeps the reply until it is served.
    #[allow(clippy::too_many_arguments)]
    fn post(
        &mut self,
        vcpu: &VcpuFd,
        mem: &VmMemory,
        control: Control,
        request: u32,
        reply: &Sender<Reply>,
        window: Option<(PathBuf, String)>,
        exits: &ExitCounters,
    ) -> Result<Option<Reply>> {
        let t0 = Instant::now();
        if !detach::post(mem, control, request)? {
            return Ok(Some(Reply::error(
                "the engine has no control area (it cannot be asked to detach)",
            )));
        }
        detach::wake(vcpu)?;
        self.pending = Some(Pending {
            request,
            reply: reply.clone(),
            t0,
            exits0: exits.total,
            window,
        });
        Ok(None)
    }

    /// Withdraws a pending request the engine has not taken within [`PENDING_MAX_EXITS`]
    /// exits or [`PENDING_MAX_WAIT`]: the client is told why, and nothing changed.
    fn withdraw_overdue(&mut self, mem: &VmMemory, exits: &ExitCounters) -> Result<()> {
        let Some(p) = &self.pending else {
            return Ok(());
        };
        let (n, waited) = (exits.total.saturating_sub(p.exits0), p.t0.elapsed());
        if n < PENDING_MAX_EXITS && waited < PENDING_MAX_WAIT {
            return Ok(());
        }
        let mut c = detach::read_control(mem)?;
        if c.request & REQ_TAKEN != 0 || c.request != p.request {
            // Being served (its files are on their way): the ack ends it.
            return Ok(());
        }
        c.request = REQ_NONE;
        detach::write_control(mem, &c)?;
        let p = self.pending.take().expect("checked above");
        if let Some((dir, _)) = &p.window {
            // Empty: the next attach may use its name.
            let _ = std::fs::remove_dir(dir);
        }
        let _ = p.reply.send(Reply::error(format!(
            "the engine reached no safe point within {n} exits and {:.1} s (an interrupt \
             waited while the guest ran with interrupts disabled); the request was \
             withdrawn and the guest runs as before",
            waited.as_secs_f64()
        )));
        Ok(())
    }

    fn detach(
        &mut self,
        vcpu: &VcpuFd,
        mem: &VmMemory,
        reply: &Sender<Reply>,
        exits: &ExitCounters,
    ) -> Result<Option<Reply>> {
        let to_native = match &self.state {
            State::Native => return Ok(Some(Reply::error("not attached"))),
            State::Resident => {
                return Ok(Some(Reply::error(
                    "not attached (the engine is resident with no instrumentation)",
                )))
            }
            State::Attached { to_native, .. } => *to_native,
        };
        let req = if to_native {
            REQ_DETACH_NATIVE
        } else {
            REQ_DETACH_RESIDENT
        };
        let control = detach::read_control(mem)?;
        self.post(vcpu, mem, control, req, reply, None, exits)
    }

    #[allow(clippy::too_many_arguments)]
    fn attach(
        &mut self,
        vcpu: &mut VcpuFd,
        mem: &VmMemory,
        cpuid: &CpuId,
        daemon: &mut Daemon,
        ring: &mut Consumer,
        (tool, options, reply): (&str, &str, &Sender<Reply>),
        exits: &ExitCounters,
    ) -> Result<Option<Reply>> {
        if let State::Attached { tool: t, .. } = &self.state {
            return Ok(Some(Reply::error(format!(
                "already attached (tool {t}); detach first"
            ))));
        }
        let n = self.count + 1 - self.boot_window;
        let dir = self.out_dir.join(format!("attach-{n}"));
        if self.state == State::Resident {
            let mut control = detach::read_control(mem)?;
            if !control.set_tool(tool.as_bytes(), options.as_bytes()) {
                return Ok(Some(Reply::error("tool name or options too long")));
            }
            if let Err(e) = std::fs::create_dir(&dir) {
                return Ok(Some(Reply::error(format!(
                    "cannot create {}: {e}",
                    dir.display()
                ))));
            }
            let window = Some((dir.clone(), tool.to_owned()));
            let r = self.post(vcpu, mem, control, REQ_SWITCH, reply, window, exits);
            if !matches!(r, Ok(None)) {
                // Not posted: the next attach may use the (empty) directory's name.
                let _ = std::fs::remove_dir(&dir);
            }
            return r;
        }
        self.attach_native(vcpu, mem, cpuid, daemon, ring, tool, options, dir)
            .map(Some)
    }

    /// The windows' engines name processes from `kernel`'s BTF (a window's engine started
    /// from native execution; a resident engine keeps the types of the run's start).
    pub fn with_kernel(mut self, kernel: Option<PathBuf>) -> Self {
        self.kernel = kernel;
        self
    }

    /// Where the kernel keeps its running task, read from its BTF once, at the first
    /// native attach (`KernelTypes::UNKNOWN`, said once, if it cannot be read: the
    /// window's processes are then by address space).
    fn kernel_types(&mut self) -> KernelTypes {
        *self.kernel_types.get_or_insert_with(|| {
            let Some(kernel) = &self.kernel else {
                return KernelTypes::UNKNOWN;
            };
            match crate::diag::kernel_types::from_kernel(kernel) {
                Ok((types, _)) => types,
                Err(why) => {
                    eprintln!(
                        "kpin: warning: windows report processes by address space (CR3): {why}"
                    );
                    KernelTypes::UNKNOWN
                }
            }
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn attach_native(
        &mut self,
        vcpu: &mut VcpuFd,
        mem: &VmMemory,
        cpuid: &CpuId,
        daemon: &mut Daemon,
        ring: &mut Consumer,
        tool: &str,
        options: &str,
        dir: PathBuf,
    ) -> Result<Reply> {
        let t0 = Instant::now();
        let Some(image) = self.image.clone() else {
            return Ok(Reply::error(
                "this run cannot attach: the engine image was not available at start",
            ));
        };
        if let Err(e) = std::fs::create_dir(&dir) {
            return Ok(Reply::error(format!(
                "cannot create {}: {e}",
                dir.display()
            )));
        }
        complete_pending_io(vcpu)?;
        // Everything published so far belongs to the previous output directory.
        daemon.serve(ring).map_err(VmmError::Daemon)?;
        daemon.set_out_dir(&dir);
        // The engine never changes XCR0 (`xsetbv` is #UD under it): kept for detach.
        self.xcrs = vcpu.get_xcrs().ok();
        let cfg = EngineConfig {
            image,
            tool: tool.to_owned(),
            options: options.to_owned(),
            // Windows simulate in the engine: the record ring serves the boot tool only.
            host_sim: false,
            kernel_types: crate::diag::kernel_types::Pending::ready(self.kernel_types()),
        };
        match engine::enter::enter(vcpu, mem, cpuid, &cfg) {
            Ok(_) => {}
            // Nothing of the vCPU changes before the attach block is written, so a bad
            // tool name or option leaves the guest running natively.
            Err(e @ (VmmError::ToolName(..) | VmmError::ToolOptions(_))) => {
                daemon.set_out_dir(&self.out_dir);
                // Empty: the next attach may use its name.
                let _ = std::fs::remove_dir(&dir);
                return Ok(Reply::error(e.to_string()));
            }
            Err(e) => return Err(e),
        }
        self.count += 1;
        self.state = State::Attached {
            tool: tool.to_owned(),
            to_native: true,
        };
        self.status.set(self.status.get().opened());
        self.window_dir = dir;
        Ok(Reply {
            attached: Some(true),
            tool: Some(tool.to_owned()),
            state: Some(self.state.name().to_owned()),
            windows: Some(self.count),
            window_dir: Some(self.window_dir.display().to_string()),
            latency_ms: Some(t0.elapsed().as_secs_f64() * 1e3),
            ..Reply::ok()
        })
    }

    /// The engine served request `code` (it wrote the code to the detach port).
    fn on_ack(
        &mut self,
        code: u32,
        vcpu: &mut VcpuFd,
        mem: &VmMemory,
        daemon: &mut Daemon,
        ring: &mut Consumer,
    ) -> Result<()> {
        let pending = self.pending.take();
        let pending = match pending {
            Some(p) if p.request == code => Some(p),
            other => {
                // An acknowledgement nobody asked for: the guest wrote the port itself.
                self.pending = other;
                return Ok(());
            }
        };
        // The window's last files and log lines go to its directory.
        daemon.serve(ring).map_err(VmmError::Daemon)?;
        match code {
            REQ_DETACH_NATIVE => {
                complete_pending_io(vcpu)?;
                let c = detach::read_control(mem)?;
                detach::restore(vcpu, &c, self.xcrs.as_ref())?;
                self.insns_before += c.guest_insns;
                self.state = State::Native;
                self.status.set(self.status.get().closed());
                daemon.set_out_dir(&self.out_dir);
            }
            REQ_DETACH_RESIDENT => {
                self.state = State::Resident;
                self.status.set(self.status.get().closed());
                daemon.set_out_dir(&self.out_dir);
            }
            _ => {
                if let Some((dir, tool)) = pending.as_ref().and_then(|p| p.window.clone()) {
                    daemon.set_out_dir(&dir);
                    self.count += 1;
                    self.window_dir = dir;
                    self.state = State::Attached {
                        tool,
                        to_native: false,
                    };
                    self.status.set(self.status.get().opened());
                }
            }
        }
        if let Some(p) = pending {
            let tool = match &self.state {
                State::Attached { tool, .. } => Some(tool.clone()),
                _ => None,
            };
            let _ = p.reply.send(Reply {
                attached: Some(tool.is_some()),
                tool,
                state: Some(self.state.name().to_owned()),
                windows: Some(self.count),
                window_dir: Some(self.window_dir.display().to_string()),
                latency_ms: Some(p.t0.elapsed().as_secs_f64() * 1e3),
                ..Reply::ok()
            });
        }
        Ok(())
    }
}

/// Runs the vCPU once with `immediate_exit` set: KVM completes the port or MMIO access
/// the last exit left pending and returns before running guest code, so the vCPU's
/// state can be replaced.
fn complete_pending_io(vcpu: &mut VcpuFd) -> Result<()> {
    vcpu.set_kvm_immediate_exit(1);
    let done = vcpu.run().map(|_| ());
    vcpu.set_kvm_immediate_exit(0);
    match done {
        Err(e) if e.errno() != libc::EINTR => Err(VmmError::Kvm("KVM_RUN", e)),
        _ => Ok(()),
    }
}

/// The engine's detach port ([`DETACH_PORT`](kpin_abi::ports::DETACH_PORT)): records the
/// request code the engine served, for [`Windows::poll`] before the next `KVM_RUN`.
pub struct DetachPort(pub Rc<Cell<Option<u32>>>);

impl PortDevice for DetachPort {
    fn read(&mut self, _offset: u16, data: &mut [u8]) {
        data.fill(0);
    }

    fn write(&mut self, _offset: u16, data: &[u8]) -> DeviceAction {
        let mut v = [0u8; 4];
        let n = data.len().min(4);
        v[..n].copy_from_slice(&data[..n]);
        self.0.set(Some(u32::from_le_bytes(v)));
        DeviceAction::None
    }
}

/// Whether a window is open, and how many have opened: what the attach-status port
/// reads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WindowStatus {
    /// A window is open.
    pub open: bool,
    /// Windows opened so far in this run.
    pub opened: u64,
}

impl WindowStatus {
    /// A new window opened.
    #[must_use]
    pub fn opened(self) -> Self {
        WindowStatus {
            open: true,
            opened: self.opened + 1,
        }
    }

    /// The open window closed.
    #[must_use]
    pub fn closed(self) -> Self {
        WindowStatus {
            open: false,
            ..self
        }
    }

    /// The byte the port reads: bit 0 whether a window is open, bits 1-7 the number of
    /// windows opened so far, modulo 128. The count is what makes the handshake safe: a
    /// guest that waits for "closed" after its window would never see a detach followed
    /// by an attach that both land before it next reads the port (a busy host delays
    /// the guest, not the client), but it sees the count change.
    pub fn port_byte(self) -> u8 {
        u8::from(self.open) | ((self.opened % 128) as u8) << 1
    }
}

/// The port [`ATTACH_STATUS_PORT`](kpin_abi::ports::ATTACH_STATUS_PORT): reads a
/// [`WindowStatus::port_byte`]; each write counts as one guest mark (`status`'s
/// `guest_marks`: a test guest says how far it got).
pub struct AttachStatus {
    /// The run's window status.
    pub status: Rc<Cell<WindowStatus>>,
    /// Writes so far.
    pub marks: Rc<Cell<u64>>,
}

impl PortDevice for AttachStatus {
    fn read(&mut self, _offset: u16, data: &mut [u8]) {
        data.fill(0);
        if let Some(b) = data.first_mut() {
            *b = self.status.get().port_byte();
        }
    }

    fn write(&mut self, _offset: u16, _data: &[u8]) -> DeviceAction {
        self.marks.set(self.marks.get() + 1);
        DeviceAction::None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_attach_status_port_reads_open_and_windows_opened_and_counts_marks() {
        let status = Rc::new(Cell::new(WindowStatus::default()));
        let marks = Rc::new(Cell::new(0));
        let mut dev = AttachStatus {
            status: status.clone(),
            marks: marks.clone(),
        };
        let mut b = [0xffu8; 2];
        dev.read(0, &mut b);
        assert_eq!(b, [0, 0]);
        status.set(status.get().opened());
        dev.read(0, &mut b);
        assert_eq!(b, [0b11, 0]);
        // A detach and an attach between two reads: still open, but the count moved on.
        status.set(status.get().closed().opened());
        dev.read(0, &mut b);
        assert_eq!(b, [0b101, 0]);
        status.set(status.get().closed());
        dev.read(0, &mut b);
        assert_eq!(b, [0b100, 0]);
        // The count wraps in 7 bits.
        let many = WindowStatus {
            open: true,
            opened: 129,
        };
        assert_eq!(many.port_byte(), 0b11);
        assert_eq!(dev.write(0, &[1]), DeviceAction::None);
        assert_eq!(marks.get(), 1);
    }

    #[test]
    fn test_detach_port_records_the_code() {
        let acks = Rc::new(Cell::new(None));
        let mut dev = DetachPort(acks.clone());
        assert_eq!(dev.write(0, &[REQ_SWITCH as u8]), DeviceAction::None);
        assert_eq!(acks.take(), Some(REQ_SWITCH));
        assert_eq!(acks.take(), None);
    }
}
