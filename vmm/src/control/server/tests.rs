//! The control server against a played vCPU loop: round trips, refusals, and hostile
//! clients (silent, trickling, half-closed, a flood, past the rate).

use std::io::Write;

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
    // A request the server stopped reading may end in a reset after the reply.
    let _ = s.read_to_end(&mut out);
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
fn test_an_attach_or_detach_while_another_is_in_the_loop_is_refused_but_status_is_served() {
    let dir = scratch("second");
    let path = dir.join(SOCKET_NAME);
    let (server, rx) = ControlServer::start(&path).expect("listen");
    // The first client's detach reaches the loop, which does not answer yet (as while an
    // attach or detach waits for the engine's safe point).
    let mut first = UnixStream::connect(&path).expect("first client");
    first.write_all(b"{\"cmd\":\"detach\"}\n").expect("send");
    let cmd = rx.recv_timeout(Duration::from_secs(20)).expect("a command");
    assert_eq!(cmd.request, Request::Detach);
    // Answered while the first is still waiting: refused without waiting for it.
    let second = request(&dir, &Request::Detach).expect("a reply");
    assert!(!second.ok, "{second:?}");
    assert!(
        second
            .error
            .as_deref()
            .unwrap_or("")
            .contains("another control client"),
        "{second:?}"
    );
    // A status is not held off by the waiting detach.
    let d = dir.clone();
    let status = std::thread::spawn(move || request(&d, &Request::Status).expect("a reply"));
    let st = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("the status");
    assert_eq!(st.request, Request::Status);
    let _ = st.reply.send(Reply::ok());
    assert!(status.join().expect("status client").ok);
    let _ = cmd.reply.send(Reply::ok());
    let mut out = Vec::new();
    first.read_to_end(&mut out).expect("reply");
    assert!(parse_reply(out.trim_ascii()).expect("JSON").ok);
    server.shutdown();
}

/// What a connection reads until the server closes it, and when.
fn reply_of(mut s: UnixStream) -> (Reply, Instant) {
    let mut out = Vec::new();
    let _ = s.set_read_timeout(Some(Duration::from_secs(20)));
    // A refused connection may end in a reset rather than an end of stream.
    let _ = s.read_to_end(&mut out);
    let r = parse_reply(out.trim_ascii()).unwrap_or_else(|e| panic!("{e}: {out:?}"));
    (r, Instant::now())
}

fn error_of(r: &Reply) -> &str {
    assert!(!r.ok, "{r:?}");
    r.error.as_deref().unwrap_or("")
}

const QUICK: Limits = Limits {
    request_deadline: Duration::from_millis(600),
    max_clients: 4,
    rate_per_second: 2.0,
    rate_burst: 3.0,
};

/// Answers every command with ok until `stop`; returns how many it answered.
fn answer_all(rx: Receiver<Command>, stop: Arc<AtomicBool>) -> JoinHandle<usize> {
    std::thread::spawn(move || {
        let mut n = 0;
        while !stop.load(Ordering::SeqCst) {
            if let Ok(cmd) = rx.recv_timeout(Duration::from_millis(10)) {
                n += 1;
                let _ = cmd.reply.send(Reply::ok());
            }
        }
        n
    })
}

