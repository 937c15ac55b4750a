//! The virtual CPU: `guest_engine::Platform` for the guest's sensitive instructions,
//! emulated at the dispatcher with the faults a CPU would raise, delivered to the guest
//! through its own IDT (`deliver.rs`):
//!
//! * port I/O: `out`/`in` of AL, AX or EAX at an imm8 or DX port through the ring-0
//!   gate's OUT/IN operations (so the VMM sees the port exit a native `out` makes; an
//!   i8042 reset ends the run as a poweroff); string port I/O stops;
//! * `cpuid` from the attach block's table, so native and instrumented runs see one CPU;
//! * control registers and the TLB, on the shadow MMU (`shadow.rs`): `mov r64,
//!   cr0/cr2/cr3/cr4/cr8` read the virtual values; `mov cr3, r64` switches the guest's
//!   address space (new shadow root in the real CR3, every VA → PA mapping the translator
//!   holds dropped); `mov cr0/cr4, r64` that change only CR0.WP, CR4.PGE or CR4.SMEP (the
//!   bits that change translations and nothing else the hardware would enforce at CPL 3;
//!   any other change stops); `invlpg m`;
//! * flags: `cli`/`sti`/`pushfq`/`popfq` on the virtual IF and IOPL (IOPL-sensitive at
//!   CPL 3); TF is never set in the real RFLAGS (single-stepping is not virtualized);
//! * `lgdt`/`lidt`/`sgdt`/`sidt`, segment state (`segments.rs`), `ltr`/`lldt`/`str`/
//!   `sldt`, same-privilege `retf`;
//! * events: `int n`, `int3`, `ud2` and undecodable bytes (#UD), `iretq` (`deliver.rs`);
//! * `syscall`/`sysretq`/`swapgs`/`rd/wr{fs,gs}base` (`transitions.rs`), `rdmsr`/`wrmsr`
//!   on the virtual MSR file (`msr.rs`);
//! * `hlt` at virtual CPL 0 with IF = 1: the gate's HLT until an interrupt is pending,
//!   then delivery with RIP after the `hlt`; with IF = 0 the run ends ("guest halted with
//!   interrupts disabled").
//!
//! Privileged instructions at virtual CPL 3 raise #GP(0). Anything else stops the run
//! naming the instruction ([`Vcpu::unsupported`]): never a guess.
//!
//! The translator must hear about some emulations' effects (a CR3 write drops mappings, a
//! write into a code frame drops its traces) before guest code runs again, and only the
//! run loop holds the `Engine`: when the shadow has such work after an emulation,
//! `emulate` stops with [`Vcpu::resume`] set, and the run loop does the work and resumes
//! there. A CPL change returns `Emulation::Switch` (traces are keyed by mode); the shadow
//! view follows the CPL at once ([`Vcpu::cpl_changed`]).

use core::cell::RefCell;

use guest_engine::shadow_mmu::{ShadowError, View};
use guest_engine::{
    Emulation, Gpr, GuestRegs, GuestVirt, Mode, Platform, SegBase, SensitiveInsn, SensitiveKind,
};
use iced_x86::{Code, Decoder, DecoderOptions, Instruction, Mnemonic, OpKind, Register};
use kpin_abi::attach::AttachBlock;

use crate::deliver::{self, rflags, Event, Kind, TripleFault, BP, PF, UD};
use crate::guest_access;
use crate::guest_mem::{PhysmapMemory, MODE_KERNEL, MODE_USER};
use crate::layout::CR4_SSE_BITS;
use crate::msr::{index, MsrFile, Written};
use crate::segments::{Segments, Sreg, GP};
use crate::shadow::{paging_control, Shadow, CR4_PGE, CR4_SMEP};
use crate::{gate, irq, log, transitions};

const CR0_PE: u64 = 1 << 0;
const CR0_EM: u64 = 1 << 2;
const CR0_TS: u64 = 1 << 3;
const CR0_ET: u64 = 1 << 4;
const CR0_NW: u64 = 1 << 29;
const CR0_CD: u64 = 1 << 30;
const CR0_PG: u64 = 1 << 31;
const CR4_VME: u64 = 1 << 0;
const CR4_PVI: u64 = 1 << 1;
const CR4_TSD: u64 = 1 << 2;
const CR4_DE: u64 = 1 << 3;
const CR4_PSE: u64 = 1 << 4;
const CR4_PAE: u64 = 1 << 5;
const CR4_MCE: u64 = 1 << 6;
const CR4_PCE: u64 = 1 << 8;
const CR4_OSFXSR: u64 = 1 << 9;
const CR4_OSXMMEXCPT: u64 = 1 << 10;
/// CR4.UMIP: `sgdt`/`sidt`/`sldt`/`str`/`smsw` at CPL > 0 raise #GP(0).
pub const CR4_UMIP: u64 = 1 << 11;
const CR4_FSGSBASE: u64 = 1 << 16;

/// DR6 at reset.
const DR6_INIT: u64 = 0xffff_0ff0;
/// DR7 at reset.
const DR7_INIT: u64 = 0x400;

/// Number of `SensitiveKind` variants (for the per-kind counters).
const KINDS: usize = 21;

/// Why the virtual CPU stopped.
#[derive(Clone, Copy)]
pub struct Unsupported {
    /// Its mnemonic (iced-x86's name), `None` if it does not decode.
    pub mnemonic: Option<Mnemonic>,
    /// What is missing, in words.
    pub why: &'static str,
}

/// Counters for the run report.
#[derive(Default)]
pub struct VcpuStats {
    /// Emulated sensitive instructions by `SensitiveKind` (declaration order).
    pub emulated: [u64; KINDS],
    /// Port writes, port reads, CPUIDs.
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
    /// `hlt`s that waited in the gate.
    pub halts: u64,
}

