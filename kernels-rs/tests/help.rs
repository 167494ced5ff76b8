//! Every binary of the kernels crate answers `--help` with its usage and exit 0, doing nothing
//! else (the GPU binaries with feature `cuda`, which builds them).

#[path = "../../tests/tests/support/help.rs"]
mod help;

fn check(exe: &str, name: &str) {
    help::check_help(
        std::path::Path::new(exe),
        name,
        &help::workspace_root(env!("CARGO_MANIFEST_DIR")),
    );
}

#[test]
fn every_binary_answers_help_without_side_effects() {
    check(
        env!("CARGO_BIN_EXE_allreduce-cpu-bench"),
        "allreduce-cpu-bench",
    );
    check(env!("CARGO_BIN_EXE_allreduce-rank"), "allreduce-rank");
    check(env!("CARGO_BIN_EXE_allreduce-sim"), "allreduce-sim");
    check(env!("CARGO_BIN_EXE_ptx-gate"), "ptx-gate");
}

#[cfg(feature = "cuda")]
#[test]
fn every_gpu_binary_answers_help_without_side_effects() {
    check(env!("CARGO_BIN_EXE_gpu-check"), "gpu-check");
    check(env!("CARGO_BIN_EXE_mla-gpu-check"), "mla-gpu-check");
    check(
        env!("CARGO_BIN_EXE_allreduce-gpu-check"),
        "allreduce-gpu-check",
    );
    check(env!("CARGO_BIN_EXE_gpu-preflight"), "gpu-preflight");
}
