//! The run loop proper: [`RunLoop`] holds what every turn of it needs (the translator,
//! the virtual CPU, the shadow MMU, the tool, the fault-progress tracker, the start time
//! and the guest-memory view), and each turn is named steps — [`RunLoop::turn`] before a
//! run of the translator, then one handler per kind of stop. A handler that cannot go on
//! logs why and returns [`GiveUp`]; the loop then ends the run in one place,
//! [`RunLoop::give_up`].

use alloc::string::String;
use core::cell::RefCell;
use core::fmt::Write;
use core::ops::ControlFlow;

use guest_engine::instrument::SegBase;
use guest_engine::platform::SensitiveInsn;
use guest_engine::profile as prof;
use guest_engine::vcpu::{Event, TripleFault, VcpuStop};
use guest_engine::{Engine, GuestRegs, GuestVirt, Platform, Stop};
use kpin_abi::attach::AttachBlock;
use kpin_abi::x86::vector::UD as VEC_UD;

use crate::events::{irq, timer};
use crate::log;
use crate::mm::guest_memory::ShadowedMemory;
use crate::mm::shadow::Shadow;
use crate::ring0::layout::VEC_PF;
use crate::ring0::log;
use crate::ring0::log::fail;
use crate::ring0::{entry, gate};
use crate::run::cache_page_fault::{self, Action};
use crate::run::error::RunError;
use crate::run::tools::Chosen;
use crate::run::vcpu::{Ring0, ShadowPort, Vcpu};
use crate::run::{
    arm_fault_redirect, deliver_at, detach, guest_dump, profile, reflect_guest_fault, report,
    tell_translator,
};

/// The run cannot go on: the reason is logged, the guest's state and the report follow
/// ([`RunLoop::give_up`]).
pub(super) struct GiveUp;

/// Logs `why` as the reason the run ends.
fn logged(why: RunError) -> GiveUp {
    log!(Error, "engine: {why}");
    GiveUp
}

/// The guest state an instruction run in a stepping mode began with.
struct StepStart {
    /// The virtual TF.
    tf: bool,
    /// The registers.
    regs: GuestRegs,
    /// Its address.
    pc: u64,
}

/// Everything a turn of the run loop works on.
pub(super) struct RunLoop<'a> {
    engine: Engine,
    vcpu: Vcpu<'a>,
    shadow: &'a RefCell<Shadow>,
    tool: Chosen,
    /// The last fault handled, to stop on one that keeps coming back.
    progress: cache_page_fault::Progress,
    /// TSC at the start of the run (the report's cycle count).
    t0: u64,
    mem: ShadowedMemory<'a>,
}

impl<'a> RunLoop<'a> {
    /// Makes the translator's faults exits of the cache, creates the virtual CPU and hands
    /// interrupts and the control requests over to the run (`engine` holds the guest's
    /// registers, `shadow` has the kernel view loaded).
    pub(super) fn setup(
        block: &'a AttachBlock,
        mut engine: Engine,
        shadow: &'a RefCell<Shadow>,
        tool: Chosen,
    ) -> Self {
        arm_fault_redirect(&mut engine);
        let mem = ShadowedMemory::new(shadow);
        // Measured before the virtual CPU makes the hardware FS/GS bases the guest's.
        let null_clears_base = crate::run::vcpu::probe_null_selector_clears_base();
        log!(
            Info,
            "engine: loading a null selector into FS {} its base on this CPU",
            if null_clears_base { "zeroes" } else { "keeps" }
        );
        let ring0 = Ring0 {
            null_clears_base,
            ..Ring0::default()
        };
        let mut vcpu = Vcpu::new(block, ring0, ShadowPort::new(shadow));
        crate::run::tasks::watch(&mut vcpu, block, &engine);
        let progress = cache_page_fault::Progress::default();
        let t0 = timer::tsc();
        prof::start();
        irq::hand_over(&engine);
        detach::publish(&engine);
        RunLoop {
            engine,
            vcpu,
            shadow,
            tool,
            progress,
            t0,
            mem,
        }
    }

    /// Runs the guest until the run ends.
    pub(super) fn run(mut self) -> ! {
        loop {
            let step = match self.turn() {
                Ok(ControlFlow::Continue(step)) => step,
                // A #DB was delivered instead of running the instruction.
                Ok(ControlFlow::Break(())) => continue,
                Err(GiveUp) => self.give_up(0),
            };
            let stop = self
                .engine
                .run(&mut self.mem, &mut self.vcpu, self.tool.as_tool());
            (self.vcpu.vif, self.vcpu.iopl) = self.engine.virtual_flags();
            let cycles = timer::tsc().wrapping_sub(self.t0);
            if let Err(GiveUp) = self.on_stop(stop, step, cycles) {
                self.give_up(cycles);
            }
        }
    }

