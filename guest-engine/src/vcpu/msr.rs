//! The virtual MSR file and `rdmsr`/`wrmsr` at virtual CPL 0. Values start from the
//! attach block (the MSRs the VMM captured, EFER from the system registers) and live only
//! here; the hardware MSRs are the engine's, except the FS and GS bases, which translated
//! code uses verbatim ([`Hardware::set_hw_base`]).
//!
//! Choices: an index not listed here raises #GP(0) in the guest, as a CPU without that
//! MSR does (the engine's own EFER, STAR, APIC… must not be the guest's), except a few
//! that are passed through to KVM by the gate because their effect concerns only the
//! guest ([`MsrFile::passes_through`]): the microcode signature (0x8b); IA32_TSC_ADJUST;
//! KVM's steal-time, PV-EOI and poll-control MSRs when CPUID offers them; the local
//! APIC's (APIC_BASE, TSC_DEADLINE, the x2APIC registers 0x800–0x8ff when CPUID offers
//! x2APIC): the engine's interrupts come through the 8259, so KVM's in-kernel local APIC
//! is the guest's, and its page is mapped into the shadow as it is (the image's shadow
//! MMU); an APIC_BASE write that moves the base stops; and, when the CPUID table offers
//! kvm-clock, its wall-clock and system-time MSRs (KVM writes the pvclock data into
//! guest-physical memory, which is the guest's under the engine too). EFER: only SCE and
//! NXE may change (LME/LMA must stay: only 64-bit code is translated), other bits are
//! reserved → #GP(0). MISC_ENABLE reads the value KVM gives a fresh vCPU (fast strings)
//! and ignores writes; the TSC reads the hardware TSC. Writes to the MSRs KVM drops for
//! every guest (`WRITES_IGNORED`: AMD NB_CFG and friends) are dropped here too. The
//! speculation controls are virtual: SPEC_CTRL keeps what the guest writes (the bits
//! CPUID offers; others #GP(0)) and reads it back, PRED_CMD (IBPB) and FLUSH_CMD (L1D
//! flush) accept their one command bit and do nothing, AMD's VIRT_SPEC_CTRL keeps its
//! SSBD bit: the guest kernel runs at CPL 3 inside the engine, so none of them would
//! protect anything on the real CPU, and each would cost a gate on a hot path (kernel
//! entry, context switch).
//! IA32_ARCH_CAPABILITIES is part of the CPU model: the VMM reads KVM's value for the vCPU
//! (`vmm::attach::MODEL_MSRS`) and the virtual CPU answers with it, read-only (a write is
//! #GP(0), as on hardware). It is not read through the gate: on an AMD host this nested
//! KVM advertises it in CPUID yet #GPs a ring-0 `rdmsr` of it, while a host-initiated
//! read works. The machine-check MSRs (MCG_* and the banks) are virtual too
//! ([`super::mce`]). Any other index the virtual CPU does not keep reads what KVM answers a
//! native guest ([`Hardware::rdmsr_safe`]), or #GP(0) if KVM has none.

use iced_x86::Instruction;
use kpin_abi::attach::AttachBlock;
use kpin_abi::x86::msr as index;
use kpin_abi::x86::{efer, is_canonical as canonical};

use super::emulate::{gp0, Flow, Step};
use super::events::Event;
use super::hardware::{GuestMmu, Hardware};
use super::mce::{MachineCheck, MCG_CAP};
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
    /// IA32_SPEC_CTRL as the guest last wrote it (kept, never written to the hardware:
    /// under the engine the guest's kernel runs at CPL 3 in the engine's address space,
    /// so restricting the real CPU's speculation on its behalf would protect nothing and
    /// cost a gate on every kernel entry).
    spec_ctrl: u64,
    /// The SPEC_CTRL bits the CPUID table offers (IBRS, STIBP, SSBD); others are #GP(0).
    spec_ctrl_writable: u64,
    /// CPUID offers IBPB: PRED_CMD accepts bit 0 (a barrier with nothing to do here).
    pred_cmd: bool,
    /// CPUID offers L1D_FLUSH: FLUSH_CMD accepts bit 0.
    flush_cmd: bool,
    /// AMD's VIRT_SPEC_CTRL (its SSBD bit), when CPUID offers VIRT_SSBD.
    virt_spec_ctrl: Option<u64>,
    /// The machine-check MSRs (`mce.rs`), when KVM gave the VMM an MCG_CAP.
    machine_check: Option<MachineCheck>,
    /// IA32_ARCH_CAPABILITIES as KVM gives it to this vCPU (`None`: KVM has none, and
    /// the VMM's CPUID table does not offer it).
    arch_capabilities: Option<u64>,
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
/// MSRs whose writes KVM accepts and drops for every guest (`kvm_set_msr_common`): AMD's
/// NB_CFG (Linux sets its extended-config-space bit on AMD CPUs with an unchecked `wrmsr`),
/// the microcode update trigger and patch loader, and AMD's BU_CFG2, DC_CFG, TW_CFG and
/// family-15h EX_CFG. Reads of them go to KVM like any other index the file does not keep.
const WRITES_IGNORED: [u32; 7] = [
    0xc001_001f, // NB_CFG
    0x79,        // IA32_UCODE_WRITE
    0xc001_0020, // PATCH_LOADER
    0xc001_102a, // BU_CFG2
    0xc001_1022, // DC_CFG
    0xc001_1023, // TW_CFG
    0xc001_102c, // F15H_EX_CFG
];

