//! Architectural constants of x86-64 (Intel SDM / AMD APM) that the VMM, the guest-engine
//! library and the engine image share: exception vectors, CR0/CR4/EFER/RFLAGS bits, MSR
//! indices, #PF error-code bits. One table, so that no crate keeps its own copy.

/// Exception vectors (Intel SDM vol. 3, §6.3.1).
pub mod vector {
    /// #DE, divide error.
    pub const DE: u8 = 0;
    /// #DB, debug.
    pub const DB: u8 = 1;
    /// NMI.
    pub const NMI: u8 = 2;
    /// #BP, breakpoint (`int3`).
    pub const BP: u8 = 3;
    /// #OF, overflow (`into`).
    pub const OF: u8 = 4;
    /// #BR, bound range exceeded.
    pub const BR: u8 = 5;
    /// #UD, invalid opcode.
    pub const UD: u8 = 6;
    /// #NM, device not available.
    pub const NM: u8 = 7;
    /// #DF, double fault (error code 0).
    pub const DF: u8 = 8;
    /// #TS, invalid TSS (selector error code).
    pub const TS: u8 = 10;
    /// #NP, segment not present (selector error code).
    pub const NP: u8 = 11;
    /// #SS, stack-segment fault (selector error code or 0).
    pub const SS: u8 = 12;
    /// #GP, general protection (selector error code or 0).
    pub const GP: u8 = 13;
    /// #PF, page fault (page-fault error code, CR2 = the linear address).
    pub const PF: u8 = 14;
    /// #MF, x87 floating-point error.
    pub const MF: u8 = 16;
    /// #AC, alignment check (error code 0).
    pub const AC: u8 = 17;
    /// #MC, machine check.
    pub const MC: u8 = 18;
    /// #XM, SIMD floating-point exception.
    pub const XM: u8 = 19;
    /// #VE, virtualization exception.
    pub const VE: u8 = 20;
    /// #CP, control-protection exception (error code).
    pub const CP: u8 = 21;

    /// Whether the CPU pushes an error code for exception `v` (8, 10–14, 17, 21, and
    /// AMD's #VC 29 / #SX 30).
    pub const fn has_error_code(v: u8) -> bool {
        matches!(v, 8 | 10..=14 | 17 | 21 | 29 | 30)
    }

    /// Whether exception `v` is contributory for the double-fault rule (SDM vol. 3,
    /// table 6-4): #DE, #TS, #NP, #SS, #GP.
    pub const fn is_contributory(v: u8) -> bool {
        matches!(v, 0 | 10..=13)
    }
}

/// CR0 bits (Intel SDM vol. 3, §2.5).
pub mod cr0 {
    /// Protection enable.
    pub const PE: u64 = 1 << 0;
    /// Monitor coprocessor.
    pub const MP: u64 = 1 << 1;
    /// x87 emulation (x87/SSE instructions raise #NM/#UD).
    pub const EM: u64 = 1 << 2;
    /// Task switched (x87/SSE instructions raise #NM).
    pub const TS: u64 = 1 << 3;
    /// Extension type (reads 1).
    pub const ET: u64 = 1 << 4;
    /// Numeric error (native x87 error reporting).
    pub const NE: u64 = 1 << 5;
    /// Write protect: supervisor writes honour read-only pages.
    pub const WP: u64 = 1 << 16;
    /// Alignment mask (with RFLAGS.AC at CPL 3: #AC).
    pub const AM: u64 = 1 << 18;
    /// Not write-through.
    pub const NW: u64 = 1 << 29;
    /// Cache disable.
    pub const CD: u64 = 1 << 30;
    /// Paging.
    pub const PG: u64 = 1 << 31;
}

