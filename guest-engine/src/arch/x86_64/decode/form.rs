//! Forming one trace (`decode_trace`): fetch the guest code it can cover, then decode
//! and add instructions one by one (`Former::add`) until the page end, the size limit, a
//! sensitive instruction or an unconditional transfer ends it, following short direct
//! jumps and cutting basic blocks at branches. The invariants are `decode.rs`'s.

use alloc::vec::Vec;

use iced_x86::{
    Code, Decoder, DecoderError, DecoderOptions, Instruction, InstructionInfoFactory, Mnemonic,
};

use super::{
    classify, gpr_usage, ins_kind, is_string_op, mem_operands, mem_operands_of, sensitive_kind,
    strip_rep, Class, DecodedInsn, DecodedTrace, FetchFault, Scratch, TraceEnd,
};
use crate::addr::{GuestPhys, GuestVirt, PAGE_BYTES};
use crate::guest_memory::{GuestMemory, Mode};
use crate::instrument::{Bbl, InsInfo};
use crate::layout::{MAX_INSN_BYTES, MAX_TRACE_INSNS};
use crate::platform::{SensitiveInsn, SensitiveKind};

/// Direct jumps one trace may follow.
const MAX_FOLLOWED_JUMPS: usize = 4;

/// Bytes a trace can span: `MAX_TRACE_INSNS` maximal instructions.
const MAX_TRACE_BYTES: usize = MAX_TRACE_INSNS * MAX_INSN_BYTES;

/// Fetches the code a trace starting at `va` can cover: up to `MAX_TRACE_BYTES` of its
/// page, plus the first bytes of the next page when the trace may reach the page end.
/// Returns (bytes on the first page, bytes available).
fn fetch(
    mem: &mut dyn GuestMemory,
    va: GuestVirt,
    pa: GuestPhys,
    mode: Mode,
    buf: &mut [u8; MAX_TRACE_BYTES + 2 * MAX_INSN_BYTES],
) -> Result<(usize, usize), FetchFault> {
    let in_page = (PAGE_BYTES - (va.0 & (PAGE_BYTES - 1))) as usize;
    if in_page >= MAX_TRACE_BYTES + MAX_INSN_BYTES {
        if !mem.read(pa, &mut buf[..MAX_TRACE_BYTES + MAX_INSN_BYTES]) {
            return Err(FetchFault(va));
        }
        return Ok((in_page, MAX_TRACE_BYTES + MAX_INSN_BYTES));
    }
    if !mem.read(pa, &mut buf[..in_page]) {
        return Err(FetchFault(va));
    }
    let next = GuestVirt(va.page().0.wrapping_add(PAGE_BYTES));
    let extra = match mem.translate(next, mode) {
        Some(npa) if mem.read(npa, &mut buf[in_page..in_page + MAX_INSN_BYTES]) => MAX_INSN_BYTES,
        _ => 0,
    };
    Ok((in_page, in_page + extra))
}

/// Whether `i` (at virtual CPL 0, followed by the byte `next` if known) runs inline
/// against the virtual flags (`crate::vflags`): `cli`, `pushfq`, `popfq`, and `sti`
/// unless a `hlt` follows (or the next byte is unknown).
fn inline_flag_insn(i: &Instruction, next: Option<u8>) -> bool {
    match i.code() {
        Code::Cli | Code::Pushfq | Code::Popfq => true,
        Code::Sti => next.is_some_and(|b| b != 0xF4),
        _ => false,
    }
}

/// Decodes the trace starting at `va` (physical `pa`) in `mode`: fetch its window, then
/// add instructions until a limit, a sensitive instruction or a transfer ends it.
pub(crate) fn decode_trace(
    mem: &mut dyn GuestMemory,
    va: GuestVirt,
    pa: GuestPhys,
    mode: Mode,
    inline_flags: bool,
    scratch: &mut Scratch,
) -> Result<DecodedTrace, FetchFault> {
    let mut buf = [0u8; MAX_TRACE_BYTES + 2 * MAX_INSN_BYTES];
    let (in_page, avail) = fetch(mem, va, pa, mode, &mut buf)?;
    let window = Window {
        buf: &buf,
        in_page,
        avail,
    };
    let vecs = scratch.trace_vecs();
    let mut f = Former::new(window, va, pa, mode, inline_flags, vecs);
    let mut instr = Instruction::default();
    let end = loop {
        let pc = va.0.wrapping_add(f.off as u64);
        if f.limit_reached() {
            break TraceEnd::FallThrough(pc);
        }
        f.dec.decode_out(&mut instr);
        if instr.is_invalid() {
            break f.undecodable(pc)?;
        }
        if let Some(end) = f.add(&mut scratch.factory, &instr, pc)? {
            break end;
        }
    };
    Ok(f.finish(end))
}

