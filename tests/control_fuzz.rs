//! A deterministic fuzzer for the control channel (issue #24), run as plain tests.
//!
//! One seeded generator (xorshift64*) makes the cases: mutations of valid `status`,
//! `detach` and `attach` requests with tools and options (bits flipped, bytes and JSON
//! tokens inserted, ranges deleted or repeated, truncations, a value replaced by a
//! number, a huge number, an array, an object, a long string or deep nesting, fields
//! added or repeated), random bytes, deep and huge JSON, and a corpus of known-hostile
//! shapes (NUL bytes, invalid UTF-8, lone surrogates, a BOM, two objects, an array).
//!
//! - `test_parse_request_fuzz` feeds [`PARSE_CASES`] cases to `parse_request`: each must
//!   give a request that round-trips and names a known tool with printable options, or an
//!   error of at most `MAX_ERROR_BYTES` whose reply line fits in a message; nothing panics.
//! - `test_control_socket_fuzz_on_a_live_minikernel` boots the mini-kernel natively with a
//!   control socket and sends [`SOCKET_CASES`] cases over it from [`FUZZ_THREADS`] client
//!   threads at once, in two phases: with the guest running natively, then with a bbcount
//!   window open. Beside them a thread plays silent, half-closed, partial, trickling and
//!   early-closing clients and a flood past the handler cap, and another asks for `status`
//!   throughout: every status must be answered within 15 s (a refusal to try again, past
//!   the rate or the handler cap, is retried) and show the guest's exits still climbing.
//!   Every case must get a reply: the error `parse_request` gives for the bytes the server
//!   reads, or for a valid request the loop's answer or a documented refusal (rate, busy;
//!   a case refused unread past the handler cap is sent again). Valid attaches are held
//!   back while the guest is native and valid detaches while it is attached (the test
//!   opens and closes the window itself); the rest reach the vCPU loop. Then the guest
//!   must power off with the native transcript, and the window's bbcount must count the
//!   known loop exactly 1000 times.
//!
//! `KPIN_FUZZ_ITERATIONS` overrides the parse case count, `KPIN_FUZZ_SOCKET_CASES` the
//! socket case count, `KPIN_FUZZ_SEED` the seed.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kpin_tests::attach::{
    join_with_transcript, start_minikernel, wait_marks, window_known_loop_runs,
};
use kpin_tests::{require_kvm, scratch_dir};
use vmm::control::client::request;
use vmm::control::protocol::{
    parse_reply, parse_request, Reply, Request, MAX_ERROR_BYTES, MAX_MESSAGE_BYTES,
};
use vmm::control::SOCKET_NAME;
use vmm::guests::MINIKERNEL_NATIVE_CMDLINE;
use vmm::input_check::TOOLS;

/// Cases given to `parse_request` directly (about 3 s in a release build).
const PARSE_CASES: u64 = 120_000;
/// Cases sent over a live run's socket, half with the guest native, half attached
/// (about 10 s here).
const SOCKET_CASES: u64 = 30_000;
/// Client threads sending them at once.
const FUZZ_THREADS: u64 = 4;
const DEFAULT_SEED: u64 = 0x6b70_696e_2d32_3421;
/// How long a retry loop or a wait for a reply may take before the test calls it a hang:
/// generous, for a loaded host; never a measure of speed.
const HANG_GUARD: Duration = Duration::from_secs(300);

/// xorshift64*: small, deterministic, good enough to pick mutations.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed | 1)
    }
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn upto(&mut self, n: usize) -> usize {
        self.below(n as u64 + 1) as usize
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| {
            let v = v.trim();
            match v.strip_prefix("0x") {
                Some(hex) => u64::from_str_radix(hex, 16).ok(),
                None => v.parse().ok(),
            }
        })
        .unwrap_or(default)
}

/// Option keys and values a valid attach may carry (the engine's, then per tool).
const ENGINE_OPTIONS: &[(&str, &[&str])] = &[
    ("bringup.checks", &["0", "1"]),
    ("bringup.ticks", &["1", "100"]),
    ("bringup.crash", &["pf"]),
];
const MEMTRACE_OPTIONS: &[(&str, &[&str])] = &[("cpl", &["0", "3", "all"]), ("limit", &["100"])];
const CACHESIM_OPTIONS: &[(&str, &[&str])] = &[
    ("L1D_size", &["32K", "16K", "3K"]),
    ("L1I_assoc", &["8", "4"]),
    ("line_size", &["64"]),
    ("replace_policy", &["LRU", "FIFO"]),
    ("warmup_refs", &["0", "1000"]),
    ("top", &["5"]),
    ("cachesim.L1D_assoc", &["4"]),
];

