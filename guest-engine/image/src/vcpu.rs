//! The virtual CPU, first slice: `guest_engine::Platform` for the sensitive instructions
//! the tiny test guests need, emulated faithfully at the dispatcher:
//!
//! * `out imm8/dx, al` and `in al, imm8/dx` through the ring-0 gate's OUT8/IN8 (port I/O
//!   at CPL 3 faults here, even with IOPL 3), so the VMM sees the same port exit a
//!   native `out` makes — an i8042 reset (`out 0x64, 0xfe`) ends the run as a poweroff;
//! * control registers and the TLB, on the shadow MMU (`shadow.rs`): `mov r64, cr0/cr3/cr4`
//!   (the virtual values), `mov cr3, r64` (the guest switches address spaces: new shadow
//!   root in the real CR3, every VA → PA mapping the translator holds dropped), `mov
//!   cr0/cr4, r64` that change only CR0.WP, CR4.PGE or CR4.SMEP (the bits that change
//!   translations and nothing else the hardware would enforce at CPL 3), `invlpg m`;
//! * `lgdt`/`lidt`/`sgdt`/`sidt` on the virtual GDTR/IDTR ([`Vcpu::gdtr`],
//!   [`Vcpu::idtr`]; operands read and written through the guest's page tables; nothing
//!   else uses them yet);
//! * `cli`/`sti`, on the virtual IF ([`Vcpu::vif`]; `pushf`/`popf`, which would show
//!   it, are not emulated yet);
//! * `cpuid`, answered from the attach block's CPUID table (`AttachBlock::cpuid`), so
//!   native and instrumented runs see one CPU;
//! * segment state ([`Vcpu::segs`], see `segments.rs`): `mov Sreg, r/m16` (DS/ES/SS/FS/
//!   GS), `mov r/m16, Sreg`, `push`/`pop fs/gs`, `ltr`/`str`, `lldt`/`sldt` and
//!   same-privilege `retf` (16/32/64-bit operand size, with or without an immediate) to a
//!   64-bit code segment, all on virtual selectors and descriptor caches loaded from the
//!   virtual GDTR; a load that would fault stops naming the exception and selector. An
//!   FS/GS load that changes the base stops too (the hardware base the translated code
//!   uses is not switched yet).
//!
//! Everything else (16/32-bit port I/O, `hlt` — no interrupt delivery exists yet to wake
//! a halted guest —, other CR writes, MSRs, `pushf`/`popf`,
//! `iretq`, far `jmp`/`call`, privilege-changing far returns, …) is refused: [`Vcpu::unsupported`] names the instruction and its RIP and
//! the engine stops with a failure (never guessing what the guest meant).
//!
//! The translator must hear about some emulations' effects (a CR3 write drops mappings, a
//! write into a code frame drops its traces) before guest code runs again, and only the
//! run loop holds the `Engine`: when the shadow has such work after an emulation,
//! `emulate` stops with [`Vcpu::resume`] set, and the run loop does the work and resumes
//! there. A shadow-MMU failure stops the run the same way (the run loop reports it).

use core::cell::RefCell;

use guest_engine::shadow_mmu::ShadowError;
use guest_engine::{
    Emulation, Gpr, GuestRegs, GuestVirt, Platform, SegBase, SensitiveInsn, SensitiveKind,
};
use iced_x86::{Code, Decoder, DecoderOptions, Instruction, Mnemonic, OpKind, Register};
use kpin_abi::attach::AttachBlock;

use crate::gate;
use crate::guest_mem::{PhysmapMemory, MODE_KERNEL};
use crate::layout::RFLAGS_IF;
use crate::segments::{GuestFault, Segments, Sreg};
use crate::shadow::{paging_control, Shadow, CR0_WP, CR4_PGE, CR4_SMEP};

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
    /// The exception the instruction would raise in the guest, if that is why.
    pub fault: Option<GuestFault>,
}

/// The virtual CPU's state and counters.
pub struct Vcpu<'a> {
    block: &'a AttachBlock,
    /// The shadow MMU (shared with guest memory and the run loop); it holds the virtual
    /// CR3 ([`Vcpu::cr3`]).
    shadow: &'a RefCell<Shadow>,
    /// The virtual CR0.
    pub cr0: u64,
    /// The virtual CR4.
    pub cr4: u64,
    /// The virtual EFER (after changing it, call [`Vcpu::update_paging_control`]).
    pub efer: u64,
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
    /// Guest selectors and descriptor caches (see [`Segments`]).
    pub segs: Segments,
    /// Set when emulation stopped.
    pub unsupported: Option<Unsupported>,
    /// A port write that may end the VM (see [`I8042_CMD`]), left to the caller: the
    /// emulation stops so that the engine can write its report first, then performs it.
    pub final_write: Option<(u16, u8)>,
    /// Where the guest continues after an emulation that stopped only so that the run
    /// loop could do the shadow's `EngineWork` (see the module header).
    pub resume: Option<GuestVirt>,
}

