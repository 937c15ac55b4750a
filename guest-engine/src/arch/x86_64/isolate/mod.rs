//! Software fault isolation of translated memory operands: no guest access reaches the
//! engine's reserved zone unchecked.
//!
//! The engine shares the address space with the guest code it translates (both run at
//! hardware CPL 3), so the engine window (PML4 slot 257) and the physmap (258) are
//! reachable by any guest access. The **reserved zone** Z is PML4 slots 256–259,
//! `[ISOLATION_ZONE_START, ISOLATION_ZONE_END)`: 2 TiB aligned to 2^41, so an address is
//! in Z iff its bits 63:41 are `0x7f_ffc0`. Slots 256 and 259 hold nothing of the
//! engine and are never present in any shadow root: a hardware access there always
//! faults into the engine, which resolves it against the guest's own tables. They are
//! the guards that make the elisions below sound.
//!
//! Before every translated instruction, each memory operand whose linear address may lie
//! in Z gets a flag-free check on its *first* byte:
//!
//! ```text
//! mov [spill.rcx], rcx
//! lea rcx, [ea]              ; + rdfsbase/rdgsbase for fs:/gs: operands
//! rorx rcx, rcx, 41          ; bits 63:41 to 22:0 (BMI2, no flags)
//! movzx ecx, cx              ; bits 56:41: 0xffc0 for Z (also for some non-canonical)
//! lea ecx, [rcx - 0xffc0]    ; zero iff a hit
//! jrcxz hit
//! jmp short ok
//! hit: ud2                   ; #UD in the cache: `Stop::Fault`, RCX restored by the PC map
//! ok: mov rcx, [spill.rcx]
//! ```
//!
//! A hit costs no exit record (the engine's tables grow with exits, and a Linux boot
//! translates ~10^5 traces): the embedder that sees #UD at a translated instruction asks
//! [`classify_fault`] whether an operand lies in Z (then it resolves the access against
//! the guest's own tables, as for a hardware #PF there), or is non-canonical (a false
//! positive of the check: #GP(0)), or else the #UD is the guest's own.
//!
//! Invariants that make checking only the first byte enough: below Z lies the
//! non-canonical hole, so an access (or an upward `rep` string) that starts below Z
//! faults before reaching it; an access starting above Z never reaches it upward, and a
//! downward `rep` string from above Z meets slot 259 first, which always faults into the
//! engine. Elisions: absolute (and RIP-relative, already absolute here) operands are
//! decided at translation time; 32-bit-addressed flat operands are below 4 GiB;
//! `[reg+disp]` with |disp| < 2 GiB − 128 KiB (push, pop, call, ret included, as
//! `[rsp-8]`…) is checked through the base register once per trace — `reg +
//! BASE_CHECK_BIAS` against Z, before its first such use — and again only after an
//! instruction writes `reg` (RSP's implicit push/pop adjustments excepted: at most
//! `MAX_TRACE_INSNS` × 8 bytes per trace). A base outside `[Z_START − BIAS, Z_END −
//! BIAS)` puts every such access either below Z in the non-canonical hole (it faults
//! there) or above `Z_END − 4 GiB`, i.e. at worst in the slot-259 guard.
//! Gathers/scatters have each lane's address checked (`emit_vsib_check`: the index
//! register is stored to the context and every lane computed), with 32-bit or 64-bit
//! indices alike; 32-bit indices without a base or segment stay near 0 (no check).
//! A hit leaves the guest state exactly that before the instruction (the check comes
//! before the instruction's instrumentation and translation).
//!
//! Cheaper forms where the status flags are dead: a base register is compared with
//! constant bounds (`CacheContext::zone_bounds`, no scratch register), the common case
//! falling through after one compare, the other out of line; `[base + index*scale +
//! disp]` checks the base *wide* ([`WIDE_BASE_CHECK_BIAS`]) once and then the index alone
//! (`cmp index, SMALL_INDEX_MAX; ja slow`, the full check out of line: [`ColdCheck`]).
//!
//! **User mode** (virtual CPL 3) has a larger fence, [`Fence::UpperHalf`]: everything at
//! or above `USER_LIMIT` = 2^47 (the upper half, and the non-canonical hole). The shadow
//! MMU may then serve the user view with the kernel root (`shadow_mmu`, "unified"), which
//! maps the guest kernel's upper half, so a user operand there must not run natively
//! either. The same forms apply with other constants: the check tests bits 62:47 (`rorx
//! rcx, rcx, 47; movzx ecx, cx; jrcxz ok`, or `shr rcx, 47; jz ok`); a base register is
//! checked with no bias (`cmp b, [2^47]; jae cold`), covering displacements in
//! `[−USER_ELIDED_NEG, ELIDED_DISP_MAX)`: upward from a base below 2^47 an access at worst
//! enters the hole (#GP), downward from a base near 0 at worst the shadow's `TOP_GUARD`,
//! the top 2 MiB that a unified root never maps. 32-bit lanes of a gather are not
//! exempt there (sign-extended, they reach below 0).
//!
//! Submodules: `gather` (VSIB lanes, masked-off ones skipped), `hoist` (checks of the
//! bases a self-looping trace never writes, moved to its top), `classify` (what a #UD
//! at a translated instruction means).

