//! The guest's CPUID table, built in one place.
//!
//! The same table is given to KVM (`KVM_SET_CPUID2`, which answers CPUID for emulated
//! ring-0 code) and, once the engine lands, to the engine through the attach block (the
//! engine answers every guest CPUID from it), so native and instrumented runs see one CPU.
//!
//! Starting from what KVM supports, [`MASKED_FEATURES`] removes the features this host's
//! KVM cannot run at guest ring 0 (see DESIGN.md §2): a kernel that saw them would use
//! instructions KVM's instruction emulator rejects, or control-register bits KVM refuses.

use kvm_bindings::{CpuId, KVM_MAX_CPUID_ENTRIES};
use kvm_ioctls::Kvm;

use crate::error::{Result, VmmError};

/// A CPUID register.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reg {
    /// EAX.
    Eax,
    /// EBX.
    Ebx,
    /// ECX.
    Ecx,
    /// EDX.
    Edx,
}

/// One feature bit removed from the guest's CPUID, with the reason.
#[derive(Clone, Copy, Debug)]
pub struct MaskedFeature {
    /// CPUID leaf (EAX input).
    pub leaf: u32,
    /// CPUID subleaf (ECX input).
    pub subleaf: u32,
    /// Register holding the bit.
    pub reg: Reg,
    /// Bit number.
    pub bit: u32,
    /// The feature's name as Linux spells it in /proc/cpuinfo.
    pub name: &'static str,
    /// Why it is hidden.
    pub why: &'static str,
}

/// Features hidden from the guest. Linux drops the features that depend on these
/// (e.g. AVX* on XSAVE) by itself.
pub const MASKED_FEATURES: &[MaskedFeature] = &[
    MaskedFeature {
        leaf: 1,
        subleaf: 0,
        reg: Reg::Ecx,
        bit: 13,
        name: "cx16",
        why: "KVM's emulator fails on cmpxchg16b at ring 0 (SLUB uses it)",
    },
    MaskedFeature {
        leaf: 1,
        subleaf: 0,
        reg: Reg::Ecx,
        bit: 17,
        name: "pcid",
        why: "this KVM rejects CR4.PCIDE",
    },
    MaskedFeature {
        leaf: 1,
        subleaf: 0,
        reg: Reg::Ecx,
        bit: 23,
        name: "popcnt",
        why: "KVM's emulator fails on popcnt at ring 0 (hweight alternatives)",
    },
    MaskedFeature {
        leaf: 1,
        subleaf: 0,
        reg: Reg::Ecx,
        bit: 26,
        name: "xsave",
        why: "KVM's emulator fails on xrstor at ring 0; AVX and friends depend on it",
    },
    MaskedFeature {
        leaf: 1,
        subleaf: 0,
        reg: Reg::Ecx,
        bit: 27,
        name: "osxsave",
        why: "follows xsave",
    },
    MaskedFeature {
        leaf: 7,
        subleaf: 0,
        reg: Reg::Ebx,
        bit: 20,
        name: "smap",
        why: "KVM's emulator fails on clac/stac at ring 0",
    },
    MaskedFeature {
        leaf: 7,
        subleaf: 0,
        reg: Reg::Ecx,
        bit: 3,
        name: "pku",
        why: "rdpkru/wrpkru at ring 0 are not emulated",
    },
    MaskedFeature {
        leaf: 7,
        subleaf: 0,
        reg: Reg::Ecx,
        bit: 16,
        name: "la57",
        why: "this KVM rejects CR4.LA57",
    },
    MaskedFeature {
        leaf: 0x4000_0001,
        subleaf: 0,
        reg: Reg::Eax,
        bit: 4,
        name: "kvm-asyncpf",
        why: "under the engine all guest code runs at CPL 3, where KVM would inject its async-page-fault #PF into the engine, which cannot tell it from a shadow-MMU fault",
    },
    MaskedFeature {
        leaf: 0x4000_0001,
        subleaf: 0,
        reg: Reg::Eax,
        bit: 14,
        name: "kvm-asyncpf-int",
        why: "follows kvm-asyncpf",
    },
];

