//! The attach block: everything the engine needs to take over the guest, written by the
//! VMM before it starts the vCPU in the engine, and written back by the engine on detach.
//!
//! It holds the complete guest vCPU state (general, segment, descriptor-table and control
//! registers, MSRs, pending events), the CPUID table the engine answers CPUID from, the
//! guest memory map, where the stolen region and the I/O ring are, the tool's name
//! and options, and where the guest kernel keeps its running task ([`KernelTypes`], from
//! the kernel's BTF; zeros when unknown).

/// `magic` of a valid block: "KPINATCH".
pub const MAGIC: u64 = u64::from_le_bytes(*b"KPINATCH");
/// Layout version; bump on any change. 6: [`KernelTypes`] also locates the address
/// space's VMAs (the maple tree `mm_struct.mm_mt`, [`MapleLayout`], `vm_area_struct`'s
/// range, offset and file). 5: [`KernelTypes`] also locates the task's executable
/// (`mm->exe_file`'s dentry). 4: [`AttachBlock::kernel_types`] at the end. 3: the
/// window the block is reached through is PML4 slot 257 (`stolen::WINDOW_VA`; 2 had it in
/// the lower half, 1 in slot 256).
pub const VERSION: u32 = 6;
/// Capacity of [`AttachBlock::msrs`].
pub const MAX_MSRS: usize = 32;
/// Capacity of [`AttachBlock::cpuid`].
pub const MAX_CPUID: usize = 96;
/// Capacity of [`AttachBlock::e820`].
pub const MAX_E820: usize = 16;
/// Capacity of the tool name, NUL-padded.
pub const TOOL_NAME_BYTES: usize = 32;
/// Capacity of the tool options (`key=value` pairs separated by spaces), NUL-padded.
pub const TOOL_OPTIONS_BYTES: usize = 256;

/// General registers, RIP and RFLAGS.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Regs {
    /// RAX.
    pub rax: u64,
    /// RBX.
    pub rbx: u64,
    /// RCX.
    pub rcx: u64,
    /// RDX.
    pub rdx: u64,
    /// RSI.
    pub rsi: u64,
    /// RDI.
    pub rdi: u64,
    /// RSP.
    pub rsp: u64,
    /// RBP.
    pub rbp: u64,
    /// R8.
    pub r8: u64,
    /// R9.
    pub r9: u64,
    /// R10.
    pub r10: u64,
    /// R11.
    pub r11: u64,
    /// R12.
    pub r12: u64,
    /// R13.
    pub r13: u64,
    /// R14.
    pub r14: u64,
    /// R15.
    pub r15: u64,
    /// RIP.
    pub rip: u64,
    /// RFLAGS.
    pub rflags: u64,
}

/// A segment register with its hidden descriptor cache, field for field as KVM keeps it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Segment {
    /// Base address.
    pub base: u64,
    /// Limit (byte granular, already scaled by G).
    pub limit: u32,
    /// Selector.
    pub selector: u16,
    /// Descriptor type (4 bits).
    pub type_: u8,
    /// Present.
    pub present: u8,
    /// Descriptor privilege level.
    pub dpl: u8,
    /// Default operation size (D/B).
    pub db: u8,
    /// Code/data (1) or system (0).
    pub s: u8,
    /// 64-bit code segment.
    pub l: u8,
    /// Granularity.
    pub g: u8,
    /// Available for software.
    pub avl: u8,
    /// The register holds no usable segment.
    pub unusable: u8,
    /// Padding.
    pub pad: u8,
}

/// GDTR or IDTR.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DescriptorTable {
    /// Linear base.
    pub base: u64,
    /// Limit.
    pub limit: u16,
    /// Padding.
    pub pad: [u8; 6],
}

impl DescriptorTable {
    /// The register holding `base` and `limit`.
    pub const fn new(base: u64, limit: u16) -> Self {
        DescriptorTable {
            base,
            limit,
            pad: [0; 6],
        }
    }
}

