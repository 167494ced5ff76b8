//! The kernel tactics a run uses: problem shapes of one decode step on one GPU, derived from the model config under tensor
//! parallelism: what each family is tuned for.
//!
//! Under TP the routed experts are all present on every rank with their intermediate size
//! split (`moe_intermediate_size / tp`); attention heads are split (`heads / tp`) and the
//! latent cache is replicated. With `b` decode tokens routed top-`k` over `E` experts, the
//! expected number of distinct experts hit (uniform routing, the assumption of this model) is
//! `E · (1 − (1 − k/E)^b)`, each with `b·k / active` tokens on average.

use std::path::Path;

use crate::arch::config::ModelConfig;
use kernels::allreduce::tactic::AllReduceTactic;
use kernels::arch::Sm;
use kernels::layers::LayersTactic;
use kernels::mla::MlaSplitTactic;
use kernels::moe_gemm::MoeGemmTactic;
use kernels::tactic::cache::{self, CacheLookup, Expected};
use kernels::tactic::{KernelFamily, ProblemShape};

/// Decode batches the lab tunes for.
pub const BATCHES: [u32; 6] = [1, 4, 8, 16, 32, 64];
/// Cached tokens per request the MLA shapes take.
pub const CONTEXTS: [u32; 3] = [1024, 8192, 65536];

/// Expected distinct experts hit and tokens per hit expert (rounded up) at `batch` tokens.
pub fn expert_load(cfg: &ModelConfig, batch: u32) -> (u32, u32) {
    let e = cfg.n_routed_experts as f64;
    let k = cfg.num_experts_per_tok as f64;
    let active = (e * (1.0 - (1.0 - k / e).powi(batch as i32)))
        .round()
        .clamp(1.0, e);
    let tpe = (batch as f64 * k / active).ceil().max(1.0);
    (active as u32, tpe as u32)
}

/// One named dense product of the decode step, per rank.
#[derive(Clone, Debug, PartialEq)]
pub struct DenseProduct {
    pub name: &'static str,
    pub n: u32,
    pub k: u32,
    /// How many times per layer it runs (per MoE or dense layer as `layers` says).
    pub per_step: u32,
}

/// The BF16 products of one decode step on one rank (attention projections, the shared
/// expert, the router, the dense layer-0 MLP, lm_head), with how often each runs per step.
pub fn dense_products(cfg: &ModelConfig, tp: u32) -> Vec<DenseProduct> {
    let layers = cfg.num_hidden_layers as u32;
    let dense_layers = cfg.first_k_dense_replace.min(cfg.num_hidden_layers) as u32;
    let moe_layers = layers - dense_layers;
    let h = cfg.hidden_size as u32;
    let heads = cfg.num_attention_heads as u32 / tp;
    let q_rank = cfg.q_lora_rank.unwrap_or(cfg.hidden_size) as u32;
    let latent = cfg.kv_lora_rank as u32;
    let rope = cfg.qk_rope_head_dim as u32;
    let nope = cfg.qk_nope_head_dim as u32;
    let v = cfg.v_head_dim as u32;
    let shared = (cfg.moe_intermediate_size * cfg.n_shared_experts) as u32 / tp;
    let dense_inter = cfg.intermediate_size as u32 / tp;
    let mut out = vec![
        // Replicated on every rank (their outputs feed every head).
        DenseProduct {
            name: "q_a_proj",
            n: q_rank,
            k: h,
            per_step: layers,
        },
        DenseProduct {
            name: "kv_a_proj_with_mqa",
            n: latent + rope,
            k: h,
            per_step: layers,
        },
        // Head-sharded.
        DenseProduct {
            name: "q_b_proj",
            n: heads * (nope + rope),
            k: q_rank,
            per_step: layers,
        },
        // Absorbed: q_nope · W_UK and o_lat · W_UVᵀ (kv_b viewed per head).
        DenseProduct {
            name: "kv_b_absorb_k",
            n: heads * latent,
            k: nope,
            per_step: layers,
        },
        DenseProduct {
            name: "kv_b_absorb_v",
            n: heads * v,
            k: latent,
            per_step: layers,
        },
        DenseProduct {
            name: "o_proj",
            n: h,
            k: heads * v,
            per_step: layers,
        },
        DenseProduct {
            name: "router",
            n: cfg.n_routed_experts as u32,
            k: h,
            per_step: moe_layers,
        },
        DenseProduct {
            name: "shared_gate_up",
            n: 2 * shared,
            k: h,
            per_step: moe_layers,
        },
        DenseProduct {
            name: "shared_down",
            n: h,
            k: shared,
            per_step: moe_layers,
        },
        DenseProduct {
            name: "lm_head",
            n: cfg.vocab_size as u32 / tp,
            k: h,
            per_step: 1,
        },
    ];
    if dense_layers > 0 {
        out.push(DenseProduct {
            name: "dense_gate_up",
            n: 2 * dense_inter,
            k: h,
            per_step: dense_layers,
        });
        out.push(DenseProduct {
            name: "dense_down",
            n: h,
            k: dense_inter,
            per_step: dense_layers,
        });
    }
    out
}