/// Values that may replace any other.
const VALUES: &[&str] = &[
    "null",
    "true",
    "0",
    "-1",
    "1.5",
    "1e999",
    "-1e-999",
    "18446744073709551616",
    "-9223372036854775809",
    "[]",
    "{}",
    "[1,[2,[3]]]",
    r#"{"a":{"b":{}}}"#,
    r#""""#,
    r#""\u0000""#,
    r#""\ud800""#,
    r#""\udc00x""#,
    r#""\u00e9""#,
    "\"\u{e9}\"",
    r#""a b""#,
    r#""x=y""#,
    r#""status""#,
    r#""attach""#,
    r#""detach""#,
    r#""bbcount""#,
    r#""null""#,
    r#"{"bringup.ticks":"1"}"#,
];

/// Byte strings inserted anywhere.
const TOKENS: &[&[u8]] = &[
    b"{",
    b"}",
    b"[",
    b"]",
    b"\"",
    b"\\",
    b":",
    b",",
    b"\n",
    b"\r",
    b"\0",
    b"\xff",
    b"\xc0\x80",
    b"\xed\xa0\x80",
    b"\xef\xbb\xbf",
    b"null",
    b"1e999",
    b"\\u0000",
    b"\\ud800",
    b" ",
    b"\t",
    b",\"x\":1",
    b"\"cmd\":\"detach\",",
];

/// Known-hostile whole requests.
const CORPUS: &[&[u8]] = &[
    b"",
    b"\n",
    b"{}",
    b"[]",
    b"null",
    b"\"status\"",
    b"[\"status\"]",
    b"{\"cmd\":\"status\",\"cmd\":\"detach\"}",
    b"{\"cmd\":\"status\"}{\"cmd\":\"status\"}",
    b"{\"cmd\":\"status\"}\0",
    b"\0{\"cmd\":\"status\"}",
    b"\xef\xbb\xbf{\"cmd\":\"status\"}",
    b"{\"cmd\":\"sta\0tus\"}",
    b"{\"cmd\":\"st\xffatus\"}",
    b"{\"cmd\":\"\\ud800\"}",
    b"{\"cmd\":\"status\",\"tool\":\"null\"}",
    b"{\"cmd\":\"detach\",\"options\":{}}",
    b"{\"cmd\":\"attach\"}",
    b"{\"cmd\":\"attach\",\"tool\":null}",
    b"{\"cmd\":\"attach\",\"tool\":\"null\",\"options\":null}",
    b"{\"cmd\":\"attach\",\"tool\":\"null\",\"options\":{\"a\":\"b\",\"a\":\"b\"}}",
    b"{\"cmd\":\"attach\",\"tool\":\"cachesim\",\"options\":{\"config_file\":\"/etc/passwd\"}}",
    b"{\"cmd\":\"attach\",\"tool\":\"null\",\"options\":{\"bringup.ticks\":\"1\\u0000\"}}",
    b"{\"cmd\":\"attach\",\"tool\":\"../../bin/sh\"}",
    b"{\"cmd\":\"STATUS\"}",
    b"{\"CMD\":\"status\"}",
    b"{\"cmd\":\"status\"",
    b"{\"cmd\":\"status\"}\n{\"cmd\":\"attach\",\"tool\":\"null\"}",
];

/// JSON whitespace, sometimes none.
fn ws(rng: &mut Rng) -> &'static str {
    const WS: &[&str] = &["", "", "", " ", "  ", "\t", "\r", " \n "];
    WS[rng.below(WS.len() as u64) as usize]
}