use iced_x86::{Mnemonic, OpKind, Register};

use super::decode::DecodedInsn;
use super::emit::{reg, Label};
use super::mangle::{hw, Tx};
use crate::context::Gpr;
use crate::error::EngineError;
use crate::instrument::{MemOperand, SegBase};

mod classify;
mod fault_address;
mod gather;
mod hoist;

pub use classify::{classify_fault, IsolationFault};
pub use fault_address::{page_fault_address, PageRights};
pub(super) use hoist::{hoistable, Hoisted};

/// What a translated memory operand may not reach natively: chosen by the trace's
/// virtual CPL (module header).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fence {
    /// Kernel mode: the reserved zone (PML4 slots 256–259).
    Zone,
    /// User mode: every address at or above 2^47 (`shadow_mmu::USER_LIMIT`).
    UpperHalf,
}

/// Most negative displacement (magnitude) of a user-mode operand whose check is elided
/// through its base register: the shadow's 2 MiB `TOP_GUARD` less the room RSP's implicit
/// drift in one trace takes (`MAX_TRACE_INSNS` pushes).
const USER_ELIDED_NEG: i64 = 0x1e_0000;

impl Fence {
    /// The fence of code translated for virtual CPL `cpl`.
    pub const fn for_cpl(cpl: u8) -> Fence {
        if cpl == 3 {
            Fence::UpperHalf
        } else {
            Fence::Zone
        }
    }

    /// Whether an access starting at `addr` hits the fence.
    pub const fn contains(self, addr: u64) -> bool {
        match self {
            Fence::Zone => in_isolation_zone(addr),
            Fence::UpperHalf => addr >= crate::shadow_mmu::USER_LIMIT,
        }
    }

    /// Added to a base register before its plain check.
    const fn bias(self) -> u64 {
        match self {
            Fence::Zone => BASE_CHECK_BIAS,
            Fence::UpperHalf => 0,
        }
    }

    /// Added to a base register before its wide check.
    const fn wide_bias(self) -> u64 {
        match self {
            Fence::Zone => WIDE_BASE_CHECK_BIAS,
            Fence::UpperHalf => 0,
        }
    }

    /// Whether a check through the base register covers displacement `disp`.
    pub(super) fn elides(self, disp: i64) -> bool {
        match self {
            Fence::Zone => (-ELIDED_DISP_MAX..ELIDED_DISP_MAX).contains(&disp),
            Fence::UpperHalf => (-USER_ELIDED_NEG..ELIDED_DISP_MAX).contains(&disp),
        }
    }

    /// Whether a base register's plain check (`wide`: its wide check) hits for `base`.
    pub(super) fn base_hits(self, base: u64, wide: bool) -> bool {
        let bias = if wide { self.wide_bias() } else { self.bias() };
        match self {
            Fence::Zone => in_isolation_zone(base.wrapping_add(bias)),
            // `ctx.zone_bounds`' user half: [2^47, u64::MAX).
            Fence::UpperHalf => self.contains(base) && base != u64::MAX,
        }
    }

