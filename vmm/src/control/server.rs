//! The control socket's server: a thread accepts connections on `<out>/control.sock`,
//! checks each peer's credentials, and hands it to a handler thread that reads one
//! request, passes it to the vCPU loop as a [`Command`] over a crossbeam channel, kicks
//! the vCPU thread out of `KVM_RUN` (SIGRTMIN, the watchdog's signal, whose handler does
//! nothing) until the loop replies, and writes the reply back.
//!
//! Clients are hostile (issue #24). Invariants (the numbers are [`Limits::default`]'s):
//! - the guest never waits for a client: nothing a client does blocks the vCPU thread,
//!   which only polls the channel (bounded by [`Limits::max_clients`]) and sends each
//!   reply into a one-slot channel;
//! - only the run's owner (kpin's effective uid) or root may connect: the peer's uid is
//!   read with `SO_PEERCRED` on every connection, and anyone else gets
//!   `permission denied: uid N is not the run's owner` and is closed;
//! - at most [`Limits::max_clients`] (16) handler threads at once; a connection beyond
//!   that gets `too many control clients` from the accepting thread, which answers
//!   without waiting and spawns nothing for it;
//! - a request is read in full, bounded by [`MAX_MESSAGE_BYTES`] and by one total
//!   deadline from the connection ([`Limits::request_deadline`], 2 s; not per read: a
//!   client trickling a byte at a time cannot extend it), *before* the
//!   one-command-at-a-time slot is taken, so a silent, half-closed or stalled client holds
//!   a handler thread for at most the deadline and never holds off another client's
//!   command;
//! - one attach or detach in the vCPU loop at a time: a client whose attach or detach
//!   arrives while another's is being served gets an error reply at once; `status` never
//!   waits for the slot (the loop answers it even while an attach or detach waits for the
//!   engine's safe point);
//! - at most [`Limits::rate_burst`] (50) commands at once and
//!   [`Limits::rate_per_second`] (100) a second on average reach the vCPU loop (a token
//!   bucket); one over that gets `rate limited` at once, never a queue;
//! - the socket is created with mode 0600, never over an existing path, and removed by
//!   [`ControlServer::shutdown`], which joins every thread it started (so none of them
//!   signals the vCPU thread after the loop is over); handlers see the stop within
//!   `READ_SLICE` while reading, and within `KICK_INTERVAL` while waiting.

use std::io::{ErrorKind, Read};
use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, TryLockError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Receiver, RecvTimeoutError, Sender, TrySendError};
use vmm_sys_util::signal::{register_signal_handler, SIGRTMIN};

use super::protocol::{parse_request, Reply, Request, MAX_MESSAGE_BYTES};
use crate::error::{Result, VmmError};

/// How long a client has, from its connection, to send its whole request.
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(2);
/// How long writing a reply may take (a client that does not read it).
const REPLY_TIMEOUT: Duration = Duration::from_secs(2);
/// The longest a handler blocks in one read, so it sees [`ControlServer::shutdown`].
const READ_SLICE: Duration = Duration::from_millis(50);
/// How long the accepting thread pauses after a failed `accept` (out of file descriptors
/// under a flood), instead of spinning.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(10);
/// How often a command still waiting for the vCPU loop re-kicks the vCPU thread (a kick
/// that lands just before `KVM_RUN` is entered is lost).
const KICK_INTERVAL: Duration = Duration::from_millis(20);
/// How long a command waits for the vCPU loop before the client is told it timed out.
pub const LOOP_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a client waits for its reply: longer than a server can take to give it.
pub const CLIENT_TIMEOUT: Duration = Duration::from_secs(40);
const _: () = assert!(
    CLIENT_TIMEOUT.as_secs()
        > REQUEST_DEADLINE.as_secs() + LOOP_TIMEOUT.as_secs() + REPLY_TIMEOUT.as_secs()
);

