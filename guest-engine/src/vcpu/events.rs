//! Exception and interrupt delivery through the guest's virtual IDT, and `iretq`: the
//! frame a CPU in 64-bit mode builds (Intel SDM vol. 3, §6.14) — IDT gate checks, target
//! CS from the virtual GDT, stack switch to TSS.RSPn on a privilege change or to an IST
//! stack, 16-byte alignment, SS/RSP/RFLAGS/CS/RIP[/error] pushed, TF/NT/RF cleared (and
//! the virtual IF for interrupt gates), the new CPL. A fault while delivering becomes the
//! next exception (or #DF, by the benign/contributory/page-fault table of §6.15); a fault
//! while delivering #DF is a triple fault, which ends the run with a report.
//!
//! Every push goes through an [`UndoLog`]: when a later push faults the earlier ones are
//! rolled back, so the guest stack looks as before the failed delivery. Registers and the
//! virtual CPU change only after the last step that can fault.
//!
//! Instructions: `iretq`, `int n`, `int3`, `ud0`/`ud1`/`ud2`; external interrupts
//! ([`Vcpu::deliver_pending`]).

use kpin_abi::attach::Segment;
use kpin_abi::x86::vector::{BP, DF, GP, NP, PF, SS as SS_FAULT, TS, UD};
use kpin_abi::x86::{is_canonical as canonical, rflags, vector};

use iced_x86::Instruction;

use super::emulate::{Flow, Step};
use super::hardware::{GuestFault, GuestMmu, Hardware};
use super::segments::{Descriptor, Sreg};
use super::undo::UndoLog;
use super::{Vcpu, VcpuStop};
use crate::{Gpr, GuestRegs, GuestVirt};

/// What raised an event (decides the error code's EXT bit, the DPL check and IF).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A processor exception (fault or trap).
    Exception,
    /// An external interrupt.
    External,
    /// `int n` (DPL-checked).
    Software,
    /// `int3` / `into` (DPL-checked, an exception otherwise).
    SoftException,
    /// An exception that is a trap: the saved RIP is the next instruction's (`int1`'s
    /// #DB; not DPL-checked).
    Trap,
}

/// One event to deliver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Event {
    /// Vector.
    pub vector: u8,
    /// Error code, pushed if `Some`.
    pub error: Option<u32>,
    /// Its source.
    pub kind: Kind,
}

impl Event {
    /// An exception with an error code.
    pub fn fault(vector: u8, error: u32) -> Self {
        Self {
            vector,
            error: Some(error),
            kind: Kind::Exception,
        }
    }
    /// An exception without an error code.
    pub fn exception(vector: u8) -> Self {
        Self {
            vector,
            error: None,
            kind: Kind::Exception,
        }
    }
    /// #UD.
    pub fn ud() -> Self {
        Self::exception(UD)
    }
    /// The exception of a failed guest memory access.
    pub fn from_guest_fault(f: GuestFault) -> Self {
        Self::from_hardware(f.vector, f.error_code)
    }
    /// An exception raised by hardware in translated code with `error` (pushed only for
    /// the vectors that have one).
    pub fn from_hardware(vector: u8, error: u32) -> Self {
        Self {
            vector,
            error: vector::has_error_code(vector).then_some(error),
            kind: Kind::Exception,
        }
    }
}

/// The guest triple-faulted: the event whose delivery failed during #DF.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TripleFault {
    /// The exception raised while delivering #DF.
    pub last: Event,
}

/// Why a delivery step failed: the exception it raises, and for #PF its CR2.
struct Nested {
    event: Event,
    cr2: Option<u64>,
}

fn nested(vector: u8, error: u32) -> Nested {
    Nested {
        event: Event::fault(vector, error),
        cr2: None,
    }
}

fn pf(f: GuestFault) -> Nested {
    Nested {
        event: Event::from_hardware(f.vector, f.error_code),
        cr2: (f.vector == PF).then_some(f.cr2.0),
    }
}

fn contributory(v: u8) -> bool {
    vector::is_contributory(v)
}

