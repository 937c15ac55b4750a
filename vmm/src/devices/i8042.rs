//! The i8042 PS/2 controller, with an AT keyboard on its first port and an auxiliary
//! port with nothing plugged in, complete enough that Linux's probe (`i8042.c`: flush,
//! self-test, CTR read/write, the AUX loopback and its IRQ 12 test, the mux check) never
//! waits for a reply that does not come. It also resets the machine (command 0xfe on
//! port 0x64), which kpin treats as poweroff (Linux booted with `reboot=k`).
//!
//! Why a model and not an absent device: a controller that ignores a command makes Linux
//! poll the status port until its timeout (10 000 reads, each after `udelay(50)`), twice
//! for the AUX probe alone — 20 000 port exits and over two seconds of an instrumented
//! boot with the command line distributions use (without `i8042.noaux i8042.nomux`).
//!
//! Bytes for the guest queue in [`I8042::out`]; the first is in the output buffer
//! (status OBF), tagged with its source (status AUXDATA for the auxiliary port). When a
//! byte reaches the output buffer and the CTR enables its port's interrupt, IRQ 1
//! (keyboard, and controller replies) or IRQ 12 (auxiliary) is pulsed. A byte written to
//! the auxiliary device finds no device: the controller answers 0xfe with the time-out
//! bit, as a PS/2 controller does when the device does not clock, so a mouse driver
//! gives up at once.

use std::collections::VecDeque;

use super::bus::{DeviceAction, PortDevice};
use super::IrqLine;

/// Base port of the controller's data register (0x60); the command/status port is 0x64.
pub const I8042_DATA_PORT: u16 = 0x60;
/// Span of ports from the data port to the command port inclusive.
pub const I8042_PORT_SPAN: u16 = 5;
/// The keyboard's ISA interrupt line.
pub const I8042_KBD_IRQ: u32 = 1;
/// The auxiliary (mouse) port's ISA interrupt line.
pub const I8042_AUX_IRQ: u32 = 12;

const OFFSET_DATA: u16 = 0;
const OFFSET_COMMAND: u16 = 4;

/// Status register bits.
mod status {
    /// Output buffer full: a byte waits on port 0x60.
    pub const OBF: u8 = 1 << 0;
    /// System flag (CTR bit 2, set by a passed self-test).
    pub const SYS: u8 = 1 << 2;
    /// The last write was to the command port.
    pub const CMD: u8 = 1 << 3;
    /// Keyboard not inhibited by the key lock (Linux warns "Keylock active" when clear).
    pub const UNLOCKED: u8 = 1 << 4;
    /// The output buffer's byte comes from the auxiliary port.
    pub const AUXDATA: u8 = 1 << 5;
    /// The device did not answer (general time-out).
    pub const TIMEOUT: u8 = 1 << 6;
}

/// Controller configuration byte (CTR) bits.
mod ctr {
    /// Keyboard interrupt (IRQ 1) enabled.
    pub const KBDINT: u8 = 1 << 0;
    /// Auxiliary interrupt (IRQ 12) enabled.
    pub const AUXINT: u8 = 1 << 1;
    /// System flag.
    pub const SYS: u8 = 1 << 2;
    /// Keyboard clock disabled.
    pub const KBDDIS: u8 = 1 << 4;
    /// Auxiliary clock disabled.
    pub const AUXDIS: u8 = 1 << 5;
    /// Scan-code translation (set 2 to set 1) on the keyboard port.
    pub const XLATE: u8 = 1 << 6;
}

/// Controller commands (writes to port 0x64).
mod cmd {
    pub const READ_CTR: u8 = 0x20;
    pub const WRITE_CTR: u8 = 0x60;
    pub const AUX_DISABLE: u8 = 0xa7;
    pub const AUX_ENABLE: u8 = 0xa8;
    pub const AUX_TEST: u8 = 0xa9;
    pub const SELF_TEST: u8 = 0xaa;
    pub const KBD_TEST: u8 = 0xab;
    pub const KBD_DISABLE: u8 = 0xad;
    pub const KBD_ENABLE: u8 = 0xae;
    pub const READ_INPUT_PORT: u8 = 0xc0;
    pub const READ_OUTPUT_PORT: u8 = 0xd0;
    pub const WRITE_OUTPUT_PORT: u8 = 0xd1;
    pub const KBD_LOOP: u8 = 0xd2;
    pub const AUX_LOOP: u8 = 0xd3;
    pub const AUX_SEND: u8 = 0xd4;
    pub const RESET_CPU: u8 = 0xfe;
}

