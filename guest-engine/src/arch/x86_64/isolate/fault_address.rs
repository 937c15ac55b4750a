//! The address a #PF in translated code faulted on, from the guest instruction alone.
//!
//! The engine's #PF handler runs at CPL 3 (natively on a host whose KVM emulates ring 0),
//! where CR2 cannot be read: reading it is a trip to ring 0 that costs as much as the
//! rest of the fault. Most faulting instructions leave one answer: every byte they access
//! lies in pages the shadow tables map for that access but one, and that one is refused
//! the way the error code says (not present, or read-only for a write). Then that is the
//! page a CPU walking those tables faults on, and CR2 is the address the operand starts
//! at. Anything else — no refused page or two, an access split across pages (the address
//! a CPU reports then is its own), a gather's lanes, an error code other than a data
//! access's, code outside 64-bit mode — is `None`, and the caller reads CR2.

use iced_x86::{Decoder, DecoderOptions, InstructionInfoFactory};

use super::super::decode::{listed_memory, mem_operands};
use super::addressing_32;
use super::classify::linear_address;
use crate::context::GuestRegs;
use crate::instrument::access;
use kpin_abi::x86::pf;

/// What the tables a fault was taken under give a page (every level's rights combined).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PageRights {
    /// No present leaf.
    Absent,
    /// Present, some level without W.
    ReadOnly,
    /// Present and writable.
    Writable,
    /// The tables could not be read: no answer.
    Unknown,
}

