//! Port I/O: `in`/`out` of AL, AX or EAX at an imm8 or DX port, and the string forms
//! `ins`/`outs` (with or without `rep`), through the embedder's [`Hardware`] (the image:
//! the ring-0 gate's IN/OUT, so the VMM sees the port exit a native `in`/`out` makes).
//! Permission as a CPU in protected mode checks it (SDM vol. 1, §19.5): allowed at
//! CPL ≤ IOPL; above it only if every bit for the accessed ports in the guest TSS's I/O
//! permission bitmap is clear (`iopl(3)`/`ioperm()` in Linux), else #GP(0). A write that
//! powers off or resets the machine (`kpin_abi::ports::ends_the_run`) stops with
//! [`super::VcpuStop::FinalPortWrite`], so that the engine writes its report first. The
//! engine's own ports (`kpin_abi::ports::engine_only`: the doorbell and the failure port)
//! are absent for the guest: reads return all ones, writes are dropped.
//!
//! A string form moves one element at a time; a fault at a later element keeps the
//! elements done (RCX, RSI/RDI advanced, as a `rep` interrupted there leaves them) and
//! re-executes the instruction, whose first element then takes the fault precisely.

use iced_x86::{Code, Instruction, Mnemonic, OpKind, Register};
use kpin_abi::x86::rflags;

use super::emulate::{gp0, Flow, Step};
use super::events::Event;
use super::hardware::{GuestMmu, Hardware};
use super::segments::Sreg;
use super::{Vcpu, VcpuStop};
use crate::{Gpr, GuestRegs, GuestVirt};

/// Offset of the I/O map base in a 64-bit TSS.
const TSS_IO_MAP_BASE: u64 = 0x66;

impl<H: Hardware, M: GuestMmu> Vcpu<'_, H, M> {
    /// `in`/`out` (not the string forms).
    pub(super) fn port_io(
        &mut self,
        i: &Instruction,
        regs: &mut GuestRegs,
        next: GuestVirt,
    ) -> Step {
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
        self.check_io_permission(port, size)?;
        self.hw.port_site(next.0.wrapping_sub(i.len() as u64));
        let rax = regs.get(Gpr::Rax);
        if i.mnemonic() == Mnemonic::Out {
            // What the `out` writes: AL, AX or EAX.
            let value = (rax & (u64::MAX >> (64 - 8 * u32::from(size)))) as u32;
            if let Some(stop) = self.write_port(port, size, value) {
                return Ok(Flow::Stop(stop));
            }
        } else {
            let v = u64::from(self.read_port(port, size));
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

    /// `ins`/`outs` of bytes, words or dwords at the DX port, `rep` or not.
    pub(super) fn port_string(
        &mut self,
        i: &Instruction,
        regs: &mut GuestRegs,
        next: GuestVirt,
    ) -> Step {
        let port = regs.get(Gpr::Rdx) as u16;
        let size = match i.mnemonic() {
            Mnemonic::Insb | Mnemonic::Outsb => 1u8,
            Mnemonic::Insw | Mnemonic::Outsw => 2,
            _ => 4,
        };
        self.check_io_permission(port, size)?;
        let out = matches!(
            i.mnemonic(),
            Mnemonic::Outsb | Mnemonic::Outsw | Mnemonic::Outsd
        );
        // Address size: RSI/RDI/RCX, or their low halves with a 0x67 prefix.
        let wide = !matches!(
            i.memory_base(),
            Register::ESI | Register::EDI | Register::SI | Register::DI
        );
        let mask = if wide { u64::MAX } else { 0xffff_ffff };
        let rep = i.has_rep_prefix() || i.has_repne_prefix();
        let step = if regs.rflags & rflags::DF != 0 {
            0u64.wrapping_sub(u64::from(size))
        } else {
            u64::from(size)
        };
        let pointer = if out { Gpr::Rsi } else { Gpr::Rdi };
        let seg_base = if out {
            match i.memory_segment() {
                Register::FS => self.segs.sregs[Sreg::Fs as usize].base,
                Register::GS => self.segs.sregs[Sreg::Gs as usize].base,
                _ => 0,
            }
        } else {
            0
        };
        let this = GuestVirt(next.0.wrapping_sub(i.len() as u64));
        self.hw.port_site(this.0);
        let mut done = 0u64;
        loop {
            if rep && regs.get(Gpr::Rcx) & mask == 0 {
                break;
            }
            let offset = regs.get(pointer) & mask;
            let va = seg_base.wrapping_add(offset);
            let n = usize::from(size);
            let element = if out {
                let mut b = [0u8; 4];
                match self.read(va, &mut b[..n]) {
                    Ok(()) => {}
                    Err(e) if done == 0 => return Err(e),
                    Err(_) => return Ok(Flow::Continue(this)),
                }
                let value = u32::from_le_bytes(b);
                if let Some(stop) = self.write_port(port, size, value) {
                    return Ok(Flow::Stop(stop));
                }
                None
            } else {
                Some(self.read_port(port, size).to_le_bytes())
            };
            if let Some(b) = element {
                match self.write(va, &b[..n]) {
                    Ok(()) => {}
                    Err(e) if done == 0 => return Err(e),
                    Err(_) => return Ok(Flow::Continue(this)),
                }
            }
            let advanced = offset.wrapping_add(step) & mask;
            regs.set(pointer, (regs.get(pointer) & !mask) | advanced);
            done += 1;
            if !rep {
                break;
            }
            let rcx = regs.get(Gpr::Rcx);
            regs.set(Gpr::Rcx, (rcx & !mask) | (rcx.wrapping_sub(1) & mask));
        }
        Ok(Flow::Continue(next))
    }

    /// #GP(0) unless the virtual CPL may access ports `port..port + size`: CPL ≤ IOPL,
    /// or every bit for them clear in the guest TSS's I/O permission bitmap (the two
    /// bytes holding them inside the TSS limit).
    fn check_io_permission(&mut self, port: u16, size: u8) -> Result<(), Event> {
        if self.cpl() <= self.iopl {
            return Ok(());
        }
        let tr = self.segs.tr;
        let limit = u64::from(tr.limit);
        if tr.present == 0 || TSS_IO_MAP_BASE + 1 > limit {
            return Err(gp0());
        }
        let mut b = [0u8; 2];
        self.mem
            .read(tr.base.wrapping_add(TSS_IO_MAP_BASE), false, &mut b)
            .map_err(|f| self.guest_fault(f))?;
        let at = u64::from(u16::from_le_bytes(b)) + u64::from(port / 8);
        if at + 1 > limit {
            return Err(gp0());
        }
        self.mem
            .read(tr.base.wrapping_add(at), false, &mut b)
            .map_err(|f| self.guest_fault(f))?;
        let bits = u16::from_le_bytes(b) >> (port % 8);
        if bits & ((1 << size) - 1) != 0 {
            return Err(gp0());
        }
        Ok(())
    }

    /// One port write (counted); the stop for a write that ends the run.
    fn write_port(&mut self, port: u16, size: u8, value: u32) -> Option<VcpuStop> {
        self.stats.outs += 1;
        if kpin_abi::ports::ends_the_run(port, size, value) {
            return Some(VcpuStop::FinalPortWrite { port, size, value });
        }
        if !kpin_abi::ports::engine_only(port) {
            self.hw.port_out(port, size, value);
        }
        None
    }

    /// One port read (counted), all ones from the engine's own ports.
    fn read_port(&mut self, port: u16, size: u8) -> u32 {
        self.stats.ins += 1;
        if kpin_abi::ports::engine_only(port) {
            u32::MAX
        } else {
            self.hw.port_in(port, size)
        }
    }
}
