//! Capturing the guest's vCPU state into the attach block ([`kpin_abi::attach`]) the
//! engine starts from: general, segment, descriptor-table and control registers, pending
//! events, the MSRs in [`ATTACH_MSRS`], the CPUID table, the e820 map, where the stolen
//! region is, the tool's name and options, and where the guest kernel keeps its running
//! task (`kernel_types`, from its BTF).
//!
//! Invariants: [`capture`] is a pure function of KVM's structures (unit-tested without
//! KVM); a block it returns is valid ([`AttachBlock::is_valid`]) and every count is within
//! its array; a table that does not fit is an error, never silently truncated.

use kpin_abi::attach::{
    AttachBlock, CpuidEntry, DescriptorTable, KernelTypes, Msr, PendingEvents, Regs, Segment,
    SystemRegs, MAX_CPUID, MAX_E820, MAX_MSRS, TOOL_NAME_BYTES, TOOL_OPTIONS_BYTES,
};
use kpin_abi::stolen::ATTACH_OFFSET;
use kpin_abi::x86::msr;
use kvm_bindings::{
    kvm_cpuid_entry2, kvm_dtable, kvm_msr_entry, kvm_regs, kvm_segment, kvm_sregs, kvm_vcpu_events,
    Msrs,
};
use kvm_ioctls::VcpuFd;

use crate::error::{Result, VmmError};
use crate::vstate::memory::{E820Entry, VmMemory};

/// MSRs handed to the engine, most widely supported first (KVM stops reading at the
/// first one it does not know).
pub const ATTACH_MSRS: &[u32] = &[
    msr::STAR,
    msr::LSTAR,
    msr::CSTAR,
    msr::SFMASK,
    msr::FS_BASE,
    msr::GS_BASE,
    msr::KERNEL_GS_BASE,
    msr::SYSENTER_CS,
    msr::SYSENTER_ESP,
    msr::SYSENTER_EIP,
    msr::PAT,
    msr::TSC,
    msr::TSC_AUX,
];

/// MSRs that are part of the guest's CPU model rather than its state: the virtual CPU
/// answers `rdmsr` of them with the value KVM gives this vCPU (read here, host-initiated),
/// so a guest under the engine reads what a native KVM guest on this host reads. Each is
/// read on its own: KVM may know one and not another, and one it does not know is simply
/// absent from the block (the engine then gives #GP(0), and the VMM's CPUID table does not
/// advertise it: see `cpuid::hide_unreadable_msrs`).
pub const MODEL_MSRS: &[u32] = &[
    msr::ARCH_CAPABILITIES, // CPUID 7.EDX[29]
    msr::MCG_CAP,           // the machine-check banks (guest-engine vcpu/mce.rs)
];
const _: () = assert!(ATTACH_MSRS.len() + MODEL_MSRS.len() <= MAX_MSRS);

/// The vCPU state KVM reports, as read by [`read_vcpu`].
pub struct VcpuState {
    /// General registers.
    pub regs: kvm_regs,
    /// Segment, descriptor-table and control registers.
    pub sregs: kvm_sregs,
    /// Pending events.
    pub events: kvm_vcpu_events,
    /// The [`ATTACH_MSRS`] KVM could read, in that order.
    pub msrs: Vec<kvm_msr_entry>,
}

/// Where things are and what to run, besides the vCPU state.
pub struct AttachInputs<'a> {
    /// The CPUID table the guest sees.
    pub cpuid: &'a [kvm_cpuid_entry2],
    /// The guest's e820 map.
    pub e820: &'a [E820Entry],
    /// Bytes of guest RAM.
    pub ram_bytes: u64,
    /// Guest-physical base of the stolen region.
    pub stolen_base: u64,
    /// Bytes of the stolen region.
    pub stolen_bytes: u64,
    /// The tool's name.
    pub tool: &'a str,
    /// The tool's options (`key=value` separated by spaces).
    pub options: &'a str,
    /// Where the guest kernel keeps its running task (`KernelTypes::UNKNOWN` if not known).
    pub kernel_types: KernelTypes,
}

