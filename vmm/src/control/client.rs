//! The client side of the control channel, for `kpin attach|detach|status`.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;

use super::protocol::{parse_reply, Reply, Request, MAX_MESSAGE_BYTES};
use super::server::{CLIENT_TIMEOUT, REQUEST_DEADLINE};
use super::SOCKET_NAME;

/// Why a request could not be answered.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// No run at that directory, or it has ended.
    #[error("no running kpin run at {0} (no control socket, or the run has ended): {1}")]
    NoRun(String, std::io::Error),
    /// The connection broke or the reply was not understood.
    #[error("control channel of {0}: {1}")]
    Channel(String, String),
}

/// Sends `request` to the run whose output directory is `run_dir` and returns its reply.
pub fn request(run_dir: &Path, request: &Request) -> Result<Reply, ClientError> {
    let path = run_dir.join(SOCKET_NAME);
    let shown = run_dir.display().to_string();
    let mut stream =
        UnixStream::connect(&path).map_err(|e| ClientError::NoRun(shown.clone(), e))?;
    let chan = |e: String| ClientError::Channel(shown.clone(), e);
    let _ = stream.set_read_timeout(Some(CLIENT_TIMEOUT));
    let _ = stream.set_write_timeout(Some(REQUEST_DEADLINE));
    let mut line = serde_json::to_vec(request).map_err(|e| chan(e.to_string()))?;
    line.push(b'\n');
    // A run that refuses at once (too many clients, rate limited) may close before all of
    // the request is read: its reply still waits to be read, and may be followed by a
    // reset connection instead of an end of stream.
    let sent = stream.write_all(&line);
    let _ = stream.shutdown(std::net::Shutdown::Write);
    let mut buf = Vec::new();
    let read = stream
        .take(MAX_MESSAGE_BYTES as u64 + 1)
        .read_to_end(&mut buf);
    if buf.is_empty() {
        return Err(chan(match (read, sent) {
            (Err(e), _) => format!("cannot read the reply: {e}"),
            (Ok(_), Err(e)) => format!("cannot send: {e}"),
            (Ok(_), Ok(())) => "the run closed the connection without a reply".into(),
        }));
    }
    parse_reply(buf.trim_ascii()).map_err(chan)
}

/// Exit status of `kpin attach|detach|status` when the run answered yes.
pub const EXIT_OK: u8 = 0;
/// Exit status when there is no such run (or it ended) or the channel failed.
pub const EXIT_NO_RUN: u8 = 1;
/// Exit status when the run refused the request (attach while attached, detach while
/// detached, an unknown tool or option, another client's command in progress, too many
/// clients, rate limited, permission denied).
pub const EXIT_REFUSED: u8 = 2;

/// Runs one `kpin attach|detach|status` command: prints the reply as JSON on stdout (or
/// the error on stderr) and returns the exit status.
pub fn command(run_dir: &Path, req: &Request) -> u8 {
    match request(run_dir, req) {
        Ok(reply) if reply.ok => {
            println!(
                "{}",
                serde_json::to_string_pretty(&reply).unwrap_or_else(|_| reply.to_line())
            );
            EXIT_OK
        }
        Ok(reply) => {
            eprintln!(
                "kpin: error: {}",
                reply
                    .error
                    .as_deref()
                    .unwrap_or("the run refused the request")
            );
            EXIT_REFUSED
        }
        Err(e) => {
            eprintln!("kpin: error: {e}");
            EXIT_NO_RUN
        }
    }
}
