//! Forming one trace (`decode_trace`): fetch the guest code it can cover, then decode
//! and add instructions one by one (`Former::add`) until the page end, the size limit, a
//! sensitive instruction or an unconditional transfer ends it, following short direct
//! jumps and cutting basic blocks at branches. The invariants are `decode.rs`'s.
//!
//! The fetch is lazy: a first chunk of the window, the rest (and the next page's first
//! bytes) only when decoding comes within an instruction of the chunk's end or a decision
//! depends on the whole window; every decision is the one the whole window gives.

use alloc::vec::Vec;

use iced_x86::{Code, Decoder, DecoderError, DecoderOptions, Instruction, Mnemonic};

use super::{
    classify, gpr_usage, ins_kind, is_string_op, mem_operands, strip_rep, Class, DecodedInsn,
    DecodedTrace, FetchFault, Scratch, SensitiveKinds, TraceEnd, Usage,
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

/// The fetch buffer: the whole window a trace can cover, and room past it.
pub(crate) const FETCH_BYTES: usize = MAX_TRACE_BYTES + 2 * MAX_INSN_BYTES;

/// Bytes fetched first: most traces are much shorter (~30 bytes).
const FIRST_FETCH: usize = 256;

/// The window of guest code a trace starting at `va` can cover: up to `MAX_TRACE_BYTES`
/// (+ one instruction) of its page, plus the first bytes of the next page when the trace
/// may reach the page end; and how much of it is fetched so far.
#[derive(Clone, Copy)]
struct Window {
    va: GuestVirt,
    pa: GuestPhys,
    mode: Mode,
    /// Bytes on the trace's first page.
    in_page: usize,
    /// Bytes the whole window holds; while the next page's part is not fetched,
    /// `in_page` (all that `limit_reached` and `maybe_follow` need of it then).
    avail: usize,
    /// Bytes fetched so far (`buf[..fetched]`).
    fetched: usize,
    /// The whole window is fetched (`fetched == avail`).
    whole: bool,
}

impl Window {
    /// Fetches the first chunk of the window at `va`.
    fn open(
        mem: &mut dyn GuestMemory,
        va: GuestVirt,
        pa: GuestPhys,
        mode: Mode,
        buf: &mut [u8; FETCH_BYTES],
    ) -> Result<Self, FetchFault> {
        let in_page = (PAGE_BYTES - (va.0 & (PAGE_BYTES - 1))) as usize;
        let cross_page = in_page < MAX_TRACE_BYTES + MAX_INSN_BYTES;
        let first_page = in_page.min(MAX_TRACE_BYTES + MAX_INSN_BYTES);
        let fetched = first_page.min(FIRST_FETCH);
        if !mem.read(pa, &mut buf[..fetched]) {
            return Err(FetchFault(va));
        }
        Ok(Self {
            va,
            pa,
            mode,
            in_page,
            avail: first_page,
            fetched,
            whole: fetched == first_page && !cross_page,
        })
    }

    /// Fetches the rest of the window: the rest of the first page's part, then (when the
    /// trace may reach the page end) the next page's first bytes, if it is mapped.
    fn complete(
        &mut self,
        mem: &mut dyn GuestMemory,
        buf: &mut [u8; FETCH_BYTES],
    ) -> Result<(), FetchFault> {
        let first_page = self.in_page.min(MAX_TRACE_BYTES + MAX_INSN_BYTES);
        if self.fetched < first_page {
            let at = GuestPhys(self.pa.0 + self.fetched as u64);
            if !mem.read(at, &mut buf[self.fetched..first_page]) {
                return Err(FetchFault(self.va));
            }
        }
        self.avail = first_page;
        if self.in_page < MAX_TRACE_BYTES + MAX_INSN_BYTES {
            let in_page = self.in_page;
            let next = GuestVirt(self.va.page().0.wrapping_add(PAGE_BYTES));
            let extra = match mem.translate(next, self.mode) {
                Some(npa) if mem.read(npa, &mut buf[in_page..in_page + MAX_INSN_BYTES]) => {
                    MAX_INSN_BYTES
                }
                _ => 0,
            };
            self.avail = in_page + extra;
        }
        self.fetched = self.avail;
        self.whole = true;
        Ok(())
    }

    /// Whether an instruction at `off` (and the byte after it) may lie past what is
    /// fetched: the whole window must be fetched before it is decoded.
    #[inline]
    fn short_at(&self, off: usize) -> bool {
        !self.whole && off + MAX_INSN_BYTES + 1 > self.fetched
    }
}

/// Whether `i` (at virtual CPL 0, followed by the byte `next` if known) runs inline
/// against the virtual state in the cache context (`crate::vflags`): `cli`, `pushfq`,
/// `popfq`, `sti` unless a `hlt` follows (or the next byte is unknown), and `mov` of a
/// segment selector into a register.
fn inline_flag_insn(i: &Instruction, next: Option<u8>) -> bool {
    match i.code() {
        Code::Cli | Code::Pushfq | Code::Popfq => true,
        Code::Sti => next.is_some_and(|b| b != 0xF4),
        Code::Mov_rm16_Sreg | Code::Mov_r32m16_Sreg | Code::Mov_r64m16_Sreg => {
            i.op0_kind() == iced_x86::OpKind::Register
        }
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
    let vecs = scratch.trace_vecs();
    // (Bytes past `fetched` are stale, never read.)
    let Scratch {
        usage,
        sensitive,
        fetch,
        ..
    } = scratch;
    let buf = &mut **fetch;
    let window = Window::open(mem, va, pa, mode, buf)?;
    let mut f = Former::new(window, va, pa, mode, inline_flags, vecs);
    let mut instr = Instruction::default();
    let end = 'trace: loop {
        // A decoder over what is fetched, at the next instruction; a new one after the
        // rest of the window is fetched.
        let mut dec = Decoder::with_ip(
            mode.bitness(),
            &buf[..f.w.fetched],
            va.0.wrapping_add(f.off as u64),
            DecoderOptions::NONE,
        );
        dec.set_position(f.off)
            .map_err(|_| FetchFault(GuestVirt(va.0.wrapping_add(f.off as u64))))?;
        loop {
            let pc = va.0.wrapping_add(f.off as u64);
            if f.limit_reached() {
                break 'trace TraceEnd::FallThrough(pc);
            }
            if f.w.short_at(f.off) {
                break;
            }
            dec.decode_out(&mut instr);
            if instr.is_invalid() {
                break 'trace f.undecodable(&dec, buf, pc)?;
            }
            match f.add(usage, sensitive, buf, &instr, pc)? {
                Added::End(end) => break 'trace end,
                Added::Next => {}
                Added::Jumped(target) => {
                    if f.w.short_at(f.off) {
                        break;
                    }
                    dec.set_ip(target);
                    dec.set_position(f.off)
                        .map_err(|_| FetchFault(GuestVirt(target)))?;
                }
                Added::NeedsWindow => break,
            }
        }
        f.w.complete(mem, buf)?;
    };
    Ok(f.finish(end))
}

/// What `Former::add` did with an instruction.
enum Added {
    /// Added; the trace goes on at the next instruction.
    Next,
    /// A followed jump: the trace goes on at this target (`Former::off` is there).
    Jumped(u64),
    /// The trace ends (before or after the instruction).
    End(TraceEnd),
    /// Not added: deciding needs the whole window fetched.
    NeedsWindow,
}

/// One trace being formed: the window of its guest code, where it is, and the trace so
/// far.
struct Former {
    w: Window,
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

impl Former {
    /// A trace at `va` in the (empty) vectors `(insns, info, bbls)`.
    fn new(
        w: Window,
        va: GuestVirt,
        pa: GuestPhys,
        mode: Mode,
        inline_flags: bool,
        (insns, info, bbls): (Vec<DecodedInsn>, Vec<InsInfo>, Vec<Bbl>),
    ) -> Self {
        Self {
            w,
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
    /// limit, or where a followed jump moved the decoder past the window (a
    /// partial-page window).
    #[inline]
    fn limit_reached(&self) -> bool {
        let w = &self.w;
        let window_end = w.avail < w.in_page && self.off + MAX_INSN_BYTES > w.avail;
        self.off >= w.in_page || self.t.insns.len() >= self.max_insns || window_end
    }

    /// How the trace ends at `pc`, where iced decoded nothing: out of bytes, it falls
    /// through to the next page (or, if nothing was decoded, that page's fetch faults);
    /// else the bytes leave for the virtual CPU as an undefined instruction.
    fn undecodable(
        &self,
        dec: &Decoder<'_>,
        buf: &[u8; FETCH_BYTES],
        pc: u64,
    ) -> Result<TraceEnd, FetchFault> {
        // (An instruction is decoded only with `MAX_INSN_BYTES` + 1 bytes fetched past it
        // or the whole window: out of bytes means out of the window.)
        if dec.last_error() == DecoderError::NoMoreBytes {
            if self.t.insns.is_empty() {
                let next_page = self.t.start.page().0.wrapping_add(PAGE_BYTES);
                return Err(FetchFault(GuestVirt(next_page)));
            }
            return Ok(TraceEnd::FallThrough(pc));
        }
        let mut bytes = [0u8; MAX_INSN_BYTES];
        let n = (self.w.fetched - self.off).min(MAX_INSN_BYTES);
        bytes[..n].copy_from_slice(&buf[self.off..self.off + n]);
        Ok(TraceEnd::Sensitive(SensitiveInsn {
            pc: GuestVirt(pc),
            len: 0,
            bytes,
            kind: SensitiveKind::Undefined,
        }))
    }

    /// Adds `instr`, decoded at `pc`, to the trace; or ends the trace before it (it is
    /// sensitive) or after it (a transfer); or leaves it for the whole window.
    #[inline]
    fn add(
        &mut self,
        usage: &mut Usage,
        sensitive: &mut SensitiveKinds,
        buf: &[u8; FETCH_BYTES],
        instr: &Instruction,
        pc: u64,
    ) -> Result<Added, FetchFault> {
        let len = instr.len();
        // A fixed-size copy (the buffer extends `MAX_INSN_BYTES` past anything
        // decodable): the bytes past `len` are whatever followed the instruction.
        let mut bytes = [0u8; MAX_INSN_BYTES];
        bytes.copy_from_slice(&buf[self.off..self.off + MAX_INSN_BYTES]);
        let virt_flags = self.runs_on_virtual_flags(buf, instr, len);
        if let Some(kind) = self
            .leaves_as_sensitive(sensitive, instr)
            .filter(|_| !virt_flags)
        {
            // (The platform gets them zero-padded.)
            bytes[len..].fill(0);
            return Ok(Added::End(TraceEnd::Sensitive(SensitiveInsn {
                pc: GuestVirt(pc),
                len: len as u8,
                bytes,
                kind,
            })));
        }
        let class = if virt_flags {
            Class::VirtFlags
        } else {
            match self.maybe_follow(classify(instr), pc) {
                Some(c) => c,
                None => return Ok(Added::NeedsWindow),
            }
        };
        self.push(usage, instr, bytes, class, pc);
        self.off += len;
        self.t.guest_bytes += len as u64;
        Ok(self.after(class))
    }

    /// Whether `instr` (`len` bytes at `off`) runs inline against the virtual flags
    /// (`Config::inline_virtual_flags`, virtual CPL 0, not stepping).
    #[inline]
    fn runs_on_virtual_flags(
        &self,
        buf: &[u8; FETCH_BYTES],
        instr: &Instruction,
        len: usize,
    ) -> bool {
        // (Fetched: see `Window::short_at`.)
        let next_byte = (self.off + len < self.w.fetched).then(|| buf[self.off + len]);
        self.inline_flags
            && self.mode.cpl() == 0
            && !self.mode.is_stepping()
            && inline_flag_insn(instr, next_byte)
    }

    /// The kind `instr` leaves the cache as, if it cannot be translated: a sensitive
    /// instruction, or (as one) 32-bit code without a 64-bit translation and `rdtsc`
    /// under CR4.TSD.
    #[inline]
    fn leaves_as_sensitive(
        &self,
        sensitive: &mut SensitiveKinds,
        instr: &Instruction,
    ) -> Option<SensitiveKind> {
        sensitive.of(instr).or_else(|| {
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
    /// `MAX_FOLLOWED_JUMPS` per trace, none while stepping). `None`: whether it fits
    /// needs the whole window.
    #[inline]
    fn maybe_follow(&mut self, class: Class, pc: u64) -> Option<Class> {
        let Class::Jmp { target } = class else {
            return Some(class);
        };
        let w = &self.w;
        let toff = target.checked_sub(self.t.start.0);
        if toff.is_some_and(|t| t < w.in_page as u64 && w.short_at(t as usize)) {
            return None;
        }
        let fits = toff.is_some_and(|toff| {
            toff as usize + MAX_INSN_BYTES <= w.avail && (toff as usize) < w.in_page
        });
        let seen = target == pc || self.t.info.iter().any(|i| i.address.0 == target);
        if fits && !seen && self.followed < MAX_FOLLOWED_JUMPS && !self.mode.is_stepping() {
            self.followed += 1;
            return Some(Class::JmpElided { target });
        }
        Some(class)
    }

    /// Appends `instr` and its description for tools (`InsInfo`).
    #[inline]
    fn push(
        &mut self,
        usage: &mut Usage,
        instr: &Instruction,
        bytes: [u8; MAX_INSN_BYTES],
        class: Class,
        pc: u64,
    ) {
        let len = instr.len();
        let rep = (instr.has_rep_prefix() || instr.has_repne_prefix()) && is_string_op(instr);
        // One look at iced's usage information (or its remembered answer) serves the
        // tools' operands and the translator's register choices (`isolate`, `mangle`).
        let (gprs_used, gprs_written, mem_ops) = if rep {
            let (used, written) = gpr_usage(usage.factory.info(instr));
            // Describe one iteration: decode the instruction without its prefix.
            let (sb, sn) = strip_rep(&bytes[..len]);
            let bitness = self.mode.bitness();
            let mut d2 = Decoder::with_ip(bitness, &sb[..sn], pc, DecoderOptions::NONE);
            let one = d2.decode();
            (used, written, mem_operands(&mut usage.factory, &one))
        } else {
            usage.of(instr)
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
    /// also moves the trace to its target, where the caller moves the decoder); a
    /// transfer ends the trace.
    #[inline]
    fn after(&mut self, class: Class) -> Added {
        match class {
            Class::JmpElided { target } => {
                self.close_bbl();
                self.off = target.wrapping_sub(self.t.start.0) as usize;
                return Added::Jumped(target);
            }
            Class::Jcc { .. } | Class::LoopLike { .. } => self.close_bbl(),
            Class::Jmp { .. }
            | Class::Call { .. }
            | Class::JmpInd
            | Class::CallInd
            | Class::Ret { .. } => return Added::End(TraceEnd::Transfer),
            Class::Plain | Class::RipRel | Class::VirtFlags => {}
        }
        Added::Next
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
