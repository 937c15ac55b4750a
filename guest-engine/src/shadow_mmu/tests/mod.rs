//! Host tests of the shadow MMU over a mock physical memory holding synthetic guest page
//! tables: the mock and the helpers here, the tests in one file per concept.

mod error_codes;
mod fill;
mod invalidation;
mod isolation;
mod large;
mod lend;
mod prefetch;
mod protection;
mod revalidate;
mod translate;
mod unified;

use alloc::collections::BTreeMap;
use alloc::vec;
use alloc::vec::Vec;

use super::*;

/// Guest RAM frames (tables) are allocated from here.
const GUEST_TABLES_BASE: u64 = 0x10_0000;
/// "Stolen region": shadow tables and the template root; the guest may not map it.
const STOLEN_BASE: u64 = 0x1_0000_0000;
/// Template PML4 entries of the engine slots (recognisable values).
const WINDOW_PML4E: u64 = 0x1_0000_5000 | pte::PRESENT | pte::WRITABLE | pte::USER;
const PHYSMAP_PML4E: u64 = 0x1_0000_6000 | pte::PRESENT | pte::WRITABLE | pte::USER;
const P: u64 = pte::PRESENT;
const W: u64 = pte::WRITABLE;
const U: u64 = pte::USER;
const A: u64 = pte::ACCESSED;
const D: u64 = pte::DIRTY;
const PS: u64 = pte::PAGE_SIZE;
const NX: u64 = pte::NO_EXECUTE;
const KERNEL_VA: u64 = 0xffff_ffff_8100_0000;
const USER_VA: u64 = 0x0000_7f00_0000_1000;

/// Physical memory made of sparse 4 KiB frames.
#[derive(Default)]
struct MockMem {
    frames: BTreeMap<u64, Vec<u64>>,
    next_guest: u64,
    next_shadow: u64,
    free_shadow: Vec<u64>,
    allocs_left: Option<usize>,
    reads: u64,
}

impl MockMem {
    fn new() -> Self {
        let mut m = MockMem {
            next_guest: GUEST_TABLES_BASE,
            next_shadow: STOLEN_BASE + 0x10_0000,
            ..Default::default()
        };
        m.frames.insert(STOLEN_BASE, vec![0; 512]);
        m.frames.get_mut(&STOLEN_BASE).expect("template")[257] = WINDOW_PML4E;
        m.frames.get_mut(&STOLEN_BASE).expect("template")[258] = PHYSMAP_PML4E;
        m
    }

    fn guest_frame(&mut self) -> u64 {
        let f = self.next_guest;
        self.next_guest += 0x1000;
        self.frames.insert(f, vec![0; 512]);
        f
    }
}

impl PhysMem for MockMem {
    fn read_u64(&mut self, pa: GuestPhys) -> Option<u64> {
        self.reads += 1;
        let f = self.frames.get(&(pa.0 & !0xfff))?;
        Some(f[((pa.0 & 0xfff) / 8) as usize])
    }
    fn write_u64(&mut self, pa: GuestPhys, value: u64) -> bool {
        match self.frames.get_mut(&(pa.0 & !0xfff)) {
            Some(f) => {
                f[((pa.0 & 0xfff) / 8) as usize] = value;
                true
            }
            None => false,
        }
    }
    fn alloc_table(&mut self) -> Option<GuestPhys> {
        if let Some(n) = self.allocs_left.as_mut() {
            if *n == 0 {
                return None;
            }
            *n -= 1;
        }
        let f = self.free_shadow.pop().unwrap_or_else(|| {
            let f = self.next_shadow;
            self.next_shadow += 0x1000;
            f
        });
        self.frames.insert(f, vec![0; 512]);
        Some(GuestPhys(f))
    }
    fn free_table(&mut self, frame: GuestPhys) {
        assert!(self.frames.remove(&frame.0).is_some(), "double free");
        self.free_shadow.push(frame.0);
    }
    fn guest_may_map(&self, frame: GuestPhys) -> bool {
        frame.0 < STOLEN_BASE
    }
}

/// A guest address space under construction.
struct Space {
    pml4: u64,
}

impl Space {
    fn new(mem: &mut MockMem) -> Self {
        Space {
            pml4: mem.guest_frame(),
        }
    }

    /// Address of the guest entry for `va` at `level`, building tables above it with
    /// P|W|U intermediate entries.
    fn entry(&self, mem: &mut MockMem, va: u64, level: u8) -> GuestPhys {
        let mut table = self.pml4;
        for l in (level + 1..=4).rev() {
            let slot = GuestPhys(table + pte::index(va, l) as u64 * 8);
            let e = mem.read_u64(slot).expect("guest table");
            table = if e & P != 0 {
                e & pte::ADDR_MASK
            } else {
                let t = mem.guest_frame();
                mem.write_u64(slot, t | P | W | U);
                t
            };
        }
        GuestPhys(table + pte::index(va, level) as u64 * 8)
    }

    fn map(&self, mem: &mut MockMem, va: u64, level: u8, value: u64) -> GuestPhys {
        let slot = self.entry(mem, va, level);
        mem.write_u64(slot, value);
        slot
    }

    /// The four (or fewer) guest entries used to translate `va`, top first.
    fn path(&self, mem: &mut MockMem, va: u64) -> Vec<u64> {
        let mut out = Vec::new();
        let mut table = self.pml4;
        for l in (1..=4).rev() {
            let e = mem
                .read_u64(GuestPhys(table + pte::index(va, l) as u64 * 8))
                .expect("guest table");
            out.push(e);
            if l == 1 || (l <= 3 && e & PS != 0) || e & P == 0 {
                break;
            }
            table = e & pte::ADDR_MASK;
        }
        out
    }
}

fn control() -> PagingControl {
    PagingControl {
        wp: true,
        nxe: true,
        pge: true,
        smep: false,
    }
}

fn config() -> ShadowConfig {
    ShadowConfig {
        template_root: GuestPhys(STOLEN_BASE),
        max_roots: 8,
        phys_addr_bits: 46,
        hw_nx: true,
        large_pages: false,
        prefetch: 0,
        unified: false,
        revalidate_on_cr3_write: false,
        lend_roots: false,
    }
}

fn setup() -> (ShadowMmu<MockMem>, Space) {
    let mut mem = MockMem::new();
    let space = Space::new(&mut mem);
    let mmu = ShadowMmu::new(mem, config(), control(), space.pml4).expect("mmu");
    (mmu, space)
}

fn map(mmu: &mut ShadowMmu<MockMem>, s: &Space, va: u64, level: u8, value: u64) -> GuestPhys {
    s.map(mmu.mem_mut(), va, level, value)
}

fn fill(mmu: &mut ShadowMmu<MockMem>, va: u64, access: Access, view: View) -> FillOutcome {
    mmu.fill(GuestVirt(va), access, view).expect("fill")
}

fn fault_code(outcome: FillOutcome) -> u32 {
    match outcome {
        FillOutcome::GuestFault(f) => {
            assert_eq!(f.vector, 14);
            f.error_code
        }
        other => panic!("expected a guest fault, got {other:?}"),
    }
}

fn mapped(outcome: FillOutcome) -> u64 {
    match outcome {
        FillOutcome::Mapped { pa } => pa.0,
        other => panic!("expected a mapping, got {other:?}"),
    }
}

fn entry(mmu: &mut ShadowMmu<MockMem>, va: u64, view: View) -> Option<u64> {
    mmu.shadow_entry(GuestVirt(va), view).expect("shadow entry")
}
