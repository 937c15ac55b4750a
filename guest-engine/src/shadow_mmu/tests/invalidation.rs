//! Invalidation: `invlpg`, CR3 writes (global leaves with CR4.PGE), control-bit changes,
//! the hardware flush the embedder owes, and the cache of shadow roots.

use super::*;

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

#[test]
fn test_cr3_write_skips_subtrees_of_only_global_leaves_and_rewalks_after_a_fill() {
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
    mapped(fill(&mut mmu, KERNEL_VA, Access::Read, View::Kernel));
    mapped(fill(&mut mmu, USER_VA, Access::Read, View::Kernel));
    mmu.write_cr3(b.pml4).expect("cr3");
    mmu.write_cr3(a.pml4).expect("cr3");
    // The kernel subtree now holds only the global leaf; a user fill marks only its own
    // path, so the next CR3 write reads the root and the user path, not the kernel's.
    mapped(fill(&mut mmu, USER_VA, Access::Read, View::Kernel));
    mmu.write_cr3(b.pml4).expect("cr3");
    let reads = mmu.mem().reads;
    mmu.write_cr3(a.pml4).expect("cr3");
    let walked = mmu.mem().reads - reads;
    // The root's 512 slots, then the user PDPT, PD and PT (not the kernel's).
    assert_eq!(walked, 4 * 512, "{walked} reads");
    assert!(entry(&mut mmu, KERNEL_VA, View::Kernel).is_some());
    assert_eq!(entry(&mut mmu, USER_VA, View::Kernel), None);
    // A non-global fill next to the global leaf is dropped by the next CR3 write.
    mapped(fill(
        &mut mmu,
        KERNEL_VA + 0x1000,
        Access::Read,
        View::Kernel,
    ));
    mmu.write_cr3(b.pml4).expect("cr3");
    mmu.write_cr3(a.pml4).expect("cr3");
    assert_eq!(entry(&mut mmu, KERNEL_VA + 0x1000, View::Kernel), None);
    assert!(entry(&mut mmu, KERNEL_VA, View::Kernel).is_some());
}
