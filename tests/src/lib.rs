//! Shared helpers of the cross-crate tests: where the committed goldens live, and the goldens
//! more than one test reads.

use std::path::PathBuf;

pub mod allreduce_host;
pub mod dense_checks;
pub mod device_models;
pub mod layer_checks;
pub mod moe_goldens;

/// `golden/data/NAME` in the repository.
pub fn golden_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("golden")
        .join("data")
        .join(name)
}
