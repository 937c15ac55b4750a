//! Hand encoder for the glue instructions the translator emits around guest code.
//!
//! Invariants: every instruction emitted here is position-dependent only through
//! RIP-relative displacements or rel8/rel32 branches, all of which are computed against
//! the final cache address given to [`Asm::new`]; the buffer is therefore only valid when
//! copied to exactly that address. Nothing here touches EFLAGS unless its name says
//! so (`add_*`, `cmp_*`, `pushfq`/`popfq`).

use alloc::vec::Vec;

use crate::error::EngineError;

/// Hardware register numbers (ModRM/REX encoding order).
pub(crate) mod reg {
    pub const RAX: u8 = 0;
    pub const RCX: u8 = 1;
    pub const RDX: u8 = 2;
    pub const RBX: u8 = 3;
    pub const RSP: u8 = 4;
    pub const RBP: u8 = 5;
    pub const R8: u8 = 8;
    pub const R9: u8 = 9;
    pub const R10: u8 = 10;
    pub const R12: u8 = 12;
    pub const R13: u8 = 13;
    pub const R15: u8 = 15;
}

/// A forward or backward branch target inside one [`Asm`] buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Label(usize);

struct Fixup {
    /// Offset of the displacement field.
    at: usize,
    /// 1 (rel8) or 4 (rel32).
    width: u8,
    /// Offset of the end of the instruction (the displacement base).
    end: usize,
    label: Label,
}

/// One entry of the cache-PC → guest map recorded while emitting (see `recover`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct MapMark {
    /// Offset into the emitted code where this state starts.
    pub offset: u32,
    /// Guest instruction whose translation this code belongs to.
    pub guest_pc: u64,
    /// Guest GPRs (bit = hardware number) whose value lives in the context spill slot.
    pub spilled: u16,
}

/// A byte buffer destined for a fixed cache address, with labels and a PC map.
pub(crate) struct Asm {
    pub(crate) buf: Vec<u8>,
    base: u64,
    labels: Vec<Option<usize>>,
    fixups: Vec<Fixup>,
    pub(crate) marks: Vec<MapMark>,
    guest_pc: u64,
    spilled: u16,
    /// Absolute address of the context's spill slot array (16 × u64).
    spill_base: u64,
}

fn rex(w: bool, r: u8, x: u8, b: u8) -> u8 {
    0x40 | (u8::from(w) << 3) | (((r >> 3) & 1) << 2) | (((x >> 3) & 1) << 1) | ((b >> 3) & 1)
}

fn modrm(md: u8, r: u8, rm: u8) -> u8 {
    (md << 6) | ((r & 7) << 3) | (rm & 7)
}

/// An [`Asm`]'s buffers between two uses ([`Asm::with_buffers`], [`Asm::finish_buffers`]):
/// the translator keeps them across traces, so that emitting one allocates nothing once
/// they have grown.
#[derive(Default)]
pub(crate) struct AsmBuffers {
    pub(crate) code: Vec<u8>,
    labels: Vec<Option<usize>>,
    fixups: Vec<Fixup>,
    pub(crate) marks: Vec<MapMark>,
}

impl Asm {
    pub(crate) fn new(base: u64, spill_base: u64) -> Self {
        Self::with_buffers(
            base,
            spill_base,
            AsmBuffers {
                code: Vec::with_capacity(1024),
                labels: Vec::with_capacity(16),
                fixups: Vec::with_capacity(16),
                marks: Vec::with_capacity(64),
            },
        )
    }

    /// An empty buffer for `base` in `b`'s (cleared) storage.
    pub(crate) fn with_buffers(base: u64, spill_base: u64, mut b: AsmBuffers) -> Self {
        b.code.clear();
        b.labels.clear();
        b.fixups.clear();
        b.marks.clear();
        Self {
            buf: b.code,
            base,
            labels: b.labels,
            fixups: b.fixups,
            marks: b.marks,
            guest_pc: 0,
            spilled: 0,
            spill_base,
        }
    }

