//! The DeepSeek-V3 / Kimi-K2.5 forward pass: embedding, MLA attention (absorbed, over the
//! paged latent cache), dense MLP or MoE (sigmoid `noaux_tc` routing, shared experts, NVFP4
//! W4A4 routed experts), final norm and `lm_head`. One call processes any mix of prefill
//! chunks and single decode tokens from several sequences.

use kernels::matrix::MatrixView;
use kernels::mla::cache::{CacheError, KvCacheDtype, LatentCacheShape, PagedLatentCache, SeqId};
use kernels::mla::reference::{AttentionQuery, MlaProblem};
use kernels::moe_gemm::reference::{ExpertInputAmax, ExpertView, Routing, silu};
use thiserror::Error;

use crate::arch::config::ModelConfig;
use crate::arch::rope::Rope;
use crate::checkpoint::weights::*;
use crate::exec::cpu::backend::Backend;

#[derive(Debug, Error)]
pub enum ForwardError {
    #[error(transparent)]
    Cache(#[from] CacheError),
    #[error("token id {token} is outside the vocabulary of {vocab}")]
    TokenOutOfRange { token: u32, vocab: usize },
    #[error("position {pos} exceeds max_position_embeddings {max}")]
    ContextTooLong { pos: usize, max: usize },
    #[error("tensor-parallel all-reduce failed: {0}")]
    AllReduce(String),
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
}

impl ForwardError {
    /// Whether the caller asked for something the model cannot do (rather than the model
    /// failing while doing it).
    pub fn is_invalid_input(&self) -> bool {
        matches!(
            self,
            Self::TokenOutOfRange { .. } | Self::ContextTooLong { .. } | Self::InvalidRequest(_)
        )
    }
}

/// Fails with [`ForwardError::NonFinite`] at the first NaN or Inf of `values` (rows of
/// `width`). One pass over the residual stream per sublayer: noise next to the sublayer itself.
fn check_finite(
    values: &[f32],
    width: usize,
    place: impl FnOnce() -> String,
) -> Result<(), ForwardError> {
    match values.iter().position(|v| !v.is_finite()) {
        None => Ok(()),
        Some(i) => Err(ForwardError::NonFinite {
            place: place(),
            row: i / width.max(1),
            element: i % width.max(1),
            value: values[i],
        }),
    }
}

/// Bytes a run needs besides the weights: a latent cache of `cached_tokens`, and the FP32
/// activations of one forward pass over `tokens` tokens with `logit_rows` rows of logits at
/// their peak (an estimate that errs high, for refusing sizes that cannot fit before
/// allocating them).
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

/// New tokens of one sequence, appended after what the cache already holds for it.
#[derive(Clone, Copy, Debug)]
pub struct SeqInput<'a> {
    pub seq: SeqId,
    pub tokens: &'a [u32],
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

/// Activation maxima at the routed experts' inputs, per MoE layer (calibration).
pub type Calibration = Vec<ExpertInputAmax>;

pub struct Model {
    pub config: ModelConfig,
    pub weights: ModelWeights,
    /// Round where the device kernels round (`model::exec::device`): the MLA queries (`q_abs`,
    /// `q_pe`) and the routed experts' input to BF16. Off by default (the CPU keeps FP32 as
    /// HF does); on, the CPU pass reproduces the device's numerics up to summation order.
    pub device_roundings: bool,
    rope: Rope,
    softmax_scale: f32,
    absorbed: Vec<AbsorbedAttention>,
}

/// Weights prepared once for the absorbed attention: W_UK of every head, transposed to
/// `[L, P]` so that absorbing it into the query is a product `q_nope · (W_UKᵀ)ᵀ` like every
/// other. A copy of one third of `kv_b` (P of every P+V rows).
struct AbsorbedAttention {
    /// `[heads · L, P]`: rows `h·L .. (h+1)·L` are W_UK[h]ᵀ.
    w_uk_t: Bf16Weight,
}

impl AbsorbedAttention {
    /// `(heads, L, P)` of a layer's W_UK.
    fn shape(c: &ModelConfig, w: &AttentionWeights) -> (usize, usize, usize) {
        let heads = w.kv_b.rows / (c.qk_nope_head_dim + c.v_head_dim);
        (heads, c.kv_lora_rank, c.qk_nope_head_dim)
    }

