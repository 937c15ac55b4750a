//! The debug architecture: RFLAGS.TF single-stepping and the breakpoints of DR0–DR3/DR7
//! (SDM vol. 3, chapter 18), on top of the engine's stepping translation mode.
//!
//! While the guest's TF is set or DR7 enables a breakpoint, [`Vcpu::mode`] is a stepping
//! mode: the engine runs one guest instruction at a time and stops (`Stop::Stepped`)
//! after each. Around every such instruction the run loop asks this module:
//!
//! * before it, [`Vcpu::instruction_breakpoint`]: an enabled execution breakpoint at its
//!   address (and RFLAGS.RF clear) is a #DB *fault* there, DR6.Bn set;
//! * after it, [`Vcpu::after_instruction`]: the data breakpoints its memory accesses hit
//!   (writes for R/W = 01, reads and writes for 11, ranges of 1, 2, 4 or 8 bytes aligned
//!   as the CPU aligns them) and, if it began with TF set, the single-step trap: one #DB
//!   *trap* with RIP after it and DR6.Bn/BS for all of them.
//!
//! An instruction that raises an exception takes neither trap (its fault is delivered);
//! `syscall` clearing TF takes no single-step trap, nor does `mov ss`/`pop ss` (the next
//! instruction's trap covers it). Not modelled: I/O breakpoints
//! (R/W = 10 with CR4.DE), general detect, the per-iteration traps of `rep` string
//! instructions (one after the whole instruction), and breakpoints hit by the CPU's own
//! implicit accesses (descriptor tables, the stack of an event delivery).

use iced_x86::{Decoder, DecoderOptions, InstructionInfoFactory};

use super::events::{Event, Kind, TripleFault};
use super::hardware::{GuestMmu, Hardware};
use super::{Vcpu, DR7_ENABLES};
use crate::arch::x86_64::decode::mem_operands;
use crate::instrument::{access, SegBase};
use crate::GuestRegs;

/// DR6.BS: a single-step trap.
const DR6_BS: u64 = 1 << 14;
/// DR6.B0–B3.
const DR6_HITS: u64 = 0xf;
/// RFLAGS.RF: the next instruction's execution breakpoints are suppressed.
const RF: u64 = 1 << 16;

/// One enabled breakpoint of DR7: its DRn, the condition (R/W bits) and the length.
#[derive(Clone, Copy)]
struct Breakpoint {
    n: usize,
    rw: u64,
    len: u64,
}

