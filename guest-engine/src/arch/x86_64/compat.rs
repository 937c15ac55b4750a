//! 32-bit guest code (`Mode::compat`: a CPL-3 code segment with L = 0, D = 1, as a 32-bit
//! process under a 64-bit kernel runs) translated into 64-bit code for the code cache.
//!
//! Most 32-bit instructions mean the same in 64-bit mode once re-encoded: iced-x86 gives
//! every memory operand with 32-bit registers (or an absolute address) the 0x67 prefix,
//! so addresses are computed and wrap in 32 bits as in compatibility mode, and a 32-bit
//! register write zero-extends, which code that cannot see the upper halves cannot tell.
//! What 64-bit mode lacks or does differently is rewritten here:
//!
//! * `inc`/`dec` r16/r32 (0x40–0x4f are REX prefixes in 64-bit mode): their ModRM forms;
//! * the stack: `push`/`pop` of registers, immediates and memory, `leave`, `call` and
//!   `ret` move 4 bytes at ESP (`mov [esp-4], …` then `lea esp, [esp-4]`, loads before
//!   ESP moves, so that a fault leaves ESP as before the instruction);
//! * indirect targets are loaded 32 bits wide; `loop`/`jecxz` count in ECX (0x67).
//!
//! Anything else that does not encode in 64-bit mode (`pusha`, `enter`, BCD adjustments,
//! `bound`, `les`, 16-bit addressing…) is [`untranslatable`]: the trace ends there as at a
//! sensitive instruction, and the virtual CPU emulates it or raises #UD. Segment bases
//! other than FS/GS are taken as 0 (Linux's flat segments); an FS/GS-relative operand's
//! linear address is computed into R9 first, so that it wraps at 4 GiB as the CPU's does
//! (i386 TLS variables lie below the thread pointer, at offsets near 4 GiB).

use iced_x86::{Code, Encoder, Instruction, MemoryOperand, OpKind, Register};

use super::decode::DecodedInsn;
use super::emit::reg;
use super::mangle::Tx;
use crate::addr::GuestVirt;
use crate::error::EngineError;

/// The scratch register of the stack rewrites: 32-bit code cannot name R8.
const SCRATCH: Register = Register::R8D;

/// Whether the 32-bit instruction `i` has no translation here (see the module header).
pub(crate) fn untranslatable(i: &Instruction) -> bool {
    if rewritten(i) {
        return false;
    }
    // `loop`/`jecxz` count in ECX (their 0x67 forms, in CX, have no 64-bit counterpart).
    if i.is_loop() || i.is_loopcc() || i.is_jcx_short() {
        return !matches!(
            i.code(),
            Code::Loop_rel8_32_ECX
                | Code::Loope_rel8_32_ECX
                | Code::Loopne_rel8_32_ECX
                | Code::Jecxz_rel8_32
        );
    }
    // Near transfers with a 16-bit operand size (IP truncated, 2-byte return addresses).
    if i.op0_kind() == OpKind::NearBranch16
        || matches!(
            i.code(),
            Code::Call_rm16 | Code::Jmp_rm16 | Code::Retnw | Code::Retnw_imm16
        )
    {
        return true;
    }
    // A string instruction reading through FS/GS: its address would not wrap.
    let string_source = matches!(i.op0_kind(), OpKind::MemorySegESI | OpKind::MemorySegEDI)
        || matches!(i.op1_kind(), OpKind::MemorySegESI);
    if string_source && matches!(i.memory_segment(), Register::FS | Register::GS) {
        return true;
    }
    // An FS/GS-relative operand of a plain instruction becomes [r9]
    // (`Tx::compat_linear_r9`): that form must encode too (the moffs forms become their
    // ModRM twins; indirect branches load their target themselves).
    let plain = i.flow_control() == iced_x86::FlowControl::Next;
    if plain && segment_relative(i) && moffs_twin(i.code()).is_none() {
        let mut j = *i;
        j.set_memory_base(Register::R9);
        j.set_memory_index(Register::None);
        j.set_memory_displacement64(0);
        j.set_memory_displ_size(0);
        j.set_segment_prefix(Register::None);
        if Encoder::new(64).encode(&j, j.ip()).is_err() {
            return true;
        }
    }
    use iced_x86::FlowControl as F;
    match i.flow_control() {
        // Near branches, calls and returns become exits and lookups (`mangle.rs`).
        F::ConditionalBranch
        | F::UnconditionalBranch
        | F::IndirectBranch
        | F::Call
        | F::IndirectCall
        | F::Return => false,
        _ => Encoder::new(64).encode(i, i.ip()).is_err(),
    }
}