    /// Cache address of the next byte.
    #[inline]
    pub(crate) fn pc(&self) -> u64 {
        self.base + self.buf.len() as u64
    }

    #[inline]
    pub(crate) fn offset(&self) -> usize {
        self.buf.len()
    }

    #[inline]
    pub(crate) fn bytes(&mut self, b: &[u8]) {
        self.buf.extend_from_slice(b);
    }

    /// Appends `b[..n]` by copying the whole of `b` (a fixed-size copy, where a slice of
    /// run-time length costs a `memcpy` call) into the spare capacity.
    #[inline]
    pub(crate) fn bytes_of<const N: usize>(&mut self, b: &[u8; N], n: usize) {
        assert!(n <= N, "{n} of {N} bytes");
        self.buf.reserve(N);
        let len = self.buf.len();
        // SAFETY: `reserve` made room for `N` bytes past `len`; the copy initializes them,
        // and only the first `n` become part of the buffer.
        unsafe {
            core::ptr::copy_nonoverlapping(b.as_ptr(), self.buf.as_mut_ptr().add(len), N);
            self.buf.set_len(len + n);
        }
    }

    #[inline]
    fn u32le(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }

    /// Starts the code of guest instruction `pc` (no spilled registers).
    #[inline]
    pub(crate) fn mark_guest(&mut self, pc: u64) {
        self.guest_pc = pc;
        self.push_mark();
    }

    #[inline]
    fn push_mark(&mut self) {
        let offset = self.buf.len() as u32;
        if let Some(last) = self.marks.last_mut() {
            if last.offset == offset {
                last.guest_pc = self.guest_pc;
                last.spilled = self.spilled;
                return;
            }
            // The mark in force already says this.
            if (last.guest_pc, last.spilled) == (self.guest_pc, self.spilled) {
                return;
            }
        }
        self.marks.push(MapMark {
            offset,
            guest_pc: self.guest_pc,
            spilled: self.spilled,
        });
    }

    /// Forgets the spill state for code that is only reached on a side path whose
    /// state was already described (out-of-line stubs restore before they exit).
    #[inline]
    pub(crate) fn set_spilled(&mut self, mask: u16) {
        self.spilled = mask;
        self.push_mark();
    }

    #[inline]
    pub(crate) fn spill_slot(&self, r: u8) -> u64 {
        self.spill_base + 8 * u64::from(r)
    }

    /// `mov [ctx.spill[r]], r` without a PC-map entry: for code that cannot fault and
    /// restores `r` (with [`Asm::unspill_quiet`]) before anything that can — the
    /// isolation checks, record appends. Such code needs no entries of its own, which
    /// keeps a trace's PC map (heap) small.
    pub(crate) fn spill_quiet(&mut self, r: u8) {
        let slot = self.spill_slot(r);
        self.mov_m_r(slot, r);
    }

    /// `mov r, [ctx.spill[r]]` without a PC-map entry (see [`Asm::spill_quiet`]).
    pub(crate) fn unspill_quiet(&mut self, r: u8) {
        let slot = self.spill_slot(r);
        self.mov_r_m(r, slot);
    }

    /// `mov [ctx.spill[r]], r` and record that `r` now lives in its slot.
    #[inline]
    pub(crate) fn emit_spill(&mut self, r: u8) {
        self.mov_m_r(self.spill_slot(r), r);
        self.spilled |= 1 << r;
        self.push_mark();
    }

    /// `mov r, [ctx.spill[r]]` and record that `r` is back in its register.
    #[inline]
    pub(crate) fn emit_unspill(&mut self, r: u8) {
        self.mov_r_m(r, self.spill_slot(r));
        self.spilled &= !(1 << r);
        self.push_mark();
    }

    // ---- labels -------------------------------------------------------------------

    #[inline]
    pub(crate) fn new_label(&mut self) -> Label {
        self.labels.push(None);
        Label(self.labels.len() - 1)
    }

