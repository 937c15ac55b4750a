//! The run's counters: what the engine did, written at the end of every run as
//! `counters.json` into the output directory (the VMM prints it and copies it into
//! `run.json`).
//!
//! The JSON is written by hand (a flat object of objects of unsigned integers): the image
//! has no serde, and the VMM parses it with serde_json, so a malformed file shows up there.

use alloc::string::String;
use core::fmt::Write;

/// Builds one JSON object of `u64` fields and nested objects.
pub struct JsonObject {
    out: String,
    /// Whether the innermost open object already has a member (a comma is due).
    has_member: alloc::vec::Vec<bool>,
}

impl JsonObject {
    /// An empty top-level object.
    pub fn new() -> Self {
        Self {
            out: String::from("{"),
            has_member: alloc::vec![false],
        }
    }

    fn key(&mut self, name: &str) {
        let first = !self.has_member.last().copied().unwrap_or(true);
        if let Some(m) = self.has_member.last_mut() {
            *m = true;
        }
        let indent = self.has_member.len();
        let _ = write!(
            self.out,
            "{}\n{:indent$}\"{name}\": ",
            if first { "" } else { "," },
            "",
            indent = 2 * indent
        );
    }

    /// Adds `"name": value`.
    pub fn u64(&mut self, name: &str, value: u64) -> &mut Self {
        self.key(name);
        let _ = write!(self.out, "{value}");
        self
    }

    /// Opens a nested object `"name": {`; close it with [`JsonObject::end`].
    pub fn begin(&mut self, name: &str) -> &mut Self {
        self.key(name);
        self.out.push('{');
        self.has_member.push(false);
        self
    }

    /// Closes the innermost object.
    pub fn end(&mut self) -> &mut Self {
        self.has_member.pop();
        let indent = 2 * self.has_member.len();
        let _ = write!(self.out, "\n{:indent$}}}", "", indent = indent);
        self
    }

    /// The finished text (closes whatever is still open).
    pub fn finish(mut self) -> String {
        while !self.has_member.is_empty() {
            self.end();
        }
        self.out.push('\n');
        self.out
    }
}
