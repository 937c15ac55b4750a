//! The isolation check of gathers and scatters (VSIB operands): every enabled lane's
//! address is checked like an ordinary operand's first byte.

use iced_x86::{OpKind, Register};

use super::super::emit::reg;
use super::super::mangle::{hw, Tx};
use super::Fence;
use crate::addr::GuestVirt;
use crate::error::EngineError;

impl Tx<'_> {
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
    pub(super) fn emit_vsib_check(
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
        // of 0, far from the zone (but not from the user fence: below 0 is the top).
        let near_zero =
            !qword && i.memory_base() == Register::None && self.env.fence == Fence::Zone;
        if seg.is_none() && (addr32 || near_zero) {
            return Ok(());
        }
        let index = i.memory_index();
        let width = if qword { 8 } else { 4 };
        let lanes = index.size() / width;
        let ctx = self.env.ctx;
        self.a.mov_m64_imm32(ctx.vsib_lane, 0);
        let store =
            vector_store(index, ctx.vsib_lanes).ok_or(EngineError::Unsupported(GuestVirt(pc)))?;
        self.emit_enc(&store, pc)?;
        let mask = vsib_mask(i);
        let store_mask = match mask {
            LaneMask::Vector(r, _) => vector_store(r, ctx.vsib_mask),
            LaneMask::Opmask(k) => opmask_store(k, ctx.vsib_mask),
            LaneMask::All => None,
        };
        if let Some(store) = store_mask {
            self.emit_enc(&store, pc)?;
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

#[cfg(test)]
mod tests {
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
    fn test_masks_name_the_register_and_element_size_the_gather_uses() {
        use super::LaneMask;
        use iced_x86::{Instruction, MemoryOperand};
        let m = |i| MemoryOperand::with_base_index_scale(Register::RDI, i, 1);
        let vex = |code, d, i, k| Instruction::with3(code, d, m(i), k).unwrap();
        // The mask's elements are the gathered elements, whatever the index width.
        for (g, reg, size) in [
            (
                vex(
                    Code::VEX_Vpgatherdd_ymm_vm32y_ymm,
                    Register::YMM0,
                    Register::YMM1,
                    Register::YMM2,
                ),
                Register::YMM2,
                4,
            ),
            (
                vex(
                    Code::VEX_Vpgatherdq_ymm_vm32x_ymm,
                    Register::YMM0,
                    Register::XMM1,
                    Register::YMM2,
                ),
                Register::YMM2,
                8,
            ),
            (
                vex(
                    Code::VEX_Vpgatherqd_xmm_vm64y_xmm,
                    Register::XMM0,
                    Register::YMM1,
                    Register::XMM3,
                ),
                Register::XMM3,
                4,
            ),
            (
                vex(
                    Code::VEX_Vgatherqpd_xmm_vm64x_xmm,
                    Register::XMM0,
                    Register::XMM1,
                    Register::XMM4,
                ),
                Register::XMM4,
                8,
            ),
        ] {
            match super::vsib_mask(&g) {
                LaneMask::Vector(r, s) => assert_eq!((r, s), (reg, size), "{g:?}"),
                other => panic!("{g:?}: {other:?}"),
            }
        }
        let mut evex = Instruction::with2(
            Code::EVEX_Vpgatherqq_zmm_k1_vm64z,
            Register::ZMM0,
            m(Register::ZMM1),
        )
        .unwrap();
        evex.set_op_mask(Register::K3);
        assert!(matches!(
            super::vsib_mask(&evex),
            LaneMask::Opmask(Register::K3)
        ));
        let mut scatter = Instruction::with2(
            Code::EVEX_Vpscatterdd_vm32z_k1_zmm,
            m(Register::ZMM1),
            Register::ZMM2,
        )
        .unwrap();
        scatter.set_op_mask(Register::K1);
        assert!(matches!(
            super::vsib_mask(&scatter),
            LaneMask::Opmask(Register::K1)
        ));

        // kmovq [rip + target], k3
        let at = 0x1000_0000u64;
        let store = super::opmask_store(Register::K3, at + 0x40).unwrap();
        let mut enc = Encoder::new(64);
        enc.encode(&store, at).unwrap();
        let bytes = enc.take_buffer();
        let i = Decoder::with_ip(64, &bytes, at, DecoderOptions::NONE).decode();
        assert_eq!(i.code(), Code::VEX_Kmovq_m64_kr);
        assert_eq!(i.op1_register(), Register::K3);
        assert_eq!(i.ip_rel_memory_address(), at + 0x40);
    }
}
