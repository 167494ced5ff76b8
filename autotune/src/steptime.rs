//! The step-time model: predicted decode tok/s of the model on `tp` RTX PRO 6000s over PCIe.
//!
//! The launch list of one decode step is the device executor's own, recorded for rank 0 of the
//! TP group on a dry device (`model::exec::device::DryStep`: zeroed weights of the rank's shapes,
//! no kernel runs), with the MoE and MLA tactics chosen here: per layer the norms, the
//! attention products, RoPE and the cache append, MLA decode + combine, the MoE (router,
//! grouping, `moe_gate_up` + `moe_down`, the shared expert) or the dense MLP, and two
//! all-reduces; then the final norm, lm_head and argmax. Each launch is priced by the cost
//! model: the MoE and MLA pairs for the tactic chosen — the heuristic default, or the tactic
//! cache's winner — the dense products by the `m, n, k` their launcher names, the all-reduces
//! by the all-reduce cost model for its tactic, every other launch by its recorded bytes at the
//! streaming bandwidth plus a launch. Every time is predicted; none is measured. The cost
//! model's parameters are its assumed ones, or those a device run of the same SM fitted
//! (`--cost-model FILE`, the sidecar `autotune --timing measure` writes beside its cache).
//!
//! Two memory rooflines bound each batch: the config's minimum bytes (every weight and the
//! latent cache read once) and the recorded launch list's bytes (what the launchers say their
//! launches read and write), both at the data-sheet bandwidth.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, Result};
use kernels::allreduce::cost::LinkParams;
use kernels::allreduce::tactic::AllReduceTactic;
use kernels::arch::{GpuSpec, Sm};
use kernels::mla::cache::KvCacheDtype;
use kernels::moe_gemm::launch::MoeGroupingBounds;
use kernels::tactic::cache::{CacheLookup, Expected, load};
use kernels::tactic::{KernelFamily, ProblemShape};
use model::arch::config::ModelConfig;
use model::arch::shard::TpShard;
use model::exec::device::DryStep;
use model::exec::tactics::TacticSelector;
use serde_json::json;

use crate::cost::{self, CostParams, Model};
use crate::manifest::Manifest;
use crate::shapes::{dense_products, expert_load};

/// Batches of the report.
pub const REPORT_BATCHES: [u32; 3] = [1, 8, 32];
/// Cached tokens per request the MLA launches read (an assumption of the report).
pub const CONTEXT: u32 = 4096;
/// vLLM on 8× RTX PRO 6000 in the seeds (facts sheet): the first request (107 tokens in 6.7 s)
/// and steady state; measured by others, not by this project.
pub const VLLM_FIRST_TOK_S: f64 = 16.0;
pub const VLLM_STEADY_TOK_S: f64 = 60.0;

/// One predicted decode step at one batch.
#[derive(Clone, Debug)]
pub struct Step {
    pub batch: u32,
    /// µs per family: moe_gemm, mla, allreduce, dense (BF16 products), small (norms, RoPE,
    /// routing, SiLU, argmax).
    pub by_family: BTreeMap<&'static str, f64>,
    pub launches: u32,
    pub total_us: f64,
    /// DRAM bytes a step must read at least (weights once, the latent cache once).
    pub min_bytes: f64,
    /// Bytes the recorded launches read and write, by the launchers' counts.
    pub launch_bytes: f64,
    /// The MoE and MLA tactics used (batch-dependent).
    pub tactics: Vec<String>,
}

impl Step {
    pub fn tok_s(&self) -> f64 {
        f64::from(self.batch) / (self.total_us * 1e-6)
    }
    pub fn allreduce_share(&self) -> f64 {
        self.by_family.get("allreduce").copied().unwrap_or(0.0) / self.total_us
    }
    /// tok/s if the step only streamed its minimum bytes at the data-sheet bandwidth.
    pub fn roofline_tok_s(&self, gpu: &GpuSpec) -> f64 {
        f64::from(self.batch) / (self.min_bytes / (gpu.mem_bandwidth_gbs * 1e9))
    }
    /// tok/s if the step only streamed its recorded launches' bytes at that bandwidth.
    pub fn launch_roofline_tok_s(&self, gpu: &GpuSpec) -> f64 {
        f64::from(self.batch) / (self.launch_bytes / (gpu.mem_bandwidth_gbs * 1e9))
    }
}

