//! Memory: the shadow MMU over the physmap and the stolen region (`shadow.rs`), guest
//! memory as the translator and the virtual CPU reach it through the shadow MMU's walk
//! (`guest_memory.rs`), and the engine's heap (`heap.rs`, the global allocator over
//! `buddy.rs`, its pure algorithm).

pub mod buddy;
pub mod guest_memory;
pub mod heap;
pub mod shadow;
