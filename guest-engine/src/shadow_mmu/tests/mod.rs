//! Host tests of the shadow MMU over a mock physical memory holding synthetic guest page
//! tables.

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

#[test]
fn test_fill_maps_right_pa_and_permissions_in_both_views() {
    let (mut mmu, s) = setup();
    map(&mut mmu, &s, KERNEL_VA, 1, 0x20_0000 | P | W | D);
    map(&mut mmu, &s, USER_VA, 1, 0x30_0000 | P | W | U | D);
    map(&mut mmu, &s, USER_VA + 0x1000, 1, 0x31_0000 | P | U);

    assert_eq!(
        mapped(fill(
            &mut mmu,
            KERNEL_VA + 0x123,
            Access::Read,
            View::Kernel
        )),
        0x20_0123
    );
    let e = entry(&mut mmu, KERNEL_VA, View::Kernel).expect("kernel leaf");
    assert_eq!(e & pte::ADDR_MASK, 0x20_0000);
    assert_ne!(e & U, 0, "every shadow leaf is user-accessible");
    assert_ne!(e & W, 0, "dirty writable page is writable");
    assert_ne!(e & NX, 0, "hw_nx");
    assert_eq!(e & pte::GLOBAL, 0);

    for view in [View::Kernel, View::User] {
        assert_eq!(
            mapped(fill(&mut mmu, USER_VA + 8, Access::Read, view)),
            0x30_0008
        );
        let e = entry(&mut mmu, USER_VA, view).expect("user leaf");
        assert_eq!(e & (P | U | W), P | U | W);
        assert_eq!(
            mapped(fill(&mut mmu, USER_VA + 0x1000, Access::Read, view)),
            0x31_0000
        );
        let e = entry(&mut mmu, USER_VA + 0x1000, view).expect("read-only leaf");
        assert_eq!(e & (P | U | W), P | U, "read-only in the guest");
    }
    assert_eq!(mmu.stats().fills, 5);
}

#[test]
fn test_supervisor_page_not_reachable_from_user_view() {
    let (mut mmu, s) = setup();
    map(&mut mmu, &s, KERNEL_VA, 1, 0x20_0000 | P | W | D);
    mapped(fill(&mut mmu, KERNEL_VA, Access::Read, View::Kernel));
    assert_eq!(
        fault_code(fill(&mut mmu, KERNEL_VA, Access::Read, View::User)),
        0x5
    );
    assert_eq!(entry(&mut mmu, KERNEL_VA, View::User), None);
    let t = mmu.translate(GuestVirt(KERNEL_VA), Access::Read, View::User);
    assert_eq!(t, Ok(None));
    // U/S = 0 at a higher level also makes the page supervisor.
    map(&mut mmu, &s, USER_VA, 1, 0x30_0000 | P | W | U | D);
    let pde = s.entry(mmu.mem_mut(), USER_VA, 2);
    let v = mmu.mem_mut().read_u64(pde).expect("pde");
    mmu.mem_mut().write_u64(pde, v & !U);
    assert_eq!(
        fault_code(fill(&mut mmu, USER_VA, Access::Write, View::User)),
        0x7
    );
    assert_eq!(mmu.stats().guest_faults, 3);
}

/// One error-code case: leaf value, access, view, control, expected code (None = mapped).
struct Case {
    leaf: u64,
    access: Access,
    view: View,
    wp: bool,
    nxe: bool,
    smep: bool,
    expect: Option<u32>,
}

fn run_cases(cases: &[Case]) {
    for (i, c) in cases.iter().enumerate() {
        let (mut mmu, s) = setup();
        mmu.set_control(PagingControl {
            wp: c.wp,
            nxe: c.nxe,
            pge: true,
            smep: c.smep,
        })
        .expect("control");
        map(&mut mmu, &s, USER_VA, 1, c.leaf);
        let got = fill(&mut mmu, USER_VA + 0x10, c.access, c.view);
        match c.expect {
            Some(code) => {
                assert_eq!(fault_code(got), code, "case {i}");
                let f = match got {
                    FillOutcome::GuestFault(f) => f,
                    _ => unreachable!(),
                };
                assert_eq!(f.cr2, GuestVirt(USER_VA + 0x10), "case {i}");
            }
            None => assert!(
                matches!(got, FillOutcome::Mapped { .. }),
                "case {i}: {got:?}"
            ),
        }
    }
}

#[test]
fn test_error_codes_not_present_write_user_and_nx_at_vcpl0_and_vcpl3() {
    use Access::*;
    use View::*;
    let c = |leaf, access, view, wp, expect| Case {
        leaf,
        access,
        view,
        wp,
        nxe: true,
        smep: false,
        expect,
    };
    let frame = 0x40_0000;
    run_cases(&[
        // not present
        c(0, Read, Kernel, true, Some(0x0)),
        c(0, Write, Kernel, true, Some(0x2)),
        c(0, Read, User, true, Some(0x4)),
        c(0, Write, User, true, Some(0x6)),
        c(0, Fetch, User, true, Some(0x14)),
        c(frame | W | U, Read, Kernel, true, Some(0x0)),
        // write to read-only
        c(frame | P | U, Write, User, true, Some(0x7)),
        c(frame | P | U, Write, User, false, Some(0x7)),
        c(frame | P | U, Write, Kernel, true, Some(0x3)),
        c(frame | P | U, Write, Kernel, false, None),
        c(frame | P, Write, Kernel, false, None),
        // user access to supervisor
        c(frame | P | W, Read, User, true, Some(0x5)),
        c(frame | P | W, Write, User, true, Some(0x7)),
        c(frame | P | W, Fetch, User, true, Some(0x15)),
        c(frame | P | W, Read, Kernel, true, None),
        // NX fetch
        c(frame | P | W | U | NX, Fetch, Kernel, true, Some(0x11)),
        c(frame | P | W | U | NX, Fetch, User, true, Some(0x15)),
        c(frame | P | W | U | NX, Read, User, true, None),
        c(frame | P | W | U, Fetch, User, true, None),
    ]);
}

#[test]
fn test_error_codes_fetch_bit_needs_nxe_or_smep() {
    use Access::*;
    use View::*;
    let c = |leaf, view, nxe, smep, expect| Case {
        leaf,
        access: Fetch,
        view,
        wp: true,
        nxe,
        smep,
        expect,
    };
    run_cases(&[
        c(0, Kernel, false, false, Some(0x0)),
        c(0, User, false, false, Some(0x4)),
        c(0, Kernel, false, true, Some(0x10)),
        // SMEP: supervisor fetch from a user page
        c(0x40_0000 | P | U, Kernel, false, true, Some(0x11)),
        c(0x40_0000 | P | U, Kernel, false, false, None),
        c(0x40_0000 | P, Kernel, false, true, None),
    ]);
}

