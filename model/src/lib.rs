//! The model layer: checkpoint → model → runner (device) → kernels.
//!
//! - [`arch`]: the DeepSeek-V3 / Kimi-K2.5 architecture: its config, the checkpoint's tensor
//!   names, RoPE.
//! - [`checkpoint`]: what NVIDIA ships, read as it is (memory-mapped shards, host weights), and
//!   what the project writes.
//! - [`quantize`]: NVFP4 checkpoints made from BF16 ones or generated at random, calibrated on
//!   a forward pass.
//! - [`exec`]: execution: the model's step written once, the runner seam every backend serves
//!   (`cpu`, `cuda`, `cuda-emulated`), sampling, tensor parallelism, tactic selection.
//! - [`serve`]: continuous batching and the OpenAI-compatible server.
//! - [`text`]: text in and out (Kimi's tiktoken BPE, the chat template, reasoning and
//!   tool-call parsing on token ids).
//! - [`cli`]: the `model` command's subcommands.
//! - [`input`], [`cleanup`]: checks on what enters, and the temporary files and shared-memory
//!   names an interrupted process must not leave behind.

pub mod arch;
pub mod checkpoint;
pub mod cleanup;
pub mod cli;
pub mod exec;
pub mod input;
pub mod quantize;
pub mod serve;
pub mod start_details;
pub mod text;