    #[inline]
    pub(crate) fn bind(&mut self, l: Label) {
        self.labels[l.0] = Some(self.buf.len());
    }

    #[inline]
    fn fixup(&mut self, width: u8, label: Label) {
        let at = self.buf.len();
        if width == 1 {
            self.buf.push(0);
        } else {
            self.buf.extend_from_slice(&[0; 4]);
        }
        let end = self.buf.len();
        self.fixups.push(Fixup {
            at,
            width,
            end,
            label,
        });
    }

    /// Makes the rel32 field at offset `at` (already in the buffer, the end of its
    /// instruction) a branch to `l`.
    #[inline]
    pub(crate) fn fixup_rel32_at(&mut self, at: usize, l: Label) {
        self.fixups.push(Fixup {
            at,
            width: 4,
            end: at + 4,
            label: l,
        });
    }

    /// Resolves label fixups and returns the code bytes and the PC map.
    pub(crate) fn finish(self) -> Result<(Vec<u8>, Vec<MapMark>), EngineError> {
        let b = self.finish_buffers()?;
        Ok((b.code, b.marks))
    }

    /// Resolves label fixups and returns the buffers: the code bytes and the PC map in
    /// `code` and `marks`.
    pub(crate) fn finish_buffers(mut self) -> Result<AsmBuffers, EngineError> {
        for f in &self.fixups {
            let target = self.labels[f.label.0].ok_or(EngineError::UnboundLabel)?;
            let rel = target as i64 - f.end as i64;
            if f.width == 1 {
                let r = i8::try_from(rel).map_err(|_| EngineError::BranchOutOfRange)?;
                self.buf[f.at] = r as u8;
            } else {
                let r = i32::try_from(rel).map_err(|_| EngineError::BranchOutOfRange)?;
                self.buf[f.at..f.at + 4].copy_from_slice(&r.to_le_bytes());
            }
        }
        Ok(AsmBuffers {
            code: self.buf,
            labels: self.labels,
            fixups: self.fixups,
            marks: self.marks,
        })
    }

    // ---- branches -----------------------------------------------------------------

    /// `jmp rel32` to a label; returns the offset of the rel32 field.
    #[inline]
    pub(crate) fn jmp_label(&mut self, l: Label) -> usize {
        self.buf.push(0xE9);
        let at = self.buf.len();
        self.fixup(4, l);
        at
    }

    /// `jcc rel32` (condition nibble `cc`) to a label; returns the rel32 offset.
    #[inline]
    pub(crate) fn jcc_label(&mut self, cc: u8, l: Label) -> usize {
        self.bytes(&[0x0F, 0x80 | (cc & 0xF)]);
        let at = self.buf.len();
        self.fixup(4, l);
        at
    }

    /// `cmp r64, qword [rip+target]`.
    pub(crate) fn cmp_r_m(&mut self, r: u8, target: u64) {
        self.riprel(Some(rex(true, r, 0, 0)), &[0x3B], r, target, &[]);
    }

    /// `jrcxz rel8` to a label (flag-free zero test of RCX).
    #[inline]
    pub(crate) fn jrcxz_label(&mut self, l: Label) {
        self.buf.push(0xE3);
        self.fixup(1, l);
    }

    /// `jmp rel32` to an absolute cache address.
    #[inline]
    pub(crate) fn jmp_abs(&mut self, target: u64) {
        self.buf.push(0xE9);
        let end = self.pc() + 4;
        self.u32le(target.wrapping_sub(end) as u32);
    }

    /// `jmp qword [rip+target]`.
    pub(crate) fn jmp_m(&mut self, target: u64) {
        self.riprel(None, &[0xFF], 4, target, &[]);
    }

    // ---- RIP-relative data access -------------------------------------------------