struct Ctx<'a> {
    cfg: &'a ModelConfig,
    tp: u32,
    sm: Sm,
    model: Model<'a>,
    manifest: &'a Manifest,
    lookup: &'a CacheLookup,
    ar_host: kernels::allreduce::cost::Host,
    ar_params: LinkParams,
}

/// One decode step at `batch` (every request at [`CONTEXT`] cached tokens): the launch list
/// the executor records for rank 0 on a dry device with the tactics chosen here, each launch
/// priced by the cost model.
fn step(c: &Ctx<'_>, batch: u32) -> Result<Step> {
    let cfg = c.cfg;
    let tp = c.tp;
    let layers = cfg.num_hidden_layers as u32;
    let dense_layers = cfg.first_k_dense_replace.min(cfg.num_hidden_layers) as u32;
    let moe_layers = layers - dense_layers;
    let h = cfg.hidden_size as f64;
    let b = f64::from(batch);
    let mut by: BTreeMap<&'static str, f64> = BTreeMap::new();
    let mut min_bytes = 0.0;
    // Weights once: every BF16 product's matrix.
    for p in dense_products(cfg, tp) {
        min_bytes += f64::from(p.n) * f64::from(p.k) * 2.0 * f64::from(p.per_step);
    }
    // MoE.
    let (active, tpe) = expert_load(cfg, batch);
    let moe_shape = ProblemShape::Moe {
        tokens_per_expert: tpe,
        active_experts: active,
        hidden: cfg.hidden_size as u32,
        inter: cfg.moe_intermediate_size as u32 / tp,
    };
    // The tactics a run selects for this step (the runner's and the launch list's selection).
    let selector = TacticSelector::from_lookup(
        c.lookup.clone(),
        c.sm,
        cfg,
        KvCacheDtype::Fp8E4m3,
        tp as usize,
        kernels::blas::DenseTactic::default(),
    );
    let selection = selector
        .select(batch as usize, CONTEXT as usize)
        .map_err(|e| anyhow::anyhow!("selecting the step's tactics: {e}"))?;
    let moe_t = selection
        .moe
        .clone()
        .context("no MoE tactic serves the shape")?;
    let image = c
        .manifest
        .image(KernelFamily::MoeGemm, c.sm, &moe_t.tactic.id());
    let moe_pair = c
        .model
        .moe(
            &moe_t.tactic,
            image,
            &moe_shape,
            &MoeGroupingBounds::for_tokens(
                batch as usize,
                cfg.num_experts_per_tok,
                cfg.n_routed_experts,
            ),
        )
        .context("MoE prediction")?;
    min_bytes += f64::from(active)
        * 3.0
        * h
        * (cfg.moe_intermediate_size as f64 / f64::from(tp))
        * (0.5 + 1.0 / 16.0)
        * f64::from(moe_layers);
    // MLA.
    let mla_shape = ProblemShape::mla(
        batch,
        cfg.num_attention_heads as u32 / tp,
        CONTEXT,
        true,
        cfg.mla_dims(),
    );
    let mla_t = selection.mla.clone();
    let image = c
        .manifest
        .image(KernelFamily::MlaDecode, c.sm, &mla_t.tactic.kernel.id());
    let mla_pair = c
        .model
        .mla(&mla_t.tactic, image, &mla_shape)
        .context("MLA prediction")?;
    min_bytes += b * f64::from(CONTEXT) * 644.0 * f64::from(layers);
    // All-reduces.
    let ar_shape = ProblemShape::AllReduce {
        elements: u64::from(batch) * cfg.hidden_size as u64,
        dtype: "bf16".into(),
        ranks: tp,
    };
    let ar_t = c
        .lookup
        .choose::<AllReduceTactic>(c.sm, &ar_shape)
        .context("no all-reduce tactic serves the shape")?;
    let ar =
        cost::allreduce(&c.ar_host, &c.ar_params, &ar_t.tactic, &ar_shape).context("all-reduce")?;

    let recorded = DryStep {
        model: "step-time".into(),
        config: cfg.clone(),
        sm: c.sm,
        shard: TpShard {
            rank: 0,
            world: tp as usize,
        },
        batch: batch as usize,
        context: CONTEXT as usize,
        kv_dtype: KvCacheDtype::Fp8E4m3,
        selector,
        tactics_source: "step-time".into(),
    }
    .record()
    .map_err(|e| anyhow::anyhow!("recording the decode step on a dry device: {e}"))?;
    for l in recorded.launches() {
        let (family, us) = match (l.kernel.as_str(), &l.problem) {
            // The cost model prices each pair as one: gate/up with down, decode with combine.
            ("moe_gate_up", _) => ("moe_gemm", moe_pair.us),
            ("moe_down", _) => ("moe_gemm", 0.0),
            ("mla_decode", _) => ("mla", mla_pair.us),
            ("mla_combine", _) => ("mla", 0.0),
            ("allreduce", _) => ("allreduce", ar.us),
            (_, Some(dense @ ProblemShape::Dense { .. })) => (
                "dense",
                c.model.dense(dense).context("dense prediction")?.us,
            ),
            _ => (
                "small",
                cost_small(c, (l.traffic.read + l.traffic.written) as f64),
            ),
        };
        *by.entry(family).or_default() += us;
    }
    let total_us = by.values().sum();
    Ok(Step {
        batch,
        by_family: by,
        launches: recorded.launches().len() as u32,
        total_us,
        min_bytes,
        launch_bytes: (recorded.read() + recorded.written()) as f64,
        tactics: vec![moe_t.describe(), mla_t.describe(), ar_t.describe()],
    })
}

