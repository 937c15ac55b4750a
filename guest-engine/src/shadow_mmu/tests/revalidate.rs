//! A CR3 write with `revalidate_on_cr3_write`: the new space's leaves that the guest's
//! tables still map (present, valid, accessed) stay, rewritten with the guest's frame and
//! rights now; anything else is dropped as without it.

use super::*;

fn setup_revalidating() -> (ShadowMmu<MockMem>, Space) {
    let mut mem = MockMem::new();
    let space = Space::new(&mut mem);
    let config = ShadowConfig {
        revalidate_on_cr3_write: true,
        lend_roots: false,
        ..config()
    };
    let mmu = ShadowMmu::new(mem, config, control(), space.pml4).expect("mmu");
    (mmu, space)
}

#[test]
fn test_cr3_write_keeps_leaves_the_guest_still_maps_alike() {
    let (mut mmu, s) = setup_revalidating();
    map(&mut mmu, &s, USER_VA, 1, 0x30_0000 | P | W | U | D);
    map(&mut mmu, &s, USER_VA + 0x1000, 1, 0x31_0000 | P | W | U | D);
    for view in [View::Kernel, View::User] {
        mapped(fill(&mut mmu, USER_VA, Access::Write, view));
        mapped(fill(&mut mmu, USER_VA + 0x1000, Access::Read, view));
    }
    mmu.write_cr3(s.pml4).expect("cr3");
    assert_eq!(mmu.stats().leaves_kept, 4);
    for view in [View::Kernel, View::User] {
        let e = entry(&mut mmu, USER_VA, view).expect("kept");
        assert_eq!(e & (pte::ADDR_MASK | P | W | U), 0x30_0000 | P | W | U);
    }
    // The guest remaps one page and write-protects the other: the first follows the
    // new frame, the second stays read-only.
    map(&mut mmu, &s, USER_VA, 1, 0x40_0000 | P | W | U | A | D);
    map(&mut mmu, &s, USER_VA + 0x1000, 1, 0x31_0000 | P | U | A | D);
    mmu.write_cr3(s.pml4).expect("cr3");
    let e = entry(&mut mmu, USER_VA, View::Kernel).expect("moved");
    assert_eq!(
        e & (pte::ADDR_MASK | P | W),
        0x40_0000 | P | W,
        "the new frame"
    );
    assert_eq!(mmu.stats().leaves_moved, 2, "one leaf in each view");
    let e = entry(&mut mmu, USER_VA + 0x1000, View::Kernel).expect("kept");
    assert_eq!(e & (P | W), P, "read-only now");
    assert_eq!(
        mmu.lookup(GuestVirt(USER_VA + 0x1000), Access::Write, View::Kernel),
        Ok(None)
    );
}

#[test]
fn test_a_moved_leaf_is_listed_under_its_new_frame_only() {
    let (mut mmu, s) = setup_revalidating();
    map(&mut mmu, &s, USER_VA, 1, 0x30_0000 | P | W | U | D);
    mapped(fill(&mut mmu, USER_VA, Access::Write, View::User));
    map(&mut mmu, &s, USER_VA, 1, 0x40_0000 | P | W | U | A | D);
    mmu.write_cr3(s.pml4).expect("cr3");
    // Code in the old frame no longer concerns the leaf; code in the new one does.
    mmu.protect_code_frame(GuestPhys(0x30_0000))
        .expect("protect");
    let e = entry(&mut mmu, USER_VA, View::User).expect("moved");
    assert_eq!(e & (pte::ADDR_MASK | W), 0x40_0000 | W);
    mmu.protect_code_frame(GuestPhys(0x40_0000))
        .expect("protect");
    let e = entry(&mut mmu, USER_VA, View::User).expect("still there");
    assert_eq!(e & (pte::ADDR_MASK | W), 0x40_0000, "write-protected");
}

