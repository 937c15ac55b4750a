//! `--tool null`: inserts nothing and writes nothing. Its runs measure the engine alone
//! (translation, dispatch, emulation) and check that translation by itself is
//! transparent.
#![no_std]
#![deny(missing_docs)]

extern crate alloc;

use alloc::boxed::Box;
use alloc::string::String;

use kpin_tool::host::{Error, Sink};
use kpin_tool::{Engine, KpinTool, Tool, ToolSpec};

/// What `--tool null` is (the registry's entry).
pub const SPEC: ToolSpec = ToolSpec {
    name: "null",
    summary: "translation only: no instrumentation, no files (measures the engine alone)",
    options: &[],
    prefixed_keys: false,
    host: None,
};

/// The tool for `--tool-option` words (it has no options of its own): the registry's
/// constructor.
pub fn new_tool(_options: &str) -> Result<Box<dyn KpinTool>, String> {
    Ok(Box::new(Null))
}

/// The null tool.
#[derive(Debug, Default)]
pub struct Null;

impl Tool for Null {}

impl KpinTool for Null {
    fn name(&self) -> &'static str {
        SPEC.name
    }

    fn finish(&mut self, _engine: &Engine, _host: &mut dyn Sink) -> Result<(), Error> {
        Ok(())
    }
}
