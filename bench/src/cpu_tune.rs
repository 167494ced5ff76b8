//! Measured tuning of the CPU kernels on this machine (`autotune --cpu`).
//!
//! Two stages, both timed here (never predicted):
//! 1. **kernels:** per family (grouped GEMM, dense products, MLA), every tactic of the family's
//!    knobs on the model's decode shapes, each in isolation; the per-shape figures go to the
//!    cache as that family's entries.
//! 2. **decode:** the whole model's decode step, one knob at a time (coordinate descent from
//!    the default: MoE item size, dense threshold and rows, MLA chunk and tasks, threads). A change is kept only when its median step
//!    beats the current tactic's by more than both spreads' noise (see [`clearly_faster`]),
//!    so a machine where the constants are already best keeps them. The result is the one
//!    [`CpuTactic`] `model run --tactics FILE` applies.
//!
//! Candidates are timed in interleaved rounds (A B C … A B C …), so drift in the machine's
//! load falls on all of them alike.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use kernels::cpu_tactic::{CpuTactic, CpuTacticSpace};
use model::arch::config::ModelConfig;
use model::checkpoint::weights::Model;
use model::checkpoint::{Checkpoint, WeightPlacement};
use model::exec::cpu::pool::CpuCompute;
use model::exec::cpu::{CpuOptions, cpu_runner};
use model::exec::generate::{GenerationRequest, generate};
use model::exec::sampler::SamplingParams;
use model::quantize::random_tokens;

use crate::cpu_tactics::{Case, Shape, median_spread};

/// The candidates of one knob group around a base tactic.
type KnobGroup = fn(&CpuTacticSpace, CpuTactic) -> Vec<CpuTactic>;

/// One candidate's measured figure.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Figure {
    pub tactic: CpuTactic,
    /// Median seconds per call (kernels) or per decode step.
    pub median: f64,
    /// Max − min over the samples, seconds.
    pub spread: f64,
    /// Interquartile range of the samples, seconds (robust to a preempted sample).
    pub iqr: f64,
    pub n: usize,
}

/// A stage's result on one shape: figures fastest first.
#[derive(Clone, Debug)]
pub struct Ranked {
    /// `cpu-moe`, `cpu-dense`, `cpu-mla` or `cpu-decode`.
    pub family: String,
    /// The shape bucket: [`Shape::id`] for kernels, `decode_knob_<knob>_<model>` for the
    /// decode stage.
    pub bucket: String,
    pub figures: Vec<Figure>,
}

/// What one run of the tuner found.
#[derive(Clone, Debug)]
pub struct Tuned {
    pub kernels: Vec<Ranked>,
    /// The decode stage's candidates per knob group, each fastest first.
    pub decode: Vec<Ranked>,
    /// The tactic the decode stage settled on.
    pub tactic: CpuTactic,
    /// Its decode step and the default's, as measured in the last round that compared them.
    pub tuned_step: Figure,
    pub default_step: Figure,
    /// The descent's result when the confirmation round did not confirm it against the
    /// default (the tactic then stays the default), with its figure from that round.
    pub rejected: Option<Figure>,
    /// Distinct tactics timed, over both stages.
    pub timed: usize,
}

/// Progress reporting, so the binary can drive a progress bar without this crate knowing it.
pub trait Progress {
    fn stage(&mut self, name: &str, steps: u64);
    fn step(&mut self, what: &str);
}

/// No progress output (tests).
pub struct Silent;

impl Progress for Silent {
    fn stage(&mut self, _: &str, _: u64) {}
    fn step(&mut self, _: &str) {}
}