/// What the server allows its clients.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Total time from a connection to its complete request.
    pub request_deadline: Duration,
    /// Connection handler threads at once.
    pub max_clients: usize,
    /// Commands passed to the vCPU loop per second, on average.
    pub rate_per_second: f64,
    /// Commands passed to the vCPU loop in a burst.
    pub rate_burst: f64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            request_deadline: REQUEST_DEADLINE,
            max_clients: 16,
            rate_per_second: 100.0,
            rate_burst: 50.0,
        }
    }
}

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

/// What the accepting thread and the handlers share.
struct Shared {
    limits: Limits,
    stop: Arc<AtomicBool>,
    /// Held while a command is in the vCPU loop.
    busy: Mutex<()>,
    rate: Mutex<TokenBucket>,
    /// Handler threads alive.
    handlers: AtomicUsize,
    vcpu_thread: libc::pthread_t,
    /// The run's owner: kpin's effective uid.
    owner: u32,
}

impl ControlServer {
    /// Listens on `path` (which must not exist) and returns the server and the receiving
    /// end the vCPU loop polls. Must be called on the vCPU thread: that is the thread it
    /// kicks.
    pub fn start(path: &Path) -> Result<(Self, Receiver<Command>)> {
        Self::start_with(path, Limits::default())
    }

    /// [`ControlServer::start`] with other limits.
    pub fn start_with(path: &Path, limits: Limits) -> Result<(Self, Receiver<Command>)> {
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
        // Room for every handler's command: a status may wait beside an attach.
        let (tx, rx) = bounded::<Command>(limits.max_clients);
        let stop = Arc::new(AtomicBool::new(false));
        let shared = Arc::new(Shared {
            limits,
            stop: stop.clone(),
            busy: Mutex::new(()),
            rate: Mutex::new(TokenBucket::new(
                limits.rate_per_second,
                limits.rate_burst,
                Instant::now(),
            )),
            handlers: AtomicUsize::new(0),
            // SAFETY: pthread_self has no preconditions.
            vcpu_thread: unsafe { libc::pthread_self() },
            // SAFETY: geteuid has no preconditions and cannot fail.
            owner: unsafe { libc::geteuid() },
        });
        let thread = std::thread::Builder::new()
            .name("kpin-control".into())
            .spawn(move || accept_loop(listener, tx, shared))
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

/// Whether a client whose uid is `peer` may control a run owned by `owner`: the same
/// user, or root.
pub fn peer_allowed(peer: u32, owner: u32) -> bool {
    peer == owner || peer == 0
}

/// The uid of the process at the other end of `stream`, from `SO_PEERCRED` (the
/// credentials it had when it connected; the kernel fills them in, the client cannot).
pub fn peer_uid(stream: &UnixStream) -> std::io::Result<u32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: the descriptor is open for `stream`'s lifetime, and `cred` and `len` are
    // valid for writes of the sizes given.
    let r = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut cred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if len as usize != std::mem::size_of::<libc::ucred>() {
        return Err(std::io::Error::new(
            ErrorKind::InvalidData,
            "short SO_PEERCRED answer",
        ));
    }
    Ok(cred.uid)
}

/// A token bucket: up to `burst` tokens, refilled at `per_second`; a command takes one.
#[derive(Debug)]
pub struct TokenBucket {
    tokens: f64,
    last: Instant,
    per_second: f64,
    burst: f64,
}

impl TokenBucket {
    /// A full bucket at `now`.
    pub fn new(per_second: f64, burst: f64, now: Instant) -> Self {
        TokenBucket {
            tokens: burst,
            last: now,
            per_second,
            burst,
        }
    }

    /// Takes a token at `now` if there is one.
    pub fn take(&mut self, now: Instant) -> bool {
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.tokens = (self.tokens + elapsed * self.per_second).min(self.burst);
        self.last = self.last.max(now);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// One of the [`Limits::max_clients`] handler places; given back when dropped.
struct HandlerSlot(Arc<Shared>);

impl HandlerSlot {
    fn take(shared: &Arc<Shared>) -> Option<Self> {
        shared
            .handlers
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < shared.limits.max_clients).then_some(n + 1)
            })
            .ok()
            .map(|_| HandlerSlot(shared.clone()))
    }
}