    #[inline]
    fn riprel(&mut self, rexb: Option<u8>, op: &[u8], r: u8, target: u64, imm: &[u8]) {
        // Assembled on the stack and appended once: the glue's most frequent form, where
        // one capacity check instead of five shows in the translator's profile.
        let mut b = [0u8; 16];
        let mut n = usize::from(rexb.is_some());
        b[0] = rexb.unwrap_or(0);
        b[n..n + op.len()].copy_from_slice(op);
        n += op.len();
        b[n] = modrm(0, r, 5);
        let end = self.pc() + (n + 5 + imm.len()) as u64;
        b[n + 1..n + 5].copy_from_slice(&(target.wrapping_sub(end) as u32).to_le_bytes());
        n += 5;
        b[n..n + imm.len()].copy_from_slice(imm);
        n += imm.len();
        self.bytes(&b[..n]);
    }

    /// `mov [rip+target], r64`.
    #[inline]
    pub(crate) fn mov_m_r(&mut self, target: u64, r: u8) {
        self.riprel(Some(rex(true, r, 0, 0)), &[0x89], r, target, &[]);
    }

    /// `mov r64, [rip+target]`.
    #[inline]
    pub(crate) fn mov_r_m(&mut self, r: u8, target: u64) {
        self.riprel(Some(rex(true, r, 0, 0)), &[0x8B], r, target, &[]);
    }

    /// `movzx r32, word [rip+target]` (bits 32-63 of the register cleared).
    pub(crate) fn movzx_r32_m16(&mut self, r: u8, target: u64) {
        let rexb = (r >= 8).then(|| rex(false, r, 0, 0));
        self.riprel(rexb, &[0x0F, 0xB7], r, target, &[]);
    }

    /// `mov r16, word [rip+target]` (bits 16-63 of the register kept).
    pub(crate) fn mov_r16_m16(&mut self, r: u8, target: u64) {
        self.bytes(&[0x66]);
        let rexb = (r >= 8).then(|| rex(false, r, 0, 0));
        self.riprel(rexb, &[0x8B], r, target, &[]);
    }

    /// `movsxd r64, dword [rip+target]`.
    pub(crate) fn movsxd_r_m(&mut self, r: u8, target: u64) {
        self.riprel(Some(rex(true, r, 0, 0)), &[0x63], r, target, &[]);
    }

    /// `lea r64, [rip+target]`.
    pub(crate) fn lea_r_rip(&mut self, r: u8, target: u64) {
        self.riprel(Some(rex(true, r, 0, 0)), &[0x8D], r, target, &[]);
    }

    /// `mov qword [rip+target], imm32` (sign-extended).
    #[inline]
    pub(crate) fn mov_m64_imm32(&mut self, target: u64, imm: i32) {
        self.riprel(
            Some(rex(true, 0, 0, 0)),
            &[0xC7],
            0,
            target,
            &imm.to_le_bytes(),
        );
    }

    /// `add qword [rip+target], imm` — WRITES EFLAGS.
    pub(crate) fn add_m64_imm(&mut self, target: u64, imm: i32) {
        if let Ok(b) = i8::try_from(imm) {
            self.riprel(Some(rex(true, 0, 0, 0)), &[0x83], 0, target, &[b as u8]);
        } else {
            self.riprel(
                Some(rex(true, 0, 0, 0)),
                &[0x81],
                0,
                target,
                &imm.to_le_bytes(),
            );
        }
    }

    /// `cmp byte [rip+target], imm8` — WRITES EFLAGS.
    #[inline]
    pub(crate) fn cmp_m8_imm8(&mut self, target: u64, imm: u8) {
        self.riprel(None, &[0x80], 7, target, &[imm]);
    }

    /// `or byte [rip+target], imm8` — WRITES EFLAGS.
    pub(crate) fn or_m8_imm8(&mut self, target: u64, imm: u8) {
        self.riprel(None, &[0x80], 1, target, &[imm]);
    }

    /// `movzx ecx, byte [rip+target]`.
    pub(crate) fn movzx_r32_m8(&mut self, r: u8, target: u64) {
        let rx = if r >= 8 {
            Some(rex(false, r, 0, 0))
        } else {
            None
        };
        self.riprel(rx, &[0x0F, 0xB6], r, target, &[]);
    }

