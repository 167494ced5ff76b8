//! Kernel families for running Kimi-K2.5-NVFP4.
//!
//! Each family lives in its own module with its CPU reference, its fast CPU version, its CUDA
//! source and its tactic type side by side:
//! - [`moe_gemm`]: the NVFP4 grouped GEMM of the routed experts;
//! - [`mla`]: MLA decode attention over the paged latent cache;
//! - [`dense`]: BF16/NVFP4 dense products for everything else;
//! - [`cpu_tactic`]: the tunables of the CPU paths of those families as one tactic value;
//! - [`allreduce`]: the PCIe-aware all-reduce of tensor parallelism;
//! - [`layers`]: the small kernels of a decode step between those (embedding, norms, RoPE,
//!   routing, expert grouping, decode-shaped BF16 products, greedy sampling);
//! - [`blas`]: the vendor library's dense BF16 products (cuBLASLt) and the tactic choosing
//!   between them and ours;
//! - [`device`]: the seam kernel launchers are written against; `cuda` (cargo feature `cuda`)
//!   implements it on a GPU through the CUDA driver, the `cuda-host` crate on the CPU.
//!
//! [`arch`] holds the SM targets, their limits and the reference GPUs' figures; [`tactic`]
//! the tactic abstraction every family implements, the problem shapes and the tactic cache the
//! runtime reads, naming no family; [`timed_device`], above the families, the device with a
//! clock through which the tuning lab and the CUDA sweeps time any family's tactics.
//!
//! [`formats`] holds the number formats every family shares: E2M1, E4M3/UE4M3, NVFP4
//! two-level quantization and the scale-factor swizzle; [`matrix`] the borrowed weight views.
//! [`isa`] and [`prefetch`] say what every family's CPU kernels run: the instruction set and
//! how far ahead they prefetch, detected once per process; [`rng`] is the seeded generator of
//! every test problem, check and closed-form golden.

pub mod allreduce;
pub mod arch;
pub mod blas;
pub mod cpu_tactic;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod dense;
pub mod device;
pub mod formats;
pub mod guided;
pub mod isa;
pub mod layers;
pub mod matrix;
pub mod mla;
pub mod moe_gemm;
pub mod prefetch;
pub mod rng;
mod scratch;
pub mod tactic;
pub mod timed_device;