/// Times `candidates` in interleaved rounds within `budget`: at least `min_rounds` rounds,
/// at most `max_rounds`. `run(tactic)` returns the seconds one sample took (a sample may
/// average several calls).
pub fn interleaved(
    candidates: &[CpuTactic],
    budget: Duration,
    min_rounds: usize,
    max_rounds: usize,
    mut run: impl FnMut(&CpuTactic) -> f64,
) -> Vec<Figure> {
    let mut samples = vec![Vec::new(); candidates.len()];
    let start = Instant::now();
    for round in 0..max_rounds.max(min_rounds) {
        if round >= min_rounds && start.elapsed() >= budget {
            break;
        }
        for (t, s) in candidates.iter().zip(&mut samples) {
            s.push(run(t));
        }
    }
    let mut figures: Vec<Figure> = candidates
        .iter()
        .zip(samples)
        .map(|(&tactic, mut s)| {
            let n = s.len();
            let (median, rel) = median_spread(&mut s);
            // `s` is sorted now.
            let q = |p: f64| s[((n - 1) as f64 * p).round() as usize];
            Figure {
                tactic,
                median,
                spread: rel * median,
                iqr: if n > 0 { q(0.75) - q(0.25) } else { f64::NAN },
                n,
            }
        })
        .collect();
    figures.sort_by(|a, b| a.median.total_cmp(&b.median));
    figures
}

/// Whether `a` is faster than `b` beyond noise: a lower median by more than 2 % and by more
/// than two standard errors of the difference of the medians (each ≈ 0.93 · IQR / √n for a
/// normal sample; the IQR, unlike max − min, ignores the odd preempted sample).
pub fn clearly_faster(a: &Figure, b: &Figure) -> bool {
    let gain = b.median - a.median;
    let se = |f: &Figure| 0.93 * f.iqr / (f.n.max(1) as f64).sqrt();
    gain > 0.02 * b.median && gain > 2.0 * se(a).hypot(se(b))
}

/// One sample of a kernel case under `tactic`: enough calls to last ≥ 2 ms, per call.
fn kernel_sample(pool: &rayon::ThreadPool, case: &Case, tactic: &CpuTactic) -> f64 {
    pool.install(|| {
        let start = Instant::now();
        let mut calls = 0u32;
        while calls == 0 || start.elapsed() < Duration::from_millis(2) {
            case.run(tactic);
            calls += 1;
        }
        start.elapsed().as_secs_f64() / f64::from(calls)
    })
}

/// The decode shapes of `config` at batch 1 (and the family's bench shapes when the model is
/// too small to have interesting ones): the MoE layer, the largest dense projections, MLA over
/// the context a short run reaches.
pub fn model_shapes(config: &ModelConfig, context: usize) -> Vec<Shape> {
    let mut shapes = vec![Shape::Moe {
        tokens: 1,
        hidden: config.hidden_size,
        inter: config.moe_intermediate_size,
        experts: config.n_routed_experts,
        top_k: config.num_experts_per_tok,
    }];
    let q_rows = config.num_attention_heads * (config.qk_nope_head_dim + config.qk_rope_head_dim);
    for (rows, cols) in [
        (q_rows, config.q_lora_rank.unwrap_or(config.hidden_size)),
        (config.vocab_size, config.hidden_size),
        (
            config.hidden_size,
            config.num_attention_heads * config.v_head_dim,
        ),
    ] {
        let s = Shape::Dense {
            tokens: 1,
            rows,
            cols,
        };
        if !shapes.contains(&s) {
            shapes.push(s);
        }
    }
    shapes.push(Shape::Mla {
        batch: 1,
        context,
        heads: config.num_attention_heads,
        latent: config.kv_lora_rank,
        rope: config.qk_rope_head_dim,
    });
    shapes
}

/// A loaded model and the decode run the decode stage times.
pub struct DecodeBench {
    pub name: String,
    pub model: Model,
    kv: kernels::mla::cache::KvCacheDtype,
    prompt: Vec<u32>,
    new_tokens: usize,
}

