//! `syscall`, `sysretq`, `swapgs`, `rd/wr{fs,gs}base`.

use super::*;
use crate::vcpu::{Sreg, MODE_KERNEL, MODE_USER};

const SYSCALL: &[u8] = &[0x0f, 0x05];
const SYSRETQ: &[u8] = &[0x48, 0x0f, 0x07];
const SWAPGS: &[u8] = &[0x0f, 0x01, 0xf8];
const RDGSBASE_RAX: &[u8] = &[0xf3, 0x48, 0x0f, 0xae, 0xc8];
const WRFSBASE_RAX: &[u8] = &[0xf3, 0x48, 0x0f, 0xae, 0xd0];

#[test]
fn test_syscall_enters_cpl0_with_selectors_from_star_and_masks_rflags() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    to_user(&mut v, &mut r);
    r.rflags |= rflags::CF; // SFMASK 0x47700 clears TF, IF, DF, AC, NT
    v.tf = true; // (TF is virtual)
    let e = run(&mut v, SYSCALL, &mut r);
    assert_eq!(
        e,
        Emulation::Switch {
            next: GuestVirt(0xffff_ffff_8100_0000),
            mode: MODE_KERNEL,
            invalidate_mappings: false
        }
    );
    assert_eq!(r.get(Gpr::Rcx), PC + 2, "RCX = the next instruction");
    assert_eq!(
        r.get(Gpr::R11),
        rflags::FIXED | rflags::IF | rflags::TF | rflags::CF,
        "R11 = RFLAGS before"
    );
    // STAR[47:32] = 0x10: CS = 0x10, SS = 0x18, both RPL 0.
    assert_eq!(v.segs.sregs[Sreg::Cs as usize].selector, 0x10);
    assert_eq!(v.segs.sregs[Sreg::Ss as usize].selector, 0x18);
    assert_eq!(v.cpl(), 0);
    assert!(!v.vif, "SFMASK has IF");
    assert_eq!(r.rflags & rflags::TF, 0);
    assert!(!v.tf);
    assert!(
        v.after_instruction(true, &r.clone(), PC, SYSCALL, &mut r, 0)
            .is_none(),
        "no single-step trap into the kernel entry"
    );
    assert_ne!(r.rflags & rflags::CF, 0);
    assert_eq!(v.mem.views, [crate::shadow_mmu::View::Kernel]);
}

#[test]
fn test_syscall_without_efer_sce_is_ud() {
    let mut b = block();
    b.sregs.efer &= !efer::SCE;
    let mut v = vcpu(&b);
    let mut r = kregs();
    let e = run(&mut v, SYSCALL, &mut r);
    assert_ud(&v, e, &r);
}

#[test]
fn test_sysretq_returns_to_cpl3_with_star_plus_16_and_plus_8() {
    let mut b = block();
    b.msrs[0].value = 0x0023_0010_0000_0000; // STAR[63:48] = 0x23 as Linux sets it
    let mut v = vcpu(&b);
    let mut r = kregs();
    r.set(Gpr::Rcx, 0x40_1000);
    r.set(
        Gpr::R11,
        rflags::FIXED | rflags::IF | rflags::CF | (3 << 12),
    );
    let e = run(&mut v, SYSRETQ, &mut r);
    assert_eq!(
        e,
        Emulation::Switch {
            next: GuestVirt(0x40_1000),
            mode: MODE_USER,
            invalidate_mappings: false
        }
    );
    assert_eq!(v.segs.sregs[Sreg::Cs as usize].selector, 0x33);
    assert_eq!(v.segs.sregs[Sreg::Ss as usize].selector, 0x2b);
    assert_eq!(v.cpl(), 3);
    assert!(v.vif);
    assert_eq!(v.iopl, 3, "RFLAGS from R11, loaded as at CPL 0");
    assert_ne!(r.rflags & rflags::CF, 0);
}

#[test]
fn test_sysretq_to_a_non_canonical_rcx_is_gp0() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    r.set(Gpr::Rcx, 0x0000_8000_0000_0000);
    let e = run(&mut v, SYSRETQ, &mut r);
    assert_gp0(&v, e, &r);
    assert_eq!(v.cpl(), 0);
}

#[test]
fn test_sysretq_at_cpl3_is_gp0() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    to_user(&mut v, &mut r);
    r.set(Gpr::Rcx, 0x40_1000);
    let e = run(&mut v, SYSRETQ, &mut r);
    assert_user_fault(&v, e, &r, 13, Some(0));
}

#[test]
fn test_swapgs_exchanges_gs_base_and_kernel_gs_base() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    assert_eq!(run(&mut v, SWAPGS, &mut r), after(SWAPGS));
    assert_eq!(v.segs.sregs[Sreg::Gs as usize].base, 0x1111_0000);
    assert_eq!(v.msrs.kernel_gs_base, 0xffff_8880_0000_0000);
    assert_eq!(v.hw.gs_base, 0x1111_0000);
    assert_eq!(run(&mut v, SWAPGS, &mut r), after(SWAPGS));
    assert_eq!(v.hw.gs_base, 0xffff_8880_0000_0000);
}

