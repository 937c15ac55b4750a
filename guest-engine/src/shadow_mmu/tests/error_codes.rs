//! Guest faults: the #PF error code a real CPU gives at the virtual CPL, for every
//! combination of leaf bits, access, view and control bits (WP, NXE, SMEP), reserved bits.

use super::*;

/// One error-code case: leaf value, access, view, control, expected code (None = mapped).
struct Case {
    leaf: u64,
    access: Access,
    view: View,
    wp: bool,
    nxe: bool,
    smep: bool,
    expect: Option<u32>,
}

fn run_cases(cases: &[Case]) {
    for (i, c) in cases.iter().enumerate() {
        let (mut mmu, s) = setup();
        mmu.set_control(PagingControl {
            wp: c.wp,
            nxe: c.nxe,
            pge: true,
            smep: c.smep,
        })
        .expect("control");
        map(&mut mmu, &s, USER_VA, 1, c.leaf);
        let got = fill(&mut mmu, USER_VA + 0x10, c.access, c.view);
        match c.expect {
            Some(code) => {
                assert_eq!(fault_code(got), code, "case {i}");
                let f = match got {
                    FillOutcome::GuestFault(f) => f,
                    _ => unreachable!(),
                };
                assert_eq!(f.cr2, GuestVirt(USER_VA + 0x10), "case {i}");
            }
            None => assert!(
                matches!(got, FillOutcome::Mapped { .. }),
                "case {i}: {got:?}"
            ),
        }
    }
}

#[test]
fn test_error_codes_not_present_write_user_and_nx_at_vcpl0_and_vcpl3() {
    use Access::*;
    use View::*;
    let c = |leaf, access, view, wp, expect| Case {
        leaf,
        access,
        view,
        wp,
        nxe: true,
        smep: false,
        expect,
    };
    let frame = 0x40_0000;
    run_cases(&[
        // not present
        c(0, Read, Kernel, true, Some(0x0)),
        c(0, Write, Kernel, true, Some(0x2)),
        c(0, Read, User, true, Some(0x4)),
        c(0, Write, User, true, Some(0x6)),
        c(0, Fetch, User, true, Some(0x14)),
        c(frame | W | U, Read, Kernel, true, Some(0x0)),
        // write to read-only
        c(frame | P | U, Write, User, true, Some(0x7)),
        c(frame | P | U, Write, User, false, Some(0x7)),
        c(frame | P | U, Write, Kernel, true, Some(0x3)),
        c(frame | P | U, Write, Kernel, false, None),
        c(frame | P, Write, Kernel, false, None),
        // user access to supervisor
        c(frame | P | W, Read, User, true, Some(0x5)),
        c(frame | P | W, Write, User, true, Some(0x7)),
        c(frame | P | W, Fetch, User, true, Some(0x15)),
        c(frame | P | W, Read, Kernel, true, None),
        // NX fetch
        c(frame | P | W | U | NX, Fetch, Kernel, true, Some(0x11)),
        c(frame | P | W | U | NX, Fetch, User, true, Some(0x15)),
        c(frame | P | W | U | NX, Read, User, true, None),
        c(frame | P | W | U, Fetch, User, true, None),
    ]);
}

#[test]
fn test_error_codes_fetch_bit_needs_nxe_or_smep() {
    use Access::*;
    use View::*;
    let c = |leaf, view, nxe, smep, expect| Case {
        leaf,
        access: Fetch,
        view,
        wp: true,
        nxe,
        smep,
        expect,
    };
    run_cases(&[
        c(0, Kernel, false, false, Some(0x0)),
        c(0, User, false, false, Some(0x4)),
        c(0, Kernel, false, true, Some(0x10)),
        // SMEP: supervisor fetch from a user page
        c(0x40_0000 | P | U, Kernel, false, true, Some(0x11)),
        c(0x40_0000 | P | U, Kernel, false, false, None),
        c(0x40_0000 | P, Kernel, false, true, None),
    ]);
}

#[test]
fn test_error_codes_reserved_bits() {
    use Access::*;
    use View::*;
    let c = |leaf, access, view, nxe, expect| Case {
        leaf,
        access,
        view,
        wp: true,
        nxe,
        smep: false,
        expect,
    };
    let above_maxphy = 1u64 << 47; // phys_addr_bits = 46
    let frame = 0x40_0000;
    run_cases(&[
        c(
            frame | P | W | U | above_maxphy,
            Read,
            Kernel,
            true,
            Some(0x9),
        ),
        c(
            frame | P | W | U | above_maxphy,
            Read,
            User,
            true,
            Some(0xd),
        ),
        c(
            frame | P | W | U | above_maxphy,
            Write,
            User,
            true,
            Some(0xf),
        ),
        c(
            frame | P | W | U | above_maxphy,
            Fetch,
            User,
            true,
            Some(0x1d),
        ),
        // XD without EFER.NXE is reserved
        c(frame | P | W | U | NX, Read, Kernel, false, Some(0x9)),
        c(frame | P | W | U | NX, Read, Kernel, true, None),
        // not-present entries are not checked for reserved bits
        c(frame | W | U | above_maxphy, Read, Kernel, true, Some(0x0)),
    ]);
    // PS in a PML4E is reserved.
    let (mut mmu, s) = setup();
    map(&mut mmu, &s, USER_VA, 4, 0x40_0000 | P | W | U | PS);
    assert_eq!(fault_code(fill(&mut mmu, USER_VA, Read, User)), 0xd);
    // Bits 20:13 of a 2 MiB leaf are reserved.
    map(
        &mut mmu,
        &s,
        0x4000_0000,
        2,
        0x20_0000 | 0x2000 | P | W | U | PS,
    );
    assert_eq!(fault_code(fill(&mut mmu, 0x4000_0000, Read, Kernel)), 0x9);
    // Bits 29:13 of a 1 GiB leaf are reserved.
    map(
        &mut mmu,
        &s,
        0x80_0000_0000,
        3,
        0x4000_0000 | 0x20_0000 | P | W | U | PS,
    );
    assert_eq!(
        fault_code(fill(&mut mmu, 0x80_0000_0000, Read, Kernel)),
        0x9
    );
    // A reserved bit in an intermediate entry.
    map(&mut mmu, &s, 0x40_0000, 1, 0x40_0000 | P | W | U);
    let pdpte = s.entry(mmu.mem_mut(), 0x40_0000, 3);
    let v = mmu.mem_mut().read_u64(pdpte).expect("pdpte");
    mmu.mem_mut().write_u64(pdpte, v | above_maxphy);
    assert_eq!(fault_code(fill(&mut mmu, 0x40_0000, Read, User)), 0xd);
}
