//! The control channel's messages: one JSON request per connection, terminated by a
//! newline or the end of the client's stream, and one JSON reply.
//!
//! Requests: `{"cmd":"status"}`, `{"cmd":"attach","tool":"bbcount","options":{"k":"v"}}`,
//! `{"cmd":"detach"}`. Replies: `{"ok":true,...}` or `{"ok":false,"error":"..."}`.
//!
//! Invariant: nothing a client sends panics the VMM or reaches the vCPU loop unchecked.
//! [`parse_request`] accepts exactly one JSON object of at most [`MAX_MESSAGE_BYTES`] with
//! a known `cmd`, only the fields that command takes (each once, each of its type) and,
//! for `attach`, a known tool with known option keys whose keys and values are printable
//! ASCII; anything else (malformed or truncated JSON, invalid UTF-8, NUL and other control
//! bytes, lone surrogates, huge numbers, extra or duplicate fields, trailing bytes) is an
//! error of at most [`MAX_ERROR_BYTES`]. Nesting cannot exhaust the stack: the request's
//! shape is flat (a nested value where a string or a flat object belongs is a type error at
//! its first byte), and serde_json refuses anything nested past 128 levels (its default
//! recursion limit; the workspace does not enable `unbounded_depth`), tested below.

use std::collections::BTreeMap;
use std::fmt;

use serde::de::{self, Deserializer as _, MapAccess, Visitor};
use serde::{Deserialize, Serialize};

/// The longest request or reply, in bytes.
pub const MAX_MESSAGE_BYTES: usize = 64 * 1024;

/// The longest error [`parse_request`] returns, in bytes: an error that quotes the client's
/// input (an unknown tool or field name) is cut, so a reply stays small whatever was sent.
pub const MAX_ERROR_BYTES: usize = 1024;

/// The commands, as `cmd` spells them.
const COMMANDS: &[&str] = &["status", "attach", "detach"];
/// The fields a request may have.
const FIELDS: &[&str] = &["cmd", "tool", "options"];

/// A client's request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "lowercase")]
pub enum Request {
    /// What the run is doing.
    Status,
    /// Enter the engine with `tool` at the next safe point.
    Attach {
        /// Tool name (one of `crate::input_check::TOOLS`).
        tool: String,
        /// Tool options.
        #[serde(default)]
        options: BTreeMap<String, String>,
    },
    /// Leave the engine.
    Detach,
}

/// The reply to a request: `ok`, and either an error or the fields of a success.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Reply {
    /// Whether the request succeeded.
    pub ok: bool,
    /// Why it did not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Whether an instrumentation window is open.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attached: Option<bool>,
    /// The open window's tool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool: Option<String>,
    /// Whether the engine is loaded in the stolen region.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine_resident: Option<bool>,
    /// How the guest runs: `native`, `attached` (a window is open) or `resident` (under
    /// the engine with no instrumentation).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<String>,
    /// Guest instructions executed under the engine so far, all windows and resident
    /// time together (native execution is not counted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_instructions: Option<u64>,
    /// Writes the guest made to the attach-status port (a test guest marks its progress).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_marks: Option<u64>,
    /// Windows opened so far.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub windows: Option<u64>,
    /// The open (or just opened) window's output directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window_dir: Option<String>,
    /// Seconds since the vCPU first ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uptime_s: Option<f64>,
    /// `KVM_RUN` returns so far.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exits: Option<u64>,
    /// Whether the guest is making progress, judged over the last one to two seconds:
    /// `advancing` (guest instructions executed), `idle` (none, and few exits: halted or
    /// waiting), `stalled` (none while exits climb: a livelock or an exit storm), or
    /// `unmeasured` (the guest runs natively, where instructions are not counted, or
    /// no sample exists yet).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<String>,
    /// The numbers behind `progress`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress_reason: Option<String>,
    /// The engine's counters from the last window that wrote them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine_counters: Option<serde_json::Value>,
    /// Milliseconds from the vCPU loop seeing the request to the vCPU being ready to
    /// run in its new mode (for a request the engine serves, including the wait for its
    /// next safe point).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency_ms: Option<f64>,
}

impl Reply {
    /// A failure reply.
    pub fn error(msg: impl Into<String>) -> Self {
        Reply {
            ok: false,
            error: Some(msg.into()),
            ..Default::default()
        }
    }

    /// A bare success.
    pub fn ok() -> Self {
        Reply {
            ok: true,
            ..Default::default()
        }
    }

