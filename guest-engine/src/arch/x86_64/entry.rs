//! Cache enter/exit: the only hand-written context switch between the engine and
//! translated code. (The ring-0 stubs — IDT, gate — are the engine image's, in
//! `guest-engine/image/src/entry.rs`.)
//!
//! # Register convention
//!
//! * **No stolen registers.** While translated code runs, every guest GPR lives in its own
//!   hardware register and guest RFLAGS in the hardware RFLAGS; the guest RSP is the
//!   hardware RSP. Glue code never pushes to the guest stack (the 128-byte red zone below
//!   RSP belongs to the guest) except where the guest instruction itself pushes (`call`).
//! * Glue code gets scratch registers by spilling them to `CacheContext::spill[reg]`,
//!   addressed **RIP-relatively** (the context sits at the start of the cache region, so
//!   every trace reaches it with a disp32). The PC map (`recover`) says, for every cache
//!   PC, which guest registers are spilled there.
//! * Glue code avoids EFLAGS: comparisons use `lea` + `jrcxz`; where a flag-writing form
//!   (`cmp`, `add`) is cheaper, it is used only where liveness proves all six status flags
//!   dead.
//! * Indirect-branch glue uses RAX, RCX, RDX (spilled); RDX carries the guest target.
//!
//! # Enter routine (`sysv64`, no arguments)
//!
//! Saves the host callee-saved registers and host RFLAGS on the host stack, stores the host
//! RSP in `ctx.host_rsp`, optionally swaps x87/SSE/AVX state (XSAVE host, XRSTOR guest), loads guest RFLAGS (`popfq` while still on the host stack) and all
//! sixteen guest GPRs from `ctx.regs`, then `jmp [ctx.enter_target]`.
//!
//! # Exit routine
//!
//! Reached by `jmp` with all guest registers in place and `ctx.exit_word` set. Stores the
//! GPRs into `ctx.regs`, switches to the host stack, stores guest RFLAGS, restores host
//! RFLAGS and callee-saved registers and returns to the enter routine's caller.
//!
//! # Exit codes (`ctx.exit_word = kind << 24 | index`)
//!
//! | kind | name            | index                  | meaning                                   |
//! |------|-----------------|------------------------|-------------------------------------------|
//! | 0    | `DIRECT`        | exit record            | direct branch / fall-through not yet linked |
//! | 1    | `IBL_MISS`      | 0 (target in `ctx.ibl_target`) | indirect branch or return missed the lookup table |
//! | 2    | `SENSITIVE`     | exit record            | sensitive instruction at the record's guest PC |
//! | 3    | `ATTENTION`     | exit record            | attention byte set at a trace entry       |
//! | 4    | `PA_MISMATCH`   | exit record            | cross-page entry found a different guest PA |
//! | 5    | `BUFFER_FULL`   | exit record            | memory-reference buffer full; resume at record's PC |
//! | 6    | `ANALYSIS_CALL` | exit record            | call an analysis routine; resume at record's PC |
//! | 7    | `FAULT`         | 0 (PC in `ctx.fault_pc`) | a fault handler redirected faulting cache code to the exit routine |
//! | 8    | `HOIST_MISS`    | exit record            | a check hoisted to a self-looping trace's top found a register in the reserved zone |
//!
//! # Inline analysis calls
//!
//! An analysis call without physical-address arguments runs without leaving the cache:
//! the caller-saved GPRs go to `ctx.regs`, the arguments to `ctx.call_args`, RSP switches
//! to the engine stack below `ctx.host_rsp`, RFLAGS go to `ctx.call_flags` (and x87/SSE/AVX
//! state to the guest XSAVE area when the engine uses vector registers), then
//! `analysis_trampoline(ctx.tool, routine, &ctx.call_args, n)` is called (`sysv64`).
//!
//! # Faults inside the cache
//!
//! A synchronous fault in translated code is turned into an exit by its handler (the host
//! harness's SIGSEGV handler; in the engine image, `kpin_exc_14` and `kpin_trap_common`): it
//! stores the faulting PC in `ctx.fault_pc` and resumes at the *fault exit* (`Gencode::
//! fault_exit`: it stores the `FAULT` word in `ctx.exit_word` and jumps to the exit routine)
//! with the faulting register state. (Under nested KVM each instruction of the image's
//! ring-0 handler is emulated, ~1.5·10^3 cycles each: what CPL 3 can do, it does.) The
//! dispatcher maps the PC back to the guest instruction and reloads spilled registers
//! (`recover.rs`, `Engine::recover_regs`).