    /// Index of the fence's first bound in `ctx.zone_bounds`.
    const fn bounds_index(self) -> u64 {
        match self {
            Fence::Zone => 0,
            Fence::UpperHalf => 4,
        }
    }
}

/// First address of the reserved zone (PML4 slot 256: `kpin_abi::stolen::RESERVED_SLOTS`).
pub const ISOLATION_ZONE_START: u64 =
    kpin_abi::stolen::slot_va(*kpin_abi::stolen::RESERVED_SLOTS.start());
/// End (exclusive) of the reserved zone (PML4 slot 260).
pub const ISOLATION_ZONE_END: u64 =
    kpin_abi::stolen::slot_va(*kpin_abi::stolen::RESERVED_SLOTS.end() + 1);
const _: () = assert!(
    ISOLATION_ZONE_START == 0xffff_8000_0000_0000 && ISOLATION_ZONE_END == 0xffff_8200_0000_0000
);

/// Whether `va` lies in the reserved zone.
pub const fn in_isolation_zone(va: u64) -> bool {
    va >= ISOLATION_ZONE_START && va < ISOLATION_ZONE_END
}

/// Offset added to a base register before its check ([`BASE_CHECK_BIAS`] below Z and
/// above it are then both caught or both safe for every elided displacement).
pub const BASE_CHECK_BIAS: u64 = 0x7fff_0000;
/// Offset added to a base register before its *wide* check (64 GiB): a base outside
/// `[Z_START − WIDE, Z_END − WIDE)` keeps `base + off` out of slots 256–258 for every
/// `off` in `[−448 GiB, 64 GiB)` (above, it lands at worst in the 512 GiB slot-259 guard).
/// Used with an index register known to be small (below).
pub const WIDE_BASE_CHECK_BIAS: u64 = 1 << 36;
/// Largest index value (unsigned) of the index fast path: `index · scale ≤ 16 GiB`, so
/// with `|disp| < 2 GiB` the operand lies within `[−2 GiB, 18 GiB)` of a wide-checked base.
const SMALL_INDEX_MAX: i32 = 0x7fff_ffff;
/// `CacheContext::zone_bounds`: the bases whose plain check hits, `[Z_START − BIAS, Z_END −
/// BIAS)`, then those whose wide check hits; then the same for [`Fence::UpperHalf`]: both
/// `[2^47, u64::MAX)` (a base of −1 reaches at worst 2 MiB below 0: the shadow's top
/// guard).
pub(crate) const fn zone_bounds() -> [u64; 8] {
    let user = crate::shadow_mmu::USER_LIMIT;
    [
        ISOLATION_ZONE_START - BASE_CHECK_BIAS,
        ISOLATION_ZONE_END - BASE_CHECK_BIAS,
        ISOLATION_ZONE_START - WIDE_BASE_CHECK_BIAS,
        ISOLATION_ZONE_END - WIDE_BASE_CHECK_BIAS,
        user,
        u64::MAX,
        user,
        u64::MAX,
    ]
}

/// Largest displacement magnitude of an operand whose check is elided through its base
/// register; the rest of the 2 GiB below `BASE_CHECK_BIAS` covers RSP's implicit drift
/// in one trace (`MAX_TRACE_INSNS` pushes or pops).
const ELIDED_DISP_MAX: i64 = 0x7ffe_0000;

/// Per-trace state of the base-register elision: the GPRs whose value (plus
/// [`BASE_CHECK_BIAS`]) was checked in this trace and not written since (RSP's implicit
/// push/pop/call/ret adjustments do not count as writes).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct BaseState {
    checked: u16,
    /// GPRs whose value plus [`WIDE_BASE_CHECK_BIAS`] was checked (implies `checked`).
    checked_wide: u16,
    /// Checked `base + index*scale` expressions (base, index, scale), same rules.
    exprs: [Option<(Option<Gpr>, Gpr, u8)>; 4],
    next: usize,
}

