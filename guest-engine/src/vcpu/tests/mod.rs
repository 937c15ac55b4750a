//! Host unit tests of the virtual CPU on a mock machine ([`MockHw`]) and a mock guest
//! memory with 4 KiB pages and their permissions ([`MockMmu`], which answers the #PF
//! error code a CPU would for a not-present, supervisor or read-only page). Every test
//! starts from [`block`]: a 64-bit kernel at CPL 0 with a guest GDT, IDT and TSS in
//! guest memory (see the constants), then emulates one instruction ([`run`]) and checks
//! the guest-visible result or the exception delivered through the IDT.
//!
//! Expected values come from the Intel SDM (vol. 2 instruction pages, vol. 3 §6.14 for
//! delivery), not from the code under test.

extern crate std;

mod compat;
mod cr;
mod debug;
mod events;
mod flags;
mod misc;
mod msr;
mod optional;
mod port_io;
mod segment_query;
mod segments;
mod syscall;
mod tables;

use std::boxed::Box;
use std::collections::BTreeMap;
use std::string::String;
use std::vec::Vec;

use iced_x86::{Decoder, DecoderOptions};
use kpin_abi::attach::{AttachBlock, CpuidEntry, Segment, CPUID_FLAG_SIGNIFICANT_INDEX};
use kpin_abi::x86::{cr0, cr4, efer, pf, rflags};

use super::hardware::{GuestFault, GuestMmu, Hardware};
use super::{Vcpu, VcpuStop};
use crate::arch::x86_64::decode::sensitive_kind;
use crate::shadow_mmu::{PagingControl, ShadowError, View};
use crate::{Emulation, Gpr, GuestRegs, GuestVirt, Platform, SensitiveInsn, SensitiveKind};

/// Where the emulated instruction is.
pub const PC: u64 = 0xffff_8000_0040_0000;
/// The guest GDT (linear address, kernel page).
pub const GDT: u64 = 0x1000;
/// The guest IDT (256 16-byte gates).
pub const IDT: u64 = 0x2000;
/// The guest TSS.
pub const TSS: u64 = 0x3000;
/// A kernel read-only data page.
pub const RO_PAGE: u64 = 0x4000;
/// A kernel read-write data page.
pub const KDATA_PAGE: u64 = 0x5000;
/// A user read-write page (also the user stack).
pub const USER_PAGE: u64 = 0x6000;
/// An address no page backs.
pub const UNMAPPED: u64 = 0x10_0000;
/// The kernel stack's top (RSP at CPL 0 in most tests); pages 0x8000..0xa000.
pub const KSTACK: u64 = 0xa000;
/// TSS.RSP0: the stack a delivery from CPL 3 switches to; pages 0xb000..0xc000.
pub const RSP0: u64 = 0xc000;
/// TSS.IST1; pages 0xc000..0xd000.
pub const IST1: u64 = 0xd000;

/// Kernel 64-bit code, DPL 0.
pub const KCODE: u16 = 0x08;
/// Kernel data, DPL 0.
pub const KDATA: u16 = 0x10;
/// User data, DPL 3 (RPL 3).
pub const UDATA: u16 = 0x1b;
/// User 64-bit code, DPL 3 (RPL 3).
pub const UCODE: u16 = 0x23;
/// The 64-bit TSS (16 bytes).
pub const TSS_SEL: u16 = 0x28;
/// An LDT (16 bytes).
pub const LDT_SEL: u16 = 0x38;
/// A not-present data segment, DPL 0.
pub const NP_DATA: u16 = 0x48;
/// 32-bit code, DPL 0.
pub const CODE32: u16 = 0x50;
/// Data with base 0x1234_5000, DPL 3.
pub const BASED_DATA: u16 = 0x58;
/// Execute-only code, DPL 0 (not readable: not loadable into a data register).
pub const XO_CODE: u16 = 0x60;
/// Read-only data, DPL 0 (not loadable into SS).
pub const RO_DATA: u16 = 0x68;
/// The GDT limit (entries up to 0x68).
pub const GDT_LIMIT: u16 = 0x6f;

