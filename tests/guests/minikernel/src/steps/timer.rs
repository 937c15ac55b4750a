//! Steps `timer`, `hlt` and `user-irq`: PIT interrupts through the remapped PIC.

use crate::console::{newline, print, print_dec, print_hex};
use crate::cpu::sti_hlt_cli;
use crate::layout::{TIMER_VECTOR, USER_SHARED_VA};
use crate::pic::{self, LAST_IRQ_VECTOR, TICKS, TICKS_FROM_CPL0, TICKS_FROM_CPL3, TIMER_HZ};
use crate::user::{self, Program};

/// Ticks step `timer` waits for.
const TIMER_TICKS: u64 = 10;
/// Ticks step `user-irq` lets interrupt ring-3 code.
const USER_IRQ_TICKS: u64 = 3;

/// Step `timer`: exactly ten PIT ticks, each awaited with `sti; hlt`; IRQ 0 masks itself at
/// the tenth, which the master IMR then shows.
pub fn ten_ticks() {
    pic::pit_start();
    let start = TICKS.get();
    let from_cpl0 = TICKS_FROM_CPL0.get();
    pic::arm_timer(Some(TIMER_TICKS));
    while TICKS.get() - start < TIMER_TICKS {
        sti_hlt_cli();
    }
    let imr = pic::master_imr();
    pic::mask_timer();
    print("pit ");
    print_dec(TIMER_HZ);
    print(" hz irq0 vector=");
    print_hex(TIMER_VECTOR);
    print(" ticks=");
    print_dec(TICKS.get() - start);
    print(" at-cpl0=");
    print_dec(TICKS_FROM_CPL0.get() - from_cpl0);
    print(" imr-after=");
    print_hex(u64::from(imr));
    newline();
}

/// Step `hlt`: one `sti; hlt` woken by one PIT tick.
pub fn hlt_wakeup() {
    pic::pit_start();
    LAST_IRQ_VECTOR.set(0);
    let start = TICKS.get();
    pic::arm_timer(Some(1));
    sti_hlt_cli();
    pic::mask_timer();
    print("woke by vector=");
    print_hex(LAST_IRQ_VECTOR.get());
    print(" ticks=");
    print_dec(TICKS.get() - start);
    newline();
}

/// Step `user-irq`: ring-3 code spins on a user page that the tick handler counts into, and
/// exits once it reads 3; IRQ 0 masks itself after exactly 3 ticks, all taken at CPL 3.
pub fn irq_at_cpl3() {
    let shared = user::shared_frame();
    // SAFETY: the shared frame is an identity-mapped frame owned by `user`; no ring-3 code
    // runs right now.
    unsafe { (shared as *mut u64).write_volatile(0) };
    let (cpl3, cpl0) = (TICKS_FROM_CPL3.get(), TICKS_FROM_CPL0.get());
    pic::mirror_ticks_to(shared);
    let seen = user::run(Program::Irq, USER_SHARED_VA, Some(USER_IRQ_TICKS));
    pic::mirror_ticks_to(0);
    print("ticks at-cpl3=");
    print_dec(TICKS_FROM_CPL3.get() - cpl3);
    print(" at-cpl0=");
    print_dec(TICKS_FROM_CPL0.get() - cpl0);
    print(" user-saw=");
    print_dec(seen);
    newline();
}