/// CR4 bits (Intel SDM vol. 3, §2.5).
pub mod cr4 {
    /// Virtual-8086 mode extensions.
    pub const VME: u64 = 1 << 0;
    /// Protected-mode virtual interrupts.
    pub const PVI: u64 = 1 << 1;
    /// Time-stamp disable: `rdtsc` at CPL > 0 raises #GP.
    pub const TSD: u64 = 1 << 2;
    /// Debugging extensions: DR4/DR5 references raise #UD.
    pub const DE: u64 = 1 << 3;
    /// Page size extensions.
    pub const PSE: u64 = 1 << 4;
    /// Physical address extension (required in long mode).
    pub const PAE: u64 = 1 << 5;
    /// Machine-check enable.
    pub const MCE: u64 = 1 << 6;
    /// Page global enable.
    pub const PGE: u64 = 1 << 7;
    /// Performance-counter enable (`rdpmc` at any CPL).
    pub const PCE: u64 = 1 << 8;
    /// OS supports `fxsave`/`fxrstor` (SSE enabled).
    pub const OSFXSR: u64 = 1 << 9;
    /// OS handles SIMD exceptions (#XM).
    pub const OSXMMEXCPT: u64 = 1 << 10;
    /// User-mode instruction prevention: `sgdt`/`sidt`/`sldt`/`str`/`smsw` at CPL > 0
    /// raise #GP(0).
    pub const UMIP: u64 = 1 << 11;
    /// 5-level paging.
    pub const LA57: u64 = 1 << 12;
    /// VMX enable.
    pub const VMXE: u64 = 1 << 13;
    /// SMX enable.
    pub const SMXE: u64 = 1 << 14;
    /// `rd/wr{fs,gs}base` enabled.
    pub const FSGSBASE: u64 = 1 << 16;
    /// Process-context identifiers.
    pub const PCIDE: u64 = 1 << 17;
    /// `xsave` and XCR0 enabled.
    pub const OSXSAVE: u64 = 1 << 18;
    /// Supervisor-mode execution prevention.
    pub const SMEP: u64 = 1 << 20;
    /// Supervisor-mode access prevention.
    pub const SMAP: u64 = 1 << 21;
    /// Protection keys for user pages.
    pub const PKE: u64 = 1 << 22;
    /// Control-flow enforcement.
    pub const CET: u64 = 1 << 23;
    /// The bits that enable SSE for the OS (OSFXSR, OSXMMEXCPT).
    pub const SSE_BITS: u64 = OSFXSR | OSXMMEXCPT;
}

/// EFER bits (MSR 0xc000_0080).
pub mod efer {
    /// `syscall`/`sysret` enable.
    pub const SCE: u64 = 1 << 0;
    /// Long mode enable.
    pub const LME: u64 = 1 << 8;
    /// Long mode active.
    pub const LMA: u64 = 1 << 10;
    /// No-execute enable (PTE bit 63).
    pub const NXE: u64 = 1 << 11;
}

/// RFLAGS bits.
pub mod rflags {
    /// Carry.
    pub const CF: u64 = 1 << 0;
    /// Bit 1: reserved, always 1.
    pub const FIXED: u64 = 1 << 1;
    /// The status flags: CF, PF, AF, ZF, SF, OF.
    pub const STATUS: u64 = 0x8d5;
    /// ZF: zero flag (also the result of `lar`/`lsl`/`verr`/`verw`).
    pub const ZF: u64 = 1 << 6;
    /// Trap flag (single step).
    pub const TF: u64 = 1 << 8;
    /// Interrupt enable.
    pub const IF: u64 = 1 << 9;
    /// Direction.
    pub const DF: u64 = 1 << 10;
    /// I/O privilege level (2 bits).
    pub const IOPL: u64 = 3 << 12;
    /// Nested task.
    pub const NT: u64 = 1 << 14;
    /// Resume flag.
    pub const RF: u64 = 1 << 16;
    /// Virtual-8086 mode.
    pub const VM: u64 = 1 << 17;
    /// Alignment check / SMAP access control.
    pub const AC: u64 = 1 << 18;
    /// CPUID-detection flag.
    pub const ID: u64 = 1 << 21;
    /// Bits `popf`/`iretq` may load at CPL 0 (CF PF AF ZF SF TF IF DF OF IOPL NT AC ID;
    /// RF and VM are not loaded by `popf`; VIF/VIP stay 0).
    pub const LOADABLE: u64 = 0x24_7fd5;
}

/// #PF error-code bits (Intel SDM vol. 3, §4.7).
pub mod pf {
    /// The page was present (a protection violation).
    pub const PRESENT: u32 = 1 << 0;
    /// The access was a write.
    pub const WRITE: u32 = 1 << 1;
    /// The access was made at CPL 3.
    pub const USER: u32 = 1 << 2;
    /// A reserved bit was set in a paging-structure entry.
    pub const RSVD: u32 = 1 << 3;
    /// The access was an instruction fetch.
    pub const FETCH: u32 = 1 << 4;
}

