//! The vCPU loop's side of the control channel: instrumentation windows. Between two
//! `KVM_RUN`s the loop hands each pending [`Command`] to [`Windows::poll`], which answers
//! `status`, and for `attach` enters the engine with the vCPU's current state.
//!
//! Attach on a natively running guest happens at a safe point between guest instructions:
//! the vCPU is first run once with `immediate_exit` set, so KVM completes any port or
//! MMIO read the last exit left pending (which would otherwise land in the engine's
//! registers) and returns before entering the guest; then [`engine::enter::enter`] loads
//! the engine, captures the complete vCPU state (registers, segment and control registers,
//! pending events, MSRs, CPUID) into the attach block and points the vCPU at the engine,
//! exactly as at boot. Window `n` (from 1) writes its tool files to `<out>/attach-<n>/`; a
//! run started with `--tool` is window 0, writing to `<out>/` as before.
//!
//! Detach is not implemented yet: the engine cannot hand the vCPU back, so a `detach`
//! request gets an error saying so and the window lasts until the end of the run.

use std::cell::Cell;
use std::path::PathBuf;
use std::rc::Rc;
use std::time::Instant;

use crossbeam_channel::Receiver;
use host_daemon::Daemon;
use kpin_abi::io_ring::Consumer;
use kvm_bindings::CpuId;
use kvm_ioctls::VcpuFd;

use super::protocol::{options_string, Reply, Request};
use super::server::Command;
use crate::devices::bus::{DeviceAction, PortDevice};
use crate::engine::{self, EngineConfig};
use crate::error::{Result, VmmError};
use crate::vstate::memory::GuestMemory;
use crate::vstate::vcpu::ExitCounters;

/// The file the engine writes its counters to.
const ENGINE_COUNTERS: &str = "counters.json";

/// What the run needs to open windows, and where it stands.
pub struct Windows {
    commands: Receiver<Command>,
    /// The engine image, if this run can attach (`None`: it could not be built).
    image: Option<PathBuf>,
    /// The run's output directory.
    out_dir: PathBuf,
    /// The open window's tool.
    attached: Option<String>,
    /// Whether the engine is loaded in the stolen region.
    resident: bool,
    /// Windows opened so far (a `--tool` run's boot window counts).
    count: u64,
    /// The open or last window's output directory.
    window_dir: PathBuf,
    start: Instant,
    /// What the attach-status port reads.
    open: Rc<Cell<bool>>,
}

impl Windows {
    /// Windows for a run writing to `out_dir`; `boot_tool` is the `--tool` the run
    /// started with, if any.
    pub fn new(
        commands: Receiver<Command>,
        image: Option<PathBuf>,
        out_dir: PathBuf,
        boot_tool: Option<String>,
    ) -> Self {
        Windows {
            commands,
            image,
            window_dir: out_dir.clone(),
            out_dir,
            resident: boot_tool.is_some(),
            count: u64::from(boot_tool.is_some()),
            open: Rc::new(Cell::new(boot_tool.is_some())),
            attached: boot_tool,
            start: Instant::now(),
        }
    }

    /// The device for the attach-status port, sharing this run's flag.
    pub fn status_port(&self) -> AttachStatus {
        AttachStatus(self.open.clone())
    }

    /// Answers every pending command. An `Err` is a host failure that ends the run.
    pub fn poll(
        &mut self,
        vcpu: &mut VcpuFd,
        mem: &GuestMemory,
        cpuid: &CpuId,
        daemon: &mut Daemon,
        ring: &mut Consumer,
        exits: &ExitCounters,
    ) -> Result<()> {
        while let Ok(cmd) = self.commands.try_recv() {
            let reply = match cmd.request {
                Request::Status => self.status(exits),
                Request::Detach => match &self.attached {
                    None => Reply::error("not attached"),
                    Some(tool) => Reply::error(format!(
                        "detach is not implemented yet: the engine (tool {tool}) stays \
                         attached until the run ends"
                    )),
                },
                Request::Attach { tool, options } => {
                    let options = options_string(&options);
                    self.attach(vcpu, mem, cpuid, daemon, ring, &tool, &options)?
                }
            };
            let _ = cmd.reply.send(reply);
        }
        Ok(())
    }

