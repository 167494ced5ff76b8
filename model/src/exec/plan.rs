//! `model plan`: per-GPU memory under tensor parallelism, and the longest context that fits.
//!
//! Sharding is the one this project uses (the same as the serving stacks it replaces):
//! - split over GPUs: `q_b_proj`/`q_proj`, `kv_b_proj`, `o_proj` (by head), dense and shared
//!   MLPs and every routed expert (by intermediate row), `embed_tokens` and `lm_head` (by vocab,
//!   `TpShard::vocab_rows`);
//! - replicated on every GPU: `q_a_proj`, `kv_a_proj_with_mqa`, norms, the router and its
//!   bias, the per-tensor NVFP4 scales, and the latent KV cache (MLA's single latent head
//!   cannot be split by head).

use kernels::formats::NVFP4_BLOCK;
use kernels::mla::cache::{KvCacheDtype, LatentCacheShape};

use crate::arch::config::ModelConfig;
use crate::checkpoint::weights::TpShard;
use crate::exec::device::{WorkspaceShape, max_pages, workspace_bytes};

/// The MLA tactics' split cap (`sp64`), which sizes the split workspace.
pub const PLANNED_MLA_SPLITS: usize = 64;

pub const GIB: f64 = (1u64 << 30) as f64;

#[derive(Clone, Debug)]
pub struct PlanRequest {
    pub gpus: usize,
    pub gpu_mem_gib: f64,
    /// Fraction of each GPU the engine may use (vLLM's `gpu_memory_utilization`).
    pub memory_utilization: f64,
    pub kv_dtype: KvCacheDtype,
    pub max_model_len: usize,
    /// Tokens per forward pass the activation workspace is sized for.
    pub max_batched_tokens: usize,
    /// Sequences per step, each with a row of logits.
    pub max_num_seqs: usize,
    /// Whether routed experts are NVFP4 (else BF16).
    pub nvfp4_experts: bool,
}

