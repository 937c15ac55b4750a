//! Architecture-specific parts. Only `x86_64` exists; iced-x86 is used nowhere else.

pub(crate) mod x86_64;

pub(crate) use x86_64::decode::{decode_trace, flags_liveness, DecodedTrace, Scratch};
pub(crate) use x86_64::emit::MapMark;
pub(crate) use x86_64::entry::{cache_enter, emit_gencode, CtxAddrs, Gencode, XsaveAreas};
pub(crate) use x86_64::isolate::{zone_bounds, Fence};
pub(crate) use x86_64::mangle::{translate_trace, EmitEnv, ExitSpec, Translated};
