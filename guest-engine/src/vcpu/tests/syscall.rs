//! Tests: syscall.
use super::*;