    /// The top of a turn, before the translator runs: control requests, the shadow's work,
    /// the translation mode, the virtual flags, and stepping. `Continue` with the state an
    /// instruction run in a stepping mode begins with; `Break` if a breakpoint's #DB was
    /// delivered instead (the next turn runs its handler).
    fn turn(&mut self) -> Result<ControlFlow<(), Option<StepStart>>, GiveUp> {
        // `kpin detach`/`attach` on this engine: served here, at a trace boundary.
        detach::note_progress(&self.engine);
        if detach::requested() != 0 {
            // A native detach hands the UART to the guest: it must have the held byte
            // (the IER write-back is `serve`'s).
            self.vcpu.hw.flush_console();
            let t0 = self.t0;
            detach::serve(
                &mut self.engine,
                &self.vcpu,
                self.shadow,
                &mut self.tool,
                &mut |e, v, sh, t| report(e, v, sh, t, timer::tsc().wrapping_sub(t0)),
            );
        }
        prof::switch(profile::SHADOW_WORK);
        tell_translator(&mut self.engine, self.shadow);
        prof::switch(prof::ENGINE);
        // Traces are keyed by mode: it follows the virtual CPL (deliveries in this loop
        // change it outside `emulate`).
        if self.engine.mode() != self.vcpu.mode() {
            if let Err(e) = self.engine.set_mode(self.vcpu.mode()) {
                log!(Error, "engine: switching the translation mode failed: {e}");
                return Err(GiveUp);
            }
        }
        // The virtual IF and IOPL go to the cache context for the inline flag
        // instructions, and come back after the run (deliveries and reports read them);
        // the selectors for inline `mov r, sreg` (deliveries change CS and SS).
        self.engine.set_virtual_flags(self.vcpu.vif, self.vcpu.iopl);
        self.engine.set_selectors(self.vcpu.segs.selectors());
        self.engine.set_irq_held(irq::highest().is_some());
        // Stepping (TF, or DR7 breakpoints): the run executes at most this one
        // instruction, whose state before it the debug checks need.
        let step = self.vcpu.mode().is_stepping().then(|| StepStart {
            tf: self.vcpu.tf,
            regs: *self.engine.regs(),
            pc: self.engine.rip().0,
        });
        if let Some(s) = &step {
            if let Some(r) = self
                .vcpu
                .instruction_breakpoint(self.engine.regs_mut(), s.pc)
            {
                self.on_debug(r, s.pc)?;
                return Ok(ControlFlow::Break(()));
            }
        }
        Ok(ControlFlow::Continue(step))
    }

    /// Handles what stopped a run of the translator (`step`: the stepped instruction's
    /// start, from [`Self::turn`]); first, a shadow-MMU failure during the run ends it.
    fn on_stop(&mut self, stop: Stop, step: Option<StepStart>, cycles: u64) -> Result<(), GiveUp> {
        let failure = self.shadow.borrow().failure().cloned();
        if let Some(e) = failure {
            log!(
                Error,
                "engine: shadow MMU failure at guest RIP {:#x}: {e}",
                self.engine.rip().0
            );
            return Err(GiveUp);
        }
        match stop {
            Stop::Sensitive(insn) => self.on_sensitive(insn, cycles),
            Stop::Fault { guest_pc, .. } => self.on_fault(guest_pc),
            Stop::FetchFault(va) => self.on_fetch_fault(va),
            Stop::EnteredStepping(next) => {
                self.engine.set_rip(next);
                Ok(())
            }
            Stop::Stepped(next) => self.on_stepped(step, next),
            Stop::Attention(va) => self.on_attention(va),
            other => {
                log!(
                    Error,
                    "engine: the run stopped at guest RIP {:#x}: {other:?}",
                    self.engine.rip().0
                );
                Err(GiveUp)
            }
        }
    }

