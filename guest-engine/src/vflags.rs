//! The virtual IF and IOPL in the cache context, for `cli`, `sti`, `pushfq` and `popfq`
//! translated inline at virtual CPL 0 (`Config::inline_virtual_flags`): Linux runs them
//! about a million times a boot (`local_irq_save`/`restore`, spinlocks), and each was an
//! exit, an emulation and a re-entry.
//!
//! Translated code runs at hardware CPL 3 with the real IF = 1 and IOPL = 0, so the
//! guest's IF and IOPL live in `CacheContext::vif` (0 or 0x200) and `viopl` (`iopl << 12`),
//! as their RFLAGS bits. The embedder keeps its virtual CPU's copy in step: it hands its
//! flags to the engine before a run (`Engine::set_virtual_flags`) and reads them back
//! after (`Engine::virtual_flags`); around each emulation inside a run the engine does
//! the same with the platform (`Platform::set_virtual_flags`/`virtual_flags`).
//!
//! The sequences (`arch/x86_64/mangle.rs`, `emit_virtual_flags`):
//! * `cli`: `mov qword [vif], 0`;
//! * `sti`: `mov qword [vif], 0x200`, then, if `irq_held` (an interrupt pending that IF
//!   held back), OR `attention::reason::INTERRUPT` into the attention byte, the flags kept
//!   by a `pushfq`/`popfq` pair on a stack in the context. An `sti` followed by `hlt`
//!   stays an exit (the emulation delivers a pending interrupt after the `hlt`, as the
//!   CPU's interrupt shadow does);
//! * `pushfq`: the real `pushfq` (the guest's arithmetic flags, DF, AC; IF = 1, IOPL = 0),
//!   then the pushed word adjusted with `lea` (flag-free): `− 0x200 + vif + viopl`;
//! * `popfq`: reads the guest's word (the only access that can fault: RAX is in its spill
//!   slot then), stores its IF and IOPL bits to the context (and sets attention if IF is
//!   set with an interrupt held), clears TF (single-stepping is not virtualized), and loads
//!   the rest with a real `popfq` from `flags_slot` (RSP pointed there and back), which at
//!   CPL 3 leaves the real IF and IOPL alone, as the emulation does.
//!
//! Their memory operands (`[rsp − 8]`, `[rsp]`) are checked and recorded like any
//! `push`/`pop`'s.
//!
//! `mov r, sreg` (a register destination) reads the guest's selector from
//! `CacheContext::sel`, kept in step the same way (`Engine::set_selectors` before a run,
//! `Platform::selectors` after each emulation): Linux's `sync_core` (`iret_to_self`, after
//! each of the ~10^5 `text_poke_early`s of a boot) reads SS and CS, and `__switch_to`
//! saves the data selectors.

//!
//! A trace-ending `iretq` at virtual CPL 0 (64-bit, not stepping, and a tool that takes
//! no fetch records) runs inline when it returns to the same CS and SS selectors, which
//! at CPL 0 needs no descriptor checks: each of Linux's ~10^5 `sync_core()`s of a boot
//! (`iret_to_self`) is one. The popped RFLAGS set the virtual IF and IOPL as `popfq`
//! does, RSP and RIP are popped, RIP looked up as an indirect branch's target. A frame
//! in or across the reserved zone, other selectors, TF/NT/RF/VM/AC/VIF/VIP set, or a
//! non-canonical RIP take the sensitive exit instead, with the guest's state untouched.
//! It counts as an emulated instruction (`Stats::emulated_insns`). What a CPU would do
//! and this does not: re-read the CS and SS descriptors from the GDT (a kernel that
//! rewrites its live CS or SS descriptor and then returns to the same selectors would
//! see the old ones).

use crate::dispatch::Engine;

impl Engine {
    /// Sets the virtual IF and IOPL that inline flag instructions see.
    pub fn set_virtual_flags(&mut self, vif: bool, iopl: u8) {
        let c = self.ctx_mut();
        c.vif = if vif { 0x200 } else { 0 };
        c.viopl = u64::from(iopl & 3) << 12;
    }

    /// The virtual IF and IOPL as inline flag instructions left them.
    pub fn virtual_flags(&self) -> (bool, u8) {
        let c = self.ctx();
        (c.vif & 0x200 != 0, ((c.viopl >> 12) & 3) as u8)
    }

    /// Sets the guest's segment selectors (ES, CS, SS, DS, FS, GS) that inline
    /// `mov r, sreg` reads.
    pub fn set_selectors(&mut self, sel: [u16; 6]) {
        self.ctx_mut().sel[..6].copy_from_slice(&sel);
    }

    /// Whether an interrupt is pending that the virtual IF holds back (an inline `sti` or
    /// `popfq` setting IF then sets the attention byte).
    pub fn set_irq_held(&mut self, held: bool) {
        self.ctx_mut().irq_held = u64::from(held);
    }
}
