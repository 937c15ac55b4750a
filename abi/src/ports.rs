//! Port numbers the engine uses to reach the VMM. Both are otherwise unused on a PC.
//! An `out` to either port (one byte, any value) exits to the VMM.

/// The host I/O ring's doorbell: the VMM drains the ring before resuming the vCPU.
/// The engine rings it only when the ring is past its batch threshold, when a record does
/// not fit, and at flush points, so a busy tool does not exit per write.
pub const DOORBELL_PORT: u16 = 0x0f10;
/// The engine failed (an unexpected fault inside the engine, a full code cache that cannot
/// be flushed, a guest triple fault): the VMM drains the ring (the engine's last log lines
/// and last-traces record), dumps state and ends the run as a crash.
pub const ENGINE_FAILURE_PORT: u16 = 0x0f11;