use crate::context::CacheContext;
use crate::layout::{GENCODE_BYTES, TABLE_SLOTS, XSAVE_MASK};

use super::emit::{reg, Asm};

/// Exit kind: direct exit not yet linked.
pub const EXIT_DIRECT: u32 = 0;
/// Exit kind: indirect-branch lookup miss.
pub const EXIT_IBL_MISS: u32 = 1;
/// Exit kind: sensitive instruction.
pub const EXIT_SENSITIVE: u32 = 2;
/// Exit kind: attention byte set.
pub const EXIT_ATTENTION: u32 = 3;
/// Exit kind: PA validation failed at a cross-page entry.
pub const EXIT_PA_MISMATCH: u32 = 4;
/// Exit kind: memory-reference buffer full.
pub const EXIT_BUFFER_FULL: u32 = 5;
/// Exit kind: analysis-routine call.
pub const EXIT_ANALYSIS_CALL: u32 = 6;
/// Exit kind: fault in cache code redirected to the exit routine.
pub const EXIT_FAULT: u32 = 7;
/// Exit kind: a hoisted isolation check hit (`isolate/`).
pub const EXIT_HOIST_MISS: u32 = 8;
/// Number of exit kinds.
pub const EXIT_KINDS: usize = 9;

/// Builds an exit word.
pub const fn exit_word(kind: u32, index: u32) -> i32 {
    ((kind << 24) | (index & 0x00FF_FFFF)) as i32
}

/// Splits an exit word into (kind, index).
pub const fn split_exit_word(w: u64) -> (u32, u32) {
    (((w >> 24) & 0xFF) as u32, (w & 0x00FF_FFFF) as u32)
}

/// Absolute addresses of the context fields generated code uses.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CtxAddrs {
    pub regs: u64,
    pub rflags: u64,
    pub spill: u64,
    pub exit_word: u64,
    pub ibl_target: u64,
    pub ret_target: u64,
    pub jump_target: u64,
    pub enter_target: u64,
    pub host_rsp: u64,
    pub buf_ptr: u64,
    pub buf_neg_end: u64,
    pub ibl_lookups: u64,
    pub attention: u64,
    pub fault_pc: u64,
    pub call_rsp: u64,
    pub call_flags: u64,
    pub call_args: u64,
    pub tool: u64,
    pub vsib_lanes: u64,
    pub vsib_lane: u64,
    pub vsib_mask: u64,
    pub zone_bounds: u64,
    pub redirect_data: u64,
    pub vif: u64,
    pub viopl: u64,
    pub irq_held: u64,
    pub flags_slot: u64,
    pub flags_rsp: u64,
    pub sel: u64,
}

impl CtxAddrs {
    pub(crate) fn new(ctx: u64) -> Self {
        use core::mem::offset_of;
        let o = |off: usize| ctx + off as u64;
        let regs = o(offset_of!(CacheContext, regs));
        Self {
            regs,
            rflags: regs + 16 * 8,
            spill: o(offset_of!(CacheContext, spill)),
            exit_word: o(offset_of!(CacheContext, exit_word)),
            ibl_target: o(offset_of!(CacheContext, ibl_target)),
            ret_target: o(offset_of!(CacheContext, ret_target)),
            jump_target: o(offset_of!(CacheContext, jump_target)),
            enter_target: o(offset_of!(CacheContext, enter_target)),
            host_rsp: o(offset_of!(CacheContext, host_rsp)),
            buf_ptr: o(offset_of!(CacheContext, buf_ptr)),
            buf_neg_end: o(offset_of!(CacheContext, buf_neg_end)),
            ibl_lookups: o(offset_of!(CacheContext, ibl_lookups)),
            attention: o(offset_of!(CacheContext, attention)),
            fault_pc: o(offset_of!(CacheContext, fault_pc)),
            call_rsp: o(offset_of!(CacheContext, call_rsp)),
            call_flags: o(offset_of!(CacheContext, call_flags)),
            call_args: o(offset_of!(CacheContext, call_args)),
            tool: o(offset_of!(CacheContext, tool)),
            vsib_lanes: o(offset_of!(CacheContext, vsib_lanes)),
            vsib_lane: o(offset_of!(CacheContext, vsib_lane)),
            vsib_mask: o(offset_of!(CacheContext, vsib_mask)),
            zone_bounds: o(offset_of!(CacheContext, zone_bounds)),
            redirect_data: o(offset_of!(CacheContext, redirect_data)),
            vif: o(offset_of!(CacheContext, vif)),
            viopl: o(offset_of!(CacheContext, viopl)),
            irq_held: o(offset_of!(CacheContext, irq_held)),
            flags_slot: o(offset_of!(CacheContext, flags_slot)),
            flags_rsp: o(offset_of!(CacheContext, flags_rsp)),
            sel: o(offset_of!(CacheContext, sel)),
        }
    }
}

