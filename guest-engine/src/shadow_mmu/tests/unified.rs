//! Unified roots: the user view served by the kernel root while that root maps nothing
//! the user may not see below `USER_LIMIT` or in `TOP_GUARD`, and split from it for good
//! by the first kernel leaf that breaks the rule.

use super::*;
use crate::shadow_mmu::{TOP_GUARD, USER_LIMIT};

const LOW: u64 = USER_LIMIT - 0x10_0000;

fn setup_unified() -> (ShadowMmu<MockMem>, Space) {
    let mut mem = MockMem::new();
    let space = Space::new(&mut mem);
    let config = ShadowConfig {
        unified: true,
        prefetch: 16,
        ..config()
    };
    let mmu = ShadowMmu::new(mem, config, control(), space.pml4).expect("mmu");
    (mmu, space)
}

fn root(mmu: &mut ShadowMmu<MockMem>, view: View) -> GuestPhys {
    mmu.root(view).expect("root")
}

#[test]
fn test_user_view_shares_the_kernel_root_and_still_faults_on_supervisor_pages() {
    let (mut mmu, s) = setup_unified();
    map(&mut mmu, &s, KERNEL_VA, 1, 0x20_0000 | P | W | D);
    map(&mut mmu, &s, USER_VA, 1, 0x30_0000 | P | W | U | D);
    assert!(mmu.is_unified());
    assert_eq!(root(&mut mmu, View::User), root(&mut mmu, View::Kernel));

    mapped(fill(&mut mmu, KERNEL_VA, Access::Read, View::Kernel));
    assert!(
        mmu.is_unified(),
        "a supervisor page in the upper half keeps it"
    );
    // The leaf is in the shared root, but it is not the user's: a lookup misses and a
    // fill is the fault a CPU at CPL 3 takes (present, user).
    let t = mmu.lookup(GuestVirt(KERNEL_VA), Access::Read, View::User);
    assert_eq!(t, Ok(None));
    assert_eq!(
        fault_code(fill(&mut mmu, KERNEL_VA, Access::Read, View::User)),
        0x5
    );
    // A user fill lands in the same root, with the user's rights; the kernel sees it.
    assert_eq!(
        mapped(fill(&mut mmu, USER_VA + 8, Access::Write, View::User)),
        0x30_0008
    );
    let e = entry(&mut mmu, USER_VA, View::Kernel).expect("shared leaf");
    assert_eq!(e & (P | U | W), P | U | W);
    assert_eq!(
        mmu.lookup(GuestVirt(USER_VA), Access::Write, View::Kernel),
        Ok(Some(GuestPhys(0x30_0000)))
    );
}

#[test]
fn test_a_lower_half_supervisor_page_splits_the_views() {
    let (mut mmu, s) = setup_unified();
    let low = LOW;
    map(&mut mmu, &s, low, 1, 0x40_0000 | P | W | D);
    map(&mut mmu, &s, USER_VA, 1, 0x30_0000 | P | W | U | D);
    mapped(fill(&mut mmu, USER_VA, Access::Read, View::User));
    let kernel = root(&mut mmu, View::Kernel);
    mapped(fill(&mut mmu, low, Access::Read, View::Kernel));
    assert!(!mmu.is_unified());
    let user = root(&mut mmu, View::User);
    assert_ne!(user, kernel);
    assert_eq!(entry(&mut mmu, low, View::User), None);
    assert_eq!(
        fault_code(fill(&mut mmu, low, Access::Read, View::User)),
        0x5
    );
    // Other spaces start unified again.
    let other = Space::new(mmu.mem_mut());
    mmu.write_cr3(other.pml4).expect("cr3");
    assert!(mmu.is_unified());
}

#[test]
fn test_prefetched_lower_half_supervisor_neighbour_splits_the_views() {
    let (mut mmu, s) = setup_unified();
    let low = LOW;
    map(&mut mmu, &s, low, 1, 0x40_0000 | P | W | U | A | D);
    // Accessed supervisor neighbour in the same prefetch group.
    map(&mut mmu, &s, low + 0x1000, 1, 0x41_0000 | P | W | A | D);
    mapped(fill(&mut mmu, low, Access::Read, View::Kernel));
    assert!(
        entry(&mut mmu, low + 0x1000, View::Kernel).is_some(),
        "prefetched"
    );
    assert!(!mmu.is_unified());
}

#[test]
fn test_the_top_guard_splits_and_cr0_wp_clear_unifies_nothing() {
    let (mut mmu, s) = setup_unified();
    let top = TOP_GUARD + 0x1000;
    map(&mut mmu, &s, top, 1, 0x50_0000 | P | W | D);
    mapped(fill(&mut mmu, top, Access::Read, View::Kernel));
    assert!(!mmu.is_unified());

    let (mut mmu, _s) = setup_unified();
    mmu.set_control(PagingControl {
        wp: false,
        ..control()
    })
    .expect("control");
    assert!(!mmu.is_unified());
    assert_ne!(root(&mut mmu, View::User), root(&mut mmu, View::Kernel));
}
