//! The kernel tactics a run uses: problem shapes of one decode step on one GPU, derived from the model config under tensor
//! parallelism: what each family is tuned for.
//!
//! Under TP the routed experts are all present on every rank with their intermediate size
//! split (`moe_intermediate_size / tp`); attention heads are split (`heads / tp`) and the
//! latent cache is replicated. With `b` decode tokens routed top-`k` over `E` experts, the
//! expected number of distinct experts hit (uniform routing, the assumption of this model) is
//! `E · (1 − (1 − k/E)^b)`, each with `b·k / active` tokens on average.

use std::path::Path;

use kernels::allreduce::tactic::AllReduceTactic;
use kernels::arch::Sm;
use kernels::blas::DenseTactic;
use kernels::files::{TEXT_FILE_LIMIT, read_text_bounded};
use kernels::layers::LayersTactic;
use kernels::mla::MlaSplitTactic;
use kernels::mla::cache::KvCacheDtype;
use kernels::moe_gemm::MoeGemmTactic;
use kernels::tactic::cache::{
    self, CPU_TARGET, CacheLookup, Chosen, Expected, TacticCache, TunedModel,
};
use kernels::tactic::{KernelFamily, ProblemShape, Tactic};

use crate::arch::config::ModelConfig;
use crate::arch::names;
use crate::arch::presets::Preset;
use crate::exec::device::support::{ExecutorTactics, device_expert_inter};
use crate::exec::error::ExecError;
use crate::input::InvalidInput;

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
            name: names::Q_A_PROJ,
            n: q_rank,
            k: h,
            per_step: layers,
        },
        DenseProduct {
            name: names::KV_A_PROJ_WITH_MQA,
            n: latent + rope,
            k: h,
            per_step: layers,
        },
        // Head-sharded.
        DenseProduct {
            name: names::Q_B_PROJ,
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
            name: names::O_PROJ,
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
            name: names::LM_HEAD,
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

/// The record a tactic cache keeps of the model `cfg` it is tuned for, named `name`: the
/// dimensions every family's shapes (and the CPU decode step) derive from.
pub fn tuned_model(name: &str, cfg: &ModelConfig) -> TunedModel {
    let dims = [
        ("vocab_size", cfg.vocab_size),
        ("hidden_size", cfg.hidden_size),
        ("intermediate_size", cfg.intermediate_size),
        ("moe_intermediate_size", cfg.moe_intermediate_size),
        ("num_hidden_layers", cfg.num_hidden_layers),
        ("num_attention_heads", cfg.num_attention_heads),
        ("n_routed_experts", cfg.n_routed_experts),
        ("n_shared_experts", cfg.n_shared_experts),
        ("num_experts_per_tok", cfg.num_experts_per_tok),
        ("first_k_dense_replace", cfg.first_k_dense_replace),
        // 0: queries from a plain `q_proj`.
        ("q_lora_rank", cfg.q_lora_rank.unwrap_or(0)),
        ("kv_lora_rank", cfg.kv_lora_rank),
        ("qk_nope_head_dim", cfg.qk_nope_head_dim),
        ("qk_rope_head_dim", cfg.qk_rope_head_dim),
        ("v_head_dim", cfg.v_head_dim),
    ];
    TunedModel {
        name: name.to_string(),
        dims: dims
            .into_iter()
            .map(|(k, v)| (k.to_string(), v as u64))
            .collect(),
    }
}

/// The preset whose dimensions `cfg` has, if any: a model's name where its checkpoint's folder
/// is not at hand (or is a cache folder with a version or checksum in its name).
pub fn preset_named(cfg: &ModelConfig) -> Option<Preset> {
    let dims = tuned_model("", cfg).dims;
    <Preset as clap::ValueEnum>::value_variants()
        .iter()
        .copied()
        .find(|p| tuned_model("", &p.model_config()).dims == dims)
}

/// The name a cache records for the model of `cfg` read from `folder` (or a preset): the
/// preset's id where the dimensions are a preset's, else the folder's name.
pub fn model_record_name(cfg: &ModelConfig, folder: Option<&Path>) -> String {
    match (preset_named(cfg), folder.and_then(Path::file_name)) {
        (Some(p), _) => p.id().to_string(),
        (None, Some(name)) => name.to_string_lossy().into_owned(),
        (None, None) => "unnamed".to_string(),
    }
}

/// The cache at `path` as written, fresh or not; `None` where it cannot be read or parsed (its
/// loader says why).
fn parsed_cache(path: &Path) -> Option<TacticCache> {
    let text = read_text_bounded(path, TEXT_FILE_LIMIT).ok()?;
    TacticCache::from_json(&text).ok()
}

/// Refuses a run of the model `cfg` given the tactic cache at `path` when the cache records
/// another model: its entries would be taken, nearest shape first, for this model's shapes
/// (the CPU decode entry of any model, the GPU families' wherever the fixed dimensions agree).
/// A cache that cannot be read, or records no model, passes: its loader warns and the run
/// uses the defaults.
pub fn check_cache_model(path: Option<&Path>, cfg: &ModelConfig) -> Result<(), InvalidInput> {
    match path.and_then(|p| Some((p, parsed_cache(p)?))) {
        Some((path, cache)) => model_matches(path, &cache, cfg),
        None => Ok(()),
    }
}

/// [`check_cache_model`] of a cache already read from `path`.
fn model_matches(path: &Path, cache: &TacticCache, cfg: &ModelConfig) -> Result<(), InvalidInput> {
    let Some(tuned) = &cache.provenance.model else {
        return Ok(());
    };
    let run = tuned_model("", cfg);
    match tuned.differences(&run) {
        None => Ok(()),
        Some(differences) => Err(InvalidInput(format!(
            "--tactics {}: tuned for model {} but this run's model is {} (dimensions differ, \
             the cache's→this run's: {differences}); \
             tune this model into a cache of its own (`autotune --cpu --checkpoint DIR --out \
             FILE` for the CPU, `autotune --sm 120 --checkpoint DIR --out FILE` for a GPU) or \
             leave out --tactics",
            path.display(),
            tuned.name,
            match preset_named(cfg) {
                Some(p) => p.id().to_string(),
                None => format!(
                    "the checkpoint's ({} layers, hidden {}, {} experts top-{})",
                    cfg.num_hidden_layers,
                    cfg.hidden_size,
                    cfg.n_routed_experts,
                    cfg.num_experts_per_tok
                ),
            },
        ))),
    }
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
/// after a one-line warning when the cache is missing, corrupt or stale. Never fails. No lines
/// for a cache of the CPU kernels (it has no GPU families: the CPU backend logs its tactic) or
/// of another model (the run refuses it: [`check_cache_model`]).
pub fn tactic_lines(path: Option<&Path>, cfg: &ModelConfig, run: &RunShapes) -> Vec<String> {
    // Read once for both questions; the loader below reads it again to say why it is stale.
    if let Some((p, cache)) = path.and_then(|p| Some((p, parsed_cache(p)?)))
        && (cache.provenance.sm == CPU_TARGET || model_matches(p, &cache, cfg).is_err())
    {
        return Vec::new();
    }
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
    fn describe<T: Tactic>(
        lookup: &CacheLookup,
        sm: Sm,
        family: &str,
        shape: &ProblemShape,
    ) -> String {
        lookup.choose::<T>(sm, shape).map_or_else(
            || format!("{family}: no tactic serves {}", shape.bucket()),
            |c| c.describe(),
        )
    }
    lines.push(describe::<MoeGemmTactic>(&lookup, run.sm, "moe_gemm", &moe));
    lines.push(describe::<MlaSplitTactic>(&lookup, run.sm, "mla", &mla));
    if tp > 1 {
        lines.push(describe::<AllReduceTactic>(
            &lookup,
            run.sm,
            "allreduce",
            &ar,
        ));
    }
    lines.push(describe::<LayersTactic>(&lookup, run.sm, "layers", &dense));
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
        let lm = dense.iter().find(|p| p.name == names::LM_HEAD).unwrap();
        assert_eq!((lm.n, lm.k), (20480, 7168));
    }
}

/// The device families' tactics for one step: what the selector chose, and from where.
#[derive(Clone, Debug)]
pub struct StepSelection {
    pub moe: Option<Chosen<MoeGemmTactic>>,
    pub mla: Chosen<MlaSplitTactic>,
    pub dense: DenseTactic,
}

impl StepSelection {
    /// The executor's tactics of this selection.
    pub fn executor(&self) -> ExecutorTactics {
        ExecutorTactics {
            moe: self.moe.as_ref().map(|c| c.tactic),
            mla: self.mla.tactic.kernel,
            dense: self.dense,
        }
    }

    /// One line per family: the tactic and its bucket (or that it is the default).
    pub fn describe(&self) -> Vec<String> {
        let mut lines = vec![self.mla.describe()];
        if let Some(moe) = &self.moe {
            lines.insert(0, moe.describe());
        }
        lines.push(format!("dense: {}", self.dense));
        lines
    }
}

/// The one selection of the device families' tactics for a step's shape, which the device
/// runner makes for every step, `model launch-list` for the step it records and `autotune
/// step-time` for the steps it prices: from the tuning lab's cache (`--tactics FILE`), the
/// winner of the bucket nearest the step's batch and context; each family's heuristic default
/// where the cache has none. Or fixed tactics, for a run that names them.
#[derive(Clone, Debug)]
pub struct TacticSelector {
    sm: Sm,
    config: ModelConfig,
    /// Tensor-parallel ranks: a rank's heads and expert columns.
    world: usize,
    fp8_cache: bool,
    dense: DenseTactic,
    source: Source,
}

#[derive(Clone, Debug)]
enum Source {
    Cache(Box<CacheLookup>),
    Fixed(ExecutorTactics),
}

impl TacticSelector {
    /// The selector of a run on `sm` for a rank of `world`, from the cache at `path` (or the
    /// defaults); a missing, corrupt or stale cache gives one warning line, returned.
    pub fn from_cache(
        path: Option<&Path>,
        sm: Sm,
        config: &ModelConfig,
        kv_dtype: KvCacheDtype,
        world: usize,
        dense: DenseTactic,
    ) -> (Self, Option<String>) {
        let lookup = match path {
            Some(p) => cache::load(p, &Expected::for_sm(sm, None)),
            None => CacheLookup::none(),
        };
        let warning = lookup.warning.clone();
        (
            Self::from_lookup(lookup, sm, config, kv_dtype, world, dense),
            warning,
        )
    }

    /// The selector over a cache already read.
    pub fn from_lookup(
        lookup: CacheLookup,
        sm: Sm,
        config: &ModelConfig,
        kv_dtype: KvCacheDtype,
        world: usize,
        dense: DenseTactic,
    ) -> Self {
        Self {
            sm,
            config: config.clone(),
            world: world.max(1),
            fp8_cache: kv_dtype == KvCacheDtype::Fp8E4m3,
            dense,
            source: Source::Cache(Box::new(lookup)),
        }
    }

    /// Always `tactics`.
    pub fn fixed(
        sm: Sm,
        config: &ModelConfig,
        kv_dtype: KvCacheDtype,
        world: usize,
        tactics: ExecutorTactics,
    ) -> Self {
        Self {
            sm,
            config: config.clone(),
            world: world.max(1),
            fp8_cache: kv_dtype == KvCacheDtype::Fp8E4m3,
            dense: tactics.dense,
            source: Source::Fixed(tactics),
        }
    }

    pub fn sm(&self) -> Sm {
        self.sm
    }

    /// The tactics for a step of `batch` rows whose longest sequence attends over `context`
    /// tokens.
    pub fn select(&self, batch: usize, context: usize) -> Result<StepSelection, ExecError> {
        let c = &self.config;
        let (sm, world) = (self.sm, self.world);
        let mla_shape = ProblemShape::mla(
            batch.max(1) as u32,
            (c.num_attention_heads / world) as u32,
            context.max(1) as u32,
            self.fp8_cache,
            c.mla_dims(),
        );
        let (active, tokens_per_expert) = expert_load(c, batch.max(1) as u32);
        let moe_shape = ProblemShape::Moe {
            tokens_per_expert,
            active_experts: active,
            hidden: c.hidden_size as u32,
            inter: device_expert_inter(c, world) as u32,
        };
        let unsupported = |why: String| ExecError::Unsupported {
            backend: "device",
            why,
        };
        let (moe, mla) = match &self.source {
            Source::Fixed(t) => (
                t.moe.map(|tactic| Chosen {
                    tactic,
                    figure: None,
                    bucket: None,
                }),
                Chosen {
                    tactic: MlaSplitTactic {
                        kernel: t.mla,
                        splits: 0,
                    },
                    figure: None,
                    bucket: None,
                },
            ),
            Source::Cache(lookup) => {
                let defaults = ExecutorTactics::defaults_for_rank(
                    sm,
                    c,
                    if self.fp8_cache {
                        KvCacheDtype::Fp8E4m3
                    } else {
                        KvCacheDtype::Bf16
                    },
                    world,
                )?;
                let moe = (c.n_routed_experts > 0).then(|| {
                    lookup
                        .choose::<MoeGemmTactic>(sm, &moe_shape)
                        .unwrap_or(Chosen {
                            tactic: defaults.moe.expect("a MoE model has a default"),
                            figure: None,
                            bucket: None,
                        })
                });
                let mla = lookup
                    .choose::<MlaSplitTactic>(sm, &mla_shape)
                    .filter(|m| m.tactic.kernel.dims == c.mla_dims())
                    .ok_or_else(|| {
                        unsupported(format!(
                            "no MLA decode tactic for {sm} serves {mla_shape:?}"
                        ))
                    })?;
                (moe, mla)
            }
        };
        Ok(StepSelection {
            moe,
            mla,
            dense: self.dense,
        })
    }

    /// Every selection a run of up to `max_batch` rows and `max_context` tokens can make: the
    /// lab's batch and context buckets within those bounds, and the bounds themselves. The
    /// kernels of each are loaded, and the experts' scales uploaded in each layout, before
    /// the first step.
    pub fn candidates(
        &self,
        max_batch: usize,
        max_context: usize,
    ) -> Result<Vec<StepSelection>, ExecError> {
        let mut batches: Vec<usize> = BATCHES
            .iter()
            .map(|&b| b as usize)
            .filter(|&b| b <= max_batch)
            .chain([1, max_batch.max(1)])
            .collect();
        batches.sort_unstable();
        batches.dedup();
        let mut contexts: Vec<usize> = CONTEXTS
            .iter()
            .map(|&c| c as usize)
            .filter(|&c| c <= max_context)
            .chain([1, max_context.max(1)])
            .collect();
        contexts.sort_unstable();
        contexts.dedup();
        let mut out = Vec::new();
        for &b in &batches {
            for &c in &contexts {
                out.push(self.select(b, c)?);
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod model_record_tests {
    use super::*;

    /// A preset's dimensions name it, whatever folder it was read from; another model is named
    /// by its folder; models of the same widths but other depths are different models.
    #[test]
    fn records_name_presets_by_id_and_other_models_by_folder() {
        let mini = Preset::Mini.model_config();
        assert_eq!(preset_named(&mini), Some(Preset::Mini));
        assert_eq!(
            model_record_name(&mini, Some(Path::new("/somewhere/mini-0.1.0"))),
            "mini"
        );
        let mut other = mini.clone();
        other.hidden_size = 512;
        assert_eq!(preset_named(&other), None);
        assert_eq!(
            model_record_name(&other, Some(Path::new("/somewhere/my-model"))),
            "my-model"
        );
        let deep = tuned_model("mini-deep", &Preset::MiniDeep.model_config());
        let differences = tuned_model("mini", &mini).differences(&deep).unwrap();
        assert_eq!(differences, "num_hidden_layers 6→61");
    }
}

#[cfg(test)]
mod selector_tests {
    use super::*;
    use crate::arch::presets::Preset;

    /// Without a cache every shape gets the defaults; a fixed selector gives its tactics
    /// whatever the shape; candidates cover one batch and context bucket at least.
    #[test]
    fn the_selector_falls_back_to_the_defaults_and_keeps_fixed_tactics() {
        let c = Preset::KimiK25.model_config();
        let kv = KvCacheDtype::Fp8E4m3;
        let (selector, warning) =
            TacticSelector::from_cache(None, Sm::Sm120, &c, kv, 8, DenseTactic::Ours);
        assert!(warning.is_none());
        let defaults = ExecutorTactics::defaults_for_rank(Sm::Sm120, &c, kv, 8).unwrap();
        for (batch, context) in [(1, 4096), (64, 100_000)] {
            let s = selector.select(batch, context).unwrap();
            assert_eq!(s.executor().moe, defaults.moe);
            assert!(s.mla.figure.is_none() && s.mla.tactic.kernel.kind.is_fp8());
        }
        let fixed = TacticSelector::fixed(Sm::Sm120, &c, kv, 8, defaults.clone());
        assert_eq!(fixed.select(7, 123).unwrap().executor(), defaults);
        let candidates = selector.candidates(64, 65_536).unwrap();
        assert!(candidates.len() >= BATCHES.len() * CONTEXTS.len());
    }
}
