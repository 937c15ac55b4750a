//! Tests: tables.
use super::*;
