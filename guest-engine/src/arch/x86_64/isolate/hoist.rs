//! Checks hoisted out of self-looping traces: the bases a loop never writes are checked
//! once at the trace's top, and the back edge enters past them (`loop_entry`).

use iced_x86::Mnemonic;

use super::super::decode::{Class, DecodedTrace};
use super::super::emit::{reg, Label};
use super::super::mangle::Tx;
use super::{addressing_32, bit_offset_register, written_gprs, BaseState};
use crate::context::Gpr;
use crate::error::EngineError;
use crate::instrument::{MemOperand, SegBase};

impl Tx<'_> {
    /// The checks of a trace that branches back to its own start, hoisted to its top
    /// (`hoisted`, from [`hoistable`]): each such register keeps its value across
    /// iterations, so one check per entry from outside covers them all (the back edge,
    /// linked to the trace's `loop_entry`, skips them). A hit cannot name an instruction
    /// here: it exits to `hit` (the dispatcher builds the trace again without hoisting,
    /// where the check traps at the instruction). Marks the registers checked in `bases`.
    pub(in crate::arch::x86_64) fn emit_hoisted_checks(
        &mut self,
        hoisted: Hoisted,
        pc: u64,
        bases: &mut BaseState,
        hit: Label,
    ) -> Result<(), EngineError> {
        for b in Gpr::ALL {
            let bit = 1u16 << (b as u8);
            if hoisted.wide & bit != 0 {
                self.emit_base_bounds_check(b, 2, pc, Some(hit));
                bases.add_wide(b);
            } else if hoisted.narrow & bit != 0 && hoisted.flags_dead {
                self.emit_base_bounds_check(b, 0, pc, Some(hit));
                bases.add(Some(b), None, 1);
            } else if hoisted.narrow & bit != 0 {
                let biased = MemOperand {
                    base: Some(b),
                    index: None,
                    scale: 1,
                    disp: self.env.fence.bias(),
                    seg: SegBase::Flat,
                    size: 8,
                    access: 0,
                };
                self.a.spill_quiet(reg::RCX);
                self.emit_ea_rcx(&biased, pc)?;
                self.emit_zone_test_to(hoisted.flags_dead, Some(hit));
                bases.add(Some(b), None, 1);
            }
        }
        Ok(())
    }
}

/// Base registers whose checks a self-looping trace hoists to its top (bit = hardware
/// number).
#[derive(Clone, Copy, Debug, Default)]
pub(in crate::arch::x86_64) struct Hoisted {
    /// Checked wide (bases of the index fast path).
    wide: u16,
    /// Checked as plain bases.
    narrow: u16,
    /// The status flags are dead at the trace's top.
    flags_dead: bool,
}

impl Hoisted {
    pub(in crate::arch::x86_64) fn any(&self) -> bool {
        self.wide | self.narrow != 0
    }
}

/// The base registers of elidable operands that no instruction of `t` up to its last
/// branch back to its start writes (RSP's implicit adjustments count as writes here: they
/// add up over iterations); `live` is the trace's flag liveness. Instructions after that
/// branch run at most once per entry: their writes are tracked as usual (`BaseState`).
pub(in crate::arch::x86_64) fn hoistable(
    tx: &mut Tx<'_>,
    t: &DecodedTrace,
    live: &[u32],
) -> Hoisted {
    let start = t.start.0;
    let Some(last) = t.insns.iter().rposition(|d| {
        matches!(d.class, Class::Jcc { target, .. } | Class::Jmp { target }
            | Class::LoopLike { target } if target == start)
    }) else {
        return Hoisted::default();
    };
    let looped = &t.insns[..=last];
    let mut written = 0u16;
    for d in looped {
        written |= written_gprs(d);
        if d.instr.stack_pointer_increment() != 0 {
            written |= 1 << reg::RSP;
        }
    }
    let (mut narrow, mut wide) = (0u16, 0u16);
    for (k, d) in looped.iter().enumerate() {
        let i = &d.instr;
        if i.vsib().is_some() || bit_offset_register(i).is_some() || addressing_32(i) {
            continue;
        }
        for m in t.info[k].mem.iter() {
            let index = if i.mnemonic() == Mnemonic::Xlatb {
                None
            } else {
                m.index
            };
            let disp = m.disp as i64;
            if m.seg != SegBase::Flat || !tx.env.fence.elides(disp) {
                continue;
            }
            match (m.base, index) {
                (Some(b), None) => narrow |= 1 << (b as u8),
                (Some(b), Some(_)) if live[k] == 0 => wide |= 1 << (b as u8),
                _ => {}
            }
        }
    }
    // The wide check needs the status flags dead at the top.
    let flags_dead = live.first() == Some(&0);
    if !flags_dead {
        wide = 0;
    }
    wide &= !written;
    narrow &= !written & !wide;
    Hoisted {
        wide,
        narrow,
        flags_dead,
    }
}
