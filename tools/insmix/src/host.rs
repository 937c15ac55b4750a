//! insmix's host-side part (feature `host`): after a run, the per-process table of the
//! engine's `processes.json` ([`kpin_tool::processes`]) in [`PROCESSES_NAME`] and in
//! `run.json`'s `insmix`: which process executed how many instructions, user and kernel
//! on its behalf. The mix itself is not split per process (the counters are per block,
//! and a block is shared by every process that runs its code).

extern crate std;

use alloc::boxed::Box;
use alloc::format;
use std::path::Path;

use kpin_tool::host_side::{storage_failure, HostTool, Reported, RunFiles};
use kpin_tool::processes::Processes;

/// The table's file in the output directory.
pub const PROCESSES_NAME: &str = "insmix-processes.txt";

/// The host part the registry lists.
#[derive(Clone, Copy, Debug)]
pub struct Host;

impl HostTool for Host {
    fn spec(&self) -> &'static kpin_tool::ToolSpec {
        &crate::SPEC
    }

    fn run_json_key(&self) -> Option<&'static str> {
        Some(crate::SPEC.name)
    }

    fn report_files(&self) -> &'static [&'static str] {
        &[PROCESSES_NAME]
    }

    fn report(&self, run: &mut RunFiles<'_>) -> Reported {
        // Only a finished run's files are results.
        let engine_file = kpin_abi::output::ENGINE_PROCESSES;
        if run.is_unfinished(crate::TXT_NAME) || run.is_unfinished(engine_file) {
            return Reported::default();
        }
        match write_table(run.dir, run.top) {
            Ok(Some(p)) => {
                run.say(&format!(
                    "{}:\n{}",
                    run.dir.join(PROCESSES_NAME).display(),
                    p.render(run.top)
                ));
                Reported {
                    run_json: Some(Box::new(p)),
                    failure: None,
                }
            }
            Ok(None) => Reported::default(),
            Err((msg, failure)) => {
                run.say(&format!("insmix: no per-process table: {msg}"));
                Reported {
                    run_json: None,
                    failure,
                }
            }
        }
    }
}

/// A failure: what to say, and the file the host's storage refused (exit status 5).
type Failure = (
    alloc::string::String,
    Option<(std::path::PathBuf, std::io::Error)>,
);

/// Reads `<out>/processes.json` and writes [`PROCESSES_NAME`] with its `top` rows;
/// `Ok(None)` if the run wrote no `processes.json`.
fn write_table(out: &Path, top: usize) -> Result<Option<Processes>, Failure> {
    let Some(p) = Processes::read(out).map_err(|e| (e, None))? else {
        return Ok(None);
    };
    let path = out.join(PROCESSES_NAME);
    host_daemon::resolve::write_output_file(&path, p.render(top).as_bytes()).map_err(|e| {
        (
            format!("cannot write {}: {e}", path.display()),
            storage_failure(&path, &e),
        )
    })?;
    Ok(Some(p))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_the_table_is_written_from_processes_json() {
        let dir = std::env::temp_dir().join(format!("kpin-insmix-host-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert!(
            write_table(&dir, 5).unwrap().is_none(),
            "no processes.json, no table"
        );
        std::fs::write(
            dir.join(kpin_abi::output::ENGINE_PROCESSES),
            r#"{"by":"task","user_instructions":30,"kernel_instructions":70,"processes":[
                {"kind":"boot","pid":null,"comm":null,"cr3":"0x0","user_instructions":0,"kernel_instructions":60},
                {"kind":"task","pid":5,"comm":"sort","exe":"busybox","cr3":"0x1000","user_instructions":30,"kernel_instructions":10}]}"#,
        )
        .unwrap();
        let p = write_table(&dir, 5).unwrap().expect("a table");
        assert!(p.rows_sum_to_totals);
        let text = std::fs::read_to_string(dir.join(PROCESSES_NAME)).unwrap();
        assert_eq!(text, p.render(5));
        assert!(text.contains(" sort "), "{text}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
