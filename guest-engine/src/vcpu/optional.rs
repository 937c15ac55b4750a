//! Instructions whose outcome follows a CPUID feature, a control bit or the vendor: what
//! the CPU the guest sees (the attach block's CPUID table, its CR4/EFER) does with them at
//! any CPL. Most are absent from that CPU or refused outside CPL 0, so the answer is the
//! exception a CPU without the feature raises; the few that a user process may run are
//! emulated with the effects the architecture allows (`xbegin` aborting at once,
//! `mwaitx`/`umwait` waking at once).
//!
//! * `sysenter`/`sysexit` — AMD CPUs raise #UD for both in long mode; Intel's `sysenter`
//!   enters CPL 0 at SYSENTER_CS/EIP/ESP (#GP(0) with a null SYSENTER_CS), `sysexit`
//!   outside CPL 0 is #GP(0);
//! * `int1` (`icebp`) — #DB as a trap (RIP after it), not checked against the gate's DPL;
//! * `rdpmc` — #GP(0) at CPL > 0 without CR4.PCE;
//! * `rdpkru`/`wrpkru` — #UD without CR4.PKE;
//! * `monitor`/`mwait` — #UD at CPL > 0 or without the feature; `monitorx`/`mwaitx`
//!   (on AMD CPUs, which run them whatever CPUID says) and `umwait`/`tpause` (with
//!   WAITPKG) — a wait that ends at once, else #UD;
//! * TSX — `xbegin`/`xabort`/`xend`/`xtest` #UD without RTM (`xtest`: RTM or HLE); with
//!   it a transaction aborts as it begins (status 0, "no reason given"), `xend` outside
//!   one is #GP(0), `xtest` says "not in one";
//! * a null selector loaded into FS/GS zeroes the base on Intel and on AMD CPUs with
//!   NullSelectClearsBase, and keeps it on older AMD ones;
//! * `clac`/`stac` — #UD at CPL > 0 or without SMAP, else AC cleared or set;
//! * `xsaves`/`xrstors`, `invpcid` — #UD without their feature (and CR4.OSXSAVE),
//!   #GP(0) at CPL > 0;
//! * `vmcall`/`vmmcall` — KVM's hypercall for the vendor's own opcode: RAX = -1
//!   (-KVM_EPERM) from CPL > 0, as KVM answers; the other vendor's opcode #GP(0) there;
//! * `serialize` — #UD without its feature (it would run natively on a CPU that has it);
//! * VMX, SVM, SMX, SGX, user interrupts, `rsm`, `jmpe` — #UD: the virtual CPU never
//!   enables them (CR4.VMXE/SMXE, EFER.SVME stay clear).
//!
//! A case left unsupported at CPL 0 stops the run (`Flow::unsupported`); at CPL 3 the
//! common fallback in `emulate.rs` makes it #UD.

use iced_x86::{Instruction, Mnemonic};
use kpin_abi::x86::{cr4, rflags, vector};

use super::emulate::{gp0, Flow, Step};
use super::events::{Event, Kind};
use super::hardware::{GuestMmu, Hardware};
use super::segments::Sreg;
use super::Vcpu;
use crate::{Gpr, GuestRegs, GuestVirt};

/// A CPUID feature bit: leaf, subleaf, register (0 EAX … 3 EDX), bit.
#[derive(Clone, Copy)]
pub(super) struct Feature(u32, u32, usize, u32);

