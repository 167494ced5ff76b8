//! The hostile-client suite: each case a probe that once broke the release binaries (a client
//! that stalls or walks away, text that poses as control tokens, a file that never ends, a
//! size that does not fit), kept so none comes back. Every case ends in an answer, an
//! `Error:` line with exit code 2, or a clean failure: 0 panics, 0 aborts, 0 hangs.

#[path = "../common/mod.rs"]
mod common;

mod cli;
mod files;
mod server;
mod template;

pub use common::cli::{golden_model, model, path_str, refused, run_bounded, wait_until};