/// A valid request, in varied spelling (field order, whitespace, escapes).
fn valid_request(rng: &mut Rng) -> Vec<u8> {
    let quote = |rng: &mut Rng, s: &str| {
        if rng.chance(10) {
            // The same string with its first character escaped.
            let mut c = s.chars();
            let first = c
                .next()
                .map_or(String::new(), |f| format!("\\u{:04x}", f as u32));
            format!("\"{first}{}\"", c.as_str())
        } else {
            format!("\"{s}\"")
        }
    };
    let mut fields: Vec<String> = Vec::new();
    let cmd = *rng.pick(&["status", "detach", "attach"]);
    fields.push(format!("\"cmd\":{}{}", ws(rng), quote(rng, cmd)));
    if cmd == "attach" {
        let tool = rng.pick(TOOLS).name;
        fields.push(format!("\"tool\":{}", quote(rng, tool)));
        let own: &[(&str, &[&str])] = match tool {
            "memtrace" => MEMTRACE_OPTIONS,
            "cachesim" => CACHESIM_OPTIONS,
            _ => &[],
        };
        if rng.chance(70) {
            let mut opts: Vec<String> = Vec::new();
            let mut used: Vec<&str> = Vec::new();
            for _ in 0..rng.below(4) {
                let (k, vs) = if own.is_empty() || rng.chance(40) {
                    *rng.pick(ENGINE_OPTIONS)
                } else {
                    *rng.pick(own)
                };
                if !used.contains(&k) {
                    used.push(k);
                    let v = rng.pick(vs);
                    opts.push(format!("{}:{}{}", quote(rng, k), ws(rng), quote(rng, v)));
                }
            }
            fields.push(format!("\"options\":{{{}}}", opts.join(",")));
        }
    }
    // Field order: any.
    for i in (1..fields.len()).rev() {
        let j = rng.upto(i);
        fields.swap(i, j);
    }
    let sep = format!(",{}", ws(rng));
    format!("{}{{{}}}{}", ws(rng), fields.join(&sep), ws(rng)).into_bytes()
}

/// Nesting `depth` deep: arrays, objects, or a mix, closed or not.
fn nested(rng: &mut Rng) -> Vec<u8> {
    let depth = match rng.below(10) {
        0..=2 => *rng.pick(&[127usize, 128, 129, 130]),
        3..=6 => rng.upto(300),
        7 | 8 => *rng.pick(&[1000usize, 5000, 20_000]),
        _ => *rng.pick(&[40_000usize, MAX_MESSAGE_BYTES / 2, MAX_MESSAGE_BYTES]),
    };
    let mut out = Vec::new();
    let mut closes = Vec::new();
    for _ in 0..depth {
        match rng.below(3) {
            0 => {
                out.push(b'[');
                closes.push(b']');
            }
            1 => {
                out.extend_from_slice(b"{\"a\":");
                closes.push(b'}');
            }
            _ => {
                let array = rng.chance(50);
                out.extend_from_slice(if array { b"[1," } else { b"{\"k\":" });
                closes.push(if array { b']' } else { b'}' });
            }
        }
        if out.len() > MAX_MESSAGE_BYTES + 16 {
            break;
        }
    }
    out.extend_from_slice(b"0");
    if rng.chance(80) {
        out.extend(closes.iter().rev());
    }
    out
}

/// Huge numbers, strings, keys and option sets, some past the message limit.
fn huge(rng: &mut Rng) -> Vec<u8> {
    let near = |rng: &mut Rng| MAX_MESSAGE_BYTES - 64 + rng.upto(128);
    match rng.below(6) {
        0 => {
            let digits = *rng.pick(&[20usize, 309, 400, 5000, 60_000]);
            format!("{{\"cmd\":{}}}", "9".repeat(digits)).into_bytes()
        }
        1 => format!(
            "{{\"cmd\":\"status\",\"x\":1e{}}}",
            "9".repeat(rng.upto(5000))
        )
        .into_bytes(),
        2 => {
            let n = near(rng);
            format!("{{\"cmd\":\"attach\",\"tool\":\"{}\"}}", "a".repeat(n)).into_bytes()
        }
        3 => {
            let n = near(rng);
            format!("{{\"{}\":1}}", "k".repeat(n)).into_bytes()
        }
        4 => {
            let n = 1 + rng.upto(5000);
            let opts: Vec<String> = (0..n).map(|i| format!("\"k{i}\":\"v\"")).collect();
            format!(
                "{{\"cmd\":\"attach\",\"tool\":\"null\",\"options\":{{{}}}}}",
                opts.join(",")
            )
            .into_bytes()
        }
        _ => {
            let mut r = valid_request(rng);
            let pad = near(rng).saturating_sub(r.len());
            r.splice(0..0, std::iter::repeat_n(b' ', pad));
            r
        }
    }
}

fn random_bytes(rng: &mut Rng) -> Vec<u8> {
    let len = if rng.chance(90) {
        rng.upto(300)
    } else {
        rng.upto(5000)
    };
    let json = rng.chance(50);
    (0..len)
        .map(|_| {
            if json {
                *rng.pick(b"{}[]\":,\\ 0123456789.eE+-abcdnulltrues\n")
            } else {
                rng.next() as u8
            }
        })
        .collect()
}