/// Delivers `ev` with `rip` as the return address (the faulting instruction for faults,
/// the next one for traps and interrupts). A fault raised while delivering it returns to
/// `fault_rip` (for `int n`/`int3`: the instruction itself, SDM vol. 3 §6.12.1.1; else
/// `rip`). Returns the handler's RIP; `regs` and `v` hold the handler's state. A #PF's
/// CR2 must already be in `v.cr2`.
fn deliver_event<H: Hardware, M: GuestMmu>(
    v: &mut Vcpu<'_, H, M>,
    regs: &mut GuestRegs,
    rip: u64,
    fault_rip: u64,
    ev: Event,
) -> Result<u64, TripleFault> {
    let mut ev = ev;
    let mut rip = rip;
    // At most: the event, one nested fault handled serially or as #DF, then #DF itself.
    for _ in 0..4 {
        match try_deliver(v, regs, rip, ev) {
            Ok(target) => {
                v.count_delivery(ev);
                return Ok(target);
            }
            Err(n) => {
                if ev.vector == DF && ev.kind == Kind::Exception {
                    return Err(TripleFault { last: n.event });
                }
                if let Some(cr2) = n.cr2 {
                    v.cr2 = cr2;
                }
                rip = fault_rip;
                let first_pf = ev.vector == PF && ev.kind == Kind::Exception;
                let first_contrib = contributory(ev.vector) && ev.kind == Kind::Exception;
                let second = n.event.vector;
                ev = if (first_contrib && contributory(second))
                    || (first_pf && (second == PF || contributory(second)))
                {
                    Event::fault(DF, 0)
                } else {
                    n.event
                };
            }
        }
    }
    Err(TripleFault { last: ev })
}

/// One delivery attempt; on a fault nothing guest-visible has changed.
fn try_deliver<H: Hardware, M: GuestMmu>(
    v: &mut Vcpu<'_, H, M>,
    regs: &mut GuestRegs,
    rip: u64,
    ev: Event,
) -> Result<u64, Nested> {
    let ext = u32::from(ev.kind == Kind::External);
    let cpl = v.cpl();
    let gate = read_gate(v, ev, ext)?;
    let (c, new_cpl) = handler_code_segment(v, &gate, ext)?;
    let old_rsp = regs.get(Gpr::Rsp);
    let rsp = handler_stack(v, old_rsp, gate.ist, new_cpl, ext)?;
    let ss = v.segs.sregs[Sreg::Ss as usize].selector;
    let cs = v.segs.sregs[Sreg::Cs as usize].selector;
    let image = v.rflags_image(regs.rflags);
    let frame = [u64::from(ss), old_rsp, image, u64::from(cs), rip];
    let rsp = push_frame(v, rsp & !0xf, &frame, ev.error, new_cpl == 3)?;
    // Commit: nothing below can fault.
    if new_cpl != cpl {
        // 64-bit mode: SS becomes a null selector with RPL = the new CPL.
        let s = &mut v.segs.sregs[Sreg::Ss as usize];
        s.selector = u16::from(new_cpl);
        s.unusable = 1;
        s.present = 0;
    }
    let mut cs_cache = c;
    cs_cache.selector = (gate.selector & 0xfffc) | u16::from(new_cpl);
    cs_cache.type_ |= 1;
    v.segs.sregs[Sreg::Cs as usize] = cs_cache;
    regs.set(Gpr::Rsp, rsp);
    regs.rflags &= !(rflags::TF | rflags::NT | rflags::RF | rflags::VM);
    v.tf = false;
    if new_cpl == 0 {
        // The guest kernel runs at hardware CPL 3, where a user's AC would make its
        // misaligned accesses fault (#AC): AC is not carried into it (the frame keeps it
        // for the return).
        regs.rflags &= !rflags::AC;
    }
    if gate.interrupt_gate {
        v.vif = false;
    }
    v.cpl_changed(cpl);
    Ok(gate.target)
}

/// A 64-bit interrupt or trap gate of the guest's IDT.
struct Gate {
    selector: u16,
    target: u64,
    ist: u64,
    /// An interrupt gate (clears IF), not a trap gate.
    interrupt_gate: bool,
}

