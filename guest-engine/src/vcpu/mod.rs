//! The virtual CPU: [`crate::Platform`] for the guest's sensitive instructions, emulated
//! at the dispatcher with the faults a CPU in 64-bit mode would raise, and events
//! delivered to the guest through its own IDT (`events.rs`). Hardware it needs (port I/O,
//! pass-through MSRs, the hardware FS/GS bases, `hlt`, pending interrupts, the TSC) and
//! guest memory through the shadow MMU come from the embedder through two traits
//! ([`Hardware`], [`GuestMmu`]): the engine image implements them with its ring-0 gate,
//! the host unit tests (`tests/`) with mocks.
//!
//! One module per instruction family; `emulate.rs` decodes the instruction, makes the
//! privilege checks common to a family and dispatches through a table from iced-x86's
//! `Code` to the handler:
//!
//! * `debug.rs` — TF single-stepping and DR0–DR3/DR7 breakpoints, around the engine's
//!   stepping mode;
//! * `cr.rs` — `mov` to/from CR0/CR2/CR3/CR4/CR8 and DR0–DR7, `lmsw`/`smsw`/`clts`,
//!   `invlpg`. CR3 switches the guest's address space in the shadow MMU; CR0/CR4 writes
//!   that change only CR0.WP, CR4.PGE/SMEP (and the bits the hardware need not enforce
//!   at CPL 3) are emulated, leaving 64-bit paged mode or enabling #NM/TSD stops;
//! * `flags.rs` — `cli`/`sti`/`pushfq`/`popfq` on the virtual IF and IOPL
//!   (IOPL-sensitive at CPL 3); TF is never set in the real RFLAGS;
//! * `tables.rs` — `lgdt`/`lidt`/`sgdt`/`sidt`/`ltr`/`lldt`/`str`/`sldt`;
//! * `segments.rs` — selectors and descriptor caches, `mov sreg`, `push`/`pop fs`/`gs`,
//!   same-privilege `retf`;
//! * `msr.rs` — the virtual MSR file, `rdmsr`/`wrmsr`;
//! * `syscall.rs` — `syscall`/`sysretq`/`swapgs`/`rd/wr{fs,gs}base`;
//! * `port_io.rs` — `in`/`out` of AL/AX/EAX (a poweroff or reset write stops for the
//!   final report; string port I/O stops); `uart_status.rs` — COM1's line status and
//!   IER, `pic_mask.rs` — the PICs' masks, and `pci_config.rs` — PCI configuration
//!   mechanism 1's address register and reads, which an embedder may answer (and, for
//!   the console's IER writes and the PCI address, keep) without a port exit once they
//!   are known;
//! * `legacy.rs` — same-privilege far `jmp`/`call`, `iretd`, `lss`/`lfs`/`lgs`/`les`/
//!   `lds`, and 32-bit code's `pushad`/`popad`, `into`, `bound`, `aam`/`aad`;
//! * `optional.rs` — instructions that follow a CPUID feature, a control bit or the
//!   vendor (`sysenter`, `int1`, `rdpmc`, PKU, MONITOR, TSX, SMAP, VMX/SVM…);
//! * `misc.rs` — `cpuid` (from the attach block's table, so native and instrumented
//!   runs see one CPU), `wbinvd`, `invd`, `xgetbv`, `rdtscp`, `rdpid`, `hlt`;
//! * `events.rs` — delivery through the IDT, `iretq`, `int n`/`int3`/`ud*`, external
//!   interrupts; `undo.rs` — the undo log that keeps a failed delivery invisible.
//!
//! Privileged instructions at virtual CPL 3 raise #GP(0). An instruction the virtual CPU
//! does not model stops the run naming it ([`VcpuStop::Unsupported`]) when it comes from
//! CPL 0-2; from CPL 3 it is the #UD a CPU without it raises (counted, logged once), so
//! no user process can end the run.
//!
//! The translator must hear about some emulations' effects (a CR3 write drops mappings, a
//! write into a code frame drops its traces) before guest code runs again, and only the
//! run loop holds the `Engine`: when the shadow has such work after an emulation,
//! `emulate` stops with [`VcpuStop::ShadowWork`], and the run loop does the work and
//! resumes there. A CPL change returns `Emulation::Switch` (traces are keyed by mode);
//! the shadow view follows the CPL at once.

