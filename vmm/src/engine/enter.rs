//! Entering the engine instead of the guest (`kpin run --tool`): load the engine image
//! into the stolen region, build the boot page tables the engine starts on, capture the
//! guest's vCPU state (exactly as the native boot left it) into the attach block, and
//! point the vCPU at the engine's entry.
//!
//! The engine's entry state: ring 0, long mode, CR3 = the boot tables at
//! `stolen_base + BOOT_PT_OFFSET`, RIP = the image's entry, RSP = [`ENGINE_BOOT_STACK_TOP`],
//! RDI = `WINDOW_VA + ATTACH_OFFSET`, RFLAGS = 2 (interrupts off), no IDT. The boot
//! tables map the whole stolen region at `WINDOW_VA` and guest RAM at `PHYSMAP_VA` with
//! 2 MiB pages (this KVM has no 1 GiB pages), all present, writable and user-accessible:
//! the engine runs at CPL 3 and replaces these tables with its own later.
//!
//! Invariant: nothing here writes guest RAM; the guest's own page tables, GDT and zero
//! page stay exactly as the native boot wrote them.

use std::path::PathBuf;

use kpin_abi::stolen::{ATTACH_OFFSET, BOOT_PT_BYTES, BOOT_PT_OFFSET, PHYSMAP_VA, WINDOW_VA};
use kvm_bindings::{kvm_regs, kvm_sregs, CpuId};
use kvm_ioctls::VcpuFd;
use vm_memory::{Address, Bytes, GuestAddress};

use crate::boot::layout::{ENGINE_BOOT_STACK_TOP, STOLEN_SIZE_BYTES};
use crate::engine::attach::{self, AttachInputs};
use crate::engine::loader;
use crate::error::{Result, VmmError};
use crate::vstate::memory::{e820_map, ram_ranges, stolen_base, VmMemory};
use crate::x86::{set_flat_long_mode_segments, TWO_MIB};
use kpin_abi::x86::{cr0, cr4, efer, pte, rflags};

/// What to run in the engine.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// The engine image (ELF built by `kpin images`).
    pub image: PathBuf,
    /// Tool name.
    pub tool: String,
    /// Tool options, `key=value` separated by spaces.
    pub options: String,
    /// cachesim started with the run simulates on a host thread fed through the record
    /// ring ([`crate::engine::host_sim`]) rather than inside the engine (if the host has a
    /// second core).
    pub host_sim: bool,
    /// Where the guest kernel keeps its running task, from its BTF
    /// ([`crate::diag::kernel_types`]), perhaps still being found; `KernelTypes::UNKNOWN`:
    /// the engine names no processes.
    pub kernel_types: crate::diag::kernel_types::Pending,
}

/// Where the engine was entered.
#[derive(Clone, Debug)]
pub struct EngineEntry {
    /// Entry point (window virtual address).
    pub entry: u64,
    /// CR3 of the boot tables.
    pub cr3: u64,
    /// Guest RIP captured into the attach block.
    pub guest_rip: u64,
    /// Guest CR3 captured into the attach block.
    pub guest_cr3: u64,
}

/// Selector of the engine's 64-bit ring-0 code segment (its GDT's entry 1).
const ENGINE_CS: u16 = 0x08;
/// Selector of the engine's ring-0 data segment (its GDT's entry 2).
const ENGINE_DS: u16 = 0x10;

const TABLE_FLAGS: u64 = pte::PRESENT | pte::WRITABLE | pte::USER;
const ONE_GIB: u64 = 0x4000_0000;
const TABLE_BYTES: usize = 4096;
/// Boot tables: PML4, window PDPT, window PD, physmap PDPT, then physmap PDs.
const PML4: usize = 0;
const WINDOW_PDPT: usize = 1;
const WINDOW_PD: usize = 2;
const PHYSMAP_PDPT: usize = 3;
const FIRST_PHYSMAP_PD: usize = 4;
const TABLES: usize = (BOOT_PT_BYTES as usize) / TABLE_BYTES;

fn pml4_index(va: u64) -> usize {
    ((va >> 39) & 0x1ff) as usize
}