/// The virtual CPU's state and counters.
pub struct Vcpu<'a> {
    block: &'a AttachBlock,
    /// The shadow MMU (shared with guest memory and the run loop); it holds the virtual
    /// CR3 ([`Vcpu::cr3`]) and the view that follows the CPL.
    shadow: &'a RefCell<Shadow>,
    /// Guest CR0.
    pub cr0: u64,
    /// Guest CR2 (set when a #PF is delivered).
    pub cr2: u64,
    /// Guest CR4.
    pub cr4: u64,
    /// Guest DR0–DR3, DR6, DR7 (stored only: breakpoints are not virtualized, so a DR7
    /// write that enables one stops).
    pub dr: [u64; 4],
    /// Guest DR6.
    pub dr6: u64,
    /// Guest DR7.
    pub dr7: u64,
    /// The virtual RFLAGS.IF (the real IF stays 1 while guest code runs).
    pub vif: bool,
    /// The virtual RFLAGS.IOPL (the real one stays 0).
    pub iopl: u8,
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
    /// Set when emulation stopped.
    pub unsupported: Option<Unsupported>,
    /// Set when a delivery triple-faulted (the run must end).
    pub triple: Option<TripleFault>,
    /// RIP after the last emulated `sti`, while no other instruction was emulated since
    /// (the interrupt shadow, see [`Vcpu::deliver_pending`]).
    sti_next: Option<u64>,
    /// A port write that ends the VM (`kpin_abi::ports::ends_the_run`: an ACPI poweroff,
    /// the ACPI reset register, the i8042 reset) as (port, size, value), left to the
    /// caller: the emulation stops so that the engine can write its report first, then
    /// performs it.
    pub final_write: Option<(u16, u8, u32)>,
    /// Where the guest continues after an emulation that stopped only so that the run
    /// loop could do the shadow's `EngineWork` (a CR3 write drops mappings, a write into
    /// a code frame drops its traces) before guest code runs again.
    pub resume: Option<GuestVirt>,
}

/// The result of emulating one instruction: where to go on, a stop, or an exception to
/// raise at the instruction (registers as before it).
type Step = Result<Emulation, Event>;

impl<'a> Vcpu<'a> {
    /// A virtual CPU for the guest in `block`; makes the hardware FS/GS bases the
    /// guest's.
    pub fn new(block: &'a AttachBlock, shadow: &'a RefCell<Shadow>) -> Self {
        let v = Self {
            block,
            shadow,
            cr0: block.sregs.cr0,
            cr2: block.sregs.cr2,
            cr4: block.sregs.cr4,
            dr: [0; 4],
            dr6: DR6_INIT,
            dr7: DR7_INIT,
            vif: block.regs.rflags & rflags::IF != 0,
            iopl: ((block.regs.rflags & rflags::IOPL) >> 12) as u8,
            gdtr: DescriptorTable {
                base: block.sregs.gdt.base,
                limit: block.sregs.gdt.limit,
            },
            idtr: DescriptorTable {
                base: block.sregs.idt.base,
                limit: block.sregs.idt.limit,
            },
            segs: Segments::new(&block.sregs),
            msrs: MsrFile::new(block),
            stats: VcpuStats::default(),
            unsupported: None,
            triple: None,
            sti_next: None,
            final_write: None,
            resume: None,
        };
        transitions::sync_hw_bases(&v);
        if v.cr4 & CR4_SSE_BITS != 0 {
            gate::cr4_sse(v.cr4);
        }
        v
    }

    fn stop(&mut self, mnemonic: Option<Mnemonic>, why: &'static str) -> Step {
        self.unsupported = Some(Unsupported { mnemonic, why });
        Ok(Emulation::Stop)
    }

