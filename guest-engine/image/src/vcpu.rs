//! The virtual CPU, first slice: `guest_engine::Platform` for the sensitive instructions
//! the tiny test guests need, emulated faithfully at the dispatcher:
//!
//! * `out imm8/dx, al` and `in al, imm8/dx` through the ring-0 gate's OUT8/IN8 (port I/O
//!   at CPL 3 faults here, even with IOPL 3), so the VMM sees the same port exit a
//!   native `out` makes — an i8042 reset (`out 0x64, 0xfe`) ends the run as a poweroff;
//! * `mov r64, cr3` (the virtual CR3; writes are not emulated yet);
//! * `lgdt`/`lidt`/`sgdt`/`sidt` on the virtual GDTR/IDTR ([`Vcpu::gdtr`],
//!   [`Vcpu::idtr`]; operands read and written through the guest's page tables; nothing
//!   else uses them yet);
//! * `cli`/`sti`, on the virtual IF ([`Vcpu::vif`]; `pushf`/`popf`, which would show
//!   it, are not emulated yet);
//! * `cpuid`, answered from the attach block's CPUID table (`AttachBlock::cpuid`), so
//!   native and instrumented runs see one CPU.
//!
//! Everything else (16/32-bit port I/O, `hlt` — no interrupt delivery exists yet to wake
//! a halted guest —, CR writes, MSR and descriptor-table instructions, `pushf`/`popf`,
//! `iretq`, …) is refused: [`Vcpu::unsupported`] names the instruction and its RIP and
//! the engine stops with a failure (never guessing what the guest meant).

use core::cell::Cell;

use guest_engine::{Emulation, Gpr, GuestRegs, GuestVirt, Platform, SensitiveInsn, SensitiveKind};
use iced_x86::{Code, Decoder, DecoderOptions, Instruction, Mnemonic, Register};
use kpin_abi::attach::AttachBlock;

use crate::gate;
use crate::guest_mem::{PhysmapMemory, MODE_KERNEL};
use crate::layout::RFLAGS_IF;

/// Ports whose writes can end the VM (the i8042 command port: 0xfe = reset): the engine
/// writes its final report before passing such a write on.
pub const I8042_CMD: u16 = 0x64;
/// The i8042 command that resets (for the VMM: powers off) the machine.
pub const I8042_RESET: u8 = 0xfe;

/// Why the virtual CPU stopped.
#[derive(Clone, Copy)]
pub struct Unsupported {
    /// Its mnemonic (iced-x86's name), `None` if it does not decode.
    pub mnemonic: Option<Mnemonic>,
    /// What is missing, in words.
    pub why: &'static str,
}

/// The virtual CPU's state and counters.
pub struct Vcpu<'a> {
    block: &'a AttachBlock,
    /// Guest CR3 (shared with the guest-memory walker).
    pub cr3: &'a Cell<u64>,
    /// Emulated instructions, by kind: port writes, port reads, CPUIDs.
    pub outs: u64,
    /// Port reads emulated.
    pub ins: u64,
    /// CPUIDs emulated.
    pub cpuids: u64,
    /// The virtual RFLAGS.IF (the real IF stays 1 while guest code runs; `cli`/`sti`
    /// change only this; nothing delivers interrupts to the guest yet).
    pub vif: bool,
    /// The virtual GDTR (loaded by `lgdt`; the engine's own GDT is what the CPU uses).
    pub gdtr: DescriptorTable,
    /// The virtual IDTR (loaded by `lidt`; nothing delivers through it yet).
    pub idtr: DescriptorTable,
    /// Set when emulation stopped.
    pub unsupported: Option<Unsupported>,
    /// A port write that may end the VM (see [`I8042_CMD`]), left to the caller: the
    /// emulation stops so that the engine can write its report first, then performs it.
    pub final_write: Option<(u16, u8)>,
}

impl<'a> Vcpu<'a> {
    /// A virtual CPU for the guest in `block`.
    pub fn new(block: &'a AttachBlock, cr3: &'a Cell<u64>) -> Self {
        Self {
            block,
            cr3,
            outs: 0,
            ins: 0,
            cpuids: 0,
            vif: block.regs.rflags & RFLAGS_IF != 0,
            gdtr: DescriptorTable {
                base: block.sregs.gdt.base,
                limit: block.sregs.gdt.limit,
            },
            idtr: DescriptorTable {
                base: block.sregs.idt.base,
                limit: block.sregs.idt.limit,
            },
            unsupported: None,
            final_write: None,
        }
    }

    fn stop(&mut self, mnemonic: Option<Mnemonic>, why: &'static str) -> Emulation {
        self.unsupported = Some(Unsupported { mnemonic, why });
        Emulation::Stop
    }
}

/// A virtual GDTR or IDTR.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DescriptorTable {
    /// Linear base.
    pub base: u64,
    /// Limit.
    pub limit: u16,
}

impl Vcpu<'_> {
    /// The linear address of `i`'s memory operand (flat segments; `None` with an FS/GS
    /// override, whose bases are not virtualised yet).
    fn data_address(&self, i: &Instruction, regs: &GuestRegs) -> Option<u64> {
        i.virtual_address(0, 0, |reg, _, _| {
            if reg.is_segment_register() {
                return match reg {
                    Register::FS | Register::GS => None,
                    _ => Some(0),
                };
            }
            let full = reg.full_register();
            let n = Gpr::from_number(full.number() as u8)?;
            if !full.is_gpr64() {
                return None;
            }
            let v = regs.get(n);
            Some(if reg.is_gpr32() { v & 0xffff_ffff } else { v })
        })
    }
}