    /// Writes W_UKᵀ of every head into `t` (`[heads · L, P]`).
    fn transpose_into(c: &ModelConfig, w: &AttentionWeights, t: &mut [half::bf16]) {
        let (heads, latent, nope) = Self::shape(c, w);
        let v_dim = c.v_head_dim;
        for head in 0..heads {
            for p in 0..nope {
                for (l, &value) in w.kv_b.row(head * (nope + v_dim) + p).iter().enumerate() {
                    t[(head * latent + l) * nope + p] = value;
                }
            }
        }
    }

    /// Every layer's, in one mapping on huge pages ([`derived_on_huge_pages`]), or owned
    /// vectors where nothing could be mapped.
    fn for_layers(c: &ModelConfig, layers: &[LayerWeights]) -> Vec<Self> {
        let sizes: Vec<usize> = layers
            .iter()
            .map(|l| {
                let (heads, latent, nope) = Self::shape(c, &l.attention);
                heads * latent * nope
            })
            .collect();
        let total: usize = sizes.iter().sum();
        let memory = derived_on_huge_pages(total, |all| {
            let mut rest = all;
            for (l, &n) in layers.iter().zip(&sizes) {
                let (layer, tail) = rest.split_at_mut(n);
                Self::transpose_into(c, &l.attention, layer);
                rest = tail;
            }
        });
        let mut start = 0;
        layers
            .iter()
            .zip(&sizes)
            .map(|(l, &n)| {
                let (heads, latent, nope) = Self::shape(c, &l.attention);
                let data = match &memory {
                    Some(memory) => Bf16Data::Derived {
                        memory: memory.clone(),
                        range: start * 2..(start + n) * 2,
                    },
                    None => {
                        let mut t = vec![half::bf16::ZERO; n];
                        Self::transpose_into(c, &l.attention, &mut t);
                        Bf16Data::Owned(std::sync::Arc::new(t))
                    }
                };
                start += n;
                Self {
                    w_uk_t: Bf16Weight {
                        rows: heads * latent,
                        cols: nope,
                        data,
                    },
                }
            })
            .collect()
    }
}

impl Model {
    pub fn new(config: ModelConfig, weights: ModelWeights) -> Self {
        let rope = Rope::new(&config);
        let softmax_scale = config.softmax_scale();
        let absorbed = AbsorbedAttention::for_layers(&config, &weights.layers);
        Self {
            config,
            weights,
            device_roundings: false,
            rope,
            softmax_scale,
            absorbed,
        }
    }

    /// W_UK of every head of `layer`, transposed (`[heads · L, P]`), as the absorbed
    /// attention multiplies by it.
    pub(crate) fn w_uk_t(&self, layer: usize) -> &Bf16Weight {
        &self.absorbed[layer].w_uk_t
    }

    pub fn cache_shape(&self) -> LatentCacheShape {
        LatentCacheShape {
            layers: self.config.num_hidden_layers,
            latent_dim: self.config.kv_lora_rank,
            rope_dim: self.config.qk_rope_head_dim,
        }
    }

    /// A cache with room for `tokens` tokens across all sequences.
    pub fn new_cache(&self, dtype: KvCacheDtype, tokens: usize) -> PagedLatentCache {
        PagedLatentCache::with_capacity_tokens(self.cache_shape(), dtype, tokens)
    }

