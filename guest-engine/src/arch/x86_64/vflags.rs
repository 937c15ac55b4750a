//! `cli`, `sti`, `pushfq` and `popfq` of virtual CPL 0 against the virtual IF and IOPL
//! in the cache context (the sequences and why they are exact: `crate::vflags`).

use iced_x86::Code;

use super::decode::DecodedInsn;
use super::emit::reg;
use super::mangle::Tx;
use crate::attention::reason;
use crate::error::EngineError;

/// RFLAGS.TF, IF and IOPL.
const TF: u32 = 1 << 8;
const IF: u32 = 1 << 9;
const IOPL: u32 = 3 << 12;

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
                self.a.bytes(&[0x81, 0xE1]); // and ecx, IF
                self.a.bytes(&IF.to_le_bytes());
                self.a.mov_m_r(c.vif, reg::RCX);
                let no_attention = self.a.new_label();
                self.a.jrcxz_label(no_attention);
                self.a.mov_r_m(reg::RCX, c.irq_held);
                self.a.jrcxz_label(no_attention);
                self.a.or_m8_imm8(c.attention, reason::INTERRUPT);
                self.a.bind(no_attention);
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
}