    /// The reply as one line of JSON (with its newline).
    pub fn to_line(&self) -> String {
        let mut s = serde_json::to_string(self).unwrap_or_else(|e| {
            format!(r#"{{"ok":false,"error":"cannot encode the reply: {e}"}}"#)
        });
        s.push('\n');
        s
    }
}

/// Parses a request, checking its size, its shape and, for `attach`, its tool and
/// options. Every error starts with `malformed request`, `request too long`, or comes from
/// [`check_tool`]; none is longer than [`MAX_ERROR_BYTES`].
pub fn parse_request(bytes: &[u8]) -> Result<Request, String> {
    parse_request_unbounded(bytes).map_err(|e| bound_error(e, MAX_ERROR_BYTES))
}

fn parse_request_unbounded(bytes: &[u8]) -> Result<Request, String> {
    if bytes.len() > MAX_MESSAGE_BYTES {
        return Err(format!(
            "request too long ({} bytes, at most {MAX_MESSAGE_BYTES})",
            bytes.len()
        ));
    }
    let malformed = |e: serde_json::Error| format!("malformed request: {e}");
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let raw = de.deserialize_map(RawVisitor).map_err(malformed)?;
    de.end().map_err(malformed)?;
    let req = match (raw.cmd.as_deref(), raw.tool, raw.options) {
        (None, ..) => return Err("malformed request: no \"cmd\" field".into()),
        (Some("status"), None, None) => Request::Status,
        (Some("detach"), None, None) => Request::Detach,
        (Some(c @ ("status" | "detach")), ..) => {
            return Err(format!(
                "malformed request: {c} takes no \"tool\" or \"options\""
            ))
        }
        (Some("attach"), None, _) => {
            return Err("malformed request: attach needs a \"tool\"".into())
        }
        (Some("attach"), Some(tool), options) => Request::Attach {
            tool,
            options: options.unwrap_or_default(),
        },
        (Some(other), ..) => {
            return Err(format!(
                "malformed request: unknown command {other:?}: the commands are {}",
                COMMANDS.join(", ")
            ))
        }
    };
    if let Request::Attach { tool, options } = &req {
        check_tool(tool, options)?;
    }
    Ok(req)
}

/// `msg` cut to at most `max` bytes (on a character boundary, ending in `...`).
fn bound_error(mut msg: String, max: usize) -> String {
    if msg.len() > max {
        let mut end = max.saturating_sub(3);
        while !msg.is_char_boundary(end) {
            end -= 1;
        }
        msg.truncate(end);
        msg.push_str("...");
    }
    msg
}

/// A request's fields as sent, each at most once.
#[derive(Default)]
struct Raw {
    cmd: Option<String>,
    tool: Option<String>,
    options: Option<BTreeMap<String, String>>,
}

/// Reads the top-level object: only [`FIELDS`], each once and of its type. (Not serde's
/// derive: that would accept an array for a struct, ignore unknown fields and buffer an
/// internally tagged enum's whole input first.)
struct RawVisitor;

impl<'de> Visitor<'de> for RawVisitor {
    type Value = Raw;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object with a \"cmd\" field")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Raw, A::Error> {
        let mut raw = Raw::default();
        while let Some(key) = map.next_key::<String>()? {
            match key.as_str() {
                "cmd" if raw.cmd.is_none() => raw.cmd = Some(map.next_value()?),
                "tool" if raw.tool.is_none() => raw.tool = Some(map.next_value()?),
                "options" if raw.options.is_none() => {
                    raw.options = Some(map.next_value::<Options>()?.0)
                }
                "cmd" | "tool" | "options" => {
                    return Err(de::Error::custom(format!("duplicate field {key:?}")))
                }
                _ => return Err(de::Error::unknown_field(&key, FIELDS)),
            }
        }
        Ok(raw)
    }
}

/// `options`: an object of strings, each key once.
struct Options(BTreeMap<String, String>);

impl<'de> Deserialize<'de> for Options {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_map(OptionsVisitor)
    }
}

struct OptionsVisitor;

impl<'de> Visitor<'de> for OptionsVisitor {
    type Value = Options;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an object of string options")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Options, A::Error> {
        let mut options = BTreeMap::new();
        while let Some(key) = map.next_key::<String>()? {
            let value: String = map.next_value()?;
            if options.contains_key(&key) {
                return Err(de::Error::custom(format!("duplicate option {key:?}")));
            }
            options.insert(key, value);
        }
        Ok(Options(options))
    }
}

/// Parses a reply.
pub fn parse_reply(bytes: &[u8]) -> Result<Reply, String> {
    if bytes.len() > MAX_MESSAGE_BYTES {
        return Err(format!("reply too long ({} bytes)", bytes.len()));
    }
    serde_json::from_slice(bytes).map_err(|e| format!("malformed reply: {e}"))
}

