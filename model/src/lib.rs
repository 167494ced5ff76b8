//! The model layer: checkpoint → model → kernels → backend.
//!
//! - [`config`] and [`checkpoint`]: what NVIDIA ships, read as it is.
//! - [`weights`]: the weights, borrowed from memory-mapped shards.
//! - [`rope`], [`forward`]: the DeepSeek-V3 forward pass over a paged latent cache, through the
//!   [`backend::Backend`] trait.
//! - [`sampler`], [`generate`]: the decode loop.
//! - [`generator`], [`quantize`], [`plan`]: checkpoint generation, NVFP4 quantization, memory
//!   planning.
//! - [`heap`]: freed activations kept for the next step, not faulted back in.
//! - [`input`], [`cleanup`], [`checkpoint_writer`]: checks on what enters, and writers that
//!   never destroy their input nor leave half-written output behind.
//! - [`tokenizer`], [`chat_template`], [`tool_declaration`], [`parsers`]: text in and out (Kimi's
//!   tiktoken BPE, the chat template, reasoning and tool-call parsing on token ids).
//! - [`engine`], [`server`]: continuous batching and the OpenAI-compatible server.

pub mod backend;
pub mod chat_template;
pub mod checkpoint;
pub mod checkpoint_writer;
pub mod cleanup;
pub mod compare;
pub mod config;
pub mod cpu_choice;
pub mod engine;
pub mod executor;
pub mod forward;
pub mod generate;
pub mod generator;
pub mod heap;
pub mod input;
pub mod nvfp4_file;
pub mod op_profile;
pub mod parsers;
pub mod plan;
pub mod quantize;
pub mod rope;
pub mod sampler;
pub mod server;
pub mod serving_cli;
pub mod tactics;
pub mod tensor_file;
pub mod tokenizer;
pub mod tool_declaration;
pub mod tp;
pub mod weights;