/// The IDT's gate for `ev`, with the checks on the gate itself (limit, type, DPL for
/// software events, present, a non-null selector).
fn read_gate<H: Hardware, M: GuestMmu>(
    v: &mut Vcpu<'_, H, M>,
    ev: Event,
    ext: u32,
) -> Result<Gate, Nested> {
    let idt_error = u32::from(ev.vector) * 8 + 2 + ext;
    let idtr = v.idtr;
    if u64::from(ev.vector) * 16 + 15 > u64::from(idtr.limit) {
        return Err(nested(GP, idt_error));
    }
    let mut gate = [0u8; 16];
    v.mem
        .read(
            idtr.base.wrapping_add(u64::from(ev.vector) * 16),
            false,
            &mut gate,
        )
        .map_err(pf)?;
    let lo = u64::from_le_bytes(gate[..8].try_into().unwrap_or_default());
    let hi = u64::from_le_bytes(gate[8..].try_into().unwrap_or_default());
    let ty = (lo >> 40) & 0xf;
    let dpl = ((lo >> 45) & 3) as u8;
    if ty != 0xe && ty != 0xf {
        return Err(nested(GP, idt_error));
    }
    if matches!(ev.kind, Kind::Software | Kind::SoftException) && dpl < v.cpl() {
        return Err(nested(GP, idt_error));
    }
    if lo & (1 << 47) == 0 {
        return Err(nested(NP, idt_error));
    }
    let selector = ((lo >> 16) & 0xffff) as u16;
    if selector & 0xfffc == 0 {
        return Err(nested(GP, ext));
    }
    Ok(Gate {
        selector,
        target: (lo & 0xffff) | (((lo >> 48) & 0xffff) << 16) | (hi << 32),
        ist: (lo >> 32) & 7,
        interrupt_gate: ty == 0xe,
    })
}

/// The handler's code segment (a present 64-bit code segment no more privileged than
/// allowed) and the CPL the handler runs at; the target must be canonical.
fn handler_code_segment<H: Hardware, M: GuestMmu>(
    v: &mut Vcpu<'_, H, M>,
    gate: &Gate,
    ext: u32,
) -> Result<(Segment, u8), Nested> {
    let cpl = v.cpl();
    let sel = gate.selector;
    let sel_error = u32::from(sel & 0xfffc) + ext;
    let d: Descriptor = v
        .segs
        .read_descriptor(&mut v.mem, v.gdtr, sel, 8)
        .map_err(|_| nested(GP, sel_error))?;
    let c = d.cache(sel);
    if c.s == 0 || c.type_ & 8 == 0 || c.dpl > cpl || c.l == 0 || c.db != 0 {
        return Err(nested(GP, sel_error));
    }
    if c.present == 0 {
        return Err(nested(NP, sel_error));
    }
    let conforming = c.type_ & 4 != 0;
    let new_cpl = if conforming { cpl } else { c.dpl };
    if !canonical(gate.target) {
        return Err(nested(GP, ext));
    }
    Ok((c, new_cpl))
}

/// The handler's stack pointer (before alignment): the IST entry's or the new CPL's
/// from the TSS when either applies, else the current one.
fn handler_stack<H: Hardware, M: GuestMmu>(
    v: &mut Vcpu<'_, H, M>,
    old_rsp: u64,
    ist: u64,
    new_cpl: u8,
    ext: u32,
) -> Result<u64, Nested> {
    if ist == 0 && new_cpl >= v.cpl() {
        return Ok(old_rsp);
    }
    let off = if ist != 0 {
        0x24 + 8 * (ist - 1)
    } else {
        4 + 8 * u64::from(new_cpl)
    };
    let tr = v.segs.tr;
    if tr.present == 0 || off + 7 > u64::from(tr.limit) {
        return Err(nested(TS, u32::from(tr.selector & 0xfffc) + ext));
    }
    let rsp = v
        .mem
        .read_u64(tr.base.wrapping_add(off), false)
        .map_err(pf)?;
    if !canonical(rsp) {
        return Err(nested(SS_FAULT, ext));
    }
    Ok(rsp)
}

/// Pushes SS, RSP, RFLAGS, CS, RIP (`frame`) and the error code if any below `rsp`, all
/// or nothing (a fault rolls the writes back); returns the new RSP.
fn push_frame<H: Hardware, M: GuestMmu>(
    v: &mut Vcpu<'_, H, M>,
    mut rsp: u64,
    frame: &[u64; 5],
    error: Option<u32>,
    user: bool,
) -> Result<u64, Nested> {
    let mut log = UndoLog::default();
    for word in frame.iter().copied().chain(error.map(u64::from)) {
        rsp = rsp.wrapping_sub(8);
        if let Err(f) = log.write(&mut v.mem, rsp, user, &word.to_le_bytes()) {
            log.rollback(&mut v.mem);
            return Err(pf(f));
        }
    }
    Ok(rsp)
}