impl BaseState {
    fn has(&self, base: Option<Gpr>, index: Option<Gpr>, scale: u8) -> bool {
        match (base, index) {
            (Some(b), None) => self.checked & (1 << (b as u8)) != 0,
            (b, Some(i)) => self.exprs.contains(&Some((b, i, scale))),
            (None, None) => false,
        }
    }

    fn add(&mut self, base: Option<Gpr>, index: Option<Gpr>, scale: u8) {
        match (base, index) {
            (Some(b), None) => self.checked |= 1 << (b as u8),
            (b, Some(i)) => {
                self.exprs[self.next] = Some((b, i, scale));
                self.next = (self.next + 1) % self.exprs.len();
            }
            (None, None) => {}
        }
    }

    fn has_wide(&self, base: Gpr) -> bool {
        self.checked_wide & (1 << (base as u8)) != 0
    }

    fn add_wide(&mut self, base: Gpr) {
        self.checked_wide |= 1 << (base as u8);
        self.checked |= 1 << (base as u8);
    }

    fn written(&mut self, mask: u16) {
        self.checked &= !mask;
        self.checked_wide &= !mask;
        let hit = |r: Option<Gpr>| r.is_some_and(|r| mask & (1 << (r as u8)) != 0);
        for e in self.exprs.iter_mut() {
            if e.is_some_and(|(b, i, _)| hit(b) || hit(Some(i))) {
                *e = None;
            }
        }
    }
}

/// The GPRs (bit = hardware number) `d` writes, RSP only when it is written other than
/// by the implicit adjustment of a push/pop/call/ret.
fn written_gprs(d: &DecodedInsn) -> u16 {
    let i = &d.instr;
    let mut mask = d.gprs_written;
    let rsp = 1u16 << reg::RSP;
    if mask & rsp != 0
        && i.stack_pointer_increment() != 0
        && !matches!(i.mnemonic(), Mnemonic::Leave | Mnemonic::Enter)
        && !(0..i.op_count()).any(|k| {
            i.op_kind(k) == OpKind::Register && i.op_register(k).full_register() == Register::RSP
        })
    {
        mask &= !rsp;
    }
    mask
}

/// `bt`/`bts`/`btr`/`btc` to memory with a register bit offset: the offset register and
/// the operand size in bytes (the access lies at `ea + (sext(reg) >> log2(8·size)) ·
/// size`, anywhere within ±2^60 of `ea`).
fn bit_offset_register(i: &iced_x86::Instruction) -> Option<(Register, u32)> {
    let bt = matches!(
        i.mnemonic(),
        Mnemonic::Bt | Mnemonic::Bts | Mnemonic::Btr | Mnemonic::Btc
    );
    (bt && i.op0_kind() == OpKind::Memory && i.op1_kind() == OpKind::Register)
        .then(|| (i.op1_register(), i.memory_size().size() as u32))
}

/// Whether `i`'s memory operands use 32-bit addressing (a `0x67` prefix).
fn addressing_32(i: &iced_x86::Instruction) -> bool {
    i.memory_base().is_gpr32()
        || i.memory_index().is_gpr32()
        || (0..i.op_count()).any(|k| {
            matches!(
                i.op_kind(k),
                OpKind::MemorySegESI | OpKind::MemorySegEDI | OpKind::MemoryESEDI
            )
        })
}