#[test]
fn test_swapgs_at_cpl3_is_gp0() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    to_user(&mut v, &mut r);
    let e = run(&mut v, SWAPGS, &mut r);
    assert_user_fault(&v, e, &r, 13, Some(0));
    assert_eq!(v.msrs.kernel_gs_base, 0x1111_0000);
}

#[test]
fn test_rd_wr_fsgsbase_without_cr4_fsgsbase_are_ud() {
    let b = block();
    let mut v = vcpu(&b);
    let mut r = kregs();
    let e = run(&mut v, RDGSBASE_RAX, &mut r);
    assert_ud(&v, e, &r);
    let mut v = vcpu(&b);
    let e = run(&mut v, WRFSBASE_RAX, &mut r);
    assert_ud(&v, e, &r);
}

#[test]
fn test_wrfsbase_sets_the_base_and_rejects_non_canonical_with_gp0() {
    let b = block();
    let mut v = vcpu(&b);
    v.cr4 |= cr4::FSGSBASE;
    let mut r = kregs();
    to_user(&mut v, &mut r);
    r.set(Gpr::Rax, 0x7f00_0000_0000);
    assert_eq!(run(&mut v, WRFSBASE_RAX, &mut r), after(WRFSBASE_RAX));
    assert_eq!(v.hw.fs_base, 0x7f00_0000_0000);
    r.set(Gpr::Rax, 0x8000_0000_0000_0000);
    let e = run(&mut v, WRFSBASE_RAX, &mut r);
    assert_user_fault(&v, e, &r, 13, Some(0));
    assert_eq!(v.hw.fs_base, 0x7f00_0000_0000);
}

#[test]
fn test_rdgsbase_reads_the_virtual_base() {
    let b = block();
    let mut v = vcpu(&b);
    v.cr4 |= cr4::FSGSBASE;
    let mut r = kregs();
    assert_eq!(run(&mut v, RDGSBASE_RAX, &mut r), after(RDGSBASE_RAX));
    assert_eq!(r.get(Gpr::Rax), 0xffff_8880_0000_0000);
}

#[test]
fn test_sysretq_to_user_lets_the_task_watch_read_current() {
    use crate::layout::INSN_COUNTER_SPREAD;
    use crate::tasks::{InsnCounts, TaskWatch};
    use kpin_abi::attach::KernelTypes;
    const PERCPU: u64 = 0xffff_8880_0f00_0000;
    const TASK: u64 = 0xffff_8880_0100_0000;
    let types = KernelTypes {
        current_task: 0x1fb80,
        task_pid: 0x970,
        task_tgid: 0x974,
        task_comm: 0xba0,
        comm_bytes: 16,
        ..KernelTypes::UNKNOWN
    };
    let counters = alloc::vec![0u64; 2 * INSN_COUNTER_SPREAD];
    // SAFETY: `counters` holds both modes' slots and outlives the virtual CPU.
    let counts = unsafe {
        InsnCounts::from_raw(counters.as_ptr(), counters[INSN_COUNTER_SPREAD..].as_ptr())
    };
    let mut b = block();
    b.msrs[0].value = 0x0023_0010_0000_0000;
    let mut v = vcpu(&b);
    v.mem.map(PERCPU + 0x1f000, true, false);
    v.mem.map(TASK, true, false);
    v.mem.poke_u64(PERCPU + 0x1fb80, TASK);
    v.mem.poke(TASK + 0x970, &[7, 0, 0, 0, 7, 0, 0, 0]);
    v.mem.poke(TASK + 0xba0, b"sh\0");
    v.tasks = Some(TaskWatch::new(&types, counts));
    // After the kernel's `swapgs` its per-CPU base is in KERNEL_GS_BASE.
    v.msrs.kernel_gs_base = PERCPU;
    let mut r = kregs();
    r.set(Gpr::Rcx, 0x40_1000);
    r.set(Gpr::R11, rflags::FIXED | rflags::IF);
    let e = run(&mut v, SYSRETQ, &mut r);
    assert!(
        matches!(
            e,
            Emulation::Switch {
                mode: MODE_USER,
                ..
            }
        ),
        "{e:?}"
    );
    let w = v.tasks.as_ref().unwrap();
    assert_eq!((w.stats.user_entries, w.stats.switches), (1, 1));
    let t = w.report_table();
    assert_eq!(
        (t.rows()[1].key.pid, &t.rows()[1].key.comm[..3]),
        (7, &b"sh\0"[..])
    );
    // A per-CPU base whose page is not mapped: the entry is skipped, nothing is
    // delivered to the guest.
    to_kernel(&mut v);
    v.msrs.kernel_gs_base = 0xffff_8880_0e00_0000;
    let e = run(&mut v, SYSRETQ, &mut r);
    assert!(
        matches!(
            e,
            Emulation::Switch {
                mode: MODE_USER,
                ..
            }
        ),
        "{e:?}"
    );
    assert_eq!(v.cpl(), 3);
    assert_eq!(v.tasks.as_ref().unwrap().stats.reads_failed, 1);
}

/// Puts the virtual CPU back at CPL 0 (CS = KCODE, SS = KDATA).
fn to_kernel(v: &mut V<'_>) {
    v.segs.sregs[Sreg::Cs as usize] = cache(KCODE, 0xb, 0, true);
    v.segs.sregs[Sreg::Ss as usize] = cache(KDATA, 0x3, 0, false);
}