/// Segment, descriptor-table and control registers.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SystemRegs {
    /// CS.
    pub cs: Segment,
    /// DS.
    pub ds: Segment,
    /// ES.
    pub es: Segment,
    /// FS.
    pub fs: Segment,
    /// GS.
    pub gs: Segment,
    /// SS.
    pub ss: Segment,
    /// TR.
    pub tr: Segment,
    /// LDTR.
    pub ldt: Segment,
    /// GDTR.
    pub gdt: DescriptorTable,
    /// IDTR.
    pub idt: DescriptorTable,
    /// CR0.
    pub cr0: u64,
    /// CR2.
    pub cr2: u64,
    /// CR3.
    pub cr3: u64,
    /// CR4.
    pub cr4: u64,
    /// CR8 (TPR).
    pub cr8: u64,
    /// EFER.
    pub efer: u64,
    /// IA32_APIC_BASE.
    pub apic_base: u64,
}

/// One MSR.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Msr {
    /// MSR index.
    pub index: u32,
    /// Padding.
    pub pad: u32,
    /// Value.
    pub value: u64,
}

/// One CPUID leaf/subleaf answer.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuidEntry {
    /// Leaf (EAX input).
    pub function: u32,
    /// Subleaf (ECX input), meaningful when `flags` has [`CPUID_FLAG_SIGNIFICANT_INDEX`].
    pub index: u32,
    /// KVM's `KVM_CPUID_FLAG_*`.
    pub flags: u32,
    /// EAX.
    pub eax: u32,
    /// EBX.
    pub ebx: u32,
    /// ECX.
    pub ecx: u32,
    /// EDX.
    pub edx: u32,
    /// Padding.
    pub pad: u32,
}

/// `CpuidEntry::flags`: the subleaf selects the answer.
pub const CPUID_FLAG_SIGNIFICANT_INDEX: u32 = 1;

/// One e820 entry.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct E820Entry {
    /// Guest-physical start.
    pub addr: u64,
    /// Bytes.
    pub size: u64,
    /// 1 = RAM, 2 = reserved.
    pub kind: u32,
    /// Padding.
    pub pad: u32,
}

impl E820Entry {
    /// The entry `[addr, addr + size)` of `kind`.
    pub const fn new(addr: u64, size: u64, kind: u32) -> Self {
        E820Entry {
            addr,
            size,
            kind,
            pad: 0,
        }
    }
}

/// Events pending or being injected at the moment of attach.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PendingEvents {
    /// An exception is pending or being injected.
    pub exception_valid: u8,
    /// Its vector.
    pub exception_nr: u8,
    /// It has an error code.
    pub exception_has_error_code: u8,
    /// An external interrupt is being injected.
    pub interrupt_valid: u8,
    /// Its vector.
    pub interrupt_nr: u8,
    /// Interrupt shadow (after `sti`/`mov ss`).
    pub interrupt_shadow: u8,
    /// An NMI is pending.
    pub nmi_pending: u8,
    /// NMIs are masked.
    pub nmi_masked: u8,
    /// The exception's error code.
    pub exception_error_code: u32,
    /// Padding.
    pub pad: u32,
}

