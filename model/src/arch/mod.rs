//! The architecture: DeepSeek-V3 / Kimi-K2.5's configuration and RoPE.

pub mod config;
pub mod rope;
