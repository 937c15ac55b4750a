//! One guest instruction run natively with its memory operand moved into engine memory.
//!
//! How the embedder performs an access that the isolation checks keep from running in
//! place (`arch::x86_64::isolate`): the guest's own mappings of the reserved zone (PML4
//! slots 256–259, which hold the engine in every shadow root), or an operand whose base
//! register lies there. The embedder walks the guest's tables, copies the operand's
//! bytes in, and [`Engine::run_redirected`] runs the instruction re-encoded with that one
//! operand RIP-relative to `CacheContext::redirect_data` (at the guest address's offset
//! modulo 64, so alignment faults are the same) — every other effect (registers, flags,
//! vector state) is the hardware's own, exactly as in place. The embedder then copies
//! the bytes back for a write. Only instructions whose one memory access is their
//! explicit operand qualify ([`redirectable`]): no control transfer, no stack, no string
//! or VSIB forms, at most 512 bytes (`fxsave`; `xsave`'s size depends on its mask: not
//! run redirected).

use iced_x86::{FlowControl, Instruction, InstructionInfoFactory, OpKind, Register};

use crate::addr::GuestVirt;
use crate::arch::cache_enter;
use crate::arch::x86_64::emit::Asm;
use crate::arch::x86_64::entry::{exit_word, EXIT_DIRECT, EXIT_FAULT};
use crate::dispatch::Engine;
use crate::error::EngineError;
use crate::layout::{GENCODE_BYTES, GENCODE_OFFSET, REDIRECT_CODE_BYTES};

/// Largest operand run redirected (`fxsave`'s 512 bytes).
pub const REDIRECT_MAX_BYTES: usize = 512;

/// What running an instruction redirected did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Redirected {
    /// It completed: registers and flags are after it, the operand bytes updated.
    Done,
    /// It raised an exception (vector and error code in the embedder's fault record, as
    /// for a fault in translated code); the guest state is that before it.
    Fault,
}

/// The size in bytes of `i`'s one memory operand, if `i` can be run redirected.
pub fn redirectable(factory: &mut InstructionInfoFactory, i: &Instruction) -> Option<usize> {
    let explicit = (0..i.op_count())
        .filter(|&k| i.op_kind(k) == OpKind::Memory)
        .count();
    let size = i.memory_size().size();
    let plain = explicit == 1
        && i.flow_control() == FlowControl::Next
        && i.stack_pointer_increment() == 0
        && i.vsib().is_none()
        && !i.is_string_instruction()
        && (1..=REDIRECT_MAX_BYTES).contains(&size)
        && factory.info(i).used_memory().len() == 1;
    // `bt*` with a register bit offset accesses beyond its operand.
    let bit_offset = matches!(
        i.mnemonic(),
        iced_x86::Mnemonic::Bt
            | iced_x86::Mnemonic::Bts
            | iced_x86::Mnemonic::Btr
            | iced_x86::Mnemonic::Btc
    ) && i.op1_kind() == OpKind::Register;
    // `xlat`'s operand is implicit ([rbx + al]) whatever its encoding says.
    let xlat = i.mnemonic() == iced_x86::Mnemonic::Xlatb;
    (plain && !bit_offset && !xlat).then_some(size)
}

/// The exit word the redirected instruction's epilogue stores (never a real exit's:
/// exit records never reach index 0xff_ffff).
const DONE: i32 = exit_word(EXIT_DIRECT, 0x00ff_ffff);

impl Engine {
    /// Runs `i` — the guest's next instruction, the guest state in the engine's registers —
    /// with its one memory operand, whose linear address is `addr`, redirected to `data`
    /// (the operand's bytes: copied in before, out after). `i` must pass [`redirectable`]
    /// with `data.len()` as its size.
    pub fn run_redirected(
        &mut self,
        i: &Instruction,
        addr: u64,
        data: &mut [u8],
    ) -> Result<Redirected, EngineError> {
        let at = (addr % 64) as usize;
        let pc = GuestVirt(i.ip());
        if data.len() > REDIRECT_MAX_BYTES {
            return Err(EngineError::Unsupported(pc));
        }
        self.ctx_mut().redirect_data.0[at..at + data.len()].copy_from_slice(data);
        let ctx = self.cache.ctx;
        let target = ctx.redirect_data + at as u64;
        let code_at = self
            .cache
            .addr(GENCODE_OFFSET + GENCODE_BYTES - REDIRECT_CODE_BYTES);
        let mut moved = *i;
        moved.set_memory_base(Register::RIP);
        moved.set_memory_index(Register::None);
        moved.set_memory_index_scale(1);
        moved.set_memory_displacement64(target);
        moved.set_memory_displ_size(8);
        moved.set_segment_prefix(Register::None);
        let mut enc = iced_x86::Encoder::new(64);
        enc.encode(&moved, code_at)
            .map_err(|_| EngineError::Encode(pc))?;
        let bytes = enc.take_buffer();
        // The encoding must be the same instruction with exactly that operand (a form
        // whose operand is implicit in its encoding would still reach the guest address).
        let check = iced_x86::Decoder::with_ip(64, &bytes, code_at, iced_x86::DecoderOptions::NONE)
            .decode();
        if check.code() != i.code()
            || !check.is_ip_rel_memory_operand()
            || check.ip_rel_memory_address() != target
        {
            return Err(EngineError::Unsupported(pc));
        }
        let mut a = Asm::new(code_at, ctx.spill);
        a.bytes(&bytes);
        a.mov_m64_imm32(ctx.exit_word, DONE);
        a.jmp_abs(self.cache.gen.exit);
        let (code, _) = a.finish()?;
        if code.len() > REDIRECT_CODE_BYTES {
            return Err(EngineError::Unsupported(pc));
        }
        // SAFETY: the last REDIRECT_CODE_BYTES of the gencode area are reserved for this
        // code (emit_gencode stays below them); the region is RWX and nothing runs in it
        // while the dispatcher does.
        unsafe {
            core::ptr::copy_nonoverlapping(code.as_ptr(), code_at as *mut u8, code.len());
        }
        self.ctx_mut().exit_word = 0;
        // SAFETY: the code just written is one guest instruction whose only memory access
        // is `redirect_data` in the context (`redirectable`), followed by the exit; the
        // context holds the guest state it runs with, as for any trace entry.
        unsafe { cache_enter(&self.cache.gen, self.cache.context(), code_at) };
        if self.ctx().exit_word == exit_word(EXIT_FAULT, 0) as u32 as u64 {
            return Ok(Redirected::Fault);
        }
        data.copy_from_slice(&self.ctx().redirect_data.0[at..at + data.len()]);
        Ok(Redirected::Done)
    }
}
