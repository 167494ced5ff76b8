//! Kernel families for running Kimi-K2.5-NVFP4.
//!
//! Each family lives in its own module with its CPU reference, its fast CPU version, its CUDA
//! source and its tactic type side by side. [`formats`] holds the number formats every family
//! shares: E2M1, E4M3/UE4M3, NVFP4 two-level quantization and the scale-factor swizzle.

pub mod allreduce;
pub mod formats;