/// `serialize` (CPUID 7.EDX[14]).
const SERIALIZE: Feature = Feature(7, 0, 3, 14);
/// `monitor`/`mwait` (CPUID 1.ECX[3]).
const MONITOR: Feature = Feature(1, 0, 2, 3);
/// `monitorx`/`mwaitx` (CPUID 0x8000_0001.ECX[29]).
const MONITORX: Feature = Feature(0x8000_0001, 0, 2, 29);
/// `umwait`/`tpause`/`umonitor` (CPUID 7.ECX[5]).
const WAITPKG: Feature = Feature(7, 0, 2, 5);
/// Hardware lock elision (CPUID 7.EBX[4]).
const HLE: Feature = Feature(7, 0, 1, 4);
/// Restricted transactional memory (CPUID 7.EBX[11]).
const RTM: Feature = Feature(7, 0, 1, 11);
/// SMAP, `clac`/`stac` (CPUID 7.EBX[20]).
const SMAP: Feature = Feature(7, 0, 1, 20);
/// `invpcid` (CPUID 7.EBX[10]).
const INVPCID: Feature = Feature(7, 0, 1, 10);
/// `xsaves`/`xrstors` (CPUID 0xd.1.EAX[3]).
const XSAVES: Feature = Feature(0xd, 1, 0, 3);
/// KVM's answer to a hypercall from CPL > 0 is -KVM_EPERM (include/uapi/linux/kvm_para.h).
const KVM_EPERM: u64 = 1;
/// A null selector loaded into FS/GS zeroes the base (AMD: CPUID 0x8000_0021.EAX[6]).
const NULL_SELECT_CLEARS_BASE: Feature = Feature(0x8000_0021, 0, 0, 6);