/// Replies of the self-tests and of a keyboard.
mod reply {
    pub const SELF_TEST_PASSED: u8 = 0x55;
    pub const INTERFACE_OK: u8 = 0x00;
    pub const ACK: u8 = 0xfa;
    pub const RESEND: u8 = 0xfe;
    pub const BAT_OK: u8 = 0xaa;
    pub const ECHO: u8 = 0xee;
}

/// The output port's value after reset: A20 enabled, CPU not held in reset.
const OUTPUT_PORT_RESET: u8 = 0x03;
/// Bytes the controller holds for the guest at most; a guest that writes faster than it
/// reads loses the newest, as the hardware's one-byte buffer would.
const OUT_QUEUE_MAX: usize = 16;

/// Unwired lines, for tests that only need the controller's registers.
#[cfg(test)]
impl IrqLine for () {
    fn trigger(&self) {}
}

/// Who put a byte in the output buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Source {
    /// The controller itself or the keyboard (IRQ 1).
    Keyboard,
    /// The auxiliary port (IRQ 12); `timeout` when its device did not answer.
    Aux { timeout: bool },
}

/// What the next byte written to port 0x60 means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DataWrite {
    /// A byte for the keyboard.
    Keyboard,
    /// The argument of a controller command.
    Controller(u8),
    /// The argument of a keyboard command (LEDs, typematic rate, scan-code set).
    KeyboardArg(u8),
}

/// The controller and its keyboard.
pub struct I8042<I: IrqLine> {
    ctr: u8,
    output_port: u8,
    last_write_was_command: bool,
    out: VecDeque<(u8, Source)>,
    next_data: DataWrite,
    kbd_irq: I,
    aux_irq: I,
}

impl<I: IrqLine> I8042<I> {
    /// A controller after a BIOS left it: keyboard interrupt on, translation off.
    pub fn new(kbd_irq: I, aux_irq: I) -> Self {
        I8042 {
            ctr: ctr::KBDINT | ctr::SYS,
            output_port: OUTPUT_PORT_RESET,
            last_write_was_command: false,
            out: VecDeque::new(),
            next_data: DataWrite::Keyboard,
            kbd_irq,
            aux_irq,
        }
    }

    fn status(&self) -> u8 {
        let mut s = status::UNLOCKED;
        if self.ctr & ctr::SYS != 0 {
            s |= status::SYS;
        }
        if self.last_write_was_command {
            s |= status::CMD;
        }
        match self.out.front() {
            None => {}
            Some((_, Source::Keyboard)) => s |= status::OBF,
            Some((_, Source::Aux { timeout })) => {
                s |= status::OBF | status::AUXDATA;
                if *timeout {
                    s |= status::TIMEOUT;
                }
            }
        }
        s
    }

    /// Queues a byte for the guest; pulses its interrupt if it is now in the buffer.
    fn push(&mut self, byte: u8, source: Source) {
        if self.out.len() >= OUT_QUEUE_MAX {
            return;
        }
        self.out.push_back((byte, source));
        if self.out.len() == 1 {
            self.interrupt_for_head();
        }
    }

    /// Pulses the interrupt of the byte now in the output buffer, if its port's is on.
    fn interrupt_for_head(&self) {
        match self.out.front() {
            Some((_, Source::Keyboard)) if self.ctr & ctr::KBDINT != 0 => self.kbd_irq.trigger(),
            Some((_, Source::Aux { .. })) if self.ctr & ctr::AUXINT != 0 => self.aux_irq.trigger(),
            _ => {}
        }
    }

    fn read_data(&mut self) -> u8 {
        let Some((byte, _)) = self.out.pop_front() else {
            return 0;
        };
        if !self.out.is_empty() {
            self.interrupt_for_head();
        }
        byte
    }

    fn command(&mut self, c: u8) -> DeviceAction {
        let kbd = Source::Keyboard;
        match c {
            cmd::RESET_CPU => return DeviceAction::Reset,
            cmd::READ_CTR => self.push(self.ctr, kbd),
            cmd::AUX_DISABLE => self.ctr |= ctr::AUXDIS,
            cmd::AUX_ENABLE => self.ctr &= !ctr::AUXDIS,
            cmd::AUX_TEST | cmd::KBD_TEST => self.push(reply::INTERFACE_OK, kbd),
            cmd::SELF_TEST => {
                self.ctr |= ctr::SYS;
                self.push(reply::SELF_TEST_PASSED, kbd);
            }
            cmd::KBD_DISABLE => self.ctr |= ctr::KBDDIS,
            cmd::KBD_ENABLE => self.ctr &= !ctr::KBDDIS,
            cmd::READ_INPUT_PORT => self.push(0, kbd),
            cmd::READ_OUTPUT_PORT => self.push(self.output_port, kbd),
            cmd::WRITE_CTR
            | cmd::WRITE_OUTPUT_PORT
            | cmd::KBD_LOOP
            | cmd::AUX_LOOP
            | cmd::AUX_SEND => self.next_data = DataWrite::Controller(c),
            // Anything else (the mux commands, password, pulse-output-line forms) is
            // ignored, as by a controller without the feature.
            _ => {}
        }
        DeviceAction::None
    }