impl Drop for HandlerSlot {
    fn drop(&mut self) {
        self.0.handlers.fetch_sub(1, Ordering::SeqCst);
    }
}

fn accept_loop(listener: UnixListener, tx: Sender<Command>, shared: Arc<Shared>) {
    let mut clients: Vec<JoinHandle<()>> = Vec::new();
    loop {
        let accepted = listener.accept();
        if shared.stop.load(Ordering::SeqCst) {
            break;
        }
        let Ok((stream, _)) = accepted else {
            std::thread::sleep(ACCEPT_BACKOFF);
            continue;
        };
        let accepted = Instant::now();
        clients.retain(|c| !c.is_finished());
        match peer_uid(&stream) {
            Ok(uid) if peer_allowed(uid, shared.owner) => {}
            Ok(uid) => {
                refuse(
                    stream,
                    &format!("permission denied: uid {uid} is not the run's owner"),
                );
                continue;
            }
            Err(e) => {
                refuse(
                    stream,
                    &format!("permission denied: cannot read the client's credentials: {e}"),
                );
                continue;
            }
        }
        let Some(slot) = HandlerSlot::take(&shared) else {
            refuse(stream, "too many control clients; try again");
            continue;
        };
        let tx = tx.clone();
        let handler = std::thread::Builder::new()
            .name("kpin-control-client".into())
            .spawn(move || {
                let shared = slot.0.clone();
                let stream = handle(stream, accepted, &tx, &shared);
                // The slot is free before the client can see its connection close: a
                // client that read its reply to the end may connect again at once.
                drop(slot);
                drop(stream);
            });
        // (A failed spawn drops the closure: the connection closes without a reply.)
        if let Ok(h) = handler {
            clients.push(h);
        }
    }
    drop(tx);
    for c in clients {
        let _ = c.join();
    }
}

/// Answers `msg` to a connection without waiting for it: takes what it already sent (so
/// closing does not reset the connection before it reads the reply), writes the reply
/// if it fits in the socket's buffer, and closes.
fn refuse(mut stream: UnixStream, msg: &str) {
    if stream.set_nonblocking(true).is_err() {
        return;
    }
    drain(&mut stream);
    send_all(&stream, Reply::error(msg).to_line().as_bytes());
}