/// Bytes per GPU, by part.
#[derive(Clone, Debug, Default)]
pub struct Plan {
    pub parts: Vec<(&'static str, f64)>,
    pub weights: f64,
    pub kv_bytes_per_token: f64,
    pub runtime_reserve: f64,
    pub activation_reserve: f64,
    /// The share of a GPU the engine may use (`gpu_mem_gib × memory_utilization`).
    pub usable: f64,
    pub kv_budget: f64,
    pub max_context_tokens: usize,
    pub fits: bool,
}

/// CUDA context, cuBLAS/NCCL workspaces and CUDA-graph pools: measured by the deployments in
/// the seeds at 1–2 GiB; the midpoint keeps the plan honest without a GPU at hand.
const RUNTIME_RESERVE_BYTES: f64 = 1.5 * GIB;

pub fn plan(c: &ModelConfig, r: &PlanRequest) -> Plan {
    let tp = r.gpus as f64;
    let bf16 = 2.0;
    let h = c.hidden_size as f64;
    let heads = c.num_attention_heads as f64;
    let layers = c.num_hidden_layers as f64;
    let moe_layers = (0..c.num_hidden_layers)
        .filter(|&l| c.is_moe_layer(l))
        .count() as f64;
    let dense_layers = layers - moe_layers;
    let expert_bytes_per_param = if r.nvfp4_experts {
        0.5 + 1.0 / NVFP4_BLOCK as f64
    } else {
        bf16
    };

    // Rank 0 holds the most vocabulary rows (`TpShard::vocab_rows`).
    let vocab_rows = TpShard {
        rank: 0,
        world: r.gpus.max(1),
    }
    .vocab_rows(c.vocab_size)
    .len();
    let embed = vocab_rows as f64 * h * bf16;
    let lm_head = if c.tie_word_embeddings { 0.0 } else { embed };
    let q_split = match c.q_lora_rank {
        Some(rank) => heads * c.qk_head_dim() as f64 * rank as f64,
        None => heads * c.qk_head_dim() as f64 * h,
    };
    let q_replicated = c.q_lora_rank.map_or(0.0, |rank| rank as f64 * (h + 1.0));
    let kv_a = c.latent_cache_dim() as f64 * h + c.kv_lora_rank as f64;
    let kv_b = heads * (c.qk_nope_head_dim + c.v_head_dim) as f64 * c.kv_lora_rank as f64;
    // The absorbed attention's W_UK, transposed per head: a second copy of a third of kv_b.
    let w_uk_t = heads * c.qk_nope_head_dim as f64 * c.kv_lora_rank as f64;
    let o = h * heads * c.v_head_dim as f64;
    let attention = layers * bf16 * (q_replicated + kv_a + (q_split + kv_b + w_uk_t + o) / tp);
    let norms = (layers * 2.0 + 1.0) * h * bf16;
    let dense = dense_layers * 3.0 * h * c.intermediate_size as f64 * bf16 / tp;
    let router = moe_layers * c.n_routed_experts as f64 * (h * bf16 + 4.0);
    let shared =
        moe_layers * 3.0 * h * (c.moe_intermediate_size * c.n_shared_experts) as f64 * bf16 / tp;
    let routed_params =
        moe_layers * c.n_routed_experts as f64 * 3.0 * h * c.moe_intermediate_size as f64;
    let routed = routed_params * expert_bytes_per_param / tp
        + if r.nvfp4_experts {
            moe_layers * c.n_routed_experts as f64 * 3.0 * 8.0
        } else {
            0.0
        };
    let parts = vec![
        ("routed experts", routed),
        ("attention", attention),
        ("shared experts", shared),
        ("embed + lm_head", embed + lm_head),
        ("router", router),
        ("dense MLP", dense),
        ("norms", norms),
    ];
    let weights: f64 = parts.iter().map(|(_, b)| b).sum();

    let shape = LatentCacheShape {
        layers: c.num_hidden_layers,
        latent_dim: c.kv_lora_rank,
        rope_dim: c.qk_rope_head_dim,
    };
    let kv_bytes_per_token = r.kv_dtype.bytes_per_token(&shape) as f64 * layers;
    // The device executor's step workspace, sized by the executor's own function.
    let activation_reserve = workspace_bytes(
        c,
        &WorkspaceShape {
            rows: r.max_batched_tokens,
            heads: c.num_attention_heads / r.gpus.max(1),
            max_pages: max_pages(c, r.max_model_len),
            max_splits: PLANNED_MLA_SPLITS,
            logit_rows: r.max_num_seqs,
            ranks: r.gpus.max(1),
            vendor_dense: false,
        },
    ) as f64;
    let usable = r.gpu_mem_gib * GIB * r.memory_utilization;
    let kv_budget = (usable - weights - RUNTIME_RESERVE_BYTES - activation_reserve).max(0.0);
    let max_context_tokens = (kv_budget / kv_bytes_per_token) as usize;
    Plan {
        parts,
        weights,
        kv_bytes_per_token,
        runtime_reserve: RUNTIME_RESERVE_BYTES,
        activation_reserve,
        usable,
        kv_budget,
        max_context_tokens,
        fits: max_context_tokens >= r.max_model_len,
    }
}

/// The fewest GPUs, from `r.gpus` up to `most`, over which `c`'s weights, runtime reserve and
/// activations leave room for at least one token of latent cache, counting only the GPU
/// counts `splits` accepts (the model's tensor-parallel split); `None` when none does.
pub fn fewest_gpus_that_fit(
    c: &ModelConfig,
    r: &PlanRequest,
    most: usize,
    splits: impl Fn(usize) -> bool,
) -> Option<usize> {
    (r.gpus.max(1)..=most)
        .filter(|&gpus| splits(gpus))
        .find(|&gpus| plan(c, &PlanRequest { gpus, ..r.clone() }).weights_fit())
}

impl Plan {
    /// Whether the weights, the runtime reserve and the activations leave room for at least
    /// one token of latent cache.
    pub fn weights_fit(&self) -> bool {
        self.max_context_tokens > 0
    }

    /// What is left of a GPU's usable share for the weights.
    pub fn usable_for_weights(&self) -> f64 {
        self.usable - self.runtime_reserve - self.activation_reserve
    }