/// A memory-bound small kernel: its bytes at the streaming bandwidth plus one launch.
fn cost_small(c: &Ctx<'_>, bytes: f64) -> f64 {
    let bw = c.model.gpu.mem_bandwidth_gbs * 1e9 * c.model.params.stream_efficiency;
    bytes / bw * 1e6 + c.model.params.launch_us
}

/// The cost model's parameters the report prices with: the assumed ones, or a device run's
/// fit of the same SM.
#[derive(Clone, Debug)]
pub struct Pricing {
    pub params: CostParams,
    pub links: LinkParams,
    /// `assumed`, or where the fit came from.
    pub source: String,
}

impl Pricing {
    pub fn assumed(sm: Sm) -> Self {
        Pricing {
            params: CostParams::for_gpu(sm.reference_gpu()),
            links: LinkParams::default(),
            source: "assumed parameters (no device fit)".into(),
        }
    }

    /// The fit in the sidecar at `path` when it was made on `sm`; else the assumed parameters,
    /// with a one-line warning saying why.
    pub fn load(path: &Path, sm: Sm) -> (Self, Option<String>) {
        let warn = |why: String| {
            (
                Self::assumed(sm),
                Some(format!(
                    "warning: cost model {}: {why}; using the assumed parameters",
                    path.display()
                )),
            )
        };
        let file = match kernels::files::read_text_bounded(path, kernels::files::TEXT_FILE_LIMIT)
            .map_err(|e| e.to_string())
            .and_then(|t| crate::refit::CostModelFile::from_json(&t))
        {
            Ok(f) => f,
            Err(e) => return warn(e),
        };
        if file.sm != sm.arch() {
            return warn(format!(
                "fitted on {} ({}), the step-time model prices {sm}",
                file.sm, file.measured_on
            ));
        }
        let mut p = Self::assumed(sm);
        if let Some(k) = &file.kernels {
            p.params = k.params.clone();
        }
        p.links = file.link_params();
        p.source = format!(
            "fitted to measurements on {} (kernels: {}; all-reduce overheads: {})",
            file.measured_on,
            file.kernels
                .as_ref()
                .map_or("assumed".to_string(), |k| format!(
                    "{} points, rms {:.3}",
                    k.points, k.rms_relative_residual
                )),
            file.allreduce
                .as_ref()
                .map_or("assumed".to_string(), |a| format!("{} points", a.points))
        );
        (p, None)
    }
}

