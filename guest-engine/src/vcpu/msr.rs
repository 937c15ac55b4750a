//! The virtual MSR file and `rdmsr`/`wrmsr` at virtual CPL 0. Values start from the
//! attach block (the MSRs the VMM captured, EFER from the system registers) and live only
//! here; the hardware MSRs are the engine's, except the FS and GS bases, which translated
//! code uses verbatim ([`Hardware::set_hw_base`]).
//!
//! Choices: an index not listed here raises #GP(0) in the guest, as a CPU without that
//! MSR does (the engine's own EFER, STAR, APIC… must not be the guest's), except a few
//! that are passed through to KVM by the gate because their effect concerns only the
//! guest ([`MsrFile::passes_through`]): the microcode signature (0x8b);
//! IA32_ARCH_CAPABILITIES (read only); IA32_TSC_ADJUST; KVM's steal-time, PV-EOI and
//! poll-control MSRs when CPUID offers them; the local APIC's (APIC_BASE, TSC_DEADLINE,
//! the x2APIC registers 0x800–0x8ff when CPUID offers x2APIC): the engine's interrupts
//! come through the 8259, so KVM's in-kernel local APIC is the guest's, and its page is
//! mapped into the shadow as it is (the image's shadow MMU); an APIC_BASE write that
//! moves the base stops; and, when the CPUID table offers kvm-clock, its wall-clock and
//! system-time MSRs (KVM writes the pvclock data into guest-physical memory, which is the
//! guest's under the engine too). EFER: only SCE and NXE may change (LME/LMA must stay:
//! only 64-bit code is translated), other bits are reserved → #GP(0). MISC_ENABLE reads
//! the value KVM gives a fresh vCPU (fast strings) and ignores writes; the TSC reads the
//! hardware TSC. Any other index the virtual CPU does not keep reads what KVM answers a
//! native guest ([`Hardware::rdmsr_safe`]), or #GP(0) if KVM has none.

use iced_x86::Instruction;
use kpin_abi::attach::AttachBlock;
use kpin_abi::x86::msr as index;
use kpin_abi::x86::{efer, is_canonical as canonical};

use super::emulate::{gp0, Flow, Step};
use super::events::Event;
use super::hardware::{GuestMmu, Hardware};
use super::segments::Sreg;
use super::Vcpu;
use crate::{Gpr, GuestRegs, GuestVirt};

/// The guest-physical frame of the local APIC page (APIC_BASE's default): the shadow MMU
/// maps only this one.
pub const LAPIC_FRAME: u64 = 0xfee0_0000;

/// MISC_ENABLE as KVM resets it (fast strings).
const MISC_ENABLE_DEFAULT: u64 = 1;
/// PAT at reset.
const PAT_DEFAULT: u64 = 0x0007_0406_0007_0406;

/// The MSRs the virtual CPU keeps (FS/GS base live in the segment caches).
pub struct MsrFile {
    /// EFER.
    pub efer: u64,
    /// STAR.
    pub star: u64,
    /// LSTAR.
    pub lstar: u64,
    /// CSTAR.
    pub cstar: u64,
    /// SFMASK.
    pub sfmask: u64,
    /// KERNEL_GS_BASE.
    pub kernel_gs_base: u64,
    /// TSC_AUX.
    pub tsc_aux: u64,
    /// SYSENTER_CS/ESP/EIP.
    pub sysenter: [u64; 3],
    /// PAT.
    pub pat: u64,
    /// MISC_FEATURES_ENABLES: bit 0, CPUID faulting (`cpuid` at CPL > 0 is #GP(0)),
    /// emulated by the virtual CPU's `cpuid`.
    pub misc_features: u64,
    /// CPUID 0x4000_0001 EAX (KVM paravirtual features), for the kvm-clock MSRs.
    kvm_features: u32,
    /// CPUID offers the x2APIC.
    x2apic: bool,
    /// CPUID offers IA32_TSC_ADJUST.
    tsc_adjust: bool,
    /// CPUID offers IA32_ARCH_CAPABILITIES.
    arch_capabilities: bool,
}