/// The 0x80 form of a 32-bit-only 0x82 opcode (the same group, invalid in 64-bit mode).
fn group82_twin(code: Code) -> Option<Code> {
    Some(match code {
        Code::Add_rm8_imm8_82 => Code::Add_rm8_imm8,
        Code::Or_rm8_imm8_82 => Code::Or_rm8_imm8,
        Code::Adc_rm8_imm8_82 => Code::Adc_rm8_imm8,
        Code::Sbb_rm8_imm8_82 => Code::Sbb_rm8_imm8,
        Code::And_rm8_imm8_82 => Code::And_rm8_imm8,
        Code::Sub_rm8_imm8_82 => Code::Sub_rm8_imm8,
        Code::Xor_rm8_imm8_82 => Code::Xor_rm8_imm8,
        Code::Cmp_rm8_imm8_82 => Code::Cmp_rm8_imm8,
        _ => return None,
    })
}

/// The instructions [`Tx::compat_plain`] rewrites rather than re-encodes.
fn rewritten(i: &Instruction) -> bool {
    (group82_twin(i.code()).is_some() && !segment_relative(i))
        || matches!(
            i.code(),
            Code::Inc_r16
                | Code::Inc_r32
                | Code::Dec_r16
                | Code::Dec_r32
                | Code::Push_r32
                | Code::Pushd_imm32
                | Code::Pushd_imm8
                | Code::Push_rm32
                | Code::Pop_r32
                | Code::Pop_rm32
                | Code::Leaved
        )
}

/// Whether `i` has a memory operand relative to FS or GS (whose bases are not 0).
fn segment_relative(i: &Instruction) -> bool {
    (0..i.op_count()).any(|k| i.op_kind(k) == OpKind::Memory)
        && matches!(i.memory_segment(), Register::FS | Register::GS)
}

/// The ModRM twin of a `mov` between AL/AX/EAX and an absolute offset (opcodes A0–A3),
/// and whether it loads.
fn moffs_twin(code: Code) -> Option<(Code, bool)> {
    Some(match code {
        Code::Mov_AL_moffs8 => (Code::Mov_r8_rm8, true),
        Code::Mov_AX_moffs16 => (Code::Mov_r16_rm16, true),
        Code::Mov_EAX_moffs32 => (Code::Mov_r32_rm32, true),
        Code::Mov_moffs8_AL => (Code::Mov_rm8_r8, false),
        Code::Mov_moffs16_AX => (Code::Mov_rm16_r16, false),
        Code::Mov_moffs32_EAX => (Code::Mov_rm32_r32, false),
        _ => return None,
    })
}

/// `[r9]`: where [`Tx::compat_linear_r9`] left a segment-relative operand.
fn at_r9() -> MemoryOperand {
    MemoryOperand::with_base(Register::R9)
}

/// `[esp + disp]`.
fn esp_at(disp: i64) -> MemoryOperand {
    MemoryOperand::with_base_displ(Register::ESP, disp)
}