impl DecodeBench {
    /// Loads the checkpoint at `dir`; each sample prefills `prompt_len` random tokens and
    /// decodes `new_tokens` greedily.
    pub fn load(dir: &std::path::Path, prompt_len: usize, new_tokens: usize) -> Result<Self> {
        let mut checkpoint = Checkpoint::open(dir)?;
        // Where `model run` reads them (`--weights auto`), so that tactics are timed as run.
        checkpoint.place_weights(WeightPlacement::auto(checkpoint.file_bytes()));
        let mut config = checkpoint.model_config().clone();
        // Every sample decodes all its tokens (as `model run --ignore-eos`).
        config.eos_token_ids.clear();
        let kv = checkpoint.kv_cache_dtype();
        let weights = checkpoint.load_weights()?;
        let name = dir
            .file_name()
            .map_or("model".to_string(), |n| n.to_string_lossy().into_owned());
        let prompt = random_tokens(prompt_len, config.vocab_size, 0);
        Ok(Self {
            name,
            model: Model::new(config, weights),
            kv,
            prompt,
            new_tokens,
        })
    }

    pub fn context(&self) -> usize {
        self.prompt.len() + self.new_tokens
    }

    /// Seconds per decode step of one greedy generation under `tactic`.
    pub fn step_seconds(&self, tactic: &CpuTactic) -> Result<f64> {
        // As `model run` runs: called from this thread, the backend owning any pool of its own.
        let mut runner = cpu_runner(
            &self.model,
            CpuOptions {
                compute: CpuCompute::tuned(*tactic).map_err(anyhow::Error::msg)?,
                ..CpuOptions::new(self.kv, self.context())
            },
        );
        let request = GenerationRequest {
            prompt: self.prompt.clone(),
            max_new_tokens: self.new_tokens,
            sampling: SamplingParams {
                temperature: 0.0,
                top_k: 0,
                top_p: 1.0,
                seed: 0,
            },
        };
        let (_, timing) =
            generate(&mut runner, &[request], |_, _| {}).map_err(|e| anyhow::anyhow!("{e}"))?;
        Ok(timing.decode_time.as_secs_f64() / timing.decode_steps.max(1) as f64)
    }
}

