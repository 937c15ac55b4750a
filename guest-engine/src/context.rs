//! The per-vCPU block at the start of the cache region that generated code addresses
//! RIP-relatively. Invariant: between traces (in the dispatcher) `regs` (`gpr`,
//! `rflags`) holds the complete guest integer state; inside the cache it is stale and the
//! hardware registers (plus `spill` slots named by the PC map) are authoritative.

/// Guest general-purpose registers in hardware encoding order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
#[repr(u8)]
#[allow(missing_docs)]
pub enum Gpr {
    Rax = 0,
    Rcx,
    Rdx,
    Rbx,
    Rsp,
    Rbp,
    Rsi,
    Rdi,
    R8,
    R9,
    R10,
    R11,
    R12,
    R13,
    R14,
    R15,
}

impl Gpr {
    /// All sixteen registers in encoding order.
    pub const ALL: [Gpr; 16] = [
        Gpr::Rax,
        Gpr::Rcx,
        Gpr::Rdx,
        Gpr::Rbx,
        Gpr::Rsp,
        Gpr::Rbp,
        Gpr::Rsi,
        Gpr::Rdi,
        Gpr::R8,
        Gpr::R9,
        Gpr::R10,
        Gpr::R11,
        Gpr::R12,
        Gpr::R13,
        Gpr::R14,
        Gpr::R15,
    ];

    /// The register with hardware number `n` (0..16).
    pub fn from_number(n: u8) -> Option<Gpr> {
        Self::ALL.get(usize::from(n)).copied()
    }
}

/// Guest integer state at a trace boundary.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct GuestRegs {
    /// GPRs indexed by [`Gpr`].
    pub gpr: [u64; 16],
    /// RFLAGS.
    pub rflags: u64,
}

impl GuestRegs {
    /// Value of one register.
    pub fn get(&self, r: Gpr) -> u64 {
        self.gpr[r as usize]
    }
    /// Sets one register.
    pub fn set(&mut self, r: Gpr, v: u64) {
        self.gpr[r as usize] = v;
    }
}

/// The block addressed by generated code. `#[repr(C)]`: offsets are used by emitted code.
#[derive(Debug)]
#[repr(C)]
pub struct CacheContext {
    /// Guest registers (valid in the dispatcher).
    pub regs: GuestRegs,
    /// Spill slot per GPR for glue code.
    pub spill: [u64; 16],
    /// Why the cache was left: `kind << 24 | index` (see `arch::x86_64::entry`).
    pub exit_word: u64,
    /// Target of the indirect branch that missed the IBL.
    pub ibl_target: u64,
    /// Return target popped by a translated `ret`, checked by the landing pad.
    pub ret_target: u64,
    /// Scratch for the final `jmp [rip+jump_target]` of an IBL hit.
    pub jump_target: u64,
    /// Where the enter routine jumps.
    pub enter_target: u64,
    /// Host (engine) stack pointer saved by the enter routine.
    pub host_rsp: u64,
    /// Next free byte of the per-vCPU memory-reference buffer.
    pub buf_ptr: u64,
    /// `-(end of buffer)`, so `lea rcx,[rcx+rax]; jrcxz` tests fullness flag-free.
    pub buf_neg_end: u64,
    /// IBL lookups executed (only counted when `Config::count_ibl_lookups`).
    pub ibl_lookups: u64,
    /// Non-zero when the dispatcher wants control at the next trace entry
    /// (interrupt pending, detach, invalidation); see `attention`.
    pub attention: u64,
    /// Guest RSP saved by an inline analysis call while it runs on the engine stack.
    pub call_rsp: u64,
    /// Guest RFLAGS saved by an inline analysis call.
    pub call_flags: u64,
    /// Arguments of an inline analysis call.
    pub call_args: [u64; 8],
    /// `*mut &mut dyn Tool` of the running `Engine::run` (for the analysis trampoline).
    pub tool: u64,
    /// Cache PC of a synchronous fault, written by the fault handler that redirected
    /// the faulting code to the exit routine with the `FAULT` exit word.
    pub fault_pc: u64,
    /// The index lanes of a gather/scatter with 64-bit vector indices, stored by its
    /// isolation check (`arch::x86_64::isolate`).
    pub vsib_lanes: [u64; 8],
    /// The lane address that check tested last (0 until its first lane): a lane in the
    /// reserved zone when the check trapped.
    pub vsib_lane: u64,
    /// The gather/scatter's mask as its check stored it: the AVX2 mask vector register,
    /// or the AVX-512 opmask in the first word (masked-off lanes are not checked).
    pub vsib_mask: [u64; 4],
    /// Constant bounds the isolation checks compare base registers with (`cmp reg,
    /// [bound]`, no scratch register): `[lo, hi)` of the bases whose plain check hits,
    /// then of those whose wide check hits, for the kernel's fence then the user's
    /// (`arch::x86_64::isolate`).
    pub zone_bounds: [u64; 8],
    /// The virtual RFLAGS.IF as its bit (0 or 0x200) and IOPL as its bits (`iopl << 12`),
    /// kept here for the inline `cli`/`sti`/`pushfq`/`popfq` of kernel-mode traces
    /// (`Config::inline_virtual_flags`; `vflags.rs`).
    pub vif: u64,
    /// See `vif`.
    pub viopl: u64,
    /// Non-zero while an interrupt is pending that the virtual IF holds back: an inline
    /// `sti` or `popfq` that sets IF then sets the attention byte.
    pub irq_held: u64,
    /// The RFLAGS value an inline `popfq` loads, and the guest RSP it returns to (the
    /// real `popfq` pops from here, not from the guest's stack), and the stack of the
    /// `pushfq`/`popfq` pair around an inline `sti`'s `or` into the attention byte.
    pub flags_slot: u64,
    /// See `flags_slot`.
    pub flags_rsp: u64,
    /// The guest's segment selectors (ES, CS, SS, DS, FS, GS), for the inline
    /// `mov r, sreg` of kernel-mode traces (`Config::inline_virtual_flags`; `vflags.rs`).
    pub sel: [u16; 8],
    /// The memory operand of an instruction run redirected (`redirect.rs`): its bytes,
    /// the first at the operand address's offset modulo 64.
    pub redirect_data: RedirectData,
}

/// Room for the largest redirected operand at any offset modulo 64, aligned like a cache
/// line, so that an operand placed at its address modulo 64 keeps its alignment (alignment
/// checks behave as at the guest address).
#[derive(Clone, Copy, Debug)]
#[repr(C, align(64))]
pub struct RedirectData(pub [u8; crate::redirect::REDIRECT_MAX_BYTES + 64]);

// The context must stay below the guest XSAVE area that follows it in the cache region.
const _: () = assert!(core::mem::size_of::<CacheContext>() <= crate::layout::XSAVE_GUEST_OFFSET);