/// Checks a tool name and its options against the host's table of tools and option keys
/// (`crate::input_check`, which `kpin run --tool` uses too); keys and values must be
/// printable ASCII without spaces or `=` (the engine's option string is `k=v k=v`, read
/// byte by byte: no control byte, NUL or multi-byte character reaches it).
pub fn check_tool(tool: &str, options: &BTreeMap<String, String>) -> Result<(), String> {
    let bad = |s: &str| s.contains(|c: char| c == '=' || !c.is_ascii_graphic());
    if let Some((k, v)) = options
        .iter()
        .find(|(k, v)| k.is_empty() || bad(k) || bad(v))
    {
        return Err(format!("bad tool option {k:?}={v:?}"));
    }
    // An option naming a host file (cachesim's config_file) is read by `kpin run` before
    // boot; a window's options reach the engine as they are.
    let spec = kpin_tool_registry::find(tool);
    if let Some(o) = options
        .keys()
        .filter_map(|k| spec.and_then(|t| t.option(k)))
        .find(|o| o.kind == kpin_tool::ValueKind::Path)
    {
        return Err(format!(
            "{} works with kpin run only (give attach the options one by one)",
            o.key
        ));
    }
    let pairs: Vec<String> = options.iter().map(|(k, v)| format!("{k}={v}")).collect();
    crate::input_check::check_tool(tool, &pairs).map_err(|e| e.to_string())
}