/// Page-table entry bits (4-level paging, Intel SDM vol. 3, §4.5; each entry is 64 bits).
pub mod pte {
    /// Bit 0: the entry is present.
    pub const PRESENT: u64 = 1 << 0;
    /// Bit 1: writes allowed (R/W).
    pub const WRITABLE: u64 = 1 << 1;
    /// Bit 2: user-mode accesses allowed (U/S).
    pub const USER: u64 = 1 << 2;
    /// Bit 3: page-level write-through.
    pub const PWT: u64 = 1 << 3;
    /// Bit 4: page-level cache disable.
    pub const PCD: u64 = 1 << 4;
    /// Bit 5: accessed (set by the CPU on every entry it uses).
    pub const ACCESSED: u64 = 1 << 5;
    /// Bit 6: dirty (set by the CPU on the leaf on a write).
    pub const DIRTY: u64 = 1 << 6;
    /// Bit 7 of a PDPTE or PDE: the entry maps a 1 GiB / 2 MiB page (PS). Reserved in a
    /// PML4E.
    pub const PAGE_SIZE: u64 = 1 << 7;
    /// Bit 7 of a 4 KiB PTE: PAT index bit.
    pub const PTE_PAT: u64 = 1 << 7;
    /// Bit 8 of a leaf: global (survives CR3 writes when CR4.PGE = 1).
    pub const GLOBAL: u64 = 1 << 8;
    /// Bit 12 of a 2 MiB / 1 GiB leaf: PAT index bit.
    pub const LARGE_PAT: u64 = 1 << 12;
    /// Bit 63: execute disable (XD/NX); reserved unless EFER.NXE = 1.
    pub const NO_EXECUTE: u64 = 1 << 63;
    /// Bits 51:12: physical address of the next table or of the 4 KiB frame.
    pub const ADDR_MASK: u64 = 0x000f_ffff_ffff_f000;
}

/// The PC's first serial port (COM1, a 16550A UART): its eight registers from
/// [`COM1_PORT`].
pub const COM1_PORT: u16 = 0x3f8;

/// MSR indices (Intel SDM vol. 4).
pub mod msr {
    /// IA32_TIME_STAMP_COUNTER.
    pub const TSC: u32 = 0x10;
    /// kvm-clock wall clock (old index, KVM feature bit 0).
    pub const KVM_WALL_CLOCK_OLD: u32 = 0x11;
    /// kvm-clock system time (old index, KVM feature bit 0).
    pub const KVM_SYSTEM_TIME_OLD: u32 = 0x12;
    /// IA32_APIC_BASE.
    pub const APIC_BASE: u32 = 0x1b;
    /// IA32_TSC_ADJUST.
    pub const TSC_ADJUST: u32 = 0x3b;
    /// IA32_BIOS_SIGN_ID (microcode revision).
    pub const BIOS_SIGN_ID: u32 = 0x8b;
    /// IA32_ARCH_CAPABILITIES (read-only).
    pub const ARCH_CAPABILITIES: u32 = 0x10a;
    /// IA32_MCG_CAP: machine-check capabilities (bank count, MCG_CTL_P, MCG_CMCI_P).
    pub const MCG_CAP: u32 = 0x179;
    /// IA32_MCG_STATUS.
    pub const MCG_STATUS: u32 = 0x17a;
    /// IA32_MCG_CTL (with MCG_CAP.MCG_CTL_P).
    pub const MCG_CTL: u32 = 0x17b;
    /// IA32_MC0_CTL2; bank i's is `MC0_CTL2 + i` (with MCG_CAP.MCG_CMCI_P).
    pub const MC0_CTL2: u32 = 0x280;
    /// IA32_MC0_CTL; bank i's CTL, STATUS, ADDR, MISC are `MC0_CTL + 4 i + 0..4`.
    pub const MC0_CTL: u32 = 0x400;
    /// MISC_FEATURES_ENABLES (bit 0: CPUID faulting).
    pub const MISC_FEATURES_ENABLES: u32 = 0x140;
    /// IA32_SYSENTER_CS.
    pub const SYSENTER_CS: u32 = 0x174;
    /// IA32_SYSENTER_ESP.
    pub const SYSENTER_ESP: u32 = 0x175;
    /// IA32_SYSENTER_EIP.
    pub const SYSENTER_EIP: u32 = 0x176;
    /// IA32_MISC_ENABLE.
    pub const MISC_ENABLE: u32 = 0x1a0;
    /// IA32_PAT.
    pub const PAT: u32 = 0x277;
    /// IA32_TSC_DEADLINE (local APIC timer).
    pub const TSC_DEADLINE: u32 = 0x6e0;
    /// First x2APIC register MSR.
    pub const X2APIC_FIRST: u32 = 0x800;
    /// Last x2APIC register MSR.
    pub const X2APIC_LAST: u32 = 0x8ff;
    /// IA32_EFER.
    pub const EFER: u32 = 0xc000_0080;
    /// IA32_STAR (`syscall`/`sysret` selectors).
    pub const STAR: u32 = 0xc000_0081;
    /// IA32_LSTAR (64-bit `syscall` target).
    pub const LSTAR: u32 = 0xc000_0082;
    /// IA32_CSTAR (compatibility-mode `syscall` target).
    pub const CSTAR: u32 = 0xc000_0083;
    /// IA32_FMASK (RFLAGS bits `syscall` clears).
    pub const SFMASK: u32 = 0xc000_0084;
    /// IA32_FS_BASE.
    pub const FS_BASE: u32 = 0xc000_0100;
    /// IA32_GS_BASE.
    pub const GS_BASE: u32 = 0xc000_0101;
    /// IA32_KERNEL_GS_BASE (exchanged with GS base by `swapgs`).
    pub const KERNEL_GS_BASE: u32 = 0xc000_0102;
    /// IA32_TSC_AUX (`rdtscp`, `rdpid`).
    pub const TSC_AUX: u32 = 0xc000_0103;
    /// kvm-clock wall clock (KVM feature bit 3).
    pub const KVM_WALL_CLOCK_NEW: u32 = 0x4b56_4d00;
    /// kvm-clock system time (KVM feature bit 3).
    pub const KVM_SYSTEM_TIME_NEW: u32 = 0x4b56_4d01;
    /// KVM steal time (KVM feature bit 5).
    pub const KVM_STEAL_TIME: u32 = 0x4b56_4d03;
    /// KVM PV EOI (KVM feature bit 6).
    pub const KVM_PV_EOI_EN: u32 = 0x4b56_4d04;
    /// KVM poll control (KVM feature bit 12).
    pub const KVM_POLL_CONTROL: u32 = 0x4b56_4d05;

