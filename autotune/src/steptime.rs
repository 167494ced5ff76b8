//! The step-time model: predicted decode tok/s of the model on `tp` RTX PRO 6000s over PCIe.
//!
//! The launch list of one decode step is the device executor's own, recorded for rank 0 of the
//! TP group on a dry device (`model::executor::DryStep`: zeroed weights of the rank's shapes,
//! no kernel runs), with the MoE and MLA tactics chosen here: per layer the norms, the
//! attention products, RoPE and the cache append, MLA decode + combine, the MoE (router,
//! grouping, `moe_gate_up` + `moe_down`, the shared expert) or the dense MLP, and two
//! all-reduces; then the final norm, lm_head and argmax. Each launch is priced by the cost
//! model: the MoE and MLA pairs for the tactic chosen — the heuristic default, or the tactic
//! cache's winner — the dense products by the `m, n, k` their launcher names, the all-reduces
//! by the all-reduce cost model for its tactic, every other launch by its recorded bytes at the
//! streaming bandwidth plus a launch. Every time is predicted; none is measured.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, Result};
use kernels::allreduce::tactic::AllReduceTactic;
use kernels::arch::{GpuSpec, Sm};
use kernels::mla::MlaSplitTactic;
use kernels::mla::cache::KvCacheDtype;
use kernels::moe_gemm::MoeGemmTactic;
use kernels::moe_gemm::launch::MoeGroupingBounds;
use kernels::tactic::cache::{CacheLookup, Expected, load};
use kernels::tactic::{KernelFamily, ProblemShape};
use model::config::ModelConfig;
use model::executor::{DryStep, ExecutorTactics};
use model::weights::TpShard;
use plotters::prelude::*;
use serde_json::json;

use crate::cost::{self, Model};
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
    pub fn roofline_tok_s(&self, gpu: &GpuSpec) -> f64 {
        f64::from(self.batch) / (self.min_bytes / (gpu.mem_bandwidth_gbs * 1e9))
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
    let moe_t = c
        .lookup
        .choose::<MoeGemmTactic>(c.sm, &moe_shape)
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
    let mla_t = c
        .lookup
        .choose::<MlaSplitTactic>(c.sm, &mla_shape)
        .context("no MLA tactic serves the shape")?;
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
    let ar = cost::allreduce(&c.ar_host, &ar_t.tactic, &ar_shape).context("all-reduce")?;

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
        tactics: ExecutorTactics {
            moe: Some(moe_t.tactic),
            mla: mla_t.tactic.kernel,
            dense: kernels::blas::DenseTactic::default(),
        },
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
        tactics: vec![moe_t.describe(), mla_t.describe(), ar_t.describe()],
    })
}

/// A memory-bound small kernel: its bytes at the streaming bandwidth plus one launch.
fn cost_small(c: &Ctx<'_>, bytes: f64) -> f64 {
    let bw = c.model.gpu.mem_bandwidth_gbs * 1e9 * c.model.params.stream_efficiency;
    bytes / bw * 1e6 + c.model.params.launch_us
}

/// The report at [`REPORT_BATCHES`] with the heuristic defaults, and with the tactic cache's
/// winners when one is given.
pub fn steps(
    cfg: &ModelConfig,
    tp: u32,
    manifest: &Manifest,
    lookup: &CacheLookup,
) -> Result<Vec<Step>> {
    let sm = Sm::Sm120;
    let ctx = Ctx {
        cfg,
        tp,
        sm,
        model: Model::new(sm.reference_gpu()),
        manifest,
        lookup,
        ar_host: cost::allreduce_host(tp),
    };
    REPORT_BATCHES.iter().map(|&b| step(&ctx, b)).collect()
}

fn table(title: &str, steps: &[Step], gpu: &GpuSpec) -> String {
    let mut s = format!("{title}\n");
    let _ = writeln!(
        s,
        "{:>5} {:>9} {:>9} {:>9} {:>9} {:>9} {:>10} {:>8} {:>9} {:>7} {:>10}",
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
        "roofline"
    );
    for st in steps {
        let f = |k: &str| st.by_family.get(k).copied().unwrap_or(0.0);
        let _ = writeln!(
            s,
            "{:>5} {:>9.0} {:>9.0} {:>9.0} {:>9.0} {:>9.0} {:>10.0} {:>8} {:>9.1} {:>6.1}% {:>10.1}",
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
            st.roofline_tok_s(gpu)
        );
    }
    for st in steps {
        let _ = writeln!(s, "  batch {}: {}", st.batch, st.tactics.join("; "));
    }
    s
}