/// Runs both stages. `kernel_budget` is the time per family and shape, `decode_budget` per
/// knob group.
pub fn tune(
    bench: &DecodeBench,
    cores: usize,
    kernel_budget: Duration,
    decode_budget: Duration,
    progress: &mut dyn Progress,
) -> Result<Tuned> {
    let space = CpuTactic::space(cores);
    let default = CpuTactic::DEFAULT;
    let mut timed = std::collections::BTreeSet::new();

    // Stage 1: kernels, in the default pool.
    let pool = default.build_pool().context("building the rayon pool")?;
    let shapes = model_shapes(&bench.model.config, bench.context());
    progress.stage("kernels", shapes.len() as u64);
    let mut kernels = Vec::new();
    for shape in &shapes {
        let family = shape.family();
        progress.step(&format!("{family} {shape}"));
        let case = shape.build(1);
        let tactics = family.tactics(&space, default);
        timed.extend(tactics.iter().map(CpuTactic::id));
        let figures = interleaved(&tactics, kernel_budget, 3, 200, |t| {
            kernel_sample(&pool, &case, t)
        });
        kernels.push(Ranked {
            family: family.id().to_string(),
            bucket: shape.id(),
            figures,
        });
    }

    // Stage 2: whole decode steps, one knob group at a time.
    // One knob at a time (a group of 48 dense pairs would get too few rounds per candidate).
    let groups: [(&str, KnobGroup); 7] = [
        ("moe_item", |s, b| s.moe(b)),
        ("dense_min", |s, b| {
            s.dense_parallel_min_bytes
                .iter()
                .map(|&v| CpuTactic {
                    dense_parallel_min_bytes: v,
                    ..b
                })
                .collect()
        }),
        ("dense_rows", |s, b| {
            s.dense_rows_per_task
                .iter()
                .map(|&v| CpuTactic {
                    dense_rows_per_task: v,
                    ..b
                })
                .collect()
        }),
        ("mla_chunk", |s, b| {
            s.mla_min_chunk
                .iter()
                .map(|&v| CpuTactic {
                    mla_min_chunk: v,
                    ..b
                })
                .collect()
        }),
        ("mla_tasks", |s, b| {
            s.mla_tasks_per_thread
                .iter()
                .map(|&v| CpuTactic {
                    mla_tasks_per_thread: v,
                    ..b
                })
                .collect()
        }),
        ("threads", |s, b| s.threads(b)),
        ("moe_dot", |s, b| s.moe_dot(b)),
    ];
    progress.stage("decode", groups.len() as u64 + 1);
    bench.step_seconds(&default)?; // warm-up: page in the weights
    let mut current = default;
    let mut decode = Vec::new();
    for (name, candidates) in groups {
        progress.step(&format!("decode steps over the {name} knobs"));
        let tactics = candidates(&space, current);
        timed.extend(tactics.iter().map(CpuTactic::id));
        let mut error = None;
        let figures = interleaved(&tactics, decode_budget, 3, 50, |t| {
            bench.step_seconds(t).unwrap_or_else(|e| {
                error.get_or_insert(e);
                f64::INFINITY
            })
        });
        if let Some(e) = error {
            return Err(e);
        }
        let here = *figures
            .iter()
            .find(|f| f.tactic == current)
            .context("the current tactic is a candidate")?;
        if clearly_faster(&figures[0], &here) {
            current = figures[0].tactic;
        }
        decode.push(Ranked {
            family: "cpu-decode".to_string(),
            bucket: format!("decode_knob_{name}_{}", bench.name),
            figures,
        });
    }
    // The verdict: the settled tactic against the default, in rounds of their own.
    progress.step("the tuned tactic against the default");
    let pair = if current == default {
        vec![default]
    } else {
        vec![current, default]
    };
    let mut error = None;
    let figures = interleaved(&pair, decode_budget, 5, 50, |t| {
        bench.step_seconds(t).unwrap_or_else(|e| {
            error.get_or_insert(e);
            f64::INFINITY
        })
    });
    if let Some(e) = error {
        return Err(e);
    }
    let find = |t: CpuTactic| *figures.iter().find(|f| f.tactic == t).expect("timed");
    let (mut tuned_step, default_step) = (find(current), find(default));
    let mut rejected = None;
    if current != default && !clearly_faster(&tuned_step, &default_step) {
        // Not confirmed: the constants stay.
        rejected = Some(tuned_step);
        current = default;
        tuned_step = default_step;
    }
    Ok(Tuned {
        kernels,
        decode,
        tactic: current,
        tuned_step,
        default_step,
        rejected,
        timed: timed.len(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fig(median: f64, iqr: f64) -> Figure {
        Figure {
            tactic: CpuTactic::DEFAULT,
            median,
            spread: 2.0 * iqr,
            iqr,
            n: 9,
        }
    }

    #[test]
    fn only_a_gain_beyond_noise_counts() {
        assert!(clearly_faster(&fig(0.90, 0.01), &fig(1.0, 0.01)));
        // 1 % faster: within the 2 % margin.
        assert!(!clearly_faster(&fig(0.99, 0.0), &fig(1.0, 0.0)));
        // 10 % faster but the samples' quartiles 50 % apart.
        assert!(!clearly_faster(&fig(0.90, 0.5), &fig(1.0, 0.1)));
        assert!(!clearly_faster(&fig(1.0, 0.0), &fig(1.0, 0.0)));
    }

    #[test]
    fn interleaved_rounds_rank_the_candidates_and_count_samples() {
        let a = CpuTactic::DEFAULT;
        let b = CpuTactic { threads: 1, ..a };
        let mut order = Vec::new();
        let figures = interleaved(&[a, b], Duration::ZERO, 3, 10, |t| {
            order.push(t.threads);
            if t.threads == 1 { 1.0 } else { 2.0 }
        });
        // A B A B A B: interleaved, and stopped after the minimum rounds (no budget).
        assert_eq!(order, vec![0, 1, 0, 1, 0, 1]);
        assert_eq!(figures[0].tactic, b);
        assert_eq!((figures[0].median, figures[0].n), (1.0, 3));
        assert_eq!(figures[1].median, 2.0);
    }
}
