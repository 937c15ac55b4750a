//! The 8259 PIC pair, the 8254 PIT channel 0, and the timer interrupt.
//!
//! Invariants:
//! * After [`remap_and_mask`] the PICs deliver IRQ 0..15 at vectors 0x20..0x2f and every IRQ
//!   is masked; only IRQ 0 is ever unmasked, and only around `sti; hlt` or ring-3 code.
//! * [`on_timer`] counts ticks; when the count reaches the armed target it masks IRQ 0 in the
//!   same handler, so a step gets *exactly* the number of ticks it asked for however slowly
//!   the CPU runs. It EOIs every tick.
//! * While a watchdog deadline is armed, reaching it prints a `MINIKERNEL-PANIC` line.

use crate::cpu::{inb, outb};
use crate::global::Global;
use crate::layout::{PIC_MASTER_BASE, PIC_SLAVE_BASE, TIMER_VECTOR};
use crate::traps::{panic_trap, TrapFrame};

/// Master PIC command port.
const PIC1_COMMAND: u16 = 0x20;
/// Master PIC data (mask) port.
const PIC1_DATA: u16 = 0x21;
/// Slave PIC command port.
const PIC2_COMMAND: u16 = 0xa0;
/// Slave PIC data (mask) port.
const PIC2_DATA: u16 = 0xa1;
/// ICW1: edge triggered, cascade, ICW4 follows.
const ICW1_INIT_ICW4: u8 = 0x11;
/// ICW3 (master): a slave on IRQ 2.
const ICW3_MASTER_SLAVE_ON_IRQ2: u8 = 1 << 2;
/// ICW3 (slave): cascade identity 2.
const ICW3_SLAVE_ID: u8 = 2;
/// ICW4: 8086 mode.
const ICW4_8086: u8 = 0x01;
/// OCW2: non-specific end of interrupt.
const OCW2_EOI: u8 = 0x20;
/// IMR bit of IRQ 0 on the master.
const IRQ0_MASK_BIT: u8 = 1 << 0;

/// PIT channel 0 data port.
const PIT_CHANNEL0: u16 = 0x40;
/// PIT mode/command port.
const PIT_COMMAND: u16 = 0x43;
/// Channel 0, lobyte/hibyte access, mode 2 (rate generator), binary.
const PIT_CH0_RATE_GENERATOR: u8 = 0x34;
/// PIT input clock in Hz.
const PIT_INPUT_HZ: u64 = 1_193_182;
/// Tick rate the kernel programs.
pub const TIMER_HZ: u64 = 1000;
/// Reload value for [`TIMER_HZ`] (1193).
const PIT_DIVISOR: u64 = (PIT_INPUT_HZ + TIMER_HZ / 2) / TIMER_HZ;

/// Ticks since boot.
pub static TICKS: Global<u64> = Global::new(0);
/// Tick count at which IRQ 0 masks itself (u64::MAX: never).
static TICK_TARGET: Global<u64> = Global::new(u64::MAX);
/// Tick count at which the watchdog fires (0: disarmed).
static WATCHDOG_AT: Global<u64> = Global::new(0);
/// Ticks that interrupted CPL 3 / CPL 0.
pub static TICKS_FROM_CPL3: Global<u64> = Global::new(0);
/// Ticks that interrupted CPL 0.
pub static TICKS_FROM_CPL0: Global<u64> = Global::new(0);
/// Vector of the last IRQ handled (0: none since reset).
pub static LAST_IRQ_VECTOR: Global<u64> = Global::new(0);
/// Physical address the tick handler stores "ticks since [`MIRROR_BASE`]" into (0: off).
static MIRROR_PA: Global<u64> = Global::new(0);
static MIRROR_BASE: Global<u64> = Global::new(0);
static PIT_RUNNING: Global<bool> = Global::new(false);