    /// `push qword [rip+target]`.
    pub(crate) fn push_m(&mut self, target: u64) {
        self.riprel(None, &[0xFF], 6, target, &[]);
    }

    /// `pop qword [rip+target]`.
    pub(crate) fn pop_m(&mut self, target: u64) {
        self.riprel(None, &[0x8F], 0, target, &[]);
    }

    // ---- register forms -----------------------------------------------------------

    /// `mov r64, imm64` (or the shorter zero-extending `mov r32, imm32`).
    #[inline]
    pub(crate) fn mov_r_imm64(&mut self, r: u8, imm: u64) {
        if let Ok(v) = u32::try_from(imm) {
            if r >= 8 {
                self.buf.push(rex(false, 0, 0, r));
            }
            self.buf.push(0xB8 + (r & 7));
            self.u32le(v);
        } else {
            self.buf.push(rex(true, 0, 0, r));
            self.buf.push(0xB8 + (r & 7));
            self.bytes(&imm.to_le_bytes());
        }
    }

    /// `mov dst, src` (64-bit).
    #[inline]
    pub(crate) fn mov_r_r(&mut self, dst: u8, src: u8) {
        self.bytes(&[rex(true, src, 0, dst), 0x89, modrm(3, src, dst)]);
    }

    pub(crate) fn push_r(&mut self, r: u8) {
        if r >= 8 {
            self.buf.push(rex(false, 0, 0, r));
        }
        self.buf.push(0x50 + (r & 7));
    }

    pub(crate) fn pop_r(&mut self, r: u8) {
        if r >= 8 {
            self.buf.push(rex(false, 0, 0, r));
        }
        self.buf.push(0x58 + (r & 7));
    }

    pub(crate) fn pushfq(&mut self) {
        self.buf.push(0x9C);
    }

    pub(crate) fn popfq(&mut self) {
        self.buf.push(0x9D);
    }

    pub(crate) fn ret(&mut self) {
        self.buf.push(0xC3);
    }

    /// `cld`.
    pub(crate) fn cld(&mut self) {
        self.buf.push(0xFC);
    }

    /// `xsave64 [rip+target]` (component mask in EDX:EAX).
    pub(crate) fn xsave64_m(&mut self, target: u64) {
        self.riprel(Some(rex(true, 0, 0, 0)), &[0x0F, 0xAE], 4, target, &[]);
    }

    /// `xsaveopt64 [rip+target]` (skips components in their init state).
    pub(crate) fn xsaveopt64_m(&mut self, target: u64) {
        self.riprel(Some(rex(true, 0, 0, 0)), &[0x0F, 0xAE], 6, target, &[]);
    }

    /// `xrstor64 [rip+target]` (component mask in EDX:EAX).
    pub(crate) fn xrstor64_m(&mut self, target: u64) {
        self.riprel(Some(rex(true, 0, 0, 0)), &[0x0F, 0xAE], 5, target, &[]);
    }

    /// ModRM + optional SIB + disp32 for `[base + disp32]` with `reg` in the reg field.
    #[inline]
    fn mem_base_disp(&mut self, r: u8, base: u8, disp: i32) {
        self.buf.push(modrm(2, r, base));
        if base & 7 == 4 {
            self.buf.push(0x24);
        }
        self.bytes(&disp.to_le_bytes());
    }

    /// `lea dst, [base + disp32]` (flag-free add).
    #[inline]
    pub(crate) fn lea_r_disp(&mut self, dst: u8, base: u8, disp: i32) {
        self.bytes(&[rex(true, dst, 0, base), 0x8D]);
        self.mem_base_disp(dst, base, disp);
    }

