//! Host unit tests for the pure parts of the engine image. The image builds only for
//! `x86_64-unknown-none` (it has `asm!`, its own entry point and a global allocator over
//! the stolen region), so the modules that need none of that are compiled here a second
//! time, by path, and tested on the host: the heap's algorithm (`mm/buddy.rs`) and the
//! counters' JSON writer (`json.rs`).

#[cfg(test)]
extern crate alloc;

#[cfg(test)]
#[path = "../image/src/mm/buddy.rs"]
mod buddy;
#[cfg(test)]
#[path = "../image/src/json.rs"]
mod json;

#[cfg(test)]
mod tests;
