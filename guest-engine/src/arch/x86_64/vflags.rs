//! `cli`, `sti`, `pushfq` and `popfq` of virtual CPL 0 against the virtual IF and IOPL
//! in the cache context, and the same-selector `iretq` of virtual CPL 0 (the sequences
//! and why they are exact: `crate::vflags`).

use iced_x86::{Code, Decoder, DecoderOptions};

use super::decode::DecodedInsn;
use super::emit::reg;
use super::isolate::ISOLATION_ZONE_END;
use super::mangle::{ExitSpec, Tx};
use crate::arch::x86_64::entry::EXIT_SENSITIVE;
use crate::attention::reason;
use crate::error::EngineError;
use crate::platform::{SensitiveInsn, SensitiveKind};

/// RFLAGS.TF, IF and IOPL.
const TF: u32 = 1 << 8;
const IF: u32 = 1 << 9;
const IOPL: u32 = 3 << 12;
/// RFLAGS bits an inline `iretq` leaves to the emulation: NT, RF, VM, AC, VIF, VIP (and
/// TF, single-stepping).
const IRET_EMULATED: u32 = TF | 1 << 14 | 1 << 16 | 1 << 17 | 1 << 18 | 1 << 19 | 1 << 20;
/// Indices of CS and SS in `CacheContext::sel` (ES, CS, SS, DS, FS, GS).
const SEL_CS: u64 = 1;
const SEL_SS: u64 = 2;
/// `jcc` condition nibbles.
const CC_B: u8 = 0x2;
const CC_NE: u8 = 0x5;
const CC_BE: u8 = 0x6;
const CC_A: u8 = 0x7;
/// Bytes of an `iretq` frame.
const FRAME: u64 = 40;
/// The end of the canonical lower half.
const LOWER_HALF_END: u64 = 1 << 47;

/// Whether the sensitive instruction `s` is `iretq`.
pub(super) fn is_iretq(s: &SensitiveInsn) -> bool {
    s.kind == SensitiveKind::FarTransfer
        && s.len != 0
        && Decoder::with_ip(
            64,
            &s.bytes[..usize::from(s.len)],
            s.pc.0,
            DecoderOptions::NONE,
        )
        .decode()
        .code()
            == Code::Iretq
}