#[test]
fn test_a_leaf_is_not_moved_to_a_frame_the_guest_may_not_map_nor_without_accessed() {
    let (mut mmu, s) = setup_revalidating();
    map(&mut mmu, &s, USER_VA, 1, 0x30_0000 | P | W | U | D);
    map(&mut mmu, &s, USER_VA + 0x1000, 1, 0x31_0000 | P | W | U | D);
    mapped(fill(&mut mmu, USER_VA, Access::Read, View::User));
    mapped(fill(&mut mmu, USER_VA + 0x1000, Access::Read, View::User));
    map(&mut mmu, &s, USER_VA, 1, STOLEN_BASE | P | W | U | A | D);
    map(&mut mmu, &s, USER_VA + 0x1000, 1, 0x41_0000 | P | W | U | D);
    mmu.write_cr3(s.pml4).expect("cr3");
    assert_eq!(entry(&mut mmu, USER_VA, View::User), None, "stolen frame");
    assert_eq!(
        entry(&mut mmu, USER_VA + 0x1000, View::User),
        None,
        "not accessed"
    );
    assert_eq!(mmu.stats().leaves_moved, 0);
}

#[test]
fn test_cr3_write_drops_leaves_not_accessed_absent_or_now_supervisor() {
    let (mut mmu, s) = setup_revalidating();
    let pages = [USER_VA, USER_VA + 0x1000, USER_VA + 0x2000];
    for (k, va) in pages.iter().enumerate() {
        map(
            &mut mmu,
            &s,
            *va,
            1,
            (0x30_0000 + 0x1000 * k as u64) | P | W | U | D,
        );
        mapped(fill(&mut mmu, *va, Access::Read, View::User));
    }
    // Accessed cleared (a CPU must walk to use it again); not present; and one made
    // supervisor at the page-directory level (the user view may not see it).
    map(&mut mmu, &s, pages[0], 1, 0x30_0000 | P | W | U | D);
    map(&mut mmu, &s, pages[1], 1, 0);
    mmu.write_cr3(s.pml4).expect("cr3");
    assert_eq!(entry(&mut mmu, pages[0], View::User), None, "not accessed");
    assert_eq!(entry(&mut mmu, pages[1], View::User), None, "not present");
    assert!(entry(&mut mmu, pages[2], View::User).is_some());
    let pde = s.entry(mmu.mem_mut(), pages[2], 2);
    let v = mmu.mem_mut().read_u64(pde).expect("pde");
    mmu.mem_mut().write_u64(pde, v & !U);
    mmu.write_cr3(s.pml4).expect("cr3");
    assert_eq!(
        entry(&mut mmu, pages[2], View::User),
        None,
        "supervisor now"
    );
    assert_eq!(
        fault_code(fill(&mut mmu, pages[2], Access::Read, View::User)),
        0x5
    );
}

#[test]
fn test_a_kept_leaf_the_hardware_marked_accessed_and_dirty_is_left_as_it_is() {
    let (mut mmu, s) = setup_revalidating();
    map(&mut mmu, &s, USER_VA, 1, 0x30_0000 | P | W | U | D);
    mapped(fill(&mut mmu, USER_VA, Access::Write, View::Kernel));
    // The CPU uses the leaf: it sets A and D in the shadow entry itself.
    let leaf = mmu
        .shadow_leaf_ref(GuestVirt(USER_VA), View::Kernel)
        .expect("walk")
        .expect("leaf");
    let used = leaf.entry | A | D;
    mmu.mem_mut().write_u64(leaf.slot, used);
    mmu.take_hw_flush();
    // The guest's tables still say the same: nothing rewritten, nothing to flush.
    mmu.write_cr3(s.pml4).expect("cr3");
    assert_eq!(entry(&mut mmu, USER_VA, View::Kernel), Some(used));
    assert_eq!(mmu.take_hw_flush(), HwFlush::None);
    assert_eq!(mmu.stats().leaves_kept, 1);
    // Made read-only: rewritten (without W) and a flush owed.
    map(&mut mmu, &s, USER_VA, 1, 0x30_0000 | P | U | A | D);
    mmu.write_cr3(s.pml4).expect("cr3");
    let e = entry(&mut mmu, USER_VA, View::Kernel).expect("kept");
    assert_eq!(e & (pte::ADDR_MASK | W | A), 0x30_0000);
    assert_eq!(mmu.take_hw_flush(), HwFlush::All);
}