impl<'a> Vcpu<'a> {
    /// A virtual CPU for the guest in `block`.
    pub fn new(block: &'a AttachBlock, shadow: &'a RefCell<Shadow>) -> Self {
        Self {
            block,
            shadow,
            cr0: block.sregs.cr0,
            cr4: block.sregs.cr4,
            efer: block.sregs.efer,
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
            segs: Segments::new(&block.sregs),
            unsupported: None,
            final_write: None,
            resume: None,
        }
    }

    /// The virtual CR3.
    pub fn cr3(&self) -> u64 {
        self.shadow.borrow().cr3()
    }

    /// Tells the shadow MMU the paging-control bits of [`Vcpu::cr0`], [`Vcpu::cr4`] and
    /// [`Vcpu::efer`] (CR0.WP, CR4.PGE/SMEP, EFER.NXE); a change drops every shadow leaf
    /// and every mapping the translator holds.
    pub fn update_paging_control(&mut self) -> Result<(), ShadowError> {
        self.shadow
            .borrow_mut()
            .set_control(paging_control(self.cr0, self.cr4, self.efer))
    }

    fn stop(&mut self, mnemonic: Option<Mnemonic>, why: &'static str) -> Emulation {
        self.unsupported = Some(Unsupported {
            mnemonic,
            why,
            fault: None,
        });
        Emulation::Stop
    }

    /// Stops because the instruction would raise `fault` in the guest.
    fn fault(&mut self, mnemonic: Mnemonic, fault: GuestFault) -> Emulation {
        self.unsupported = Some(Unsupported {
            mnemonic: Some(mnemonic),
            why: "exception delivery to the guest is not implemented",
            fault: Some(fault),
        });
        Emulation::Stop
    }