    /// Runs the model on `inputs`, appending their tokens to the cache, and returns logits.
    /// With `calibration`, records the routed experts' input maxima per MoE layer.
    pub fn forward(
        &self,
        backend: &dyn Backend,
        cache: &mut PagedLatentCache,
        inputs: &[SeqInput<'_>],
        logit_rows: LogitRows,
        mut calibration: Option<&mut Calibration>,
    ) -> Result<Logits, ForwardError> {
        let mut result = None;
        backend.run_step(&mut || {
            result = Some(self.forward_step(
                backend,
                cache,
                inputs,
                logit_rows,
                calibration.as_deref_mut(),
            ));
        });
        result.expect("a backend runs the step it is given")
    }

    fn forward_step(
        &self,
        backend: &dyn Backend,
        cache: &mut PagedLatentCache,
        inputs: &[SeqInput<'_>],
        logit_rows: LogitRows,
        mut calibration: Option<&mut Calibration>,
    ) -> Result<Logits, ForwardError> {
        let c = &self.config;
        let hidden = c.hidden_size;
        let mut rows: Vec<(SeqId, usize)> = Vec::new();
        for input in inputs {
            let start = cache.seq_len(input.seq)?;
            cache.reserve(input.seq, input.tokens.len())?;
            for (i, &token) in input.tokens.iter().enumerate() {
                if token as usize >= c.vocab_size {
                    return Err(ForwardError::TokenOutOfRange {
                        token,
                        vocab: c.vocab_size,
                    });
                }
                if start + i >= c.max_position_embeddings {
                    return Err(ForwardError::ContextTooLong {
                        pos: start + i,
                        max: c.max_position_embeddings,
                    });
                }
                rows.push((input.seq, start + i));
            }
        }
        let tokens: Vec<u32> = inputs
            .iter()
            .flat_map(|i| i.tokens.iter().copied())
            .collect();
        let n = rows.len();

        // A tensor-parallel shard holds some of the vocabulary's rows: the others are zeros
        // here, and the all-reduce adds the one rank's row to zeros (exact).
        let vocab_rows = &self.weights.vocab_rows;
        let vocab_split = *vocab_rows != (0..c.vocab_size);
        let mut x = vec![0.0f32; n * hidden];
        for (dst, &token) in x.chunks_exact_mut(hidden).zip(&tokens) {
            if !vocab_rows.contains(&(token as usize)) {
                continue;
            }
            let row = self.weights.embed.row(token as usize - vocab_rows.start);
            for (d, w) in dst.iter_mut().zip(row) {
                *d = w.to_f32();
            }
        }
        if vocab_split {
            backend
                .all_reduce_sum(&mut x)
                .map_err(ForwardError::AllReduce)?;
        }

        check_finite(&x, hidden, || "embed_tokens".into())?;

        let mut moe_layer = 0;
        for (layer, weights) in self.weights.layers.iter().enumerate() {
            let h = rms_norm_rows(&x, hidden, &weights.input_norm, c.rms_norm_eps);
            let mut attn = self.attention(backend, cache, layer, &weights.attention, &h, &rows)?;
            backend
                .all_reduce_sum(&mut attn)
                .map_err(ForwardError::AllReduce)?;
            add_in_place(&mut x, &attn);
            check_finite(&x, hidden, || format!("layer {layer} (self_attn)"))?;
            let h = rms_norm_rows(&x, hidden, &weights.post_attention_norm, c.rms_norm_eps);
            let mut mlp = match &weights.mlp {
                MlpWeights::Dense(dense) => dense_mlp(backend, dense, &h, n),
                MlpWeights::Moe(moe) => {
                    let amax = calibration.as_deref_mut().map(|cal| {
                        if cal.len() <= moe_layer {
                            cal.resize(moe_layer + 1, ExpertInputAmax::default());
                        }
                        &mut cal[moe_layer]
                    });
                    moe_layer += 1;
                    self.moe(backend, moe, &h, n, amax)
                }
            };
            backend
                .all_reduce_sum(&mut mlp)
                .map_err(ForwardError::AllReduce)?;
            add_in_place(&mut x, &mlp);
            check_finite(&x, hidden, || format!("layer {layer} (mlp)"))?;
        }
        for input in inputs {
            cache.commit(input.seq, input.tokens.len())?;
        }

        let selected: Vec<usize> = match logit_rows {
            LogitRows::All => (0..n).collect(),
            LogitRows::Last => {
                let mut end = 0;
                inputs
                    .iter()
                    .map(|i| {
                        end += i.tokens.len();
                        end - 1
                    })
                    .collect()
            }
        };
        let mut final_hidden = Vec::with_capacity(selected.len() * hidden);
        for &r in &selected {
            final_hidden.extend_from_slice(&x[r * hidden..(r + 1) * hidden]);
        }
        let normed = rms_norm_rows(&final_hidden, hidden, &self.weights.norm, c.rms_norm_eps);
        let mut values = vec![0.0f32; selected.len() * c.vocab_size];
        if vocab_split {
            // This rank's ids scored into their columns, zeros elsewhere; the all-reduce
            // gathers every rank's columns (a sum with zeros: exact).
            let held = vocab_rows.len();
            let mut part = vec![0.0f32; selected.len() * held];
            backend.matmul(
                &normed,
                selected.len(),
                self.weights.lm_head.view(),
                &mut part,
            );
            for (row, scored) in values.chunks_exact_mut(c.vocab_size).zip(part.chunks(held)) {
                row[vocab_rows.clone()].copy_from_slice(scored);
            }
            backend
                .all_reduce_sum(&mut values)
                .map_err(ForwardError::AllReduce)?;
        } else {
            backend.matmul(
                &normed,
                selected.len(),
                self.weights.lm_head.view(),
                &mut values,
            );
        }
        check_finite(&values, c.vocab_size, || {
            "the final norm and lm_head".into()
        })?;
        Ok(Logits {
            rows: selected.len(),
            vocab: c.vocab_size,
            values,
        })
    }

    fn attention(
        &self,
        backend: &dyn Backend,
        cache: &mut PagedLatentCache,
        layer: usize,
        w: &AttentionWeights,
        h: &[f32],
        rows: &[(SeqId, usize)],
    ) -> Result<Vec<f32>, ForwardError> {
        let c = &self.config;
        let n = rows.len();
        let (nope, rope_dim, v_dim, latent) = (
            c.qk_nope_head_dim,
            c.qk_rope_head_dim,
            c.v_head_dim,
            c.kv_lora_rank,
        );
        // This rank's heads: all of them, or its tensor-parallel share.
        let heads = w.kv_b.rows / (nope + v_dim);
        let qk = nope + rope_dim;

        // The first query projection and the compressed KV read the same input: one call.
        let mut q = vec![0.0f32; n * heads * qk];
        let mut kv = vec![0.0f32; n * (latent + rope_dim)];
        match &w.q {
            QueryProjection::LowRank { a, norm, b } => {
                let mut qa = vec![0.0f32; n * a.rows];
                backend.matmul_many(h, n, &[a.view(), w.kv_a.view()], &mut [&mut qa, &mut kv]);
                let qa = rms_norm_rows(&qa, a.rows, norm, c.rms_norm_eps);
                backend.matmul(&qa, n, b.view(), &mut q);
            }
            QueryProjection::Full(wq) => {
                backend.matmul_many(h, n, &[wq.view(), w.kv_a.view()], &mut [&mut q, &mut kv])
            }
        }

        // Each row normed (its latent, in place) and rotated (its RoPE part), the rows of a
        // prefill in parallel; then written to the cache in order.
        for_rows(&mut kv, latent + rope_dim, |r, row| {
            let (c_part, pe_part) = row.split_at_mut(latent);
            let normed = rms_norm(c_part, &w.kv_a_norm, c.rms_norm_eps);
            c_part.copy_from_slice(&normed);
            self.rope.apply(pe_part, rows[r].1);
        });
        for (row, &(seq, pos)) in kv.chunks_exact(latent + rope_dim).zip(rows) {
            let (c_part, pe_part) = row.split_at(latent);
            cache.write(layer, seq, pos, c_part, pe_part)?;
        }

        // Absorb W_UK into the query, per head: q_abs[:, h] = q_nope[:, h] · W_UK[h], a
        // product with the pre-transposed W_UK[h]ᵀ (`[L, P]`); all heads in one backend call.
        let w_uk_t = self.absorbed[layer].w_uk_t.data.as_slice();
        let uk_heads: Vec<MatrixView<'_>> = w_uk_t
            .chunks_exact(latent * nope)
            .take(heads)
            .map(|data| MatrixView::Bf16 {
                rows: latent,
                cols: nope,
                data,
            })
            .collect();
        // [heads, n, P] in, [heads, n, L] out.
        let mut q_nope = vec![0.0f32; heads * n * nope];
        let mut q_pe = vec![0.0f32; n * heads * rope_dim];
        for_rows(&mut q_nope, n * nope, |head, block| {
            for (r, dst) in block.chunks_exact_mut(nope).enumerate() {
                dst.copy_from_slice(&q[(r * heads + head) * qk..][..nope]);
            }
        });
        for_rows(&mut q_pe, heads * rope_dim, |r, pe_row| {
            for (head, pe) in pe_row.chunks_exact_mut(rope_dim).enumerate() {
                pe.copy_from_slice(&q[(r * heads + head) * qk + nope..][..rope_dim]);
            }
            self.rope.apply_heads(pe_row, rope_dim, rows[r].1);
        });
        let mut absorbed = vec![0.0f32; heads * n * latent];
        backend.matmul_per_head(&q_nope, n, &uk_heads, &mut absorbed);
        let mut q_abs = vec![0.0f32; n * heads * latent];
        for_rows(&mut q_abs, heads * latent, |r, row| {
            for (head, dst) in row.chunks_exact_mut(latent).enumerate() {
                dst.copy_from_slice(&absorbed[(head * n + r) * latent..][..latent]);
            }
        });

        let queries: Vec<AttentionQuery> = rows
            .iter()
            .map(|&(seq, pos)| AttentionQuery {
                seq,
                context: pos + 1,
            })
            .collect();
        if self.device_roundings {
            round_to_bf16(&mut q_abs);
            round_to_bf16(&mut q_pe);
        }
        let problem = MlaProblem {
            layer,
            heads,
            queries: &queries,
            q_abs: &q_abs,
            q_pe: &q_pe,
            softmax_scale: self.softmax_scale,
        };
        let mut o_latent = vec![0.0f32; n * heads * latent];
        let mut lse = vec![0.0f32; n * heads];
        backend.mla_attention(cache, &problem, &mut o_latent, &mut lse)?;

        // Back out of latent space with W_UV, per head: o[:, h] = o_latent[:, h] · W_UV[h]ᵀ,
        // where W_UV[h] is kv_b's rows h·(P+V)+P .. (h+1)·(P+V); all heads in one call.
        let uv_heads: Vec<MatrixView<'_>> = (0..heads)
            .map(|head| {
                let first = head * (nope + v_dim) + nope;
                MatrixView::Bf16 {
                    rows: v_dim,
                    cols: latent,
                    data: &w.kv_b.data.as_slice()[first * latent..(first + v_dim) * latent],
                }
            })
            .collect();
        let mut latent_rows = vec![0.0f32; heads * n * latent];
        for_rows(&mut latent_rows, n * latent, |head, block| {
            for (r, dst) in block.chunks_exact_mut(latent).enumerate() {
                dst.copy_from_slice(&o_latent[(r * heads + head) * latent..][..latent]);
            }
        });
        let mut head_v = vec![0.0f32; heads * n * v_dim];
        backend.matmul_per_head(&latent_rows, n, &uv_heads, &mut head_v);
        let mut o = vec![0.0f32; n * heads * v_dim];
        for_rows(&mut o, heads * v_dim, |r, row| {
            for (head, dst) in row.chunks_exact_mut(v_dim).enumerate() {
                dst.copy_from_slice(&head_v[(head * n + r) * v_dim..][..v_dim]);
            }
        });
        let mut out = vec![0.0f32; n * c.hidden_size];
        backend.matmul(&o, n, w.o.view(), &mut out);
        Ok(out)
    }

    fn moe(
        &self,
        backend: &dyn Backend,
        w: &MoeWeights,
        h: &[f32],
        n: usize,
        amax: Option<&mut ExpertInputAmax>,
    ) -> Vec<f32> {
        let c = &self.config;
        let mut logits = vec![0.0f32; n * c.n_routed_experts];
        // The router and the shared experts' gate and up read the same input: one call.
        let shared = w.shared.as_ref().map(|shared| {
            let inter = shared.gate.rows;
            let (mut gate, mut up) = (vec![0.0f32; n * inter], vec![0.0f32; n * inter]);
            backend.matmul_many(
                h,
                n,
                &[w.router.view(), shared.gate.view(), shared.up.view()],
                &mut [&mut logits, &mut gate, &mut up],
            );
            (shared, gate, up)
        });
        if shared.is_none() {
            backend.matmul(h, n, w.router.view(), &mut logits);
        }
        let routing = route(&logits, &w.correction_bias, c);
        let experts: Vec<ExpertView<'_>> = w.experts.iter().map(ExpertWeights::view).collect();
        let mut out = vec![0.0f32; n * c.hidden_size];
        if self.device_roundings {
            let mut h_bf16 = h.to_vec();
            round_to_bf16(&mut h_bf16);
            backend.moe(&h_bf16, c.hidden_size, &routing, &experts, &mut out, amax);
        } else {
            backend.moe(h, c.hidden_size, &routing, &experts, &mut out, amax);
        }
        if let Some((shared, gate, up)) = shared {
            add_in_place(&mut out, &mlp_down(backend, shared, gate, &up, n));
        }
        out
    }
}

/// `noaux_tc` routing: sigmoid scores; the correction bias is added for choosing experts only
/// (groups ranked by the sum of their two best biased scores, `topk_group` groups kept); the
/// weights are the chosen experts' unbiased scores, normalized, times `routed_scaling_factor`.
/// Ties go to the lower expert index, so the choice is deterministic.
pub fn route(logits: &[f32], bias: &[f32], c: &ModelConfig) -> Routing {
    use rayon::prelude::*;
    let experts = c.n_routed_experts;
    let rows = logits.len() / experts.max(1);
    // Each row's choice alone: a prefill's rows in parallel.
    let chosen: Vec<(Vec<usize>, Vec<f32>)> = if rows >= NORM_PARALLEL_ROWS {
        logits
            .par_chunks_exact(experts)
            .with_min_len(NORM_PARALLEL_ROWS / 4)
            .map(|row| route_row(row, bias, c))
            .collect()
    } else {
        logits
            .chunks_exact(experts)
            .map(|row| route_row(row, bias, c))
            .collect()
    };
    let mut routing = Routing {
        top_k: c.num_experts_per_tok,
        experts: Vec::with_capacity(rows * c.num_experts_per_tok),
        weights: Vec::with_capacity(rows * c.num_experts_per_tok),
    };
    for (experts, weights) in chosen {
        routing.experts.extend(experts.iter().map(|&e| e as u32));
        routing.weights.extend(weights);
    }
    routing
}

/// One row's experts (best first) and their weights; see [`route`].
fn route_row(row: &[f32], bias: &[f32], c: &ModelConfig) -> (Vec<usize>, Vec<f32>) {
    let k = c.num_experts_per_tok;
    let per_group = c.n_routed_experts / c.n_group;
    let scores: Vec<f32> = row.iter().map(|&l| 1.0 / (1.0 + (-l).exp())).collect();
    let mut choice: Vec<f32> = scores.iter().zip(bias).map(|(s, b)| s + b).collect();
    if c.n_group > 1 {
        let group_scores: Vec<f32> = choice
            .chunks_exact(per_group)
            .map(|g| {
                let mut sorted = g.to_vec();
                sorted.sort_by(|a, b| b.total_cmp(a));
                sorted.iter().take(2).sum()
            })
            .collect();
        let kept = top_indices(&group_scores, c.topk_group);
        for (g, chunk) in choice.chunks_exact_mut(per_group).enumerate() {
            if !kept.contains(&g) {
                chunk.fill(f32::NEG_INFINITY);
            }
        }
    }
    let chosen = top_indices(&choice, k);
    let mut weights: Vec<f32> = chosen.iter().map(|&e| scores[e]).collect();
    if c.norm_topk_prob {
        let sum: f32 = weights.iter().sum::<f32>() + 1e-20;
        weights.iter_mut().for_each(|w| *w /= sum);
    }
    weights
        .iter_mut()
        .for_each(|w| *w *= c.routed_scaling_factor as f32);
    (chosen, weights)
}

/// Indices of the `k` largest values, largest first, ties to the lower index.
fn top_indices(values: &[f32], k: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..values.len()).collect();
    order.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
    order.truncate(k);
    order
}

fn dense_mlp(backend: &dyn Backend, w: &DenseMlpWeights, h: &[f32], n: usize) -> Vec<f32> {
    let inter = w.gate.rows;
    let mut gate = vec![0.0f32; n * inter];
    let mut up = vec![0.0f32; n * inter];
    backend.matmul_many(
        h,
        n,
        &[w.gate.view(), w.up.view()],
        &mut [&mut gate, &mut up],
    );
    mlp_down(backend, w, gate, &up, n)
}

/// `down(silu(gate) · up)` from the gate and up products.
fn mlp_down(
    backend: &dyn Backend,
    w: &DenseMlpWeights,
    mut gate: Vec<f32>,
    up: &[f32],
    n: usize,
) -> Vec<f32> {
    let inter = w.down.cols;
    for_rows(&mut gate, inter, |r, row| {
        for (g, u) in row.iter_mut().zip(&up[r * inter..(r + 1) * inter]) {
            *g = silu(*g) * u;
        }
    });
    let mut out = vec![0.0f32; n * w.down.rows];
    backend.matmul(&gate, n, w.down.view(), &mut out);
    out
}

fn round_to_bf16(values: &mut [f32]) {
    for v in values {
        *v = half::bf16::from_f32(*v).to_f32();
    }
}

/// RMSNorm in FP32: `x / sqrt(mean(x²) + eps) · w`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f64) -> Vec<f32> {
    let mut out = vec![0.0; x.len().min(weight.len())];
    rms_norm_into(x, weight, eps, &mut out);
    out
}

/// [`rms_norm`] written into `out`.
fn rms_norm_into(x: &[f32], weight: &[f32], eps: f64, out: &mut [f32]) {
    let mean_square = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let inv = 1.0 / (mean_square + eps as f32).sqrt();
    for ((o, v), w) in out.iter_mut().zip(x).zip(weight) {
        *o = w * (v * inv);
    }
}

/// [`rms_norm`] of every row, the rows of a prefill in parallel (each row's sum in the same
/// order as alone).
fn rms_norm_rows(x: &[f32], dim: usize, weight: &[f32], eps: f64) -> Vec<f32> {
    use rayon::prelude::*;
    let mut out = vec![0.0; x.len() / dim.max(1) * dim];
    if dim == 0 {
        return out;
    }
    if x.len() / dim >= NORM_PARALLEL_ROWS {
        x.par_chunks_exact(dim)
            .zip(out.par_chunks_exact_mut(dim))
            .with_min_len(NORM_PARALLEL_ROWS / 2)
            .for_each(|(row, o)| rms_norm_into(row, weight, eps, o));
    } else {
        for (row, o) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
            rms_norm_into(row, weight, eps, o);
        }
    }
    out
}