fn set_low8(regs: &mut GuestRegs, r: Gpr, v: u8) {
    regs.set(r, (regs.get(r) & !0xff) | u64::from(v));
}

impl Platform for Vcpu<'_> {
    fn emulate(&mut self, insn: &SensitiveInsn, regs: &mut GuestRegs) -> Emulation {
        let len = usize::from(insn.len).min(insn.bytes.len());
        let mut d = Decoder::with_ip(64, &insn.bytes[..len], insn.pc.0, DecoderOptions::NONE);
        let i = d.decode();
        if len == 0 || i.is_invalid() {
            return self.stop(None, "the bytes do not decode");
        }
        let next = GuestVirt(insn.pc.0.wrapping_add(len as u64));
        let dx = regs.get(Gpr::Rdx) as u16;
        let al = regs.get(Gpr::Rax) as u8;
        match i.code() {
            Code::Out_imm8_AL | Code::Out_DX_AL => {
                let port = if i.code() == Code::Out_DX_AL {
                    dx
                } else {
                    u16::from(i.immediate8())
                };
                if port == I8042_CMD && al == I8042_RESET {
                    self.final_write = Some((port, al));
                    self.outs += 1;
                    return Emulation::Stop;
                }
                gate::out8(port, al);
                self.outs += 1;
                Emulation::Continue(next)
            }
            Code::In_AL_imm8 | Code::In_AL_DX => {
                let port = if i.code() == Code::In_AL_DX {
                    dx
                } else {
                    u16::from(i.immediate8())
                };
                set_low8(regs, Gpr::Rax, gate::in8(port));
                self.ins += 1;
                Emulation::Continue(next)
            }
            Code::Cpuid => {
                let [a, b, c, d] = self
                    .block
                    .cpuid(regs.get(Gpr::Rax) as u32, regs.get(Gpr::Rcx) as u32);
                regs.set(Gpr::Rax, u64::from(a));
                regs.set(Gpr::Rbx, u64::from(b));
                regs.set(Gpr::Rcx, u64::from(c));
                regs.set(Gpr::Rdx, u64::from(d));
                self.cpuids += 1;
                Emulation::Continue(next)
            }
            Code::Mov_r64_cr if i.op1_register() == Register::CR3 => {
                match Gpr::from_number(i.op0_register().number() as u8) {
                    Some(r) if i.op0_register().is_gpr64() => {
                        regs.set(r, self.cr3.get());
                        Emulation::Continue(next)
                    }
                    _ => self.stop(Some(i.mnemonic()), "unexpected operand"),
                }
            }
            Code::Cli => {
                self.vif = false;
                Emulation::Continue(next)
            }
            Code::Sti => {
                self.vif = true;
                Emulation::Continue(next)
            }
            Code::Lgdt_m1664 | Code::Lidt_m1664 => {
                let mut bytes = [0u8; 10];
                let ok = self.data_address(&i, regs).is_some_and(|ea| {
                    PhysmapMemory::new(self.block, self.cr3).read_virt(ea, MODE_KERNEL, &mut bytes)
                });
                if !ok {
                    return self.stop(
                        Some(i.mnemonic()),
                        "its operand is not readable (or uses FS/GS): exception delivery to the guest is not implemented",
                    );
                }
                let limit = u16::from_le_bytes([bytes[0], bytes[1]]);
                let mut base = [0u8; 8];
                base.copy_from_slice(&bytes[2..]);
                let table = DescriptorTable {
                    base: u64::from_le_bytes(base),
                    limit,
                };
                if i.code() == Code::Lgdt_m1664 {
                    self.gdtr = table;
                } else {
                    self.idtr = table;
                }
                Emulation::Continue(next)
            }
            Code::Sgdt_m1664 | Code::Sidt_m1664 => {
                let t = if i.code() == Code::Sgdt_m1664 {
                    self.gdtr
                } else {
                    self.idtr
                };
                let mut bytes = [0u8; 10];
                bytes[..2].copy_from_slice(&t.limit.to_le_bytes());
                bytes[2..].copy_from_slice(&t.base.to_le_bytes());
                let ok = self.data_address(&i, regs).is_some_and(|ea| {
                    PhysmapMemory::new(self.block, self.cr3).write_virt(ea, MODE_KERNEL, &bytes)
                });
                if !ok {
                    return self.stop(
                        Some(i.mnemonic()),
                        "its operand is not writable (or uses FS/GS): exception delivery to the guest is not implemented",
                    );
                }
                Emulation::Continue(next)
            }
            Code::Hlt if !self.vif => self.stop(
                Some(i.mnemonic()),
                "hlt with interrupts disabled: the guest halts for good",
            ),
            Code::Hlt => self.stop(
                Some(i.mnemonic()),
                "hlt: interrupt delivery to the guest is not implemented, nothing could wake it",
            ),
            _ => {
                let why = match insn.kind {
                    SensitiveKind::PortIo => "only 8-bit in/out to AL are emulated",
                    _ => "not emulated by the virtual CPU yet",
                };
                self.stop(Some(i.mnemonic()), why)
            }
        }
    }
}
