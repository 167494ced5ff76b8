//! Kernel families for running Kimi-K2.5-NVFP4.
//!
//! The modules form layers: each uses its own layer and the ones below, never one above, and
//! no module imports one that imports it back (`scripts/module-cycles.py` checks). So a family
//! can be read, tested and changed knowing only what lies underneath it.
//!
//! 1. Foundations every family shares. [`arch`]: the SM targets, their limits and the reference
//!    GPUs' figures. [`formats`]: E2M1, E4M3/UE4M3, NVFP4 two-level quantization and the
//!    scale-factor swizzle; [`matrix`]: the borrowed weight views. [`isa`] and [`prefetch`]:
//!    the instruction set the CPU kernels run and how far ahead they prefetch, detected once
//!    per process. [`guided`]: the CPU kernels' self-scheduling over a thread pool. [`rng`]:
//!    the seeded generator of every test problem, check and closed-form golden. [`files`]: the
//!    bounded, non-blocking reads of every file the programs are given. [`process`]: whether
//!    a peer process runs, is stopped or is gone.
//! 2. The abstractions the families are written against. [`tactic`]: the tactic trait every
//!    family implements, the problem shapes, the tactic cache the runtime reads and the figures
//!    of timed runs; it names no family. [`cpu_tactic`]: the tunables of the families' CPU
//!    paths as one tactic value. [`device`]: the seam kernel launchers are written against,
//!    vendor products included; the `cuda-host` crate implements it on the CPU.
//! 3. The kernel families, each with its CPU reference, its fast CPU version, its CUDA source
//!    and its tactic type side by side:
//!    - [`dense`]: BF16/NVFP4 dense products for everything else;
//!    - [`moe_gemm`]: the NVFP4 grouped GEMM of the routed experts;
//!    - [`mla`]: MLA decode attention over the paged latent cache;
//!    - [`layers`]: the small kernels of a decode step between those (embedding, norms, RoPE,
//!      routing, expert grouping, decode-shaped BF16 products, sampling);
//!    - [`blas`]: the vendor library's dense BF16 products (cuBLASLt) and the tactic choosing
//!      between them and ours;
//!    - `cuda` (cargo feature `cuda`): the device seam on a GPU through the CUDA driver, with
//!      the vendor products of [`blas`];
//!    - [`allreduce`]: the PCIe-aware all-reduce of tensor parallelism, on processes or GPUs.
//! 4. Above the families: [`timed_device`], the device with a clock through which the tuning
//!    lab and the CUDA sweeps time any family's tactics.

pub mod allreduce;
pub mod arch;
pub mod blas;
pub mod cpu_tactic;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod dense;
pub mod device;
pub mod files;
pub mod formats;
pub mod guided;
pub mod isa;
pub mod layers;
pub mod matrix;
pub mod mla;
pub mod moe_gemm;
pub mod prefetch;
pub mod process;
pub mod rng;
mod scratch;
pub mod tactic;
pub mod timed_device;