/// Where a Linux guest keeps its running task, read by the VMM from the kernel's BTF
/// (`vmm/src/diag/kernel_types.rs`): the engine reads `current` when the guest returns
/// to CPL 3 and names the task by these fields. Each field 0 means unknown; the engine
/// then tracks no tasks ([`KernelTypes::is_known`] is false), or, if only the executable's
/// fields are unknown, names no executables ([`KernelTypes::knows_exe`]), or, if only the
/// VMAs' fields are unknown, records no code origins ([`KernelTypes::knows_vmas`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelTypes {
    /// Offset of the running task's `struct task_struct *` from the kernel's per-CPU base
    /// (the GS base at CPL 0): `current_task` (6.1) or `pcpu_hot.current_task` (6.2+).
    pub current_task: u64,
    /// Offset of `task_struct.pid` (`pid_t`, 4 bytes).
    pub task_pid: u32,
    /// Offset of `task_struct.tgid` (`pid_t`, 4 bytes).
    pub task_tgid: u32,
    /// Offset of `task_struct.comm`.
    pub task_comm: u32,
    /// Bytes of `task_struct.comm` (`TASK_COMM_LEN`, 16), at most [`MAX_COMM_BYTES`].
    pub comm_bytes: u32,
    /// Offset of `task_struct.mm` (`struct mm_struct *`, NULL for kernel threads).
    pub task_mm: u32,
    /// Offset of `mm_struct.exe_file` (`struct file *`).
    pub mm_exe_file: u32,
    /// Offset of `file.f_path.dentry` (`struct dentry *`).
    pub file_dentry: u32,
    /// Offset of `dentry.d_name.len` (`u32`).
    pub dentry_name_len: u32,
    /// Offset of `dentry.d_name.name` (`const unsigned char *`).
    pub dentry_name: u32,
    /// Offset of `dentry.d_parent` (`struct dentry *`; the root's is itself).
    pub dentry_parent: u32,
    /// Offset of `mm_struct.mm_mt.ma_root`: the root of the maple tree that holds the
    /// address space's VMAs (an encoded node pointer).
    pub mm_mt_root: u32,
    /// Offset of `mm_struct.context.vdso` (x86: the vDSO's address; 0: unknown, the vDSO's
    /// code is then `[anon]`).
    pub mm_vdso: u32,
    /// Offset of `vm_area_struct.vm_start` (0 is a real value: it is the struct's first
    /// member; the VMA's fields are known as a group, [`KernelTypes::knows_vmas`]).
    pub vma_start: u32,
    /// Offset of `vm_area_struct.vm_end` (exclusive).
    pub vma_end: u32,
    /// Offset of `vm_area_struct.vm_pgoff` (the mapping's offset in its file, in pages).
    pub vma_pgoff: u32,
    /// Offset of `vm_area_struct.vm_file` (`struct file *`, NULL for anonymous memory).
    pub vma_file: u32,
    /// Where the maple tree's nodes keep their pivots, slots and metadata.
    pub maple: MapleLayout,
}

const _: () = assert!(core::mem::size_of::<KernelTypes>() == 88);
const _: () = assert!(core::mem::offset_of!(KernelTypes, task_mm) == 24);

/// Largest `KernelTypes::comm_bytes` the engine reads.
pub const MAX_COMM_BYTES: u32 = 16;

/// Bytes of a maple tree node (`struct maple_node`: every node type fits in it).
pub const MAPLE_NODE_BYTES: u16 = 256;

/// The layouts of the maple tree's nodes the VMA tree uses, from BTF: `struct
/// maple_range_64` (leaves, `maple_leaf_64`, and `maple_range_64` internal nodes) and
/// `struct maple_arange_64` (internal nodes of a tree that tracks gaps, as the VMA tree
/// does). Each starts with the `parent` pointer; pivots are `u64`s, inclusive upper bounds
/// of the slot of the same index; the metadata's first byte is the node's last used slot.
/// All zeros: unknown.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MapleLayout {
    /// Offset of `maple_range_64.pivot`.
    pub range_pivot: u16,
    /// Offset of `maple_range_64.slot`.
    pub range_slot: u16,
    /// Offset of `maple_range_64.meta` (the metadata, over the last slot when that is
    /// unused).
    pub range_meta: u16,
    /// Pivots of a `maple_range_64` (15; one slot more than pivots).
    pub range_pivots: u16,
    /// Offset of `maple_arange_64.pivot`.
    pub arange_pivot: u16,
    /// Offset of `maple_arange_64.slot`.
    pub arange_slot: u16,
    /// Offset of `maple_arange_64.meta`.
    pub arange_meta: u16,
    /// Pivots of a `maple_arange_64` (9).
    pub arange_pivots: u16,
}

impl MapleLayout {
    /// Whether both layouts are known and fit in a node: pivots after the parent pointer,
    /// between 1 and 15 of them, the slots (one more) and the metadata's first byte
    /// within [`MAPLE_NODE_BYTES`].
    pub fn is_known(&self) -> bool {
        let fits = |pivot: u16, slot: u16, meta: u16, pivots: u16| {
            pivot >= 8
                && (1..=15).contains(&pivots)
                && u32::from(pivot) + 8 * u32::from(pivots) <= u32::from(slot)
                && u32::from(slot) + 8 * (u32::from(pivots) + 1) <= u32::from(MAPLE_NODE_BYTES)
                && (8..MAPLE_NODE_BYTES).contains(&meta)
        };
        fits(
            self.range_pivot,
            self.range_slot,
            self.range_meta,
            self.range_pivots,
        ) && fits(
            self.arange_pivot,
            self.arange_slot,
            self.arange_meta,
            self.arange_pivots,
        )
    }
}

