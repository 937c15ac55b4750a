//! x86-64: decoding (iced-x86), translation rules, glue encoding and the cache entry code.

mod compat;
pub(crate) mod decode;
pub(crate) mod emit;
pub mod entry;
pub(crate) mod insert;
pub mod isolate;
pub(crate) mod mangle;
mod vflags;
