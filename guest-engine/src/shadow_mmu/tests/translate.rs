//! VA → PA answered from the shadow entries (`translate`, `lookup`), with fetch rights
//! checked in software.

use super::*;

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