/// Indices of `b` in `bytes`.
fn positions(bytes: &[u8], b: u8) -> Vec<usize> {
    bytes
        .iter()
        .enumerate()
        .filter(|(_, &c)| c == b)
        .map(|(i, _)| i)
        .collect()
}

/// A value to put in place of another.
fn value(rng: &mut Rng) -> Vec<u8> {
    match rng.below(10) {
        0 => nested(rng),
        1 => {
            let len = if rng.chance(10) {
                rng.upto(70_000)
            } else {
                rng.upto(100)
            };
            format!("\"{}\"", "x".repeat(len)).into_bytes()
        }
        2 => "9".repeat(1 + rng.upto(500)).into_bytes(),
        _ => rng.pick(VALUES).as_bytes().to_vec(),
    }
}

/// One to four mutations of `bytes`.
fn mutate(rng: &mut Rng, mut bytes: Vec<u8>) -> Vec<u8> {
    for _ in 0..1 + rng.below(4) {
        let len = bytes.len();
        let at = rng.upto(len);
        match rng.below(9) {
            0 if len > 0 => bytes[at.min(len - 1)] ^= 1 << rng.below(8),
            1 if len > 0 => bytes[at.min(len - 1)] = *rng.pick(b"\0\xff\"\\{}[]:,\n\x80\xc0 a0"),
            2 => {
                let t = rng.pick(TOKENS);
                bytes.splice(at..at, t.iter().copied());
            }
            3 => {
                let end = (at + 1 + rng.upto(8)).min(len);
                bytes.drain(at..end);
            }
            4 => {
                let end = (at + 1 + rng.upto(16)).min(len);
                let copy = bytes[at..end].to_vec();
                bytes.splice(at..at, copy);
            }
            5 => bytes.truncate(at),
            6 => {
                // A value (after a colon) replaced.
                let colons = positions(&bytes, b':');
                if !colons.is_empty() {
                    let c = *rng.pick(&colons) + 1;
                    let end = bytes[c..]
                        .iter()
                        .position(|&b| b == b',' || b == b'}')
                        .map_or(bytes.len(), |e| c + e);
                    let v = value(rng);
                    bytes.splice(c..end, v);
                }
            }
            7 => {
                // A field added (or one repeated) after an opening brace.
                let braces = positions(&bytes, b'{');
                if !braces.is_empty() {
                    let b = *rng.pick(&braces) + 1;
                    let key = *rng.pick(&["x", "cmd", "tool", "options", "", "\\u0063md"]);
                    let mut f = format!("\"{key}\":").into_bytes();
                    f.extend(value(rng));
                    f.push(b',');
                    bytes.splice(b..b, f);
                }
            }
            _ => {
                let t = rng.pick(TOKENS);
                bytes.extend_from_slice(t);
            }
        }
    }
    bytes
}

/// The next fuzz case.
fn case(rng: &mut Rng) -> Vec<u8> {
    match rng.below(100) {
        0..=44 => {
            let r = valid_request(rng);
            mutate(rng, r)
        }
        45..=54 => valid_request(rng),
        55..=64 => {
            let r = valid_request(rng);
            let cut = rng.upto(r.len());
            r[..cut].to_vec()
        }
        65..=74 => random_bytes(rng),
        75..=82 => {
            let n = nested(rng);
            match rng.below(3) {
                0 => n,
                1 => [&b"{\"cmd\":"[..], &n, b"}"].concat(),
                _ => [
                    &b"{\"cmd\":\"attach\",\"tool\":\"null\",\"options\":"[..],
                    &n,
                    b"}",
                ]
                .concat(),
            }
        }
        83..=85 => huge(rng),
        86..=90 => {
            let r = valid_request(rng);
            let once = mutate(rng, r);
            mutate(rng, once)
        }
        _ => rng.pick(CORPUS).to_vec(),
    }
}

/// What the server parses of `bytes`: the part before the first newline.
fn line_of(bytes: &[u8]) -> &[u8] {
    bytes
        .iter()
        .position(|&b| b == b'\n')
        .map_or(bytes, |n| &bytes[..n])
}

