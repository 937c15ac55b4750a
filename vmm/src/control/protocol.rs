//! The control channel's messages: one JSON request per connection, terminated by a
//! newline or the end of the client's stream, and one JSON reply.
//!
//! Requests: `{"cmd":"status"}`, `{"cmd":"attach","tool":"bbcount","options":{"k":"v"}}`,
//! `{"cmd":"detach"}`. Replies: `{"ok":true,...}` or `{"ok":false,"error":"..."}`.
//!
//! Invariant: nothing a client sends panics the VMM: a message longer than
//! [`MAX_MESSAGE_BYTES`] or that does not parse gets an error reply.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The longest request or reply, in bytes.
pub const MAX_MESSAGE_BYTES: usize = 64 * 1024;

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

/// Parses a request, checking its size and, for `attach`, its tool and options.
pub fn parse_request(bytes: &[u8]) -> Result<Request, String> {
    if bytes.len() > MAX_MESSAGE_BYTES {
        return Err(format!(
            "request too long ({} bytes, at most {MAX_MESSAGE_BYTES})",
            bytes.len()
        ));
    }
    let req: Request =
        serde_json::from_slice(bytes).map_err(|e| format!("malformed request: {e}"))?;
    if let Request::Attach { tool, options } = &req {
        check_tool(tool, options)?;
    }
    Ok(req)
}

/// Parses a reply.
pub fn parse_reply(bytes: &[u8]) -> Result<Reply, String> {
    if bytes.len() > MAX_MESSAGE_BYTES {
        return Err(format!("reply too long ({} bytes)", bytes.len()));
    }
    serde_json::from_slice(bytes).map_err(|e| format!("malformed reply: {e}"))
}

/// Checks a tool name and its options against the host's table of tools and option keys
/// (`crate::input_check`, which `kpin run --tool` uses too); keys and values must not
/// contain whitespace or `=` (the engine's option string is `k=v k=v`).
pub fn check_tool(tool: &str, options: &BTreeMap<String, String>) -> Result<(), String> {
    let bad = |s: &str| s.contains(|c: char| c == '=' || c.is_whitespace());
    if let Some((k, v)) = options
        .iter()
        .find(|(k, v)| k.is_empty() || bad(k) || bad(v))
    {
        return Err(format!("bad tool option {k:?}={v:?}"));
    }
    if options
        .keys()
        .any(|k| k == "config_file" || k == "cachesim.config_file")
    {
        return Err(
            "config_file works with kpin run only (give attach the options one by one)".into(),
        );
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