    fn write_data(&mut self, v: u8) {
        match core::mem::replace(&mut self.next_data, DataWrite::Keyboard) {
            DataWrite::Controller(cmd::WRITE_CTR) => self.ctr = v,
            DataWrite::Controller(cmd::WRITE_OUTPUT_PORT) => self.output_port = v,
            DataWrite::Controller(cmd::KBD_LOOP) => self.push(v, Source::Keyboard),
            DataWrite::Controller(cmd::AUX_LOOP) => self.push(v, Source::Aux { timeout: false }),
            // Nothing is plugged into the auxiliary port.
            DataWrite::Controller(_) => self.push(reply::RESEND, Source::Aux { timeout: true }),
            DataWrite::KeyboardArg(_) => self.push(reply::ACK, Source::Keyboard),
            DataWrite::Keyboard => self.keyboard(v),
        }
    }

    /// A byte for the keyboard: an AT keyboard's replies (Linux's atkbd probe reads its
    /// ID and resets it).
    fn keyboard(&mut self, v: u8) {
        let kbd = Source::Keyboard;
        match v {
            // Reset: acknowledged, then the self-test (BAT) passed.
            0xff => {
                self.push(reply::ACK, kbd);
                self.push(reply::BAT_OK, kbd);
            }
            // Read ID: an MF2 keyboard (in translated form when the CTR translates).
            0xf2 => {
                self.push(reply::ACK, kbd);
                self.push(0xab, kbd);
                self.push(
                    if self.ctr & ctr::XLATE != 0 {
                        0x41
                    } else {
                        0x83
                    },
                    kbd,
                );
            }
            0xee => self.push(reply::ECHO, kbd),
            // Set LEDs, typematic rate, scan-code set: an argument byte follows.
            0xed | 0xf3 | 0xf0 => {
                self.next_data = DataWrite::KeyboardArg(v);
                self.push(reply::ACK, kbd);
            }
            // Enable, disable, set defaults and the per-key mode commands.
            0xf4..=0xfd => self.push(reply::ACK, kbd),
            _ => self.push(reply::RESEND, kbd),
        }
    }
}

impl<I: IrqLine> PortDevice for I8042<I> {
    fn read(&mut self, offset: u16, data: &mut [u8]) {
        let v = match offset {
            OFFSET_DATA => self.read_data(),
            OFFSET_COMMAND => self.status(),
            _ => 0xff,
        };
        data.fill(v);
    }