/// The handler address of vector `v` in the test IDT.
pub fn handler(v: u8) -> u64 {
    0xffff_8000_0010_0000 + u64::from(v) * 0x10
}

/// An 8-byte code/data descriptor.
pub fn seg_desc(base: u32, ty: u8, dpl: u8, present: bool, l: bool, db: bool) -> u64 {
    let base = u64::from(base);
    let limit = 0xfffffu64;
    (limit & 0xffff)
        | ((base & 0xff_ffff) << 16)
        | (u64::from(ty) << 40)
        | (1 << 44)
        | (u64::from(dpl) << 45)
        | (u64::from(present) << 47)
        | (((limit >> 16) & 0xf) << 48)
        | (u64::from(l) << 53)
        | (u64::from(db) << 54)
        | (1 << 55)
        | (((base >> 24) & 0xff) << 56)
}

/// A 16-byte system descriptor (TSS type 9 or LDT type 2).
pub fn sys_desc(base: u64, limit: u32, ty: u8) -> [u64; 2] {
    let lo = u64::from(limit & 0xffff)
        | ((base & 0xff_ffff) << 16)
        | (u64::from(ty) << 40)
        | (1 << 47)
        | (((base >> 24) & 0xff) << 56);
    [lo, base >> 32]
}

/// A 16-byte IDT gate.
pub fn gate(target: u64, sel: u16, ist: u8, ty: u8, dpl: u8, present: bool) -> [u64; 2] {
    let lo = (target & 0xffff)
        | (u64::from(sel) << 16)
        | (u64::from(ist) << 32)
        | (u64::from(ty) << 40)
        | (u64::from(dpl) << 45)
        | (u64::from(present) << 47)
        | (((target >> 16) & 0xffff) << 48);
    [lo, target >> 32]
}

/// A segment cache as KVM reports it.
pub fn cache(selector: u16, ty: u8, dpl: u8, l: bool) -> Segment {
    Segment {
        base: 0,
        limit: 0xffff_ffff,
        selector,
        type_: ty,
        present: 1,
        dpl,
        db: u8::from(!l),
        s: 1,
        l: u8::from(l),
        g: 1,
        avl: 0,
        unusable: 0,
        pad: 0,
    }
}

fn cpuid_entry(function: u32, regs: [u32; 4], indexed: bool) -> CpuidEntry {
    CpuidEntry {
        function,
        index: 0,
        flags: if indexed {
            CPUID_FLAG_SIGNIFICANT_INDEX
        } else {
            0
        },
        eax: regs[0],
        ebx: regs[1],
        ecx: regs[2],
        edx: regs[3],
        pad: 0,
    }
}

