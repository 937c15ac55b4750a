//! kpin's guest engine image: a no_std binary for `x86_64-unknown-none`, linked at
//! `kpin_abi::stolen::WINDOW_VA + ENGINE_OFFSET`, loaded by the VMM into the stolen region
//! and entered at `_start` (see `ring0/entry.rs`) with the attach block in RDI.
//!
//! It brings itself up — its own GDT, TSS with IST stacks, IDT, the ring-0 gate, the
//! I/O-ring log, its own page tables — optionally measures the gate and the timer at
//! CPL 3, then runs the guest from the code cache with the translator (`guest-engine`)
//! at hardware CPL 3 (`run/`), emulating the sensitive instructions it knows
//! (`guest_engine::vcpu`, on this machine's hardware through `run/vcpu.rs`) and stopping
//! with a clear report at the first one it does not. Layout: `ring0/` (ring-0 code and the
//! engine's own machine state), `events/` (interrupts, timer), `mm/` (shadow MMU, guest
//! memory, heap), `run/` (bring-up flow, run loop); see `docs/ARCHITECTURE.md`.
#![no_std]
#![no_main]
#![deny(missing_docs)]

extern crate alloc;

mod events;
mod json;
mod mm;
mod ring0;
mod run;

/// The address `link.ld` links the image at; it must be where the VMM loads it.
const LINK_BASE: u64 = 0xffff_8080_0020_0000;
const _: () = assert!(
    LINK_BASE == kpin_abi::stolen::WINDOW_VA + kpin_abi::stolen::ENGINE_OFFSET,
    "link.ld and kpin-abi disagree on the engine's address"
);

#[panic_handler]
fn panic(info: &core::panic::PanicInfo<'_>) -> ! {
    ring0::crash::panic(info)
}