    /// `lea dst, [base + index*(1<<scale_log2)]` (flag-free add).
    pub(crate) fn lea_r_bi(&mut self, dst: u8, base: u8, index: u8, scale_log2: u8) {
        self.bytes(&[rex(true, dst, index, base), 0x8D]);
        let sib = (scale_log2 << 6) | ((index & 7) << 3) | (base & 7);
        if base & 7 == 5 {
            self.bytes(&[modrm(1, dst, 4), sib, 0]);
        } else {
            self.bytes(&[modrm(0, dst, 4), sib]);
        }
    }

    /// `mov dst, [base + disp32]`.
    pub(crate) fn mov_r_mb(&mut self, dst: u8, base: u8, disp: i32) {
        self.bytes(&[rex(true, dst, 0, base), 0x8B]);
        self.mem_base_disp(dst, base, disp);
    }

    /// `mov dst, [base + index*(1<<scale_log2)]`.
    pub(crate) fn mov_r_mbi(&mut self, dst: u8, base: u8, index: u8, scale_log2: u8) {
        self.bytes(&[rex(true, dst, index, base), 0x8B]);
        let sib = (scale_log2 << 6) | ((index & 7) << 3) | (base & 7);
        if base & 7 == 5 {
            self.bytes(&[modrm(1, dst, 4), sib, 0]);
        } else {
            self.bytes(&[modrm(0, dst, 4), sib]);
        }
    }

    /// `jmp r64`.
    pub(crate) fn jmp_r(&mut self, r: u8) {
        if r >= 8 {
            self.buf.push(rex(false, 0, 0, r));
        }
        self.bytes(&[0xFF, modrm(3, 4, r)]);
    }

    /// `mov [base + disp32], src`.
    pub(crate) fn mov_mb_r(&mut self, base: u8, disp: i32, src: u8) {
        self.bytes(&[rex(true, src, 0, base), 0x89]);
        self.mem_base_disp(src, base, disp);
    }

    /// `mov dword [base + disp32], imm32`.
    pub(crate) fn mov_mb32_imm32(&mut self, base: u8, disp: i32, imm: u32) {
        if base >= 8 {
            self.buf.push(rex(false, 0, 0, base));
        }
        self.buf.push(0xC7);
        self.mem_base_disp(0, base, disp);
        self.u32le(imm);
    }

    /// Stores the u64 `v` at `[base + disp32]`: one `mov qword [..], simm32` when `v` is
    /// a sign-extended 32-bit value (kernel-half and low addresses), else two dword stores.
    pub(crate) fn mov_mb64_imm(&mut self, base: u8, disp: i32, v: u64) {
        match i32::try_from(v as i64) {
            Ok(imm) => {
                self.buf.push(rex(true, 0, 0, base));
                self.buf.push(0xC7);
                self.mem_base_disp(0, base, disp);
                self.u32le(imm as u32);
            }
            Err(_) => {
                self.mov_mb32_imm32(base, disp, v as u32);
                self.mov_mb32_imm32(base, disp + 4, (v >> 32) as u32);
            }
        }
    }

    /// `movzx dst32, src16`.
    pub(crate) fn movzx_r32_r16(&mut self, dst: u8, src: u8) {
        if dst >= 8 || src >= 8 {
            self.buf.push(rex(false, dst, 0, src));
        }
        self.bytes(&[0x0F, 0xB7, modrm(3, dst, src)]);
    }

    /// `push imm32` (sign-extended to 64 bits).
    pub(crate) fn push_imm32(&mut self, imm: i32) {
        self.buf.push(0x68);
        self.bytes(&imm.to_le_bytes());
    }

    /// Pushes a full 64-bit constant without a scratch register or EFLAGS:
    /// `push imm32` then, if needed, `mov dword [rsp+4], hi32`.
    pub(crate) fn push_imm64(&mut self, v: u64) {
        self.push_imm32(v as u32 as i32);
        let sign_extended = i64::from(v as u32 as i32) as u64;
        if sign_extended != v {
            self.mov_mb32_imm32(reg::RSP, 4, (v >> 32) as u32);
        }
    }
}

#[cfg(test)]
mod tests {
    use iced_x86::{Decoder, DecoderOptions, Formatter, NasmFormatter};

