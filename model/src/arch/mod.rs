//! The architecture: DeepSeek-V3 / Kimi-K2.5's configuration and ModelOpt's quantization
//! description of it, the checkpoint's tensor names, named sizes, the tensor-parallel split
//! and RoPE.

pub mod config;
pub mod names;
pub mod presets;
pub mod quant_config;
pub mod rope;
pub mod shard;