impl Tx<'_> {
    /// The checks for instruction `d` with memory operands `ops` (see the module header),
    /// emitted at the instruction's start; updates `bases` for the instruction's effect.
    pub(super) fn emit_isolation_checks(
        &mut self,
        d: &DecodedInsn,
        ops: &[MemOperand],
        bases: &mut BaseState,
        flags_dead: bool,
    ) -> Result<(), EngineError> {
        let pc = d.instr.ip();
        let addr32 = addressing_32(&d.instr);
        let bit_offset = bit_offset_register(&d.instr);
        let xlat = d.instr.mnemonic() == Mnemonic::Xlatb;
        let fence = self.env.fence;
        if let Some(qword) = d.instr.vsib() {
            self.emit_vsib_check(&d.instr, qword, addr32, pc, flags_dead)?;
        }
        for (k, m) in ops.iter().enumerate() {
            if ops[..k].contains(m) {
                continue;
            }
            if let Some((r, size)) = bit_offset {
                self.emit_zone_check_bit_offset(m, r, size, addr32, pc, flags_dead)?;
                continue;
            }
            // `xlat`: [rbx + al], within 255 bytes of RBX (iced names AL, read as RAX).
            let m = &if xlat {
                MemOperand { index: None, ..*m }
            } else {
                *m
            };
            let disp = m.disp as i64;
            match (m.base, m.index, m.seg) {
                (None, None, SegBase::Flat) => {
                    if fence.contains(m.disp) {
                        self.a.bytes(&[0x0F, 0x0B]); // ud2
                    }
                }
                (_, _, SegBase::Flat) if addr32 => {}
                (b, Some(x), SegBase::Flat)
                    if flags_dead && fence.elides(disp) && !bases.has(b, Some(x), m.scale) =>
                {
                    // The index fast path: the base checked wide (once per trace until
                    // written), then per use only `cmp index, SMALL_INDEX_MAX; jbe ok`;
                    // a larger index takes the full check of the expression.
                    if let Some(b) = b.filter(|b| !bases.has_wide(*b)) {
                        self.emit_base_bounds_check(b, 2, pc, None);
                        bases.add_wide(b);
                    }
                    // The slow path is out of line: the fast path falls through.
                    let (slow, back) = (self.a.new_label(), self.a.new_label());
                    let n = x as u8;
                    self.a.bytes(&[0x48 | (n >> 3), 0x81, 0xF8 | (n & 7)]); // cmp x, imm32
                    self.a.bytes(&SMALL_INDEX_MAX.to_le_bytes());
                    self.a.jcc_label(0x7, slow); // ja slow
                    self.a.bind(back);
                    self.cold.push(ColdCheck {
                        slow,
                        back,
                        pc,
                        kind: ColdKind::Full(MemOperand {
                            disp: fence.bias(),
                            ..*m
                        }),
                    });
                    bases.add(b, Some(x), m.scale);
                }
                (b, x, SegBase::Flat) if fence.elides(disp) => {
                    let scale = if x.is_some() { m.scale } else { 1 };
                    if let (Some(b), None, true) = (b, x, flags_dead) {
                        if !bases.has(Some(b), None, 1) {
                            self.emit_base_bounds_check(b, 0, pc, None);
                            bases.add(Some(b), None, 1);
                        }
                    } else if !bases.has(b, x, scale) {
                        let biased = MemOperand {
                            scale,
                            disp: fence.bias(),
                            ..*m
                        };
                        self.emit_zone_check(&biased, pc, flags_dead)?;
                        bases.add(b, x, scale);
                    }
                }
                _ if addr32 => self.emit_zone_check_addr32(m, pc, flags_dead)?,
                _ => self.emit_zone_check(m, pc, flags_dead)?,
            }
        }
        bases.written(written_gprs(d));
        Ok(())
    }

    /// The out-of-line slow paths (`self.cold`), then back to the instruction.
    pub(super) fn emit_cold_checks(&mut self) -> Result<(), EngineError> {
        // Drained, not consumed: the list keeps its storage for the next trace.
        let mut cold = core::mem::take(&mut self.cold);
        for c in cold.drain(..) {
            self.a.bind(c.slow);
            self.a.mark_guest(c.pc);
            match c.kind {
                ColdKind::Full(operand) => {
                    self.emit_zone_check(&operand, c.pc, true)?;
                    self.a.jmp_label(c.back);
                }
                ColdKind::Bound {
                    reg,
                    bound,
                    back_cc,
                    hit,
                } => {
                    self.a.cmp_r_m(reg as u8, bound);
                    self.a.jcc_label(back_cc, c.back);
                    match hit {
                        None => self.a.bytes(&[0x0F, 0x0B]), // ud2
                        Some(l) => {
                            self.a.jmp_label(l);
                        }
                    }
                }
            }
        }
        self.cold = cold;
        Ok(())
    }

    /// The check of `bt*` to memory with the bit offset in register `r` (operand size
    /// `size`): checks `ea + (sext(r) >> 3)`, which lies within `size` bytes above the
    /// accessed address (below the zone: in the hole; above it: at worst in the slot-259
    /// guard). Flag-free: `sarx` (BMI2) with the count in RDX.
    fn emit_zone_check_bit_offset(
        &mut self,
        m: &MemOperand,
        r: Register,
        size: u32,
        addr32: bool,
        pc: u64,
        flags_dead: bool,
    ) -> Result<(), EngineError> {
        let full = hw(r);
        self.a.spill_quiet(reg::RCX);
        self.a.spill_quiet(reg::RAX);
        self.a.spill_quiet(reg::RDX);
        self.emit_linear_rcx(m, addr32, pc)?;
        // RAX may hold the segment base now; every guest value comes from its spill slot
        // if it was spilled.
        if matches!(full, reg::RAX | reg::RCX | reg::RDX) {
            self.a.mov_r_m(reg::RAX, self.a.spill_slot(full));
        } else {
            self.a.mov_r_r(reg::RAX, full);
        }
        match size {
            2 => self.a.bytes(&[0x48, 0x0F, 0xBF, 0xC0]), // movsx rax, ax
            4 => self.a.bytes(&[0x48, 0x63, 0xC0]),       // movsxd rax, eax
            _ => {}
        }
        self.a.bytes(&[0xBA, 0x03, 0x00, 0x00, 0x00]); // mov edx, 3
        self.a.bytes(&[0xC4, 0xE2, 0xEA, 0xF7, 0xC0]); // sarx rax, rax, rdx
        self.a.lea_r_bi(reg::RCX, reg::RCX, reg::RAX, 0);
        self.a.unspill_quiet(reg::RDX);
        self.a.unspill_quiet(reg::RAX);
        self.emit_zone_test(flags_dead);
        Ok(())
    }

    /// RCX = the linear address of `m` (RAX and RCX spilled; RAX clobbered): with
    /// `addr32` the offset wraps at 4 GiB before the segment base is added.
    fn emit_linear_rcx(
        &mut self,
        m: &MemOperand,
        addr32: bool,
        pc: u64,
    ) -> Result<(), EngineError> {
        let flat = MemOperand {
            seg: SegBase::Flat,
            ..*m
        };
        self.emit_ea_rcx(&flat, pc)?;
        if addr32 {
            self.a.bytes(&[0x89, 0xC9]); // mov ecx, ecx
        }
        match m.seg {
            SegBase::Flat => return Ok(()),
            SegBase::Fs => self.a.bytes(&[0xF3, 0x48, 0x0F, 0xAE, 0xC0]), // rdfsbase rax
            SegBase::Gs => self.a.bytes(&[0xF3, 0x48, 0x0F, 0xAE, 0xC8]), // rdgsbase rax
        }
        self.a.lea_r_bi(reg::RCX, reg::RCX, reg::RAX, 0);
        Ok(())
    }

    /// The check of an `fs:`/`gs:` operand with 32-bit addressing: the offset wraps at
    /// 4 GiB before the segment base is added (`mov ecx, ecx`), so that upper register
    /// bits the access ignores cannot move the checked address out of the zone.
    fn emit_zone_check_addr32(
        &mut self,
        m: &MemOperand,
        pc: u64,
        flags_dead: bool,
    ) -> Result<(), EngineError> {
        self.a.spill_quiet(reg::RCX);
        self.a.spill_quiet(reg::RAX);
        self.emit_linear_rcx(m, true, pc)?;
        self.a.unspill_quiet(reg::RAX);
        self.emit_zone_test(flags_dead);
        Ok(())
    }

    /// The inline check of `checked`'s address (a shorter one when the status flags are
    /// dead).
    fn emit_zone_check(
        &mut self,
        checked: &MemOperand,
        pc: u64,
        flags_dead: bool,
    ) -> Result<(), EngineError> {
        let seg = checked.seg != SegBase::Flat;
        self.a.spill_quiet(reg::RCX);
        if seg {
            self.a.spill_quiet(reg::RAX);
        }
        self.emit_ea_rcx(checked, pc)?;
        if seg {
            self.a.unspill_quiet(reg::RAX);
        }
        self.emit_zone_test(flags_dead);
        Ok(())
    }

    /// The check of base register `b` with the status flags dead, against the bounds
    /// `k` of the fence's part of `ctx.zone_bounds` (0: plain, `b + bias`; 2: wide, `b +
    /// wide bias`): compares with the constant bounds, no scratch register. The common
    /// case falls through after one compare — a base above the zone in kernel code that
    /// runs in the upper half (`cmp b, [hi]; jb cold`), below it otherwise (`cmp b, [lo];
    /// jae cold`); the other compare and the `ud2` (or `jmp hit`) are out of line.
    fn emit_base_bounds_check(&mut self, b: Gpr, k: u64, pc: u64, hit: Option<Label>) {
        let fence = self.env.fence;
        let bounds = self.env.ctx.zone_bounds + 8 * (fence.bounds_index() + k);
        let (cold, back) = (self.a.new_label(), self.a.new_label());
        let above_first = self.env.upper_half && fence == Fence::Zone;
        let (first, cc, second) = if above_first {
            (bounds + 8, 0x2, bounds) // jb cold; then below lo: not a hit
        } else {
            (bounds, 0x3, bounds + 8) // jae cold; then at or above hi: not a hit
        };
        self.a.cmp_r_m(b as u8, first);
        self.a.jcc_label(cc, cold);
        self.a.bind(back);
        self.cold.push(ColdCheck {
            slow: cold,
            back,
            pc,
            kind: ColdKind::Bound {
                reg: b,
                bound: second,
                // Back when b < lo (upper-half order) or b >= hi (the other).
                back_cc: if above_first { 0x2 } else { 0x3 },
                hit,
            },
        });
    }

    /// With the address in RCX (spilled): trap if it is in the zone, then unspill RCX.
    fn emit_zone_test(&mut self, flags_dead: bool) {
        self.emit_zone_test_to(flags_dead, None);
    }

    /// [`Self::emit_zone_test`], a hit going to the exit stub `hit` if given.
    fn emit_zone_test_to(&mut self, flags_dead: bool, hit: Option<Label>) {
        // The hit path restores RCX before its `ud2`, so that the guest state there is
        // the instruction's start with nothing spilled: the check needs no PC-map
        // entries of its own (its other instructions cannot fault; interrupts need no
        // recovery), which keeps the fragment tables — and heap-pressure flushes — small.
        let skip = hit_tail_len(hit);
        if self.env.fence == Fence::UpperHalf {
            // Bits 62:47 (an address with bit 63 alone set is non-canonical: #GP natively).
            if flags_dead {
                self.a.bytes(&[0x48, 0xC1, 0xE9, 0x2F]); // shr rcx, 47
                self.a.bytes(&[0x74, skip]); // jz ok
            } else {
                self.a.bytes(&[0xC4, 0xE3, 0xFB, 0xF0, 0xC9, 0x2F]); // rorx rcx, rcx, 47
                self.a.bytes(&[0x0F, 0xB7, 0xC9]); // movzx ecx, cx
                self.a.bytes(&[0xE3, skip]); // jrcxz ok
            }
        } else if flags_dead {
            self.a.bytes(&[0x48, 0xC1, 0xE9, 0x29]); // shr rcx, 41
            self.a.bytes(&[0x81, 0xF9, 0xC0, 0xFF, 0x7F, 0x00]); // cmp ecx, 0x7fffc0
            self.a.bytes(&[0x75, skip]); // jne ok
        } else {
            self.a.bytes(&[0xC4, 0xE3, 0xFB, 0xF0, 0xC9, 0x29]); // rorx rcx, rcx, 41
            self.a.bytes(&[0x0F, 0xB7, 0xC9]); // movzx ecx, cx
            self.a.bytes(&[0x8D, 0x89, 0x40, 0x00, 0xFF, 0xFF]); // lea ecx, [rcx - 0xffc0]
            self.a.bytes(&[0xE3, 0x02]); // jrcxz hit
            self.a.bytes(&[0xEB, skip]); // jmp short ok
        }
        self.emit_hit_tail(hit);
    }

    /// `hit: unspill rcx; ud2 (or jmp to the stub); ok: unspill rcx` (the test before it
    /// jumps [`hit_tail_len`] bytes ahead to `ok` when it passes).
    fn emit_hit_tail(&mut self, hit: Option<Label>) {
        let at = self.a.offset();
        self.a.unspill_quiet(reg::RCX); // hit:
        match hit {
            None => self.a.bytes(&[0x0F, 0x0B]), // ud2
            Some(l) => {
                self.a.jmp_label(l);
            }
        }
        debug_assert_eq!(self.a.offset() - at, usize::from(hit_tail_len(hit)));
        self.a.unspill_quiet(reg::RCX); // ok:
    }
}

