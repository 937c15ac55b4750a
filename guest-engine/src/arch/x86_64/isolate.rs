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

use iced_x86::{Mnemonic, OpAccess, OpKind, Register};

use iced_x86::{Decoder, DecoderOptions, InstructionInfoFactory};

use super::decode::{mem_operands, Class, DecodedInsn, DecodedTrace};
use super::emit::reg;
use super::emit::Label;
use super::mangle::{hw, Tx};
use crate::addr::GuestVirt;
use crate::context::{Gpr, GuestRegs};
use crate::error::EngineError;
use crate::instrument::{MemOperand, SegBase};

/// First address of the reserved zone (PML4 slot 256).
pub const ISOLATION_ZONE_START: u64 = 0xffff_8000_0000_0000;
/// End (exclusive) of the reserved zone (PML4 slot 260).
pub const ISOLATION_ZONE_END: u64 = 0xffff_8200_0000_0000;

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
/// BIAS)`, then those whose wide check hits.
pub(crate) const fn zone_bounds() -> [u64; 4] {
    [
        ISOLATION_ZONE_START - BASE_CHECK_BIAS,
        ISOLATION_ZONE_END - BASE_CHECK_BIAS,
        ISOLATION_ZONE_START - WIDE_BASE_CHECK_BIAS,
        ISOLATION_ZONE_END - WIDE_BASE_CHECK_BIAS,
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
fn written_gprs(tx: &mut Tx<'_>, d: &DecodedInsn) -> u16 {
    let i = &d.instr;
    let mut mask = 0u16;
    for u in tx.factory.info(i).used_registers() {
        let r = u.register();
        if r.is_gpr()
            && matches!(
                u.access(),
                OpAccess::Write
                    | OpAccess::CondWrite
                    | OpAccess::ReadWrite
                    | OpAccess::ReadCondWrite
            )
        {
            mask |= 1 << hw(r);
        }
    }
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
                    if in_isolation_zone(m.disp) {
                        self.a.bytes(&[0x0F, 0x0B]); // ud2
                    }
                }
                (_, _, SegBase::Flat) if addr32 => {}
                (b, Some(x), SegBase::Flat)
                    if flags_dead
                        && (-ELIDED_DISP_MAX..ELIDED_DISP_MAX).contains(&disp)
                        && !bases.has(b, Some(x), m.scale) =>
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
                            disp: BASE_CHECK_BIAS,
                            ..*m
                        }),
                    });
                    bases.add(b, Some(x), m.scale);
                }
                (b, x, SegBase::Flat) if (-ELIDED_DISP_MAX..ELIDED_DISP_MAX).contains(&disp) => {
                    let scale = if x.is_some() { m.scale } else { 1 };
                    if let (Some(b), None, true) = (b, x, flags_dead) {
                        if !bases.has(Some(b), None, 1) {
                            self.emit_base_bounds_check(b, 0, pc, None);
                            bases.add(Some(b), None, 1);
                        }
                    } else if !bases.has(b, x, scale) {
                        let biased = MemOperand {
                            scale,
                            disp: BASE_CHECK_BIAS,
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
        bases.written(written_gprs(self, d));
        Ok(())
    }

    /// The out-of-line slow paths (`self.cold`), then back to the instruction.
    pub(super) fn emit_cold_checks(&mut self) -> Result<(), EngineError> {
        for c in core::mem::take(&mut self.cold) {
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

    /// A gather/scatter: each lane's address `base + index[k]·scale + disp` (+ FS/GS base;
    /// `qword`: 64-bit indices, else 32-bit ones sign-extended) is checked like an
    /// ordinary operand's first byte (a base near the zone with 32-bit indices reaches it
    /// or not lane by lane). The index register is stored to `ctx.vsib_lanes` (a VEX
    /// `vmovdqu`, or EVEX `vmovdqu64` for ZMM and registers 16–31), and each lane's
    /// address to `ctx.vsib_lane` before its test, so that `classify_fault` learns the
    /// lane that trapped; `ctx.vsib_lane` is zeroed first (a #UD of the store itself is the
    /// guest's: the gather would raise it too). The mask (AVX2 vector or AVX-512 opmask)
    /// is stored to `ctx.vsib_mask` too and a masked-off lane's address becomes 0 before
    /// its test: it accesses nothing, so it never traps. Flag-free (`cqo`, `pext`: BMI2). With 32-bit addressing and no segment base, lanes
    /// lie below 4 GiB: no check.
    fn emit_vsib_check(
        &mut self,
        i: &iced_x86::Instruction,
        qword: bool,
        addr32: bool,
        pc: u64,
        flags_dead: bool,
    ) -> Result<(), EngineError> {
        let seg = i.segment_prefix();
        let seg = (seg == Register::FS || seg == Register::GS).then_some(seg);
        // 32-bit indices without a base or segment: lanes stay within 2^35 + 2^31 bytes
        // of 0, far from the zone.
        if seg.is_none() && (addr32 || (!qword && i.memory_base() == Register::None)) {
            return Ok(());
        }
        let index = i.memory_index();
        let width = if qword { 8 } else { 4 };
        let lanes = index.size() / width;
        let ctx = self.env.ctx;
        self.a.mov_m64_imm32(ctx.vsib_lane, 0);
        let store =
            vector_store(index, ctx.vsib_lanes).ok_or(EngineError::Unsupported(GuestVirt(pc)))?;
        let bytes = self.encode(&store, pc)?;
        self.a.bytes(&bytes);
        let mask = vsib_mask(i);
        let store_mask = match mask {
            LaneMask::Vector(r, _) => vector_store(r, ctx.vsib_mask),
            LaneMask::Opmask(k) => opmask_store(k, ctx.vsib_mask),
            LaneMask::All => None,
        };
        if let Some(store) = store_mask {
            let bytes = self.encode(&store, pc)?;
            self.a.bytes(&bytes);
        }
        let pext = iced_x86::Instruction::with3(
            iced_x86::Code::VEX_Pext_r64_r64_rm64,
            Register::RCX,
            Register::RCX,
            Register::RDX,
        )
        .map_err(|_| EngineError::Encode(GuestVirt(pc)))?;
        let pext = self.encode(&pext, pc)?;
        let base = i.memory_base();
        let scale_log2 = i.memory_index_scale().trailing_zeros() as u8;
        let disp = i.memory_displacement64() as i64 as i32;
        self.a.spill_quiet(reg::RCX);
        self.a.spill_quiet(reg::RAX);
        for k in 0..lanes {
            let lane = ctx.vsib_lanes + (width * k) as u64;
            if qword {
                self.a.mov_r_m(reg::RAX, lane);
            } else {
                self.a.movsxd_r_m(reg::RAX, lane);
            }
            if base == Register::None {
                self.a.bytes(&[0xB9, 0, 0, 0, 0]); // mov ecx, 0
            } else {
                let b = hw(base);
                if matches!(b, reg::RAX | reg::RCX) {
                    self.a.mov_r_m(reg::RCX, self.a.spill_slot(b));
                } else {
                    self.a.mov_r_r(reg::RCX, b);
                }
                if base.is_gpr32() {
                    self.a.bytes(&[0x89, 0xC9]); // mov ecx, ecx
                }
            }
            self.a.lea_r_bi(reg::RCX, reg::RCX, reg::RAX, scale_log2);
            self.a.lea_r_disp(reg::RCX, reg::RCX, disp);
            if addr32 {
                self.a.bytes(&[0x89, 0xC9]); // mov ecx, ecx
            }
            match seg {
                Some(Register::FS) => self.a.bytes(&[0xF3, 0x48, 0x0F, 0xAE, 0xC0]), // rdfsbase rax
                Some(_) => self.a.bytes(&[0xF3, 0x48, 0x0F, 0xAE, 0xC8]),            // rdgsbase rax
                None => {}
            }
            if seg.is_some() {
                self.a.lea_r_bi(reg::RCX, reg::RCX, reg::RAX, 0);
            }
            // A masked-off lane accesses nothing: its address becomes 0 (flag-free: RDX =
            // the lane's mask bit spread by `cqo`, then `pext rcx, rcx, rdx`).
            let masked = match mask {
                LaneMask::Vector(_, 8) => {
                    self.a.mov_r_m(reg::RAX, ctx.vsib_mask + 8 * k as u64);
                    true
                }
                LaneMask::Vector(..) => {
                    self.a.movsxd_r_m(reg::RAX, ctx.vsib_mask + 4 * k as u64);
                    true
                }
                LaneMask::Opmask(_) => {
                    self.a.mov_r_m(reg::RAX, ctx.vsib_mask);
                    // rorx rax, rax, k + 1: the lane's bit to bit 63.
                    self.a
                        .bytes(&[0xC4, 0xE3, 0xFB, 0xF0, 0xC0, (k as u8 + 1) & 63]);
                    true
                }
                LaneMask::All => false,
            };
            if masked {
                self.a.spill_quiet(reg::RDX);
                self.a.bytes(&[0x48, 0x99]); // cqo
                self.a.bytes(&pext);
                self.a.unspill_quiet(reg::RDX);
            }
            self.a.unspill_quiet(reg::RAX);
            self.a.mov_m_r(ctx.vsib_lane, reg::RCX);
            self.emit_zone_test(flags_dead);
        }
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
    /// `k` of `ctx.zone_bounds` (0: plain, `b + BASE_CHECK_BIAS`; 2: wide, `b +
    /// WIDE_BASE_CHECK_BIAS`): compares with the constant bounds, no scratch register.
    /// The common case falls through after one compare — a base above the zone in code
    /// that runs in the upper half (`cmp b, [hi]; jb cold`), below it in code in the lower
    /// half (`cmp b, [lo]; jae cold`); the other compare and the `ud2` (or `jmp hit`) are
    /// out of line.
    fn emit_base_bounds_check(&mut self, b: Gpr, k: u64, pc: u64, hit: Option<Label>) {
        let bounds = self.env.ctx.zone_bounds + 8 * k;
        let (cold, back) = (self.a.new_label(), self.a.new_label());
        let (first, cc, second) = if self.env.upper_half {
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
                // Back when b < lo (kernel order) or b >= hi (user order).
                back_cc: if self.env.upper_half { 0x2 } else { 0x3 },
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
        if flags_dead {
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

    /// The checks of a trace that branches back to its own start, hoisted to its top
    /// (`hoisted`, from [`hoistable`]): each such register keeps its value across
    /// iterations, so one check per entry from outside covers them all (the back edge,
    /// linked to the trace's `loop_entry`, skips them). A hit cannot name an instruction
    /// here: it exits to `hit` (the dispatcher builds the trace again without hoisting,
    /// where the check traps at the instruction). Marks the registers checked in `bases`.
    pub(super) fn emit_hoisted_checks(
        &mut self,
        hoisted: Hoisted,
        pc: u64,
        bases: &mut BaseState,
        hit: Label,
    ) -> Result<(), EngineError> {
        for b in Gpr::ALL {
            let bit = 1u16 << (b as u8);
            if hoisted.wide & bit != 0 {
                self.emit_base_bounds_check(b, 2, pc, Some(hit));
                bases.add_wide(b);
            } else if hoisted.narrow & bit != 0 && hoisted.flags_dead {
                self.emit_base_bounds_check(b, 0, pc, Some(hit));
                bases.add(Some(b), None, 1);
            } else if hoisted.narrow & bit != 0 {
                let biased = MemOperand {
                    base: Some(b),
                    index: None,
                    scale: 1,
                    disp: BASE_CHECK_BIAS,
                    seg: SegBase::Flat,
                    size: 8,
                    access: 0,
                };
                self.a.spill_quiet(reg::RCX);
                self.emit_ea_rcx(&biased, pc)?;
                self.emit_zone_test_to(hoisted.flags_dead, Some(hit));
                bases.add(Some(b), None, 1);
            }
        }
        Ok(())
    }
}

/// Base registers whose checks a self-looping trace hoists to its top (bit = hardware
/// number).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Hoisted {
    /// Checked wide (bases of the index fast path).
    wide: u16,
    /// Checked as plain bases.
    narrow: u16,
    /// The status flags are dead at the trace's top.
    flags_dead: bool,
}

impl Hoisted {
    pub(super) fn any(&self) -> bool {
        self.wide | self.narrow != 0
    }
}

/// The base registers of elidable operands that no instruction of `t` up to its last
/// branch back to its start writes (RSP's implicit adjustments count as writes here: they
/// add up over iterations); `live` is the trace's flag liveness. Instructions after that
/// branch run at most once per entry: their writes are tracked as usual (`BaseState`).
pub(super) fn hoistable(tx: &mut Tx<'_>, t: &DecodedTrace, live: &[u32]) -> Hoisted {
    let start = t.start.0;
    let Some(last) = t.insns.iter().rposition(|d| {
        matches!(d.class, Class::Jcc { target, .. } | Class::Jmp { target }
            | Class::LoopLike { target } if target == start)
    }) else {
        return Hoisted::default();
    };
    let looped = &t.insns[..=last];
    let mut written = 0u16;
    for d in looped {
        written |= written_gprs(tx, d);
        if d.instr.stack_pointer_increment() != 0 {
            written |= 1 << reg::RSP;
        }
    }
    let (mut narrow, mut wide) = (0u16, 0u16);
    for (k, d) in looped.iter().enumerate() {
        let i = &d.instr;
        if i.vsib().is_some() || bit_offset_register(i).is_some() || addressing_32(i) {
            continue;
        }
        for m in t.info[k].mem.iter() {
            let index = if i.mnemonic() == Mnemonic::Xlatb {
                None
            } else {
                m.index
            };
            let disp = m.disp as i64;
            if m.seg != SegBase::Flat || !(-ELIDED_DISP_MAX..ELIDED_DISP_MAX).contains(&disp) {
                continue;
            }
            match (m.base, index) {
                (Some(b), None) => narrow |= 1 << (b as u8),
                (Some(b), Some(_)) if live[k] == 0 => wide |= 1 << (b as u8),
                _ => {}
            }
        }
    }
    // The wide check needs the status flags dead at the top.
    let flags_dead = live.first() == Some(&0);
    if !flags_dead {
        wide = 0;
    }
    wide &= !written;
    narrow &= !written & !wide;
    Hoisted {
        wide,
        narrow,
        flags_dead,
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
    /// The full check of this operand (the index fast path's, with [`BASE_CHECK_BIAS`] as
    /// displacement).
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

/// Which lanes of a gather/scatter access memory.
#[derive(Clone, Copy, Debug)]
enum LaneMask {
    /// An AVX2 mask vector register and its element size in bytes (the sign bit of each
    /// element enables its lane).
    Vector(Register, usize),
    /// An AVX-512 opmask register (bit k enables lane k).
    Opmask(Register),
    /// No mask (an EVEX form with k0, which raises #UD anyway).
    All,
}

/// The mask of the gather/scatter `i`.
fn vsib_mask(i: &iced_x86::Instruction) -> LaneMask {
    if i.op_mask() != Register::None {
        return LaneMask::Opmask(i.op_mask());
    }
    // VEX gathers: dest, memory, mask; the mask's elements are the gathered elements.
    if i.op_count() == 3 && i.op2_kind() == OpKind::Register {
        return LaneMask::Vector(i.op2_register(), i.memory_size().size());
    }
    LaneMask::All
}

/// `kmovq [target], k` (RIP-relative).
fn opmask_store(k: Register, target: u64) -> Option<iced_x86::Instruction> {
    let m = iced_x86::MemoryOperand::with_base_displ(Register::RIP, target as i64);
    iced_x86::Instruction::with2(iced_x86::Code::VEX_Kmovq_m64_kr, m, k).ok()
}

/// `vmovdqu [target], index` (RIP-relative) for a VSIB index register: VEX for
/// XMM0–15/YMM0–15, EVEX `vmovdqu64` for ZMM and registers 16–31.
fn vector_store(index: Register, target: u64) -> Option<iced_x86::Instruction> {
    use iced_x86::Code;
    let n = index.number();
    let code = if index.is_zmm() {
        Code::EVEX_Vmovdqu64_zmmm512_k1z_zmm
    } else if index.is_ymm() {
        if n < 16 {
            Code::VEX_Vmovdqu_ymmm256_ymm
        } else {
            Code::EVEX_Vmovdqu64_ymmm256_k1z_ymm
        }
    } else if index.is_xmm() {
        if n < 16 {
            Code::VEX_Vmovdqu_xmmm128_xmm
        } else {
            Code::EVEX_Vmovdqu64_xmmm128_k1z_xmm
        }
    } else {
        return None;
    };
    let m = iced_x86::MemoryOperand::with_base_displ(Register::RIP, target as i64);
    iced_x86::Instruction::with2(code, m, index).ok()
}

/// The sign-extended value of the 16/32/64-bit GPR `r`.
fn gpr_value(regs: &GuestRegs, r: Register) -> i64 {
    let full = Gpr::from_number(hw(r)).map_or(0, |g| regs.get(g));
    match r.size() {
        2 => i64::from(full as u16 as i16),
        4 => i64::from(full as u32 as i32),
        _ => full as i64,
    }
}

/// What a #UD raised at the translation of a guest instruction means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IsolationFault {
    /// An operand's linear address lies in the reserved zone: the access gets what the
    /// guest's own page tables say (as a hardware #PF at `addr` would).
    Zone {
        /// The operand's linear address.
        addr: u64,
        /// `instrument::access` bits of the operand (READ, WRITE).
        access: u32,
    },
    /// An operand's address is non-canonical (the check's only false positives): #GP(0).
    NonCanonical {
        /// The address.
        addr: u64,
    },
    /// No operand lies in the zone but a base register (plus [`BASE_CHECK_BIAS`]) does
    /// (a base-register check hit): the operand at `addr` (canonical, outside the zone:
    /// the start of slot 260) gets what the guest's tables say, but the trace cannot run
    /// it natively.
    BaseInZone {
        /// The base register's value (base + index * scale).
        base: u64,
        /// The operand's linear address.
        addr: u64,
        /// `instrument::access` bits of the operand (READ, WRITE).
        access: u32,
    },
    /// The #UD is the guest's own (e.g. `ud2`, or nothing the check explains).
    GuestUd,
}

/// Classifies a #UD at the guest instruction `bytes` (at `pc`) with the guest state
/// `regs` before it and the FS/GS bases (see the module header). `vector_lane` is the
/// lane address the check of a gather/scatter with 64-bit indices tested last
/// (`Engine::vector_lane_checked`; ignored for other instructions).
pub fn classify_fault(
    bytes: &[u8],
    pc: u64,
    regs: &GuestRegs,
    fs_base: u64,
    gs_base: u64,
    vector_lane: u64,
) -> IsolationFault {
    let i = Decoder::with_ip(64, bytes, pc, DecoderOptions::NONE).decode();
    if i.is_invalid() || matches!(i.mnemonic(), Mnemonic::Ud0 | Mnemonic::Ud1 | Mnemonic::Ud2) {
        return IsolationFault::GuestUd;
    }
    if i.vsib().is_some() {
        let scatter = matches!(
            i.mnemonic(),
            Mnemonic::Vpscatterdd
                | Mnemonic::Vpscatterdq
                | Mnemonic::Vscatterdps
                | Mnemonic::Vscatterdpd
                | Mnemonic::Vpscatterqd
                | Mnemonic::Vpscatterqq
                | Mnemonic::Vscatterqps
                | Mnemonic::Vscatterqpd
        );
        let addr = vector_lane;
        if in_isolation_zone(addr) {
            let access = if scatter {
                crate::instrument::access::WRITE
            } else {
                crate::instrument::access::READ
            };
            return IsolationFault::Zone { addr, access };
        }
        // The check's false positives: non-canonical lanes with bits 56:41 = 0xffc0.
        if (addr >> 41) & 0xffff == 0xffc0 && ((addr as i64) << 16 >> 16) as u64 != addr {
            return IsolationFault::NonCanonical { addr };
        }
        return IsolationFault::GuestUd;
    }
    let mut factory = InstructionInfoFactory::new();
    let ops = mem_operands(&mut factory, &i);
    let addr32 = addressing_32(&i);
    let mut non_canonical = None;
    for m in ops.iter() {
        let seg = match m.seg {
            SegBase::Flat => 0,
            SegBase::Fs => fs_base,
            SegBase::Gs => gs_base,
        };
        let mut offset = if i.mnemonic() == Mnemonic::Xlatb {
            regs.get(Gpr::Rbx).wrapping_add(regs.get(Gpr::Rax) & 0xff)
        } else {
            m.effective_address(regs)
        };
        if let Some((r, size)) = bit_offset_register(&i) {
            let v = gpr_value(regs, r);
            let bits = i64::from(size * 8);
            offset = offset.wrapping_add((v.div_euclid(bits) * i64::from(size)) as u64);
        }
        if addr32 {
            offset &= 0xffff_ffff;
        }
        let addr = offset.wrapping_add(seg);
        if in_isolation_zone(addr) {
            return IsolationFault::Zone {
                addr,
                access: m.access,
            };
        }
        if ((addr as i64) << 16 >> 16) as u64 != addr {
            non_canonical.get_or_insert(addr);
        }
    }
    if let Some(addr) = non_canonical {
        return IsolationFault::NonCanonical { addr };
    }
    for m in ops.iter() {
        let addr = m.effective_address(regs);
        let base = addr.wrapping_sub(m.disp);
        // The index fast path checks the base register alone, wide.
        let wide = m
            .index
            .and(m.base)
            .map(|b| regs.get(b))
            .filter(|b| in_isolation_zone(b.wrapping_add(WIDE_BASE_CHECK_BIAS)));
        if m.seg == SegBase::Flat && in_isolation_zone(base.wrapping_add(BASE_CHECK_BIAS)) {
            return IsolationFault::BaseInZone {
                base,
                addr,
                access: m.access,
            };
        }
        if let (SegBase::Flat, Some(base)) = (m.seg, wide) {
            return IsolationFault::BaseInZone {
                base,
                addr,
                access: m.access,
            };
        }
    }
    IsolationFault::GuestUd
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
    use iced_x86::{Code, Decoder, DecoderOptions, Encoder, Register};

    #[test]
    fn test_vector_index_store_covers_every_index_register() {
        let at = 0x1000_0000u64;
        let target = at + 0x2000;
        for (index, code) in [
            (Register::XMM3, Code::VEX_Vmovdqu_xmmm128_xmm),
            (Register::YMM15, Code::VEX_Vmovdqu_ymmm256_ymm),
            (Register::XMM17, Code::EVEX_Vmovdqu64_xmmm128_k1z_xmm),
            (Register::YMM31, Code::EVEX_Vmovdqu64_ymmm256_k1z_ymm),
            (Register::ZMM5, Code::EVEX_Vmovdqu64_zmmm512_k1z_zmm),
        ] {
            let store = super::vector_store(index, target).unwrap();
            let mut enc = Encoder::new(64);
            enc.encode(&store, at).unwrap();
            let bytes = enc.take_buffer();
            let i = Decoder::with_ip(64, &bytes, at, DecoderOptions::NONE).decode();
            assert_eq!(i.code(), code);
            assert_eq!(i.op1_register(), index);
            assert!(i.is_ip_rel_memory_operand());
            assert_eq!(i.ip_rel_memory_address(), target);
            assert_eq!(i.memory_size().size(), index.size());
        }
        assert!(super::vector_store(Register::RAX, target).is_none());
    }

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