impl KernelTypes {
    /// All zeros: nothing known.
    pub const UNKNOWN: KernelTypes = KernelTypes {
        current_task: 0,
        task_pid: 0,
        task_tgid: 0,
        task_comm: 0,
        comm_bytes: 0,
        task_mm: 0,
        mm_exe_file: 0,
        file_dentry: 0,
        dentry_name_len: 0,
        dentry_name: 0,
        dentry_parent: 0,
        mm_mt_root: 0,
        mm_vdso: 0,
        vma_start: 0,
        vma_end: 0,
        vma_pgoff: 0,
        vma_file: 0,
        maple: MapleLayout {
            range_pivot: 0,
            range_slot: 0,
            range_meta: 0,
            range_pivots: 0,
            arange_pivot: 0,
            arange_slot: 0,
            arange_meta: 0,
            arange_pivots: 0,
        },
    };

    /// Whether every field is known (non-zero) and `comm_bytes` is within
    /// [`MAX_COMM_BYTES`].
    pub fn is_known(&self) -> bool {
        self.current_task != 0
            && self.task_pid != 0
            && self.task_tgid != 0
            && self.task_comm != 0
            && (1..=MAX_COMM_BYTES).contains(&self.comm_bytes)
    }

    /// Whether the task's executable can be found too: [`KernelTypes::is_known`] and every
    /// offset on the way from the task to its executable's name known (non-zero).
    pub fn knows_exe(&self) -> bool {
        self.is_known()
            && self.task_mm != 0
            && self.mm_exe_file != 0
            && self.file_dentry != 0
            && self.dentry_name_len != 0
            && self.dentry_name != 0
            && self.dentry_parent != 0
    }

    /// Whether the VMA of a user address can be found too (for the file its code came
    /// from): [`KernelTypes::knows_exe`] (the file's path is read the same way), the maple
    /// tree's root and node layouts, and the VMA's end, offset and file (its start may be
    /// at offset 0). `mm_vdso` is optional.
    pub fn knows_vmas(&self) -> bool {
        self.knows_exe()
            && self.mm_mt_root != 0
            && self.vma_end != 0
            && self.vma_pgoff != 0
            && self.vma_file != 0
            && self.maple.is_known()
    }
}

/// The attach block.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct AttachBlock {
    /// [`MAGIC`].
    pub magic: u64,
    /// [`VERSION`].
    pub version: u32,
    /// `size_of::<AttachBlock>()`, as a second check.
    pub size: u32,
    /// General registers.
    pub regs: Regs,
    /// System registers.
    pub sregs: SystemRegs,
    /// Pending events.
    pub events: PendingEvents,
    /// Number of valid [`AttachBlock::msrs`].
    pub msr_count: u32,
    /// Number of valid [`AttachBlock::cpuid`].
    pub cpuid_count: u32,
    /// MSRs the guest has written (syscall, FS/GS bases, …).
    pub msrs: [Msr; MAX_MSRS],
    /// The CPUID table the engine answers from.
    pub cpuid: [CpuidEntry; MAX_CPUID],
    /// Number of valid [`AttachBlock::e820`].
    pub e820_count: u32,
    /// Padding.
    pub pad: u32,
    /// The guest's memory map (the stolen region is not in it).
    pub e820: [E820Entry; MAX_E820],
    /// Bytes of guest RAM.
    pub ram_bytes: u64,
    /// Guest-physical base of the stolen region.
    pub stolen_base: u64,
    /// Bytes of the stolen region.
    pub stolen_bytes: u64,
    /// Tool name, NUL-padded (`null`, `bbcount`, …).
    pub tool_name: [u8; TOOL_NAME_BYTES],
    /// Tool options, NUL-padded.
    pub tool_options: [u8; TOOL_OPTIONS_BYTES],
    /// Where the guest kernel keeps its running task (zeros: unknown).
    pub kernel_types: KernelTypes,
}

const _: () = assert!(core::mem::size_of::<AttachBlock>() as u64 <= crate::stolen::ATTACH_BYTES);