impl<H: Hardware, M: GuestMmu> Vcpu<'_, H, M> {
    /// Whether DR7 enables any breakpoint (L0–L3/G0–G3).
    pub(super) fn breakpoints_armed(&self) -> bool {
        self.dr7 & DR7_ENABLES != 0
    }

    /// The breakpoints DR7 enables.
    fn breakpoints(&self) -> impl Iterator<Item = Breakpoint> + '_ {
        (0..4)
            .filter(|n| self.dr7 & (3 << (2 * n)) != 0)
            .map(|n| Breakpoint {
                n,
                rw: (self.dr7 >> (16 + 4 * n)) & 3,
                len: match (self.dr7 >> (18 + 4 * n)) & 3 {
                    0 => 1,
                    1 => 2,
                    2 => 8,
                    _ => 4,
                },
            })
    }

    /// Before the instruction at `rip` runs (in a stepping mode): an enabled execution
    /// breakpoint there is a #DB fault (RIP = the instruction, DR6.Bn), unless
    /// RFLAGS.RF is set. `Some` with the handler's RIP (or the triple fault) if one hit.
    pub fn instruction_breakpoint(
        &mut self,
        regs: &mut GuestRegs,
        rip: u64,
    ) -> Option<Result<u64, TripleFault>> {
        if regs.rflags & RF != 0 {
            return None;
        }
        let hits = self
            .breakpoints()
            .filter(|b| b.rw == 0 && self.dr[b.n] == rip)
            .fold(0, |h, b| h | 1 << b.n);
        if hits == 0 {
            return None;
        }
        self.dr6 = (self.dr6 & !DR6_HITS) | hits;
        Some(self.deliver(regs, rip, debug_event(Kind::Exception)))
    }

    /// After one instruction ran in a stepping mode (`Stop::Stepped`): `tf` is the TF it
    /// began with, `before` the guest registers it began with (at `pc`, its bytes
    /// `bytes`), `regs` the state after it, `next` where it continues. Delivers the #DB
    /// trap of the data breakpoints its accesses hit and of the single-step; `None` if
    /// neither.
    #[allow(clippy::too_many_arguments)]
    pub fn after_instruction(
        &mut self,
        tf: bool,
        before: &GuestRegs,
        pc: u64,
        bytes: &[u8],
        regs: &mut GuestRegs,
        next: u64,
    ) -> Option<Result<u64, TripleFault>> {
        // The instruction completed: the RF it began with suppresses nothing more (an
        // `iretq` that loads RF, as a #DB handler returns, keeps the loaded one).
        if before.rflags & RF != 0 {
            regs.rflags &= !RF;
        }
        // `mov ss`/`pop ss` hold debug traps off until after the next instruction.
        let stepped =
            tf && !core::mem::take(&mut self.step_suppressed) && !self.loads_ss(pc, bytes);
        let hits = if self.breakpoints_armed() {
            self.data_hits(before, pc, bytes)
        } else {
            0
        };
        if hits == 0 && !stepped {
            return None;
        }
        self.dr6 = (self.dr6 & !DR6_HITS) | hits;
        if stepped {
            self.dr6 |= DR6_BS;
        }
        Some(self.deliver(regs, next, debug_event(Kind::Trap)))
    }

    /// Whether the instruction at `pc` loads SS (`mov ss`, `pop ss`).
    fn loads_ss(&self, pc: u64, bytes: &[u8]) -> bool {
        let i = Decoder::with_ip(self.bitness(), bytes, pc, DecoderOptions::NONE).decode();
        matches!(
            i.mnemonic(),
            iced_x86::Mnemonic::Mov | iced_x86::Mnemonic::Pop
        ) && i.op0_kind() == iced_x86::OpKind::Register
            && i.op0_register() == iced_x86::Register::SS
    }

    /// DR6.Bn bits of the data breakpoints the instruction at `pc` hits with the
    /// registers `before` it.
    fn data_hits(&self, before: &GuestRegs, pc: u64, bytes: &[u8]) -> u64 {
        let i = Decoder::with_ip(self.bitness(), bytes, pc, DecoderOptions::NONE).decode();
        if i.is_invalid() {
            return 0;
        }
        let mut factory = InstructionInfoFactory::new();
        let ops = mem_operands(&mut factory, &i);
        let mut hits = 0;
        for m in ops.iter() {
            let seg = match m.seg {
                SegBase::Fs => self.segs.sregs[super::Sreg::Fs as usize].base,
                SegBase::Gs => self.segs.sregs[super::Sreg::Gs as usize].base,
                SegBase::Flat => 0,
            };
            let start = m.effective_address(before).wrapping_add(seg);
            let end = start.wrapping_add(u64::from(m.size.max(1)));
            for b in self.breakpoints() {
                let wanted = match b.rw {
                    1 => access::WRITE,
                    3 => access::READ | access::WRITE,
                    _ => 0,
                };
                let lo = self.dr[b.n] & !(b.len - 1);
                if m.access & wanted != 0 && start < lo.wrapping_add(b.len) && lo < end {
                    hits |= 1 << b.n;
                }
            }
        }
        hits
    }
}

/// #DB as `kind` (a fault for an execution breakpoint, a trap otherwise).
fn debug_event(kind: Kind) -> Event {
    Event {
        vector: kpin_abi::x86::vector::DB,
        error: None,
        kind,
    }
}