/// An out-of-line slow path of a check (status flags dead there).
pub(super) struct ColdCheck {
    slow: Label,
    back: Label,
    /// The guest instruction.
    pc: u64,
    kind: ColdKind,
}

/// What a [`ColdCheck`] does.
enum ColdKind {
    /// The full check of this operand (the index fast path's, with the fence's base bias
    /// as displacement).
    Full(MemOperand),
    /// The second compare of a base bounds check: back if `reg` compared with the
    /// bound at `bound` satisfies `back_cc`, else a hit (`ud2`, or a jump to `hit`).
    Bound {
        reg: Gpr,
        bound: u64,
        back_cc: u8,
        hit: Option<Label>,
    },
}

/// Bytes of [`Tx::emit_hit_tail`] up to `ok`.
fn hit_tail_len(hit: Option<Label>) -> u8 {
    7 + if hit.is_some() { 5 } else { 2 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_zone_is_slots_256_to_259() {
        assert!(in_isolation_zone(0xffff_8000_0000_0000));
        assert!(in_isolation_zone(0xffff_8080_0000_0000));
        assert!(in_isolation_zone(0xffff_8100_0000_0000));
        assert!(in_isolation_zone(0xffff_81ff_ffff_ffff));
        assert!(!in_isolation_zone(0xffff_8200_0000_0000));
        assert!(!in_isolation_zone(0x0000_7fff_ffff_ffff));
        assert!(!in_isolation_zone(0xffff_ffff_8000_0000));
        assert_eq!(ISOLATION_ZONE_START >> 41, 0x7f_ffc0);
        assert_eq!((ISOLATION_ZONE_END - 1) >> 41, 0x7f_ffc0);
    }
}

#[cfg(test)]
mod encoding_tests {
    use iced_x86::{Code, Decoder, DecoderOptions, Register};

    #[test]
    fn test_hand_encoded_check_instructions_decode_as_intended() {
        let cases: [(&[u8], Code, [Register; 3]); 3] = [
            (
                &[0xC4, 0xE2, 0xEA, 0xF7, 0xC0],
                Code::VEX_Sarx_r64_rm64_r64,
                [Register::RAX, Register::RAX, Register::RDX],
            ),
            (
                &[0xC4, 0xE3, 0xFB, 0xF0, 0xC9, 0x29],
                Code::VEX_Rorx_r64_rm64_imm8,
                [Register::RCX, Register::RCX, Register::None],
            ),
            (
                &[0x48, 0xC1, 0xE9, 0x29],
                Code::Shr_rm64_imm8,
                [Register::RCX, Register::None, Register::None],
            ),
        ];
        for (bytes, code, regs) in cases {
            let i = Decoder::with_ip(64, bytes, 0, DecoderOptions::NONE).decode();
            assert_eq!(i.code(), code);
            assert_eq!(i.len(), bytes.len());
            for (k, r) in regs.iter().enumerate() {
                if *r != Register::None {
                    assert_eq!(i.op_register(k as u32), *r);
                }
            }
        }
    }
}
