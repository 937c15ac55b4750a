//! Port I/O: `in`/`out` of AL, AX or EAX at an imm8 or DX port, through the embedder's
//! [`Hardware`] (the image: the ring-0 gate's IN/OUT, so the VMM sees the port exit a
//! native `in`/`out` makes). IOPL-sensitive: at CPL > IOPL #GP(0) (the TSS I/O bitmap is
//! not consulted). An i8042 reset ends the run as a poweroff
//! ([`super::VcpuStop::FinalPortWrite`]); string port I/O stops (`emulate.rs`).

use iced_x86::{Code, Instruction, Mnemonic, OpKind};

use super::emulate::{gp0, Flow, Step};
use super::hardware::{GuestMmu, Hardware};
use super::{Vcpu, VcpuStop};
use crate::{Gpr, GuestRegs, GuestVirt};

/// Ports whose writes can end the VM (the i8042 command port: 0xfe = reset): the engine
/// writes its final report before passing such a write on.
pub const I8042_CMD: u16 = 0x64;
/// The i8042 command that resets (for the VMM: powers off) the machine.
pub const I8042_RESET: u8 = 0xfe;

impl<H: Hardware, M: GuestMmu> Vcpu<'_, H, M> {
    /// `in`/`out` (not the string forms).
    pub(super) fn port_io(
        &mut self,
        i: &Instruction,
        regs: &mut GuestRegs,
        next: GuestVirt,
    ) -> Step {
        if self.cpl() > self.iopl {
            return Err(gp0());
        }
        let port = if i.op_kind(0) == OpKind::Immediate8 || i.op_kind(1) == OpKind::Immediate8 {
            u16::from(i.immediate8())
        } else {
            regs.get(Gpr::Rdx) as u16
        };
        let size = match i.code() {
            Code::Out_imm8_AL | Code::Out_DX_AL | Code::In_AL_imm8 | Code::In_AL_DX => 1,
            Code::Out_imm8_AX | Code::Out_DX_AX | Code::In_AX_imm8 | Code::In_AX_DX => 2,
            _ => 4,
        };
        let rax = regs.get(Gpr::Rax);
        if i.mnemonic() == Mnemonic::Out {
            self.stats.outs += 1;
            if size == 1 && port == I8042_CMD && rax as u8 == I8042_RESET {
                return Ok(Flow::Stop(VcpuStop::FinalPortWrite {
                    port,
                    value: rax as u8,
                }));
            }
            self.hw.port_out(port, size, rax as u32);
        } else {
            self.stats.ins += 1;
            let v = u64::from(self.hw.port_in(port, size));
            regs.set(
                Gpr::Rax,
                match size {
                    1 => (rax & !0xff) | (v & 0xff),
                    2 => (rax & !0xffff) | (v & 0xffff),
                    // A 32-bit destination zero-extends.
                    _ => v & 0xffff_ffff,
                },
            );
        }
        Ok(Flow::Continue(next))
    }
}