    /// Guest memory through the shadow MMU's walk of the guest's page tables.
    pub fn mem(&self) -> PhysmapMemory<'a> {
        PhysmapMemory::new(self.shadow)
    }

    /// The virtual CR3.
    pub fn cr3(&self) -> u64 {
        self.shadow.borrow().cr3()
    }

    /// Tells the shadow MMU the paging-control bits of CR0, CR4 and EFER (CR0.WP,
    /// CR4.PGE/SMEP, EFER.NXE); a change drops every shadow leaf and every mapping the
    /// translator holds.
    pub fn update_paging_control(&mut self) -> Result<(), ShadowError> {
        self.shadow
            .borrow_mut()
            .set_control(paging_control(self.cr0, self.cr4, self.msrs.efer))
    }

    /// Continues at `next` if the shadow-MMU operation `r` worked; else records its
    /// failure, which the run loop reports.
    fn shadow_done(&mut self, r: Result<(), ShadowError>, next: GuestVirt) -> Step {
        match r {
            Ok(()) => Ok(Emulation::Continue(next)),
            Err(e) => {
                self.shadow.borrow_mut().record(e);
                Ok(Emulation::Stop)
            }
        }
    }

    /// MAXPHYADDR from the CPUID table (36 if it has no leaf 0x8000_0008).
    fn phys_addr_bits(&self) -> u32 {
        match self.block.cpuid(0x8000_0008, 0)[0] & 0xff {
            0 => 36,
            n => n,
        }
    }

    /// The CR4 bits a write may set without #GP: those whose feature the CPUID table
    /// offers (CPUID masks PCIDE, LA57, OSXSAVE, SMAP, PKE, so setting them is #GP as
    /// on a CPU without them). VMXE/SMXE/CET are never offered.
    fn cr4_writable(&self) -> u64 {
        let [_, _, _, edx1] = self.block.cpuid(1, 0);
        let [_, ebx7, ecx7, _] = self.block.cpuid(7, 0);
        // (CPUID register, bit, the CR4 bits that feature makes writable)
        let features = [
            (edx1, 1, CR4_VME | CR4_PVI),
            (edx1, 2, CR4_DE),
            (edx1, 3, CR4_PSE),
            (edx1, 13, CR4_PGE),
            (edx1, 24, CR4_OSFXSR),
            (edx1, 25, CR4_OSXMMEXCPT),
            (ecx7, 2, CR4_UMIP),
            (ebx7, 0, CR4_FSGSBASE),
            (ebx7, 7, CR4_SMEP),
        ];
        let mut m = CR4_PAE | CR4_MCE | CR4_PCE | CR4_TSD;
        for (reg, bit, cr4) in features {
            if reg & (1 << bit) != 0 {
                m |= cr4;
            }
        }
        m
    }

    /// `mov cr0, r64` or `lmsw` (CPL 0 checked by the caller).
    fn write_cr0(&mut self, i: &Instruction, v: u64, next: GuestVirt) -> Step {
        let old = self.cr0;
        if v >> 32 != 0
            || (v & CR0_PG != 0 && v & CR0_PE == 0)
            || (v & CR0_NW != 0 && v & CR0_CD == 0)
        {
            return Err(gp0());
        }
        if (old ^ v) & (CR0_PE | CR0_PG) != 0 {
            return self.stop(
                Some(i.mnemonic()),
                "a CR0 write that changes PE or PG (leaving 64-bit paged mode) is not emulated",
            );
        }
        if v & (CR0_EM | CR0_TS) != 0 {
            return self.stop(
                Some(i.mnemonic()),
                "a CR0 write that sets EM or TS (x87/SSE traps: #NM is not virtualized) is not emulated",
            );
        }
        // The rest is stored: WP goes to the shadow MMU; MP/NE/ET are what the
        // real CR0 has; AM only matters at CPL 3 with RFLAGS.AC (user-space
        // alignment checks are not virtualized: the real AM stays clear); CD/NW
        // change caching only, which a VM cannot observe.
        self.cr0 = v | CR0_ET;
        let r = self.update_paging_control();
        self.shadow_done(r, next)
    }

    /// `mov crN, r64` (CPL 0 checked by the caller).
    fn write_cr(&mut self, i: &Instruction, v: u64, next: GuestVirt) -> Step {
        match i.op0_register() {
            Register::CR3 => {
                // Bit 63 asks to keep PCID-tagged entries; PCIDs are off (CPUID masks
                // them), so the write flushes as a plain one.
                let cr3 = v & !(1 << 63);
                if cr3 >> self.phys_addr_bits() != 0 {
                    return Err(gp0());
                }
                let r = self.shadow.borrow_mut().write_cr3(cr3);
                self.shadow_done(r, next)
            }
            Register::CR0 => self.write_cr0(i, v, next),
            Register::CR4 => {
                let old = self.cr4;
                if v & !self.cr4_writable() != 0 {
                    return Err(gp0());
                }
                if (old ^ v) & CR4_PAE != 0 {
                    return self.stop(
                        Some(i.mnemonic()),
                        "a CR4 write that clears PAE (leaving long mode) is not emulated",
                    );
                }
                if v & CR4_TSD != 0 {
                    return self.stop(
                        Some(i.mnemonic()),
                        "CR4.TSD (rdtsc faulting at CPL 3) is not virtualized",
                    );
                }
                self.cr4 = v;
                if (old ^ v) & CR4_SSE_BITS != 0 {
                    gate::cr4_sse(v);
                }
                let r = self.update_paging_control();
                self.shadow_done(r, next)
            }
            Register::CR2 => {
                self.cr2 = v;
                Ok(Emulation::Continue(next))
            }
            // CR8 (the TPR) is not forwarded to the local APIC: writes are dropped and
            // reads give 0 (64-bit Linux programs the TPR through the APIC page).
            Register::CR8 => Ok(Emulation::Continue(next)),
            _ => Err(Event::exception(UD)),
        }
    }

    /// The virtual CPL (CS.RPL).
    pub fn cpl(&self) -> u8 {
        self.segs.cpl()
    }

    /// The translation mode of the virtual CPL (`MODE_USER` at CPL 3, else
    /// `MODE_KERNEL`): traces are keyed by it.
    pub fn mode(&self) -> Mode {
        if self.cpl() == 3 {
            MODE_USER
        } else {
            MODE_KERNEL
        }
    }

    /// The RFLAGS the guest sees: the real arithmetic flags with the virtual IF and IOPL
    /// (RF and VM clear).
    pub fn rflags_image(&self, real: u64) -> u64 {
        (real & !(rflags::IF | rflags::IOPL | rflags::RF | rflags::VM))
            | (u64::from(self.vif) << 9)
            | (u64::from(self.iopl) << 12)
    }

    /// Loads RFLAGS from a guest value (`popfq`, `iretq`, `sysretq`) as an instruction
    /// executed at `cpl` may: IOPL only at CPL 0, IF at CPL ≤ IOPL. Re-arms the attention
    /// byte if IF became 1 with an interrupt pending. (`iret` is true for `iretq`, which
    /// also loads RF.)
    pub fn load_rflags(&mut self, regs: &mut GuestRegs, value: u64, cpl: u8, iret: bool) {
        let was = self.vif;
        if cpl == 0 {
            self.iopl = ((value & rflags::IOPL) >> 12) as u8;
        }
        if cpl <= self.iopl {
            self.vif = value & rflags::IF != 0;
        }
        let keep = rflags::LOADABLE & !(rflags::IF | rflags::IOPL | rflags::TF);
        let rf = if iret { value & rflags::RF } else { 0 };
        regs.rflags = (value & keep) | rf | 2 | rflags::IF;
        if self.vif && !was {
            irq::rearm_if_pending();
        }
    }

    /// Called after anything that may change the CPL (delivery, `iretq`, `syscall`,
    /// `sysretq`) with the CPL before it.
    pub fn cpl_changed(&mut self, old: u8) {
        let new = self.cpl();
        if new != old {
            self.on_cpl_change(new);
        }
    }

    /// The shadow view follows the CPL (user at CPL 3, kernel otherwise): its root goes
    /// into the real CR3. A failure is recorded for the run loop to report.
    fn on_cpl_change(&mut self, new_cpl: u8) {
        let mut sh = self.shadow.borrow_mut();
        if let Err(e) = sh.enter(View::for_cpl(new_cpl)) {
            sh.record(e);
        }
    }

    /// Delivers `ev` to the guest with return address `rip`; the handler's RIP.
    pub fn deliver(
        &mut self,
        regs: &mut GuestRegs,
        rip: u64,
        ev: Event,
    ) -> Result<u64, TripleFault> {
        deliver::deliver_event(self, regs, rip, ev)
    }

    /// Counts a delivered event.
    pub fn count_delivery(&mut self, ev: Event) {
        match ev.kind {
            Kind::External => self.stats.interrupts += 1,
            Kind::Software => self.stats.software_ints += 1,
            Kind::Exception | Kind::SoftException => {
                if let Some(c) = self.stats.exceptions.get_mut(usize::from(ev.vector)) {
                    *c += 1;
                }
            }
        }
    }

    /// Delivers the highest pending external interrupt if the virtual IF allows it;
    /// `Some(handler)` if one was delivered.
    pub fn deliver_pending(
        &mut self,
        regs: &mut GuestRegs,
        rip: u64,
    ) -> Result<Option<u64>, TripleFault> {
        if !self.vif {
            return Ok(None);
        }
        let Some(vector) = irq::highest() else {
            return Ok(None);
        };
        irq::take(vector);
        // `sti; hlt` with the interrupt arriving between them: hardware takes it on the
        // `hlt`, returning after it.
        let mut b = [0u8; 1];
        let rip = if self.sti_next == Some(rip)
            && self.mem().read_virt(rip, self.mode(), &mut b)
            && b[0] == 0xf4
        {
            rip + 1
        } else {
            rip
        };
        self.sti_next = None;
        let ev = Event {
            vector,
            error: None,
            kind: Kind::External,
        };
        let handler = self.deliver(regs, rip, ev)?;
        // A trap gate leaves IF set: the next pending vector must not wait for an
        // IF change.
        if self.vif {
            irq::rearm_if_pending();
        }
        Ok(Some(handler))
    }

    /// Reads guest memory at the current CPL; a #PF (CR2 set) on failure.
    fn read(&mut self, va: u64, out: &mut [u8]) -> Result<(), Event> {
        let user = self.cpl() == 3;
        guest_access::read(&self.mem(), va, user, out).map_err(|f| {
            self.cr2 = f.cr2;
            Event::fault(PF, f.error)
        })
    }

    /// Writes guest memory at the current CPL; a #PF (CR2 set) on failure.
    fn write(&mut self, va: u64, data: &[u8]) -> Result<(), Event> {
        let user = self.cpl() == 3;
        guest_access::write(&self.mem(), va, user, data).map_err(|f| {
            self.cr2 = f.cr2;
            Event::fault(PF, f.error)
        })
    }
}