/// The boot page tables for a stolen region at `stolen_base` of `stolen_bytes` and guest
/// RAM `ram` (guest-physical start, bytes), as the [`BOOT_PT_BYTES`] written at
/// `BOOT_PT_OFFSET`. Guest RAM may span at most as many GiB-slots as there are spare
/// tables (four: 0–4 GiB of guest-physical space).
pub fn boot_page_tables(
    stolen_base: u64,
    stolen_bytes: u64,
    ram: &[(u64, u64)],
) -> Result<Vec<u8>> {
    assert!(
        stolen_bytes <= ONE_GIB && stolen_bytes.is_multiple_of(TWO_MIB),
        "the stolen region fits one page directory"
    );
    let mut t = vec![[0u64; 512]; TABLES];
    let table_pa = |i: usize| stolen_base + BOOT_PT_OFFSET + (i * TABLE_BYTES) as u64;
    t[PML4][pml4_index(WINDOW_VA)] = table_pa(WINDOW_PDPT) | TABLE_FLAGS;
    t[WINDOW_PDPT][0] = table_pa(WINDOW_PD) | TABLE_FLAGS;
    let pages = (stolen_bytes / TWO_MIB) as usize;
    for (i, e) in t[WINDOW_PD].iter_mut().take(pages).enumerate() {
        *e = (stolen_base + i as u64 * TWO_MIB) | TABLE_FLAGS | pte::PAGE_SIZE;
    }
    t[PML4][pml4_index(PHYSMAP_VA)] = table_pa(PHYSMAP_PDPT) | TABLE_FLAGS;
    let mut next_pd = FIRST_PHYSMAP_PD;
    for &(start, len) in ram {
        let mut pa = start / TWO_MIB * TWO_MIB;
        while pa < start + len {
            let gib = (pa / ONE_GIB) as usize;
            if t[PHYSMAP_PDPT][gib] == 0 {
                if next_pd == TABLES {
                    return Err(VmmError::EngineRam {
                        ram_end: start + len,
                        mapped: (TABLES - FIRST_PHYSMAP_PD) as u64,
                    });
                }
                t[PHYSMAP_PDPT][gib] = table_pa(next_pd) | TABLE_FLAGS;
                next_pd += 1;
            }
            let pd = ((t[PHYSMAP_PDPT][gib] & !0xfff) - table_pa(0)) as usize / TABLE_BYTES;
            t[pd][((pa % ONE_GIB) / TWO_MIB) as usize] = pa | TABLE_FLAGS | pte::PAGE_SIZE;
            pa += TWO_MIB;
        }
    }
    Ok(t.iter().flatten().flat_map(|e| e.to_le_bytes()).collect())
}

/// Loads the engine, fills the attach block from the vCPU's current (native boot) state,
/// and points the vCPU at the engine's entry.
pub fn enter(
    vcpu: &VcpuFd,
    mem: &VmMemory,
    cpuid: &CpuId,
    cfg: &EngineConfig,
) -> Result<EngineEntry> {
    // Translated code runs on this CPU: the isolation checks emit rorx/sarx.
    if !std::arch::is_x86_feature_detected!("bmi2") {
        return Err(VmmError::HostCpuLacks("BMI2"));
    }
    let elf = std::fs::read(&cfg.image).map_err(|e| VmmError::ReadFile(cfg.image.clone(), e))?;
    let plan = loader::plan(&elf, STOLEN_SIZE_BYTES)
        .map_err(|e| VmmError::EngineImage(cfg.image.clone(), e))?;
    let base = stolen_base(mem.ram_bytes);
    let write = |off: u64, bytes: &[u8]| {
        mem.stolen
            .write_slice(bytes, GuestAddress(base).unchecked_add(off))
            .map_err(|e| VmmError::GuestAccess(base + off, e))
    };
    plan.apply(&elf, write)?;
    let ram: Vec<(u64, u64)> = ram_ranges(mem.ram_bytes)
        .iter()
        .map(|(a, len)| (a.raw_value(), *len as u64))
        .collect();
    write(
        BOOT_PT_OFFSET,
        &boot_page_tables(base, STOLEN_SIZE_BYTES, &ram)?,
    )?;

    let state = attach::read_vcpu(vcpu)?;
    let e820 = e820_map(mem.ram_bytes);
    let block = attach::capture(
        &state,
        &AttachInputs {
            cpuid: cpuid.as_slice(),
            e820: &e820,
            ram_bytes: mem.ram_bytes,
            stolen_base: base,
            stolen_bytes: STOLEN_SIZE_BYTES,
            tool: &cfg.tool,
            options: &cfg.options,
            kernel_types: cfg.kernel_types.get(),
        },
    )?;
    attach::write_block(mem, &block)?;
    // A fresh control area: no request, the new engine publishes its attention word.
    super::detach::write_control(mem, &kpin_abi::attach_control::Control::new())?;

    let cr3 = base + BOOT_PT_OFFSET;
    vcpu.set_sregs(&engine_sregs(state.sregs, cr3))
        .map_err(|e| VmmError::Kvm("KVM_SET_SREGS", e))?;
    vcpu.set_regs(&engine_regs(plan.entry))
        .map_err(|e| VmmError::Kvm("KVM_SET_REGS", e))?;
    Ok(EngineEntry {
        entry: plan.entry,
        cr3,
        guest_rip: block.regs.rip,
        guest_cr3: block.sregs.cr3,
    })
}