impl AttachBlock {
    /// An empty, valid block.
    pub const fn new() -> Self {
        AttachBlock {
            magic: MAGIC,
            version: VERSION,
            size: core::mem::size_of::<AttachBlock>() as u32,
            regs: Regs {
                rax: 0,
                rbx: 0,
                rcx: 0,
                rdx: 0,
                rsi: 0,
                rdi: 0,
                rsp: 0,
                rbp: 0,
                r8: 0,
                r9: 0,
                r10: 0,
                r11: 0,
                r12: 0,
                r13: 0,
                r14: 0,
                r15: 0,
                rip: 0,
                rflags: 0,
            },
            sregs: SystemRegs {
                cs: EMPTY_SEGMENT,
                ds: EMPTY_SEGMENT,
                es: EMPTY_SEGMENT,
                fs: EMPTY_SEGMENT,
                gs: EMPTY_SEGMENT,
                ss: EMPTY_SEGMENT,
                tr: EMPTY_SEGMENT,
                ldt: EMPTY_SEGMENT,
                gdt: EMPTY_TABLE,
                idt: EMPTY_TABLE,
                cr0: 0,
                cr2: 0,
                cr3: 0,
                cr4: 0,
                cr8: 0,
                efer: 0,
                apic_base: 0,
            },
            events: PendingEvents {
                exception_valid: 0,
                exception_nr: 0,
                exception_has_error_code: 0,
                interrupt_valid: 0,
                interrupt_nr: 0,
                interrupt_shadow: 0,
                nmi_pending: 0,
                nmi_masked: 0,
                exception_error_code: 0,
                pad: 0,
            },
            msr_count: 0,
            cpuid_count: 0,
            msrs: [Msr {
                index: 0,
                pad: 0,
                value: 0,
            }; MAX_MSRS],
            cpuid: [CpuidEntry {
                function: 0,
                index: 0,
                flags: 0,
                eax: 0,
                ebx: 0,
                ecx: 0,
                edx: 0,
                pad: 0,
            }; MAX_CPUID],
            e820_count: 0,
            pad: 0,
            e820: [E820Entry {
                addr: 0,
                size: 0,
                kind: 0,
                pad: 0,
            }; MAX_E820],
            ram_bytes: 0,
            stolen_base: 0,
            stolen_bytes: 0,
            tool_name: [0; TOOL_NAME_BYTES],
            tool_options: [0; TOOL_OPTIONS_BYTES],
            kernel_types: KernelTypes::UNKNOWN,
        }
    }

    /// Whether magic, version and size match this build.
    pub fn is_valid(&self) -> bool {
        self.magic == MAGIC
            && self.version == VERSION
            && self.size as usize == core::mem::size_of::<AttachBlock>()
    }

    /// The CPUID answer for `function`/`index`, as a real CPU would give it: subleaf-keyed
    /// leaves match on `index`, others ignore it; an unknown leaf answers zeros.
    pub fn cpuid(&self, function: u32, index: u32) -> [u32; 4] {
        let n = (self.cpuid_count as usize).min(MAX_CPUID);
        self.cpuid[..n]
            .iter()
            .find(|e| {
                e.function == function
                    && (e.flags & CPUID_FLAG_SIGNIFICANT_INDEX == 0 || e.index == index)
            })
            .map_or([0; 4], |e| [e.eax, e.ebx, e.ecx, e.edx])
    }

    /// The tool name without its NUL padding.
    pub fn tool_name(&self) -> &[u8] {
        trim_nul(&self.tool_name)
    }

    /// The tool options without their NUL padding.
    pub fn tool_options(&self) -> &[u8] {
        trim_nul(&self.tool_options)
    }
}

impl Default for AttachBlock {
    fn default() -> Self {
        Self::new()
    }
}

const EMPTY_SEGMENT: Segment = Segment {
    base: 0,
    limit: 0,
    selector: 0,
    type_: 0,
    present: 0,
    dpl: 0,
    db: 0,
    s: 0,
    l: 0,
    g: 0,
    avl: 0,
    unusable: 0,
    pad: 0,
};
const EMPTY_TABLE: DescriptorTable = DescriptorTable::new(0, 0);