/// `parse_request`'s answer to one case, checked.
fn parse_checked(bytes: &[u8]) -> Result<Request, String> {
    let parsed = parse_request(bytes);
    match &parsed {
        Ok(req) => {
            assert!(bytes.len() <= MAX_MESSAGE_BYTES);
            let again = serde_json::to_vec(req).expect("a request encodes");
            assert_eq!(parse_request(&again).as_ref(), Ok(req), "round trip");
            if let Request::Attach { tool, options } = req {
                assert!(TOOLS.iter().any(|t| t.name == tool), "{tool:?}");
                for (k, v) in options {
                    let printable = |s: &str| s.bytes().all(|b| b.is_ascii_graphic() && b != b'=');
                    assert!(!k.is_empty() && printable(k) && printable(v), "{k:?}={v:?}");
                }
            }
        }
        Err(e) => {
            assert!(
                !e.is_empty() && e.len() <= MAX_ERROR_BYTES,
                "{} bytes",
                e.len()
            );
            assert!(Reply::error(e.clone()).to_line().len() <= MAX_MESSAGE_BYTES);
        }
    }
    parsed
}

#[test]
fn test_parse_request_fuzz() {
    let cases = env_u64("KPIN_FUZZ_ITERATIONS", PARSE_CASES);
    let seed = env_u64("KPIN_FUZZ_SEED", DEFAULT_SEED);
    let mut rng = Rng::new(seed);
    let start = Instant::now();
    let (mut ok, mut bytes) = ([0u64; 3], 0u64);
    let mut errors: std::collections::BTreeMap<String, u64> = Default::default();
    for i in 0..cases {
        let c = case(&mut rng);
        bytes += c.len() as u64;
        let parsed = std::panic::catch_unwind(|| parse_checked(&c)).unwrap_or_else(|_| {
            panic!(
                "case {i} (seed {seed:#x}): {:?}",
                String::from_utf8_lossy(&c[..c.len().min(400)])
            )
        });
        match parsed {
            Ok(Request::Status) => ok[0] += 1,
            Ok(Request::Detach) => ok[1] += 1,
            Ok(Request::Attach { .. }) => ok[2] += 1,
            Err(e) => {
                let kind: String = e.split([':', '(', '"']).next().unwrap_or("").trim().into();
                *errors.entry(kind).or_default() += 1;
            }
        }
    }
    println!(
        "parse fuzz: {cases} cases ({} MiB), seed {seed:#x}, {:.2} s; valid status/detach/attach \
         {ok:?}; errors {errors:?}",
        bytes >> 20,
        start.elapsed().as_secs_f64()
    );
    // The generator reaches both sides: valid requests of each kind, and many errors.
    if cases >= 10_000 {
        assert!(ok.iter().all(|&n| n > cases / 200), "{ok:?}");
        assert!(errors.values().sum::<u64>() > cases / 2, "{errors:?}");
        assert!(errors.contains_key("request too long"), "{errors:?}");
    }
}

/// Refusals a valid request may get instead of the loop's answer.
const TRY_AGAIN: &[&str] = &[
    "rate limited",
    "another control client",
    "too many control clients",
    "busy:",
    "has not taken the previous command",
];

fn try_again(r: &Reply) -> bool {
    !r.ok
        && r.error
            .as_deref()
            .is_some_and(|e| TRY_AGAIN.iter().any(|t| e.contains(t)))
}

/// Sends `bytes` on a fresh connection in one of three ways (with a newline, without one
/// and then the end of stream, in two writes) and returns the reply.
fn exchange(path: &Path, bytes: &[u8], style: u64) -> Reply {
    let mut s = UnixStream::connect(path).expect("connect: the run must keep listening");
    let _ = s.set_read_timeout(Some(Duration::from_secs(60)));
    let _ = s.set_write_timeout(Some(Duration::from_secs(10)));
    // Writes may fail once the server stopped reading (too long, refused): the reply is
    // still there to read.
    let _ = match style % 3 {
        0 => s.write_all(bytes).and_then(|()| s.write_all(b"\n")),
        1 => s.write_all(bytes),
        _ => {
            let half = bytes.len() / 2;
            s.write_all(&bytes[..half]).and_then(|()| {
                std::thread::sleep(Duration::from_millis(1));
                s.write_all(&bytes[half..])
            })
        }
    };
    let _ = s.shutdown(std::net::Shutdown::Write);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    parse_reply(out.trim_ascii()).unwrap_or_else(|e| {
        panic!(
            "no reply ({e}) to {:?}: {:?}",
            String::from_utf8_lossy(&bytes[..bytes.len().min(200)]),
            String::from_utf8_lossy(&out)
        )
    })
}

/// The guest's state during a phase.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Phase {
    Native,
    Attached,
}

