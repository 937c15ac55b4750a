//! `--tool null`: inserts nothing and writes nothing. Its runs measure the engine alone
//! (translation, dispatch, emulation) and check that translation by itself is
//! transparent.
#![no_std]
#![deny(missing_docs)]

use kpin_tool::host::{Error, Sink};
use kpin_tool::{Engine, KpinTool, Tool};

/// The null tool.
#[derive(Debug, Default)]
pub struct Null;

impl Tool for Null {}

impl KpinTool for Null {
    fn name(&self) -> &'static str {
        "null"
    }

    fn finish(&mut self, _engine: &Engine, _host: &mut dyn Sink) -> Result<(), Error> {
        Ok(())
    }
}