/// General registers at the engine's entry.
pub fn engine_regs(entry: u64) -> kvm_regs {
    kvm_regs {
        rip: entry,
        rsp: ENGINE_BOOT_STACK_TOP,
        rdi: WINDOW_VA + ATTACH_OFFSET,
        rflags: rflags::FIXED,
        ..Default::default()
    }
}

/// System registers at the engine's entry: flat ring-0 segments, no IDT, paging on the
/// boot tables at `cr3`.
pub fn engine_sregs(mut s: kvm_sregs, cr3: u64) -> kvm_sregs {
    set_flat_long_mode_segments(&mut s, ENGINE_CS, ENGINE_DS);
    s.gdt.base = 0;
    s.gdt.limit = 0;
    s.idt.base = 0;
    s.idt.limit = 0;
    s.cr0 = cr0::PE | cr0::MP | cr0::ET | cr0::NE | cr0::WP | cr0::PG;
    s.cr2 = 0;
    s.cr3 = cr3;
    s.cr4 = cr4::PAE;
    s.efer = efer::LME | efer::LMA;
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::diag::paging::translate;

    fn walker(tables: &[u8], base: u64) -> impl FnMut(u64) -> Option<u64> + '_ {
        let start = base + BOOT_PT_OFFSET;
        move |pa| {
            let off = usize::try_from(pa.checked_sub(start)?).ok()?;
            Some(u64::from_le_bytes(
                tables.get(off..off + 8)?.try_into().ok()?,
            ))
        }
    }

    #[test]
    fn test_boot_tables_map_the_window_and_guest_ram() {
        let base = 1 << 32;
        let ram = [(0, 256 << 20)];
        let t = boot_page_tables(base, 64 << 20, &ram).unwrap();
        assert_eq!(t.len(), BOOT_PT_BYTES as usize);
        let cr3 = base + BOOT_PT_OFFSET;
        let mut w = walker(&t, base);
        assert_eq!(translate(cr3, WINDOW_VA, &mut w), Some(base));
        assert_eq!(
            translate(cr3, WINDOW_VA + (64 << 20) - 1, &mut w),
            Some(base + (64 << 20) - 1)
        );
        assert_eq!(translate(cr3, WINDOW_VA + (64 << 20), &mut w), None);
        assert_eq!(translate(cr3, PHYSMAP_VA + 0x9000, &mut w), Some(0x9000));
        assert_eq!(
            translate(cr3, PHYSMAP_VA + (256 << 20) - 8, &mut w),
            Some((256 << 20) - 8)
        );
        assert_eq!(translate(cr3, PHYSMAP_VA + (256 << 20), &mut w), None);
        assert_eq!(
            translate(cr3, 0x1000, &mut w),
            None,
            "low memory stays unmapped"
        );
        // Every level is user-accessible (the engine runs at CPL 3).
        for va in [WINDOW_VA, PHYSMAP_VA] {
            let at = pml4_index(va) * 8;
            let pml4e = u64::from_le_bytes(t[at..at + 8].try_into().unwrap());
            assert_eq!(pml4e & TABLE_FLAGS, TABLE_FLAGS, "{va:#x}");
        }
    }

    #[test]
    fn test_ram_above_the_gap_is_mapped_and_too_much_is_an_error() {
        let base = 6 << 30;
        let ram: Vec<(u64, u64)> = ram_ranges(4 << 30)
            .iter()
            .map(|(a, l)| (a.raw_value(), *l as u64))
            .collect();
        let t = boot_page_tables(base, 64 << 20, &ram).unwrap();
        let mut w = walker(&t, base);
        let cr3 = base + BOOT_PT_OFFSET;
        assert_eq!(
            translate(cr3, PHYSMAP_VA + (4 << 30) + 0x1234, &mut w),
            Some((4 << 30) + 0x1234)
        );
        assert_eq!(
            translate(cr3, PHYSMAP_VA + 0xc000_0000, &mut w),
            None,
            "MMIO gap unmapped"
        );
        let ram: Vec<(u64, u64)> = ram_ranges(6 << 30)
            .iter()
            .map(|(a, l)| (a.raw_value(), *l as u64))
            .collect();
        assert!(matches!(
            boot_page_tables(8 << 30, 64 << 20, &ram),
            Err(VmmError::EngineRam { .. })
        ));
    }

    #[test]
    fn test_engine_entry_state() {
        let r = engine_regs(WINDOW_VA + 0x20_0000);
        assert_eq!(r.rdi, WINDOW_VA + ATTACH_OFFSET);
        assert_eq!(r.rflags, 2, "interrupts off");
        let s = engine_sregs(kvm_sregs::default(), 0x1_0000_8000);
        assert_eq!((s.cs.selector, s.cs.l, s.cs.dpl), (ENGINE_CS, 1, 0));
        assert_eq!(s.cr3, 0x1_0000_8000);
        assert_eq!(s.efer & efer::LMA, efer::LMA);
    }
}