/// The attach block of a 64-bit kernel at CPL 0 with IF = 1: CR0 PE|MP|ET|NE|WP|PG,
/// CR4 PAE|PGE|OSFXSR|OSXMMEXCPT, EFER SCE|LME|LMA|NXE, STAR/LSTAR/SFMASK as Linux sets
/// them, and a CPUID table offering DE, PSE, PGE, FXSR, SSE, FSGSBASE, SMEP, UMIP,
/// RDPID, RDTSCP, MAXPHYADDR 39.
pub fn block() -> Box<AttachBlock> {
    let mut b = Box::new(AttachBlock::new());
    b.regs.rflags = rflags::FIXED | rflags::IF;
    let s = &mut b.sregs;
    s.cs = cache(KCODE, 0xb, 0, true);
    s.ss = cache(KDATA, 0x3, 0, false);
    s.ds = cache(KDATA, 0x3, 0, false);
    s.es = cache(KDATA, 0x3, 0, false);
    s.fs = cache(0, 0, 0, false);
    s.fs.unusable = 1;
    s.fs.base = 0x7000_0000;
    s.gs = cache(0, 0, 0, false);
    s.gs.unusable = 1;
    s.gs.base = 0xffff_8880_0000_0000;
    s.tr = Segment {
        base: TSS,
        limit: 0x67,
        selector: TSS_SEL,
        type_: 0xb,
        present: 1,
        s: 0,
        ..Segment::default()
    };
    s.ldt = Segment {
        unusable: 1,
        ..Segment::default()
    };
    s.gdt.base = GDT;
    s.gdt.limit = GDT_LIMIT;
    s.idt.base = IDT;
    s.idt.limit = 0xfff;
    s.cr0 = cr0::PE | cr0::MP | cr0::ET | cr0::NE | cr0::WP | cr0::PG;
    s.cr3 = 0x10_0000;
    s.cr4 = cr4::PAE | cr4::PGE | cr4::OSFXSR | cr4::OSXMMEXCPT;
    s.efer = efer::SCE | efer::LME | efer::LMA | efer::NXE;
    let msrs = [
        (kpin_abi::x86::msr::STAR, 0x0023_0010_0000_0000u64),
        (kpin_abi::x86::msr::LSTAR, 0xffff_ffff_8100_0000),
        (kpin_abi::x86::msr::SFMASK, 0x4_7700),
        (kpin_abi::x86::msr::KERNEL_GS_BASE, 0x1111_0000),
        (kpin_abi::x86::msr::TSC_AUX, 5),
    ];
    for (k, (index, value)) in msrs.into_iter().enumerate() {
        b.msrs[k].index = index;
        b.msrs[k].value = value;
    }
    b.msr_count = msrs.len() as u32;
    let leaves = [
        cpuid_entry(0, [0xd, 0x6874_7541, 0x444d_4163, 0x6974_6e65], false),
        cpuid_entry(
            1,
            [
                0x00a2_0f10,
                0,
                0,
                (1 << 2) | (1 << 3) | (1 << 13) | (1 << 24) | (1 << 25),
            ],
            false,
        ),
        cpuid_entry(7, [0, 1 | (1 << 7), (1 << 2) | (1 << 22), 0], true),
        cpuid_entry(0x8000_0001, [0, 0, 0, 1 << 27], false),
        cpuid_entry(0x8000_0008, [39, 0, 0, 0], false),
    ];
    for (k, e) in leaves.into_iter().enumerate() {
        b.cpuid[k] = e;
    }
    b.cpuid_count = leaves.len() as u32;
    b
}

/// One 4 KiB page of mock guest memory.
pub struct Page {
    data: Box<[u8; 4096]>,
    writable: bool,
    user: bool,
}

/// Mock guest memory: pages with a writable and a user bit; faults as a CPU with
/// CR0.WP = 1 reports them. Records the shadow-MMU calls.
#[derive(Default)]
pub struct MockMmu {
    pages: BTreeMap<u64, Page>,
    /// The virtual CR3.
    pub cr3: u64,
    /// CR3 writes.
    pub cr3_writes: Vec<u64>,
    /// `invlpg` addresses.
    pub invlpgs: Vec<u64>,
    /// The last paging control set.
    pub control: Option<PagingControl>,
    /// Views entered.
    pub views: Vec<View>,
    /// A recorded failure.
    pub failure: Option<ShadowError>,
    /// Work for the translator (set by a CR3 write, as the shadow MMU does).
    pub work: bool,
    /// Makes the next shadow-MMU operation fail (an engine failure, not a guest fault).
    pub fail_next: bool,
}

impl MockMmu {
    /// Maps the page at `va` (zeroed).
    pub fn map(&mut self, va: u64, writable: bool, user: bool) {
        self.pages.insert(
            va >> 12,
            Page {
                data: Box::new([0; 4096]),
                writable,
                user,
            },
        );
    }

