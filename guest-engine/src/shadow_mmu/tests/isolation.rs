//! The engine's own memory: its PML4 slots in every root, guest use of the reserved slots
//! or of stolen frames refused, and shadow-MMU failures (out of tables, bad configuration,
//! guest tables outside memory) reported as errors.

use super::*;

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
fn test_guest_use_of_slots_256_to_259_is_refused() {
    let (mut mmu, s) = setup();
    for va in [
        0xffff_8000_0000_1000u64,
        0xffff_8080_0000_2000,
        0xffff_8100_0000_3000,
        0xffff_8180_0000_4000,
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
}

#[test]
fn test_guest_faults_in_slots_256_to_259_are_the_guests_own() {
    let (mut mmu, s) = setup();
    // Supervisor page at the start of each reserved slot; unmapped page after it.
    for slot_va in [
        0xffff_8000_0000_0000u64,
        0xffff_8080_0000_0000,
        0xffff_8100_0000_0000,
        0xffff_8180_0000_0000,
    ] {
        map(&mut mmu, &s, slot_va, 1, 0x30_0000 | P | W | D);
        let unmapped = slot_va + 0x1000;
        // Not present: P = 0; user view sets U; a write sets W.
        assert_eq!(
            fault_code(fill(&mut mmu, unmapped, Access::Read, View::Kernel)),
            0
        );
        assert_eq!(
            fault_code(fill(&mut mmu, unmapped, Access::Write, View::User)),
            PF_WRITE | PF_USER
        );
        // A supervisor page read from user mode: P = 1, U = 1.
        assert_eq!(
            fault_code(fill(&mut mmu, slot_va, Access::Read, View::User)),
            PF_PRESENT | PF_USER
        );
        assert_eq!(
            mmu.translate(GuestVirt(unmapped), Access::Read, View::User),
            Ok(None)
        );
        // Nothing of the guest's is installed: lookups still miss.
        assert_eq!(
            mmu.lookup(GuestVirt(unmapped), Access::Read, View::Kernel),
            Ok(None)
        );
    }
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
