//! Starting a guest under the guest engine (`--tool`): loading the engine image into the
//! stolen region, filling the attach block with the guest's native boot state, and
//! entering the engine instead of the guest.

pub mod attach;
pub mod detach;
pub mod enter;
pub mod host_sim;
pub mod loader;

pub use enter::{EngineConfig, EngineEntry};