/// The guest code `fetch` brought in for one trace.
#[derive(Clone, Copy)]
struct Window<'b> {
    buf: &'b [u8; MAX_TRACE_BYTES + 2 * MAX_INSN_BYTES],
    /// Bytes on the trace's first page.
    in_page: usize,
    /// Bytes fetched.
    avail: usize,
}

/// One trace being formed: the decoder over the fetched window, where it is, and the
/// trace so far.
struct Former<'b> {
    w: Window<'b>,
    dec: Decoder<'b>,
    mode: Mode,
    inline_flags: bool,
    /// A stepping trace is one instruction (`Mode::stepping`).
    max_insns: usize,
    /// Offset of the next instruction from the trace's start.
    off: usize,
    /// The first instruction of the basic block not closed yet.
    bbl_first: usize,
    /// Direct jumps followed so far.
    followed: usize,
    t: DecodedTrace,
}

impl<'b> Former<'b> {
    /// A trace at `va` in the (empty) vectors `(insns, info, bbls)`.
    fn new(
        w: Window<'b>,
        va: GuestVirt,
        pa: GuestPhys,
        mode: Mode,
        inline_flags: bool,
        (insns, info, bbls): (Vec<DecodedInsn>, Vec<InsInfo>, Vec<Bbl>),
    ) -> Self {
        let dec = Decoder::with_ip(
            mode.bitness(),
            &w.buf[..w.avail],
            va.0,
            DecoderOptions::NONE,
        );
        Self {
            w,
            dec,
            mode,
            inline_flags,
            max_insns: if mode.is_stepping() {
                1
            } else {
                MAX_TRACE_INSNS
            },
            off: 0,
            bbl_first: 0,
            followed: 0,
            t: DecodedTrace {
                start: va,
                pa,
                insns,
                info,
                bbls,
                end: TraceEnd::Transfer,
                guest_bytes: 0,
            },
        }
    }

    /// Whether the trace stops before the next instruction: at the page end, at the size
    /// limit, or where a followed jump moved the decoder past the fetched window (a
    /// partial-page fetch).
    #[inline]
    fn limit_reached(&self) -> bool {
        let w = &self.w;
        let window_end = w.avail < w.in_page && self.off + MAX_INSN_BYTES > w.avail;
        self.off >= w.in_page || self.t.insns.len() >= self.max_insns || window_end
    }

    /// How the trace ends at `pc`, where iced decoded nothing: out of bytes, it falls
    /// through to the next page (or, if nothing was decoded, that page's fetch faults);
    /// else the bytes leave for the virtual CPU as an undefined instruction.
    fn undecodable(&self, pc: u64) -> Result<TraceEnd, FetchFault> {
        if self.dec.last_error() == DecoderError::NoMoreBytes {
            if self.t.insns.is_empty() {
                let next_page = self.t.start.page().0.wrapping_add(PAGE_BYTES);
                return Err(FetchFault(GuestVirt(next_page)));
            }
            return Ok(TraceEnd::FallThrough(pc));
        }
        let mut bytes = [0u8; MAX_INSN_BYTES];
        let n = (self.w.avail - self.off).min(MAX_INSN_BYTES);
        bytes[..n].copy_from_slice(&self.w.buf[self.off..self.off + n]);
        Ok(TraceEnd::Sensitive(SensitiveInsn {
            pc: GuestVirt(pc),
            len: 0,
            bytes,
            kind: SensitiveKind::Undefined,
        }))
    }

    /// Adds `instr`, decoded at `pc`, to the trace; or ends the trace before it (it is
    /// sensitive) or after it (a transfer). `Some` is how the trace ends.
    #[inline]
    fn add(
        &mut self,
        factory: &mut InstructionInfoFactory,
        instr: &Instruction,
        pc: u64,
    ) -> Result<Option<TraceEnd>, FetchFault> {
        let len = instr.len();
        let mut bytes = [0u8; MAX_INSN_BYTES];
        bytes[..len].copy_from_slice(&self.w.buf[self.off..self.off + len]);
        let virt_flags = self.runs_on_virtual_flags(instr, len);
        if let Some(kind) = self.leaves_as_sensitive(instr).filter(|_| !virt_flags) {
            return Ok(Some(TraceEnd::Sensitive(SensitiveInsn {
                pc: GuestVirt(pc),
                len: len as u8,
                bytes,
                kind,
            })));
        }
        let class = if virt_flags {
            Class::VirtFlags
        } else {
            self.maybe_follow(classify(instr), pc)
        };
        self.push(factory, instr, bytes, class, pc);
        self.off += len;
        self.t.guest_bytes += len as u64;
        self.after(class)
    }

    /// Whether `instr` (`len` bytes at `off`) runs inline against the virtual flags
    /// (`Config::inline_virtual_flags`, virtual CPL 0, not stepping).
    #[inline]
    fn runs_on_virtual_flags(&self, instr: &Instruction, len: usize) -> bool {
        let next_byte = (self.off + len < self.w.avail).then(|| self.w.buf[self.off + len]);
        self.inline_flags
            && self.mode.cpl() == 0
            && !self.mode.is_stepping()
            && inline_flag_insn(instr, next_byte)
    }

