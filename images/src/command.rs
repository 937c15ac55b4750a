//! Running host tools (`apt-get`, `dpkg-deb`, `tar`, `cargo`) as subprocesses.
//!
//! Invariants: a child never reads our stdin; its stdout and stderr are captured, so a failure
//! can report the tail of what the tool said; and every failure is reported together with the
//! exact command line ([`describe`]) so that the user can rerun it by hand.

use std::ffi::OsStr;
use std::io;
use std::process::{Command, ExitStatus, Output, Stdio};

/// How many trailing lines of a failed command's stderr an error keeps.
const STDERR_TAIL_LINES: usize = 12;

/// Why a host command did not succeed.
#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    /// The program could not be started (usually: it is not installed).
    #[error("the program could not be started")]
    Spawn(#[source] io::Error),
    /// Waiting for the program or reading its output failed.
    #[error("waiting for the program failed")]
    Wait(#[source] io::Error),
    /// The program ran and reported failure.
    #[error("it exited with {status}{}", format_tail(stderr_tail))]
    Failed {
        /// The exit status.
        status: ExitStatus,
        /// The last lines the program wrote to stderr.
        stderr_tail: String,
    },
}

impl CommandError {
    /// The captured stderr tail, if the program ran.
    pub(crate) fn stderr_tail(&self) -> &str {
        match self {
            CommandError::Failed { stderr_tail, .. } => stderr_tail,
            CommandError::Spawn(_) | CommandError::Wait(_) => "",
        }
    }
}

fn format_tail(tail: &str) -> String {
    if tail.is_empty() {
        String::new()
    } else {
        format!("; its stderr ends with:\n{tail}")
    }
}

/// The last [`STDERR_TAIL_LINES`] non-empty lines of `stderr`, lossily decoded.
pub(crate) fn stderr_tail(stderr: &[u8]) -> String {
    let text = String::from_utf8_lossy(stderr);
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let start = lines.len().saturating_sub(STDERR_TAIL_LINES);
    lines[start..].join("\n")
}

/// The command line of `cmd` as a user would type it, plus its working directory if set.
pub(crate) fn describe(cmd: &Command) -> String {
    let mut words = vec![quote(cmd.get_program())];
    words.extend(cmd.get_args().map(quote));
    let line = words.join(" ");
    match cmd.get_current_dir() {
        Some(dir) => format!("cd {} && {line}", quote(dir.as_os_str())),
        None => line,
    }
}

/// `word` quoted for a POSIX shell when it contains anything but plain characters.
fn quote(word: &OsStr) -> String {
    let text = word.to_string_lossy();
    let plain = !text.is_empty()
        && text
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_=+./:,%@".contains(&b));
    if plain {
        text.into_owned()
    } else {
        format!("'{}'", text.replace('\'', r"'\''"))
    }
}

/// Runs `cmd` to completion with stdin closed and stdout/stderr captured.
pub(crate) fn run_captured(cmd: &mut Command) -> Result<Output, CommandError> {
    let output = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(CommandError::Spawn)?
        .wait_with_output()
        .map_err(CommandError::Wait)?;
    check_status(output.status, &output.stderr)?;
    Ok(output)
}

/// `Ok` if `status` is success, else [`CommandError::Failed`] with the tail of `stderr`.
pub(crate) fn check_status(status: ExitStatus, stderr: &[u8]) -> Result<(), CommandError> {
    if status.success() {
        Ok(())
    } else {
        Err(CommandError::Failed {
            status,
            stderr_tail: stderr_tail(stderr),
        })
    }
}

/// The first line of `gcc --version`, part of the stamps of what gcc builds: asked once
/// per process (it cannot change under one `kpin run`, and each ask is a process, ~8 ms:
/// four a run before). A failure is not remembered; `on_error` gets the command line and
/// the error.
pub(crate) fn gcc_version<E>(
    on_error: impl FnOnce(String, CommandError) -> E,
) -> Result<String, E> {
    static VERSION: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    if let Some(v) = VERSION.get() {
        return Ok(v.clone());
    }
    let mut cmd = Command::new("gcc");
    cmd.arg("--version");
    let out = run_captured(&mut cmd).map_err(|e| on_error(describe(&cmd), e))?;
    let v = String::from_utf8_lossy(&out.stdout)
        .lines()
        .next()
        .unwrap_or("")
        .to_owned();
    Ok(VERSION.get_or_init(|| v).clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_describe_quotes_only_special_words() {
        let mut cmd = Command::new("apt-get");
        cmd.args([
            "download",
            "busybox-static=1:1.35.0-4+deb12u1+b1",
            "a b",
            "it's",
        ]);
        cmd.current_dir("/tmp/x y");
        assert_eq!(
            describe(&cmd),
            r"cd '/tmp/x y' && apt-get download busybox-static=1:1.35.0-4+deb12u1+b1 'a b' 'it'\''s'"
        );
    }

    #[test]
    fn test_stderr_tail_keeps_last_nonempty_lines() {
        let text: String = (0..20).map(|i| format!("line {i}\n\n")).collect();
        let tail = stderr_tail(text.as_bytes());
        assert_eq!(tail.lines().count(), STDERR_TAIL_LINES);
        assert!(tail.starts_with("line 8"));
        assert!(tail.ends_with("line 19"));
    }

    #[test]
    fn test_run_captured_reports_status_and_stderr() {
        let err = run_captured(Command::new("sh").args(["-c", "echo oops >&2; exit 3"]))
            .expect_err("the command fails");
        assert_eq!(err.stderr_tail(), "oops");
        let message = err.to_string();
        assert!(message.contains("exit status: 3"), "{message}");
        assert!(message.contains("oops"), "{message}");
    }

    #[test]
    fn test_run_captured_reports_missing_program() {
        let err = run_captured(&mut Command::new("/nonexistent/kpin-no-such-program"))
            .expect_err("the program does not exist");
        assert!(matches!(err, CommandError::Spawn(_)));
    }
}
