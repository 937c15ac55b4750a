//! Fills: the PA and permissions of a shadow leaf in each view, guest A/D bits set as
//! hardware sets them, and guest 2 MiB / 1 GiB pages shadowed with 4 KiB leaves.

use super::*;

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
