//! Lending a kernel root across CR3 writes (`lend.rs`): Linux's `text_poke` pattern
//! (a space with an empty lower half, a space sharing its kernel half with one
//! supervisor page in the lower half, back and forth) costs one real CR3 load per round
//! trip, and the guest sees what a CPU would give it.

use super::*;

/// The poking address: a supervisor page in the lower half.
const POKE_VA: u64 = 0x0000_3a00_0000_0000;

fn setup_lending() -> (ShadowMmu<MockMem>, Space, Space) {
    let mut mem = MockMem::new();
    let init = Space::new(&mut mem);
    let poking = Space::new(&mut mem);
    let config = ShadowConfig {
        revalidate_on_cr3_write: true,
        lend_roots: true,
        ..config()
    };
    let mut mmu = ShadowMmu::new(mem, config, control(), init.pml4).expect("mmu");
    for s in [&init, &poking] {
        map(
            &mut mmu,
            s,
            KERNEL_VA,
            1,
            0x20_0000 | P | W | A | D | pte::GLOBAL,
        );
    }
    (mmu, init, poking)
}

#[test]
fn test_text_poke_round_trip_keeps_the_root_and_parks_the_poking_page() {
    let (mut mmu, init, poking) = setup_lending();
    let pte = map(&mut mmu, &poking, POKE_VA, 1, 0x40_0000 | P | W | A | D);
    mapped(fill(&mut mmu, KERNEL_VA, Access::Read, View::Kernel));
    let root = mmu.root(View::Kernel).expect("root");
    mmu.take_hw_flush();

    // init → poking: the root is lent, nothing to flush, the global leaf still there.
    mmu.write_cr3(poking.pml4).expect("cr3");
    assert_eq!(mmu.root(View::Kernel), Ok(root));
    assert_eq!(mmu.take_hw_flush(), HwFlush::None);
    assert!(entry(&mut mmu, KERNEL_VA, View::Kernel).is_some());
    assert_eq!(
        mapped(fill(&mut mmu, POKE_VA, Access::Write, View::Kernel)),
        0x40_0000
    );

    // poking → init: the root goes home; the poking page leaves it (a flush is owed)
    // and is the guest's fault in init, as on a CPU.
    mmu.write_cr3(init.pml4).expect("cr3");
    assert_eq!(mmu.root(View::Kernel), Ok(root));
    assert_eq!(mmu.take_hw_flush(), HwFlush::All);
    assert_eq!(entry(&mut mmu, POKE_VA, View::Kernel), None);
    assert_eq!(
        fault_code(fill(&mut mmu, POKE_VA, Access::Read, View::Kernel)),
        0
    );
    assert!(entry(&mut mmu, KERNEL_VA, View::Kernel).is_some());

    // init → poking again: the parked page is back without a fill or a flush.
    let fills = mmu.stats().fills;
    mmu.write_cr3(poking.pml4).expect("cr3");
    assert_eq!(mmu.take_hw_flush(), HwFlush::None);
    assert!(entry(&mut mmu, POKE_VA, View::Kernel).is_some());
    assert_eq!(mmu.stats().fills, fills);

    // The guest maps another frame there meanwhile (the next page `text_poke` patches):
    // the parked leaf is checked and follows it, without a fill, and it was in no real
    // CR3, so still nothing to flush.
    mmu.write_cr3(init.pml4).expect("cr3");
    mmu.take_hw_flush();
    mmu.mem_mut().write_u64(pte, 0x41_0000 | P | W | A | D);
    mmu.write_cr3(poking.pml4).expect("cr3");
    assert_eq!(mmu.take_hw_flush(), HwFlush::None);
    let e = entry(&mut mmu, POKE_VA, View::Kernel).expect("moved");
    assert_eq!(e & (pte::ADDR_MASK | W), 0x41_0000 | W);
    assert_eq!(mmu.stats().fills, fills);
    // Not accessed: dropped, and the fill finds it.
    mmu.write_cr3(init.pml4).expect("cr3");
    mmu.mem_mut().write_u64(pte, 0x42_0000 | P | W | D);
    mmu.write_cr3(poking.pml4).expect("cr3");
    assert_eq!(entry(&mut mmu, POKE_VA, View::Kernel), None);
    assert_eq!(
        mapped(fill(&mut mmu, POKE_VA, Access::Read, View::Kernel)),
        0x42_0000
    );
    let stats = mmu.stats();
    assert_eq!((stats.roots_lent, stats.roots_returned), (4, 3));
}

#[test]
fn test_a_root_with_a_lower_half_or_a_space_with_a_root_is_not_lent() {
    let (mut mmu, init, poking) = setup_lending();
    map(&mut mmu, &init, USER_VA, 1, 0x30_0000 | P | W | U | A | D);
    mapped(fill(&mut mmu, USER_VA, Access::Read, View::Kernel));
    let root = mmu.root(View::Kernel).expect("root");
    mmu.write_cr3(poking.pml4).expect("cr3");
    assert_ne!(
        mmu.root(View::Kernel),
        Ok(root),
        "a lower half: a root of its own"
    );
    assert_eq!(mmu.take_hw_flush(), HwFlush::All);
    let own = mmu.root(View::Kernel).expect("root");
    // Back and forth: each space keeps its own root; nothing is lent or returned.
    mmu.write_cr3(init.pml4).expect("cr3");
    assert_eq!(mmu.root(View::Kernel), Ok(root));
    assert_eq!(mmu.take_hw_flush(), HwFlush::All);
    mmu.write_cr3(poking.pml4).expect("cr3");
    assert_eq!(mmu.root(View::Kernel), Ok(own));
    assert_eq!(mmu.take_hw_flush(), HwFlush::All);
    assert_eq!(entry(&mut mmu, USER_VA, View::Kernel), None);
    assert_eq!((mmu.stats().roots_lent, mmu.stats().roots_returned), (0, 0));
}

#[test]
fn test_a_lent_root_drops_non_global_kernel_leaves_the_borrower_maps_otherwise() {
    let (mut mmu, init, poking) = setup_lending();
    let va = KERNEL_VA + 0x1000;
    map(&mut mmu, &init, va, 1, 0x21_0000 | P | W | A | D);
    map(&mut mmu, &poking, va, 1, 0x22_0000 | P | W | A | D);
    mapped(fill(&mut mmu, va, Access::Read, View::Kernel));
    mmu.take_hw_flush();
    mmu.write_cr3(poking.pml4).expect("cr3");
    assert_eq!(mmu.stats().roots_lent, 1);
    assert_eq!(entry(&mut mmu, va, View::Kernel), None);
    assert_eq!(
        mmu.take_hw_flush(),
        HwFlush::All,
        "a leaf the real CR3 held went"
    );
    assert_eq!(
        mapped(fill(&mut mmu, va, Access::Read, View::Kernel)),
        0x22_0000
    );
}