/// Reads the vCPU's complete state from KVM.
pub fn read_vcpu(vcpu: &VcpuFd) -> Result<VcpuState> {
    let regs = vcpu
        .get_regs()
        .map_err(|e| VmmError::Kvm("KVM_GET_REGS", e))?;
    let sregs = vcpu
        .get_sregs()
        .map_err(|e| VmmError::Kvm("KVM_GET_SREGS", e))?;
    let events = vcpu
        .get_vcpu_events()
        .map_err(|e| VmmError::Kvm("KVM_GET_VCPU_EVENTS", e))?;
    let wanted: Vec<kvm_msr_entry> = ATTACH_MSRS
        .iter()
        .map(|&index| kvm_msr_entry {
            index,
            ..Default::default()
        })
        .collect();
    let mut msrs = Msrs::from_entries(&wanted).expect("ATTACH_MSRS is far below KVM's MSR limit");
    let n = vcpu
        .get_msrs(&mut msrs)
        .map_err(|e| VmmError::Kvm("KVM_GET_MSRS", e))?;
    let mut msrs = msrs.as_slice()[..n.min(wanted.len())].to_vec();
    msrs.extend(MODEL_MSRS.iter().filter_map(|&index| read_msr(vcpu, index)));
    Ok(VcpuState {
        regs,
        sregs,
        events,
        msrs,
    })
}

/// KVM's value of MSR `index` for this vCPU (a host-initiated read), or `None` if KVM
/// does not have it.
pub fn read_msr(vcpu: &VcpuFd, index: u32) -> Option<kvm_msr_entry> {
    let mut m = Msrs::from_entries(&[kvm_msr_entry {
        index,
        ..Default::default()
    }])
    .expect("one entry is below KVM's MSR limit");
    match vcpu.get_msrs(&mut m) {
        Ok(1) => Some(m.as_slice()[0]),
        _ => None,
    }
}

/// Builds the attach block from the vCPU state and the inputs.
pub fn capture(state: &VcpuState, inputs: &AttachInputs<'_>) -> Result<AttachBlock> {
    let mut b = AttachBlock::new();
    let r = &state.regs;
    b.regs = Regs {
        rax: r.rax,
        rbx: r.rbx,
        rcx: r.rcx,
        rdx: r.rdx,
        rsi: r.rsi,
        rdi: r.rdi,
        rsp: r.rsp,
        rbp: r.rbp,
        r8: r.r8,
        r9: r.r9,
        r10: r.r10,
        r11: r.r11,
        r12: r.r12,
        r13: r.r13,
        r14: r.r14,
        r15: r.r15,
        rip: r.rip,
        rflags: r.rflags,
    };
    let s = &state.sregs;
    b.sregs = SystemRegs {
        cs: segment(&s.cs),
        ds: segment(&s.ds),
        es: segment(&s.es),
        fs: segment(&s.fs),
        gs: segment(&s.gs),
        ss: segment(&s.ss),
        tr: segment(&s.tr),
        ldt: segment(&s.ldt),
        gdt: table(&s.gdt),
        idt: table(&s.idt),
        cr0: s.cr0,
        cr2: s.cr2,
        cr3: s.cr3,
        cr4: s.cr4,
        cr8: s.cr8,
        efer: s.efer,
        apic_base: s.apic_base,
    };
    let e = &state.events;
    b.events = PendingEvents {
        exception_valid: u8::from(e.exception.injected != 0 || e.exception.pending != 0),
        exception_nr: e.exception.nr,
        exception_has_error_code: e.exception.has_error_code,
        interrupt_valid: e.interrupt.injected,
        interrupt_nr: e.interrupt.nr,
        interrupt_shadow: e.interrupt.shadow,
        nmi_pending: e.nmi.pending,
        nmi_masked: e.nmi.masked,
        exception_error_code: e.exception.error_code,
        ..b.events
    };
    if state.msrs.len() > MAX_MSRS {
        return Err(VmmError::AttachTable("MSR", state.msrs.len(), MAX_MSRS));
    }
    for (slot, m) in b.msrs.iter_mut().zip(&state.msrs) {
        *slot = Msr {
            index: m.index,
            pad: 0,
            value: m.data,
        };
    }
    b.msr_count = count(state.msrs.len());
    if inputs.cpuid.len() > MAX_CPUID {
        return Err(VmmError::AttachTable(
            "CPUID",
            inputs.cpuid.len(),
            MAX_CPUID,
        ));
    }
    for (slot, c) in b.cpuid.iter_mut().zip(inputs.cpuid) {
        *slot = CpuidEntry {
            function: c.function,
            index: c.index,
            flags: c.flags,
            eax: c.eax,
            ebx: c.ebx,
            ecx: c.ecx,
            edx: c.edx,
            pad: 0,
        };
    }
    b.cpuid_count = count(inputs.cpuid.len());
    if inputs.e820.len() > MAX_E820 {
        return Err(VmmError::AttachTable("e820", inputs.e820.len(), MAX_E820));
    }
    b.e820[..inputs.e820.len()].copy_from_slice(inputs.e820);
    b.e820_count = count(inputs.e820.len());
    b.ram_bytes = inputs.ram_bytes;
    b.stolen_base = inputs.stolen_base;
    b.stolen_bytes = inputs.stolen_bytes;
    b.tool_name = tool_name(inputs.tool)?;
    b.tool_options = tool_options(inputs.options)?;
    b.kernel_types = inputs.kernel_types;
    Ok(b)
}