/// A virtual GDTR or IDTR.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DescriptorTable {
    /// Linear base.
    pub base: u64,
    /// Limit.
    pub limit: u16,
}

/// MSR indices whose #GP was already logged (so a guest probing in a loop logs once).
static MSR_GP_LOGGED: crate::msr::LogOnce = crate::msr::LogOnce::new();

impl Vcpu<'_> {
    /// The #GP(0) an `rdmsr`/`wrmsr` of an index the virtual CPU does not have raises;
    /// logged once per index (the guest handles it, but a difference from native is
    /// worth seeing in engine.log).
    fn msr_gp(&self, index: u32, write: bool) -> Event {
        if MSR_GP_LOGGED.first(index) {
            log!(
                Info,
                "engine: guest {} of MSR {index:#x} raises #GP(0) (not in the virtual MSR file)",
                if write { "wrmsr" } else { "rdmsr" }
            );
        }
        gp0()
    }
}

fn gp0() -> Event {
    Event::fault(GP, 0)
}

/// The segment register `r` names.
fn sreg_of(r: Register) -> Option<Sreg> {
    Some(match r {
        Register::ES => Sreg::Es,
        Register::CS => Sreg::Cs,
        Register::SS => Sreg::Ss,
        Register::DS => Sreg::Ds,
        Register::FS => Sreg::Fs,
        Register::GS => Sreg::Gs,
        _ => return None,
    })
}

/// The 64-bit GPR `r` is part of.
fn gpr(r: Register) -> Option<Gpr> {
    let full = r.full_register();
    Gpr::from_number(full.number() as u8).filter(|_| full.is_gpr64())
}