/// Computes the report, writes `step-time.txt`, `step-time.json` and `step-time.svg` into
/// `out_dir`, and returns the text.
pub fn write_report(
    cfg: &ModelConfig,
    model_name: &str,
    tp: u32,
    out_dir: &Path,
    manifest_path: &Path,
    tactics: Option<&Path>,
) -> Result<String> {
    let manifest = Manifest::load(manifest_path)?;
    let gpu = Sm::Sm120.reference_gpu();
    let defaults = steps(cfg, tp, &manifest, &CacheLookup::none())?;
    let tuned = match tactics {
        Some(p) => {
            let lookup = load(p, &Expected::for_sm(Sm::Sm120, None));
            if let Some(w) = &lookup.warning {
                eprintln!("{w}");
            }
            lookup
                .cache
                .is_some()
                .then(|| steps(cfg, tp, &manifest, &lookup))
                .transpose()?
        }
        None => None,
    };
    let mut text = format!(
        "# PREDICTED decode step time: {model_name} on {tp}x {} over PCIe (TP{tp}), every request \
         at {CONTEXT} cached tokens (FP8 latent cache)\n\
         # Launch list RECORDED from the device executor (rank 0, on a dry device: no kernel ran); \
         per-launch times from autotune's cost model, all-reduces from \
         kernels::allreduce::cost (two-sockets-4x4 host). Nothing here is measured.\n\
         # roofline: tok/s if the step only streamed its minimum DRAM bytes (weights once, the \
         latent cache once) at {:.0} GB/s. vLLM in the seeds (measured by others): ~{VLLM_FIRST_TOK_S:.0} \
         tok/s first request, ~{VLLM_STEADY_TOK_S:.0} steady state.\n\n",
        gpu.name, gpu.mem_bandwidth_gbs
    );
    text += &table("heuristic default tactics (predicted)", &defaults, gpu);
    if let Some(t) = &tuned {
        text += "\n";
        text += &table("tactic cache winners (predicted)", t, gpu);
    }
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
                    "min_bytes": s.min_bytes,
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
        "launch_list": "recorded from the device executor (model::executor::DryStep: rank 0 on a dry device, no kernel ran)",
        "vllm_measured_by_others_tok_s": {"first_request": VLLM_FIRST_TOK_S, "steady": VLLM_STEADY_TOK_S},
        "defaults": rows(&defaults),
        "tuned": tuned.as_deref().map(rows),
    });
    std::fs::write(
        out_dir.join("step-time.json"),
        serde_json::to_string_pretty(&doc)? + "\n",
    )?;
    chart(
        &out_dir.join("step-time.svg"),
        model_name,
        tp,
        &defaults,
        tuned.as_deref(),
        gpu,
    )?;
    Ok(text)
}

/// A chart line: label, points, colour, stroke width.
type Series = (String, Vec<(f64, f64)>, RGBAColor, u32);

fn chart(
    path: &Path,
    model_name: &str,
    tp: u32,
    defaults: &[Step],
    tuned: Option<&[Step]>,
    gpu: &GpuSpec,
) -> Result<()> {
    let root = SVGBackend::new(path, (960, 600)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut series: Vec<Series> = vec![(
        "predicted, heuristic default tactics".into(),
        defaults
            .iter()
            .map(|s| (f64::from(s.batch), s.tok_s()))
            .collect(),
        BLUE.to_rgba(),
        2,
    )];
    if let Some(t) = tuned {
        series.push((
            "predicted, tactic cache winners".into(),
            t.iter().map(|s| (f64::from(s.batch), s.tok_s())).collect(),
            GREEN.to_rgba(),
            3,
        ));
    }
    series.push((
        "memory roofline (min bytes at the data-sheet bandwidth)".into(),
        defaults
            .iter()
            .map(|s| (f64::from(s.batch), s.roofline_tok_s(gpu)))
            .collect(),
        BLACK.to_rgba(),
        1,
    ));
    let xs: Vec<f64> = defaults.iter().map(|s| f64::from(s.batch)).collect();
    let x0 = xs.first().copied().unwrap_or(1.0);
    let x1 = xs.last().copied().unwrap_or(32.0);
    for (name, v, color) in [
        (
            "vLLM steady state (measured by others)",
            VLLM_STEADY_TOK_S,
            RED.to_rgba(),
        ),
        (
            "vLLM first request (measured by others)",
            VLLM_FIRST_TOK_S,
            MAGENTA.to_rgba(),
        ),
    ] {
        series.push((name.into(), vec![(x0, v), (x1, v)], color, 1));
    }
    let y_max = series
        .iter()
        .flat_map(|(_, p, _, _)| p.iter().map(|(_, y)| *y))
        .fold(1.0f64, f64::max);
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("PREDICTED decode tok/s, {model_name}, {tp}x RTX PRO 6000 (PCIe), {CONTEXT}-token contexts"),
            ("sans-serif", 18),
        )
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(60)
        .build_cartesian_2d((x0 * 0.8..x1 * 1.25).log_scale(), (5.0f64..y_max * 2.0).log_scale())?;
    chart
        .configure_mesh()
        .x_desc("decode batch (sequences)")
        .y_desc("tokens/s (all sequences, predicted)")
        .draw()?;
    for (name, points, color, width) in series {
        let style = color.stroke_width(width);
        chart
            .draw_series(LineSeries::new(points.iter().copied(), style))?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
        chart.draw_series(points.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()?;
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use model::generator::Preset;

    #[test]
    fn predicted_steps_are_slower_than_the_roofline_and_count_the_all_reduces() {
        let cfg = Preset::KimiK25.model_config();
        let manifest =
            Manifest::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../ptx/manifest.json"))
                .unwrap();
        let steps = steps(&cfg, 8, &manifest, &CacheLookup::none()).unwrap();
        let gpu = Sm::Sm120.reference_gpu();
        for s in &steps {
            assert!(s.tok_s() < s.roofline_tok_s(gpu), "batch {}", s.batch);
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
        let single = super::steps(&cfg, 1, &manifest, &CacheLookup::none()).unwrap();
        assert!(
            single
                .iter()
                .all(|s| !s.by_family.contains_key("allreduce"))
        );
    }
}