    /// The fault a `user`/`write` access at `va` takes, if any.
    fn check(&self, va: u64, user: bool, write: bool) -> Result<(), GuestFault> {
        let mut error = 0;
        if write {
            error |= pf::WRITE;
        }
        if user {
            error |= pf::USER;
        }
        match self.pages.get(&(va >> 12)) {
            None => Err(GuestFault::page_fault(GuestVirt(va), error)),
            Some(p) if (user && !p.user) || (write && !p.writable) => {
                Err(GuestFault::page_fault(GuestVirt(va), error | pf::PRESENT))
            }
            Some(_) => Ok(()),
        }
    }

    /// Bytes at `va` (test setup and checks: no permission check; panics if unmapped).
    pub fn peek(&self, va: u64, out: &mut [u8]) {
        for (k, b) in out.iter_mut().enumerate() {
            let a = va + k as u64;
            *b = self.pages[&(a >> 12)].data[(a & 0xfff) as usize];
        }
    }

    /// Writes bytes at `va` for setup (no permission check).
    pub fn poke(&mut self, va: u64, data: &[u8]) {
        for (k, b) in data.iter().enumerate() {
            let a = va + k as u64;
            self.pages.get_mut(&(a >> 12)).expect("mapped").data[(a & 0xfff) as usize] = *b;
        }
    }

    /// The u64 at `va`.
    pub fn peek_u64(&self, va: u64) -> u64 {
        let mut b = [0; 8];
        self.peek(va, &mut b);
        u64::from_le_bytes(b)
    }

    /// Writes a u64 at `va`.
    pub fn poke_u64(&mut self, va: u64, v: u64) {
        self.poke(va, &v.to_le_bytes());
    }
}

impl GuestMmu for MockMmu {
    fn read(&mut self, va: u64, user: bool, out: &mut [u8]) -> Result<(), GuestFault> {
        for k in 0..out.len() as u64 {
            self.check(va.wrapping_add(k), user, false)?;
        }
        self.peek(va, out);
        Ok(())
    }

    fn write(&mut self, va: u64, user: bool, data: &[u8]) -> Result<(), GuestFault> {
        for k in 0..data.len() as u64 {
            self.check(va.wrapping_add(k), user, true)?;
        }
        self.poke(va, data);
        Ok(())
    }

    fn cr3(&self) -> u64 {
        self.cr3
    }

    fn write_cr3(&mut self, cr3: u64) -> Result<(), ShadowError> {
        if core::mem::take(&mut self.fail_next) {
            return Err(ShadowError::OutOfTables);
        }
        self.cr3 = cr3;
        self.cr3_writes.push(cr3);
        self.work = true;
        Ok(())
    }

    fn invlpg(&mut self, va: u64) -> Result<(), ShadowError> {
        self.invlpgs.push(va);
        Ok(())
    }

    fn set_paging_control(&mut self, control: PagingControl) -> Result<(), ShadowError> {
        if core::mem::take(&mut self.fail_next) {
            return Err(ShadowError::OutOfTables);
        }
        self.control = Some(control);
        Ok(())
    }

    fn enter_view(&mut self, view: View) -> Result<(), ShadowError> {
        self.views.push(view);
        Ok(())
    }

    fn record_failure(&mut self, e: ShadowError) {
        self.failure = Some(e);
    }

    fn failed(&self) -> bool {
        self.failure.is_some()
    }

    fn has_work(&self) -> bool {
        self.work
    }
}

