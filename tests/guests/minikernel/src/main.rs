//! kpin's mini-kernel: a tiny 64-bit guest OS that exercises, on purpose and in a fixed order,
//! every CPU mechanism kpin has to virtualize, and prints one line per step on COM1.
//!
//! Boot contract (Linux 64-bit boot protocol as kpin's VMM implements it): entered at
//! `_start` in long mode with RSI = `boot_params`, interrupts off, no IDT. The kernel loads
//! its own GDT/TSS/IDT, builds its own page tables, prints `MINIKERNEL-START`, runs the
//! steps of `steps::STEPS`, prints `MINIKERNEL-DONE <fnv1a64>` and powers off through the
//! i8042. See README.md for the transcript format and how it is compared.

#![no_std]
#![no_main]

mod bootinfo;
mod console;
mod cpu;
mod entry;
mod gdt;
mod global;
mod layout;
mod paging;
mod pic;
mod selftest;
mod steps;
mod syscall;
mod traps;
mod user;

use crate::console::{fresh_line, print, print_dec};
use crate::layout::{FRAME_POOL_END, IMAGE_BASE};

/// Rust entry, called by `_start` with the physical address of `boot_params`.
extern "C" fn kmain(boot_params: u64) -> ! {
    gdt::init();
    traps::init();
    console::start_transcript();
    bootinfo::init(boot_params, IMAGE_BASE, FRAME_POOL_END);
    paging::init();
    pic::remap_and_mask();
    user::init();
    selftest::crash_if_requested();
    steps::run_all();
    console::finish_transcript();
    cpu::poweroff()
}

#[panic_handler]
fn panic(info: &core::panic::PanicInfo) -> ! {
    fresh_line();
    print("MINIKERNEL-PANIC vector=none rust-panic");
    if let Some(location) = info.location() {
        print(" at ");
        print(location.file());
        print(":");
        print_dec(u64::from(location.line()));
    }
    print("\n");
    cpu::poweroff()
}