/// The tool name, NUL-padded: 1 to `TOOL_NAME_BYTES - 1` bytes of `[A-Za-z0-9_-]`.
pub fn tool_name(name: &str) -> Result<[u8; TOOL_NAME_BYTES]> {
    let ok = !name.is_empty()
        && name.len() < TOOL_NAME_BYTES
        && name
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'-');
    if !ok {
        return Err(VmmError::ToolName(name.to_owned(), TOOL_NAME_BYTES - 1));
    }
    let mut out = [0; TOOL_NAME_BYTES];
    out[..name.len()].copy_from_slice(name.as_bytes());
    Ok(out)
}

/// The tool options, NUL-padded: at most `TOOL_OPTIONS_BYTES - 1` printable ASCII bytes.
pub fn tool_options(options: &str) -> Result<[u8; TOOL_OPTIONS_BYTES]> {
    let ok = options.len() < TOOL_OPTIONS_BYTES
        && options.bytes().all(|c| c == b' ' || c.is_ascii_graphic());
    if !ok {
        return Err(VmmError::ToolOptions(TOOL_OPTIONS_BYTES - 1));
    }
    let mut out = [0; TOOL_OPTIONS_BYTES];
    out[..options.len()].copy_from_slice(options.as_bytes());
    Ok(out)
}

/// Writes `b` into the stolen region at `ATTACH_OFFSET`, where the engine reads it.
pub fn write_block(mem: &VmMemory, b: &AttachBlock) -> Result<()> {
    let host = mem.stolen_host_address(ATTACH_OFFSET)?;
    assert!(
        (host as usize).is_multiple_of(std::mem::align_of::<AttachBlock>()),
        "the stolen region's mapping is page-aligned"
    );
    // SAFETY: `host` points into the stolen region's live mapping, which holds
    // ATTACH_BYTES >= size_of::<AttachBlock>() bytes at ATTACH_OFFSET (asserted in the
    // abi crate) and is suitably aligned (checked above); the vCPU is not running, so
    // nothing else accesses it.
    unsafe { std::ptr::write_volatile(host.cast::<AttachBlock>(), *b) };
    Ok(())
}

fn count(n: usize) -> u32 {
    u32::try_from(n).expect("bounded by the block's array sizes")
}

fn segment(s: &kvm_segment) -> Segment {
    Segment {
        base: s.base,
        limit: s.limit,
        selector: s.selector,
        type_: s.type_,
        present: s.present,
        dpl: s.dpl,
        db: s.db,
        s: s.s,
        l: s.l,
        g: s.g,
        avl: s.avl,
        unusable: s.unusable,
        pad: 0,
    }
}