/// Every shape of `family` the lab tunes, per rank at `tp`.
pub fn shapes(cfg: &ModelConfig, tp: u32, family: KernelFamily) -> Vec<ProblemShape> {
    let mut out = Vec::new();
    match family {
        KernelFamily::MoeGemm => {
            for b in BATCHES {
                let (active, tpe) = expert_load(cfg, b);
                out.push(ProblemShape::Moe {
                    tokens_per_expert: tpe,
                    active_experts: active,
                    hidden: cfg.hidden_size as u32,
                    inter: cfg.moe_intermediate_size as u32 / tp,
                });
            }
        }
        KernelFamily::MlaDecode => {
            for fp8_cache in [true, false] {
                for b in BATCHES {
                    for c in CONTEXTS {
                        out.push(ProblemShape::mla(
                            b,
                            cfg.num_attention_heads as u32 / tp,
                            c,
                            fp8_cache,
                            cfg.mla_dims(),
                        ));
                    }
                }
            }
        }
        KernelFamily::AllReduce => {
            for b in BATCHES {
                out.push(ProblemShape::AllReduce {
                    elements: u64::from(b) * cfg.hidden_size as u64,
                    dtype: "bf16".into(),
                    ranks: tp,
                });
            }
        }
        KernelFamily::Layers => {
            for b in BATCHES {
                for p in dense_products(cfg, tp) {
                    let s = ProblemShape::Dense {
                        m: b,
                        n: p.n,
                        k: p.k,
                    };
                    if !out.contains(&s) {
                        out.push(s);
                    }
                }
            }
        }
        KernelFamily::Cpu => {}
    }
    out.dedup();
    out
}

/// One run's view of the tactic cache (`--tactics FILE`): the SM its GPU executor targets and
/// the shapes of this run.
pub struct RunShapes {
    pub sm: Sm,
    pub tp: u32,
    /// Decode tokens per step (or prefill tokens for `logits`).
    pub tokens: u32,
    /// Longest context of the run.
    pub context: u32,
    pub fp8_cache: bool,
}