#[test]
fn test_error_codes_reserved_bits() {
    use Access::*;
    use View::*;
    let c = |leaf, access, view, nxe, expect| Case {
        leaf,
        access,
        view,
        wp: true,
        nxe,
        smep: false,
        expect,
    };
    let above_maxphy = 1u64 << 47; // phys_addr_bits = 46
    let frame = 0x40_0000;
    run_cases(&[
        c(
            frame | P | W | U | above_maxphy,
            Read,
            Kernel,
            true,
            Some(0x9),
        ),
        c(
            frame | P | W | U | above_maxphy,
            Read,
            User,
            true,
            Some(0xd),
        ),
        c(
            frame | P | W | U | above_maxphy,
            Write,
            User,
            true,
            Some(0xf),
        ),
        c(
            frame | P | W | U | above_maxphy,
            Fetch,
            User,
            true,
            Some(0x1d),
        ),
        // XD without EFER.NXE is reserved
        c(frame | P | W | U | NX, Read, Kernel, false, Some(0x9)),
        c(frame | P | W | U | NX, Read, Kernel, true, None),
        // not-present entries are not checked for reserved bits
        c(frame | W | U | above_maxphy, Read, Kernel, true, Some(0x0)),
    ]);
    // PS in a PML4E is reserved.
    let (mut mmu, s) = setup();
    map(&mut mmu, &s, USER_VA, 4, 0x40_0000 | P | W | U | PS);
    assert_eq!(fault_code(fill(&mut mmu, USER_VA, Read, User)), 0xd);
    // Bits 20:13 of a 2 MiB leaf are reserved.
    map(
        &mut mmu,
        &s,
        0x4000_0000,
        2,
        0x20_0000 | 0x2000 | P | W | U | PS,
    );
    assert_eq!(fault_code(fill(&mut mmu, 0x4000_0000, Read, Kernel)), 0x9);
    // Bits 29:13 of a 1 GiB leaf are reserved.
    map(
        &mut mmu,
        &s,
        0x80_0000_0000,
        3,
        0x4000_0000 | 0x20_0000 | P | W | U | PS,
    );
    assert_eq!(
        fault_code(fill(&mut mmu, 0x80_0000_0000, Read, Kernel)),
        0x9
    );
    // A reserved bit in an intermediate entry.
    map(&mut mmu, &s, 0x40_0000, 1, 0x40_0000 | P | W | U);
    let pdpte = s.entry(mmu.mem_mut(), 0x40_0000, 3);
    let v = mmu.mem_mut().read_u64(pdpte).expect("pdpte");
    mmu.mem_mut().write_u64(pdpte, v | above_maxphy);
    assert_eq!(fault_code(fill(&mut mmu, 0x40_0000, Read, User)), 0xd);
}

#[test]
fn test_accessed_on_all_levels_and_dirty_only_on_write() {
    let (mut mmu, s) = setup();
    map(&mut mmu, &s, USER_VA, 1, 0x30_0000 | P | W | U);
    assert!(s.path(mmu.mem_mut(), USER_VA).iter().all(|e| e & A == 0));
    mapped(fill(&mut mmu, USER_VA, Access::Read, View::User));
    let path = s.path(mmu.mem_mut(), USER_VA);
    assert_eq!(path.len(), 4);
    assert!(
        path.iter().all(|e| e & A != 0),
        "A on every level: {path:x?}"
    );
    assert!(path.iter().all(|e| e & D == 0), "no D on a read: {path:x?}");
    assert_eq!(mmu.stats().ad_updates, 4);

    mapped(fill(&mut mmu, USER_VA, Access::Write, View::User));
    let path = s.path(mmu.mem_mut(), USER_VA);
    assert_ne!(path[3] & D, 0, "D on the leaf");
    assert!(path[..3].iter().all(|e| e & D == 0), "D only on the leaf");
    assert_eq!(mmu.stats().ad_updates, 5);

    // A faulting walk writes nothing.
    map(&mut mmu, &s, USER_VA + 0x1000, 1, 0x31_0000 | P | U);
    let pd = s.entry(mmu.mem_mut(), USER_VA + 0x1000, 2);
    let before = mmu.mem_mut().read_u64(pd).expect("pde");
    fault_code(fill(&mut mmu, USER_VA + 0x1000, Access::Write, View::User));
    assert_eq!(s.path(mmu.mem_mut(), USER_VA + 0x1000)[3] & (A | D), 0);
    assert_eq!(mmu.mem_mut().read_u64(pd), Some(before));
}

#[test]
fn test_first_write_to_clean_page_faults_once_and_sets_dirty() {
    let (mut mmu, s) = setup();
    let leaf = map(&mut mmu, &s, USER_VA, 1, 0x30_0000 | P | W | U);
    for view in [View::Kernel, View::User] {
        mapped(fill(&mut mmu, USER_VA, Access::Read, view));
        let e = entry(&mut mmu, USER_VA, view).expect("leaf");
        assert_eq!(e & W, 0, "clean page is read-only in the shadow");
        assert_eq!(
            mmu.lookup(GuestVirt(USER_VA), Access::Write, view),
            Ok(None)
        );
    }
    // The hardware write fault (P|W|U at CPL 3) on the read-only shadow.
    let out = mmu
        .on_page_fault(
            GuestVirt(USER_VA + 4),
            PF_PRESENT | PF_WRITE | PF_USER,
            View::User,
        )
        .expect("fault");
    assert_eq!(mapped(out), 0x30_0004);
    assert_ne!(mmu.mem_mut().read_u64(leaf).expect("leaf") & D, 0);
    assert_ne!(entry(&mut mmu, USER_VA, View::User).expect("leaf") & W, 0);
    // The kernel view's entry is still read-only; its next write fault upgrades it
    // without another A/D update.
    let ad = mmu.stats().ad_updates;
    assert_eq!(entry(&mut mmu, USER_VA, View::Kernel).expect("leaf") & W, 0);
    mapped(fill(&mut mmu, USER_VA, Access::Write, View::Kernel));
    assert_ne!(entry(&mut mmu, USER_VA, View::Kernel).expect("leaf") & W, 0);
    assert_eq!(mmu.stats().ad_updates, ad);
    // A read of a guest-dirty page maps it writable at once.
    map(&mut mmu, &s, USER_VA + 0x1000, 1, 0x31_0000 | P | W | U | D);
    mapped(fill(&mut mmu, USER_VA + 0x1000, Access::Read, View::User));
    assert_ne!(
        entry(&mut mmu, USER_VA + 0x1000, View::User).expect("leaf") & W,
        0
    );
}

#[test]
fn test_2mib_guest_page_maps_4k_frames_inside_it() {
    let (mut mmu, s) = setup();
    let va = 0x4000_0000;
    let pde = map(
        &mut mmu,
        &s,
        va,
        2,
        0x60_0000 | P | W | U | PS | pte::LARGE_PAT | pte::PWT,
    );
    assert_eq!(
        mapped(fill(&mut mmu, va + 0x1_2345, Access::Read, View::User)),
        0x61_2345
    );
    let e = entry(&mut mmu, va + 0x1_2000, View::User).expect("leaf");
    assert_eq!(e & pte::ADDR_MASK, 0x61_2000);
    assert_eq!(
        e & (pte::PTE_PAT | pte::PWT),
        pte::PTE_PAT | pte::PWT,
        "caching bits"
    );
    assert_eq!(
        entry(&mut mmu, va, View::User),
        None,
        "only the touched 4 KiB is mapped"
    );
    assert_eq!(mmu.mem_mut().read_u64(pde).expect("pde") & (A | D), A);
    mapped(fill(&mut mmu, va + 0x1f_f000, Access::Write, View::User));
    assert_eq!(mmu.mem_mut().read_u64(pde).expect("pde") & (A | D), A | D);
    assert_eq!(
        mmu.translate(GuestVirt(va + 0x1f_fff8), Access::Write, View::User),
        Ok(Some(GuestPhys(0x7f_fff8)))
    );
}