mod cr;
mod debug;
mod emulate;
mod events;
mod flags;
mod hardware;
mod legacy;
mod mce;
mod misc;
mod msr;
mod optional;
pub mod pci_config;
pub mod pic_mask;
mod port_exits;
mod port_io;
mod segment_query;
mod segments;
mod syscall;
mod tables;
pub mod uart_status;
mod undo;

#[cfg(test)]
mod tests;

use iced_x86::Mnemonic;
use kpin_abi::attach::AttachBlock;
use kpin_abi::x86::{cr4, rflags};

pub use cr::paging_control;
pub use events::{Event, Kind, TripleFault};
pub use hardware::{GuestFault, GuestMmu, Hardware};
pub use msr::{LogOnce, MsrFile, Written, LAPIC_FRAME};
pub use pci_config::{PciConfigCache, PciOut};
pub use pic_mask::PicMaskCache;
pub use port_exits::{PortExitTable, PortSite};
pub(crate) use segments::sreg_of;
pub use segments::{Descriptor, Segments, Sreg};
pub use tables::DescriptorTable;
pub use uart_status::{LineStatusCache, OutRoute};

use crate::shadow_mmu::View;
use crate::{Gpr, GuestRegs, GuestVirt, Mode, SensitiveKind};

/// Translation mode of traces run at virtual CPL 0–2.
pub const MODE_KERNEL: Mode = Mode(0);
/// Translation mode of traces run at virtual CPL 3.
pub const MODE_USER: Mode = Mode(3);

/// DR6 at reset.
const DR6_INIT: u64 = 0xffff_0ff0;
/// DR7 at reset.
const DR7_INIT: u64 = 0x400;
/// DR7's L0–L3/G0–G3: breakpoint enables.
const DR7_ENABLES: u64 = 0xff;
/// DR7.GD: general detect.
const DR7_GD: u64 = 1 << 13;

/// Why an emulation stopped the run (`Emulation::Stop`); [`Vcpu::take_stop`] hands it to
/// the run loop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VcpuStop {
    /// The instruction is not emulated: the run ends naming it.
    Unsupported {
        /// Its mnemonic (iced-x86's name), `None` if it does not decode.
        mnemonic: Option<Mnemonic>,
        /// What is missing, in words.
        why: &'static str,
    },
    /// A delivery triple-faulted: the run ends.
    TripleFault(TripleFault),
    /// A port write that ends the VM (`kpin_abi::ports::ends_the_run`: an ACPI poweroff,
    /// the ACPI reset register, the i8042 reset): the engine writes its report first, then
    /// performs it and continues after the instruction.
    FinalPortWrite {
        /// The port.
        port: u16,
        /// The operand size (1, 2, 4).
        size: u8,
        /// The value written.
        value: u32,
    },
    /// The shadow MMU has work for the translator (a CR3 write drops mappings, a write
    /// into a code frame drops its traces): do it, then continue at `resume`.
    ShadowWork {
        /// Where the guest continues.
        resume: GuestVirt,
    },
    /// The shadow MMU recorded an engine failure: the run ends reporting it.
    ShadowFailure,
}

/// Counters for the run report.
#[derive(Default)]
pub struct VcpuStats {
    /// Emulated sensitive instructions by `SensitiveKind` (declaration order).
    pub emulated: [u64; SensitiveKind::COUNT],
    /// Port writes.
    pub outs: u64,
    /// Port reads.
    pub ins: u64,
    /// CPUIDs.
    pub cpuids: u64,
    /// External interrupts delivered to the guest.
    pub interrupts: u64,
    /// Exceptions delivered, by vector (0–31).
    pub exceptions: [u64; 32],
    /// `int n` delivered.
    pub software_ints: u64,
    /// `hlt`s that waited.
    pub halts: u64,
    /// Instructions at CPL 3 the virtual CPU does not model, answered with #UD.
    pub user_unsupported: u64,
    /// DR7 writes that enabled a hardware breakpoint.
    pub breakpoint_enables: u64,
}