/// The mock machine behind the gate: records what the virtual CPU asks of it.
#[derive(Default)]
pub struct MockHw {
    /// What the embedder measured of null-selector loads (`None`: not measured).
    pub null_clears: Option<bool>,
    /// `out`s: (port, size, value).
    pub outs: Vec<(u16, u8, u32)>,
    /// What `in` answers (any port).
    pub in_value: u32,
    /// `in`s: (port, size).
    pub ins: Vec<(u16, u8)>,
    /// MSRs KVM has (pass-through and `rdmsr_safe`).
    pub host_msrs: BTreeMap<u32, u64>,
    /// Pass-through `wrmsr`s.
    pub wrmsrs: Vec<(u32, u64)>,
    /// CR4 values given to `set_cr4_sse`.
    pub cr4_sse: Vec<u64>,
    /// The hardware FS base.
    pub fs_base: u64,
    /// The hardware GS base.
    pub gs_base: u64,
    /// `hlt`s.
    pub halts: u32,
    /// A vector that becomes pending when the CPU halts.
    pub wake_with: Option<u8>,
    /// Pending vectors.
    pub pending: Vec<u8>,
    /// Attention re-arms.
    pub rearms: u32,
    /// The TSC.
    pub tsc: u64,
    /// Log lines.
    pub log: Vec<String>,
    /// What `control_requested` answers once the CPU has halted (a detach posted while
    /// the guest waits in `hlt`).
    pub control_after_halt: bool,
}

impl Hardware for MockHw {
    fn port_out(&mut self, port: u16, size: u8, value: u32) {
        self.outs.push((port, size, value));
    }
    fn port_in(&mut self, port: u16, size: u8) -> u32 {
        self.ins.push((port, size));
        let mask = if size == 4 {
            u32::MAX
        } else {
            (1u32 << (8 * u32::from(size))) - 1
        };
        self.in_value & mask
    }
    fn rdmsr_passthrough(&mut self, index: u32) -> u64 {
        self.host_msrs[&index]
    }
    fn rdmsr_safe(&mut self, index: u32) -> Option<u64> {
        self.host_msrs.get(&index).copied()
    }
    fn wrmsr_passthrough(&mut self, index: u32, value: u64) {
        self.wrmsrs.push((index, value));
    }
    fn set_cr4_sse(&mut self, cr4: u64) {
        self.cr4_sse.push(cr4);
    }
    fn set_hw_base(&mut self, fs: bool, base: u64) {
        if fs {
            self.fs_base = base;
        } else {
            self.gs_base = base;
        }
    }
    fn halt(&mut self) {
        self.halts += 1;
        assert!(self.halts < 100, "halted forever");
        if let Some(v) = self.wake_with.take() {
            self.pending.push(v);
        }
    }
    fn pending_highest(&self) -> Option<u8> {
        self.pending.iter().copied().max()
    }
    fn take_pending(&mut self, vector: u8) {
        self.pending.retain(|&v| v != vector);
    }
    fn rearm_attention(&mut self) {
        if !self.pending.is_empty() {
            self.rearms += 1;
        }
    }
    fn tsc(&mut self) -> u64 {
        self.tsc
    }
    fn log(&mut self, line: core::fmt::Arguments<'_>) {
        self.log.push(std::format!("{line}"));
    }
    fn null_selector_clears_base(&self) -> Option<bool> {
        self.null_clears
    }

    fn control_requested(&self) -> bool {
        self.control_after_halt && self.halts > 0
    }
}

/// The virtual CPU under test.
pub type V<'a> = Vcpu<'a, MockHw, MockMmu>;