/// Builds the guest CPUID table for a single-vCPU guest with APIC ID 0.
pub fn guest_cpuid(kvm: &Kvm) -> Result<CpuId> {
    let mut cpuid = kvm
        .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(|e| VmmError::Kvm("KVM_GET_SUPPORTED_CPUID", e))?;
    apply_policy(cpuid.as_mut_slice());
    Ok(cpuid)
}

/// Clears the CPUID bits of MSRs KVM cannot give this vCPU (the guest's CPUID and its MSRs
/// must agree: a kernel reads an advertised MSR without a fault handler). Today only
/// IA32_ARCH_CAPABILITIES (7.EDX[29]), which KVM advertises on every host. Returns whether
/// anything changed (then the table must be given to KVM again).
pub fn hide_unreadable_msrs(cpuid: &mut CpuId, vcpu: &kvm_ioctls::VcpuFd) -> bool {
    const ARCH_CAPABILITIES_BIT: u32 = 1 << 29;
    let mut changed = false;
    for e in cpuid.as_mut_slice().iter_mut() {
        if e.function == 7
            && e.index == 0
            && e.edx & ARCH_CAPABILITIES_BIT != 0
            && crate::engine::attach::read_msr(vcpu, kpin_abi::x86::msr::ARCH_CAPABILITIES)
                .is_none()
        {
            e.edx &= !ARCH_CAPABILITIES_BIT;
            changed = true;
        }
    }
    changed
}

/// Applies the table policy to raw entries (separate from KVM for testing).
pub fn apply_policy(entries: &mut [kvm_bindings::kvm_cpuid_entry2]) {
    for e in entries.iter_mut() {
        if e.function == 1 {
            // One logical processor, initial APIC ID 0.
            e.ebx &= 0x0000_ffff;
            e.ebx |= 1 << 16;
        }
        for m in MASKED_FEATURES
            .iter()
            .filter(|m| m.leaf == e.function && m.subleaf == e.index)
        {
            let reg = match m.reg {
                Reg::Eax => &mut e.eax,
                Reg::Ebx => &mut e.ebx,
                Reg::Ecx => &mut e.ecx,
                Reg::Edx => &mut e.edx,
            };
            *reg &= !(1 << m.bit);
        }
    }
}

#[cfg(test)]
mod tests {
    use kvm_bindings::kvm_cpuid_entry2;

    use super::*;

    #[test]
    fn test_policy_masks_listed_bits_only() {
        let mut entries = [
            kvm_cpuid_entry2 {
                function: 1,
                ecx: u32::MAX,
                edx: u32::MAX,
                ebx: 0xff08_0800,
                ..Default::default()
            },
            kvm_cpuid_entry2 {
                function: 7,
                index: 0,
                ebx: u32::MAX,
                ecx: u32::MAX,
                ..Default::default()
            },
            kvm_cpuid_entry2 {
                function: 7,
                index: 1,
                ebx: u32::MAX,
                ..Default::default()
            },
        ];
        apply_policy(&mut entries);
        assert_eq!(entries[0].ecx & (1 << 13), 0, "cx16 hidden");
        assert_eq!(entries[0].ecx & (1 << 26), 0, "xsave hidden");
        assert_eq!(entries[0].ecx & (1 << 0), 1, "sse3 kept");
        assert_eq!(entries[0].edx, u32::MAX, "leaf 1 edx untouched");
        assert_eq!(entries[0].ebx >> 24, 0, "APIC id 0");
        assert_eq!((entries[0].ebx >> 16) & 0xff, 1, "one logical CPU");
        assert_eq!(entries[1].ebx & (1 << 20), 0, "smap hidden");
        assert_eq!(entries[2].ebx, u32::MAX, "other subleaves untouched");
    }
}