/// Addresses of the generated routines.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Gencode {
    pub enter: u64,
    pub exit: u64,
    /// Stores the `FAULT` exit word and jumps to `exit` (see "Faults inside the cache").
    pub fault_exit: u64,
    pub ibl_miss: u64,
    /// Shared hash lookup per mode slot (RDX = target, RCX/RDX spilled), used after
    /// return-cache misses; 0 when the region has no IBL tables (native runner).
    pub ibl_shared: [u64; TABLE_SLOTS],
}

/// Addresses of the two 64-byte aligned XSAVE areas (guest, host) used when the engine
/// itself may touch vector state (host builds); the in-guest engine is soft-float.
#[derive(Clone, Copy, Debug)]
pub(crate) struct XsaveAreas {
    pub guest: u64,
    pub host: u64,
}

const HOST_SAVED: [u8; 6] = [reg::RBX, reg::RBP, reg::R12, reg::R13, 14, reg::R15];

/// Emits the enter, exit and IBL-miss routines for the context at `ctx` into the
/// `GENCODE_BYTES` at `at`, and one shared hash lookup per mode's IBL table.
///
/// # Safety
/// `at` must be writable and executable for `GENCODE_BYTES` bytes and `ctx` must
/// be a `CacheContext` within ±2 GiB of `at`.
pub(crate) unsafe fn emit_gencode(
    at: *mut u8,
    ctx: &CtxAddrs,
    xsave: Option<XsaveAreas>,
    ibl_tables: Option<[u64; TABLE_SLOTS]>,
) -> Gencode {
    let base = at as u64;
    let mut a = Asm::new(base, ctx.spill);

    // exit routine
    let exit = a.pc();
    for r in 0..16u8 {
        a.mov_m_r(ctx.regs + 8 * u64::from(r), r);
    }
    a.mov_r_m(reg::RSP, ctx.host_rsp);
    if let Some(x) = xsave {
        a.mov_r_imm64(reg::RAX, u64::from(XSAVE_MASK));
        a.mov_r_imm64(reg::RDX, 0);
        a.xsave64_m(x.guest);
        a.xrstor64_m(x.host);
    }
    a.pushfq();
    a.pop_m(ctx.rflags);
    a.popfq();
    for r in HOST_SAVED.iter().rev() {
        a.pop_r(*r);
    }
    a.ret();

    // enter routine
    let enter = a.pc();
    for r in HOST_SAVED {
        a.push_r(r);
    }
    a.pushfq();
    a.mov_m_r(ctx.host_rsp, reg::RSP);
    if let Some(x) = xsave {
        a.mov_r_imm64(reg::RAX, u64::from(XSAVE_MASK));
        a.mov_r_imm64(reg::RDX, 0);
        a.xsave64_m(x.host);
        a.xrstor64_m(x.guest);
    }
    a.push_m(ctx.rflags);
    a.popfq();
    for r in (0..16u8).filter(|r| *r != reg::RSP) {
        a.mov_r_m(r, ctx.regs + 8 * u64::from(r));
    }
    a.mov_r_m(reg::RSP, ctx.regs + 8 * u64::from(reg::RSP));
    a.jmp_m(ctx.enter_target);

    // IBL miss: RDX = target, RAX/RCX/RDX spilled.
    let ibl_miss = a.pc();
    a.mov_m_r(ctx.ibl_target, reg::RDX);
    for r in [reg::RAX, reg::RCX, reg::RDX] {
        a.mov_r_m(r, ctx.spill + 8 * u64::from(r));
    }
    a.mov_m64_imm32(ctx.exit_word, exit_word(EXIT_IBL_MISS, 0));
    a.jmp_abs(exit);

    let mut ibl_shared = [0; TABLE_SLOTS];
    for (shared, table) in ibl_shared.iter_mut().zip(ibl_tables.iter().flatten()) {
        *shared = a.pc();
        a.set_spilled(1 << reg::RCX | 1 << reg::RDX);
        emit_ibl_lookup(&mut a, ctx, *table, ibl_miss);
    }

    // fault exit: a fault handler stored `ctx.fault_pc`.
    let fault_exit = a.pc();
    a.mov_m64_imm32(ctx.exit_word, exit_word(EXIT_FAULT, 0));
    a.jmp_abs(exit);

    let (code, _) = a.finish().expect("gencode labels are all bound");
    assert!(
        code.len() <= GENCODE_BYTES - crate::layout::REDIRECT_CODE_BYTES,
        "gencode exceeds its reserved area"
    );
    // SAFETY: the caller guarantees `at` is writable for GENCODE_BYTES bytes, and the
    // code was just checked to fit.
    unsafe { core::ptr::copy_nonoverlapping(code.as_ptr(), at, code.len()) };
    Gencode {
        enter,
        exit,
        fault_exit,
        ibl_miss,
        ibl_shared,
    }
}

