//! 2 MiB shadow leaves (`ShadowConfig::large_pages`): used where the guest maps 2 MiB
//! uniformly, split when a frame inside is protected, dropped by `invlpg` and CR3 writes.

use super::*;

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