/// IA32_SPEC_CTRL and its bits.
const SPEC_CTRL: u32 = 0x48;
const SPEC_CTRL_IBRS: u64 = 1 << 0;
const SPEC_CTRL_STIBP: u64 = 1 << 1;
const SPEC_CTRL_SSBD: u64 = 1 << 2;
/// IA32_PRED_CMD (write-only; bit 0 = IBPB).
const PRED_CMD: u32 = 0x49;
/// IA32_FLUSH_CMD (write-only; bit 0 = L1D_FLUSH).
const FLUSH_CMD: u32 = 0x10b;
/// AMD's VIRT_SPEC_CTRL (bit 2 = SSBD).
const VIRT_SPEC_CTRL: u32 = 0xc001_011f;

/// The SPEC_CTRL bits the CPUID table offers, whether it offers IBPB, L1D_FLUSH and
/// VIRT_SSBD: Intel's leaf 7 EDX bits and AMD's leaf 0x8000_0008 EBX bits, as KVM decides
/// which guest writes to accept (`kvm_spec_ctrl_test_value`).
fn speculation_controls(b: &AttachBlock) -> (u64, bool, bool, bool) {
    let edx7 = b.cpuid(7, 0)[3];
    let amd = b.cpuid(0x8000_0008, 0)[1];
    let has = |reg: u32, bit: u32| reg & (1 << bit) != 0;
    let mut bits = 0;
    if has(edx7, 26) || has(amd, 14) {
        bits |= SPEC_CTRL_IBRS;
    }
    if has(edx7, 27) || has(amd, 15) {
        bits |= SPEC_CTRL_STIBP;
    }
    if has(edx7, 31) || has(amd, 24) {
        bits |= SPEC_CTRL_SSBD;
    }
    let ibpb = has(edx7, 26) || has(amd, 12);
    (bits, ibpb, has(edx7, 28), has(amd, 25))
}

/// IA32_ARCH_CAPABILITIES (read-only; CPUID 7.EDX[29]): KVM's value, from the attach block.
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
        let captured = |i: u32| b.msrs[..n].iter().find(|m| m.index == i).map(|m| m.value);
        let get = |i: u32, default: u64| captured(i).unwrap_or(default);
        let (spec_ctrl_writable, pred_cmd, flush_cmd, virt_ssbd) = speculation_controls(b);
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
            arch_capabilities: captured(ARCH_CAPABILITIES),
            spec_ctrl: 0,
            spec_ctrl_writable,
            pred_cmd,
            flush_cmd,
            virt_spec_ctrl: virt_ssbd.then_some(0),
            tsc_adjust: b.cpuid(7, 0)[1] & (1 << 1) != 0,
            machine_check: captured(MCG_CAP).map(MachineCheck::new),
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

    /// Whether `rdmsr` of `i` goes to KVM: [`MsrFile::passes_through`].
    pub fn read_passes_through(&self, i: u32) -> bool {
        self.passes_through(i)
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
            ARCH_CAPABILITIES => return self.arch_capabilities,
            SPEC_CTRL if self.spec_ctrl_writable != 0 => self.spec_ctrl,
            VIRT_SPEC_CTRL => return self.virt_spec_ctrl,
            _ => return self.machine_check.as_ref().and_then(|m| m.read(i)),
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
            i if WRITES_IGNORED.contains(&i) => {}
            SPEC_CTRL if self.spec_ctrl_writable != 0 && v & !self.spec_ctrl_writable == 0 => {
                self.spec_ctrl = v;
            }
            PRED_CMD if self.pred_cmd && v & !1 == 0 => {}
            FLUSH_CMD if self.flush_cmd && v & !1 == 0 => {}
            VIRT_SPEC_CTRL if self.virt_spec_ctrl.is_some() && v & !SPEC_CTRL_SSBD == 0 => {
                self.virt_spec_ctrl = Some(v);
            }
            index::FS_BASE => return Some(Written::FsBase(addr(v)?)),
            index::GS_BASE => return Some(Written::GsBase(addr(v)?)),
            i if self.machine_check.as_ref().is_some_and(|m| m.has(i)) => {
                let m = self.machine_check.as_mut().expect("checked just above");
                if !m.write(i, v) {
                    return None;
                }
            }
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
