//! Control and debug registers: `mov` to/from CR0/CR2/CR3/CR4/CR8 and DR0–DR7, `smsw`,
//! `lmsw`, `clts`, and `invlpg`, on the shadow MMU (CR3 = the guest's address space,
//! CR0.WP/CR4.PGE/CR4.SMEP/EFER.NXE = its paging-control bits).
//!
//! `mov cr0/cr4, r64` checks reserved bits as hardware does (#GP(0)); a write that would
//! leave 64-bit paged mode (PE, PG, PAE) or trap x87/SSE (EM, TS) stops the run instead.
//! CR4.TSD (Linux's `PR_SET_TSC`) makes user code's translation mode one where
//! `rdtsc`/`rdtscp` are emulated (#GP(0) at CPL 3; `Mode::timestamp_faulting`). CR4 bits whose feature the CPUID table hides are #GP(0)
//! as on a CPU without them. CR8 (the TPR) reads 0 and ignores writes: 64-bit Linux
//! programs the TPR through the APIC page.

use iced_x86::{Instruction, OpKind, Register};
use kpin_abi::x86::{cr0, cr4};

use super::emulate::{gp0, gpr, Flow, Step};
use super::events::Event;
use super::hardware::{GuestMmu, Hardware};
use super::{Vcpu, DR6_INIT, DR7_ENABLES, DR7_GD, DR7_INIT};
use crate::shadow_mmu::{PagingControl, ShadowError};
use crate::{GuestRegs, GuestVirt};

/// The guest control bits that change translations, from CR0, CR4 and EFER.
pub fn paging_control(cr0: u64, cr4: u64, efer: u64) -> PagingControl {
    PagingControl {
        wp: cr0 & cr0::WP != 0,
        nxe: efer & kpin_abi::x86::efer::NXE != 0,
        pge: cr4 & cr4::PGE != 0,
        smep: cr4 & cr4::SMEP != 0,
    }
}