#[test]
fn test_1gib_guest_page_maps_4k_frames_inside_it() {
    let (mut mmu, s) = setup();
    let va = 0xffff_8880_0000_0000; // Linux's direct map uses 1 GiB pages
    let pdpte = map(&mut mmu, &s, va, 3, 0x4000_0000 | P | W | PS | pte::GLOBAL);
    assert_eq!(
        mapped(fill(
            &mut mmu,
            va + 0x1234_5678,
            Access::Write,
            View::Kernel
        )),
        0x5234_5678
    );
    let e = entry(&mut mmu, va + 0x1234_5000, View::Kernel).expect("leaf");
    assert_eq!(e & pte::ADDR_MASK, 0x5234_5000);
    assert_ne!(e & W, 0);
    assert_ne!(e & pte::SW_GLOBAL, 0);
    assert_eq!(
        mmu.mem_mut().read_u64(pdpte).expect("pdpte") & (A | D),
        A | D
    );
    let path = s.path(mmu.mem_mut(), va);
    assert_eq!(path.len(), 2);
    assert_eq!(
        fault_code(fill(&mut mmu, va, Access::Read, View::User)),
        0x5
    );
}

#[test]
fn test_invlpg_drops_that_va_in_both_views_of_the_current_space_only() {
    let (mut mmu, a) = setup();
    let b = Space::new(mmu.mem_mut());
    for s in [&a, &b] {
        map(&mut mmu, s, USER_VA, 1, 0x30_0000 | P | W | U | D);
        map(&mut mmu, s, USER_VA + 0x1000, 1, 0x31_0000 | P | W | U | D);
    }
    mmu.write_cr3(b.pml4).expect("cr3");
    mapped(fill(&mut mmu, USER_VA, Access::Read, View::User));
    mmu.write_cr3(a.pml4).expect("cr3");
    for view in [View::Kernel, View::User] {
        mapped(fill(&mut mmu, USER_VA, Access::Read, view));
        mapped(fill(&mut mmu, USER_VA + 0x1000, Access::Read, view));
    }
    mmu.take_hw_flush();
    mmu.invlpg(GuestVirt(USER_VA + 0x10)).expect("invlpg");
    for view in [View::Kernel, View::User] {
        assert_eq!(entry(&mut mmu, USER_VA, view), None);
        assert!(entry(&mut mmu, USER_VA + 0x1000, view).is_some());
    }
    assert_eq!(
        mmu.take_hw_flush(),
        HwFlush::Pages(vec![GuestVirt(USER_VA)])
    );
    assert_eq!(
        mmu.reverse_map().mappings(GuestPhys(0x30_0000)).len(),
        1,
        "space B keeps it"
    );
    assert_eq!(mmu.stats().invalidations, 3);
}

#[test]
fn test_invlpg_drops_global_entries_of_other_spaces() {
    let (mut mmu, a) = setup();
    let b = Space::new(mmu.mem_mut());
    for s in [&a, &b] {
        map(
            &mut mmu,
            s,
            KERNEL_VA,
            1,
            0x20_0000 | P | W | D | pte::GLOBAL,
        );
    }
    mapped(fill(&mut mmu, KERNEL_VA, Access::Read, View::Kernel));
    mmu.write_cr3(b.pml4).expect("cr3");
    mmu.invlpg(GuestVirt(KERNEL_VA)).expect("invlpg");
    mmu.write_cr3(a.pml4).expect("cr3");
    assert_eq!(entry(&mut mmu, KERNEL_VA, View::Kernel), None);
    assert_eq!(mmu.reverse_map().mapping_count(), 0);
}

#[test]
fn test_cr3_write_drops_non_global_and_keeps_global_with_pge() {
    let (mut mmu, a) = setup();
    let b = Space::new(mmu.mem_mut());
    map(
        &mut mmu,
        &a,
        KERNEL_VA,
        1,
        0x20_0000 | P | W | D | pte::GLOBAL,
    );
    map(&mut mmu, &a, KERNEL_VA + 0x1000, 1, 0x21_0000 | P | W | D);
    map(&mut mmu, &a, USER_VA, 1, 0x30_0000 | P | W | U | D);
    map(&mut mmu, &b, USER_VA, 1, 0x50_0000 | P | W | U | D);
    let fill_a = |mmu: &mut ShadowMmu<MockMem>| {
        mapped(fill(mmu, KERNEL_VA, Access::Read, View::Kernel));
        mapped(fill(mmu, KERNEL_VA + 0x1000, Access::Read, View::Kernel));
        mapped(fill(mmu, USER_VA, Access::Read, View::Kernel));
        mapped(fill(mmu, USER_VA, Access::Read, View::User));
    };
    fill_a(&mut mmu);
    let root_a = mmu.root(View::Kernel).expect("root");

    // Switch to B: A's roots are kept as they are; B's view sees its own mapping.
    mmu.write_cr3(b.pml4).expect("cr3");
    assert_eq!(mmu.take_hw_flush(), HwFlush::All);
    assert_eq!(entry(&mut mmu, USER_VA, View::User), None);
    assert_eq!(
        mapped(fill(&mut mmu, USER_VA, Access::Read, View::User)),
        0x50_0000
    );

    // Back to A: same root, non-global leaves dropped, the global one kept.
    mmu.write_cr3(a.pml4).expect("cr3");
    assert_eq!(mmu.root(View::Kernel), Ok(root_a));
    assert!(entry(&mut mmu, KERNEL_VA, View::Kernel).is_some());
    assert_eq!(entry(&mut mmu, KERNEL_VA + 0x1000, View::Kernel), None);
    assert_eq!(entry(&mut mmu, USER_VA, View::Kernel), None);
    assert_eq!(entry(&mut mmu, USER_VA, View::User), None);

    // Without PGE a CR3 write drops global leaves too.
    let mut c = control();
    c.pge = false;
    mmu.set_control(c).expect("control");
    fill_a(&mut mmu);
    assert_eq!(
        entry(&mut mmu, KERNEL_VA, View::Kernel).expect("leaf") & pte::SW_GLOBAL,
        0
    );
    mmu.write_cr3(a.pml4).expect("cr3");
    assert_eq!(entry(&mut mmu, KERNEL_VA, View::Kernel), None);
    // The control change flushed B's leaf too; nothing is left anywhere.
    assert_eq!(mmu.reverse_map().mapping_count(), 0);
}