/// The report at [`REPORT_BATCHES`] with the heuristic defaults, and with the tactic cache's
/// winners when one is given.
pub fn steps(
    cfg: &ModelConfig,
    tp: u32,
    manifest: &Manifest,
    lookup: &CacheLookup,
    pricing: &Pricing,
) -> Result<Vec<Step>> {
    let sm = Sm::Sm120;
    let ctx = Ctx {
        cfg,
        tp,
        sm,
        model: Model::with_params(sm.reference_gpu(), pricing.params.clone()),
        manifest,
        lookup,
        ar_host: cost::allreduce_host(tp),
        ar_params: pricing.links.clone(),
    };
    REPORT_BATCHES.iter().map(|&b| step(&ctx, b)).collect()
}

fn table(title: &str, steps: &[Step], gpu: &GpuSpec) -> String {
    let mut s = format!("{title}\n");
    let _ = writeln!(
        s,
        "{:>5} {:>9} {:>9} {:>9} {:>9} {:>9} {:>10} {:>8} {:>9} {:>7} {:>14} {:>14}",
        "batch",
        "moe µs",
        "mla µs",
        "ar µs",
        "dense µs",
        "small µs",
        "step µs",
        "launches",
        "tok/s",
        "ar %",
        "roofline:min",
        "roofline:list"
    );
    for st in steps {
        let f = |k: &str| st.by_family.get(k).copied().unwrap_or(0.0);
        let _ = writeln!(
            s,
            "{:>5} {:>9.0} {:>9.0} {:>9.0} {:>9.0} {:>9.0} {:>10.0} {:>8} {:>9.1} {:>6.1}% {:>14.1} {:>14.1}",
            st.batch,
            f("moe_gemm"),
            f("mla"),
            f("allreduce"),
            f("dense"),
            f("small"),
            st.total_us,
            st.launches,
            st.tok_s(),
            100.0 * st.allreduce_share(),
            st.roofline_tok_s(gpu),
            st.launch_roofline_tok_s(gpu)
        );
    }
    for st in steps {
        let _ = writeln!(
            s,
            "  batch {}: {:.2} GB minimum (config), {:.2} GB by the launch list; {}",
            st.batch,
            st.min_bytes / 1e9,
            st.launch_bytes / 1e9,
            st.tactics.join("; ")
        );
    }
    s
}

