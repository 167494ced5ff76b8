//! Shared helpers of the cross-crate tests: where the committed goldens live, and the goldens
//! more than one test reads.

use std::path::PathBuf;

pub mod allreduce_host;
pub mod dense_checks;
pub mod device_models;
pub mod layer_checks;
pub mod moe_goldens;
pub mod routing;
pub mod stub_driver;

/// Environment variable naming the `golden/data` folder where the source tree is not (the
/// GPU bundle carries the goldens beside its binaries).
pub const GOLDEN_DIR_ENV: &str = "KIMI_GOLDEN_DIR";

/// `golden/data/NAME` in the repository, or `$KIMI_GOLDEN_DIR/NAME`.
pub fn golden_path(name: &str) -> PathBuf {
    match std::env::var_os(GOLDEN_DIR_ENV) {
        Some(dir) => PathBuf::from(dir).join(name),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join("golden")
            .join("data")
            .join(name),
    }
}
