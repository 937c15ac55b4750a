//! Tests: msr.
use super::*;