/// The virtual CPU's state and counters, over the embedder's hardware `H` and guest
/// memory `M`.
pub struct Vcpu<'a, H: Hardware, M: GuestMmu> {
    block: &'a AttachBlock,
    /// The hardware behind the gate.
    pub hw: H,
    /// Guest memory and the shadow MMU (which holds the virtual CR3, [`Vcpu::cr3`], and
    /// the view that follows the CPL).
    pub mem: M,
    /// Guest CR0.
    pub cr0: u64,
    /// Guest CR2 (set when a #PF is delivered).
    pub cr2: u64,
    /// Guest CR4.
    pub cr4: u64,
    /// Guest DR0–DR3 (the breakpoints DR7 enables are checked by `debug.rs`).
    pub dr: [u64; 4],
    /// Guest DR6.
    pub dr6: u64,
    /// Guest DR7.
    pub dr7: u64,
    /// The virtual RFLAGS.IF (the real IF stays 1 while guest code runs).
    pub vif: bool,
    /// The virtual RFLAGS.IOPL (the real one stays 0).
    pub iopl: u8,
    /// The virtual RFLAGS.TF (the real one stays 0): while set, traces are translated in
    /// a stepping mode ([`Vcpu::mode`]) and every guest instruction ends in a #DB.
    pub tf: bool,
    /// The instruction just emulated cleared TF in a way that takes no single-step trap
    /// after it (`syscall` with SFMASK.TF); taken by [`Vcpu::after_instruction`].
    pub(super) step_suppressed: bool,
    /// The virtual GDTR (loaded by `lgdt`; the engine's own GDT is what the CPU uses).
    pub gdtr: DescriptorTable,
    /// The virtual IDTR (loaded by `lidt`; events are delivered through it).
    pub idtr: DescriptorTable,
    /// Guest selectors and descriptor caches (see [`Segments`]).
    pub segs: Segments,
    /// The virtual MSRs.
    pub msrs: MsrFile,
    /// Counters.
    pub stats: VcpuStats,
    /// Why the last emulation stopped (taken by the run loop).
    stop: Option<VcpuStop>,
    /// RIP after the last emulated `sti`, while no other instruction was emulated since
    /// (the interrupt shadow, see [`Vcpu::deliver_pending`]).
    sti_next: Option<u64>,
    /// MSR indices whose #GP was already logged (a guest probing in a loop logs once).
    msr_gp_logged: LogOnce,
    /// Mnemonics whose #UD at CPL 3 (not modelled) was already logged.
    unsupported_logged: LogOnce,
    /// Which guest task runs, checked at every entry to CPL 3 (`crate::tasks`; `None`:
    /// not watched).
    pub tasks: Option<crate::tasks::TaskWatch>,
}

impl<'a, H: Hardware, M: GuestMmu> Vcpu<'a, H, M> {
    /// A virtual CPU for the guest in `block`; makes the hardware FS/GS bases and SSE
    /// bits the guest's.
    pub fn new(block: &'a AttachBlock, hw: H, mem: M) -> Self {
        let mut v = Self {
            block,
            hw,
            mem,
            cr0: block.sregs.cr0,
            cr2: block.sregs.cr2,
            cr4: block.sregs.cr4,
            dr: [0; 4],
            dr6: DR6_INIT,
            dr7: DR7_INIT,
            vif: block.regs.rflags & rflags::IF != 0,
            iopl: ((block.regs.rflags & rflags::IOPL) >> 12) as u8,
            tf: block.regs.rflags & rflags::TF != 0,
            step_suppressed: false,
            gdtr: DescriptorTable::new(block.sregs.gdt.base, block.sregs.gdt.limit),
            idtr: DescriptorTable::new(block.sregs.idt.base, block.sregs.idt.limit),
            segs: Segments::new(&block.sregs),
            msrs: MsrFile::new(block),
            stats: VcpuStats::default(),
            stop: None,
            sti_next: None,
            msr_gp_logged: LogOnce::new(),
            unsupported_logged: LogOnce::new(),
            tasks: None,
        };
        v.sync_hw_bases();
        if v.cr4 & cr4::SSE_BITS != 0 {
            v.hw.set_cr4_sse(v.cr4);
        }
        v
    }

    /// Why the last emulation returned `Emulation::Stop` (once).
    pub fn take_stop(&mut self) -> Option<VcpuStop> {
        self.stop.take()
    }

    /// The virtual CR3.
    pub fn cr3(&self) -> u64 {
        self.mem.cr3()
    }

    /// The virtual CPL (CS.RPL).
    pub fn cpl(&self) -> u8 {
        self.segs.cpl()
    }