impl Tx<'_> {
    /// The inline form of `d` (a `Class::VirtFlags` instruction).
    pub(super) fn emit_virtual_flags(&mut self, d: &DecodedInsn) -> Result<(), EngineError> {
        let c = self.env.ctx;
        match d.instr.code() {
            Code::Cli => self.a.mov_m64_imm32(c.vif, 0),
            Code::Sti => {
                self.a.mov_m64_imm32(c.vif, IF as i32);
                // An interrupt held back by IF: attention at the next trace entry. The
                // `or` writes the flags, so a `pushfq`/`popfq` pair keeps the guest's, on
                // a one-word stack in the context.
                let done = self.a.new_label();
                self.a.spill_quiet(reg::RCX);
                self.a.mov_r_m(reg::RCX, c.irq_held);
                self.a.jrcxz_label(done);
                self.a.mov_m_r(c.flags_rsp, reg::RSP);
                self.a.lea_r_rip(reg::RSP, c.flags_slot + 8);
                self.a.pushfq();
                self.a.or_m8_imm8(c.attention, reason::INTERRUPT);
                self.a.popfq();
                self.a.mov_r_m(reg::RSP, c.flags_rsp);
                self.a.bind(done);
                self.a.unspill_quiet(reg::RCX);
            }
            Code::Mov_rm16_Sreg | Code::Mov_r32m16_Sreg | Code::Mov_r64m16_Sreg => {
                // The guest's selector from the context (the embedder keeps it there):
                // into the low 16 bits of a 16-bit destination, zero-extended into any
                // other, as the CPU does.
                let sreg = crate::vcpu::sreg_of(d.instr.op1_register())
                    .ok_or(EngineError::Unsupported(crate::GuestVirt(d.instr.ip())))?;
                let at = c.sel + 2 * sreg as u64;
                let r = super::mangle::hw(d.instr.op0_register());
                if d.instr.op0_register().is_gpr16() {
                    self.a.mov_r16_m16(r, at);
                } else {
                    self.a.movzx_r32_m16(r, at);
                }
            }
            Code::Pushfq => {
                // The real flags (IF = 1, IOPL = 0 at CPL 3), then `− IF + vif + viopl`.
                self.a.pushfq();
                self.a.spill_quiet(reg::RAX);
                self.a.spill_quiet(reg::RCX);
                self.a.mov_r_mb(reg::RAX, reg::RSP, 0);
                self.a.mov_r_m(reg::RCX, c.vif);
                self.a.lea_r_bi(reg::RAX, reg::RAX, reg::RCX, 0);
                self.a.mov_r_m(reg::RCX, c.viopl);
                self.a.lea_r_bi(reg::RAX, reg::RAX, reg::RCX, 0);
                self.a.lea_r_disp(reg::RAX, reg::RAX, -(IF as i32));
                self.a.mov_mb_r(reg::RSP, 0, reg::RAX);
                self.a.unspill_quiet(reg::RCX);
                self.a.unspill_quiet(reg::RAX);
            }
            Code::Popfq => {
                // Only the read of the guest's word can fault (RAX is in its slot then);
                // the flags are free until the real `popfq` loads them.
                self.a.emit_spill(reg::RAX);
                self.a.mov_r_mb(reg::RAX, reg::RSP, 0);
                self.a.spill_quiet(reg::RCX);
                self.a.mov_r_r(reg::RCX, reg::RAX);
                self.emit_vif_from_rcx();
                self.a.mov_r_r(reg::RCX, reg::RAX);
                self.a.bytes(&[0x81, 0xE1]); // and ecx, IOPL
                self.a.bytes(&IOPL.to_le_bytes());
                self.a.mov_m_r(c.viopl, reg::RCX);
                self.a.bytes(&[0x48, 0x25]); // and rax, !TF (sign-extended)
                self.a.bytes(&(!TF).to_le_bytes());
                self.a.mov_m_r(c.flags_slot, reg::RAX);
                self.a.lea_r_disp(reg::RAX, reg::RSP, 8);
                self.a.mov_m_r(c.flags_rsp, reg::RAX);
                self.a.unspill_quiet(reg::RCX);
                self.a.lea_r_rip(reg::RSP, c.flags_slot);
                self.a.popfq();
                self.a.mov_r_m(reg::RSP, c.flags_rsp);
                self.a.emit_unspill(reg::RAX);
            }
            _ => {
                return Err(EngineError::Unsupported(crate::addr::GuestVirt(
                    d.instr.ip(),
                )))
            }
        }
        Ok(())
    }

    /// The trace's ending `iretq` `s` (virtual CPL 0, 64-bit), inline when it returns to
    /// the same CS and SS selectors with plain flags: the virtual IF and IOPL from the
    /// popped RFLAGS (attention if that sets IF with an interrupt held), the rest loaded
    /// by a real `popfq`, RSP popped, and the popped RIP looked up as any indirect
    /// branch's target. Anything else — a frame in or across the reserved zone, other
    /// selectors, TF/NT/RF/VM/AC/VIF/VIP set, a non-canonical RIP — takes the sensitive
    /// exit as before, with the guest's flags and registers as they were. The frame is
    /// read with the guest's flags in place, so a fault there is precise.
    pub(super) fn emit_inline_iretq(&mut self, s: SensitiveInsn) {
        let c = self.env.ctx;
        let slow = self.a.new_label();
        self.a.emit_spill(reg::RCX);
        self.a.emit_spill(reg::RDX);
        // The guest's flags to `flags_slot` (flag-free), for the slow path and the reads.
        self.a.mov_m_r(c.flags_rsp, reg::RSP);
        self.a.lea_r_rip(reg::RSP, c.flags_slot + 8);
        self.a.pushfq();
        self.a.mov_r_m(reg::RSP, c.flags_rsp);
        // The frame [RSP, RSP + 40) must lie in the lower half, or above the zone without
        // wrapping: never in engine memory, never non-canonical.
        let in_range = self.a.new_label();
        self.a.mov_r_imm64(reg::RDX, LOWER_HALF_END - FRAME);
        self.a.bytes(&[0x48, 0x39, 0xD4]); // cmp rsp, rdx
        self.a.jcc_label(CC_BE, in_range);
        self.a.mov_r_imm64(reg::RDX, ISOLATION_ZONE_END);
        self.a.bytes(&[0x48, 0x39, 0xD4]); // cmp rsp, rdx
        self.a.jcc_label(CC_B, slow);
        self.a.mov_r_imm64(reg::RDX, FRAME.wrapping_neg());
        self.a.bytes(&[0x48, 0x39, 0xD4]); // cmp rsp, rdx
        self.a.jcc_label(CC_A, slow);
        self.a.bind(in_range);
        self.load_flags_from_slot();
        // Touch both ends of the frame with the guest's flags: a fault is the `iretq`'s.
        self.a.mov_r_mb(reg::RCX, reg::RSP, 0);
        self.a.mov_r_mb(reg::RCX, reg::RSP, 32);
        // From here the flags are the `iretq`'s to set (or the slow path's to restore).
        for (disp, sel) in [(8u8, SEL_CS), (32, SEL_SS)] {
            self.a.bytes(&[0x0F, 0xB7, 0x4C, 0x24, disp]); // movzx ecx, word [rsp + disp]
            self.a.movzx_r32_m16(reg::RDX, c.sel + 2 * sel);
            self.a.bytes(&[0x39, 0xD1]); // cmp ecx, edx
            self.a.jcc_label(CC_NE, slow);
        }
        self.a.mov_r_mb(reg::RCX, reg::RSP, 16);
        self.a.bytes(&[0xF7, 0xC1]); // test ecx, IRET_EMULATED
        self.a.bytes(&IRET_EMULATED.to_le_bytes());
        self.a.jcc_label(CC_NE, slow);
        // RIP canonical: RIP >> 47 (arithmetic) + 1 is 0 or 1.
        self.a.mov_r_mb(reg::RDX, reg::RSP, 0);
        self.a.mov_r_r(reg::RCX, reg::RDX);
        self.a.bytes(&[0x48, 0xC1, 0xF9, 47]); // sar rcx, 47
        self.a.lea_r_disp(reg::RCX, reg::RCX, 1);
        self.a.bytes(&[0x48, 0x83, 0xF9, 0x01]); // cmp rcx, 1
        self.a.jcc_label(CC_A, slow);
        // Committed. It counts as an emulated instruction of this mode.
        if let Some((mode_counter, inline_counter)) = self.env.iret_counters {
            self.a.add_m64_imm(mode_counter, 1);
            self.a.add_m64_imm(inline_counter, 1);
        }
        self.a.mov_r_mb(reg::RCX, reg::RSP, 16);
        self.emit_vif_from_rcx();
        self.a.mov_r_mb(reg::RCX, reg::RSP, 16);
        self.a.bytes(&[0x81, 0xE1]); // and ecx, IOPL
        self.a.bytes(&IOPL.to_le_bytes());
        self.a.mov_m_r(c.viopl, reg::RCX);
        // The rest of RFLAGS by a real `popfq` (at CPL 3 it leaves IF and IOPL alone).
        self.a.mov_r_mb(reg::RCX, reg::RSP, 16);
        self.a.mov_m_r(c.flags_slot, reg::RCX);
        self.load_flags_from_slot();
        self.a.mov_r_mb(reg::RSP, reg::RSP, 24);
        self.emit_ibl();
        // The emulation, as without the inline path.
        self.a.bind(slow);
        self.load_flags_from_slot();
        self.a.emit_unspill(reg::RCX);
        self.a.emit_unspill(reg::RDX);
        self.emit_exit_inline(EXIT_SENSITIVE, ExitSpec::Sensitive(s));
    }

    /// The virtual IF from the RFLAGS word in RCX (which this clobbers, and the flags),
    /// and attention if that sets IF while an interrupt is held.
    fn emit_vif_from_rcx(&mut self) {
        let c = self.env.ctx;
        self.a.bytes(&[0x81, 0xE1]); // and ecx, IF
        self.a.bytes(&IF.to_le_bytes());
        self.a.mov_m_r(c.vif, reg::RCX);
        let no_attention = self.a.new_label();
        self.a.jrcxz_label(no_attention);
        self.a.mov_r_m(reg::RCX, c.irq_held);
        self.a.jrcxz_label(no_attention);
        self.a.or_m8_imm8(c.attention, reason::INTERRUPT);
        self.a.bind(no_attention);
    }

    /// Loads RFLAGS from `flags_slot` (flag-free around the `popfq`; RSP kept).
    fn load_flags_from_slot(&mut self) {
        let c = self.env.ctx;
        self.a.mov_m_r(c.flags_rsp, reg::RSP);
        self.a.lea_r_rip(reg::RSP, c.flags_slot);
        self.a.popfq();
        self.a.mov_r_m(reg::RSP, c.flags_rsp);
    }
}