impl Vcpu<'_> {
    /// The linear address of `i`'s memory operand (FS/GS: their virtual bases).
    pub fn data_address(&self, i: &Instruction, regs: &GuestRegs) -> Option<u64> {
        i.virtual_address(0, 0, |reg, _, _| {
            if reg.is_segment_register() {
                return Some(match reg {
                    Register::FS => self.segs.sregs[Sreg::Fs as usize].base,
                    Register::GS => self.segs.sregs[Sreg::Gs as usize].base,
                    _ => 0,
                });
            }
            let v = regs.get(gpr(reg)?);
            Some(if reg.is_gpr32() { v & 0xffff_ffff } else { v })
        })
    }

    /// The memory operand's address, or #GP(0) if it is non-canonical.
    fn operand_address(&self, i: &Instruction, regs: &GuestRegs) -> Result<u64, Event> {
        self.data_address(i, regs)
            .filter(|&a| ((a as i64) << 16 >> 16) as u64 == a)
            .ok_or_else(gp0)
    }

    /// Reads the 16-bit register or memory operand `op` of `i`.
    fn read_rm16(&mut self, i: &Instruction, op: u32, regs: &GuestRegs) -> Result<u16, Event> {
        if i.op_kind(op) == OpKind::Register {
            return Ok(gpr(i.op_register(op)).map_or(0, |n| regs.get(n) as u16));
        }
        let ea = self.operand_address(i, regs)?;
        let mut b = [0u8; 2];
        self.read(ea, &mut b)?;
        Ok(u16::from_le_bytes(b))
    }

    /// Writes `v` to `i`'s first operand: 16 bits to memory or a 16-bit register, the
    /// zero-extended value to a 32/64-bit register.
    fn write_rm16(&mut self, i: &Instruction, v: u16, regs: &mut GuestRegs) -> Result<(), Event> {
        if i.op0_kind() == OpKind::Register {
            let r = i.op0_register();
            if let Some(n) = gpr(r) {
                let old = regs.get(n);
                regs.set(
                    n,
                    if r.is_gpr16() {
                        (old & !0xffff) | u64::from(v)
                    } else {
                        u64::from(v)
                    },
                );
            }
            return Ok(());
        }
        let ea = self.operand_address(i, regs)?;
        self.write(ea, &v.to_le_bytes())
    }

    /// Loads DS/ES/SS/FS/GS with `sel` (the checks in [`Segments::load_data`]); an FS/GS
    /// base change goes to the hardware base too.
    fn load_sreg(&mut self, reg: Sreg, sel: u16) -> Result<(), Event> {
        let old_base = self.segs.sregs[reg as usize].base;
        let mem = self.mem();
        self.segs
            .load_data(&mem, self.gdtr, reg, sel)
            .map_err(Event::from_guest_fault)?;
        let base = self.segs.sregs[reg as usize].base;
        if matches!(reg, Sreg::Fs | Sreg::Gs) && base != old_base {
            transitions::set_hw_base(reg == Sreg::Fs, base);
        }
        Ok(())
    }

    /// `retf` (16/32/64-bit operand size, optional immediate): same privilege only.
    fn far_return(&mut self, i: &Instruction, regs: &mut GuestRegs) -> Step {
        let size: u64 = match i.code() {
            Code::Retfw | Code::Retfw_imm16 => 2,
            Code::Retfd | Code::Retfd_imm16 => 4,
            _ => 8,
        };
        let rsp = regs.get(Gpr::Rsp);
        let mut b = [0u8; 16];
        let sz = size as usize;
        self.read(rsp, &mut b[..2 * sz])?;
        let mut ip = [0u8; 8];
        ip[..sz].copy_from_slice(&b[..sz]);
        let rip = u64::from_le_bytes(ip);
        let sel = u16::from_le_bytes([b[sz], b[sz + 1]]);
        let mem = self.mem();
        let (d, c) = match self.segs.check_far_return_cs(&mem, self.gdtr, sel) {
            Ok(Some(dc)) => dc,
            Ok(None) => {
                return self.stop(
                    Some(i.mnemonic()),
                    "a far return to an outer privilege level is not emulated yet",
                )
            }
            Err(f) => return Err(Event::from_guest_fault(f)),
        };
        if c.l == 0 || c.db != 0 {
            return self.stop(
                Some(i.mnemonic()),
                "a far return to a non-64-bit code segment (only 64-bit code is translated)",
            );
        }
        if ((rip as i64) << 16 >> 16) as u64 != rip {
            return Err(gp0());
        }
        self.segs
            .commit_cs(&mem, &d, c)
            .map_err(Event::from_guest_fault)?;
        let imm = if i.op_count() > 0 {
            u64::from(i.immediate16())
        } else {
            0
        };
        regs.set(Gpr::Rsp, rsp.wrapping_add(2 * size + imm));
        Ok(Emulation::Continue(GuestVirt(rip)))
    }

    /// `hlt` at CPL 0 with IF = 1: waits in the gate until an interrupt is pending, then
    /// delivers it with RIP after the `hlt`.
    fn halt(&mut self, regs: &mut GuestRegs, next: GuestVirt) -> Step {
        if !self.vif {
            return self.stop(
                Some(Mnemonic::Hlt),
                "guest halted with interrupts disabled (nothing can wake it)",
            );
        }
        loop {
            match self.deliver_pending(regs, next.0) {
                Ok(Some(handler)) => return Ok(Emulation::Continue(GuestVirt(handler))),
                Ok(None) => {
                    self.stats.halts += 1;
                    gate::hlt();
                }
                Err(t) => {
                    self.triple = Some(t);
                    return Ok(Emulation::Stop);
                }
            }
        }
    }

    /// The emulation of one decoded instruction.
    fn emulate_insn(
        &mut self,
        insn: &SensitiveInsn,
        i: &Instruction,
        regs: &mut GuestRegs,
        next: GuestVirt,
    ) -> Step {
        let cpl = self.cpl();
        let dx = regs.get(Gpr::Rdx) as u16;
        let go = Ok(Emulation::Continue(next));
        // Instructions that need CPL 0 (IOPL-sensitive ones are checked below).
        let privileged = matches!(
            i.mnemonic(),
            Mnemonic::Hlt
                | Mnemonic::Lgdt
                | Mnemonic::Lidt
                | Mnemonic::Ltr
                | Mnemonic::Lldt
                | Mnemonic::Mov
                | Mnemonic::Rdmsr
                | Mnemonic::Wrmsr
                | Mnemonic::Swapgs
                | Mnemonic::Sysretq
                | Mnemonic::Invlpg
                | Mnemonic::Wbinvd
                | Mnemonic::Invd
                | Mnemonic::Clts
                | Mnemonic::Lmsw
        ) && insn.kind != SensitiveKind::SegmentRegister;
        if privileged && cpl != 0 {
            return Err(gp0());
        }
        let iopl_ok = cpl <= self.iopl;
        // CR4.UMIP: the store-descriptor-table instructions need CPL 0.
        if cpl != 0
            && self.cr4 & CR4_UMIP != 0
            && matches!(
                i.mnemonic(),
                Mnemonic::Sgdt | Mnemonic::Sidt | Mnemonic::Sldt | Mnemonic::Str | Mnemonic::Smsw
            )
        {
            return Err(gp0());
        }
        match i.code() {
            Code::Smsw_rm16 | Code::Smsw_r32m16 | Code::Smsw_r64m16 => {
                // A register destination gets the whole CR0 (bits above 15 are
                // undefined for 32/64-bit operands; real CPUs give CR0).
                if i.op0_kind() == OpKind::Register {
                    let r = i.op0_register();
                    if let Some(n) = gpr(r) {
                        let old = regs.get(n);
                        regs.set(
                            n,
                            if r.is_gpr16() {
                                (old & !0xffff) | (self.cr0 & 0xffff)
                            } else {
                                self.cr0
                            },
                        );
                    }
                    return go;
                }
                self.write_rm16(i, self.cr0 as u16, regs)?;
                go
            }
            // CR0.TS is always clear here (setting it stops), so `clts` changes nothing.
            Code::Clts => go,
            Code::Lmsw_rm16 | Code::Lmsw_r32m16 => {
                // Loads MP, EM, TS and may set (never clear) PE.
                let w = u64::from(self.read_rm16(i, 0, regs)?) & 0xf;
                let v = (self.cr0 & !0xe) | w | (self.cr0 & CR0_PE);
                self.write_cr0(i, v, next)
            }
            // Caches are invisible to the guest in a VM: write-back and invalidation
            // have nothing to do.
            Code::Wbinvd | Code::Invd => go,
            // CR4.OSXSAVE can never be set (CPUID hides XSAVE), so both are #UD.
            Code::Xgetbv | Code::Xsetbv => Err(Event::exception(UD)),
            Code::Rdtscp => {
                if self.block.cpuid(0x8000_0001, 0)[3] & (1 << 27) == 0 {
                    return Err(Event::exception(UD));
                }
                let t = crate::timer::tsc();
                regs.set(Gpr::Rax, t & 0xffff_ffff);
                regs.set(Gpr::Rdx, t >> 32);
                regs.set(Gpr::Rcx, self.msrs.tsc_aux & 0xffff_ffff);
                go
            }
            Code::Rdpid_r64 => {
                if self.block.cpuid(7, 0)[2] & (1 << 22) == 0 {
                    return Err(Event::exception(UD));
                }
                if let Some(r) = gpr(i.op0_register()) {
                    regs.set(r, self.msrs.tsc_aux & 0xffff_ffff);
                }
                go
            }
            Code::Out_imm8_AL
            | Code::Out_DX_AL
            | Code::Out_imm8_AX
            | Code::Out_DX_AX
            | Code::Out_imm8_EAX
            | Code::Out_DX_EAX
            | Code::In_AL_imm8
            | Code::In_AL_DX
            | Code::In_AX_imm8
            | Code::In_AX_DX
            | Code::In_EAX_imm8
            | Code::In_EAX_DX => {
                if !iopl_ok {
                    // The TSS I/O bitmap is not consulted: IOPL < CPL always faults.
                    return Err(gp0());
                }
                let port =
                    if i.op_kind(0) == OpKind::Immediate8 || i.op_kind(1) == OpKind::Immediate8 {
                        u16::from(i.immediate8())
                    } else {
                        dx
                    };
                let size = match i.code() {
                    Code::Out_imm8_AL | Code::Out_DX_AL | Code::In_AL_imm8 | Code::In_AL_DX => 1,
                    Code::Out_imm8_AX | Code::Out_DX_AX | Code::In_AX_imm8 | Code::In_AX_DX => 2,
                    _ => 4,
                };
                let rax = regs.get(Gpr::Rax);
                if i.mnemonic() == Mnemonic::Out {
                    self.stats.outs += 1;
                    if kpin_abi::ports::ends_the_run(port, size, rax as u32) {
                        self.final_write = Some((port, size, rax as u32));
                        return Ok(Emulation::Stop);
                    }
                    gate::out(port, size, rax as u32);
                } else {
                    self.stats.ins += 1;
                    let v = u64::from(gate::input(port, size));
                    regs.set(
                        Gpr::Rax,
                        match size {
                            1 => (rax & !0xff) | v,
                            2 => (rax & !0xffff) | v,
                            // A 32-bit destination zero-extends.
                            _ => v,
                        },
                    );
                }
                go
            }
            Code::Cpuid if cpl != 0 && self.msrs.misc_features & 1 != 0 => Err(gp0()),
            Code::Cpuid => {
                let [a, b, c, d] = self
                    .block
                    .cpuid(regs.get(Gpr::Rax) as u32, regs.get(Gpr::Rcx) as u32);
                regs.set(Gpr::Rax, u64::from(a));
                regs.set(Gpr::Rbx, u64::from(b));
                regs.set(Gpr::Rcx, u64::from(c));
                regs.set(Gpr::Rdx, u64::from(d));
                self.stats.cpuids += 1;
                go
            }
            Code::Mov_r64_cr => {
                let v = match i.op1_register() {
                    Register::CR0 => self.cr0,
                    Register::CR2 => self.cr2,
                    Register::CR3 => self.cr3(),
                    Register::CR4 => self.cr4,
                    Register::CR8 => 0,
                    _ => return Err(Event::exception(UD)),
                };
                if let Some(r) = gpr(i.op0_register()) {
                    regs.set(r, v);
                }
                go
            }
            Code::Mov_r64_dr => {
                let v = match i.op1_register() {
                    Register::DR0 => self.dr[0],
                    Register::DR1 => self.dr[1],
                    Register::DR2 => self.dr[2],
                    Register::DR3 => self.dr[3],
                    Register::DR4 | Register::DR5 if self.cr4 & CR4_DE != 0 => {
                        return Err(Event::exception(UD))
                    }
                    Register::DR4 | Register::DR6 => self.dr6,
                    Register::DR5 | Register::DR7 => self.dr7,
                    _ => return Err(Event::exception(UD)),
                };
                if let Some(r) = gpr(i.op0_register()) {
                    regs.set(r, v);
                }
                go
            }
            Code::Mov_dr_r64 => {
                let v = gpr(i.op1_register()).map_or(0, |r| regs.get(r));
                match i.op0_register() {
                    r @ (Register::DR0 | Register::DR1 | Register::DR2 | Register::DR3) => {
                        self.dr[(r as usize) - (Register::DR0 as usize)] = v;
                    }
                    Register::DR4 | Register::DR5 if self.cr4 & CR4_DE != 0 => {
                        return Err(Event::exception(UD))
                    }
                    Register::DR4 | Register::DR6 => {
                        if v >> 32 != 0 {
                            return Err(gp0());
                        }
                        // B0–B3, BD, BS, BT are writable; the rest reads fixed.
                        self.dr6 = (v & 0xe00f) | DR6_INIT;
                    }
                    Register::DR5 | Register::DR7 => {
                        if v >> 32 != 0 {
                            return Err(gp0());
                        }
                        // L0–L3/G0–G3 enable breakpoints, GD the general-detect trap.
                        if v & 0x20ff != 0 {
                            return self.stop(
                                Some(i.mnemonic()),
                                "a DR7 write that enables a hardware breakpoint (or general detect) is not virtualized",
                            );
                        }
                        self.dr7 = (v & !0xd800) | DR7_INIT;
                    }
                    _ => return Err(Event::exception(UD)),
                }
                go
            }
            Code::Mov_cr_r64 => {
                let v = gpr(i.op1_register()).map_or(0, |r| regs.get(r));
                self.write_cr(i, v, next)
            }
            Code::Invlpg_m => {
                // A non-canonical operand is a no-op on hardware (no #GP for invlpg).
                let va = self.data_address(i, regs).unwrap_or(0);
                let r = self.shadow.borrow_mut().invlpg(va);
                self.shadow_done(r, next)
            }
            Code::Cli | Code::Sti if !iopl_ok => Err(gp0()),
            Code::Cli => {
                self.vif = false;
                go
            }
            Code::Sti => {
                let was = self.vif;
                self.vif = true;
                self.sti_next = Some(next.0);
                // The interrupt shadow, approximated: `sti; hlt` delivers from the `hlt`
                // (RIP after it, as hardware does); any other instruction after `sti`
                // may see the interrupt before it runs (no one-instruction shadow).
                let mut b = [0u8; 1];
                let hlt_next = self.mem().read_virt(next.0, self.mode(), &mut b) && b[0] == 0xf4;
                if !was && !hlt_next {
                    irq::rearm_if_pending();
                }
                go
            }
            Code::Pushfq => {
                let image = self.rflags_image(regs.rflags);
                let rsp = regs.get(Gpr::Rsp).wrapping_sub(8);
                self.write(rsp, &image.to_le_bytes())?;
                regs.set(Gpr::Rsp, rsp);
                go
            }
            Code::Popfq => {
                let rsp = regs.get(Gpr::Rsp);
                let mut b = [0u8; 8];
                self.read(rsp, &mut b)?;
                self.load_rflags(regs, u64::from_le_bytes(b), cpl, false);
                regs.set(Gpr::Rsp, rsp.wrapping_add(8));
                go
            }
            Code::Lgdt_m1664 | Code::Lidt_m1664 => {
                let ea = self.operand_address(i, regs)?;
                let mut bytes = [0u8; 10];
                self.read(ea, &mut bytes)?;
                let limit = u16::from_le_bytes([bytes[0], bytes[1]]);
                let mut base = [0u8; 8];
                base.copy_from_slice(&bytes[2..]);
                let table = DescriptorTable {
                    base: u64::from_le_bytes(base),
                    limit,
                };
                if i.code() == Code::Lgdt_m1664 {
                    self.gdtr = table;
                } else {
                    self.idtr = table;
                }
                go
            }
            Code::Sgdt_m1664 | Code::Sidt_m1664 => {
                let t = if i.code() == Code::Sgdt_m1664 {
                    self.gdtr
                } else {
                    self.idtr
                };
                let mut bytes = [0u8; 10];
                bytes[..2].copy_from_slice(&t.limit.to_le_bytes());
                bytes[2..].copy_from_slice(&t.base.to_le_bytes());
                let ea = self.operand_address(i, regs)?;
                self.write(ea, &bytes)?;
                go
            }
            Code::Mov_Sreg_rm16 | Code::Mov_Sreg_r32m16 | Code::Mov_Sreg_r64m16 => {
                let Some(reg) = sreg_of(i.op0_register()).filter(|&r| r != Sreg::Cs) else {
                    return Err(Event::exception(UD));
                };
                let sel = self.read_rm16(i, 1, regs)?;
                self.load_sreg(reg, sel)?;
                go
            }
            Code::Mov_rm16_Sreg | Code::Mov_r32m16_Sreg | Code::Mov_r64m16_Sreg => {
                let Some(reg) = sreg_of(i.op1_register()) else {
                    return Err(Event::exception(UD));
                };
                let sel = self.segs.sregs[reg as usize].selector;
                self.write_rm16(i, sel, regs)?;
                go
            }
            Code::Str_rm16 | Code::Str_r32m16 | Code::Str_r64m16 => {
                let sel = self.segs.tr.selector;
                self.write_rm16(i, sel, regs)?;
                go
            }
            Code::Sldt_rm16 | Code::Sldt_r32m16 | Code::Sldt_r64m16 => {
                let sel = self.segs.ldtr.selector;
                self.write_rm16(i, sel, regs)?;
                go
            }
            Code::Ltr_rm16
            | Code::Ltr_r32m16
            | Code::Ltr_r64m16
            | Code::Lldt_rm16
            | Code::Lldt_r32m16
            | Code::Lldt_r64m16 => {
                let sel = self.read_rm16(i, 0, regs)?;
                let ldt = i.mnemonic() == Mnemonic::Lldt;
                let mem = self.mem();
                self.segs
                    .load_system(&mem, self.gdtr, sel, ldt)
                    .map_err(Event::from_guest_fault)?;
                go
            }
            Code::Pushw_FS | Code::Pushq_FS | Code::Pushw_GS | Code::Pushq_GS => {
                let reg = if matches!(i.code(), Code::Pushw_FS | Code::Pushq_FS) {
                    Sreg::Fs
                } else {
                    Sreg::Gs
                };
                let size = if matches!(i.code(), Code::Pushw_FS | Code::Pushw_GS) {
                    2
                } else {
                    8
                };
                let v = u64::from(self.segs.sregs[reg as usize].selector).to_le_bytes();
                let rsp = regs.get(Gpr::Rsp).wrapping_sub(size as u64);
                self.write(rsp, &v[..size])?;
                regs.set(Gpr::Rsp, rsp);
                go
            }
            Code::Popw_FS | Code::Popq_FS | Code::Popw_GS | Code::Popq_GS => {
                let reg = if matches!(i.code(), Code::Popw_FS | Code::Popq_FS) {
                    Sreg::Fs
                } else {
                    Sreg::Gs
                };
                let size = if matches!(i.code(), Code::Popw_FS | Code::Popw_GS) {
                    2
                } else {
                    8
                };
                let rsp = regs.get(Gpr::Rsp);
                let mut b = [0u8; 2];
                self.read(rsp, &mut b)?;
                self.load_sreg(reg, u16::from_le_bytes(b))?;
                regs.set(Gpr::Rsp, rsp.wrapping_add(size));
                go
            }
            Code::Retfw
            | Code::Retfd
            | Code::Retfq
            | Code::Retfw_imm16
            | Code::Retfd_imm16
            | Code::Retfq_imm16 => self.far_return(i, regs),
            Code::Iretq => {
                let rip = deliver::iretq(self, regs)?;
                Ok(Emulation::Continue(GuestVirt(rip)))
            }
            Code::Syscall => {
                let rip = transitions::syscall(self, regs, next.0)?;
                Ok(Emulation::Continue(GuestVirt(rip)))
            }
            Code::Sysretq => {
                let rip = transitions::sysretq(self, regs)?;
                Ok(Emulation::Continue(GuestVirt(rip)))
            }
            Code::Swapgs => {
                transitions::swapgs(self)?;
                go
            }
            Code::Rdfsbase_r64 | Code::Rdgsbase_r64 => {
                let v = transitions::read_base(self, i.code() == Code::Rdfsbase_r64)?;
                if let Some(r) = gpr(i.op0_register()) {
                    regs.set(r, v);
                }
                go
            }
            Code::Wrfsbase_r64 | Code::Wrgsbase_r64 => {
                let v = gpr(i.op0_register()).map_or(0, |r| regs.get(r));
                transitions::write_base(self, i.code() == Code::Wrfsbase_r64, v)?;
                go
            }
            Code::Rdmsr if self.msrs.read_passes_through(regs.get(Gpr::Rcx) as u32) => {
                let v = gate::rdmsr(regs.get(Gpr::Rcx) as u32);
                regs.set(Gpr::Rax, v & 0xffff_ffff);
                regs.set(Gpr::Rdx, v >> 32);
                go
            }
            Code::Wrmsr
                if regs.get(Gpr::Rcx) as u32 == index::APIC_BASE
                    && regs.get(Gpr::Rax) & 0xffff_f000 != crate::shadow::LAPIC_FRAME =>
            {
                self.stop(
                    Some(i.mnemonic()),
                    "an APIC_BASE write that moves the local APIC from 0xfee00000 is not emulated (the shadow MMU maps only the default page)",
                )
            }
            Code::Wrmsr if self.msrs.passes_through(regs.get(Gpr::Rcx) as u32) => {
                let v = (regs.get(Gpr::Rdx) << 32) | (regs.get(Gpr::Rax) & 0xffff_ffff);
                // SAFETY: `passes_through` lists only MSRs whose effect is the guest's
                // (microcode signature, the local APIC the engine does not use, kvm-clock
                // pages in guest-physical memory; APIC_BASE cannot move, checked above).
                unsafe { gate::wrmsr(regs.get(Gpr::Rcx) as u32, v) };
                go
            }
            Code::Rdmsr => {
                let fs = self.segs.sregs[Sreg::Fs as usize].base;
                let gs = self.segs.sregs[Sreg::Gs as usize].base;
                let idx = regs.get(Gpr::Rcx) as u32;
                // An index the virtual CPU does not keep reads what KVM answers a native
                // guest (MTRRs, FEATURE_CONTROL, platform info, …): reading changes
                // nothing, and every MSR the engine itself depends on is virtual above.
                let v = match self.msrs.read(idx, fs, gs) {
                    Some(v) => v,
                    None => gate::rdmsr_safe(idx).ok_or_else(|| self.msr_gp(idx, false))?,
                };
                regs.set(Gpr::Rax, v & 0xffff_ffff);
                regs.set(Gpr::Rdx, v >> 32);
                go
            }
            Code::Wrmsr => {
                let v = (regs.get(Gpr::Rdx) << 32) | (regs.get(Gpr::Rax) & 0xffff_ffff);
                match self
                    .msrs
                    .write(regs.get(Gpr::Rcx) as u32, v)
                    .ok_or_else(|| self.msr_gp(regs.get(Gpr::Rcx) as u32, true))?
                {
                    Written::Stored if regs.get(Gpr::Rcx) as u32 == index::EFER => {
                        if let Err(e) = self.update_paging_control() {
                            self.shadow.borrow_mut().record(e);
                            return Ok(Emulation::Stop);
                        }
                    }
                    Written::Stored => {}
                    Written::FsBase(b) => {
                        self.segs.sregs[Sreg::Fs as usize].base = b;
                        transitions::set_hw_base(true, b);
                    }
                    Written::GsBase(b) => {
                        self.segs.sregs[Sreg::Gs as usize].base = b;
                        transitions::set_hw_base(false, b);
                    }
                }
                go
            }
            Code::Int3 => Err(Event {
                vector: BP,
                error: None,
                kind: Kind::SoftException,
            }),
            Code::Int_imm8 => Err(Event {
                vector: i.immediate8(),
                error: None,
                kind: Kind::Software,
            }),
            Code::Ud0
            | Code::Ud1_r16_rm16
            | Code::Ud1_r32_rm32
            | Code::Ud1_r64_rm64
            | Code::Ud2 => Err(Event::exception(UD)),
            Code::Hlt => self.halt(regs, next),
            _ => {
                let why = match insn.kind {
                    SensitiveKind::PortIo => "string port I/O is not emulated",
                    _ => "not emulated by the virtual CPU yet",
                };
                self.stop(Some(i.mnemonic()), why)
            }
        }
    }
}