/// What the fuzz clients' cases got.
#[derive(Debug, Default)]
struct Tally {
    /// Cases sent (each until it was read).
    sent: AtomicU64,
    /// Valid attaches while native, valid detaches while attached: not sent.
    held_back: AtomicU64,
    /// Cases answered with `parse_request`'s own error.
    parse_errors: AtomicU64,
    /// Valid requests the vCPU loop answered.
    answered: AtomicU64,
    /// Valid requests refused with "try again" (rate, busy).
    refused: AtomicU64,
    /// Sends refused unread past the handler cap (and sent again).
    too_many: AtomicU64,
}

/// Sends `cases` cases from one thread, checking each reply against `parse_request`.
fn fuzz_client(path: &Path, seed: u64, cases: u64, phase: Phase, tally: &Tally) {
    let mut rng = Rng::new(seed);
    let mut done = 0;
    while done < cases {
        let c = case(&mut rng);
        let line = line_of(&c);
        let expected = (line.len() <= MAX_MESSAGE_BYTES).then(|| parse_request(line));
        let dangerous = matches!(
            (&expected, phase),
            (Some(Ok(Request::Attach { .. })), Phase::Native)
                | (Some(Ok(Request::Detach)), Phase::Attached)
        );
        if dangerous {
            tally.held_back.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        done += 1;
        tally.sent.fetch_add(1, Ordering::Relaxed);
        let style = rng.next();
        let shown = || String::from_utf8_lossy(&c[..c.len().min(200)]).into_owned();
        // Past the handler cap (a flood, slow clients) a case is refused unread: send it
        // again until it is read.
        let t = Instant::now();
        let r = loop {
            let r = exchange(path, &c, style);
            if r.error.as_deref() != Some("too many control clients; try again") {
                break r;
            }
            tally.too_many.fetch_add(1, Ordering::Relaxed);
            assert!(t.elapsed() < HANG_GUARD, "{r:?}");
            std::thread::sleep(Duration::from_millis(5));
        };
        match expected {
            None => {
                let e = r.error.as_deref().unwrap_or("");
                assert!(!r.ok && e.contains("too long"), "{r:?} for {}", shown());
                tally.parse_errors.fetch_add(1, Ordering::Relaxed);
            }
            Some(Err(e)) => {
                assert_eq!(r.error.as_deref(), Some(&*e), "{r:?} for {}", shown());
                assert!(!r.ok);
                tally.parse_errors.fetch_add(1, Ordering::Relaxed);
            }
            Some(Ok(req)) => {
                if try_again(&r) {
                    tally.refused.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                let e = r.error.as_deref().unwrap_or("");
                match (&req, phase) {
                    (Request::Status, _) => {
                        assert!(r.ok && r.state.is_some(), "{r:?}");
                        let want = match phase {
                            Phase::Native => "native",
                            Phase::Attached => "attached",
                        };
                        assert_eq!(r.state.as_deref(), Some(want), "{r:?}");
                    }
                    (Request::Detach, Phase::Native) => {
                        assert!(!r.ok && e == "not attached", "{r:?}")
                    }
                    (Request::Attach { .. }, Phase::Attached) => {
                        assert!(!r.ok && e.starts_with("already attached"), "{r:?}")
                    }
                    _ => unreachable!("held back"),
                }
                tally.answered.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// What the nuisance clients saw.
#[derive(Debug, Default)]
struct Nuisance {
    rounds: u64,
    timed_out: u64,
    half_closed: u64,
    early_closed: u64,
    flood_refused: u64,
    slowest_deadline: Duration,
}

/// Waits for the reply of a client that never completes its request: the deadline error,
/// about two seconds after it connected.
fn expect_deadline(s: &mut UnixStream, connected: Instant) -> Duration {
    let mut out = Vec::new();
    let _ = s.set_read_timeout(Some(Duration::from_secs(30)));
    let _ = s.read_to_end(&mut out);
    let took = connected.elapsed();
    let r = parse_reply(out.trim_ascii()).unwrap_or_else(|e| panic!("{e}: {out:?}"));
    let e = r.error.as_deref().unwrap_or("");
    if e.contains("too many control clients") {
        return Duration::ZERO;
    }
    assert!(e.contains("no complete request within"), "{r:?}");
    // Not before the deadline; "after" is bounded only as a guard against a hang.
    assert!(
        took >= Duration::from_millis(1900) && took < HANG_GUARD,
        "deadline error after {took:?}"
    );
    took
}

/// Plays hostile clients until `stop`: silent, partial, trickling, half-closed and
/// early-closing ones in rounds of a few at once, and one flood past the handler cap.
fn nuisance(path: &Path, stop: &AtomicBool) -> Nuisance {
    let mut seen = Nuisance::default();
    let mut flooded = false;
    while !stop.load(Ordering::SeqCst) {
        seen.rounds += 1;
        let slow: Vec<JoinHandle<Duration>> = (0..3)
            .map(|kind| {
                let path = path.to_owned();
                std::thread::spawn(move || {
                    let mut s = UnixStream::connect(&path).expect("connect");
                    let t = Instant::now();
                    match kind {
                        0 => {}
                        // (A connection the server refused for the handler cap may be
                        // closed already: the write fails, the refusal is still read.)
                        1 => {
                            let _ = s.write_all(b"{\"cmd\":\"stat");
                        }
                        _ => {
                            // A byte every 300 ms: longer than the deadline in all.
                            let mut w = s.try_clone().expect("clone");
                            std::thread::spawn(move || {
                                for &b in b"{\"cmd\":\"status\"}    " {
                                    if w.write_all(&[b]).is_err() {
                                        break;
                                    }
                                    std::thread::sleep(Duration::from_millis(300));
                                }
                            });
                        }
                    }
                    expect_deadline(&mut s, t)
                })
            })
            .collect();
        let mut half = UnixStream::connect(path).expect("connect");
        half.shutdown(std::net::Shutdown::Write)
            .expect("half-close");
        let mut out = Vec::new();
        let _ = half.read_to_end(&mut out);
        let r = parse_reply(out.trim_ascii()).expect("a reply to a half-closed client");
        let e = r.error.as_deref().unwrap_or("");
        assert!(
            e.contains("malformed request: EOF") || e.contains("too many"),
            "{r:?}"
        );
        seen.half_closed += 1;
        // Connects, sends, and leaves without reading its reply.
        let mut early = UnixStream::connect(path).expect("connect");
        let _ = early.write_all(b"{\"cmd\":\"status\"}\n");
        drop(early);
        seen.early_closed += 1;
        if !flooded {
            flooded = true;
            let flood: Vec<UnixStream> = (0..24)
                .map(|_| UnixStream::connect(path).expect("connect"))
                .collect();
            for mut s in flood {
                let _ = s.set_read_timeout(Some(Duration::from_secs(30)));
                let mut out = Vec::new();
                let _ = s.read_to_end(&mut out);
                let r = parse_reply(out.trim_ascii()).expect("a reply to each of a flood");
                let e = r.error.as_deref().unwrap_or("");
                if e.contains("too many control clients") {
                    seen.flood_refused += 1;
                } else {
                    assert!(e.contains("no complete request"), "{r:?}");
                }
            }
            assert!(seen.flood_refused >= 8, "{seen:?}");
        }
        for h in slow {
            let took = h.join().expect("slow client");
            if !took.is_zero() {
                seen.timed_out += 1;
                seen.slowest_deadline = seen.slowest_deadline.max(took);
            }
        }
    }
    seen
}

/// What the well-behaved status client saw.
#[derive(Debug, Default)]
struct Watch {
    answered: u64,
    retries: u64,
    slowest: Duration,
    first_exits: u64,
    last_exits: u64,
}

/// Asks for `status` every 50 ms until `stop`, retrying refusals; each must be answered
/// (retries are bounded only as a guard against a hang).
fn watch(dir: &Path, phase: Phase, stop: &AtomicBool) -> Watch {
    let mut w = Watch::default();
    while !stop.load(Ordering::SeqCst) {
        let t = Instant::now();
        let r = loop {
            let r = request(dir, &Request::Status).expect("status: the run must answer");
            if !try_again(&r) {
                break r;
            }
            w.retries += 1;
            assert!(t.elapsed() < HANG_GUARD, "status refused: {r:?}");
            std::thread::sleep(Duration::from_millis(5));
        };
        let took = t.elapsed();
        assert!(r.ok, "{r:?}");
        let want = match phase {
            Phase::Native => "native",
            Phase::Attached => "attached",
        };
        assert_eq!(r.state.as_deref(), Some(want), "{r:?}");
        let exits = r.exits.expect("exits");
        if w.answered == 0 {
            w.first_exits = exits;
        }
        assert!(exits >= w.last_exits, "{r:?}");
        w.last_exits = exits;
        w.answered += 1;
        w.slowest = w.slowest.max(took);
        std::thread::sleep(Duration::from_millis(50));
    }
    w
}

/// One phase: the fuzz clients, the nuisance clients and the watcher at once.
fn phase(dir: &Path, phase: Phase, seed: u64, cases: u64) {
    let path: PathBuf = dir.join(SOCKET_NAME);
    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Tally::default());
    let t = Instant::now();
    let watcher = {
        let (dir, stop) = (dir.to_owned(), stop.clone());
        std::thread::spawn(move || watch(&dir, phase, &stop))
    };
    let nuisance = {
        let (path, stop) = (path.clone(), stop.clone());
        std::thread::spawn(move || nuisance(&path, &stop))
    };
    let per_thread = cases.div_ceil(FUZZ_THREADS);
    let clients: Vec<JoinHandle<()>> = (0..FUZZ_THREADS)
        .map(|i| {
            let (path, tally) = (path.clone(), tally.clone());
            let seed = seed ^ (i + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            std::thread::spawn(move || fuzz_client(&path, seed, per_thread, phase, &tally))
        })
        .collect();
    let mut failed = Vec::new();
    for c in clients {
        if let Err(e) = c.join() {
            failed.push(e);
        }
    }
    stop.store(true, Ordering::SeqCst);
    let nuisance = nuisance.join();
    let watch = watcher.join();
    if let Some(e) = failed.pop() {
        std::panic::resume_unwind(e);
    }
    let (nuisance, watch) = (
        nuisance.unwrap_or_else(|e| std::panic::resume_unwind(e)),
        watch.unwrap_or_else(|e| std::panic::resume_unwind(e)),
    );
    println!(
        "{phase:?} phase: {:.1} s; cases {tally:?}; nuisance {nuisance:?}; status {watch:?}",
        t.elapsed().as_secs_f64()
    );
    assert!(watch.answered >= 3, "{watch:?}");
    assert!(
        watch.last_exits > watch.first_exits,
        "the guest kept running: {watch:?}"
    );
    assert!(
        nuisance.timed_out >= 1 && nuisance.half_closed >= 1,
        "{nuisance:?}"
    );
    let answered = tally.answered.load(Ordering::Relaxed);
    assert!(answered > 0, "valid requests reached the loop: {tally:?}");
}

/// `req` until it is not refused with "try again".
fn insist(dir: &Path, req: &Request) -> Reply {
    let t = Instant::now();
    loop {
        let r = request(dir, req).expect("a reply");
        if !try_again(&r) {
            return r;
        }
        assert!(t.elapsed() < HANG_GUARD, "{req:?}: {r:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn test_control_socket_fuzz_on_a_live_minikernel() {
    require_kvm!();
    let cases = env_u64("KPIN_FUZZ_SOCKET_CASES", SOCKET_CASES);
    let seed = env_u64("KPIN_FUZZ_SEED", DEFAULT_SEED);
    let dir = scratch_dir("control-fuzz");
    // One window (the known loop, a mark, then a wait for its end), then a wait for the
    // next window, which runs the rest of the steps under the engine.
    let cmdline = format!("{MINIKERNEL_NATIVE_CMDLINE} kpin.attach_cycles=1 kpin.wait_attach=1");
    let (vm_thread, console) = start_minikernel(&dir, &cmdline, None);
    let started = Instant::now();
    phase(&dir, Phase::Native, seed, cases / 2);
    let bbcount = Request::Attach {
        tool: "bbcount".into(),
        options: Default::default(),
    };
    let a = insist(&dir, &bbcount);
    assert!(a.ok, "{a:?}");
    wait_marks(&dir, 1);
    phase(
        &dir,
        Phase::Attached,
        seed.rotate_left(17),
        cases - cases / 2,
    );
    let d = insist(&dir, &Request::Detach);
    assert!(d.ok, "{d:?}");
    let a = insist(
        &dir,
        &Request::Attach {
            tool: "null".into(),
            options: Default::default(),
        },
    );
    assert!(a.ok, "{a:?}");
    let skipped = join_with_transcript(vm_thread, &console, "");
    println!(
        "socket fuzz: {cases} cases, seed {seed:#x}, {:.1} s from the socket to the guest's end",
        started.elapsed().as_secs_f64()
    );
    assert!(
        skipped > 0,
        "the native command line skips native-unsafe steps"
    );
    assert!(!dir.join(SOCKET_NAME).exists(), "the socket is removed");
    assert_eq!(window_known_loop_runs(&dir.join("attach-1")), 1000);
}
