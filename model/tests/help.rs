//! `model --help` prints its usage and exits 0, doing nothing else (no default model is
//! generated or unpacked).

#[path = "../../tests/tests/support/help.rs"]
mod help;

#[test]
fn model_answers_help_without_side_effects() {
    help::check_help(
        std::path::Path::new(env!("CARGO_BIN_EXE_model")),
        "model",
        &help::workspace_root(env!("CARGO_MANIFEST_DIR")),
    );
}
