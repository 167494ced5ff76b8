//! `autotune --help` and `autotune step-time --help` print their usage and exit 0, doing
//! nothing else: no tuning, no step-time report written.

#[path = "../../tests/tests/support/help.rs"]
mod help;

#[test]
fn autotune_answers_help_without_side_effects() {
    help::check_help(
        std::path::Path::new(env!("CARGO_BIN_EXE_autotune")),
        "autotune",
        &help::workspace_root(env!("CARGO_MANIFEST_DIR")),
    );
}