#[test]
fn test_control_change_flushes_everything() {
    let (mut mmu, s) = setup();
    map(&mut mmu, &s, KERNEL_VA, 1, 0x20_0000 | P | D | pte::GLOBAL);
    let mut c = control();
    c.wp = false;
    mmu.set_control(c).expect("control");
    mapped(fill(&mut mmu, KERNEL_VA, Access::Read, View::Kernel));
    assert_ne!(
        entry(&mut mmu, KERNEL_VA, View::Kernel).expect("leaf") & W,
        0,
        "WP=0"
    );
    let tables = mmu.stats().tables;
    mmu.set_control(control()).expect("control");
    assert_eq!(entry(&mut mmu, KERNEL_VA, View::Kernel), None);
    assert!(mmu.stats().tables < tables, "emptied tables are freed");
    mapped(fill(&mut mmu, KERNEL_VA, Access::Read, View::Kernel));
    assert_eq!(
        entry(&mut mmu, KERNEL_VA, View::Kernel).expect("leaf") & W,
        0,
        "WP=1"
    );
    mmu.flush_all().expect("flush");
    assert_eq!(mmu.reverse_map().mapping_count(), 0);
    assert_eq!(mmu.stats().tables, 1, "only the root is left");
}

#[test]
fn test_write_through_alias_to_protected_code_frame_faults_and_is_reported() {
    let (mut mmu, s) = setup();
    let code_va = KERNEL_VA;
    let alias_va = 0xffff_c900_0000_0000; // a vmap alias, as text_poke uses
    let late_alias = USER_VA;
    map(&mut mmu, &s, code_va, 1, 0x20_0000 | P | W | D);
    map(&mut mmu, &s, alias_va, 1, 0x20_0000 | P | W | D);
    map(&mut mmu, &s, late_alias, 1, 0x20_0000 | P | W | U | D);
    mapped(fill(&mut mmu, code_va, Access::Fetch, View::Kernel));
    mapped(fill(&mut mmu, alias_va, Access::Write, View::Kernel));
    assert_ne!(
        entry(&mut mmu, alias_va, View::Kernel).expect("alias") & W,
        0
    );
    mmu.take_hw_flush();

    assert_eq!(mmu.protect_code_frame(GuestPhys(0x20_0000)), Ok(true));
    assert_eq!(mmu.protect_code_frame(GuestPhys(0x20_0000)), Ok(false));
    assert_eq!(mmu.protected_frames(), 1);
    assert_eq!(mmu.stats().protected_frames, 1);
    assert_eq!(
        entry(&mut mmu, alias_va, View::Kernel).expect("alias") & W,
        0
    );
    assert_eq!(entry(&mut mmu, code_va, View::Kernel).expect("code") & W, 0);
    assert_eq!(
        mmu.take_hw_flush(),
        HwFlush::Pages(vec![GuestVirt(code_va), GuestVirt(alias_va)])
    );
    // A later alias is mapped read-only too.
    mapped(fill(&mut mmu, late_alias, Access::Read, View::User));
    assert_eq!(
        entry(&mut mmu, late_alias, View::User).expect("late") & W,
        0
    );

    let out = mmu
        .on_page_fault(
            GuestVirt(alias_va + 0x40),
            PF_PRESENT | PF_WRITE | PF_USER,
            View::Kernel,
        )
        .expect("fault");
    assert_eq!(
        out,
        FillOutcome::ProtectedCode {
            frame: GuestPhys(0x20_0000),
            pa: GuestPhys(0x20_0040)
        }
    );
    assert_eq!(mmu.stats().write_protect_faults, 1);
    // The translator's PA lookup still answers for the write.
    assert_eq!(
        mmu.translate(GuestVirt(late_alias + 8), Access::Write, View::User),
        Ok(Some(GuestPhys(0x20_0008)))
    );

    // The engine invalidates the frame's traces, then drops the protection: every
    // mapping the guest allows to write is writable again, the write re-executes.
    assert_eq!(mmu.unprotect_code_frame(GuestPhys(0x20_0000)), Ok(true));
    assert_ne!(
        entry(&mut mmu, alias_va, View::Kernel).expect("alias") & W,
        0
    );
    assert_ne!(entry(&mut mmu, code_va, View::Kernel).expect("code") & W, 0);
    assert_ne!(
        entry(&mut mmu, late_alias, View::User).expect("late") & W,
        0
    );
    let out = mmu
        .on_page_fault(
            GuestVirt(alias_va + 0x40),
            PF_PRESENT | PF_WRITE | PF_USER,
            View::Kernel,
        )
        .expect("fault");
    assert_eq!(mapped(out), 0x20_0040);
    assert_eq!(mmu.stats().write_protect_faults, 1);
}

#[test]
fn test_protection_spans_spaces_and_views() {
    let (mut mmu, a) = setup();
    let b = Space::new(mmu.mem_mut());
    map(&mut mmu, &a, USER_VA, 1, 0x30_0000 | P | W | U | D);
    map(&mut mmu, &b, USER_VA + 0x5000, 1, 0x30_0000 | P | W | U | D);
    mapped(fill(&mut mmu, USER_VA, Access::Write, View::User));
    mapped(fill(&mut mmu, USER_VA, Access::Write, View::Kernel));
    mmu.write_cr3(b.pml4).expect("cr3");
    mapped(fill(&mut mmu, USER_VA + 0x5000, Access::Write, View::User));
    assert_eq!(mmu.reverse_map().mappings(GuestPhys(0x30_0000)).len(), 3);
    mmu.protect_code_frame(GuestPhys(0x30_0000))
        .expect("protect");
    for m in mmu.reverse_map().mappings(GuestPhys(0x30_0000)).to_vec() {
        assert_eq!(
            mmu.mem_mut().read_u64(m.slot).expect("slot") & W,
            0,
            "{m:?}"
        );
    }
    let out = fill(&mut mmu, USER_VA + 0x5000, Access::Write, View::User);
    assert!(matches!(out, FillOutcome::ProtectedCode { .. }));
}

#[test]
fn test_engine_slots_in_every_root() {
    let (mut mmu, a) = setup();
    let b = Space::new(mmu.mem_mut());
    map(&mut mmu, &a, USER_VA, 1, 0x30_0000 | P | W | U | D);
    let mut roots = Vec::new();
    for s in [&a, &b] {
        mmu.write_cr3(s.pml4).expect("cr3");
        for view in [View::Kernel, View::User] {
            roots.push(mmu.root(view).expect("root"));
        }
    }
    mmu.write_cr3(a.pml4).expect("cr3");
    mapped(fill(&mut mmu, USER_VA, Access::Read, View::User));
    mmu.flush_all().expect("flush");
    assert_eq!(roots.len(), 4);
    for root in roots {
        let mem = mmu.mem_mut();
        assert_eq!(
            mem.read_u64(GuestPhys(root.0 + 257 * 8)),
            Some(WINDOW_PML4E)
        );
        assert_eq!(
            mem.read_u64(GuestPhys(root.0 + 258 * 8)),
            Some(PHYSMAP_PML4E)
        );
        assert_eq!(mem.read_u64(GuestPhys(root.0 + 256 * 8)), Some(0));
    }
}