fn table(t: &kvm_dtable) -> DescriptorTable {
    DescriptorTable::new(t.base, t.limit)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state() -> VcpuState {
        let mut s = VcpuState {
            regs: kvm_regs {
                rip: 0x100_0000,
                rsi: 0x7000,
                rsp: 0x8ff0,
                rflags: 2,
                r15: 15,
                ..Default::default()
            },
            sregs: kvm_sregs::default(),
            events: kvm_vcpu_events::default(),
            msrs: vec![kvm_msr_entry {
                index: 0xc000_0082,
                reserved: 0,
                data: 0xffff_ffff_8100_0000,
            }],
        };
        s.sregs.cr3 = 0x9000;
        s.sregs.efer = 0x500;
        s.sregs.cs = kvm_segment {
            selector: 0x10,
            l: 1,
            present: 1,
            type_: 0xb,
            ..Default::default()
        };
        s.sregs.gdt = kvm_dtable {
            base: 0x500,
            limit: 31,
            ..Default::default()
        };
        s.events.nmi.masked = 1;
        s.events.exception.pending = 1;
        s.events.exception.nr = 14;
        s.events.exception.error_code = 2;
        s
    }

    fn inputs<'a>(cpuid: &'a [kvm_cpuid_entry2], e820: &'a [E820Entry]) -> AttachInputs<'a> {
        AttachInputs {
            cpuid,
            e820,
            ram_bytes: 256 << 20,
            stolen_base: 1 << 32,
            stolen_bytes: 64 << 20,
            tool: "null",
            options: "bringup.crash=pf x=1",
            kernel_types: KernelTypes {
                current_task: 0x1fb80,
                task_pid: 0x970,
                task_tgid: 0x974,
                task_comm: 0xba0,
                comm_bytes: 16,
                ..KernelTypes::UNKNOWN
            },
        }
    }

    #[test]
    fn test_capture_copies_every_register_and_table() {
        let cpuid = [kvm_cpuid_entry2 {
            function: 0,
            eax: 0xd,
            ebx: 0x756e_6547,
            ..Default::default()
        }];
        let e820 = [E820Entry::new(0, 0x9fc00, 1)];
        let b = capture(&state(), &inputs(&cpuid, &e820)).unwrap();
        assert!(b.is_valid());
        assert_eq!(b.regs.rip, 0x100_0000);
        assert_eq!(b.regs.rsi, 0x7000);
        assert_eq!(b.regs.r15, 15);
        assert_eq!(b.sregs.cr3, 0x9000);
        assert_eq!(b.sregs.efer, 0x500);
        assert_eq!((b.sregs.cs.selector, b.sregs.cs.l), (0x10, 1));
        assert_eq!((b.sregs.gdt.base, b.sregs.gdt.limit), (0x500, 31));
        assert_eq!(b.events.exception_valid, 1);
        assert_eq!(
            (b.events.exception_nr, b.events.exception_error_code),
            (14, 2)
        );
        assert_eq!(b.events.nmi_masked, 1);
        assert_eq!(b.msr_count, 1);
        assert_eq!(b.msrs[0].value, 0xffff_ffff_8100_0000);
        assert_eq!(b.cpuid(0, 0), [0xd, 0x756e_6547, 0, 0]);
        assert_eq!(b.e820_count, 1);
        assert_eq!(b.e820[0].size, 0x9fc00);
        assert_eq!(b.stolen_base, 1 << 32);
        assert_eq!(b.tool_name(), b"null");
        assert_eq!(b.tool_options(), b"bringup.crash=pf x=1");
        assert_eq!(b.kernel_types.current_task, 0x1fb80);
        assert!(b.kernel_types.is_known());
    }

    #[test]
    fn test_oversized_tables_and_bad_tool_names_are_errors() {
        let cpuid = vec![kvm_cpuid_entry2::default(); MAX_CPUID + 1];
        let err = capture(&state(), &inputs(&cpuid, &[])).unwrap_err();
        assert!(err.to_string().contains("CPUID"), "{err}");
        let e820 = vec![E820Entry::new(0, 1, 1); MAX_E820 + 1];
        assert!(capture(&state(), &inputs(&[], &e820)).is_err());
        for bad in ["", "a b", "../x", &"n".repeat(TOOL_NAME_BYTES)] {
            assert!(tool_name(bad).is_err(), "{bad:?}");
        }
        assert!(tool_name(&"n".repeat(TOOL_NAME_BYTES - 1)).is_ok());
        assert!(tool_options("a=1\nb=2").is_err());
        assert!(tool_options(&"o".repeat(TOOL_OPTIONS_BYTES)).is_err());
    }
}