/// IA32_BIOS_SIGN_ID (microcode revision, written 0 then read after a CPUID).
const BIOS_SIGN_ID: u32 = index::BIOS_SIGN_ID;
/// The x2APIC register MSRs (CPUID 1.ECX[21]).
const X2APIC: core::ops::RangeInclusive<u32> = index::X2APIC_FIRST..=index::X2APIC_LAST;
/// kvm-clock MSRs, old (0x11/0x12, CPUID 0x4000_0001 EAX bit 0) and new
/// (0x4b56_4d00/01, bit 3).
const KVM_CLOCK_OLD: [u32; 2] = [index::KVM_WALL_CLOCK_OLD, index::KVM_SYSTEM_TIME_OLD];
const KVM_CLOCK_NEW: [u32; 2] = [index::KVM_WALL_CLOCK_NEW, index::KVM_SYSTEM_TIME_NEW];
/// Other KVM paravirtual MSRs whose effect is the guest's own, with their CPUID
/// 0x4000_0001 EAX feature bit: steal time (5; KVM writes the record into guest memory),
/// PV EOI (6; KVM and the guest's EOI path share a flag in guest memory), poll control
/// (12; host-side halt polling). (Async page faults are hidden by the VMM's CPUID table:
/// KVM would inject them as #PF into the engine at CPL 3.)
const KVM_PV: [(u32, u32); 3] = [
    (index::KVM_STEAL_TIME, 5),
    (index::KVM_PV_EOI_EN, 6),
    (index::KVM_POLL_CONTROL, 12),
];
/// IA32_TSC_ADJUST (CPUID 7.EBX[1]): KVM's, moving the guest's TSC (the engine reads
/// the TSC only to measure).
const TSC_ADJUST: u32 = index::TSC_ADJUST;
/// IA32_ARCH_CAPABILITIES (read-only; CPUID 7.EDX[29]): read from KVM.
const ARCH_CAPABILITIES: u32 = index::ARCH_CAPABILITIES;

/// What a write did beyond storing the value.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Written {
    /// Stored.
    Stored,
    /// FS base changed: the caller updates the segment cache and the hardware base.
    FsBase(u64),
    /// GS base changed: likewise.
    GsBase(u64),
}

/// CPUID 0x4000_0001 EAX if leaf 0x4000_0000 names KVM, else 0.
fn kvm_features(b: &AttachBlock) -> u32 {
    let [_, ebx, ecx, edx] = b.cpuid(0x4000_0000, 0);
    let mut sig = [0u8; 12];
    sig[..4].copy_from_slice(&ebx.to_le_bytes());
    sig[4..8].copy_from_slice(&ecx.to_le_bytes());
    sig[8..].copy_from_slice(&edx.to_le_bytes());
    if &sig == b"KVMKVMKVM\0\0\0" {
        b.cpuid(0x4000_0001, 0)[0]
    } else {
        0
    }
}

impl MsrFile {
    /// The MSRs the VMM captured at attach.
    pub fn new(b: &AttachBlock) -> Self {
        let n = (b.msr_count as usize).min(b.msrs.len());
        let get = |i: u32, default: u64| {
            b.msrs[..n]
                .iter()
                .find(|m| m.index == i)
                .map_or(default, |m| m.value)
        };
        Self {
            efer: b.sregs.efer,
            star: get(index::STAR, 0),
            lstar: get(index::LSTAR, 0),
            cstar: get(index::CSTAR, 0),
            sfmask: get(index::SFMASK, 0),
            kernel_gs_base: get(index::KERNEL_GS_BASE, 0),
            tsc_aux: get(index::TSC_AUX, 0),
            sysenter: [
                get(index::SYSENTER_CS, 0),
                get(index::SYSENTER_ESP, 0),
                get(index::SYSENTER_EIP, 0),
            ],
            pat: get(index::PAT, PAT_DEFAULT),
            misc_features: 0,
            kvm_features: kvm_features(b),
            x2apic: b.cpuid(1, 0)[2] & (1 << 21) != 0,
            arch_capabilities: b.cpuid(7, 0)[3] & (1 << 29) != 0,
            tsc_adjust: b.cpuid(7, 0)[1] & (1 << 1) != 0,
        }
    }

