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
use vmm_sys_util::signal::SIGRTMIN;

use super::protocol::{parse_request, Reply, Request, MAX_MESSAGE_BYTES};
use crate::error::{Result, VmmError};

/// How long a client may take to send its request or read its reply.
pub const CLIENT_TIMEOUT: Duration = Duration::from_secs(10);
/// How often a command still waiting for the vCPU loop re-kicks the vCPU thread (a kick
/// that lands just before `KVM_RUN` is entered is lost).
const KICK_INTERVAL: Duration = Duration::from_millis(20);
/// How long a command waits for the vCPU loop before the client is told it timed out.
const LOOP_TIMEOUT: Duration = Duration::from_secs(30);

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
