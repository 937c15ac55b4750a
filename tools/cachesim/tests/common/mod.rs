//! Shared by the tests (and the `feed_cost` example).

pub mod program;