impl Platform for Vcpu<'_> {
    fn emulate(&mut self, insn: &SensitiveInsn, regs: &mut GuestRegs) -> Emulation {
        if let Some(c) = self.stats.emulated.get_mut(insn.kind as usize) {
            *c += 1;
        }
        let len = usize::from(insn.len).min(insn.bytes.len());
        let mut d = Decoder::with_ip(64, &insn.bytes[..len], insn.pc.0, DecoderOptions::NONE);
        let i = d.decode();
        let next = GuestVirt(insn.pc.0.wrapping_add(len as u64));
        let before = *regs;
        let mode_before = self.mode();
        self.sti_next = None;
        let step = if len == 0 || i.is_invalid() {
            Err(Event::exception(UD))
        } else {
            self.emulate_insn(insn, &i, regs, next)
        };
        let e = match step {
            Ok(e) => e,
            Err(ev) => {
                // Precise: the exception sees the registers from before the instruction;
                // software interrupts return after it.
                *regs = before;
                let rip = if matches!(ev.kind, Kind::Software | Kind::SoftException) {
                    next.0
                } else {
                    insn.pc.0
                };
                match self.deliver(regs, rip, ev) {
                    Ok(handler) => Emulation::Continue(GuestVirt(handler)),
                    Err(t) => {
                        self.triple = Some(t);
                        Emulation::Stop
                    }
                }
            }
        };
        // The translator must hear about the shadow's work before guest code runs
        // again, and only the run loop holds the engine: stop there and resume.
        let sh = self.shadow.borrow();
        if sh.failure().is_some() {
            return Emulation::Stop;
        }
        match e {
            Emulation::Continue(next) if sh.has_work() => {
                self.resume = Some(next);
                Emulation::Stop
            }
            // The CPL changed: traces are keyed by mode (the shadow view already follows).
            Emulation::Continue(next) if self.mode() != mode_before => Emulation::Switch {
                next,
                mode: self.mode(),
                invalidate_mappings: false,
            },
            e => e,
        }
    }

    fn segment_base(&mut self, seg: SegBase) -> u64 {
        match seg {
            SegBase::Fs => self.segs.sregs[Sreg::Fs as usize].base,
            SegBase::Gs => self.segs.sregs[Sreg::Gs as usize].base,
            _ => 0,
        }
    }
}
