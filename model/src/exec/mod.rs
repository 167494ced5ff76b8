//! Execution: the model's step written once ([`deepseek`]) over the operations every backend
//! serves ([`ops::StepOps`]), the runner seam the decode loop and the server drive
//! ([`runner::ModelRunner`]), and the backends: the CPU kernels ([`cpu`]) and the device
//! executor on a GPU or on the host execution layer ([`device`]). Also sampling, the decode
//! loop, tensor-parallel rank processes and the tactics a run selects.

pub mod backend;
pub mod cpu;
pub mod deepseek;
pub mod device;
pub mod generate;
pub mod ops;
pub mod plan;
pub mod profile;
pub mod runner;
pub mod sampler;
pub mod tactics;
pub mod tp;
pub mod weights;

use kernels::device::DeviceError;
use kernels::mla::cache::{CacheError, KvCacheDtype, LatentCacheShape};
use thiserror::Error;

use crate::arch::config::ModelConfig;

pub use ops::{SeqInput, StepOutput, StepResult};
pub use runner::{ModelRunner, Runner};

#[derive(Debug, Error)]
pub enum ExecError {
    #[error(transparent)]
    Cache(CacheError),
    #[error("token id {token} is outside the vocabulary of {vocab}")]
    TokenOutOfRange { token: u32, vocab: usize },
    #[error("position {pos} exceeds max_position_embeddings {max}")]
    ContextTooLong { pos: usize, max: usize },
    #[error("tensor-parallel all-reduce failed: {0}")]
    AllReduce(String),
    /// A tensor-parallel rank exited or stopped taking commands; the message names it.
    #[error("{0}")]
    RankLost(String),
    /// The first place whose output holds NaN or Inf: a damaged weight, or values the model
    /// cannot represent. Nothing after it would mean anything.
    #[error(
        "the output of {place} is not finite (row {row}, element {element} is {value}); `model inspect` checks the checkpoint's weights"
    )]
    NonFinite {
        place: String,
        row: usize,
        element: usize,
        value: f32,
    },
    #[error("{0}")]
    InvalidRequest(String),
    /// The device (GPU or host execution layer) failed.
    #[error("device: {0}")]
    Device(String),
    /// The model's shape, or a weight, is outside what the backend implements.
    #[error("the {backend} backend cannot run this model: {why}")]
    Unsupported { backend: &'static str, why: String },
}

impl ExecError {
    /// Whether the caller asked for something the model cannot do (rather than the model
    /// failing while doing it).
    pub fn is_invalid_input(&self) -> bool {
        matches!(
            self,
            Self::TokenOutOfRange { .. } | Self::ContextTooLong { .. } | Self::InvalidRequest(_)
        )
    }

    /// Whether the runner cannot go on after it: the device failed, or a tensor-parallel rank
    /// (or its collective) did.
    pub fn is_fatal(&self) -> bool {
        matches!(
            self,
            Self::Device(_) | Self::AllReduce(_) | Self::RankLost(_)
        )
    }

    /// Whether the model or its options are outside what the backend runs (refused before any
    /// work: exit code 2).
    pub fn is_unsupported(&self) -> bool {
        matches!(self, Self::Unsupported { .. })
    }
}

impl From<DeviceError> for ExecError {
    fn from(e: DeviceError) -> Self {
        Self::Device(e.to_string())
    }
}

/// Which rows get logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitRows {
    /// The last token of every input (decoding).
    Last,
    /// Every token (scoring a prompt).
    All,
}

/// Logits `[rows, vocab]`.
#[derive(Clone, Debug)]
pub struct Logits {
    pub rows: usize,
    pub vocab: usize,
    pub values: Vec<f32>,
}

impl Logits {
    pub fn row(&self, row: usize) -> &[f32] {
        &self.values[row * self.vocab..(row + 1) * self.vocab]
    }
}

/// Bytes a CPU run needs besides the weights: a latent cache of `cached_tokens`, and the FP32
/// activations of one step over `tokens` tokens with `logit_rows` rows of logits at their peak
/// (an estimate that errs high, for refusing sizes that cannot fit before allocating them).
pub fn forward_bytes(
    c: &ModelConfig,
    kv_dtype: KvCacheDtype,
    cached_tokens: usize,
    tokens: usize,
    logit_rows: usize,
) -> u64 {
    let shape = LatentCacheShape {
        layers: c.num_hidden_layers,
        latent_dim: c.kv_lora_rank,
        rope_dim: c.qk_rope_head_dim,
    };
    let cache = kv_dtype.bytes_per_token(&shape) as u64 * c.num_hidden_layers as u64;
    let heads = c.num_attention_heads as u64;
    let mlp = (c.intermediate_size as u64)
        .max((c.moe_intermediate_size * c.n_shared_experts) as u64)
        .max((c.moe_intermediate_size * c.num_experts_per_tok) as u64);
    let per_token_floats = 6 * c.hidden_size as u64
        + heads * (c.qk_head_dim() + 2 * c.kv_lora_rank + c.qk_rope_head_dim + c.v_head_dim) as u64
        + c.q_lora_rank.unwrap_or(0) as u64
        + c.latent_cache_dim() as u64
        + c.n_routed_experts as u64
        + 3 * mlp;
    // Temporaries live next to their inputs: twice the sum is the safe side.
    (cached_tokens as u64)
        .saturating_mul(cache)
        .saturating_add((tokens as u64).saturating_mul(8 * per_token_floats))
        .saturating_add((logit_rows as u64).saturating_mul(4 * c.vocab_size as u64))
}
