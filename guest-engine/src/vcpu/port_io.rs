//! Port I/O: `in`/`out` of AL, AX or EAX at an imm8 or DX port, through the embedder's
//! [`Hardware`] (the image: the ring-0 gate's IN/OUT, so the VMM sees the port exit a
//! native `in`/`out` makes). IOPL-sensitive: at CPL > IOPL #GP(0) (the TSS I/O bitmap is
//! not consulted). A write that powers off or resets the machine
//! (`kpin_abi::ports::ends_the_run`) stops with [`super::VcpuStop::FinalPortWrite`], so
//! that the engine writes its report first; string port I/O stops (`emulate.rs`). The
//! engine's own ports (`kpin_abi::ports::engine_only`: the doorbell and the failure port)
//! are absent for the guest: reads return all ones, writes are dropped.

use iced_x86::{Code, Instruction, Mnemonic, OpKind};

use super::emulate::{gp0, Flow, Step};
use super::hardware::{GuestMmu, Hardware};
use super::{Vcpu, VcpuStop};
use crate::{Gpr, GuestRegs, GuestVirt};

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
        let absent = kpin_abi::ports::engine_only(port);
        if i.mnemonic() == Mnemonic::Out {
            self.stats.outs += 1;
            // What the `out` writes: AL, AX or EAX.
            let value = (rax & (u64::MAX >> (64 - 8 * u32::from(size)))) as u32;
            if kpin_abi::ports::ends_the_run(port, size, value) {
                return Ok(Flow::Stop(VcpuStop::FinalPortWrite { port, size, value }));
            }
            if !absent {
                self.hw.port_out(port, size, value);
            }
        } else {
            self.stats.ins += 1;
            let v = if absent {
                u64::from(u32::MAX)
            } else {
                u64::from(self.hw.port_in(port, size))
            };
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
