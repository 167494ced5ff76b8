//! NVFP4 grouped GEMM for the routed MoE experts.
//!
//! - [`reference`]: the CPU reference with the checkpoint's exact W4A4 semantics.
//! - [`cpu`]: the fast CPU grouped GEMM (same semantics; SIMD kernels in [`cpu_simd`]).
//! - [`mma_sm120`]: a register-level CPU model of SM120's block-scaled FP4 `mma.sync`, the
//!   instruction the native kernel is built on, and the fragment layouts its loaders must
//!   produce.
//! - [`tactic`]: the typed tactic space (tiles, stages, variants), shared-memory footprints,
//!   per-SM limits and the problem shapes each tactic can compute.
//! - `moe_gemm.cu` (beside this file): the CUDA source, templated on the tactic parameters.
//! - [`launch`]: the kernels' argument struct, buffer layouts and launches on any
//!   [`Device`](crate::device::Device) (a GPU, or the host execution layer).
//! - [`check`]: the correctness harness every device's runs go through.

pub mod check;
pub mod cpu;
pub mod cpu_int;
pub mod cpu_simd;
pub mod golden_data;
pub mod launch;
pub mod mma_sm120;
pub mod reference;
pub mod tactic;

pub use tactic::{KernelVariant, MoeGemmTactic, ScaleLoad, SmemFootprint};