    /// A sensitive instruction the virtual CPU stopped on: shadow work to apply, the final
    /// port write (poweroff or reset), a triple fault, or one it does not emulate.
    fn on_sensitive(&mut self, insn: SensitiveInsn, cycles: u64) -> Result<(), GiveUp> {
        match self.vcpu.take_stop() {
            Some(VcpuStop::ShadowWork { resume }) => {
                self.engine.complete_stopped_emulation(self.tool.as_tool());
                self.engine.set_rip(resume);
                Ok(())
            }
            Some(VcpuStop::FinalPortWrite { port, size, value }) => {
                // The held THR byte before the report, so that it counts it.
                self.vcpu.hw.flush_console();
                report(
                    &self.engine,
                    &self.vcpu,
                    self.shadow,
                    &mut self.tool,
                    cycles,
                );
                log!(
                    Info,
                    "engine: guest RIP {:#x} writes {value:#x} to port {port:#x} (poweroff or reset): passing it on",
                    insn.pc.0
                );
                log::flush();
                gate::out(port, size, value);
                // The VMM normally ends the run here; if not, the guest continues.
                self.engine
                    .set_rip(GuestVirt(insn.pc.0 + u64::from(insn.len)));
                Ok(())
            }
            Some(VcpuStop::TripleFault(t)) => {
                log!(
                    Error,
                    "engine: the guest triple-faulted at RIP {:#x}: {} (vector {}, error code {:#x}) while delivering #DF",
                    insn.pc.0,
                    crate::ring0::crash::vector_name(u64::from(t.last.vector)),
                    t.last.vector,
                    t.last.error.unwrap_or(0)
                );
                Err(GiveUp)
            }
            stop => {
                let text = unsupported(stop, &insn);
                log!(Error, "engine: {text}");
                Err(GiveUp)
            }
        }
    }

    /// A hardware fault in translated code at the guest instruction `guest_pc`: a #PF goes
    /// to the shadow MMU (`cache_page_fault::on_page_fault`), a #UD may be an isolation
    /// check's hit (`on_isolation_hit`); whichever answers, [`Self::apply`] carries out its
    /// `Action`. Any other fault, or a #UD that is not a hit, is the guest's.
    fn on_fault(&mut self, guest_pc: GuestVirt) -> Result<(), GiveUp> {
        let (vector, error) = entry::take_cache_fault();
        let mode = self.vcpu.mode();
        let action = if vector == u64::from(VEC_PF) {
            prof::switch(profile::SHADOW_FILL);
            let cr2 = cache_page_fault::fault_address(
                &self.engine,
                self.shadow,
                &mut self.progress,
                mode,
                guest_pc,
                error as u32,
                Platform::segment_base(&mut self.vcpu, SegBase::Fs),
                Platform::segment_base(&mut self.vcpu, SegBase::Gs),
            );
            let hw = cache_page_fault::HwPageFault {
                guest_pc,
                cr2,
                error: error as u32,
            };
            let action = cache_page_fault::on_page_fault(
                &mut self.engine,
                self.shadow,
                &self.vcpu,
                &mut self.progress,
                mode,
                hw,
            );
            if let Ok(Action::Reflect(_)) = action {
                // The fill turned out to be the guest's fault.
                prof::switch_charging(profile::GUEST_FAULT, profile::GUEST_FAULT);
            }
            action.map(Some)
        } else {
            prof::switch(profile::GUEST_FAULT);
            if vector == u64::from(VEC_UD) {
                let hit = cache_page_fault::IsolationHit {
                    guest_pc,
                    fs_base: Platform::segment_base(&mut self.vcpu, SegBase::Fs),
                    gs_base: Platform::segment_base(&mut self.vcpu, SegBase::Gs),
                };
                cache_page_fault::on_isolation_hit(
                    &mut self.engine,
                    self.shadow,
                    &self.vcpu,
                    &mut self.progress,
                    mode,
                    hit,
                )
            } else {
                Ok(None)
            }
        };
        match action {
            Ok(Some(action)) => self.apply(action, guest_pc),
            Ok(None) => {
                let ev = Event::from_hardware(vector as u8, error as u32);
                deliver_at(&mut self.engine, &mut self.vcpu, guest_pc.0, ev)
            }
            Err(e) => Err(e),
        }
        .map_err(logged)
    }

    /// Carries out what the shadow MMU or the isolation checks decided for a fault at the
    /// guest instruction `guest_pc`.
    fn apply(&mut self, action: Action, guest_pc: GuestVirt) -> Result<(), RunError> {
        match action {
            Action::Retry => {
                self.engine.set_rip(guest_pc);
                Ok(())
            }
            Action::Resume(next) => {
                self.engine.set_rip(next);
                Ok(())
            }
            Action::Reflect(f) => {
                reflect_guest_fault(&mut self.engine, &mut self.vcpu, self.shadow, f, guest_pc)
            }
        }
    }