    /// Whether `rdmsr`/`wrmsr` of `i` go to KVM through the gate (see the module header).
    pub fn passes_through(&self, i: u32) -> bool {
        i == BIOS_SIGN_ID
            || i == index::APIC_BASE
            || i == index::TSC_DEADLINE
            || (X2APIC.contains(&i) && self.x2apic)
            || (i == TSC_ADJUST && self.tsc_adjust)
            || (KVM_CLOCK_OLD.contains(&i) && self.kvm_features & 1 != 0)
            || (KVM_CLOCK_NEW.contains(&i) && self.kvm_features & (1 << 3) != 0)
            || KVM_PV
                .iter()
                .any(|&(m, bit)| m == i && self.kvm_features & (1 << bit) != 0)
    }

    /// Whether `rdmsr` of `i` goes to KVM: [`MsrFile::passes_through`] and the read-only
    /// MSRs KVM models (a write to them is #GP(0), as on hardware).
    pub fn read_passes_through(&self, i: u32) -> bool {
        self.passes_through(i) || (i == ARCH_CAPABILITIES && self.arch_capabilities)
    }

    /// `rdmsr`: the value, or `None` for #GP(0). FS/GS base and the TSC come from the
    /// caller.
    pub fn read(&self, i: u32, fs_base: u64, gs_base: u64, tsc: u64) -> Option<u64> {
        Some(match i {
            index::TSC => tsc,
            index::SYSENTER_CS => self.sysenter[0],
            index::SYSENTER_ESP => self.sysenter[1],
            index::SYSENTER_EIP => self.sysenter[2],
            index::MISC_ENABLE => MISC_ENABLE_DEFAULT,
            index::PAT => self.pat,
            index::MISC_FEATURES_ENABLES => self.misc_features,
            index::EFER => self.efer,
            index::STAR => self.star,
            index::LSTAR => self.lstar,
            index::CSTAR => self.cstar,
            index::SFMASK => self.sfmask,
            index::FS_BASE => fs_base,
            index::GS_BASE => gs_base,
            index::KERNEL_GS_BASE => self.kernel_gs_base,
            index::TSC_AUX => self.tsc_aux,
            _ => return None,
        })
    }

    /// `wrmsr`: `None` for #GP(0) (unknown index, reserved bits, non-canonical address).
    pub fn write(&mut self, i: u32, v: u64) -> Option<Written> {
        let addr = |v: u64| canonical(v).then_some(v);
        match i {
            index::EFER => {
                if (v ^ self.efer) & !(efer::SCE | efer::NXE) != 0 {
                    return None;
                }
                self.efer = v;
            }
            index::STAR => self.star = v,
            index::LSTAR => self.lstar = addr(v)?,
            index::CSTAR => self.cstar = addr(v)?,
            index::SFMASK => self.sfmask = v & 0xffff_ffff,
            index::KERNEL_GS_BASE => self.kernel_gs_base = addr(v)?,
            index::TSC_AUX => self.tsc_aux = v & 0xffff_ffff,
            index::SYSENTER_CS => self.sysenter[0] = v,
            index::SYSENTER_ESP => self.sysenter[1] = addr(v)?,
            index::SYSENTER_EIP => self.sysenter[2] = addr(v)?,
            index::PAT => self.pat = v,
            // CPUID faulting only (ring-3 MWAIT is not offered).
            index::MISC_FEATURES_ENABLES if v & !1 == 0 => self.misc_features = v,
            index::MISC_ENABLE => {}
            index::FS_BASE => return Some(Written::FsBase(addr(v)?)),
            index::GS_BASE => return Some(Written::GsBase(addr(v)?)),
            _ => return None,
        }
        Some(Written::Stored)
    }
}

/// Up to 32 MSR indices remembered, for logging each once.
pub struct LogOnce([core::sync::atomic::AtomicU64; 32]);

impl Default for LogOnce {
    fn default() -> Self {
        Self::new()
    }
}

impl LogOnce {
    /// Nothing remembered.
    pub const fn new() -> Self {
        #[allow(clippy::declare_interior_mutable_const)]
        const E: core::sync::atomic::AtomicU64 = core::sync::atomic::AtomicU64::new(0);
        Self([E; 32])
    }