/// Guest memory for `b`: the GDT, IDT (every vector an interrupt gate to [`handler`] in
/// KCODE, DPL 0, except 0x80 and 3, DPL 3), the TSS, the data pages and the stacks.
pub fn memory() -> MockMmu {
    let mut m = MockMmu {
        cr3: 0x10_0000,
        ..MockMmu::default()
    };
    for page in [GDT, IDT, TSS, RO_PAGE] {
        m.map(page, page != RO_PAGE, false);
    }
    for page in [KDATA_PAGE, 0x8000, 0x9000, 0xb000, 0xc000] {
        m.map(page, true, false);
    }
    m.map(USER_PAGE, true, true);
    let gdt: [(u16, u64); 9] = [
        (KCODE, seg_desc(0, 0xb, 0, true, true, false)),
        (KDATA, seg_desc(0, 0x3, 0, true, false, true)),
        (UDATA & !3, seg_desc(0, 0x3, 3, true, false, true)),
        (UCODE & !3, seg_desc(0, 0xb, 3, true, true, false)),
        (NP_DATA, seg_desc(0, 0x3, 0, false, false, true)),
        (CODE32, seg_desc(0, 0xb, 0, true, false, true)),
        (BASED_DATA, seg_desc(0x1234_5000, 0x3, 3, true, false, true)),
        (XO_CODE, seg_desc(0, 0x8, 0, true, true, false)),
        (RO_DATA, seg_desc(0, 0x0, 0, true, false, true)),
    ];
    for (sel, d) in gdt {
        m.poke_u64(GDT + u64::from(sel), d);
    }
    let [lo, hi] = sys_desc(TSS, 0x67, 9);
    m.poke_u64(GDT + u64::from(TSS_SEL), lo);
    m.poke_u64(GDT + u64::from(TSS_SEL) + 8, hi);
    let [lo, hi] = sys_desc(0xffff_8000_0000_7000, 0xfff, 2);
    m.poke_u64(GDT + u64::from(LDT_SEL), lo);
    m.poke_u64(GDT + u64::from(LDT_SEL) + 8, hi);
    for v in 0..=255u8 {
        let dpl = if v == 0x80 || v == 3 { 3 } else { 0 };
        let [lo, hi] = gate(handler(v), KCODE, 0, 0xe, dpl, true);
        m.poke_u64(IDT + 16 * u64::from(v), lo);
        m.poke_u64(IDT + 16 * u64::from(v) + 8, hi);
    }
    m.poke_u64(TSS + 4, RSP0);
    m.poke_u64(TSS + 0x24, IST1);
    m
}

/// A virtual CPU for `b` on [`memory`] and a fresh [`MockHw`].
pub fn vcpu(b: &AttachBlock) -> V<'_> {
    Vcpu::new(b, MockHw::default(), memory())
}

/// Kernel registers: RSP = [`KSTACK`], RFLAGS = 0x202.
pub fn kregs() -> GuestRegs {
    let mut r = GuestRegs {
        rflags: rflags::FIXED | rflags::IF,
        ..GuestRegs::default()
    };
    r.set(Gpr::Rsp, KSTACK);
    r
}

/// Puts the virtual CPU at CPL 3 (CS = UCODE, SS = UDATA); RSP in the user page.
pub fn to_user(v: &mut V<'_>, r: &mut GuestRegs) {
    v.segs.sregs[super::Sreg::Cs as usize] = cache(UCODE, 0xb, 3, true);
    v.segs.sregs[super::Sreg::Ss as usize] = cache(UDATA, 0x3, 3, false);
    r.set(Gpr::Rsp, USER_PAGE + 0x800);
}

/// Emulates the instruction `bytes` at [`PC`].
pub fn run(v: &mut V<'_>, bytes: &[u8], r: &mut GuestRegs) -> Emulation {
    let mut d = Decoder::with_ip(64, bytes, PC, DecoderOptions::NONE);
    let i = d.decode();
    let mut insn = SensitiveInsn {
        pc: GuestVirt(PC),
        len: if i.is_invalid() { 0 } else { i.len() as u8 },
        bytes: [0; crate::layout::MAX_INSN_BYTES],
        kind: sensitive_kind(&i).unwrap_or(SensitiveKind::Other),
    };
    insn.bytes[..bytes.len()].copy_from_slice(bytes);
    v.emulate(&insn, r)
}

/// The address after the instruction `bytes` at [`PC`].
pub fn after(bytes: &[u8]) -> Emulation {
    Emulation::Continue(GuestVirt(PC + bytes.len() as u64))
}

