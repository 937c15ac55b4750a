//! Tests: flags.
use super::*;