#[test]
fn test_guest_use_of_slots_256_to_258_is_refused() {
    let (mut mmu, s) = setup();
    for va in [
        0xffff_8000_0000_1000u64,
        0xffff_8080_0000_2000,
        0xffff_8100_0000_3000,
    ] {
        map(&mut mmu, &s, va, 1, 0x30_0000 | P | W | D);
        assert_eq!(
            mmu.fill(GuestVirt(va), Access::Read, View::Kernel),
            Err(ShadowError::ReservedSlot(GuestVirt(va)))
        );
        assert_eq!(
            mmu.translate(GuestVirt(va), Access::Read, View::Kernel),
            Err(ShadowError::ReservedSlot(GuestVirt(va)))
        );
    }
    assert_eq!(
        mmu.fill(GuestVirt(0x0000_8000_0000_0000), Access::Read, View::Kernel),
        Err(ShadowError::NonCanonical(GuestVirt(0x0000_8000_0000_0000)))
    );
    // Slot 259 is the guest's.
    map(
        &mut mmu,
        &s,
        0xffff_8180_0000_0000,
        1,
        0x30_0000 | P | W | D,
    );
    mapped(fill(
        &mut mmu,
        0xffff_8180_0000_0000,
        Access::Read,
        View::Kernel,
    ));
}

#[test]
fn test_guest_mapping_of_stolen_frame_is_refused() {
    let (mut mmu, s) = setup();
    map(&mut mmu, &s, USER_VA, 1, STOLEN_BASE | P | W | U | D);
    assert_eq!(
        mmu.fill(GuestVirt(USER_VA), Access::Read, View::User),
        Err(ShadowError::ForbiddenFrame {
            va: GuestVirt(USER_VA),
            frame: GuestPhys(STOLEN_BASE)
        })
    );
    assert_eq!(entry(&mut mmu, USER_VA, View::User), None);
    // A guest page table in the stolen region is refused before anything is read or set.
    let pde = s.entry(mmu.mem_mut(), USER_VA + 0x20_0000, 2);
    mmu.mem_mut()
        .write_u64(pde, (STOLEN_BASE + 0x10_0000) | P | W | U);
    assert_eq!(
        mmu.fill(GuestVirt(USER_VA + 0x20_0000), Access::Read, View::User),
        Err(ShadowError::ForbiddenTable(GuestPhys(
            STOLEN_BASE + 0x10_0000
        )))
    );
    let mut mem = MockMem::new();
    mem.guest_frame();
    let mut mmu = ShadowMmu::new(mem, config(), control(), STOLEN_BASE).expect("mmu");
    assert_eq!(
        mmu.fill(GuestVirt(USER_VA), Access::Read, View::User),
        Err(ShadowError::ForbiddenTable(GuestPhys(STOLEN_BASE)))
    );
}

#[test]
fn test_hw_flush_degrades_to_full_flush_after_many_pages() {
    let (mut mmu, s) = setup();
    let n = MAX_HW_FLUSH_PAGES as u64 + 1;
    for k in 0..n {
        map(
            &mut mmu,
            &s,
            USER_VA + k * 0x1000,
            1,
            (0x30_0000 + k * 0x1000) | P | W | U | D,
        );
        mapped(fill(
            &mut mmu,
            USER_VA + k * 0x1000,
            Access::Read,
            View::User,
        ));
    }
    assert_eq!(mmu.take_hw_flush(), HwFlush::None, "fills owe no flush");
    for k in 0..n - 1 {
        mmu.invlpg(GuestVirt(USER_VA + k * 0x1000)).expect("invlpg");
    }
    assert!(matches!(mmu.take_hw_flush(), HwFlush::Pages(p) if p.len() == MAX_HW_FLUSH_PAGES));
    for k in 0..n {
        mmu.invlpg(GuestVirt(USER_VA + k * 0x1000)).expect("invlpg");
    }
    assert_eq!(
        mmu.take_hw_flush(),
        HwFlush::Pages(vec![GuestVirt(USER_VA + (n - 1) * 0x1000)])
    );
    assert_eq!(mmu.stats().protected_frames, 0);
}

#[test]
fn test_translate_answers_from_shadow_and_checks_fetch_rights() {
    let (mut mmu, s) = setup();
    map(&mut mmu, &s, USER_VA, 1, 0x30_0000 | P | W | U | D | NX);
    map(&mut mmu, &s, KERNEL_VA, 1, 0x20_0000 | P);
    let va = GuestVirt(USER_VA + 0x10);
    assert_eq!(mmu.lookup(va, Access::Read, View::User), Ok(None));
    assert_eq!(
        mmu.translate(va, Access::Read, View::User),
        Ok(Some(GuestPhys(0x30_0010)))
    );
    assert_eq!(
        mmu.lookup(va, Access::Read, View::User),
        Ok(Some(GuestPhys(0x30_0010)))
    );
    assert_eq!(
        mmu.lookup(va, Access::Write, View::User),
        Ok(Some(GuestPhys(0x30_0010)))
    );
    assert_eq!(mmu.lookup(va, Access::Fetch, View::User), Ok(None));
    let faults = mmu.stats().guest_faults;
    assert_eq!(mmu.translate(va, Access::Fetch, View::User), Ok(None));
    assert_eq!(mmu.stats().guest_faults, faults + 1);
    let k = GuestVirt(KERNEL_VA);
    assert_eq!(
        mmu.translate(k, Access::Fetch, View::Kernel),
        Ok(Some(GuestPhys(0x20_0000)))
    );
    assert_eq!(mmu.translate(k, Access::Fetch, View::User), Ok(None));
    assert_eq!(mmu.translate(k, Access::Write, View::Kernel), Ok(None));
    // A stale shadow entry is trusted until the guest invalidates, like a real TLB.
    map(&mut mmu, &s, KERNEL_VA, 1, 0x22_0000 | P);
    assert_eq!(
        mmu.translate(k, Access::Read, View::Kernel),
        Ok(Some(GuestPhys(0x20_0000)))
    );
    mmu.invlpg(k).expect("invlpg");
    assert_eq!(
        mmu.translate(k, Access::Read, View::Kernel),
        Ok(Some(GuestPhys(0x22_0000)))
    );
}