    /// The translation mode of the virtual CPL ([`MODE_USER`] at CPL 3, else
    /// [`MODE_KERNEL`]): traces are keyed by it.
    pub fn mode(&self) -> Mode {
        let mode = if self.cpl() != 3 {
            MODE_KERNEL
        } else if self.bitness() == 32 {
            MODE_USER.compat()
        } else {
            MODE_USER
        };
        let mode = if self.cpl() == 3 && self.cr4 & cr4::TSD != 0 {
            mode.timestamp_faulting()
        } else {
            mode
        };
        if self.tf || self.breakpoints_armed() {
            mode.stepping()
        } else {
            mode
        }
    }

    /// Called after anything that may change the CPL (delivery, `iretq`, `syscall`,
    /// `sysretq`) with the CPL before it: the shadow view follows the CPL (user at CPL
    /// 3, kernel otherwise). A failure is recorded for the run loop to report. An entry
    /// to CPL 3 is where the task watch looks at which task runs.
    pub(crate) fn cpl_changed(&mut self, old: u8) {
        let new = self.cpl();
        if new != old {
            if let Err(e) = self.mem.enter_view(View::for_cpl(new)) {
                self.mem.record_failure(e);
            }
            if new == 3 {
                self.user_entry();
            }
        }
    }

    /// The guest entered CPL 3: the task watch, if any, reads `current` with the kernel's
    /// privileges (a fault, or a pointer into a device page, is only counted).
    fn user_entry(&mut self) {
        if let Some(w) = &mut self.tasks {
            let t0 = self.hw.tsc();
            let gs = [
                self.segs.sregs[Sreg::Gs as usize].base,
                self.msrs.kernel_gs_base,
            ];
            let mem = &mut self.mem;
            let cr3 = mem.cr3();
            w.on_user_entry(cr3, gs, &mut |va, out| mem.observe(va, out));
            w.stats.cycles = w.stats.cycles.wrapping_add(self.hw.tsc().wrapping_sub(t0));
        }
    }

    /// The code segment's bitness: 64 (CS.L), 32 (CS.D) or 16.
    pub fn bitness(&self) -> u32 {
        let cs = &self.segs.sregs[Sreg::Cs as usize];
        if cs.l != 0 {
            64
        } else if cs.db != 0 {
            32
        } else {
            16
        }
    }

    /// The stack pointer's width as a mask: ESP in 32-bit code, RSP in 64-bit code.
    fn stack_mask(&self) -> u64 {
        if self.bitness() == 64 {
            u64::MAX
        } else {
            0xffff_ffff
        }
    }

    /// Pushes `data` (2, 4 or 8 bytes) on the guest stack at the current CPL.
    fn push_bytes(&mut self, regs: &mut GuestRegs, data: &[u8]) -> Result<(), Event> {
        let mask = self.stack_mask();
        let rsp = regs.get(Gpr::Rsp).wrapping_sub(data.len() as u64) & mask;
        self.write(rsp, data)?;
        regs.set(Gpr::Rsp, rsp);
        Ok(())
    }

    /// Reads `out.len()` bytes at the top of the guest stack; the stack pointer after
    /// popping them (not yet set).
    fn peek_stack(&mut self, regs: &GuestRegs, out: &mut [u8]) -> Result<u64, Event> {
        let mask = self.stack_mask();
        let rsp = regs.get(Gpr::Rsp) & mask;
        self.read(rsp, out)?;
        Ok(rsp.wrapping_add(out.len() as u64) & mask)
    }

    /// Reads guest memory at the current CPL; a #PF (CR2 set) on failure.
    fn read(&mut self, va: u64, out: &mut [u8]) -> Result<(), Event> {
        let user = self.cpl() == 3;
        self.mem
            .read(va, user, out)
            .map_err(|f| self.guest_fault(f))
    }

    /// Writes guest memory at the current CPL; a #PF (CR2 set) on failure.
    fn write(&mut self, va: u64, data: &[u8]) -> Result<(), Event> {
        let user = self.cpl() == 3;
        self.mem
            .write(va, user, data)
            .map_err(|f| self.guest_fault(f))
    }

    /// The exception for `f`; for a #PF, with CR2 set.
    fn guest_fault(&mut self, f: GuestFault) -> Event {
        if f.vector == kpin_abi::x86::vector::PF {
            self.cr2 = f.cr2.0;
        }
        Event::from_guest_fault(f)
    }
}