impl<H: Hardware, M: GuestMmu> Vcpu<'_, H, M> {
    /// Whether the guest's CPUID table offers `f`.
    pub(super) fn has(&self, f: Feature) -> bool {
        let Feature(leaf, sub, reg, bit) = f;
        self.block.cpuid(leaf, sub)[reg] & (1 << bit) != 0
    }

    /// Whether the CPU the guest sees is AMD's (or Hygon's, which follows it): the
    /// vendor decides `sysenter`/`sysexit` in long mode and null-selector bases.
    pub(super) fn amd_like(&self) -> bool {
        let [_, b, c, d] = self.block.cpuid(0, 0);
        let mut vendor = [0u8; 12];
        vendor[..4].copy_from_slice(&b.to_le_bytes());
        vendor[4..8].copy_from_slice(&d.to_le_bytes());
        vendor[8..].copy_from_slice(&c.to_le_bytes());
        &vendor == b"AuthenticAMD" || &vendor == b"HygonGenuine"
    }

    /// Whether loading a null selector into FS or GS zeroes its base: as the embedder
    /// measured it on the hardware, else on Intel's CPUs and on AMD's that say so (CPUID
    /// 0x8000_0021 EAX[6], NullSelectClearsBase); older AMD CPUs keep the base (Linux's
    /// X86_BUG_NULL_SEG).
    pub(super) fn null_clears_base(&self) -> bool {
        self.hw
            .null_selector_clears_base()
            .unwrap_or_else(|| !self.amd_like() || self.has(NULL_SELECT_CLEARS_BASE))
    }

    /// `sysenter` in 64-bit mode.
    pub(super) fn sysenter(
        &mut self,
        _i: &Instruction,
        regs: &mut GuestRegs,
        _next: GuestVirt,
    ) -> Step {
        if self.amd_like() {
            return Err(Event::ud());
        }
        let [cs, esp, eip] = self.msrs.sysenter;
        let sel = (cs & 0xfffc) as u16;
        if sel == 0 {
            return Err(gp0());
        }
        // Flat 64-bit CS and SS at DPL 0 (SDM vol. 2, SYSENTER, IA32_EFER.LMA = 1).
        let old_cpl = self.cpl();
        self.vif = false;
        regs.rflags &= !(rflags::RF | rflags::VM | rflags::AC);
        regs.set(Gpr::Rsp, esp);
        self.segs.sregs[Sreg::Cs as usize] = super::syscall::flat(sel, true, 0);
        self.segs.sregs[Sreg::Ss as usize] = super::syscall::flat(sel + 8, false, 0);
        self.cpl_changed(old_cpl);
        Ok(Flow::Continue(GuestVirt(eip)))
    }

    /// `sysexit`: #GP(0) outside CPL 0; #UD on AMD in long mode; #GP(0) with a null
    /// SYSENTER_CS.
    pub(super) fn sysexit(
        &mut self,
        i: &Instruction,
        _regs: &mut GuestRegs,
        _n: GuestVirt,
    ) -> Step {
        // CPL first: the AMD host here gives #GP(0) at CPL 3, not #UD.
        if self.cpl() != 0 {
            return Err(gp0());
        }
        if self.amd_like() {
            return Err(Event::ud());
        }
        if self.msrs.sysenter[0] & 0xfffc == 0 {
            return Err(gp0());
        }
        Ok(Flow::unsupported(i, "sysexit at CPL 0 is not emulated"))
    }

    /// `vmcall`/`vmmcall`: the guest's CPU is a KVM vCPU (CPUID 0x4000_0000), whose
    /// hypercall instruction is the vendor's own (`vmmcall` on AMD, `vmcall` on Intel).
    /// From CPL > 0 KVM answers it with RAX = -KVM_EPERM (-1) and continues, and the
    /// other vendor's opcode with #GP(0) (#UD at CPL 0). At CPL 0 hypercalls are not
    /// forwarded: the run stops.
    pub(super) fn hypercall(
        &mut self,
        i: &Instruction,
        regs: &mut GuestRegs,
        next: GuestVirt,
    ) -> Step {
        let native = (i.mnemonic() == Mnemonic::Vmmcall) == self.amd_like();
        if !native {
            // KVM answers the other vendor's opcode as it reaches it from CPL 3: #GP(0)
            // (the AMD host here does); from CPL 0, #UD.
            return Err(if self.cpl() != 0 { gp0() } else { Event::ud() });
        }
        if self.cpl() == 0 {
            return Ok(Flow::unsupported(i, "KVM hypercalls are not forwarded"));
        }
        regs.set(Gpr::Rax, KVM_EPERM.wrapping_neg());
        Ok(Flow::Continue(next))
    }

    /// `serialize`: #UD unless CPUID 7.EDX[14] offers it (nothing else to do: the
    /// emulation itself serializes).
    pub(super) fn serialize(
        &mut self,
        _i: &Instruction,
        _r: &mut GuestRegs,
        next: GuestVirt,
    ) -> Step {
        if !self.has(SERIALIZE) {
            return Err(Event::ud());
        }
        Ok(Flow::Continue(next))
    }

    /// `int1`: #DB, a trap delivered whatever the gate's DPL.
    pub(super) fn int1(&mut self, _i: &Instruction, _r: &mut GuestRegs, _n: GuestVirt) -> Step {
        Err(Event {
            vector: vector::DB,
            error: None,
            kind: Kind::Trap,
        })
    }

    /// `rdpmc`: #GP(0) at CPL > 0 unless CR4.PCE.
    pub(super) fn rdpmc(&mut self, i: &Instruction, _r: &mut GuestRegs, _n: GuestVirt) -> Step {
        if self.cpl() != 0 && self.cr4 & cr4::PCE == 0 {
            return Err(gp0());
        }
        Ok(Flow::unsupported(
            i,
            "performance counters are not virtualized",
        ))
    }

    /// `rdpkru`/`wrpkru`: #UD without CR4.PKE (the virtual CPU hides PKU).
    pub(super) fn pkru(&mut self, i: &Instruction, _r: &mut GuestRegs, _n: GuestVirt) -> Step {
        if self.cr4 & cr4::PKE == 0 {
            return Err(Event::ud());
        }
        Ok(Flow::unsupported(i, "protection keys are not virtualized"))
    }

    /// `monitor`/`mwait`: CPL 0 only (#UD above), and only with the feature.
    pub(super) fn monitor(&mut self, i: &Instruction, _r: &mut GuestRegs, next: GuestVirt) -> Step {
        if self.cpl() != 0 || !self.has(MONITOR) {
            return Err(Event::ud());
        }
        match i.mnemonic() {
            // Arming the monitor has no visible effect.
            Mnemonic::Monitor => Ok(Flow::Continue(next)),
            _ => Ok(Flow::unsupported(i, "mwait at CPL 0 is not emulated")),
        }
    }

    /// `monitorx`/`mwaitx`, `umonitor`/`umwait`/`tpause`: #UD without the feature; else
    /// the wait ends at once (a spurious wake-up, which both allow). `umwait`/`tpause`
    /// report "woken before the deadline": CF, ZF, OF, SF, AF, PF clear.
    pub(super) fn user_wait(
        &mut self,
        i: &Instruction,
        regs: &mut GuestRegs,
        next: GuestVirt,
    ) -> Step {
        // AMD CPUs run monitorx/mwaitx at CPL 3 even where CPUID hides MONITORX (the
        // AMD host here does), so the answer follows the vendor there.
        let offered = match i.mnemonic() {
            Mnemonic::Monitorx | Mnemonic::Mwaitx => self.has(MONITORX) || self.amd_like(),
            _ => self.has(WAITPKG),
        };
        if !offered {
            return Err(Event::ud());
        }
        if matches!(i.mnemonic(), Mnemonic::Umwait | Mnemonic::Tpause) {
            regs.rflags &= !rflags::STATUS;
        }
        Ok(Flow::Continue(next))
    }

    /// TSX: `xbegin` (aborts at once to its fallback with EAX = 0), `xabort` (nothing
    /// to abort), `xend` (#GP(0): no transaction), `xtest` (ZF = 1: none).
    pub(super) fn tsx(&mut self, i: &Instruction, regs: &mut GuestRegs, next: GuestVirt) -> Step {
        let offered = self.has(RTM) || (i.mnemonic() == Mnemonic::Xtest && self.has(HLE));
        if !offered {
            return Err(Event::ud());
        }
        match i.mnemonic() {
            Mnemonic::Xbegin => {
                regs.set(Gpr::Rax, regs.get(Gpr::Rax) & !0xffff_ffff);
                Ok(Flow::Continue(GuestVirt(i.near_branch_target())))
            }
            Mnemonic::Xend => Err(gp0()),
            Mnemonic::Xtest => {
                regs.rflags = (regs.rflags & !rflags::STATUS) | rflags::ZF;
                Ok(Flow::Continue(next))
            }
            _ => Ok(Flow::Continue(next)),
        }
    }

    /// `clac`/`stac`: #UD at CPL > 0 or without SMAP; else RFLAGS.AC.
    pub(super) fn clac_stac(
        &mut self,
        i: &Instruction,
        regs: &mut GuestRegs,
        next: GuestVirt,
    ) -> Step {
        if self.cpl() != 0 || !self.has(SMAP) {
            return Err(Event::ud());
        }
        if i.mnemonic() == Mnemonic::Stac {
            regs.rflags |= rflags::AC;
        } else {
            regs.rflags &= !rflags::AC;
        }
        Ok(Flow::Continue(next))
    }

    /// `xsaves`/`xrstors` and `invpcid`: #UD without the feature, #GP(0) at CPL > 0.
    pub(super) fn supervisor_only(
        &mut self,
        i: &Instruction,
        _r: &mut GuestRegs,
        _n: GuestVirt,
    ) -> Step {
        let offered = match i.mnemonic() {
            Mnemonic::Invpcid => self.has(INVPCID),
            _ => self.has(XSAVES) && self.cr4 & cr4::OSXSAVE != 0,
        };
        if !offered {
            return Err(Event::ud());
        }
        if self.cpl() != 0 {
            return Err(gp0());
        }
        Ok(Flow::unsupported(
            i,
            "not emulated at CPL 0 by the virtual CPU yet",
        ))
    }
}