#[test]
fn test_root_cache_evicts_least_recently_used_space() {
    let mut mem = MockMem::new();
    let spaces: Vec<Space> = (0..3).map(|_| Space::new(&mut mem)).collect();
    for s in &spaces {
        s.map(&mut mem, USER_VA, 1, 0x30_0000 | P | W | U | D);
    }
    let mut cfg = config();
    cfg.max_roots = 4;
    let mut mmu = ShadowMmu::new(mem, cfg, control(), spaces[0].pml4).expect("mmu");
    for s in &spaces[..2] {
        mmu.write_cr3(s.pml4).expect("cr3");
        for view in [View::Kernel, View::User] {
            mapped(fill(&mut mmu, USER_VA, Access::Read, view));
        }
    }
    // Touch space 0 again so space 1 is the oldest.
    mmu.write_cr3(spaces[0].pml4).expect("cr3");
    mmu.root(View::Kernel).expect("root");
    mmu.root(View::User).expect("root");
    assert_eq!(mmu.reverse_map().mapping_count(), 2);
    mmu.write_cr3(spaces[2].pml4).expect("cr3");
    mapped(fill(&mut mmu, USER_VA, Access::Read, View::User));
    assert_eq!(mmu.stats().roots_evicted, 1);
    assert_eq!(
        mmu.reverse_map().mapping_count(),
        2,
        "space 1's leaves went with it"
    );
    mapped(fill(&mut mmu, USER_VA, Access::Read, View::Kernel));
    assert_eq!(mmu.stats().roots_evicted, 2);
    assert_eq!(mmu.reverse_map().mapping_count(), 2);
    // 4 roots, each with PDPT, PD and PT for the one mapping... except evicted ones.
    assert_eq!(mmu.stats().tables, 4 + 2 * 3);
}

#[test]
fn test_out_of_shadow_tables_and_bad_config_are_errors() {
    let mut mem = MockMem::new();
    let s = Space::new(&mut mem);
    s.map(&mut mem, USER_VA, 1, 0x30_0000 | P | W | U | D);
    mem.allocs_left = Some(2);
    let mut mmu = ShadowMmu::new(mem, config(), control(), s.pml4).expect("mmu");
    assert_eq!(
        mmu.fill(GuestVirt(USER_VA), Access::Read, View::User),
        Err(ShadowError::OutOfTables)
    );
    let mut cfg = config();
    cfg.max_roots = 1;
    assert!(matches!(
        ShadowMmu::new(MockMem::new(), cfg, control(), 0),
        Err(ShadowError::TooFewRoots)
    ));
    let mut cfg = config();
    cfg.phys_addr_bits = 64;
    assert!(matches!(
        ShadowMmu::new(MockMem::new(), cfg, control(), 0),
        Err(ShadowError::PhysAddrBits(64))
    ));
    for bad in [3, 1024] {
        let mut cfg = config();
        cfg.prefetch = bad;
        assert!(matches!(
            ShadowMmu::new(MockMem::new(), cfg, control(), 0),
            Err(ShadowError::Prefetch(n)) if n == bad
        ));
    }
}

#[test]
fn test_unbacked_guest_table_is_an_error() {
    let (mut mmu, s) = setup();
    map(&mut mmu, &s, USER_VA, 2, 0x7000_0000 | P | W | U);
    assert!(matches!(
        mmu.fill(GuestVirt(USER_VA), Access::Read, View::User),
        Err(ShadowError::GuestTableUnbacked(_))
    ));
}

#[test]
fn test_protection_inside_a_2mib_guest_page_is_per_4k_frame() {
    let (mut mmu, s) = setup();
    let va = 0x4000_0000;
    map(&mut mmu, &s, va, 2, 0x60_0000 | P | W | U | PS | D);
    mapped(fill(&mut mmu, va + 0x3000, Access::Fetch, View::User));
    mmu.protect_code_frame(GuestPhys(0x60_3000))
        .expect("protect");
    let out = fill(&mut mmu, va + 0x3008, Access::Write, View::User);
    assert!(
        matches!(out, FillOutcome::ProtectedCode { frame, .. } if frame == GuestPhys(0x60_3000))
    );
    assert_eq!(
        mapped(fill(&mut mmu, va + 0x4008, Access::Write, View::User)),
        0x60_4008
    );
    assert_ne!(
        entry(&mut mmu, va + 0x4000, View::User).expect("leaf") & W,
        0
    );
    assert_eq!(
        entry(&mut mmu, va + 0x3000, View::User).expect("leaf") & W,
        0
    );
}

#[test]
fn test_cr3_write_skips_roots_with_nothing_to_drop() {
    let (mut mmu, a) = setup();
    let b = Space::new(mmu.mem_mut());
    map(
        &mut mmu,
        &a,
        KERNEL_VA,
        1,
        0x20_0000 | P | W | D | pte::GLOBAL,
    );
    map(&mut mmu, &a, USER_VA, 1, 0x30_0000 | P | W | U | D);
    mapped(fill(&mut mmu, KERNEL_VA, Access::Read, View::Kernel));
    mapped(fill(&mut mmu, USER_VA, Access::Read, View::User));
    mmu.write_cr3(b.pml4).expect("cr3");
    mmu.write_cr3(a.pml4).expect("cr3");
    assert_eq!(mmu.stats().leaves_dropped, 1, "the non-global leaf");
    // Nothing was filled since: switching away and back reads no shadow table.
    mmu.write_cr3(b.pml4).expect("cr3");
    let reads = mmu.mem().reads;
    mmu.write_cr3(a.pml4).expect("cr3");
    assert_eq!(mmu.mem().reads, reads);
    assert!(
        entry(&mut mmu, KERNEL_VA, View::Kernel).is_some(),
        "global kept"
    );
    // A new fill makes the next CR3 write walk that root again.
    mapped(fill(&mut mmu, USER_VA, Access::Read, View::User));
    mmu.write_cr3(a.pml4).expect("cr3");
    assert_eq!(entry(&mut mmu, USER_VA, View::User), None);
    assert_eq!(mmu.stats().leaves_dropped, 2);
}

fn setup_large() -> (ShadowMmu<MockMem>, Space) {
    let mut mem = MockMem::new();
    let space = Space::new(&mut mem);
    let mut cfg = config();
    cfg.large_pages = true;
    let mmu = ShadowMmu::new(mem, cfg, control(), space.pml4).expect("mmu");
    (mmu, space)
}

fn level(mmu: &mut ShadowMmu<MockMem>, va: u64, view: View) -> Option<u8> {
    mmu.shadow_leaf_level(GuestVirt(va), view).expect("level")
}

#[test]
fn test_large_shadow_leaf_for_2mib_guest_page() {
    let (mut mmu, s) = setup_large();
    let va = 0x4000_0000;
    map(
        &mut mmu,
        &s,
        va,
        2,
        0x60_0000 | P | W | U | PS | D | pte::LARGE_PAT,
    );
    assert_eq!(
        mapped(fill(&mut mmu, va + 0x1_2345, Access::Read, View::User)),
        0x61_2345
    );
    assert_eq!(level(&mut mmu, va, View::User), Some(2));
    let e = entry(&mut mmu, va + 0x1f_f000, View::User).expect("leaf");
    assert_eq!(e & pte::ADDR_MASK, 0x7f_f000);
    assert_eq!(e & (P | U | W), P | U | W);
    assert_ne!(e & pte::PTE_PAT, 0, "PAT moved to bit 7 (the PS position)");
    // The whole 2 MiB answers without another fill.
    let got = mmu.lookup(GuestVirt(va + 0x1f_fff8), Access::Write, View::User);
    assert_eq!(got, Ok(Some(GuestPhys(0x7f_fff8))));
    assert_eq!(mmu.stats().fills, 1);
    assert_eq!(mmu.reverse_map().mapping_count(), 1);
    // 4 KiB guest pages still get 4 KiB leaves.
    map(&mut mmu, &s, USER_VA, 1, 0x30_0000 | P | W | U | D);
    mapped(fill(&mut mmu, USER_VA, Access::Read, View::User));
    assert_eq!(level(&mut mmu, USER_VA, View::User), Some(1));
}