/// What an exception frame on the handler's stack holds.
#[derive(Debug, PartialEq, Eq)]
pub struct Frame {
    /// Error code, if pushed.
    pub error: Option<u64>,
    /// Saved RIP.
    pub rip: u64,
    /// Saved CS.
    pub cs: u64,
    /// Saved RFLAGS.
    pub rflags: u64,
    /// Saved RSP.
    pub rsp: u64,
    /// Saved SS.
    pub ss: u64,
}

/// Reads the frame at the handler's RSP (`with_error`: an error code on top).
pub fn frame(v: &V<'_>, r: &GuestRegs, with_error: bool) -> Frame {
    let mut at = r.get(Gpr::Rsp);
    let error = with_error.then(|| {
        let e = v.mem.peek_u64(at);
        at += 8;
        e
    });
    let w = |k: u64| v.mem.peek_u64(at + 8 * k);
    Frame {
        error,
        rip: w(0),
        cs: w(1),
        rflags: w(2),
        rsp: w(3),
        ss: w(4),
    }
}

/// Asserts that the emulation delivered exception `vector` with `error` (None: none
/// pushed) to its handler at CPL 0, with the faulting instruction as the return address.
pub fn assert_fault(v: &V<'_>, e: Emulation, r: &GuestRegs, vector: u8, error: Option<u64>) {
    assert_eq!(
        e,
        Emulation::Continue(GuestVirt(handler(vector))),
        "vector {vector}"
    );
    let f = frame(v, r, error.is_some());
    assert_eq!(f.error, error, "error code of vector {vector}");
    assert_eq!(f.rip, PC, "a fault returns to the faulting instruction");
    assert_eq!(v.stats.exceptions[usize::from(vector)], 1);
}

/// Asserts #GP(0) at the instruction.
pub fn assert_gp0(v: &V<'_>, e: Emulation, r: &GuestRegs) {
    assert_fault(v, e, r, 13, Some(0));
}

/// Asserts #UD at the instruction.
pub fn assert_ud(v: &V<'_>, e: Emulation, r: &GuestRegs) {
    assert_fault(v, e, r, 6, None);
}

/// The stop the last emulation returned.
pub fn stop(v: &mut V<'_>) -> VcpuStop {
    v.take_stop().expect("the emulation stopped")
}

/// Replaces IDT gate `vector`.
pub fn set_gate(v: &mut V<'_>, vector: u8, g: [u64; 2]) {
    v.mem.poke_u64(IDT + 16 * u64::from(vector), g[0]);
    v.mem.poke_u64(IDT + 16 * u64::from(vector) + 8, g[1]);
}

/// Makes vector `vector` deliver on IST1.
pub fn use_ist1(v: &mut V<'_>, vector: u8) {
    set_gate(v, vector, gate(handler(vector), KCODE, 1, 0xe, 0, true));
}

/// Asserts that an instruction at CPL 3 raised exception `vector` (error code `error`):
/// delivered at CPL 0 on TSS.RSP0 with the user's SS:RSP and CS in the frame.
pub fn assert_user_fault(v: &V<'_>, e: Emulation, r: &GuestRegs, vector: u8, error: Option<u64>) {
    assert_eq!(
        e,
        Emulation::Switch {
            next: GuestVirt(handler(vector)),
            mode: super::MODE_KERNEL,
            invalidate_mappings: false
        },
        "vector {vector}"
    );
    assert_eq!(v.cpl(), 0);
    let f = frame(v, r, error.is_some());
    assert_eq!(f.error, error, "error code of vector {vector}");
    assert_eq!(f.rip, PC);
    assert_eq!(f.cs, u64::from(UCODE));
    assert_eq!(f.ss, u64::from(UDATA));
    let frame_words = 5 + u64::from(error.is_some());
    assert_eq!(
        r.get(Gpr::Rsp),
        RSP0 - 8 * frame_words,
        "stack switched to TSS.RSP0"
    );
}