fn trim_nul(b: &[u8]) -> &[u8] {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    &b[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_new_block_is_valid_and_fits_its_slot() {
        let b = AttachBlock::new();
        assert!(b.is_valid());
        assert!(core::mem::size_of::<AttachBlock>() as u64 <= crate::stolen::ATTACH_BYTES);
        let mut bad = b;
        bad.version += 1;
        assert!(!bad.is_valid());
    }

    #[test]
    fn test_cpuid_lookup_honours_significant_index() {
        let mut b = AttachBlock::new();
        b.cpuid[0] = CpuidEntry {
            function: 1,
            eax: 0x806f8,
            ..Default::default()
        };
        b.cpuid[1] = CpuidEntry {
            function: 7,
            index: 0,
            flags: CPUID_FLAG_SIGNIFICANT_INDEX,
            ebx: 0xaa,
            ..Default::default()
        };
        b.cpuid[2] = CpuidEntry {
            function: 7,
            index: 1,
            flags: CPUID_FLAG_SIGNIFICANT_INDEX,
            ebx: 0xbb,
            ..Default::default()
        };
        b.cpuid_count = 3;
        assert_eq!(b.cpuid(1, 99)[0], 0x806f8, "leaf 1 ignores the subleaf");
        assert_eq!(b.cpuid(7, 0)[1], 0xaa);
        assert_eq!(b.cpuid(7, 1)[1], 0xbb);
        assert_eq!(b.cpuid(7, 2), [0; 4]);
        assert_eq!(
            b.cpuid(0x4000_0000, 0),
            [0; 4],
            "unknown leaves answer zeros"
        );
    }

    #[test]
    fn test_kernel_types_are_known_only_when_whole() {
        assert!(!AttachBlock::new().kernel_types.is_known());
        let k = KernelTypes {
            current_task: 0x1fb80,
            task_pid: 0x5a0,
            task_tgid: 0x5a4,
            task_comm: 0x758,
            comm_bytes: 16,
            ..KernelTypes::UNKNOWN
        };
        assert!(k.is_known());
        assert!(!k.knows_exe(), "the executable's offsets are unknown");
        let e = KernelTypes {
            task_mm: 0x898,
            mm_exe_file: 0x378,
            file_dentry: 0x18,
            dentry_name_len: 0x24,
            dentry_name: 0x28,
            dentry_parent: 0x18,
            ..k
        };
        assert!(e.knows_exe());
        assert!(!KernelTypes { task_pid: 0, ..e }.knows_exe());
        assert!(!KernelTypes {
            dentry_parent: 0,
            ..e
        }
        .knows_exe());
        assert!(!e.knows_vmas(), "the VMAs' offsets are unknown");
        let v = KernelTypes {
            mm_mt_root: 0x8,
            vma_end: 0x8,
            vma_pgoff: 0x78,
            vma_file: 0x80,
            maple: MapleLayout {
                range_pivot: 8,
                range_slot: 0x80,
                range_meta: 0xf8,
                range_pivots: 15,
                arange_pivot: 8,
                arange_slot: 0x50,
                arange_meta: 0xf0,
                arange_pivots: 9,
            },
            ..e
        };
        assert!(v.knows_vmas(), "vm_start at 0 and no vDSO offset are fine");
        assert!(!KernelTypes { vma_file: 0, ..v }.knows_vmas());
        assert!(!KernelTypes { task_mm: 0, ..v }.knows_vmas());
        let too_big = MapleLayout {
            arange_pivots: 16,
            ..v.maple
        };
        assert!(!KernelTypes {
            maple: too_big,
            ..v
        }
        .knows_vmas());
        let past_the_node = MapleLayout {
            range_slot: 0x88,
            ..v.maple
        };
        assert!(!past_the_node.is_known(), "16 slots from 0x88 end past 256");
        assert!(!KernelTypes { task_pid: 0, ..k }.is_known());
        assert!(!KernelTypes {
            comm_bytes: 17,
            ..k
        }
        .is_known());
    }

    #[test]
    fn test_tool_name_and_options_trim_padding() {
        let mut b = AttachBlock::new();
        b.tool_name[..7].copy_from_slice(b"bbcount");
        b.tool_options[..5].copy_from_slice(b"top=5");
        assert_eq!(b.tool_name(), b"bbcount");
        assert_eq!(b.tool_options(), b"top=5");
    }
}