#[test]
fn test_large_shadow_leaves_for_1gib_guest_page_and_clean_write() {
    let (mut mmu, s) = setup_large();
    let va = 0xffff_8880_0000_0000;
    let pdpte = map(&mut mmu, &s, va, 3, 0x4000_0000 | P | W | PS);
    assert_eq!(
        mapped(fill(&mut mmu, va + 0x20_0010, Access::Read, View::Kernel)),
        0x4020_0010
    );
    assert_eq!(
        mapped(fill(&mut mmu, va + 0x60_0010, Access::Read, View::Kernel)),
        0x4060_0010
    );
    assert_eq!(level(&mut mmu, va + 0x20_0000, View::Kernel), Some(2));
    assert_eq!(level(&mut mmu, va + 0x40_0000, View::Kernel), None);
    assert_eq!(
        entry(&mut mmu, va + 0x20_0000, View::Kernel).expect("leaf") & W,
        0,
        "clean"
    );
    // First write: fault, D set on the 1 GiB leaf, the 2 MiB shadow becomes writable.
    let out = mmu
        .on_page_fault(
            GuestVirt(va + 0x20_0010),
            PF_PRESENT | PF_WRITE | PF_USER,
            View::Kernel,
        )
        .expect("fault");
    assert_eq!(mapped(out), 0x4020_0010);
    assert_ne!(mmu.mem_mut().read_u64(pdpte).expect("pdpte") & D, 0);
    assert_ne!(
        entry(&mut mmu, va + 0x3f_f000, View::Kernel).expect("leaf") & W,
        0
    );
    assert_eq!(level(&mut mmu, va + 0x3f_f000, View::Kernel), Some(2));
    assert_eq!(mmu.reverse_map().mapping_count(), 2);
}

#[test]
fn test_protecting_a_frame_splits_its_large_shadow_leaf() {
    let (mut mmu, s) = setup_large();
    let va = 0x4000_0000;
    map(&mut mmu, &s, va, 2, 0x60_0000 | P | W | U | PS | D);
    mapped(fill(&mut mmu, va, Access::Read, View::User));
    mapped(fill(&mut mmu, va, Access::Read, View::Kernel));
    mmu.take_hw_flush();
    mmu.protect_code_frame(GuestPhys(0x60_3000))
        .expect("protect");
    assert_eq!(level(&mut mmu, va, View::User), None);
    assert_eq!(level(&mut mmu, va, View::Kernel), None);
    assert_eq!(mmu.reverse_map().mapping_count(), 0);
    assert_eq!(mmu.take_hw_flush(), HwFlush::Pages(vec![GuestVirt(va)]));
    // Refills are 4 KiB: the protected frame read-only, its neighbours writable.
    let out = fill(&mut mmu, va + 0x3008, Access::Write, View::User);
    assert!(
        matches!(out, FillOutcome::ProtectedCode { frame, .. } if frame == GuestPhys(0x60_3000))
    );
    assert_eq!(level(&mut mmu, va + 0x3000, View::User), Some(1));
    assert_eq!(
        entry(&mut mmu, va + 0x3000, View::User).expect("leaf") & W,
        0
    );
    mapped(fill(&mut mmu, va + 0x4000, Access::Write, View::User));
    assert_eq!(level(&mut mmu, va + 0x4000, View::User), Some(1));
    assert_ne!(
        entry(&mut mmu, va + 0x4000, View::User).expect("leaf") & W,
        0
    );
    // Unprotected again, the next fill in the range makes one 2 MiB leaf again and the
    // 4 KiB leaves under it go.
    mmu.unprotect_code_frame(GuestPhys(0x60_3000))
        .expect("unprotect");
    mapped(fill(&mut mmu, va + 0x8000, Access::Read, View::User));
    assert_eq!(level(&mut mmu, va + 0x3000, View::User), Some(2));
    assert_eq!(mmu.reverse_map().mapping_count(), 1);
    assert!(mmu.reverse_map().mappings(GuestPhys(0x60_3000)).is_empty());
}

#[test]
fn test_invlpg_and_cr3_write_drop_large_shadow_leaves() {
    let (mut mmu, s) = setup_large();
    let b = Space::new(mmu.mem_mut());
    let va = 0x4000_0000;
    map(&mut mmu, &s, va, 2, 0x60_0000 | P | W | U | PS | D);
    mapped(fill(&mut mmu, va + 0x5000, Access::Read, View::User));
    // The guest remaps the range with 4 KiB pages and invalidates one address in it.
    let pde = s.entry(mmu.mem_mut(), va, 2);
    mmu.mem_mut().write_u64(pde, 0);
    map(&mut mmu, &s, va + 0x5000, 1, 0x90_0000 | P | W | U | D);
    mmu.invlpg(GuestVirt(va + 0x5000)).expect("invlpg");
    assert_eq!(
        level(&mut mmu, va, View::User),
        None,
        "the whole 2 MiB leaf went"
    );
    assert_eq!(
        mapped(fill(&mut mmu, va + 0x5010, Access::Read, View::User)),
        0x90_0010
    );
    assert_eq!(level(&mut mmu, va + 0x5000, View::User), Some(1));
    // Back to a 2 MiB guest page: the page table under the PDE is replaced.
    mmu.mem_mut().write_u64(pde, 0x60_0000 | P | W | U | PS | D);
    mmu.invlpg(GuestVirt(va + 0x5000)).expect("invlpg");
    mapped(fill(&mut mmu, va + 0x7000, Access::Read, View::User));
    assert_eq!(level(&mut mmu, va + 0x5000, View::User), Some(2));
    assert_eq!(mmu.reverse_map().mapping_count(), 1);
    mmu.write_cr3(b.pml4).expect("cr3");
    mmu.write_cr3(s.pml4).expect("cr3");
    assert_eq!(level(&mut mmu, va, View::User), None);
    assert_eq!(mmu.reverse_map().mapping_count(), 0);
    assert_eq!(mmu.stats().tables, 1, "only the user-view root is left");
}

fn setup_prefetch(group: usize) -> (ShadowMmu<MockMem>, Space) {
    let mut mem = MockMem::new();
    let space = Space::new(&mut mem);
    let mut cfg = config();
    cfg.prefetch = group;
    let mmu = ShadowMmu::new(mem, cfg, control(), space.pml4).expect("mmu");
    (mmu, space)
}

