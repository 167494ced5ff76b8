//! Every binary of the bench crate answers `--help` with its usage and exit 0, doing nothing
//! else: no benchmark runs, no result file is written.

#[path = "../../tests/tests/support/help.rs"]
mod help;

#[test]
fn every_binary_answers_help_without_side_effects() {
    let repo = help::workspace_root(env!("CARGO_MANIFEST_DIR"));
    for (exe, name) in [
        (env!("CARGO_BIN_EXE_allreduce-chart"), "allreduce-chart"),
        (env!("CARGO_BIN_EXE_charts"), "charts"),
        (env!("CARGO_BIN_EXE_cpu-grouped-gemm"), "cpu-grouped-gemm"),
        (env!("CARGO_BIN_EXE_cpu-tuning"), "cpu-tuning"),
        (env!("CARGO_BIN_EXE_load-rate"), "load-rate"),
        (env!("CARGO_BIN_EXE_model-decode"), "model-decode"),
        (env!("CARGO_BIN_EXE_peer-llamacpp"), "peer-llamacpp"),
        (env!("CARGO_BIN_EXE_serve-load"), "serve-load"),
    ] {
        help::check_help(std::path::Path::new(exe), name, &repo);
    }
}