#[test]
fn test_silent_trickling_and_half_closed_clients_hold_off_no_one() {
    let dir = scratch("slow");
    let path = dir.join(SOCKET_NAME);
    // A deadline long enough that the well-behaved client's reply comes first however
    // loaded the host is.
    let limits = Limits {
        max_clients: 8,
        request_deadline: Duration::from_secs(3),
        ..QUICK
    };
    let (server, rx) = ControlServer::start_with(&path, limits).expect("listen");
    let done = Arc::new(AtomicBool::new(false));
    let loop_thread = answer_all(rx, done.clone());
    let silent = UnixStream::connect(&path).expect("silent");
    let mut partial = UnixStream::connect(&path).expect("partial");
    partial.write_all(b"{\"cmd\":\"sta").expect("send");
    // One byte every 100 ms: a deadline per read would never expire.
    let trickle = UnixStream::connect(&path).expect("trickle");
    let mut w = trickle.try_clone().expect("clone");
    let writer = std::thread::spawn(move || {
        for &b in b"{\"cmd\":\"status\"}                               \n" {
            if w.write_all(&[b]).is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    let half = UnixStream::connect(&path).expect("half-closed");
    half.shutdown(std::net::Shutdown::Write).expect("shutdown");
    // Meanwhile a well-behaved client is served, before any slow one's deadline.
    let ok = request(&dir, &Request::Status).expect("status");
    let ok_at = Instant::now();
    assert!(ok.ok, "{ok:?}");
    let (r, _) = reply_of(half);
    assert!(error_of(&r).contains("malformed request: EOF"), "{r:?}");
    for s in [silent, partial, trickle] {
        let (r, at) = reply_of(s);
        assert!(
            error_of(&r).contains("no complete request within 3000 ms"),
            "{r:?}"
        );
        // The deadline is the connection's total, not a reading's: the trickler's request
        // would be whole after ~5 s, yet it gets the deadline's error.
        assert!(at > ok_at, "a slow client was answered first");
    }
    let _ = writer.join();
    done.store(true, Ordering::SeqCst);
    assert_eq!(
        loop_thread.join().expect("loop"),
        1,
        "only the status reached the loop"
    );
    server.shutdown();
}

#[test]
fn test_a_flood_of_clients_is_capped_and_the_next_client_is_served() {
    let dir = scratch("flood");
    let path = dir.join(SOCKET_NAME);
    // Admitted clients time out after 3 s: long after the accepting thread refused the
    // rest, however loaded the host.
    let limits = Limits {
        request_deadline: Duration::from_secs(3),
        ..QUICK
    };
    let (server, rx) = ControlServer::start_with(&path, limits).expect("listen");
    let done = Arc::new(AtomicBool::new(false));
    let loop_thread = answer_all(rx, done.clone());
    let flood: Vec<UnixStream> = (0..12)
        .map(|_| UnixStream::connect(&path).expect("connect"))
        .collect();
    let t0 = Instant::now();
    let readers: Vec<_> = flood
        .into_iter()
        .map(|s| std::thread::spawn(move || reply_of(s)))
        .collect();
    let (mut refused, mut timed_out) = (Vec::new(), Vec::new());
    for reader in readers {
        let (r, at) = reader.join().expect("reader");
        let e = error_of(&r);
        if e.contains("too many control clients") {
            refused.push(at);
        } else {
            assert!(e.contains("no complete request"), "{r:?}");
            timed_out.push(at);
        }
    }
    // Refused at once: before any admitted client's deadline.
    assert!(
        refused.iter().max() < timed_out.iter().min(),
        "refused {refused:?}, timed out {timed_out:?} (from {t0:?})"
    );
    let (refused, timed_out) = (refused.len(), timed_out.len());
    assert_eq!(
        (timed_out, refused),
        (QUICK.max_clients, 12 - QUICK.max_clients)
    );
    // The places are given back.
    let t = Instant::now();
    loop {
        let r = request(&dir, &Request::Status).expect("status");
        if r.ok {
            break;
        }
        assert!(error_of(&r).contains("too many"), "{r:?}");
        assert!(t.elapsed() < Duration::from_secs(60), "{r:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
    done.store(true, Ordering::SeqCst);
    let _ = loop_thread.join();
    server.shutdown();
}

#[test]
fn test_commands_past_the_rate_are_refused_not_queued() {
    let dir = scratch("rate");
    let path = dir.join(SOCKET_NAME);
    // A refill too slow to matter while the test runs, however slow the host: the burst
    // is all there is (the refill itself is `TokenBucket`'s test, with its own clock).
    let limits = Limits {
        rate_per_second: 0.001,
        ..QUICK
    };
    let (server, rx) = ControlServer::start_with(&path, limits).expect("listen");
    let done = Arc::new(AtomicBool::new(false));
    let loop_thread = answer_all(rx, done.clone());
    // Malformed requests take no token.
    for _ in 0..5 {
        let r = raw(&dir, b"{\"cmd\":\"nope\"}\n");
        assert!(error_of(&r).contains("unknown command"), "{r:?}");
    }
    let replies: Vec<Reply> = (0..6)
        .map(|_| request(&dir, &Request::Status).expect("a reply"))
        .collect();
    let ok = replies.iter().filter(|r| r.ok).count();
    assert_eq!(ok, 3, "the burst of 3: {replies:?}");
    for r in replies.iter().filter(|r| !r.ok) {
        assert!(error_of(r).starts_with("rate limited"), "{r:?}");
    }
    done.store(true, Ordering::SeqCst);
    assert_eq!(loop_thread.join().expect("loop"), ok);
    server.shutdown();
}

#[test]
fn test_token_bucket_refills_at_its_rate_up_to_its_burst() {
    let t0 = Instant::now();
    let mut b = TokenBucket::new(10.0, 2.0, t0);
    assert!(b.take(t0) && b.take(t0) && !b.take(t0));
    assert!(!b.take(t0 + Duration::from_millis(50)));
    assert!(b.take(t0 + Duration::from_millis(100)));
    // An hour idle refills the burst, no more; time going backwards adds nothing.
    let later = t0 + Duration::from_secs(3600);
    assert!(b.take(later) && b.take(later) && !b.take(later));
    assert!(!b.take(t0));
}

#[test]
fn test_only_the_owner_and_root_may_connect() {
    assert!(peer_allowed(1000, 1000));
    assert!(peer_allowed(0, 1000));
    assert!(peer_allowed(0, 0));
    assert!(!peer_allowed(1001, 1000));
    assert!(!peer_allowed(65534, 1000));
    assert!(!peer_allowed(1000, 0), "a root run refuses other users");
    let (a, _b) = UnixStream::pair().expect("pair");
    // SAFETY: geteuid has no preconditions.
    assert_eq!(peer_uid(&a).expect("SO_PEERCRED"), unsafe {
        libc::geteuid()
    });
}

#[test]
fn test_a_refusal_reaches_a_client_that_already_sent_its_request() {
    let (mut client, server_end) = UnixStream::pair().expect("pair");
    client.write_all(&[b'x'; 10_000]).expect("send");
    refuse(
        server_end,
        "permission denied: uid 7 is not the run's owner",
    );
    let (r, _) = reply_of(client);
    assert_eq!(
        error_of(&r),
        "permission denied: uid 7 is not the run's owner"
    );
}

#[test]
fn test_shutdown_does_not_wait_for_a_silent_client() {
    let dir = scratch("shutdown");
    let path = dir.join(SOCKET_NAME);
    let (server, _rx) = ControlServer::start(&path).expect("listen");
    let silent = UnixStream::connect(&path).expect("connect");
    std::thread::sleep(Duration::from_millis(100));
    server.shutdown();
    // Ended by the shutdown, not by its deadline (which would say so).
    let (r, _) = reply_of(silent);
    assert_eq!(error_of(&r), "the run has ended");
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