#[test]
fn test_prefetch_shadows_accessed_neighbours_in_the_group_without_touching_guest_tables() {
    let (mut mmu, s) = setup_prefetch(8);
    let base = USER_VA & !0x7fff; // an aligned group of 8 pages
    let page = |k: u64| base + k * 0x1000;
    // 0: the faulting page (not yet accessed); 1: accessed+dirty, writable; 2: accessed,
    // clean, writable; 3: accessed supervisor page; 4: not accessed; 5: not present;
    // 6: accessed, reserved bit set; 7: accessed, frame in the stolen region.
    let entries = [
        0x30_0000 | P | W | U,
        0x30_1000 | P | W | U | A | D,
        0x30_2000 | P | W | U | A,
        0x30_3000 | P | W | A | D,
        0x30_4000 | P | W | U,
        0,
        0x30_6000 | P | U | A | (1 << 50),
        STOLEN_BASE | P | U | A,
    ];
    let slots: Vec<GuestPhys> = entries
        .iter()
        .enumerate()
        .map(|(k, e)| map(&mut mmu, &s, page(k as u64), 1, *e))
        .collect();
    // A page of the next group, accessed: outside the group, not prefetched.
    map(&mut mmu, &s, page(8), 1, 0x30_8000 | P | U | A);
    assert_eq!(
        mapped(fill(&mut mmu, page(0), Access::Read, View::Kernel)),
        0x30_0000
    );
    let e1 = entry(&mut mmu, page(1), View::Kernel).expect("page 1 prefetched");
    assert_eq!(e1 & pte::ADDR_MASK, 0x30_1000);
    assert_ne!(e1 & W, 0, "accessed and dirty: writable");
    let e2 = entry(&mut mmu, page(2), View::Kernel).expect("page 2 prefetched");
    assert_eq!(e2 & W, 0, "clean: read-only until a write fault sets D");
    assert!(entry(&mut mmu, page(3), View::Kernel).is_some());
    for k in [4, 5, 6, 7, 8] {
        assert_eq!(entry(&mut mmu, page(k), View::Kernel), None, "page {k}");
    }
    assert_eq!(mmu.stats().prefetched, 3);
    assert_eq!(mmu.stats().fills, 1);
    // Only the faulting page's entries changed (its A bit).
    for (k, slot) in slots.iter().enumerate().skip(1) {
        assert_eq!(mmu.mem_mut().read_u64(*slot), Some(entries[k]), "page {k}");
    }
    // A write to the clean prefetched page faults once and sets its D bit.
    assert_eq!(
        mmu.lookup(GuestVirt(page(2)), Access::Write, View::Kernel),
        Ok(None)
    );
    assert_eq!(
        mapped(fill(&mut mmu, page(2), Access::Write, View::Kernel)),
        0x30_2000
    );
    assert_eq!(mmu.mem_mut().read_u64(slots[2]), Some(entries[2] | D));
    // Prefetched leaves are in the reverse map: protecting one's frame drops its W.
    mmu.protect_code_frame(GuestPhys(0x30_1000))
        .expect("protect");
    assert_eq!(
        entry(&mut mmu, page(1), View::Kernel).expect("page 1") & W,
        0
    );
}

#[test]
fn test_prefetch_in_the_user_view_skips_supervisor_pages() {
    let (mut mmu, s) = setup_prefetch(4);
    let base = USER_VA & !0x3fff;
    map(&mut mmu, &s, base, 1, 0x30_0000 | P | U);
    map(&mut mmu, &s, base + 0x1000, 1, 0x30_1000 | P | U | A);
    map(&mut mmu, &s, base + 0x2000, 1, 0x30_2000 | P | A);
    assert_eq!(
        mapped(fill(&mut mmu, base, Access::Read, View::User)),
        0x30_0000
    );
    assert!(entry(&mut mmu, base + 0x1000, View::User).is_some());
    assert_eq!(entry(&mut mmu, base + 0x2000, View::User), None);
}

#[test]
fn test_prefetch_inside_a_large_guest_page_split_into_4k_leaves() {
    let (mut mmu, s) = setup_prefetch(16);
    // A 2 MiB guest page (4 KiB shadow leaves: large shadow leaves are off).
    map(&mut mmu, &s, KERNEL_VA, 2, 0x4000_0000 | P | W | PS);
    assert_eq!(
        mapped(fill(
            &mut mmu,
            KERNEL_VA + 0x5000,
            Access::Write,
            View::Kernel
        )),
        0x4000_5000
    );
    for k in 0..16u64 {
        let e = entry(&mut mmu, KERNEL_VA + k * 0x1000, View::Kernel).expect("prefetched");
        assert_eq!(e & pte::ADDR_MASK, 0x4000_0000 + k * 0x1000);
        assert_ne!(e & W, 0, "the large leaf is dirty now");
    }
    assert_eq!(entry(&mut mmu, KERNEL_VA + 0x10_000, View::Kernel), None);
    assert_eq!(mmu.stats().prefetched, 15);
}

#[test]
fn test_invlpg_and_cr3_write_drop_prefetched_leaves() {
    let (mut mmu, s) = setup_prefetch(4);
    let base = USER_VA & !0x3fff;
    map(&mut mmu, &s, base, 1, 0x30_0000 | P | U | A);
    map(&mut mmu, &s, base + 0x1000, 1, 0x30_1000 | P | U | A);
    fill(&mut mmu, base, Access::Read, View::Kernel);
    assert!(entry(&mut mmu, base + 0x1000, View::Kernel).is_some());
    mmu.invlpg(GuestVirt(base + 0x1000)).expect("invlpg");
    assert_eq!(entry(&mut mmu, base + 0x1000, View::Kernel), None);
    fill(&mut mmu, base + 0x1000, Access::Read, View::Kernel);
    assert!(entry(&mut mmu, base, View::Kernel).is_some());
    mmu.write_cr3(s.pml4).expect("cr3");
    assert_eq!(entry(&mut mmu, base, View::Kernel), None);
    assert_eq!(entry(&mut mmu, base + 0x1000, View::Kernel), None);
    assert_eq!(mmu.reverse_map().mapping_count(), 0);
}

#[test]
fn test_unprotect_all_restores_write_access_to_every_protected_frame() {
    let (mut mmu, s) = setup();
    map(&mut mmu, &s, KERNEL_VA, 1, 0x30_0000 | P | W | D);
    map(&mut mmu, &s, KERNEL_VA + 0x1000, 1, 0x30_1000 | P | W | D);
    fill(&mut mmu, KERNEL_VA, Access::Write, View::Kernel);
    fill(&mut mmu, KERNEL_VA + 0x1000, Access::Write, View::Kernel);
    for f in [0x30_0000, 0x30_1000] {
        mmu.protect_code_frame(GuestPhys(f)).expect("protect");
    }
    assert_eq!(
        entry(&mut mmu, KERNEL_VA, View::Kernel).expect("leaf") & W,
        0
    );
    assert_eq!(mmu.unprotect_all_code_frames(), Ok(2));
    assert_eq!(mmu.protected_frames(), 0);
    for va in [KERNEL_VA, KERNEL_VA + 0x1000] {
        assert_ne!(entry(&mut mmu, va, View::Kernel).expect("leaf") & W, 0);
    }
}