    /// The MSRs the engine's ring-0 gate lets WRMSR write, as inclusive ranges: the FS/GS
    /// bases the engine sets for translated code, and every MSR the virtual CPU may pass
    /// through to KVM (`guest_engine`'s `MsrFile::passes_through`, whatever CPUID offers).
    /// The gate refuses any other (the image's `ring0/gate.rs` checks these ranges, in
    /// this order: a Linux boot's gate WRMSRs are ~1 000 x2APIC EOIs and ~950 TSC
    /// deadlines; the FS/GS bases come through it only on a host without FSGSBASE).
    pub const GATE_WRITABLE: [(u32, u32); 9] = [
        (X2APIC_FIRST, X2APIC_LAST),
        (TSC_DEADLINE, TSC_DEADLINE),
        (FS_BASE, KERNEL_GS_BASE),
        (KVM_WALL_CLOCK_NEW, KVM_SYSTEM_TIME_NEW),
        (KVM_STEAL_TIME, KVM_POLL_CONTROL),
        (APIC_BASE, APIC_BASE),
        (BIOS_SIGN_ID, BIOS_SIGN_ID),
        (TSC_ADJUST, TSC_ADJUST),
        (KVM_WALL_CLOCK_OLD, KVM_SYSTEM_TIME_OLD),
    ];

    /// Whether the gate lets WRMSR write `i` ([`GATE_WRITABLE`]).
    pub const fn gate_writable(i: u32) -> bool {
        let mut k = 0;
        while k < GATE_WRITABLE.len() {
            if i >= GATE_WRITABLE[k].0 && i <= GATE_WRITABLE[k].1 {
                return true;
            }
            k += 1;
        }
        false
    }
}

/// Whether `v` is a canonical 48-bit linear address (bits 63:47 all equal).
pub const fn is_canonical(v: u64) -> bool {
    ((v as i64) << 16 >> 16) as u64 == v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_error_code_vectors_are_those_the_sdm_lists() {
        let with: [u8; 8] = [8, 10, 11, 12, 13, 14, 17, 21];
        for v in 0..=31u8 {
            let expect = with.contains(&v) || v == 29 || v == 30;
            assert_eq!(vector::has_error_code(v), expect, "vector {v}");
        }
    }

    #[test]
    fn test_contributory_exceptions_are_de_ts_np_ss_gp() {
        let c: [u8; 5] = [vector::DE, vector::TS, vector::NP, vector::SS, vector::GP];
        for v in 0..=31u8 {
            assert_eq!(vector::is_contributory(v), c.contains(&v), "vector {v}");
        }
    }

    #[test]
    fn test_canonical_addresses_sign_extend_bit_47() {
        assert!(is_canonical(0x0000_7fff_ffff_ffff));
        assert!(is_canonical(0xffff_8000_0000_0000));
        assert!(!is_canonical(0x0000_8000_0000_0000));
        assert!(!is_canonical(0xfff7_ffff_ffff_ffff));
    }

    #[test]
    fn test_sse_bits_are_osfxsr_and_osxmmexcpt() {
        assert_eq!(cr4::SSE_BITS, (1 << 9) | (1 << 10));
        assert_eq!(rflags::LOADABLE & (rflags::RF | rflags::VM), 0);
    }
}