/// Computes the report, writes `step-time.txt`, `step-time.json` and `step-time.svg` into
/// `out_dir` when there is one (else nothing), and returns the text.
pub fn write_report(
    cfg: &ModelConfig,
    model_name: &str,
    tp: u32,
    out_dir: Option<&Path>,
    manifest_path: &Path,
    tactics: Option<&Path>,
    cost_model: Option<&Path>,
) -> Result<String> {
    let manifest = Manifest::load(manifest_path)?;
    let gpu = Sm::Sm120.reference_gpu();
    let pricing = match cost_model {
        Some(p) => {
            let (pricing, warning) = Pricing::load(p, Sm::Sm120);
            if let Some(w) = warning {
                eprintln!("{w}");
            }
            pricing
        }
        None => Pricing::assumed(Sm::Sm120),
    };
    let defaults = steps(cfg, tp, &manifest, &CacheLookup::none(), &pricing)?;
    let tuned = match tactics {
        Some(p) => {
            let lookup = load(p, &Expected::for_sm(Sm::Sm120, None));
            if let Some(w) = &lookup.warning {
                eprintln!("{w}");
            }
            lookup
                .cache
                .is_some()
                .then(|| steps(cfg, tp, &manifest, &lookup, &pricing))
                .transpose()?
        }
        None => None,
    };
    let mut text = format!(
        "# PREDICTED decode step time: {model_name} on {tp}x {} over PCIe (TP{tp}), every request \
         at {CONTEXT} cached tokens (FP8 latent cache)\n\
         # Launch list RECORDED from the device executor (rank 0, on a dry device: no kernel ran); \
         per-launch times from autotune's cost model ({}), all-reduces from \
         kernels::allreduce::cost (two-sockets-4x4 host). Nothing here is measured.\n\
         # roofline:min  = tok/s if the step only streamed the config's minimum DRAM bytes \
         (weights once, the latent cache once) at {:.0} GB/s;\n\
         # roofline:list = tok/s if it only streamed the bytes its recorded launches read and \
         write (the launchers' counts) at that bandwidth.\n\
         # vLLM in the seeds (measured by others): ~{VLLM_FIRST_TOK_S:.0} tok/s first request, \
         ~{VLLM_STEADY_TOK_S:.0} steady state.\n\n",
        gpu.name, pricing.source, gpu.mem_bandwidth_gbs
    );
    text += &table("heuristic default tactics (predicted)", &defaults, gpu);
    if let Some(t) = &tuned {
        text += "\n";
        text += &table("tactic cache winners (predicted)", t, gpu);
    }
    let Some(out_dir) = out_dir else {
        return Ok(text);
    };
    std::fs::create_dir_all(out_dir)?;
    std::fs::write(out_dir.join("step-time.txt"), &text)?;
    let rows = |steps: &[Step]| -> Vec<serde_json::Value> {
        steps
            .iter()
            .map(|s| {
                json!({
                    "batch": s.batch,
                    "us_by_family": s.by_family,
                    "step_us": s.total_us,
                    "launches": s.launches,
                    "tok_s": s.tok_s(),
                    "allreduce_share": s.allreduce_share(),
                    "roofline_tok_s": s.roofline_tok_s(gpu),
                    "roofline_launch_list_tok_s": s.launch_roofline_tok_s(gpu),
                    "min_bytes": s.min_bytes,
                    "launch_list_bytes": s.launch_bytes,
                    "tactics": s.tactics,
                })
            })
            .collect()
    };
    let doc = json!({
        "source": "predicted",
        "model": model_name,
        "tp": tp,
        "gpu": gpu.name,
        "context_tokens": CONTEXT,
        "cost_model": pricing.source,
        "roofline": {
            "min": "the config's minimum bytes (weights once, the latent cache once) at the data-sheet bandwidth",
            "launch_list": "the recorded launches' bytes read + written at the data-sheet bandwidth",
        },
        "launch_list": "recorded from the device executor (model::exec::device::DryStep: rank 0 on a dry device, no kernel ran)",
        "vllm_measured_by_others_tok_s": {"first_request": VLLM_FIRST_TOK_S, "steady": VLLM_STEADY_TOK_S},
        "defaults": rows(&defaults),
        "tuned": tuned.as_deref().map(rows),
    });
    std::fs::write(
        out_dir.join("step-time.json"),
        serde_json::to_string_pretty(&doc)? + "\n",
    )?;
    // Drawn from the JSON just written, as `cargo run -p bench --bin charts` redraws it.
    bench::charts::step_time::draw(&doc, &out_dir.join("step-time.svg"))?;
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;
    use model::arch::presets::Preset;

    #[test]
    fn predicted_steps_are_slower_than_the_roofline_and_count_the_all_reduces() {
        let cfg = Preset::KimiK25.model_config();
        let manifest =
            Manifest::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../ptx/manifest.json"))
                .unwrap();
        let pricing = Pricing::assumed(Sm::Sm120);
        let steps = steps(&cfg, 8, &manifest, &CacheLookup::none(), &pricing).unwrap();
        let gpu = Sm::Sm120.reference_gpu();
        for s in &steps {
            assert!(s.tok_s() < s.roofline_tok_s(gpu), "batch {}", s.batch);
            // The launches read at least what the config says a step must.
            assert!(s.launch_bytes >= s.min_bytes, "batch {}", s.batch);
            assert!(
                s.tok_s() < s.launch_roofline_tok_s(gpu),
                "batch {}",
                s.batch
            );
            assert!(s.allreduce_share() > 0.0 && s.allreduce_share() < 1.0);
            for f in ["moe_gemm", "mla", "allreduce", "dense", "small"] {
                assert!(s.by_family[f] > 0.0, "{f}");
            }
        }
        // The executor's recorded list: the same launches at every batch, at least per layer
        // the cache append, MLA decode + combine and two all-reduces.
        assert!(steps.iter().all(|s| s.launches == steps[0].launches));
        assert!(steps[0].launches >= 5 * cfg.num_hidden_layers as u32);
        // More sequences per step: more tokens per second (weights are shared).
        assert!(steps.windows(2).all(|w| w[1].tok_s() > w[0].tok_s()));
        // Without tensor parallelism there is no all-reduce.
        let single = super::steps(&cfg, 1, &manifest, &CacheLookup::none(), &pricing).unwrap();
        assert!(
            single
                .iter()
                .all(|s| !s.by_family.contains_key("allreduce"))
        );
    }

    #[test]
    fn the_report_draws_a_legible_chart_from_its_json() {
        let cfg = Preset::KimiK25.model_config();
        let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../ptx/manifest.json");
        let dir = tempfile::tempdir().unwrap();
        write_report(
            &cfg,
            "kimi-k2.5",
            8,
            Some(dir.path()),
            &manifest,
            None,
            None,
        )
        .unwrap();
        let svg = std::fs::read_to_string(dir.path().join("step-time.svg")).unwrap();
        assert_eq!(
            bench::charts::layout::problems(&svg).unwrap(),
            Vec::<String>::new()
        );
        let (_, texts) = bench::charts::layout::text_boxes(&svg).unwrap();
        for batch in REPORT_BATCHES {
            assert!(
                texts.iter().any(|t| t.text == batch.to_string()),
                "{texts:?}"
            );
        }
        // Redrawn from the JSON alone, the chart is the same.
        let redrawn = dir.path().join("redrawn.svg");
        bench::charts::step_time::draw_file(&dir.path().join("step-time.json"), &redrawn).unwrap();
        assert_eq!(std::fs::read_to_string(redrawn).unwrap(), svg);
    }

    #[test]
    fn a_cost_model_fitted_on_the_priced_sm_is_used_and_another_warns() {
        use crate::refit::{AllReduceFit, COST_MODEL_FORMAT, CostModelFile, KernelFit};
        let mut fitted = CostParams::for_gpu(Sm::Sm120.reference_gpu());
        fitted.launch_us = 7.5;
        let file = |sm: &str| CostModelFile {
            format: COST_MODEL_FORMAT,
            source: "fitted to measurements".into(),
            sm: sm.into(),
            measured_on: "a GPU".into(),
            model_gpu: "RTX PRO 6000".into(),
            driver_version: "580.1".into(),
            cuda_version: "13.0".into(),
            commit: "c".into(),
            kernels: Some(KernelFit {
                params: fitted.clone(),
                assumed: CostParams::for_gpu(Sm::Sm120.reference_gpu()),
                determined: vec!["launch_us".into()],
                held: vec![],
                points: 3,
                rms_relative_residual: 0.1,
                max_relative_residual: 0.2,
                assumed_rms_relative_residual: 0.3,
                residuals: vec![],
            }),
            allreduce: Some(AllReduceFit {
                measured_as: "ranks".into(),
                world: 8,
                points: 4,
                launch_us: 2.5,
                phase_sync_us: 0.7,
                bandwidth_scale: 3.0,
                rms_us: 0.1,
                used_by_step_time: vec![],
            }),
            notes: vec![],
        };
        let dir = tempfile::tempdir().unwrap();
        let same = dir.path().join("sm120.cost-model.json");
        std::fs::write(&same, file("sm_120a").to_json()).unwrap();
        let (p, warning) = Pricing::load(&same, Sm::Sm120);
        assert_eq!(warning, None);
        assert_eq!(p.params, fitted);
        assert_eq!((p.links.launch_us, p.links.phase_sync_us), (2.5, 0.7));
        // The link bandwidths stay the PCIe host's.
        assert_eq!(
            p.links.bandwidth_scale,
            LinkParams::default().bandwidth_scale
        );
        assert!(p.source.contains("fitted"), "{}", p.source);
        let other = dir.path().join("sm90.cost-model.json");
        std::fs::write(&other, file("sm_90a").to_json()).unwrap();
        let (p, warning) = Pricing::load(&other, Sm::Sm120);
        let w = warning.unwrap();
        assert!(w.contains("fitted on sm_90a") && !w.contains('\n'), "{w}");
        assert_eq!(p.params, CostParams::for_gpu(Sm::Sm120.reference_gpu()));
        let (_, warning) = Pricing::load(&dir.path().join("absent.json"), Sm::Sm120);
        assert!(warning.unwrap().contains("using the assumed parameters"));
    }
}
