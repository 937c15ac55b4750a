//! COM1 output, number formatting, and the transcript checksum.
//!
//! Invariant: every byte the kernel prints goes through [`put_byte`]; once
//! [`start_transcript`] has printed the `MINIKERNEL-START` line, each byte is folded into a
//! FNV-1a 64-bit hash that [`finish_transcript`] prints on the `MINIKERNEL-DONE` line.

use crate::cpu::{inb, outb};
use crate::global::Global;

/// COM1 transmit holding register.
const COM1_THR: u16 = 0x3f8;
/// COM1 line status register.
const COM1_LSR: u16 = 0x3fd;
/// LSR bit 5: the transmit holding register is empty.
const LSR_THR_EMPTY: u8 = 1 << 5;

/// FNV-1a 64-bit offset basis.
const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
/// FNV-1a 64-bit prime.
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

static HASHING: Global<bool> = Global::new(false);
static HASH: Global<u64> = Global::new(FNV_OFFSET);
/// Bytes printed since the last newline (so a panic can start on a fresh line).
static COLUMN: Global<u64> = Global::new(0);

/// Prints one byte on COM1.
pub fn put_byte(b: u8) {
    while inb(COM1_LSR) & LSR_THR_EMPTY == 0 {}
    outb(COM1_THR, b);
    if HASHING.get() {
        HASH.set((HASH.get() ^ u64::from(b)).wrapping_mul(FNV_PRIME));
    }
    COLUMN.set(if b == b'\n' { 0 } else { COLUMN.get() + 1 });
}

/// Prints a string.
pub fn print(s: &str) {
    for &b in s.as_bytes() {
        put_byte(b);
    }
}

/// Prints a newline.
pub fn newline() {
    put_byte(b'\n');
}

/// Ends the current line if something is on it.
pub fn fresh_line() {
    if COLUMN.get() != 0 {
        newline();
    }
}

/// Prints `v` as `0x` followed by lowercase hex digits without leading zeros.
pub fn print_hex(v: u64) {
    print("0x");
    print_hex_digits(v, 1);
}

/// Prints `v` as at least `min_digits` lowercase hex digits, no prefix.
pub fn print_hex_digits(v: u64, min_digits: u32) {
    let mut started = false;
    for i in (0..16u32).rev() {
        let nibble = ((v >> (i * 4)) & 0xf) as u8;
        if nibble != 0 || i < min_digits {
            started = true;
        }
        if started {
            put_byte(if nibble < 10 {
                b'0' + nibble
            } else {
                b'a' + nibble - 10
            });
        }
    }
}

/// Prints `v` in decimal.
pub fn print_dec(v: u64) {
    let mut digits = [0u8; 20];
    let mut n = v;
    let mut len = 0;
    loop {
        digits[len] = b'0' + (n % 10) as u8;
        len += 1;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    while len > 0 {
        len -= 1;
        put_byte(digits[len]);
    }
}

/// Prints `v` as exactly two decimal digits (step numbers).
pub fn print_dec2(v: u64) {
    put_byte(b'0' + ((v / 10) % 10) as u8);
    put_byte(b'0' + (v % 10) as u8);
}

/// Prints `ok` or `BAD`.
pub fn print_ok(ok: bool) {
    print(if ok { "ok" } else { "BAD" });
}

/// Prints the `MINIKERNEL-START` line and starts hashing everything printed after it.
pub fn start_transcript() {
    fresh_line();
    print("MINIKERNEL-START\n");
    HASH.set(FNV_OFFSET);
    HASHING.set(true);
}

/// Stops hashing and prints `MINIKERNEL-DONE <16 hex digits>`.
pub fn finish_transcript() {
    fresh_line();
    HASHING.set(false);
    print("MINIKERNEL-DONE ");
    print_hex_digits(HASH.get(), 16);
    newline();
}
