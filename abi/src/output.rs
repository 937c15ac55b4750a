//! The names of the files kpin itself writes in a run's output directory (each window's
//! `attach-<n>/` has its own `engine.log`, `counters.json` and `profile.txt`), shared by
//! the VMM, the host daemon and the engine image. A tool's own files are named by its
//! crate.

/// The guest's console (the VMM).
pub const CONSOLE_LOG: &str = "console.log";
/// The run's summary and completeness record (the VMM).
pub const RUN_JSON: &str = "run.json";
/// The guest-state dump of a run that did not end cleanly (the VMM).
pub const DUMP_TXT: &str = "dump.txt";
/// The engine's log, through the I/O ring (the daemon).
pub const ENGINE_LOG: &str = "engine.log";
/// The engine's counters, written through the ring at the end of a run or window.
pub const ENGINE_COUNTERS: &str = "counters.json";
/// The engine's cycle profile, written through the ring beside the counters.
pub const ENGINE_PROFILE: &str = "profile.txt";
/// The processes the engine saw run (pid, tgid, comm, first/last seen, instructions per
/// CPL), written through the ring beside the counters (`docs/processes.md`).
pub const ENGINE_PROCESSES: &str = "processes.json";
/// The run's control socket (the VMM).
pub const CONTROL_SOCKET: &str = "control.sock";
/// The copy of a built-in guest's disk image the run boots and writes (`--guest debian`;
/// the VMM).
pub const GUEST_DISK_COPY: &str = "debian-disk.img";
