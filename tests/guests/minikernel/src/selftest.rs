//! Crash self-tests: `minikernel.crash=NAME` on the command line makes the kernel crash on
//! purpose right after the `MINIKERNEL-START` line, to prove that failures end in a
//! `MINIKERNEL-PANIC` line and a poweroff instead of a hang:
//! * `stack-overflow`: unbounded recursion runs into the kernel stack's guard page; the #PF
//!   cannot be delivered on the overflowed stack, so the CPU raises #DF, handled on IST1
//!   (`vector=8`).
//! * `null-deref`: a kernel read of address 0 (page 0 is unmapped): `vector=14`.
//! * `user-hang`: a ring-3 loop that never returns; the PIT watchdog reports it after 5 s
//!   (`vector=32 ... watchdog`).
//! * anything else: a Rust panic (`rust-panic`).

use core::hint::black_box;

use crate::bootinfo::option;
use crate::console::{print, put_byte};
use crate::user::{self, Program};

/// Performs the crash the command line asks for, if any (never returns then).
pub fn crash_if_requested() {
    let Some(name) = option("minikernel.crash=") else {
        return;
    };
    print("selftest crash=");
    for &b in name {
        put_byte(b);
    }
    print("\n");
    match name {
        b"stack-overflow" => {
            black_box(recurse(0));
        }
        b"null-deref" => {
            // SAFETY: not safe at all on purpose: page 0 is unmapped, so this read faults and
            // the trap handler powers the VM off before the value could be used.
            black_box(unsafe { core::ptr::read_volatile(black_box(0usize) as *const u64) });
        }
        b"user-hang" => {
            user::run(Program::Hang, 0, None);
        }
        _ => {}
    }
    panic!("crash self-test did not crash");
}

/// Recurses until the stack overflows.
#[inline(never)]
fn recurse(depth: u64) -> u64 {
    let mut frame = [depth; 32];
    black_box(&mut frame);
    if depth == u64::MAX {
        return 0;
    }
    recurse(black_box(depth + 1)).wrapping_add(frame[1])
}