    /// An instruction fetch at `va` the shadow could not serve: the guest's fault, or the
    /// end of the run.
    fn on_fetch_fault(&mut self, va: GuestVirt) -> Result<(), GiveUp> {
        // The instruction starts at the engine's RIP (`va` may be its second page).
        prof::switch(profile::GUEST_FAULT);
        let rip = self.engine.rip();
        match cache_page_fault::fetch_fault(self.shadow, self.vcpu.mode(), va) {
            Some(f) => reflect_guest_fault(&mut self.engine, &mut self.vcpu, self.shadow, f, rip),
            None => Err(RunError::Undecodable { va: va.0 }),
        }
        .map_err(logged)
    }

    /// One instruction ran in a stepping mode (it began as `step` says): its #DB trap, if
    /// any, follows.
    fn on_stepped(&mut self, step: Option<StepStart>, next: GuestVirt) -> Result<(), GiveUp> {
        prof::switch(profile::GUEST_FAULT);
        let Some(s) = step else {
            log!(
                Error,
                "engine: a stepping stop outside a stepping mode at RIP {:#x}",
                next.0
            );
            return Err(GiveUp);
        };
        let mut bytes = [0u8; cache_page_fault::MAX_INSN];
        let n = ShadowedMemory::new(self.shadow).peek_code(s.pc, self.engine.mode(), &mut bytes);
        match self.vcpu.after_instruction(
            s.tf,
            &s.regs,
            s.pc,
            &bytes[..n],
            self.engine.regs_mut(),
            next.0,
        ) {
            None => {
                self.engine.set_rip(next);
                Ok(())
            }
            Some(r) => self.on_debug(r, next.0),
        }
    }

    /// Continues at the handler of a #DB delivery (`r`), or logs the triple fault at `rip`.
    fn on_debug(&mut self, r: Result<u64, TripleFault>, rip: u64) -> Result<(), GiveUp> {
        match r {
            Ok(handler) => {
                self.engine.set_rip(GuestVirt(handler));
                Ok(())
            }
            Err(t) => {
                log!(
                    Error,
                    "engine: the guest triple-faulted delivering #DB at RIP {rip:#x} (last vector {})",
                    t.last.vector
                );
                Err(GiveUp)
            }
        }
    }

    /// The run stopped for attention at `va` (state precise there): a pending interrupt.
    fn on_attention(&mut self, va: GuestVirt) -> Result<(), GiveUp> {
        // Only interrupts set attention so far.
        prof::switch(profile::INTERRUPT);
        self.engine.set_attention(0);
        // Console bytes wait at most for the next interrupt (a guest that spins
        // after a message, e.g. a kernel panic without reboot, still shows it), and
        // a held THR byte's THR-empty interrupt comes before the guest's next one.
        self.vcpu.hw.flush_console();
        match self.vcpu.deliver_pending(self.engine.regs_mut(), va.0) {
            Ok(Some(handler)) => self.engine.set_rip(GuestVirt(handler)),
            Ok(None) => self.engine.set_rip(va),
            Err(_) => {
                log!(
                    Error,
                    "engine: the guest triple-faulted delivering an interrupt at RIP {:#x}",
                    va.0
                );
                return Err(GiveUp);
            }
        }
        Ok(())
    }

    /// Ends a run the engine cannot continue (the reason is logged): the guest's state,
    /// the report (`cycles` into the run), then the failure port (exit status 3).
    #[cold]
    fn give_up(&mut self, cycles: u64) -> ! {
        guest_dump::log_guest_state(&self.engine, &self.vcpu, &self.mem);
        report(
            &self.engine,
            &self.vcpu,
            self.shadow,
            &mut self.tool,
            cycles,
        );
        fail();
    }
}

/// The log line for a sensitive instruction `insn` the virtual CPU stopped on without
/// emulating it (`stop`: what it said, if anything), with its bytes.
fn unsupported(stop: Option<VcpuStop>, insn: &SensitiveInsn) -> String {
    let mut text = String::new();
    match stop {
        Some(VcpuStop::Unsupported { mnemonic, why }) => {
            let name = mnemonic.map_or(String::from("(undecodable)"), |m| {
                let mut n = String::new();
                let _ = write!(n, "{m:?}");
                n.to_ascii_lowercase()
            });
            let _ = write!(
                text,
                "unsupported sensitive instruction `{name}` ({:?}) at guest RIP {:#x}: {why}; bytes",
                insn.kind, insn.pc.0
            );
        }
        _ => {
            let _ = write!(
                text,
                "sensitive instruction ({:?}) at guest RIP {:#x} stopped the run; bytes",
                insn.kind, insn.pc.0
            );
        }
    }
    for b in &insn.bytes[..usize::from(insn.len).min(insn.bytes.len())] {
        let _ = write!(text, " {b:02x}");
    }
    text
}
