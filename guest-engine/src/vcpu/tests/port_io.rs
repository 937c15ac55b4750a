//! Tests: port_io.
use super::*;