impl<H: Hardware, M: GuestMmu> Vcpu<'_, H, M> {
    /// Tells the shadow MMU the paging-control bits of CR0, CR4 and EFER (CR0.WP,
    /// CR4.PGE/SMEP, EFER.NXE); a change drops every shadow leaf and every mapping the
    /// translator holds.
    pub fn update_paging_control(&mut self) -> Result<(), ShadowError> {
        self.mem
            .set_paging_control(paging_control(self.cr0, self.cr4, self.msrs.efer))
    }

    /// Continues at `next` if the shadow-MMU operation `r` worked; else records its
    /// failure, which the run loop reports.
    fn shadow_done(&mut self, r: Result<(), ShadowError>, next: GuestVirt) -> Step {
        match r {
            Ok(()) => Ok(Flow::Continue(next)),
            Err(e) => {
                self.mem.record_failure(e);
                Ok(Flow::Stop(super::VcpuStop::ShadowFailure))
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

    /// The CR4 bits a write may set without #GP: those whose feature the CPUID table
    /// offers (CPUID masks PCIDE, LA57, OSXSAVE, SMAP, PKE, so setting them is #GP as
    /// on a CPU without them). VMXE/SMXE/CET are never offered.
    fn cr4_writable(&self) -> u64 {
        let [_, _, _, edx1] = self.block.cpuid(1, 0);
        let [_, ebx7, ecx7, _] = self.block.cpuid(7, 0);
        // (CPUID register, bit, the CR4 bits that feature makes writable)
        let features = [
            (edx1, 1, cr4::VME | cr4::PVI),
            (edx1, 2, cr4::DE),
            (edx1, 3, cr4::PSE),
            (edx1, 13, cr4::PGE),
            (edx1, 24, cr4::OSFXSR),
            (edx1, 25, cr4::OSXMMEXCPT),
            (ecx7, 2, cr4::UMIP),
            (ebx7, 0, cr4::FSGSBASE),
            (ebx7, 7, cr4::SMEP),
        ];
        let mut m = cr4::PAE | cr4::MCE | cr4::PCE | cr4::TSD;
        for (reg, bit, bits) in features {
            if reg & (1 << bit) != 0 {
                m |= bits;
            }
        }
        m
    }

    /// `mov cr0, r64` or `lmsw` (CPL 0 checked by the caller).
    fn write_cr0(&mut self, i: &Instruction, v: u64, next: GuestVirt) -> Step {
        let old = self.cr0;
        if v >> 32 != 0
            || (v & cr0::PG != 0 && v & cr0::PE == 0)
            || (v & cr0::NW != 0 && v & cr0::CD == 0)
        {
            return Err(gp0());
        }
        if (old ^ v) & (cr0::PE | cr0::PG) != 0 {
            return Ok(Flow::unsupported(
                i,
                "a CR0 write that changes PE or PG (leaving 64-bit paged mode) is not emulated",
            ));
        }
        if v & (cr0::EM | cr0::TS) != 0 {
            return Ok(Flow::unsupported(
                i,
                "a CR0 write that sets EM or TS (x87/SSE traps: #NM is not virtualized) is not emulated",
            ));
        }
        // The rest is stored: WP goes to the shadow MMU; MP/NE/ET are what the
        // real CR0 has; AM only matters at CPL 3 with RFLAGS.AC (user-space
        // alignment checks are not virtualized: the real AM stays clear); CD/NW
        // change caching only, which a VM cannot observe.
        self.cr0 = v | cr0::ET;
        let r = self.update_paging_control();
        self.shadow_done(r, next)
    }

    /// `mov cr4, r64` (CPL 0 checked by the caller).
    fn write_cr4(&mut self, i: &Instruction, v: u64, next: GuestVirt) -> Step {
        let old = self.cr4;
        if v & !self.cr4_writable() != 0 {
            return Err(gp0());
        }
        if (old ^ v) & cr4::PAE != 0 {
            return Ok(Flow::unsupported(
                i,
                "a CR4 write that clears PAE (leaving long mode) is not emulated",
            ));
        }
        self.cr4 = v;
        if (old ^ v) & cr4::SSE_BITS != 0 {
            self.hw.set_cr4_sse(v);
        }
        let r = self.update_paging_control();
        self.shadow_done(r, next)
    }

    /// `mov crN, r64`.
    pub(super) fn mov_to_cr(
        &mut self,
        i: &Instruction,
        regs: &mut GuestRegs,
        next: GuestVirt,
    ) -> Step {
        let v = gpr(i.op1_register()).map_or(0, |r| regs.get(r));
        match i.op0_register() {
            Register::CR3 => {
                // Bit 63 asks to keep PCID-tagged entries; PCIDs are off (CPUID masks
                // them), so the write flushes as a plain one.
                let cr3 = v & !(1 << 63);
                if cr3 >> self.phys_addr_bits() != 0 {
                    return Err(gp0());
                }
                let r = self.mem.write_cr3(cr3);
                self.shadow_done(r, next)
            }
            Register::CR0 => self.write_cr0(i, v, next),
            Register::CR4 => self.write_cr4(i, v, next),
            Register::CR2 => {
                self.cr2 = v;
                Ok(Flow::Continue(next))
            }
            // CR8 (the TPR) is not forwarded to the local APIC: writes are dropped.
            Register::CR8 => Ok(Flow::Continue(next)),
            _ => Err(Event::ud()),
        }
    }

    /// `mov r64, crN`.
    pub(super) fn mov_from_cr(
        &mut self,
        i: &Instruction,
        regs: &mut GuestRegs,
        next: GuestVirt,
    ) -> Step {
        let v = match i.op1_register() {
            Register::CR0 => self.cr0,
            Register::CR2 => self.cr2,
            Register::CR3 => self.cr3(),
            Register::CR4 => self.cr4,
            Register::CR8 => 0,
            _ => return Err(Event::ud()),
        };
        if let Some(r) = gpr(i.op0_register()) {
            regs.set(r, v);
        }
        Ok(Flow::Continue(next))
    }

    /// `mov r64, drN` (DR4/DR5 alias DR6/DR7 unless CR4.DE, which makes them #UD).
    pub(super) fn mov_from_dr(
        &mut self,
        i: &Instruction,
        regs: &mut GuestRegs,
        next: GuestVirt,
    ) -> Step {
        let v = match i.op1_register() {
            Register::DR0 => self.dr[0],
            Register::DR1 => self.dr[1],
            Register::DR2 => self.dr[2],
            Register::DR3 => self.dr[3],
            Register::DR4 | Register::DR5 if self.cr4 & cr4::DE != 0 => return Err(Event::ud()),
            Register::DR4 | Register::DR6 => self.dr6,
            Register::DR5 | Register::DR7 => self.dr7,
            _ => return Err(Event::ud()),
        };
        if let Some(r) = gpr(i.op0_register()) {
            regs.set(r, v);
        }
        Ok(Flow::Continue(next))
    }

    /// `mov drN, r64`: DR0–DR3 stored; DR6/DR7 upper halves must be 0 (#GP(0)); a DR7
    /// that enables a breakpoint makes the translation mode a stepping one (`debug.rs`);
    /// one that enables general detect stops.
    pub(super) fn mov_to_dr(
        &mut self,
        i: &Instruction,
        regs: &mut GuestRegs,
        next: GuestVirt,
    ) -> Step {
        let v = gpr(i.op1_register()).map_or(0, |r| regs.get(r));
        match i.op0_register() {
            r @ (Register::DR0 | Register::DR1 | Register::DR2 | Register::DR3) => {
                self.dr[(r as usize) - (Register::DR0 as usize)] = v;
            }
            Register::DR4 | Register::DR5 if self.cr4 & cr4::DE != 0 => return Err(Event::ud()),
            Register::DR4 | Register::DR6 => {
                if v >> 32 != 0 {
                    return Err(gp0());
                }
                // B0–B3, BD, BS, BT are writable; the rest reads fixed.
                self.dr6 = (v & 0xe00f) | DR6_INIT;
            }
            Register::DR5 | Register::DR7 => {
                if v >> 32 != 0 {
                    return Err(gp0());
                }
                // GD arms the general-detect trap on every debug-register access.
                if v & DR7_GD != 0 {
                    return Ok(Flow::unsupported(
                        i,
                        "a DR7 write that enables general detect is not virtualized",
                    ));
                }
                // L0–L3/G0–G3 enable breakpoints (Linux: ptrace's u_debugreg, gdb's
                // hbreak and watch): from the next instruction on the translation mode
                // steps and `debug.rs` checks them.
                if v & DR7_ENABLES != 0 {
                    self.stats.breakpoint_enables += 1;
                }
                self.dr7 = (v & !0xd800) | DR7_INIT;
            }
            _ => return Err(Event::ud()),
        }
        Ok(Flow::Continue(next))
    }

    /// `smsw r/m16`: a register destination gets the whole CR0 (bits above 15 are
    /// undefined for 32/64-bit operands; real CPUs give CR0).
    pub(super) fn smsw(&mut self, i: &Instruction, regs: &mut GuestRegs, next: GuestVirt) -> Step {
        if i.op0_kind() == OpKind::Register {
            let r = i.op0_register();
            if let Some(n) = gpr(r) {
                let old = regs.get(n);
                regs.set(
                    n,
                    if r.is_gpr16() {
                        (old & !0xffff) | (self.cr0 & 0xffff)
                    } else {
                        self.cr0
                    },
                );
            }
            return Ok(Flow::Continue(next));
        }
        self.write_rm16(i, self.cr0 as u16, regs)?;
        Ok(Flow::Continue(next))
    }

    /// `clts`: CR0.TS is always clear here (setting it stops), so it changes nothing.
    pub(super) fn clts(
        &mut self,
        _i: &Instruction,
        _regs: &mut GuestRegs,
        next: GuestVirt,
    ) -> Step {
        Ok(Flow::Continue(next))
    }

    /// `lmsw r/m16`: loads MP, EM, TS and may set (never clear) PE.
    pub(super) fn lmsw(&mut self, i: &Instruction, regs: &mut GuestRegs, next: GuestVirt) -> Step {
        let w = u64::from(self.read_rm16(i, 0, regs)?) & 0xf;
        let v = (self.cr0 & !0xe) | w | (self.cr0 & cr0::PE);
        self.write_cr0(i, v, next)
    }

    /// `invlpg m`: a non-canonical operand is a no-op on hardware (no #GP).
    pub(super) fn invlpg(
        &mut self,
        i: &Instruction,
        regs: &mut GuestRegs,
        next: GuestVirt,
    ) -> Step {
        let va = self.data_address(i, regs).unwrap_or(0);
        let r = self.mem.invlpg(va);
        self.shadow_done(r, next)
    }
}
