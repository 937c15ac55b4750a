//! The control socket's server: a thread accepts connections on `<out>/control.sock`,
//! reads one request from each, hands it to the vCPU loop as a [`Command`] over a
//! crossbeam channel, kicks the vCPU thread out of `KVM_RUN` (SIGRTMIN, the watchdog's
//! signal, whose handler does nothing) until the loop replies, and writes the reply back.
//!
//! Invariants: one client at a time (a second concurrent client gets an error reply at
//! once); a request is bounded by [`MAX_MESSAGE_BYTES`] and a slow client by
//! [`CLIENT_TIMEOUT`]; the socket is created with mode 0600, never over an existing path,
//! and removed by [`ControlServer::shutdown`], which joins every thread it started (so
//! none of them signals the vCPU thread after the loop is over).

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{bounded, Receiver, RecvTimeoutError, Sender};
use vmm_sys_util::signal::{register_signal_handler, SIGRTMIN};

use super::protocol::{parse_request, Reply, Request, MAX_MESSAGE_BYTES};
use crate::error::{Result, VmmError};

/// How long a client may take to send its request or read its reply.
pub const CLIENT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a refused second client gets to send its request.
const BUSY_READ_TIMEOUT: Duration = Duration::from_secs(1);
/// How often a command still waiting for the vCPU loop re-kicks the vCPU thread (a kick
/// that lands just before `KVM_RUN` is entered is lost).
const KICK_INTERVAL: Duration = Duration::from_millis(20);
/// How long a command waits for the vCPU loop before the client is told it timed out.
const LOOP_TIMEOUT: Duration = Duration::from_secs(30);

extern "C" fn ignore_kick(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}

/// A request on its way to the vCPU loop, with where the loop's reply goes.
pub struct Command {
    /// The request.
    pub request: Request,
    /// Where to send the reply (exactly once; dropping it tells the client the run ended).
    pub reply: Sender<Reply>,
}

/// A running control server.
pub struct ControlServer {
    path: PathBuf,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl ControlServer {
    /// Listens on `path` (which must not exist) and returns the server and the receiving
    /// end the vCPU loop polls. Must be called on the vCPU thread: that is the thread it
    /// kicks.
    pub fn start(path: &Path) -> Result<(Self, Receiver<Command>)> {
        if path.symlink_metadata().is_ok() {
            return Err(VmmError::ControlSocket(
                path.to_owned(),
                std::io::Error::new(
                    std::io::ErrorKind::AlreadyExists,
                    "the path exists (another run, or a stale socket: remove it)",
                ),
            ));
        }
        let listener =
            UnixListener::bind(path).map_err(|e| VmmError::ControlSocket(path.to_owned(), e))?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
            .map_err(|e| VmmError::ControlSocket(path.to_owned(), e))?;
        // The kick's handler does nothing; without one SIGRTMIN would end the process.
        register_signal_handler(SIGRTMIN(), ignore_kick)
            .map_err(|e| VmmError::Host("installing the vCPU kick signal handler", e.into()))?;
        // SAFETY: pthread_self has no preconditions.
        let vcpu_thread = unsafe { libc::pthread_self() };
        let (tx, rx) = bounded::<Command>(1);
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("kpin-control".into())
            .spawn(move || accept_loop(listener, tx, flag, vcpu_thread))
            .map_err(|e| VmmError::Host("spawning the control thread", e))?;
        Ok((
            ControlServer {
                path: path.to_owned(),
                stop,
                thread: Some(thread),
            },
            rx,
        ))
    }

    /// Stops accepting, waits for every thread and removes the socket.
    pub fn shutdown(mut self) {
        self.stop_and_join();
    }

    fn stop_and_join(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            // Wake the accept() with a connection of our own.
            let _ = UnixStream::connect(&self.path);
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        self.stop_and_join();
    }
}

fn accept_loop(
    listener: UnixListener,
    tx: Sender<Command>,
    stop: Arc<AtomicBool>,
    vcpu_thread: libc::pthread_t,
) {
    let busy = Arc::new(Mutex::new(()));
    let mut clients: Vec<JoinHandle<()>> = Vec::new();
    for stream in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            break;
        }
        let Ok(mut stream) = stream else { continue };
        clients.retain(|c| !c.is_finished());
        let _ = stream.set_read_timeout(Some(CLIENT_TIMEOUT));
        let _ = stream.set_write_timeout(Some(CLIENT_TIMEOUT));
        let (busy, tx, stop) = (busy.clone(), tx.clone(), stop.clone());
        let handler = std::thread::Builder::new()
            .name("kpin-control-client".into())
            .spawn(move || {
                let Ok(_one) = busy.try_lock() else {
                    // Read (and drop) the request first, so the client's send completes
                    // and it reads this reply rather than a broken pipe.
                    let _ = stream.set_read_timeout(Some(BUSY_READ_TIMEOUT));
                    let _ = read_request(&mut stream);
                    let _ = stream.write_all(
                        Reply::error("another control client is connected to this run; try again")
                            .to_line()
                            .as_bytes(),
                    );
                    return;
                };
                let reply = serve(&mut stream, &tx, &stop, vcpu_thread);
                let _ = stream.write_all(reply.to_line().as_bytes());
            });
        if let Ok(h) = handler {
            clients.push(h);
        }
    }
    drop(tx);
    for c in clients {
        let _ = c.join();
    }
}