/// Reinitializes both PICs at vectors 0x20/0x28 with every IRQ masked.
pub fn remap_and_mask() {
    outb(PIC1_COMMAND, ICW1_INIT_ICW4);
    outb(PIC2_COMMAND, ICW1_INIT_ICW4);
    outb(PIC1_DATA, PIC_MASTER_BASE);
    outb(PIC2_DATA, PIC_SLAVE_BASE);
    outb(PIC1_DATA, ICW3_MASTER_SLAVE_ON_IRQ2);
    outb(PIC2_DATA, ICW3_SLAVE_ID);
    outb(PIC1_DATA, ICW4_8086);
    outb(PIC2_DATA, ICW4_8086);
    outb(PIC1_DATA, 0xff);
    outb(PIC2_DATA, 0xff);
}

/// The master PIC's interrupt mask register.
pub fn master_imr() -> u8 {
    inb(PIC1_DATA)
}

/// The slave PIC's interrupt mask register.
pub fn slave_imr() -> u8 {
    inb(PIC2_DATA)
}

/// Starts PIT channel 0 at [`TIMER_HZ`] (once; IRQ 0 stays masked).
pub fn pit_start() {
    if PIT_RUNNING.get() {
        return;
    }
    outb(PIT_COMMAND, PIT_CH0_RATE_GENERATOR);
    outb(PIT_CHANNEL0, (PIT_DIVISOR & 0xff) as u8);
    outb(PIT_CHANNEL0, (PIT_DIVISOR >> 8) as u8);
    PIT_RUNNING.set(true);
}

/// Unmasks IRQ 0 until `count` more ticks have been taken (`None`: until [`mask_timer`]).
pub fn arm_timer(count: Option<u64>) {
    TICK_TARGET.set(count.map_or(u64::MAX, |c| TICKS.get() + c));
    outb(PIC1_DATA, master_imr() & !IRQ0_MASK_BIT);
}

/// Masks IRQ 0.
pub fn mask_timer() {
    outb(PIC1_DATA, master_imr() | IRQ0_MASK_BIT);
    TICK_TARGET.set(u64::MAX);
}

/// Fires a `MINIKERNEL-PANIC` if `ticks` more ticks pass before [`disarm_watchdog`].
pub fn arm_watchdog(ticks: u64) {
    WATCHDOG_AT.set(TICKS.get() + ticks);
}

/// Disarms the watchdog.
pub fn disarm_watchdog() {
    WATCHDOG_AT.set(0);
}

/// Makes every tick store "ticks since now" into the qword at physical `pa` (0: stop).
pub fn mirror_ticks_to(pa: u64) {
    MIRROR_BASE.set(TICKS.get());
    MIRROR_PA.set(pa);
}

/// IRQ 0.
pub fn on_timer(frame: &TrapFrame) {
    let ticks = TICKS.get() + 1;
    TICKS.set(ticks);
    LAST_IRQ_VECTOR.set(TIMER_VECTOR);
    if frame.cs & 3 == 3 {
        TICKS_FROM_CPL3.set(TICKS_FROM_CPL3.get() + 1);
    } else {
        TICKS_FROM_CPL0.set(TICKS_FROM_CPL0.get() + 1);
    }
    let mirror = MIRROR_PA.get();
    if mirror != 0 {
        // SAFETY: `mirror_ticks_to` callers pass an identity-mapped frame they own.
        unsafe { (mirror as *mut u64).write_volatile(ticks - MIRROR_BASE.get()) };
    }
    if ticks == TICK_TARGET.get() {
        outb(PIC1_DATA, master_imr() | IRQ0_MASK_BIT);
    }
    let watchdog = WATCHDOG_AT.get();
    if watchdog != 0 && ticks >= watchdog {
        panic_trap(frame, 0, "watchdog: a step did not finish in time");
    }
    outb(PIC1_COMMAND, OCW2_EOI);
}

/// Any other PIC vector (all are masked, so only spurious IRQ 7/15 can arrive): EOI the real
/// ones and otherwise ignore them.
pub fn on_other_irq(vector: u64) {
    LAST_IRQ_VECTOR.set(vector);
    let irq = vector - TIMER_VECTOR;
    if irq == 7 {
        return; // spurious master IRQ: no EOI
    }
    if irq == 15 {
        outb(PIC1_COMMAND, OCW2_EOI); // spurious slave IRQ: the master still saw IRQ 2
        return;
    }
    if irq >= 8 {
        outb(PIC2_COMMAND, OCW2_EOI);
    }
    outb(PIC1_COMMAND, OCW2_EOI);
}
