//! What a run needs in host memory besides the weights, estimated before anything is
//! allocated, so that a size which cannot fit is refused by name instead of failing halfway.

use kernels::mla::cache::{KvCacheDtype, LatentCacheShape};

use crate::arch::config::ModelConfig;

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
