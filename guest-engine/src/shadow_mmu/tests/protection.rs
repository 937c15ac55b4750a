//! Write protection of code frames (self-modifying code): writes through any alias fault
//! and are reported, across spaces and views, per 4 KiB frame, and unprotection restores
//! write access.

use super::*;

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