/// `iretq` at the current CPL: pops RIP, CS, RFLAGS, RSP, SS (always, in 64-bit mode)
/// with the checks of the SDM's IRET pseudocode for a return to the same or an outer
/// privilege level. Returns the new RIP, or the exception to raise (nothing changed).
fn iretq<H: Hardware, M: GuestMmu>(
    v: &mut Vcpu<'_, H, M>,
    regs: &mut GuestRegs,
) -> Result<u64, Event> {
    let cpl = v.cpl();
    let user = cpl == 3;
    let rsp = regs.get(Gpr::Rsp);
    let mut f = [0u64; 5];
    for (k, w) in f.iter_mut().enumerate() {
        *w = match v.mem.read_u64(rsp.wrapping_add(8 * k as u64), user) {
            Ok(w) => w,
            Err(f) => return Err(v.guest_fault(f)),
        };
    }
    let [rip, cs_raw, flags, new_rsp, ss_raw] = f;
    let (cs, ss) = (cs_raw as u16, ss_raw as u16);
    let gp = |e: u16| Event::fault(GP, u32::from(e & 0xfffc));
    if cs & 0xfffc == 0 {
        return Err(gp(0));
    }
    let rpl = (cs & 3) as u8;
    if rpl < cpl {
        return Err(gp(cs));
    }
    let d = v.segs.read_descriptor(&mut v.mem, v.gdtr, cs, 8)?;
    let mut c = d.cache(cs);
    let conforming = c.type_ & 4 != 0;
    if c.s == 0 || c.type_ & 8 == 0 || (conforming && c.dpl > rpl) || (!conforming && c.dpl != rpl)
    {
        return Err(gp(cs));
    }
    if c.present == 0 {
        return Err(Event::fault(NP, u32::from(cs & 0xfffc)));
    }
    // 64-bit code, or (at CPL 3) 32-bit code, which the engine translates too; 16-bit
    // code is not translated: its segment is refused.
    let compat = c.l == 0 && c.db != 0 && rpl == 3;
    if (c.l == 0 && !compat) || c.db != 0 && c.l != 0 {
        return Err(gp(cs));
    }
    if !canonical(rip) || (compat && rip > u64::from(c.limit)) {
        return Err(gp(0));
    }
    // SS: null only for a return to CPL < 3 with RPL = the new CPL.
    let ss_cache = if ss & 0xfffc == 0 {
        if rpl == 3 || (ss & 3) as u8 != rpl {
            return Err(gp(0));
        }
        None
    } else {
        let sd = v.segs.read_descriptor(&mut v.mem, v.gdtr, ss, 8)?;
        let s = sd.cache(ss);
        if (ss & 3) as u8 != rpl || s.s == 0 || s.type_ & 8 != 0 || s.type_ & 2 == 0 || s.dpl != rpl
        {
            return Err(gp(ss));
        }
        if s.present == 0 {
            return Err(Event::fault(SS_FAULT, u32::from(ss & 0xfffc)));
        }
        Some(s)
    };
    // Commit.
    c.type_ |= 1;
    v.segs.sregs[Sreg::Cs as usize] = c;
    let s = &mut v.segs.sregs[Sreg::Ss as usize];
    match ss_cache {
        Some(mut sc) => {
            sc.type_ |= 1;
            *s = sc;
        }
        None => {
            s.selector = ss;
            s.unusable = 1;
            s.present = 0;
        }
    }
    v.load_rflags(regs, flags, cpl, true);
    regs.set(Gpr::Rsp, new_rsp);
    if rpl > cpl {
        // Returning outward: data segments the new CPL may not use become null.
        for r in [Sreg::Ds, Sreg::Es, Sreg::Fs, Sreg::Gs] {
            let s = &mut v.segs.sregs[r as usize];
            let code_conf = s.type_ & 0xc == 0xc;
            if s.unusable == 0 && !code_conf && s.dpl < rpl {
                s.selector = 0;
                s.unusable = 1;
                s.present = 0;
            }
        }
    }
    v.cpl_changed(cpl);
    Ok(rip)
}