/// `i`'s memory operand, its displacement moved by `delta` (`pop [esp+x]` addresses with
/// ESP after the pop).
fn memory_operand(i: &Instruction, delta: i64) -> MemoryOperand {
    let disp = i.memory_displacement32() as i32 as i64 + delta;
    MemoryOperand::new(
        i.memory_base(),
        i.memory_index(),
        i.memory_index_scale(),
        disp,
        if disp == 0 { 0 } else { 4 },
        false,
        i.segment_prefix(),
    )
}

impl Tx<'_> {
    /// Emits `i` (an instruction built here) encoded for 64-bit mode.
    fn emit_built(
        &mut self,
        i: Result<Instruction, iced_x86::IcedError>,
        pc: u64,
    ) -> Result<(), EngineError> {
        let i = i.map_err(|_| EngineError::Encode(GuestVirt(pc)))?;
        self.emit_enc(&i, pc)?;
        Ok(())
    }

    /// `lea esp, [esp + delta]`: moves the 32-bit stack pointer, flags untouched.
    fn compat_move_esp(&mut self, delta: i64, pc: u64) -> Result<(), EngineError> {
        self.emit_built(
            Instruction::with2(Code::Lea_r32_m, Register::ESP, esp_at(delta)),
            pc,
        )
    }

    /// Pushes the 32-bit immediate `value`.
    pub(super) fn compat_push_imm(&mut self, value: u32, pc: u64) -> Result<(), EngineError> {
        self.emit_built(
            Instruction::with2(Code::Mov_rm32_imm32, esp_at(-4), value),
            pc,
        )?;
        self.compat_move_esp(-4, pc)
    }

    /// A 32-bit instruction that does not transfer control (`Class::Plain`): re-encoded
    /// for 64-bit mode, or rewritten where 64-bit mode lacks it or does it differently
    /// (see the module header).
    pub(super) fn compat_plain(&mut self, d: &DecodedInsn) -> Result<(), EngineError> {
        let i = &d.instr;
        let pc = i.ip();
        if let Some(code) = group82_twin(i.code()) {
            // Same operands, the 0x80 opcode (`untranslatable` leaves FS/GS operands of
            // the rare 0x82 forms to the virtual CPU's #UD).
            let mut j = *i;
            j.set_code(code);
            return self.emit_encoded(&j, pc);
        }
        match i.code() {
            Code::Inc_r16 | Code::Inc_r32 | Code::Dec_r16 | Code::Dec_r32 => {
                self.compat_inc_dec(i, pc)
            }
            Code::Push_r32 | Code::Push_rm32 if i.op0_kind() == OpKind::Register => {
                // `push esp` stores ESP as it was before the push, as here.
                self.emit_built(
                    Instruction::with2(Code::Mov_rm32_r32, esp_at(-4), i.op0_register()),
                    pc,
                )?;
                self.compat_move_esp(-4, pc)
            }
            Code::Pushd_imm32 | Code::Pushd_imm8 => self.compat_push_imm(i.immediate(0) as u32, pc),
            Code::Push_rm32 => self.compat_push_memory(i, pc),
            Code::Pop_r32 | Code::Pop_rm32
                if i.op0_kind() == OpKind::Register && i.op0_register() == Register::ESP =>
            {
                self.emit_built(
                    Instruction::with2(Code::Mov_r32_rm32, Register::ESP, esp_at(0)),
                    pc,
                )
            }
            Code::Pop_r32 | Code::Pop_rm32 if i.op0_kind() == OpKind::Register => {
                self.emit_built(
                    Instruction::with2(Code::Mov_r32_rm32, i.op0_register(), esp_at(0)),
                    pc,
                )?;
                self.compat_move_esp(4, pc)
            }
            Code::Pop_rm32 => self.compat_pop_memory(i, pc),
            Code::Leaved => self.compat_leave(pc),
            _ if segment_relative(i) => self.compat_segment_relative(i, pc),
            _ => self.emit_encoded(i, pc),
        }
    }

    /// Emits `i` (the guest's, or a copy of it changed here) encoded for 64-bit mode.
    fn emit_encoded(&mut self, i: &Instruction, pc: u64) -> Result<(), EngineError> {
        self.emit_enc(i, pc)?;
        Ok(())
    }

    /// `inc`/`dec` r16/r32: their ModRM forms (0x40–0x4f are REX prefixes in 64-bit
    /// mode).
    fn compat_inc_dec(&mut self, i: &Instruction, pc: u64) -> Result<(), EngineError> {
        let code = match i.code() {
            Code::Inc_r16 => Code::Inc_rm16,
            Code::Inc_r32 => Code::Inc_rm32,
            Code::Dec_r16 => Code::Dec_rm16,
            _ => Code::Dec_rm32,
        };
        self.emit_built(Instruction::with1(code, i.op0_register()), pc)
    }

    /// `push m32`: the load into R8 first, so that a fault leaves ESP unmoved.
    fn compat_push_memory(&mut self, i: &Instruction, pc: u64) -> Result<(), EngineError> {
        self.a.emit_spill(reg::R8);
        if segment_relative(i) {
            self.compat_linear_r9(i, 0)?;
            self.emit_built(Instruction::with2(Code::Mov_r32_rm32, SCRATCH, at_r9()), pc)?;
            self.compat_linear_done();
        } else {
            self.emit_built(
                Instruction::with2(Code::Mov_r32_rm32, SCRATCH, memory_operand(i, 0)),
                pc,
            )?;
        }
        self.emit_built(
            Instruction::with2(Code::Mov_rm32_r32, esp_at(-4), SCRATCH),
            pc,
        )?;
        self.compat_move_esp(-4, pc)?;
        self.a.emit_unspill(reg::R8);
        Ok(())
    }

    /// `pop m32`: through R8; an ESP-based operand addresses with ESP after the pop.
    fn compat_pop_memory(&mut self, i: &Instruction, pc: u64) -> Result<(), EngineError> {
        let delta = if i.memory_base() == Register::ESP {
            4
        } else {
            0
        };
        self.a.emit_spill(reg::R8);
        self.emit_built(
            Instruction::with2(Code::Mov_r32_rm32, SCRATCH, esp_at(0)),
            pc,
        )?;
        if segment_relative(i) {
            self.compat_linear_r9(i, delta)?;
            self.emit_built(Instruction::with2(Code::Mov_rm32_r32, at_r9(), SCRATCH), pc)?;
            self.compat_linear_done();
        } else {
            self.emit_built(
                Instruction::with2(Code::Mov_rm32_r32, memory_operand(i, delta), SCRATCH),
                pc,
            )?;
        }
        self.compat_move_esp(4, pc)?;
        self.a.emit_unspill(reg::R8);
        Ok(())
    }

    /// `leave` (32-bit): EBP ← [EBP], ESP ← EBP + 4, the load first.
    fn compat_leave(&mut self, pc: u64) -> Result<(), EngineError> {
        self.a.emit_spill(reg::R8);
        self.emit_built(
            Instruction::with2(
                Code::Mov_r32_rm32,
                SCRATCH,
                MemoryOperand::with_base(Register::EBP),
            ),
            pc,
        )?;
        self.emit_built(
            Instruction::with2(
                Code::Lea_r32_m,
                Register::ESP,
                MemoryOperand::with_base_displ(Register::EBP, 4),
            ),
            pc,
        )?;
        self.emit_built(
            Instruction::with2(Code::Mov_r32_rm32, Register::EBP, SCRATCH),
            pc,
        )?;
        self.a.emit_unspill(reg::R8);
        Ok(())
    }

    /// An instruction with an FS/GS-relative memory operand: the linear address wraps at
    /// 4 GiB as in compatibility mode, so it is computed into R9 and the instruction then
    /// uses [r9].
    fn compat_segment_relative(&mut self, i: &Instruction, pc: u64) -> Result<(), EngineError> {
        self.compat_linear_r9(i, 0)?;
        // The moffs forms have no ModRM: their ModRM twins.
        if let Some((code, load)) = moffs_twin(i.code()) {
            let r = if load {
                i.op0_register()
            } else {
                i.op1_register()
            };
            let j = if load {
                Instruction::with2(code, r, at_r9())
            } else {
                Instruction::with2(code, at_r9(), r)
            };
            self.emit_built(j, pc)?;
            self.compat_linear_done();
            return Ok(());
        }
        let mut j = *i;
        j.set_memory_base(Register::R9);
        j.set_memory_index(Register::None);
        j.set_memory_index_scale(1);
        j.set_memory_displacement64(0);
        j.set_memory_displ_size(0);
        j.set_segment_prefix(Register::None);
        self.emit_encoded(&j, pc)?;
        self.compat_linear_done();
        Ok(())
    }

    /// R9 ← the 32-bit linear address of `i`'s FS/GS-relative memory operand (its
    /// displacement moved by `delta`): `(base + offset) mod 2^32`, which 64-bit mode would
    /// not wrap (a TLS variable below the thread pointer has an offset near 4 GiB). R9
    /// and R10 are spilled until [`Tx::compat_linear_done`]; flags untouched.
    fn compat_linear_r9(&mut self, i: &Instruction, delta: i64) -> Result<(), EngineError> {
        let pc = i.ip();
        self.a.emit_spill(reg::R9);
        self.a.emit_spill(reg::R10);
        let mut offset = memory_operand(i, delta);
        offset.segment_prefix = Register::None;
        self.emit_built(
            Instruction::with2(Code::Lea_r32_m, Register::R9D, offset),
            pc,
        )?;
        // rdfsbase r10 / rdgsbase r10 (the hardware bases are the guest's).
        let modrm = if i.memory_segment() == Register::FS {
            0xC2
        } else {
            0xCA
        };
        self.a.bytes(&[0xF3, 0x49, 0x0F, 0xAE, modrm]);
        let sum = MemoryOperand::with_base_index(Register::R9D, Register::R10D);
        self.emit_built(Instruction::with2(Code::Lea_r32_m, Register::R9D, sum), pc)
    }

    /// Restores R10 and R9 after [`Tx::compat_linear_r9`].
    fn compat_linear_done(&mut self) {
        self.a.emit_unspill(reg::R10);
        self.a.emit_unspill(reg::R9);
    }

    /// Loads the target of a 32-bit `jmp`/`call r/m32` into EDX (RDX, RCX spilled).
    pub(super) fn compat_load_target_edx(&mut self, i: &Instruction) -> Result<(), EngineError> {
        let pc = i.ip();
        match i.op0_kind() {
            OpKind::Register => self.emit_built(
                Instruction::with2(Code::Mov_r32_rm32, Register::EDX, i.op0_register()),
                pc,
            ),
            OpKind::Memory if segment_relative(i) => {
                // `call *%gs:0x10` (glibc's system calls through the vDSO)
                self.compat_linear_r9(i, 0)?;
                self.emit_built(
                    Instruction::with2(Code::Mov_r32_rm32, Register::EDX, at_r9()),
                    pc,
                )?;
                self.compat_linear_done();
                Ok(())
            }
            OpKind::Memory => self.emit_built(
                Instruction::with2(Code::Mov_r32_rm32, Register::EDX, memory_operand(i, 0)),
                pc,
            ),
            _ => Err(EngineError::Unsupported(GuestVirt(pc))),
        }
    }

    /// `ret [n]` in 32-bit code: EDX ← [ESP], ESP += 4 + n (RDX, RCX spilled).
    pub(super) fn compat_pop_return(&mut self, pop: u16, pc: u64) -> Result<(), EngineError> {
        self.emit_built(
            Instruction::with2(Code::Mov_r32_rm32, Register::EDX, esp_at(0)),
            pc,
        )?;
        self.compat_move_esp(4 + i64::from(pop), pc)
    }
}
