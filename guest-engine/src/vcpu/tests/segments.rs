//! Tests: segments.
use super::*;