/// The indirect-branch lookup: RDX = guest target, RCX/RDX spilled (RAX is spilled here).
/// Two probes of the `[-va, cache_pc]` table keyed by the low 16 bits of the target,
/// compared flag-free with `lea` + `jrcxz`; a hit restores RAX/RCX/RDX and jumps through
/// `ctx.jump_target`, a miss goes to `ibl_miss`. An empty bucket is `[0, 0]`, whose tag
/// matches the target 0: a hit whose code pointer is 0 is a miss too (a guest `call` through
/// a null pointer must fault in the guest, not jump to host address 0).
pub(crate) fn emit_ibl_lookup(a: &mut Asm, c: &CtxAddrs, ibl_table: u64, ibl_miss: u64) {
    a.emit_spill(reg::RAX);
    let hit = a.new_label();
    let hit2 = a.new_label();
    let miss = a.new_label();
    a.movzx_r32_r16(reg::RAX, reg::RDX);
    a.lea_r_bi(reg::RAX, reg::RAX, reg::RAX, 0);
    a.lea_r_rip(reg::RCX, ibl_table);
    a.lea_r_bi(reg::RAX, reg::RCX, reg::RAX, 3);
    a.mov_r_mb(reg::RCX, reg::RAX, 0);
    a.lea_r_bi(reg::RCX, reg::RCX, reg::RDX, 0);
    a.jrcxz_label(hit);
    a.mov_r_mb(reg::RCX, reg::RAX, 16);
    a.lea_r_bi(reg::RCX, reg::RCX, reg::RDX, 0);
    a.jrcxz_label(hit2);
    a.bind(miss);
    a.jmp_abs(ibl_miss);
    a.bind(hit2);
    a.lea_r_disp(reg::RAX, reg::RAX, 16);
    a.bind(hit);
    a.mov_r_mb(reg::RCX, reg::RAX, 8);
    a.jrcxz_label(miss);
    a.mov_m_r(c.jump_target, reg::RCX);
    a.emit_unspill(reg::RAX);
    a.emit_unspill(reg::RCX);
    a.emit_unspill(reg::RDX);
    a.jmp_m(c.jump_target);
}

/// Called from generated code for inline analysis calls.
///
/// # Safety
/// `tool` must be the `*mut &mut dyn Tool` that `Engine::run` stored in the context for
/// the duration of the run, and `args..args+n` must be readable.
pub(crate) unsafe extern "sysv64" fn analysis_trampoline(
    tool: *mut &mut dyn crate::instrument::Tool,
    routine: u64,
    args: *const u64,
    n: u64,
) {
    // SAFETY: per the contract, `tool` is live and not otherwise borrowed while the cache
    // runs, and the argument array is in the context.
    unsafe {
        let a = core::slice::from_raw_parts(args, n as usize);
        (**tool).analyze(routine as u32, a);
    }
}

/// Runs translated code: loads the guest state from the context and jumps to `target`.
/// Returns when some code reaches the exit routine.
///
/// # Safety
/// `gen` must come from `emit_gencode` for `ctx`, `target` must be valid code in the same
/// region, and the guest state must be one the code can run with.
pub(crate) unsafe fn cache_enter(gen: &Gencode, ctx: *mut CacheContext, target: u64) {
    // SAFETY: `ctx` is valid per the caller's contract.
    unsafe { (*ctx).enter_target = target };
    // SAFETY: `gen.enter` is the sysv64 routine emitted by `emit_gencode`; it preserves
    // the callee-saved registers and RFLAGS (DF included) and returns normally.
    let f: extern "sysv64" fn() = unsafe { core::mem::transmute(gen.enter as usize) };
    f();
}
