//! Tests: events.
use super::*;