    use super::*;

    fn dis(base: u64, b: &[u8]) -> alloc::vec::Vec<alloc::string::String> {
        let mut d = Decoder::with_ip(64, b, base, DecoderOptions::NONE);
        let mut f = NasmFormatter::new();
        let mut out = alloc::vec::Vec::new();
        while d.can_decode() {
            let i = d.decode();
            assert!(!i.is_invalid());
            let mut s = alloc::string::String::new();
            f.format(&i, &mut s);
            out.push(s);
        }
        out
    }

    #[test]
    fn test_glue_encodings_round_trip() {
        let base = 0x7000_0000_0000;
        let mut a = Asm::new(base, base + 0x100);
        a.emit_spill(reg::RCX);
        a.emit_unspill(15);
        a.mov_m64_imm32(base + 0x200, -5);
        a.add_m64_imm(base + 0x208, 1);
        a.cmp_m8_imm8(base + 0x210, 0);
        a.movzx_r32_m8(reg::RCX, base + 0x210);
        a.movzx_r32_r16(reg::RAX, reg::RDX);
        a.lea_r_bi(reg::RAX, reg::RCX, reg::RAX, 3);
        a.lea_r_bi(reg::RCX, reg::RCX, reg::RDX, 0);
        a.lea_r_bi(reg::RAX, reg::R13, reg::RAX, 0);
        a.lea_r_disp(reg::RSP, reg::RSP, 16);
        a.lea_r_disp(reg::RCX, reg::R12, -1);
        a.mov_r_mb(reg::RAX, reg::RAX, 8);
        a.mov_mb_r(reg::RAX, 8, reg::RCX);
        a.mov_mb32_imm32(reg::RSP, 4, 0x1234_5678);
        a.mov_r_imm64(reg::RDX, 0x1122_3344_5566_7788);
        a.mov_r_imm64(9, 0x10);
        a.push_imm64(0x5555_0000_1234);
        a.push_r(reg::R15);
        a.pop_r(reg::RBX);
        a.jmp_m(base + 0x300);
        a.mov_r_r(reg::RDX, reg::R13);
        a.mov_r_mbi(reg::RCX, reg::RDX, reg::RCX, 3);
        a.jmp_r(reg::RCX);
        a.jmp_r(reg::R13);
        a.or_m8_imm8(base + 0x210, 1);
        a.mov_mb64_imm(reg::RAX, 24, 0xffff_ffff_8100_0040);
        a.mov_mb64_imm(reg::RAX, 16, 0x0000_0101_0000_0004);
        let (code, _) = a.finish().expect("no labels");
        let text = dis(base, &code);
        let expect = [
            "mov [rel 700000000108h],rcx",
            "mov r15,[rel 700000000178h]",
            "mov qword [rel 700000000200h],0FFFFFFFFFFFFFFFBh",
            "add qword [rel 700000000208h],1",
            "cmp byte [rel 700000000210h],0",
            "movzx ecx,byte [rel 700000000210h]",
            "movzx eax,dx",
            "lea rax,[rcx+rax*8]",
            "lea rcx,[rcx+rdx]",
            "lea rax,[r13+rax]",
            "lea rsp,[rsp+10h]",
            "lea rcx,[r12-1]",
            "mov rax,[rax+8]",
            "mov [rax+8],rcx",
            "mov dword [rsp+4],12345678h",
            "mov rdx,1122334455667788h",
            "mov r9d,10h",
            "push 1234h",
            "mov dword [rsp+4],5555h",
            "push r15",
            "pop rbx",
            "jmp qword [rel 700000000300h]",
            "mov rdx,r13",
            "mov rcx,[rdx+rcx*8]",
            "jmp rcx",
            "jmp r13",
            "or byte [rel 700000000210h],1",
            "mov qword [rax+18h],0FFFFFFFF81000040h",
            "mov dword [rax+10h],4",
            "mov dword [rax+14h],101h",
        ];
        assert_eq!(text, expect);
    }
}