    fn status(&self, exits: &ExitCounters) -> Reply {
        let counters = std::fs::read_to_string(self.window_dir.join(ENGINE_COUNTERS))
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok());
        Reply {
            attached: Some(self.attached.is_some()),
            tool: self.attached.clone(),
            engine_resident: Some(self.resident),
            windows: Some(self.count),
            window_dir: (self.count > 0).then(|| self.window_dir.display().to_string()),
            uptime_s: Some(self.start.elapsed().as_secs_f64()),
            exits: Some(exits.total),
            engine_counters: counters,
            ..Reply::ok()
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn attach(
        &mut self,
        vcpu: &mut VcpuFd,
        mem: &GuestMemory,
        cpuid: &CpuId,
        daemon: &mut Daemon,
        ring: &mut Consumer,
        tool: &str,
        options: &str,
    ) -> Result<Reply> {
        let t0 = Instant::now();
        if let Some(t) = &self.attached {
            return Ok(Reply::error(format!(
                "already attached (tool {t}); detach first"
            )));
        }
        if self.resident {
            return Ok(Reply::error(
                "the engine is resident but detached; switching tools is not implemented yet",
            ));
        }
        let Some(image) = self.image.clone() else {
            return Ok(Reply::error(
                "this run cannot attach: the engine image was not available at start",
            ));
        };
        let dir = self.out_dir.join(format!("attach-{}", self.count + 1));
        if let Err(e) = std::fs::create_dir(&dir) {
            return Ok(Reply::error(format!(
                "cannot create {}: {e}",
                dir.display()
            )));
        }
        // A safe point: complete whatever the last exit left pending, without running
        // guest code.
        vcpu.set_kvm_immediate_exit(1);
        let done = vcpu.run().map(|_| ());
        vcpu.set_kvm_immediate_exit(0);
        match done {
            Err(e) if e.errno() != libc::EINTR => return Err(VmmError::Kvm("KVM_RUN", e)),
            _ => {}
        }
        // Everything published so far belongs to the previous output directory.
        daemon.serve(ring).map_err(VmmError::Daemon)?;
        daemon.set_out_dir(&dir);
        let cfg = EngineConfig {
            image,
            tool: tool.to_owned(),
            options: options.to_owned(),
        };
        match engine::enter::enter(vcpu, mem, cpuid, &cfg) {
            Ok(_) => {}
            // Nothing of the vCPU changes before the attach block is written, so a bad
            // tool name or option leaves the guest running natively.
            Err(e @ (VmmError::ToolName(..) | VmmError::ToolOptions(_))) => {
                return Ok(Reply::error(e.to_string()))
            }
            Err(e) => return Err(e),
        }
        self.count += 1;
        self.resident = true;
        self.attached = Some(tool.to_owned());
        self.open.set(true);
        self.window_dir = dir;
        Ok(Reply {
            attached: Some(true),
            tool: Some(tool.to_owned()),
            windows: Some(self.count),
            window_dir: Some(self.window_dir.display().to_string()),
            latency_ms: Some(t0.elapsed().as_secs_f64() * 1e3),
            ..Reply::ok()
        })
    }
}

/// The port [`ATTACH_STATUS_PORT`](kpin_abi::ports::ATTACH_STATUS_PORT): reads 1 while a
/// window is open.
pub struct AttachStatus(pub Rc<Cell<bool>>);

impl PortDevice for AttachStatus {
    fn read(&mut self, _offset: u16, data: &mut [u8]) {
        data.fill(0);
        if let Some(b) = data.first_mut() {
            *b = u8::from(self.0.get());
        }
    }

    fn write(&mut self, _offset: u16, _data: &[u8]) -> DeviceAction {
        DeviceAction::None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_attach_status_port_reads_the_flag() {
        let flag = Rc::new(Cell::new(false));
        let mut dev = AttachStatus(flag.clone());
        let mut b = [0xffu8; 2];
        dev.read(0, &mut b);
        assert_eq!(b, [0, 0]);
        flag.set(true);
        dev.read(0, &mut b);
        assert_eq!(b, [1, 0]);
    }
}