/// The linear address a hardware #PF with `error` at the guest instruction `bytes` (at
/// `pc`, decoded with `bitness`) faulted on, with the guest state `regs` before it and the
/// FS/GS bases, when the shadow tables leave one answer (see the module header);
/// `rights(va)` is what the shadow tables the fault was taken under give `va`.
#[allow(clippy::too_many_arguments)]
pub fn page_fault_address(
    bitness: u32,
    bytes: &[u8],
    pc: u64,
    regs: &GuestRegs,
    fs_base: u64,
    gs_base: u64,
    error: u32,
    mut rights: impl FnMut(u64) -> PageRights,
) -> Option<u64> {
    // A data access's fault, present or not, read or write; no reserved bit, fetch or
    // protection-key fault (bit 5 and up).
    if error & !(pf::PRESENT | pf::WRITE | pf::USER) != 0 {
        return None;
    }
    // 64-bit mode only: in compatibility mode every segment's base counts (a 32-bit
    // program may run on an LDT segment of its own), and addresses wrap at 4 GiB.
    if bitness != 64 {
        return None;
    }
    let i = Decoder::with_ip(bitness, bytes, pc, DecoderOptions::NONE).decode();
    if i.is_invalid() || i.vsib().is_some() {
        return None;
    }
    let mut factory = InstructionInfoFactory::new();
    let ops = mem_operands(&mut factory, &i);
    // Every access listed (the list has a fixed capacity).
    if ops.is_empty() || listed_memory(factory.info(&i)).count() != ops.len() {
        return None;
    }
    let addr32 = addressing_32(&i);
    let mut refused: Option<(u64, bool, bool, bool)> = None;
    for m in ops.iter() {
        let addr = linear_address(&i, m, regs, fs_base, gs_base, addr32);
        let size = u64::from(m.size);
        let canonical = ((addr as i64) << 16 >> 16) as u64 == addr;
        if size == 0 || !canonical || (addr & 0xfff) + size > 0x1000 {
            return None;
        }
        let (read, write) = (m.access & access::READ != 0, m.access & access::WRITE != 0);
        let (present, writable) = match rights(addr) {
            PageRights::Absent => (false, false),
            PageRights::ReadOnly => (true, false),
            PageRights::Writable => (true, true),
            PageRights::Unknown => return None,
        };
        if present && (writable || !write) {
            continue;
        }
        // Refused: not present, or a write to a read-only page.
        let page = addr & !0xfff;
        match refused {
            None => refused = Some((addr, present, read, write)),
            Some((a, ..)) if a & !0xfff == page => {}
            Some(_) => return None,
        }
    }
    let (addr, present, read, write) = refused?;
    // The error code must say the same: P for a protection fault (a write's), W for an
    // operand that writes, no W for one that reads.
    let says_present = error & pf::PRESENT != 0;
    let says_write = error & pf::WRITE != 0;
    let kind_agrees = if says_write { write } else { read && !present };
    if says_present != present || !kind_agrees {
        return None;
    }
    Some(addr)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::context::Gpr;

    const PC: u64 = 0x40_1000;

    fn regs(set: &[(Gpr, u64)]) -> GuestRegs {
        let mut r = GuestRegs::default();
        for &(g, v) in set {
            r.set(g, v);
        }
        r
    }

    /// `page_fault_address` over tables where `mapped` pages are present (writable when
    /// the flag says so) and every other page is absent.
    fn derive(bytes: &[u8], r: &GuestRegs, error: u32, mapped: &[(u64, bool)]) -> Option<u64> {
        page_fault_address(
            64,
            bytes,
            PC,
            r,
            0x7000_0000,
            0x9000_0000,
            error,
            |va| match mapped.iter().find(|(p, _)| *p == va & !0xfff) {
                None => PageRights::Absent,
                Some((_, false)) => PageRights::ReadOnly,
                Some((_, true)) => PageRights::Writable,
            },
        )
    }

    #[test]
    fn a_load_from_an_absent_page_faulted_at_its_operand() {
        // mov rax, [rbx + 0x10]
        let r = regs(&[(Gpr::Rbx, 0x5000_0ff0)]);
        assert_eq!(
            derive(&[0x48, 0x8b, 0x43, 0x10], &r, pf::USER, &[]),
            Some(0x5000_1000)
        );
        // The page is mapped: nothing this instruction touches is refused.
        assert_eq!(
            derive(
                &[0x48, 0x8b, 0x43, 0x10],
                &r,
                pf::USER,
                &[(0x5000_1000, false)]
            ),
            None
        );
    }

    #[test]
    fn a_store_to_a_read_only_page_needs_an_error_code_that_says_so() {
        // mov [rdi], eax
        let r = regs(&[(Gpr::Rdi, 0x6000_0123)]);
        let ro = [(0x6000_0000, false)];
        let prot_write = pf::USER | pf::PRESENT | pf::WRITE;
        assert_eq!(
            derive(&[0x89, 0x07], &r, prot_write, &ro),
            Some(0x6000_0123)
        );
        // A not-present error code for a present page: not this instruction's answer.
        assert_eq!(derive(&[0x89, 0x07], &r, pf::USER | pf::WRITE, &ro), None);
        // A read-only page refuses no read: `mov eax, [rdi]` has nothing refused.
        assert_eq!(derive(&[0x8b, 0x07], &r, prot_write, &ro), None);
    }

    #[test]
    fn a_push_faults_below_the_stack_pointer() {
        // push rax, with RSP at a page's start: the slot is in the page below.
        let r = regs(&[(Gpr::Rsp, 0x7ffc_2000)]);
        let err = pf::USER | pf::WRITE;
        assert_eq!(
            derive(&[0x50], &r, err, &[(0x7ffc_2000, true)]),
            Some(0x7ffc_1ff8)
        );
    }

    #[test]
    fn compatibility_mode_is_left_to_cr2() {
        // push 0x80b5fa0 in a 32-bit process: its slot is ESP - 4 in 32 bits, and
        // segment bases other than FS/GS would count too.
        let r = regs(&[(Gpr::Rsp, 0xffeb_7360)]);
        let bytes = [0x68, 0xa0, 0x5f, 0x0b, 0x08];
        let got = page_fault_address(32, &bytes, PC, &r, 0, 0, pf::USER | pf::WRITE, |_| {
            PageRights::Absent
        });
        assert_eq!(got, None);
    }

    #[test]
    fn segment_bases_count() {
        // mov rax, fs:[0x28]
        let r = regs(&[]);
        let bytes = [0x64, 0x48, 0x8b, 0x04, 0x25, 0x28, 0, 0, 0];
        assert_eq!(derive(&bytes, &r, pf::USER, &[]), Some(0x7000_0028));
    }

    #[test]
    fn two_refused_pages_a_split_access_or_a_fetch_leave_it_to_cr2() {
        let err = pf::USER | pf::WRITE;
        // movsq: both the source and the destination page absent.
        let r = regs(&[(Gpr::Rsi, 0x1000), (Gpr::Rdi, 0x3000)]);
        assert_eq!(derive(&[0x48, 0xa5], &r, err, &[]), None);
        // One of them mapped: the other is the answer.
        assert_eq!(
            derive(&[0x48, 0xa5], &r, err, &[(0x1000, false)]),
            Some(0x3000)
        );
        assert_eq!(
            derive(&[0x48, 0xa5], &r, pf::USER, &[(0x3000, true)]),
            Some(0x1000)
        );
        // An 8-byte load across a page boundary.
        let r = regs(&[(Gpr::Rbx, 0x5000_0ffc)]);
        assert_eq!(derive(&[0x48, 0x8b, 0x03], &r, pf::USER, &[]), None);
        // A fetch fault, or one with the reserved bit.
        let r = regs(&[(Gpr::Rbx, 0x5000_0000)]);
        assert_eq!(
            derive(&[0x48, 0x8b, 0x03], &r, pf::USER | pf::FETCH, &[]),
            None
        );
        assert_eq!(
            derive(&[0x48, 0x8b, 0x03], &r, pf::USER | pf::RSVD, &[]),
            None
        );
        // No memory operand at all.
        assert_eq!(derive(&[0x48, 0x89, 0xd8], &r, pf::USER, &[]), None);
        // Tables that could not be read.
        let unknown = page_fault_address(64, &[0x48, 0x8b, 0x03], PC, &r, 0, 0, pf::USER, |_| {
            PageRights::Unknown
        });
        assert_eq!(unknown, None);
    }

    #[test]
    fn a_call_through_memory_reads_its_target_and_pushes() {
        // call [rbx]: the target's page mapped, the stack's absent.
        let r = regs(&[(Gpr::Rbx, 0x5000_0100), (Gpr::Rsp, 0x7ffc_1000)]);
        let err = pf::USER | pf::WRITE;
        assert_eq!(
            derive(&[0xff, 0x13], &r, err, &[(0x5000_0000, false)]),
            Some(0x7ffc_0ff8)
        );
    }
}
