//! One module per `kpin` command (the command line itself is `cli.rs`).

pub(crate) mod control;
pub(crate) mod images;
pub(crate) mod new_tool;
pub(crate) mod processes;
pub(crate) mod reports;
pub(crate) mod run;
pub(crate) mod trace;