/// Reads one request, bounded in size and time.
fn read_request(stream: &mut UnixStream) -> std::result::Result<Vec<u8>, String> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let n = stream
            .read(&mut chunk)
            .map_err(|e| format!("cannot read the request: {e}"))?;
        if n == 0 {
            return Ok(buf);
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(end) = buf.iter().position(|&b| b == b'\n') {
            buf.truncate(end);
            return Ok(buf);
        }
        if buf.len() > MAX_MESSAGE_BYTES {
            return Err(format!("request too long (over {MAX_MESSAGE_BYTES} bytes)"));
        }
    }
}

fn serve(
    stream: &mut UnixStream,
    tx: &Sender<Command>,
    stop: &AtomicBool,
    vcpu_thread: libc::pthread_t,
) -> Reply {
    let request = match read_request(stream).and_then(|b| parse_request(&b)) {
        Ok(r) => r,
        Err(e) => return Reply::error(e),
    };
    let (reply_tx, reply_rx) = bounded(1);
    let cmd = Command {
        request,
        reply: reply_tx,
    };
    if tx.send(cmd).is_err() {
        return Reply::error("the run has ended");
    }
    let mut waited = Duration::ZERO;
    loop {
        if stop.load(Ordering::SeqCst) {
            return Reply::error("the run has ended");
        }
        // SAFETY: the vCPU thread is alive: it joins this thread (through
        // `ControlServer::shutdown`, after setting `stop`) before its run loop returns,
        // and SIGRTMIN's handler (installed by the watchdog) does nothing.
        unsafe { libc::pthread_kill(vcpu_thread, SIGRTMIN()) };
        match reply_rx.recv_timeout(KICK_INTERVAL) {
            Ok(r) => return r,
            Err(RecvTimeoutError::Disconnected) => return Reply::error("the run has ended"),
            Err(RecvTimeoutError::Timeout) => {
                waited += KICK_INTERVAL;
                if waited >= LOOP_TIMEOUT {
                    return Reply::error("the vCPU loop did not answer in time");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::client::{request, ClientError};
    use crate::control::protocol::parse_reply;
    use crate::control::SOCKET_NAME;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("kpin-control-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("scratch dir");
        d
    }

    /// Raw bytes in, raw reply out.
    fn raw(dir: &Path, bytes: &[u8]) -> Reply {
        let mut s = UnixStream::connect(dir.join(SOCKET_NAME)).expect("connect");
        let _ = s.write_all(bytes);
        let _ = s.shutdown(std::net::Shutdown::Write);
        let mut out = Vec::new();
        s.read_to_end(&mut out).expect("read the reply");
        parse_reply(out.trim_ascii()).expect("a JSON reply")
    }

    /// Plays the vCPU loop: answers every command with `status` ok until `n` are done.
    fn answer(rx: &Receiver<Command>, n: usize) -> Vec<Request> {
        let mut seen = Vec::new();
        while seen.len() < n {
            let cmd = rx.recv_timeout(Duration::from_secs(20)).expect("a command");
            seen.push(cmd.request.clone());
            let _ = cmd.reply.send(Reply {
                windows: Some(seen.len() as u64),
                ..Reply::ok()
            });
        }
        seen
    }

    #[test]
    fn test_requests_reach_the_loop_and_bad_ones_get_error_replies() {
        let dir = scratch("roundtrip");
        let path = dir.join(SOCKET_NAME);
        let (server, rx) = ControlServer::start(&path).expect("listen");
        let mode = std::fs::metadata(&path)
            .expect("socket")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let d = dir.clone();
        let client = std::thread::spawn(move || {
            let status = request(&d, &Request::Status).expect("status");
            let bad = raw(&d, b"{\"cmd\":\"reboot\"}\n");
            let mut big = vec![b' '; MAX_MESSAGE_BYTES + 10];
            big.push(b'\n');
            let oversize = raw(&d, &big);
            let detach = request(&d, &Request::Detach).expect("detach");
            (status, bad, oversize, detach)
        });
        let seen = answer(&rx, 2);
        let (status, bad, oversize, detach) = client.join().expect("client");
        assert_eq!(seen, vec![Request::Status, Request::Detach]);
        assert!(status.ok && status.windows == Some(1), "{status:?}");
        assert!(detach.ok && detach.windows == Some(2), "{detach:?}");
        assert!(!bad.ok && bad.error.as_deref().unwrap_or("").contains("malformed"));
        assert!(!oversize.ok && oversize.error.as_deref().unwrap_or("").contains("too long"));
        server.shutdown();
        assert!(!path.exists(), "the socket is removed at the end");
        match request(&dir, &Request::Status) {
            Err(ClientError::NoRun(..)) => {}
            other => panic!("after the end: {other:?}"),
        }
    }

    #[test]
    fn test_a_second_concurrent_client_is_refused() {
        let dir = scratch("second");
        let path = dir.join(SOCKET_NAME);
        let (server, rx) = ControlServer::start(&path).expect("listen");
        // The first client connects and sends nothing yet: it holds the channel.
        let mut first = UnixStream::connect(&path).expect("first client");
        std::thread::sleep(Duration::from_millis(200));
        let second = request(&dir, &Request::Status).expect("a reply");
        assert!(!second.ok, "{second:?}");
        assert!(
            second
                .error
                .as_deref()
                .unwrap_or("")
                .contains("another control client"),
            "{second:?}"
        );
        first.write_all(b"{\"cmd\":\"status\"}\n").expect("send");
        answer(&rx, 1);
        let mut out = Vec::new();
        first.read_to_end(&mut out).expect("reply");
        assert!(parse_reply(out.trim_ascii()).expect("JSON").ok);
        server.shutdown();
    }

    #[test]
    fn test_an_existing_path_is_refused_and_kept() {
        let dir = scratch("exists");
        let path = dir.join(SOCKET_NAME);
        std::fs::write(&path, b"not ours").expect("write");
        assert!(matches!(
            ControlServer::start(&path),
            Err(VmmError::ControlSocket(..))
        ));
        assert_eq!(std::fs::read(&path).expect("still there"), b"not ours");
    }

    #[test]
    fn test_a_request_after_the_loop_ended_says_so() {
        let dir = scratch("ended");
        let (server, rx) = ControlServer::start(&dir.join(SOCKET_NAME)).expect("listen");
        drop(rx);
        let r = request(&dir, &Request::Status).expect("a reply");
        assert!(
            !r.ok && r.error.as_deref() == Some("the run has ended"),
            "{r:?}"
        );
        server.shutdown();
    }
}
