//! The weights as the step reads them, in any backend's handles ([`WeightKinds`]): one tree
//! for every backend, built from the host weights by the backend (the CPU borrows the mapped
//! tensors, a device uploads them in its kernels' layouts).
//!
//! It differs from the checkpoint's tensors where the step wants another cut: `kv_a_proj_with_mqa`
//! split into its latent and RoPE rows, gate over up as one stacked matrix, and the absorbed
//! attention's per-head W_UKᵀ (a transposed copy) and W_UV (rows of `kv_b_proj`).

use std::ops::Range;

use super::ops::WeightKinds;
use crate::arch::config::ModelConfig;
use crate::arch::shard::TpShard;
use crate::checkpoint::weights::Bf16Weight;

pub struct Weights<K: WeightKinds> {
    /// The embedding's rows `vocab_rows`.
    pub embed: K::Matrix,
    pub layers: Vec<Layer<K>>,
    pub norm: K::Vector,
    /// `lm_head`'s rows `vocab_rows`.
    pub lm_head: K::Matrix,
    /// This rank's place in its tensor-parallel group ([`TpShard::SINGLE`]: the whole model).
    pub shard: TpShard,
    /// The vocabulary ids whose rows `embed` and `lm_head` hold ([`TpShard::vocab_rows`]).
    pub vocab_rows: Range<usize>,
    /// Attention heads of this rank.
    pub heads: usize,
}

pub struct Layer<K: WeightKinds> {
    pub input_norm: K::Vector,
    pub attention: Attention<K>,
    pub post_attention_norm: K::Vector,
    pub mlp: Mlp<K>,
}

pub struct Attention<K: WeightKinds> {
    /// `q_a_proj` and its norm, when the query is low-rank.
    pub q_a: Option<(K::Matrix, K::Vector)>,
    /// `q_b_proj`, or the full `q_proj`.
    pub q_b: K::Matrix,
    /// The first `kv_lora_rank` rows of `kv_a_proj_with_mqa`.
    pub kv_a_latent: K::Matrix,
    /// Its last `qk_rope_head_dim` rows.
    pub kv_a_rope: K::Matrix,
    pub kv_a_norm: K::Vector,
    /// W_UK of every head, transposed (`[L, P]` each).
    pub w_uk_t: K::Heads,
    /// W_UV of every head (`[V, L]` each: rows of `kv_b_proj`).
    pub w_uv: K::Heads,
    pub o: K::Matrix,
}

pub struct DenseMlp<K: WeightKinds> {
    /// Gate's rows over up's.
    pub gate_up: K::Matrix,
    pub down: K::Matrix,
}

pub struct Moe<K: WeightKinds> {
    pub router: K::Matrix,
    pub correction_bias: K::Vector,
    pub experts: K::Experts,
    pub shared: Option<DenseMlp<K>>,
}

pub enum Mlp<K: WeightKinds> {
    Dense(DenseMlp<K>),
    Moe(Moe<K>),
}

/// W_UK of every head of a layer's `kv_b_proj` (`[heads · (P + V), L]`), transposed to
/// `[heads · L, P]`: absorbing it into the query is then a product `q_nope · (W_UKᵀ)ᵀ` like
/// every other. One third of `kv_b` copied.
pub fn w_uk_transposed(c: &ModelConfig, kv_b: &Bf16Weight) -> Vec<half::bf16> {
    let mut t =
        vec![
            half::bf16::ZERO;
            kv_b.rows / (c.qk_nope_head_dim + c.v_head_dim) * c.kv_lora_rank * c.qk_nope_head_dim
        ];
    w_uk_transpose_into(c, kv_b, &mut t);
    t
}

/// [`w_uk_transposed`] into `t`.
pub fn w_uk_transpose_into(c: &ModelConfig, kv_b: &Bf16Weight, t: &mut [half::bf16]) {
    let (latent, nope, v) = (c.kv_lora_rank, c.qk_nope_head_dim, c.v_head_dim);
    for head in 0..kv_b.rows / (nope + v) {
        for p in 0..nope {
            for (l, &value) in kv_b.row(head * (nope + v) + p).iter().enumerate() {
                t[(head * latent + l) * nope + p] = value;
            }
        }
    }
}
