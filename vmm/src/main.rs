//! `kpin`: run a guest under kpin's VMM, natively or under the guest engine (`--tool`).
//!
//! The binary's modules: `cli` (the command line and its help texts), `cmd/` (one module
//! per command: `run`, `images`, `control` for attach/detach/status, `trace`, `new_tool`), `summary`
//! (the records `run.json` holds), `run_record` (writing them, and what the end of a run
//! says about its output), `stop_signals` (SIGINT/SIGTERM), `tools_cmd` (`kpin tools`).

use std::process::ExitCode;

use clap::Parser;
use vmm::input_check::UsageError;

mod cli;
mod cmd;
mod run_record;
mod stop_signals;
mod summary;
mod tools_cmd;

use cli::{Cli, Command};

/// Exit status of a clean guest poweroff.
const EXIT_CLEAN: u8 = 0;
/// Exit status when kpin itself fails (bad input, no KVM, images cannot be built).
const EXIT_HOST_ERROR: u8 = 1;
/// Exit status for a bad command line (clap's own errors use it too).
const EXIT_USAGE: u8 = 2;
/// Exit status when the guest crashes (triple fault, KVM emulation failure, unhandled
/// I/O, kernel panic).
const EXIT_GUEST_CRASH: u8 = 3;
/// Exit status when the run's timeout expires.
const EXIT_TIMEOUT: u8 = 4;
/// Exit status when the output directory could not be written (file system full or
/// read-only, an I/O error): the run's results are incomplete. (A run stopped by SIGINT or
/// SIGTERM exits with 128 + the signal: 130, 143.)
const EXIT_OUTPUT_FAILED: u8 = 5;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Images {
            dir,
            generic_612,
            debian,
        } => cmd::images::images(dir, generic_612, debian).map(|()| EXIT_CLEAN),
        Command::Run(args) => cmd::run::run(*args),
        Command::Attach {
            run,
            tool,
            tool_option,
        } => cmd::control::attach(&run, tool, &tool_option),
        Command::Detach { run } => Ok(cmd::control::detach(&run)),
        Command::Status { run } => Ok(cmd::control::status(&run)),
        Command::Trace {
            run,
            limit,
            kernel,
            system_map,
        } => cmd::trace::trace(&run, limit, kernel.as_deref(), system_map.as_deref())
            .map(|()| EXIT_CLEAN),
        Command::Tools => {
            print!("{}", tools_cmd::render());
            Ok(EXIT_CLEAN)
        }
        Command::NewTool { dir, name } => cmd::new_tool::new_tool(&dir, &name).map(|()| EXIT_CLEAN),
    };
    match result {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("kpin: error: {e:#}");
            if e.downcast_ref::<UsageError>().is_some() {
                ExitCode::from(EXIT_USAGE)
            } else {
                ExitCode::from(EXIT_HOST_ERROR)
            }
        }
    }
}

/// Says what kpin is doing, on stderr (`kpin: <line>`).
fn progress(line: &str) {
    eprintln!("kpin: {line}");
}