    fn write(&mut self, offset: u16, data: &[u8]) -> DeviceAction {
        let Some(&v) = data.first() else {
            return DeviceAction::None;
        };
        match offset {
            OFFSET_COMMAND => {
                self.last_write_was_command = true;
                self.command(v)
            }
            OFFSET_DATA => {
                self.last_write_was_command = false;
                self.write_data(v);
                DeviceAction::None
            }
            _ => DeviceAction::None,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::rc::Rc;

    use super::*;

    #[derive(Clone, Default)]
    struct Count(Rc<Cell<u32>>);

    impl IrqLine for Count {
        fn trigger(&self) {
            self.0.set(self.0.get() + 1);
        }
    }

    fn controller() -> (I8042<Count>, Count, Count) {
        let (kbd, aux) = (Count::default(), Count::default());
        (I8042::new(kbd.clone(), aux.clone()), kbd, aux)
    }

    fn status(k: &mut I8042<Count>) -> u8 {
        let mut s = [0];
        k.read(OFFSET_COMMAND, &mut s);
        s[0]
    }

    fn data(k: &mut I8042<Count>) -> u8 {
        let mut d = [0];
        k.read(OFFSET_DATA, &mut d);
        d[0]
    }

    /// Linux's `i8042_command`: the command, its argument, and the reply if any.
    fn command(k: &mut I8042<Count>, c: u8, arg: Option<u8>) -> Option<(u8, u8)> {
        assert_eq!(k.write(OFFSET_COMMAND, &[c]), DeviceAction::None);
        if let Some(a) = arg {
            k.write(OFFSET_DATA, &[a]);
        }
        let s = status(k);
        (s & status::OBF != 0).then(|| (s, data(k)))
    }

    #[test]
    fn test_reset_command_requests_reset() {
        let (mut k, _, _) = controller();
        assert_eq!(k.write(OFFSET_COMMAND, &[0xfe]), DeviceAction::Reset);
    }

    #[test]
    fn test_ctr_round_trips_through_data_port() {
        let (mut k, _, _) = controller();
        assert_eq!(command(&mut k, cmd::WRITE_CTR, Some(0x47)), None);
        let (s, v) = command(&mut k, cmd::READ_CTR, None).unwrap();
        assert_eq!(v, 0x47);
        assert_eq!(s & status::AUXDATA, 0);
        assert_eq!(status(&mut k) & status::OBF, 0);
    }

    #[test]
    fn test_linux_probe_gets_every_reply_it_waits_for() {
        let (mut k, _, aux) = controller();
        // Self-test, then the AUX loopback with the byte Linux sends.
        assert_eq!(command(&mut k, cmd::SELF_TEST, None).unwrap().1, 0x55);
        let (s, v) = command(&mut k, cmd::AUX_LOOP, Some(0x5a)).unwrap();
        assert_eq!((v, s & status::AUXDATA), (0x5a, status::AUXDATA));
        // Bit assignment test: AUX disable/enable show in the CTR.
        command(&mut k, cmd::AUX_DISABLE, None);
        assert_ne!(
            command(&mut k, cmd::READ_CTR, None).unwrap().1 & ctr::AUXDIS,
            0
        );
        command(&mut k, cmd::AUX_ENABLE, None);
        assert_eq!(
            command(&mut k, cmd::READ_CTR, None).unwrap().1 & ctr::AUXDIS,
            0
        );
        // The mux check's third loop byte comes back unchanged: no multiplexer.
        for b in [0xf0, 0x56, 0xa4] {
            assert_eq!(command(&mut k, cmd::AUX_LOOP, Some(b)).unwrap().1, b);
        }
        // The IRQ test: with AUXINT on, the loopback byte raises IRQ 12.
        command(&mut k, cmd::WRITE_CTR, Some(ctr::AUXINT | ctr::SYS));
        let before = aux.0.get();
        k.write(OFFSET_COMMAND, &[cmd::AUX_LOOP]);
        k.write(OFFSET_DATA, &[0xa5]);
        assert_eq!(aux.0.get(), before + 1);
        assert_eq!(data(&mut k), 0xa5);
    }

    #[test]
    fn test_a_byte_for_the_absent_mouse_times_out_at_once() {
        let (mut k, _, _) = controller();
        let (s, v) = command(&mut k, cmd::AUX_SEND, Some(0xff)).unwrap();
        assert_eq!(v, 0xfe);
        assert_eq!(
            s & (status::TIMEOUT | status::AUXDATA),
            status::TIMEOUT | status::AUXDATA
        );
    }

    #[test]
    fn test_keyboard_answers_reset_and_id_with_one_interrupt_per_byte() {
        let (mut k, kbd, _) = controller();
        k.write(OFFSET_DATA, &[0xf2]);
        assert_eq!(kbd.0.get(), 1);
        assert_eq!(
            [data(&mut k), data(&mut k), data(&mut k)],
            [0xfa, 0xab, 0x83]
        );
        assert_eq!(kbd.0.get(), 3);
        k.write(OFFSET_DATA, &[0xff]);
        assert_eq!([data(&mut k), data(&mut k)], [0xfa, 0xaa]);
        // LEDs: the command and its argument are each acknowledged.
        k.write(OFFSET_DATA, &[0xed]);
        k.write(OFFSET_DATA, &[0x07]);
        assert_eq!([data(&mut k), data(&mut k)], [0xfa, 0xfa]);
        assert_eq!(status(&mut k) & status::OBF, 0);
    }

    #[test]
    fn test_interrupts_follow_the_ctr_and_the_queue_is_bounded() {
        let (mut k, kbd, _) = controller();
        command(&mut k, cmd::WRITE_CTR, Some(0));
        for _ in 0..100 {
            k.write(OFFSET_DATA, &[0xee]);
        }
        assert_eq!(kbd.0.get(), 0);
        assert_eq!(k.out.len(), OUT_QUEUE_MAX);
    }
}
