//! Tests: misc.
use super::*;