    /// The kind `instr` leaves the cache as, if it cannot be translated: a sensitive
    /// instruction, or (as one) 32-bit code without a 64-bit translation and `rdtsc`
    /// under CR4.TSD.
    #[inline]
    fn leaves_as_sensitive(&self, instr: &Instruction) -> Option<SensitiveKind> {
        sensitive_kind(instr).or_else(|| {
            if self.mode.is_compat() && super::super::compat::untranslatable(instr) {
                Some(SensitiveKind::Other)
            } else if self.mode.is_timestamp_faulting() && instr.mnemonic() == Mnemonic::Rdtsc {
                Some(SensitiveKind::Timestamp)
            } else {
                None
            }
        })
    }

    /// `class`, or for a direct jump (at `pc`) that stays on the trace's page and does
    /// not loop back into the trace, `JmpElided`: the trace follows it (at most
    /// `MAX_FOLLOWED_JUMPS` per trace, none while stepping).
    #[inline]
    fn maybe_follow(&mut self, class: Class, pc: u64) -> Class {
        let Class::Jmp { target } = class else {
            return class;
        };
        let w = &self.w;
        let fits = target.checked_sub(self.t.start.0).is_some_and(|toff| {
            toff as usize + MAX_INSN_BYTES <= w.avail && (toff as usize) < w.in_page
        });
        let seen = target == pc || self.t.info.iter().any(|i| i.address.0 == target);
        if fits && !seen && self.followed < MAX_FOLLOWED_JUMPS && !self.mode.is_stepping() {
            self.followed += 1;
            return Class::JmpElided { target };
        }
        class
    }

    /// Appends `instr` and its description for tools (`InsInfo`).
    #[inline]
    fn push(
        &mut self,
        factory: &mut InstructionInfoFactory,
        instr: &Instruction,
        bytes: [u8; MAX_INSN_BYTES],
        class: Class,
        pc: u64,
    ) {
        let len = instr.len();
        let rep = (instr.has_rep_prefix() || instr.has_repne_prefix()) && is_string_op(instr);
        // One look at iced's usage information serves the tools' operands and the
        // translator's register choices (`isolate`, `mangle`).
        let info = factory.info(instr);
        let (gprs_used, gprs_written) = gpr_usage(info);
        let mem_ops = if rep {
            // Describe one iteration: decode the instruction without its prefix.
            let (sb, sn) = strip_rep(&bytes[..len]);
            let bitness = self.mode.bitness();
            let mut d2 = Decoder::with_ip(bitness, &sb[..sn], pc, DecoderOptions::NONE);
            let one = d2.decode();
            mem_operands(factory, &one)
        } else {
            mem_operands_of(info, instr)
        };
        self.t.info.push(InsInfo {
            address: GuestVirt(pc),
            len: len as u8,
            kind: ins_kind(class),
            mem: mem_ops,
            rep,
            opcode: instr.mnemonic() as u16,
        });
        self.t.insns.push(DecodedInsn {
            instr: *instr,
            bytes,
            class,
            gprs_used,
            gprs_written,
        });
    }

    /// After an instruction of `class`: a branch closes its basic block (a followed jump
    /// also moves the decoder to its target); a transfer ends the trace.
    #[inline]
    fn after(&mut self, class: Class) -> Result<Option<TraceEnd>, FetchFault> {
        match class {
            Class::JmpElided { target } => {
                self.close_bbl();
                self.off = target.wrapping_sub(self.t.start.0) as usize;
                self.dec.set_ip(target);
                self.dec
                    .set_position(self.off)
                    .map_err(|_| FetchFault(GuestVirt(target)))?;
            }
            Class::Jcc { .. } | Class::LoopLike { .. } => self.close_bbl(),
            Class::Jmp { .. }
            | Class::Call { .. }
            | Class::JmpInd
            | Class::CallInd
            | Class::Ret { .. } => return Ok(Some(TraceEnd::Transfer)),
            Class::Plain | Class::RipRel | Class::VirtFlags => {}
        }
        Ok(None)
    }

    /// Closes the basic block `bbl_first..` (at least one instruction).
    #[inline]
    fn close_bbl(&mut self) {
        let n = self.t.insns.len();
        self.t.bbls.push(Bbl {
            first: self.bbl_first,
            count: n - self.bbl_first,
            address: self.t.info[self.bbl_first].address,
        });
        self.bbl_first = n;
    }

    /// The trace, ended by `end`, its last basic block closed.
    fn finish(mut self, end: TraceEnd) -> DecodedTrace {
        if self.bbl_first < self.t.insns.len() {
            self.close_bbl();
        }
        self.t.end = end;
        self.t
    }
}