/// Reads the tactic cache at `path` (or none) and says, one line per GPU family, the tactic
/// the GPU executor uses for this run's shapes: the cache's winner, or the heuristic default
/// after a one-line warning when the cache is missing, corrupt or stale. Never fails.
pub fn tactic_lines(path: Option<&Path>, cfg: &ModelConfig, run: &RunShapes) -> Vec<String> {
    let lookup = match path {
        Some(p) => cache::load(p, &Expected::for_sm(run.sm, None)),
        None => CacheLookup::none(),
    };
    let mut lines = Vec::new();
    if let Some(w) = &lookup.warning {
        lines.push(w.clone());
    }
    let tp = run.tp.max(1);
    let (active, tpe) = expert_load(cfg, run.tokens.max(1));
    let moe = ProblemShape::Moe {
        tokens_per_expert: tpe,
        active_experts: active,
        hidden: cfg.hidden_size as u32,
        inter: (cfg.moe_intermediate_size as u32 / tp).max(1),
    };
    let mla = ProblemShape::mla(
        run.tokens.max(1),
        (cfg.num_attention_heads as u32 / tp).max(1),
        run.context.max(1),
        run.fp8_cache,
        cfg.mla_dims(),
    );
    let ar = ProblemShape::AllReduce {
        elements: u64::from(run.tokens.max(1)) * cfg.hidden_size as u64,
        dtype: "bf16".into(),
        ranks: tp,
    };
    let dense = ProblemShape::Dense {
        m: run.tokens.max(1),
        n: cfg.q_lora_rank.unwrap_or(cfg.hidden_size) as u32,
        k: cfg.hidden_size as u32,
    };
    let describe = |line: Option<String>, family: &str, shape: &ProblemShape| {
        line.unwrap_or_else(|| format!("{family}: no tactic serves {}", shape.bucket()))
    };
    lines.push(describe(
        lookup
            .choose::<MoeGemmTactic>(run.sm, &moe)
            .map(|c| c.describe()),
        "moe_gemm",
        &moe,
    ));
    lines.push(describe(
        lookup
            .choose::<MlaSplitTactic>(run.sm, &mla)
            .map(|c| c.describe()),
        "mla",
        &mla,
    ));
    if tp > 1 {
        lines.push(describe(
            lookup
                .choose::<AllReduceTactic>(run.sm, &ar)
                .map(|c| c.describe()),
            "allreduce",
            &ar,
        ));
    }
    lines.push(describe(
        lookup
            .choose::<LayersTactic>(run.sm, &dense)
            .map(|c| c.describe()),
        "layers",
        &dense,
    ));
    lines
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::presets::Preset;

    #[test]
    fn kimi_decode_shapes_under_tp8() {
        let cfg = Preset::KimiK25.model_config();
        // Batch 1: 8 experts with one token each.
        assert_eq!(expert_load(&cfg, 1), (8, 1));
        // Batch 64: most experts hit, about two tokens each.
        let (active, tpe) = expert_load(&cfg, 64);
        assert!(active > 250 && active < 384 && tpe == 2, "{active} {tpe}");
        let moe = shapes(&cfg, 8, KernelFamily::MoeGemm);
        assert_eq!(moe.len(), BATCHES.len());
        assert!(moe.iter().all(|s| matches!(
            s,
            ProblemShape::Moe {
                inter: 256,
                hidden: 7168,
                ..
            }
        )));
        let ar = shapes(&cfg, 8, KernelFamily::AllReduce);
        assert!(ar.contains(&ProblemShape::AllReduce {
            elements: 7168,
            dtype: "bf16".into(),
            ranks: 8
        }));
        let mla = shapes(&cfg, 8, KernelFamily::MlaDecode);
        assert!(
            mla.iter()
                .all(|s| matches!(s, ProblemShape::Mla { heads: 8, .. }))
        );
        let dense = dense_products(&cfg, 8);
        let lm = dense.iter().find(|p| p.name == "lm_head").unwrap();
        assert_eq!((lm.n, lm.k), (20480, 7168));
    }
}

/// The tuning lab's cache as a run reads it (`--tactics FILE`): each family's tactic for the
/// run's device and shapes.
#[derive(Clone, Debug, Default)]
pub struct RunnerTactics {
    path: Option<std::path::PathBuf>,
    quiet: bool,
}

impl RunnerTactics {
    pub fn load(path: Option<&Path>, quiet: bool) -> Self {
        Self {
            path: path.map(Path::to_path_buf),
            quiet,
        }
    }

    /// The device executor's tactics on `sm` for a rank of `world`: the cache's winners where
    /// it has them, each family's heuristic default elsewhere; logged with where each came
    /// from.
    pub fn executor(
        &self,
        sm: Sm,
        config: &ModelConfig,
        kv_dtype: kernels::mla::cache::KvCacheDtype,
        world: usize,
    ) -> Result<crate::exec::device::ExecutorTactics, crate::exec::ExecError> {
        let (tactics, source) = crate::exec::device::decode_tactics(
            self.path.as_deref(),
            sm,
            config,
            world,
            1,
            4096,
            kv_dtype,
        )?;
        if !self.quiet && self.path.is_some() {
            eprintln!("tactics: {source}");
        }
        Ok(tactics)
    }
}