impl<H: Hardware, M: GuestMmu> Vcpu<'_, H, M> {
    /// Delivers `ev` to the guest with return address `rip`; the handler's RIP, or the
    /// triple fault that ends the run. A #PF's CR2 must already be in `self.cr2`.
    pub fn deliver(
        &mut self,
        regs: &mut GuestRegs,
        rip: u64,
        ev: Event,
    ) -> Result<u64, TripleFault> {
        deliver_event(self, regs, rip, rip, ev)
    }

    /// Counts a delivered event.
    fn count_delivery(&mut self, ev: Event) {
        match ev.kind {
            Kind::External => self.stats.interrupts += 1,
            Kind::Software => self.stats.software_ints += 1,
            Kind::Exception | Kind::SoftException | Kind::Trap => {
                if let Some(c) = self.stats.exceptions.get_mut(usize::from(ev.vector)) {
                    *c += 1;
                }
            }
        }
    }

    /// Delivers the highest pending external interrupt if the virtual IF allows it;
    /// `Some(handler)` if one was delivered.
    pub fn deliver_pending(
        &mut self,
        regs: &mut GuestRegs,
        rip: u64,
    ) -> Result<Option<u64>, TripleFault> {
        if !self.vif {
            return Ok(None);
        }
        let Some(vector) = self.hw.pending_highest() else {
            return Ok(None);
        };
        self.hw.take_pending(vector);
        // `sti; hlt` with the interrupt arriving between them: hardware takes it on the
        // `hlt`, returning after it.
        let mut b = [0u8; 1];
        let user = self.cpl() == 3;
        let rip = if self.sti_next == Some(rip)
            && self.mem.read(rip, user, &mut b).is_ok()
            && b[0] == 0xf4
        {
            rip + 1
        } else {
            rip
        };
        self.sti_next = None;
        let ev = Event {
            vector,
            error: None,
            kind: Kind::External,
        };
        let handler = self.deliver(regs, rip, ev)?;
        // A trap gate leaves IF set: the next pending vector must not wait for an
        // IF change.
        if self.vif {
            self.hw.rearm_attention();
        }
        Ok(Some(handler))
    }

    /// `iretq`.
    pub(super) fn iretq(
        &mut self,
        _i: &Instruction,
        regs: &mut GuestRegs,
        _next: GuestVirt,
    ) -> Step {
        let rip = iretq(self, regs)?;
        Ok(Flow::Continue(GuestVirt(rip)))
    }

    /// `int3`: #BP as a software exception (DPL-checked, returns after it).
    pub(super) fn int3(
        &mut self,
        _i: &Instruction,
        _regs: &mut GuestRegs,
        _next: GuestVirt,
    ) -> Step {
        Err(Event {
            vector: BP,
            error: None,
            kind: Kind::SoftException,
        })
    }

    /// `int n`.
    pub(super) fn int_n(
        &mut self,
        i: &Instruction,
        _regs: &mut GuestRegs,
        _next: GuestVirt,
    ) -> Step {
        Err(Event {
            vector: i.immediate8(),
            error: None,
            kind: Kind::Software,
        })
    }

    /// `ud0`/`ud1`/`ud2`: #UD.
    pub(super) fn ud(&mut self, _i: &Instruction, _regs: &mut GuestRegs, _next: GuestVirt) -> Step {
        Err(Event::ud())
    }

    /// Delivers the exception an emulation raised (registers are as before the
    /// instruction; software interrupts return to `next`).
    pub(super) fn raise(&mut self, regs: &mut GuestRegs, pc: u64, next: u64, ev: Event) -> Flow {
        // An instruction that raises an exception (or is a software interrupt) takes no
        // single-step trap after it: the delivery cleared TF.
        self.step_suppressed = true;
        let rip = if matches!(ev.kind, Kind::Software | Kind::SoftException | Kind::Trap) {
            next
        } else {
            pc
        };
        match deliver_event(self, regs, rip, pc, ev) {
            Ok(handler) => Flow::Continue(GuestVirt(handler)),
            Err(t) => Flow::Stop(VcpuStop::TripleFault(t)),
        }
    }
}