    fn mem(&self) -> PhysmapMemory<'a> {
        PhysmapMemory::new(self.shadow)
    }

    /// Continues at `next` if the shadow-MMU operation `r` worked; else records its
    /// failure, which the run loop reports.
    fn shadow_done(&mut self, r: Result<(), ShadowError>, next: GuestVirt) -> Emulation {
        match r {
            Ok(()) => Emulation::Continue(next),
            Err(e) => {
                self.shadow.borrow_mut().record(e);
                Emulation::Stop
            }
        }
    }

    /// MAXPHYADDR from the CPUID table (36 if it has no leaf 0x8000_0008).
    fn phys_addr_bits(&self) -> u32 {
        match self.block.cpuid(0x8000_0008, 0)[0] & 0xff {
            0 => 36,
            n => n,
        }
    }

    /// `mov crN, r64` for CR0, CR3 and CR4.
    fn write_cr(&mut self, i: &Instruction, v: u64, next: GuestVirt) -> Emulation {
        match i.op0_register() {
            Register::CR3 => {
                // Bit 63 asks to keep PCID-tagged entries; PCIDs are off (CPUID masks
                // them), so the write flushes as a plain one.
                let cr3 = v & !(1 << 63);
                if cr3 >> self.phys_addr_bits() != 0 {
                    return self.fault(
                        i.mnemonic(),
                        GuestFault {
                            vector: crate::segments::GP,
                            error: 0,
                        },
                    );
                }
                let r = self.shadow.borrow_mut().write_cr3(cr3);
                self.shadow_done(r, next)
            }
            Register::CR0 | Register::CR4 => {
                let (old, allowed) = if i.op0_register() == Register::CR0 {
                    (self.cr0, CR0_WP)
                } else {
                    (self.cr4, CR4_PGE | CR4_SMEP)
                };
                if (old ^ v) & !allowed != 0 {
                    return self.stop(
                        Some(i.mnemonic()),
                        "a CR0/CR4 write that changes bits other than CR0.WP, CR4.PGE and CR4.SMEP is not emulated yet",
                    );
                }
                if i.op0_register() == Register::CR0 {
                    self.cr0 = v;
                } else {
                    self.cr4 = v;
                }
                let r = self.update_paging_control();
                self.shadow_done(r, next)
            }
            _ => self.stop(
                Some(i.mnemonic()),
                "only CR0, CR3 and CR4 writes are emulated",
            ),
        }
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
    /// The linear address of `i`'s memory operand (FS/GS: their virtual bases).
    pub fn data_address(&self, i: &Instruction, regs: &GuestRegs) -> Option<u64> {
        i.virtual_address(0, 0, |reg, _, _| {
            if reg.is_segment_register() {
                return Some(match reg {
                    Register::FS => self.segs.sregs[Sreg::Fs as usize].base,
                    Register::GS => self.segs.sregs[Sreg::Gs as usize].base,
                    _ => 0,
                });
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

/// The segment register `r` names.
fn sreg_of(r: Register) -> Option<Sreg> {
    Some(match r {
        Register::ES => Sreg::Es,
        Register::CS => Sreg::Cs,
        Register::SS => Sreg::Ss,
        Register::DS => Sreg::Ds,
        Register::FS => Sreg::Fs,
        Register::GS => Sreg::Gs,
        _ => return None,
    })
}

impl<'a> Vcpu<'a> {
    /// Reads the 16-bit register or memory operand `op` of `i`.
    fn read_rm16(&self, i: &Instruction, op: u32, regs: &GuestRegs) -> Option<u16> {
        if i.op_kind(op) == OpKind::Register {
            let r = i.op_register(op).full_register();
            let n = Gpr::from_number(r.number() as u8).filter(|_| r.is_gpr64())?;
            return Some(regs.get(n) as u16);
        }
        let ea = self.data_address(i, regs)?;
        let mut b = [0u8; 2];
        self.mem()
            .read_virt(ea, MODE_KERNEL, &mut b)
            .then_some(u16::from_le_bytes(b))
    }

    /// Writes `v` to `i`'s first operand: 16 bits to memory or a 16-bit register, the
    /// zero-extended value to a 32/64-bit register.
    fn write_rm16(
        &mut self,
        i: &Instruction,
        v: u16,
        regs: &mut GuestRegs,
        next: GuestVirt,
    ) -> Emulation {
        if i.op0_kind() == OpKind::Register {
            let r = i.op0_register();
            let Some(n) = Gpr::from_number(r.full_register().number() as u8)
                .filter(|_| r.full_register().is_gpr64())
            else {
                return self.stop(Some(i.mnemonic()), "unexpected operand");
            };
            let old = regs.get(n);
            regs.set(
                n,
                if r.is_gpr16() {
                    (old & !0xffff) | u64::from(v)
                } else {
                    u64::from(v)
                },
            );
            return Emulation::Continue(next);
        }
        let ok = self
            .data_address(i, regs)
            .is_some_and(|ea| self.mem().write_virt(ea, MODE_KERNEL, &v.to_le_bytes()));
        if !ok {
            return self.stop(
                Some(i.mnemonic()),
                "its operand is not writable: exception delivery to the guest is not implemented",
            );
        }
        Emulation::Continue(next)
    }

    /// Loads DS/ES/SS/FS/GS with `sel` (the checks in [`Segments::load_data`]).
    fn load_sreg(&mut self, i: &Instruction, reg: Sreg, sel: u16, next: GuestVirt) -> Emulation {
        let old_base = self.segs.sregs[reg as usize].base;
        let mem = self.mem();
        if let Err(f) = self.segs.load_data(&mem, self.gdtr, reg, sel) {
            return self.fault(i.mnemonic(), f);
        }
        if matches!(reg, Sreg::Fs | Sreg::Gs) && self.segs.sregs[reg as usize].base != old_base {
            return self.stop(
                Some(i.mnemonic()),
                "the load changes the FS/GS base, and the hardware base translated code uses is not switched yet",
            );
        }
        Emulation::Continue(next)
    }

    /// `retf` (16/32/64-bit operand size, optional immediate): same privilege only.
    fn far_return(&mut self, i: &Instruction, regs: &mut GuestRegs) -> Emulation {
        let size: u64 = match i.code() {
            Code::Retfw | Code::Retfw_imm16 => 2,
            Code::Retfd | Code::Retfd_imm16 => 4,
            _ => 8,
        };
        let rsp = regs.get(Gpr::Rsp);
        let mut b = [0u8; 16];
        let sz = size as usize;
        if !self.mem().read_virt(rsp, MODE_KERNEL, &mut b[..2 * sz]) {
            return self.stop(
                Some(i.mnemonic()),
                "the stack is not readable: exception delivery to the guest is not implemented",
            );
        }
        let mut ip = [0u8; 8];
        ip[..sz].copy_from_slice(&b[..sz]);
        let rip = u64::from_le_bytes(ip);
        let sel = u16::from_le_bytes([b[sz], b[sz + 1]]);
        let mem = self.mem();
        let (d, c) = match self.segs.check_far_return_cs(&mem, self.gdtr, sel) {
            Ok(Some(dc)) => dc,
            Ok(None) => {
                return self.stop(
                    Some(i.mnemonic()),
                    "a far return to an outer privilege level is not emulated yet",
                )
            }
            Err(f) => return self.fault(i.mnemonic(), f),
        };
        if c.l == 0 || c.db != 0 {
            return self.stop(
                Some(i.mnemonic()),
                "a far return to a non-64-bit code segment (only 64-bit code is translated)",
            );
        }
        // A non-canonical RIP: #GP(0).
        if ((rip as i64) << 16 >> 16) as u64 != rip {
            return self.fault(
                i.mnemonic(),
                GuestFault {
                    vector: crate::segments::GP,
                    error: 0,
                },
            );
        }
        if let Err(f) = self.segs.commit_cs(&mem, &d, c) {
            return self.fault(i.mnemonic(), f);
        }
        let imm = if i.op_count() > 0 {
            u64::from(i.immediate16())
        } else {
            0
        };
        regs.set(Gpr::Rsp, rsp.wrapping_add(2 * size + imm));
        Emulation::Continue(GuestVirt(rip))
    }
}

fn set_low8(regs: &mut GuestRegs, r: Gpr, v: u8) {
    regs.set(r, (regs.get(r) & !0xff) | u64::from(v));
}

impl Platform for Vcpu<'_> {
    fn emulate(&mut self, insn: &SensitiveInsn, regs: &mut GuestRegs) -> Emulation {
        let e = self.emulate_insn(insn, regs);
        let sh = self.shadow.borrow();
        if sh.failure().is_some() {
            return Emulation::Stop;
        }
        match e {
            Emulation::Continue(next) if sh.has_work() => {
                self.resume = Some(next);
                Emulation::Stop
            }
            e => e,
        }
    }

    fn segment_base(&mut self, seg: SegBase) -> u64 {
        match seg {
            SegBase::Fs => self.segs.sregs[Sreg::Fs as usize].base,
            SegBase::Gs => self.segs.sregs[Sreg::Gs as usize].base,
            _ => 0,
        }
    }
}

impl Vcpu<'_> {
    /// Emulates one sensitive instruction (see the module header).
    fn emulate_insn(&mut self, insn: &SensitiveInsn, regs: &mut GuestRegs) -> Emulation {
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
            Code::Mov_r64_cr
                if matches!(
                    i.op1_register(),
                    Register::CR0 | Register::CR3 | Register::CR4
                ) =>
            {
                let v = match i.op1_register() {
                    Register::CR0 => self.cr0,
                    Register::CR4 => self.cr4,
                    _ => self.cr3(),
                };
                match Gpr::from_number(i.op0_register().number() as u8) {
                    Some(r) if i.op0_register().is_gpr64() => {
                        regs.set(r, v);
                        Emulation::Continue(next)
                    }
                    _ => self.stop(Some(i.mnemonic()), "unexpected operand"),
                }
            }
            Code::Mov_cr_r64 => match Gpr::from_number(i.op1_register().number() as u8) {
                Some(r) if i.op1_register().is_gpr64() => self.write_cr(&i, regs.get(r), next),
                _ => self.stop(Some(i.mnemonic()), "unexpected operand"),
            },
            Code::Invlpg_m => match self.data_address(&i, regs) {
                Some(va) => {
                    let r = self.shadow.borrow_mut().invlpg(va);
                    self.shadow_done(r, next)
                }
                None => self.stop(Some(i.mnemonic()), "unexpected operand"),
            },
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
                let ok = self
                    .data_address(&i, regs)
                    .is_some_and(|ea| self.mem().read_virt(ea, MODE_KERNEL, &mut bytes));
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
                let ok = self
                    .data_address(&i, regs)
                    .is_some_and(|ea| self.mem().write_virt(ea, MODE_KERNEL, &bytes));
                if !ok {
                    return self.stop(
                        Some(i.mnemonic()),
                        "its operand is not writable (or uses FS/GS): exception delivery to the guest is not implemented",
                    );
                }
                Emulation::Continue(next)
            }
            Code::Mov_Sreg_rm16 | Code::Mov_Sreg_r32m16 | Code::Mov_Sreg_r64m16 => {
                let Some(reg) = sreg_of(i.op0_register()) else {
                    return self.stop(Some(i.mnemonic()), "unexpected operand");
                };
                if reg == Sreg::Cs {
                    return self.stop(
                        Some(i.mnemonic()),
                        "mov cs raises #UD; exception delivery to the guest is not implemented",
                    );
                }
                let Some(sel) = self.read_rm16(&i, 1, regs) else {
                    return self.stop(Some(i.mnemonic()), "its operand is not readable: exception delivery to the guest is not implemented");
                };
                self.load_sreg(&i, reg, sel, next)
            }
            Code::Mov_rm16_Sreg | Code::Mov_r32m16_Sreg | Code::Mov_r64m16_Sreg => {
                let Some(reg) = sreg_of(i.op1_register()) else {
                    return self.stop(Some(i.mnemonic()), "unexpected operand");
                };
                let sel = self.segs.sregs[reg as usize].selector;
                self.write_rm16(&i, sel, regs, next)
            }
            Code::Str_rm16 | Code::Str_r32m16 | Code::Str_r64m16 => {
                let sel = self.segs.tr.selector;
                self.write_rm16(&i, sel, regs, next)
            }
            Code::Sldt_rm16 | Code::Sldt_r32m16 | Code::Sldt_r64m16 => {
                let sel = self.segs.ldtr.selector;
                self.write_rm16(&i, sel, regs, next)
            }
            Code::Ltr_rm16
            | Code::Ltr_r32m16
            | Code::Ltr_r64m16
            | Code::Lldt_rm16
            | Code::Lldt_r32m16
            | Code::Lldt_r64m16 => {
                let Some(sel) = self.read_rm16(&i, 0, regs) else {
                    return self.stop(Some(i.mnemonic()), "its operand is not readable: exception delivery to the guest is not implemented");
                };
                let ldt = i.mnemonic() == Mnemonic::Lldt;
                let mem = self.mem();
                match self.segs.load_system(&mem, self.gdtr, sel, ldt) {
                    Ok(()) => Emulation::Continue(next),
                    Err(f) => self.fault(i.mnemonic(), f),
                }
            }
            Code::Pushw_FS | Code::Pushq_FS | Code::Pushw_GS | Code::Pushq_GS => {
                let reg = if matches!(i.code(), Code::Pushw_FS | Code::Pushq_FS) {
                    Sreg::Fs
                } else {
                    Sreg::Gs
                };
                let size = if matches!(i.code(), Code::Pushw_FS | Code::Pushw_GS) {
                    2
                } else {
                    8
                };
                let v = u64::from(self.segs.sregs[reg as usize].selector).to_le_bytes();
                let rsp = regs.get(Gpr::Rsp).wrapping_sub(size as u64);
                if !self.mem().write_virt(rsp, MODE_KERNEL, &v[..size]) {
                    return self.stop(Some(i.mnemonic()), "the stack is not writable: exception delivery to the guest is not implemented");
                }
                regs.set(Gpr::Rsp, rsp);
                Emulation::Continue(next)
            }
            Code::Popw_FS | Code::Popq_FS | Code::Popw_GS | Code::Popq_GS => {
                let reg = if matches!(i.code(), Code::Popw_FS | Code::Popq_FS) {
                    Sreg::Fs
                } else {
                    Sreg::Gs
                };
                let size = if matches!(i.code(), Code::Popw_FS | Code::Popw_GS) {
                    2
                } else {
                    8
                };
                let rsp = regs.get(Gpr::Rsp);
                let mut b = [0u8; 2];
                if !self.mem().read_virt(rsp, MODE_KERNEL, &mut b) {
                    return self.stop(Some(i.mnemonic()), "the stack is not readable: exception delivery to the guest is not implemented");
                }
                let e = self.load_sreg(&i, reg, u16::from_le_bytes(b), next);
                if e != Emulation::Stop {
                    regs.set(Gpr::Rsp, rsp.wrapping_add(size));
                }
                e
            }
            Code::Retfw
            | Code::Retfd
            | Code::Retfq
            | Code::Retfw_imm16
            | Code::Retfd_imm16
            | Code::Retfq_imm16 => self.far_return(&i, regs),
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