/// The engine's option string for `options`: `k=v` separated by spaces.
pub fn options_string(options: &BTreeMap<String, String>) -> String {
    options
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_requests_parse_and_round_trip() {
        assert_eq!(parse_request(br#"{"cmd":"status"}"#), Ok(Request::Status));
        assert_eq!(
            parse_request(b"{\"cmd\":\"detach\"}\n"),
            Ok(Request::Detach)
        );
        let a =
            parse_request(br#"{"cmd":"attach","tool":"bbcount","options":{"bringup.crash":"pf"}}"#)
                .expect("a valid attach");
        let Request::Attach { tool, options } = &a else {
            panic!("not an attach: {a:?}");
        };
        assert_eq!(tool, "bbcount");
        assert_eq!(options_string(options), "bringup.crash=pf");
        let text = serde_json::to_vec(&a).expect("encodes");
        assert_eq!(parse_request(&text), Ok(a));
        assert_eq!(
            parse_request(br#"{"cmd":"attach","tool":"null"}"#),
            Ok(Request::Attach {
                tool: "null".into(),
                options: BTreeMap::new()
            })
        );
    }

    #[test]
    fn test_bad_requests_are_errors() {
        for bad in [
            &b"not json"[..],
            b"",
            b"{}",
            br#"{"cmd":"reboot"}"#,
            br#"{"cmd":"attach"}"#,
            br#"{"cmd":"attach","tool":7}"#,
            b"\xff\xfe",
        ] {
            let e = parse_request(bad).expect_err("must not parse");
            assert!(e.starts_with("malformed request"), "{e}");
        }
        let e = parse_request(br#"{"cmd":"attach","tool":"nosuch"}"#).expect_err("unknown");
        assert!(e.contains("unknown tool \"nosuch\""), "{e}");
        let e = parse_request(br#"{"cmd":"attach","tool":"bbcount","options":{"depth":"3"}}"#)
            .expect_err("unknown option");
        assert!(e.contains("unknown --tool-option key \"depth\""), "{e}");
        // The daemon reads no file a client names.
        let e = parse_request(
            br#"{"cmd":"attach","tool":"cachesim","options":{"config_file":"/etc/passwd"}}"#,
        )
        .expect_err("config_file");
        assert!(e.contains("config_file works with kpin run only"), "{e}");
        let e =
            parse_request(br#"{"cmd":"attach","tool":"null","options":{"bringup.crash":"a b"}}"#)
                .expect_err("space");
        assert!(e.contains("bad tool option"), "{e}");
    }

    /// `bytes` must be refused with an error containing `what`.
    fn refused(bytes: &[u8], what: &str) {
        let e = parse_request(bytes).expect_err(&String::from_utf8_lossy(bytes));
        assert!(e.contains(what), "{e:?} lacks {what:?}");
        assert!(e.len() <= MAX_ERROR_BYTES, "{} bytes", e.len());
    }

    #[test]
    fn test_hostile_shapes_are_errors() {
        // Extra, duplicate and misplaced fields.
        refused(br#"{"cmd":"status","pad":1}"#, "unknown field `pad`");
        refused(
            br#"{"cmd":"status","cmd":"status"}"#,
            "duplicate field \"cmd\"",
        );
        refused(br#"{"cmd":"status","tool":"null"}"#, "status takes no");
        refused(br#"{"cmd":"detach","options":{}}"#, "detach takes no");
        refused(
            br#"{"cmd":"attach","tool":"null","options":{"bringup.ticks":"1","bringup.ticks":"2"}}"#,
            "duplicate option",
        );
        // Other shapes and types.
        refused(br#"["status"]"#, "expected a JSON object");
        refused(br#""status""#, "expected a JSON object");
        refused(br#"{"cmd":["status"]}"#, "invalid type: sequence");
        refused(
            br#"{"cmd":"attach","tool":"null","options":[]}"#,
            "invalid type",
        );
        refused(
            br#"{"cmd":"attach","tool":"null","options":{"a":1}}"#,
            "invalid type",
        );
        refused(br#"{"cmd":"STATUS"}"#, "unknown command \"STATUS\"");
        refused(
            br#"{"cmd":"status"} {"cmd":"detach"}"#,
            "trailing characters",
        );
        refused(br#"{"cmd":"status""#, "EOF while parsing");
        // Numbers: huge, long, or out of range, where a string belongs.
        refused(br#"{"cmd":1e999999}"#, "malformed request");
        let long = format!(r#"{{"cmd":{}}}"#, "9".repeat(60_000));
        refused(long.as_bytes(), "malformed request");
        refused(br#"{"cmd":-0.0e-99999}"#, "invalid type");
        // Bytes: NUL, control characters, invalid UTF-8, lone surrogates, a BOM.
        refused(b"{\"cmd\":\"sta\0tus\"}", "control character");
        refused(b"{\"cmd\":\"status\"}\0", "trailing characters");
        refused(br#"{"cmd":"status\u0000"}"#, "unknown command");
        refused(b"{\"cmd\":\"st\xffatus\"}", "invalid unicode");
        refused(b"{\"cmd\":\"\xc0\x80\"}", "invalid unicode");
        refused(br#"{"cmd":"\ud800"}"#, "malformed request");
        refused(br#"{"cmd":"\udc00status"}"#, "malformed request");
        refused(b"\xef\xbb\xbf{\"cmd\":\"status\"}", "malformed request");
        for (k, v) in [("bringup.ticks", "1\\u0001"), ("bringup.ticks", "\\u00e9")] {
            let req = format!(r#"{{"cmd":"attach","tool":"null","options":{{"{k}":"{v}"}}}}"#);
            refused(req.as_bytes(), "bad tool option");
        }
        // A name quoted back is cut: the reply stays small.
        let tool = "\\u0001".repeat(10_000);
        let req = format!(r#"{{"cmd":"attach","tool":"{tool}"}}"#);
        refused(req.as_bytes(), "unknown tool");
        let key = "k".repeat(50_000);
        refused(format!(r#"{{"{key}":1}}"#).as_bytes(), "unknown field");
    }

    #[test]
    fn test_deep_nesting_is_refused_without_overflowing_the_stack() {
        // On a small stack, to be sure the limit is not just a big enough default stack.
        let t = std::thread::Builder::new()
            .stack_size(256 << 10)
            .spawn(|| {
                for depth in [127, 128, 129, 1000, MAX_MESSAGE_BYTES / 2] {
                    let arrays = format!("{}{}", "[".repeat(depth), "]".repeat(depth));
                    let objects = format!("{}1{}", r#"{"a":"#.repeat(depth), "}".repeat(depth));
                    for nested in [&arrays, &objects] {
                        for req in [
                            nested.clone(),
                            format!(r#"{{"cmd":{nested}}}"#),
                            format!(r#"{{"cmd":"attach","tool":"null","options":{nested}}}"#),
                            format!(r#"{{"cmd":"status","x":{nested}}}"#),
                        ] {
                            let req = &req.as_bytes()[..req.len().min(MAX_MESSAGE_BYTES)];
                            assert!(parse_request(req).is_err());
                        }
                    }
                }
            })
            .expect("spawn");
        t.join().expect("no stack overflow, no panic");
        // serde_json's own limit (for any other caller that parses into a Value).
        let deep = "[".repeat(129);
        let e = serde_json::from_str::<serde_json::Value>(&deep).expect_err("too deep");
        assert!(e.to_string().contains("recursion limit exceeded"), "{e}");
    }

    #[test]
    fn test_oversize_messages_are_refused() {
        let mut big = br#"{"cmd":"status","pad":""#.to_vec();
        big.resize(MAX_MESSAGE_BYTES + 1, b'x');
        let e = parse_request(&big).expect_err("too long");
        assert!(e.contains("too long"), "{e}");
        assert!(parse_reply(&big).is_err());
    }

    #[test]
    fn test_replies_serialize_compactly_and_parse_back() {
        assert_eq!(Reply::ok().to_line(), "{\"ok\":true}\n");
        let e = Reply::error("not attached");
        assert_eq!(e.to_line(), "{\"ok\":false,\"error\":\"not attached\"}\n");
        assert_eq!(parse_reply(e.to_line().as_bytes()), Ok(e));
        let s = Reply {
            attached: Some(true),
            tool: Some("bbcount".into()),
            windows: Some(2),
            ..Reply::ok()
        };
        assert_eq!(parse_reply(s.to_line().as_bytes()), Ok(s));
    }
}
