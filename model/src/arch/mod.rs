//! The architecture: DeepSeek-V3 / Kimi-K2.5's configuration, named sizes, tensor-parallel
//! split and RoPE.

pub mod config;
pub mod presets;
pub mod rope;
pub mod shard;
