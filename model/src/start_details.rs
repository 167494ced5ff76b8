//! Whether the engine's start-up details are printed: a switch the command line sets and the
//! loaders, backends and server read, kept here at the bottom so they need not import the CLI.

use std::sync::atomic::{AtomicBool, Ordering};

/// Whether the engine's start-up details (weights placement, CPU tactic, cache sizes, device
/// tactics) are printed on stderr: on for every command but `chat`, whose start is one line
/// unless `--verbose` or `RUST_LOG` asks for them.
static START_DETAILS: AtomicBool = AtomicBool::new(true);

pub fn start_details_shown() -> bool {
    START_DETAILS.load(Ordering::Relaxed)
}

pub fn show_start_details(shown: bool) {
    START_DETAILS.store(shown, Ordering::Relaxed);
}
