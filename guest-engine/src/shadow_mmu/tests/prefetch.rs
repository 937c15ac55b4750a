//! Prefetch (`ShadowConfig::prefetch`): a 4 KiB fill also shadows the accessed pages of
//! its group, never writes guest tables, respects the view, and its leaves are dropped
//! like any other.

use super::*;

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