    /// `true` the first time `index` is seen (and whenever the table is full).
    pub fn first(&self, index: u32) -> bool {
        use core::sync::atomic::Ordering::Relaxed;
        let key = u64::from(index) | 1 << 32;
        for slot in &self.0 {
            match slot.load(Relaxed) {
                0 => {
                    slot.store(key, Relaxed);
                    return true;
                }
                k if k == key => return false,
                _ => {}
            }
        }
        true
    }
}

impl<H: Hardware, M: GuestMmu> Vcpu<'_, H, M> {
    /// The #GP(0) an `rdmsr`/`wrmsr` of an index the virtual CPU does not have raises;
    /// logged once per index (the guest handles it, but a difference from native is
    /// worth seeing in engine.log).
    fn msr_gp(&mut self, index: u32, write: bool) -> Event {
        if self.msr_gp_logged.first(index) {
            self.hw.log(format_args!(
                "engine: guest {} of MSR {index:#x} raises #GP(0) (not in the virtual MSR file)",
                if write { "wrmsr" } else { "rdmsr" }
            ));
        }
        gp0()
    }

    /// `rdmsr`.
    pub(super) fn rdmsr(
        &mut self,
        _i: &Instruction,
        regs: &mut GuestRegs,
        next: GuestVirt,
    ) -> Step {
        let idx = regs.get(Gpr::Rcx) as u32;
        let v = if self.msrs.read_passes_through(idx) {
            self.hw.rdmsr_passthrough(idx)
        } else {
            let fs = self.segs.sregs[Sreg::Fs as usize].base;
            let gs = self.segs.sregs[Sreg::Gs as usize].base;
            let tsc = self.hw.tsc();
            // An index the virtual CPU does not keep reads what KVM answers a native
            // guest (MTRRs, FEATURE_CONTROL, platform info, …): reading changes
            // nothing, and every MSR the engine itself depends on is virtual above.
            match self.msrs.read(idx, fs, gs, tsc) {
                Some(v) => v,
                None => match self.hw.rdmsr_safe(idx) {
                    Some(v) => v,
                    None => return Err(self.msr_gp(idx, false)),
                },
            }
        };
        regs.set(Gpr::Rax, v & 0xffff_ffff);
        regs.set(Gpr::Rdx, v >> 32);
        Ok(Flow::Continue(next))
    }

    /// `wrmsr`.
    pub(super) fn wrmsr(&mut self, i: &Instruction, regs: &mut GuestRegs, next: GuestVirt) -> Step {
        let idx = regs.get(Gpr::Rcx) as u32;
        let v = (regs.get(Gpr::Rdx) << 32) | (regs.get(Gpr::Rax) & 0xffff_ffff);
        if idx == index::APIC_BASE && v & 0xffff_f000 != LAPIC_FRAME {
            return Ok(Flow::unsupported(
                i,
                "an APIC_BASE write that moves the local APIC from 0xfee00000 is not emulated (the shadow MMU maps only the default page)",
            ));
        }
        if self.msrs.passes_through(idx) {
            // `passes_through` lists only MSRs whose effect is the guest's (microcode
            // signature, the local APIC the engine does not use, kvm-clock pages in
            // guest-physical memory; APIC_BASE cannot move, checked above).
            self.hw.wrmsr_passthrough(idx, v);
            return Ok(Flow::Continue(next));
        }
        let Some(w) = self.msrs.write(idx, v) else {
            return Err(self.msr_gp(idx, true));
        };
        match w {
            Written::Stored if idx == index::EFER => {
                if let Err(e) = self.update_paging_control() {
                    self.mem.record_failure(e);
                    return Ok(Flow::Stop(super::VcpuStop::ShadowFailure));
                }
            }
            Written::Stored => {}
            Written::FsBase(b) => {
                self.segs.sregs[Sreg::Fs as usize].base = b;
                self.hw.set_hw_base(true, b);
            }
            Written::GsBase(b) => {
                self.segs.sregs[Sreg::Gs as usize].base = b;
                self.hw.set_hw_base(false, b);
            }
        }
        Ok(Flow::Continue(next))
    }
}