/// Writes `bytes` (within the socket's send timeout, or as far as a non-blocking socket
/// takes them) with `MSG_NOSIGNAL`: a client that closed early is an `EPIPE`, never a
/// SIGPIPE for a process that did not ignore it.
fn send_all(stream: &UnixStream, mut bytes: &[u8]) {
    while !bytes.is_empty() {
        // SAFETY: the descriptor is open for `stream`'s lifetime and `bytes` is valid for
        // reads of its length.
        let n = unsafe {
            libc::send(
                stream.as_raw_fd(),
                bytes.as_ptr().cast(),
                bytes.len(),
                libc::MSG_NOSIGNAL,
            )
        };
        match usize::try_from(n) {
            Ok(0) => return,
            Ok(n) => bytes = &bytes[n.min(bytes.len())..],
            Err(_) if std::io::Error::last_os_error().kind() == ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}

/// Takes up to a message's worth of what the client has sent and nobody read, without
/// waiting: a connection closed with unread bytes is reset, and a client reading to the
/// end of its stream then gets an error after the reply (many drop the reply with it).
fn drain(stream: &mut UnixStream) {
    let mut chunk = [0u8; 4096];
    let mut taken = 0;
    while taken <= MAX_MESSAGE_BYTES {
        match stream.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => taken += n,
        }
    }
}

/// Serves one connection: reads its request (bounded in size and total time), passes it
/// on, writes the reply; returns the connection for the caller to close.
fn handle(
    mut stream: UnixStream,
    accepted: Instant,
    tx: &Sender<Command>,
    shared: &Shared,
) -> UnixStream {
    let limit = shared.limits.request_deadline;
    let reply = match read_request(&mut stream, accepted, limit, &shared.stop)
        .and_then(|b| parse_request(&b))
    {
        Ok(request) => forward(request, tx, shared),
        Err(e) => Reply::error(e),
    };
    let _ = stream.set_write_timeout(Some(REPLY_TIMEOUT));
    send_all(&stream, reply.to_line().as_bytes());
    if stream.set_nonblocking(true).is_ok() {
        drain(&mut stream);
    }
    stream
}

/// Reads one request: up to its first newline or the end of the client's stream, at most
/// [`MAX_MESSAGE_BYTES`], complete within `limit` of `accepted`.
fn read_request(
    stream: &mut UnixStream,
    accepted: Instant,
    limit: Duration,
    stop: &AtomicBool,
) -> std::result::Result<Vec<u8>, String> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if stop.load(Ordering::SeqCst) {
            return Err("the run has ended".into());
        }
        let left = (accepted + limit).saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!(
                "no complete request within {} ms of connecting (send one line, then read \
                 the reply)",
                limit.as_millis()
            ));
        }
        let _ = stream.set_read_timeout(Some(left.min(READ_SLICE)));
        let room = (MAX_MESSAGE_BYTES + 1 - buf.len()).min(chunk.len());
        match stream.read(&mut chunk[..room]) {
            Ok(0) => return Ok(buf),
            Ok(n) => {
                buf.extend_from_slice(&chunk[..n]);
                if let Some(end) = buf.iter().position(|&b| b == b'\n') {
                    buf.truncate(end);
                    return Ok(buf);
                }
                if buf.len() > MAX_MESSAGE_BYTES {
                    return Err(format!("request too long (over {MAX_MESSAGE_BYTES} bytes)"));
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                ) => {}
            Err(e) => return Err(format!("cannot read the request: {e}")),
        }
    }
}
/// Passes `request` to the vCPU loop if no other command is there and the rate allows,
/// and waits for its reply.
fn forward(request: Request, tx: &Sender<Command>, shared: &Shared) -> Reply {
    const BUSY: &str =
        "another control client's attach or detach is being served by this run; try again";
    let _one = match (request == Request::Status, shared.busy.try_lock()) {
        (true, _) => None,
        (false, Ok(one)) => Some(one),
        (false, Err(TryLockError::Poisoned(p))) => Some(p.into_inner()),
        (false, Err(TryLockError::WouldBlock)) => return Reply::error(BUSY),
    };
    let allowed = shared
        .rate
        .lock()
        .map(|mut r| r.take(Instant::now()))
        .unwrap_or(false);
    if !allowed {
        return Reply::error(format!(
            "rate limited: at most {} control commands per second; try again",
            shared.limits.rate_per_second
        ));
    }
    let (reply_tx, reply_rx) = bounded(1);
    let cmd = Command {
        request,
        reply: reply_tx,
    };
    // Never waits: the channel holds a command per handler, so it is full only if the
    // loop took none of them in `LOOP_TIMEOUT`.
    match tx.try_send(cmd) {
        Ok(()) => {}
        Err(TrySendError::Full(_)) => {
            return Reply::error("the vCPU loop has not taken the previous command yet")
        }
        Err(TrySendError::Disconnected(_)) => return Reply::error("the run has ended"),
    }
    let mut waited = Duration::ZERO;
    loop {
        if shared.stop.load(Ordering::SeqCst) {
            return Reply::error("the run has ended");
        }
        // SAFETY: the vCPU thread is alive: it joins this thread (through
        // `ControlServer::shutdown`, after setting `stop`) before its run loop returns,
        // and SIGRTMIN's handler (installed by the watchdog) does nothing.
        unsafe { libc::pthread_kill(shared.vcpu_thread, SIGRTMIN()) };
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
mod tests;
