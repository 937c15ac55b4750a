//! The per-run control channel (issue #14): every `kpin run` listens on
//! `<out>/control.sock`, and `kpin attach|detach|status` talk to it.
//!
//! - [`protocol`]: the JSON messages (one request, one reply per connection), bounded;
//! - [`server`]: the socket's thread, which hands each command to the vCPU loop over a
//!   channel and kicks the vCPU out of `KVM_RUN`;
//! - [`client`]: the command-line side.

pub mod client;
pub mod progress;
pub mod protocol;
pub mod server;
pub mod windows;

/// The control socket's file name in a run's output directory.
pub use kpin_abi::output::CONTROL_SOCKET as SOCKET_NAME;