/// Rows from which [`rms_norm_rows`] runs in parallel: a row of a few thousand elements is a
/// microsecond, less than waking a thread for it.
const NORM_PARALLEL_ROWS: usize = 32;

fn add_in_place(x: &mut [f32], y: &[f32]) {
    let width = 1 << 12;
    for_rows(x, width, |i, block| {
        for (a, b) in block.iter_mut().zip(&y[i * width..]) {
            *a += b;
        }
    });
}

/// `f(i, row)` for every `width`-wide row `i` of `values` (the last one may be shorter), in
/// parallel from [`NORM_PARALLEL_ROWS`] rows (a prefill's), in order below (a decode step's
/// few rows are less work than waking a thread). Each row is the same computation either way.
fn for_rows(values: &mut [f32], width: usize, f: impl Fn(usize, &mut [f32]) + Sync + Send) {
    use rayon::prelude::*;
    let width = width.max(1);
    if values.len() / width >= NORM_PARALLEL_ROWS {
        values
            .par_chunks_mut(width)
            .enumerate()
            .with_min_len(NORM_PARALLEL_ROWS / 4)
            .for_each(|(i, row)| f(i, row));
    } else {
        for (i, row) in values.chunks_mut(width).enumerate() {
            f(i, row);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn routing_config(n_group: usize, topk_group: usize) -> ModelConfig {
        let text = serde_json::json!({
            "model_type": "deepseek_v3", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
            "moe_intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1,
            "n_routed_experts": 8, "num_experts_per_tok": 2, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
            "qk_rope_head_dim": 4, "v_head_dim": 8, "max_position_embeddings": 64,
            "n_group": n_group, "topk_group": topk_group, "routed_scaling_factor": 2.5, "norm_topk_prob": true
        });
        crate::arch::config::CheckpointConfig::from_json(std::path::Path::new("c"), &text, None)
            .unwrap()
            .model
    }

    #[test]
    fn bias_selects_but_does_not_weight() {
        let c = routing_config(1, 1);
        let logits = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7];
        let mut bias = [0.0f32; 8];
        bias[0] = 1.0; // makes expert 0 the best choice despite the lowest score
        let r = route(&logits, &bias, &c);
        assert_eq!(r.experts, vec![0, 7]);
        let (s0, s7) = (0.5f32, 1.0 / (1.0 + (-0.7f32).exp()));
        assert!((r.weights[0] - 2.5 * s0 / (s0 + s7)).abs() < 1e-6);
        assert!((r.weights.iter().sum::<f32>() - 2.5).abs() < 1e-5);
    }

    #[test]
    fn group_limited_top_k_ignores_experts_of_dropped_groups() {
        let c = routing_config(4, 1);
        // Group 3 (experts 6, 7) has the single best expert but group 0's two experts sum higher.
        let logits = [2.0, 2.0, -5.0, -5.0, -5.0, -5.0, 3.0, -5.0];
        let r = route(&logits, &[0.0; 8], &c);
        assert_eq!(r.experts, vec![0, 1]);
    }
}
