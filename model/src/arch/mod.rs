//! The architecture: DeepSeek-V3 / Kimi-K2.5's configuration, the checkpoint's tensor names,
//! named sizes, the tensor-parallel split and RoPE.

pub mod config;
pub mod names;
pub mod presets;
pub mod rope;
pub mod shard;