    pub fn render(&self, r: &PlanRequest) -> String {
        let mut s = String::new();
        let gib = |b: f64| b / GIB;
        s += &format!(
            "per GPU ({} GPUs, {:.1} GiB each, {:.0}% usable, KV cache {}):\n",
            r.gpus,
            r.gpu_mem_gib,
            r.memory_utilization * 100.0,
            r.kv_dtype.id()
        );
        for (name, bytes) in &self.parts {
            s += &format!("  {name:<18} {:>9.3} GiB\n", gib(*bytes));
        }
        s += &format!("  {:<18} {:>9.3} GiB\n", "weights total", gib(self.weights));
        s += &format!(
            "  {:<18} {:>9.3} GiB\n",
            "runtime reserve",
            gib(self.runtime_reserve)
        );
        s += &format!(
            "  {:<18} {:>9.3} GiB  ({} tokens per pass)\n",
            "activations",
            gib(self.activation_reserve),
            r.max_batched_tokens
        );
        s += &format!(
            "  {:<18} {:>9.3} GiB\n",
            "KV cache budget",
            gib(self.kv_budget)
        );
        s += &format!(
            "KV cache per token: {:.0} B ({:.1} KiB, replicated on every GPU)\n",
            self.kv_bytes_per_token,
            self.kv_bytes_per_token / 1024.0
        );
        s += &format!(
            "largest context that fits: {} tokens\n",
            self.max_context_tokens
        );
        s += &format!(
            "max_model_len {}: {}\n",
            r.max_model_len,
            if self.fits { "fits" } else { "does NOT fit" }
        );
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::presets::Preset;

    fn request(kv_dtype: KvCacheDtype, max_model_len: usize) -> PlanRequest {
        PlanRequest {
            gpus: 8,
            gpu_mem_gib: 96.0,
            memory_utilization: 0.90,
            kv_dtype,
            max_model_len,
            max_batched_tokens: 8192,
            max_num_seqs: 256,
            nvfp4_experts: true,
        }
    }

    /// On Kimi-K2.5's real shapes, rank 0 of TP8 (the rank holding the most vocabulary
    /// rows) allocates what the plan says, within 1% for each part: its weights (zeroed, of
    /// the rank's shapes, on a dry device), the latent cache and the step workspace.
    #[test]
    fn the_kimi_tp8_plan_is_what_a_rank_of_the_executor_allocates() {
        use crate::exec::device::{
            DeviceOptions, DeviceWeights, ExecutorTactics, StepCapacity, runner_with_weights,
        };
        use kernels::arch::Sm;
        use kernels::device::dry::DryDevice;
        let c = Preset::KimiK25.model_config();
        for kv_dtype in [KvCacheDtype::Bf16, KvCacheDtype::Fp8E4m3] {
            let r = PlanRequest {
                max_model_len: 32_768,
                ..request(kv_dtype, 32_768)
            };
            let planned = plan(&c, &r);
            let shard = TpShard {
                rank: 0,
                world: r.gpus,
            };
            let tactics =
                ExecutorTactics::defaults_for_rank(Sm::Sm120, &c, kv_dtype, r.gpus).unwrap();
            let dev = DryDevice::new(Sm::Sm120);
            let weights = DeviceWeights::zeroed(&dev, &c, shard, tactics.moe.as_slice()).unwrap();
            let runner = runner_with_weights(
                dev,
                &c,
                weights,
                DeviceOptions {
                    kv_dtype,
                    cache_tokens: r.max_model_len,
                    capacity: StepCapacity {
                        tokens: r.max_batched_tokens,
                        logit_rows: r.max_num_seqs,
                    },
                    tactics,
                    selector: None,
                    fill_memory: None,
                    quiet: true,
                },
            )
            .unwrap();
            let got = runner.ops().device_bytes();
            let cache = planned.kv_bytes_per_token * r.max_model_len as f64;
            let rel = |a: usize, b: f64| (a as f64 - b).abs() / b;
            println!(
                "Kimi-K2.5 TP8 rank 0, {} cache: weights {:.3} GiB allocated vs {:.3} GiB \
                 planned ({:.3}%), cache {:.3} vs {:.3} GiB ({:.3}%), workspace {:.3} vs \
                 {:.3} GiB ({:.3}%)",
                kv_dtype.id(),
                got.weights as f64 / GIB,
                planned.weights / GIB,
                100.0 * rel(got.weights, planned.weights),
                got.cache as f64 / GIB,
                cache / GIB,
                100.0 * rel(got.cache, cache),
                got.workspace as f64 / GIB,
                planned.activation_reserve / GIB,
                100.0 * rel(got.workspace, planned.activation_reserve),
            );
            assert!(rel(got.weights, planned.weights) <= 0.01, "weights");
            assert!(rel(got.cache, cache) <= 0.01, "cache");
            assert!(
                rel(got.workspace, planned.activation_reserve) <= 0.01,
                "workspace"
            );
        }
    }

    /// `--gpu-memory-utilization`: on a GPU the latent cache takes what the weights and the
    /// step workspace leave of that share of the device's memory, to the page.
    #[test]
    fn the_cache_fills_the_memory_share_the_weights_and_workspace_leave() {
        use crate::exec::ModelRunner;
        use crate::exec::device::{
            DeviceOptions, DeviceWeights, ExecutorTactics, StepCapacity, runner_with_weights,
        };
        use kernels::arch::Sm;
        use kernels::device::dry::DryDevice;
        use kernels::mla::cache::PAGE_TOKENS;
        let c = Preset::KimiK25.model_config();
        // An RTX PRO 6000's 97,887 MiB.
        let total = 97_887u64 << 20;
        let share = 0.9;
        let shard = TpShard { rank: 0, world: 8 };
        for kv_dtype in [KvCacheDtype::Bf16, KvCacheDtype::Fp8E4m3] {
            let tactics = ExecutorTactics::defaults_for_rank(Sm::Sm120, &c, kv_dtype, 8).unwrap();
            let dev = DryDevice::with_memory(Sm::Sm120, total);
            let weights = DeviceWeights::zeroed(&dev, &c, shard, tactics.moe.as_slice()).unwrap();
            let runner = runner_with_weights(
                dev,
                &c,
                weights,
                DeviceOptions {
                    kv_dtype,
                    cache_tokens: 1,
                    capacity: StepCapacity {
                        tokens: 8192,
                        logit_rows: 256,
                    },
                    tactics,
                    selector: None,
                    fill_memory: Some(share),
                    quiet: true,
                },
            )
            .unwrap();
            let got = runner.ops().device_bytes();
            let held = (got.weights + got.cache + got.workspace) as f64;
            let budget = share * total as f64;
            let page = got.cache as f64 / runner.total_pages() as f64;
            println!(
                "Kimi-K2.5 TP8 rank 0 on 97,887 MiB at 0.9, {} cache: {} tokens ({:.2} GiB), \
                 {:.2} GiB held of {:.2} GiB",
                kv_dtype.id(),
                runner.total_pages() * PAGE_TOKENS,
                got.cache as f64 / GIB,
                held / GIB,
                budget / GIB
            );
            assert!(held <= budget, "{held} > {budget}");
            assert!(
                budget - held < page + (64 << 20) as f64,
                "pages left unused"
            );
        }
    }

    #[test]
    fn kimi_on_eight_rtx_pro_6000_matches_the_deployment() {
        let c = Preset::KimiK25.model_config();
        let bf16 = plan(&c, &request(KvCacheDtype::Bf16, 262_144));
        // vLLM reported 70.81 GiB of weights per GPU at TP8.
        assert!(
            (bf16.weights / GIB - 70.81).abs() < 0.5,
            "{}",
            bf16.weights / GIB
        );
        assert!((bf16.kv_bytes_per_token - 61.0 * 1152.0).abs() < 1.0);
        assert!(
            !bf16.fits,
            "262,144 must not fit with a BF16 cache: {}",
            bf16.max_context_tokens
        );
        assert!(bf16.max_context_tokens >= 131_072);
        let fp8 = plan(&c, &request(KvCacheDtype::Fp8E4m3, 262_144));
        assert!(
            fp8.fits,
            "262,144 must fit with an FP8 cache: {}",
            fp8.max_context_tokens
        );
        assert!(fp8.max_context_tokens as f64 > 1.7 * bf16.max_context_tokens as f64);
    }

    /// Kimi at 4 GPUs of 96 GiB holds ~142 GiB of weights each: no room. The answer is the
    /// first GPU count whose own plan leaves room, and every smaller split leaves none.
    #[test]
    fn the_fewest_gpus_are_the_first_count_whose_plan_fits() {
        let c = Preset::KimiK25.model_config();
        let four = PlanRequest {
            gpus: 4,
            ..request(KvCacheDtype::Bf16, 8192)
        };
        let planned = plan(&c, &four);
        assert!(!planned.weights_fit());
        assert!(planned.weights > planned.usable_for_weights());
        let splits = |g: usize| c.check_tensor_parallel(g).is_ok();
        let n = fewest_gpus_that_fit(&c, &four, 64, splits).expect("some split fits");
        assert!(
            plan(
                &c,
                &PlanRequest {
                    gpus: n,
                    ..four.clone()
                }
            )
            .weights_fit()
        );
        assert!(splits(n));
        for smaller in 4..n {
            assert!(
                !splits(smaller)
                    || !plan(
                        &c,
                        &PlanRequest {
                            gpus: smaller,
                            ..four.clone()
                        }
                    )
                    .weights_fit(),
                "{smaller} GPUs already fit"
            );
        }
        // A GPU too small for any split.
        let tiny = PlanRequest {
            gpu_mem_gib: 1.0,
            ..four
        };
        assert_eq!(fewest_gpus_that_fit(&c, &tiny, 64, splits), None);
    }
}
