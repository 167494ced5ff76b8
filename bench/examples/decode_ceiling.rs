//! How close a batch-1 decode step can come to the read bandwidth, measured on the model's own
//! weights: whole decode steps through the real CPU backend, alternating in one process with steps
//! whose every weight-reading call is replaced by a plain sum of exactly the bytes that call
//! reads (the same matrices in the same order, one fork and join per call as the kernels,
//! guided claims of at least 128 KB for the dense products, one task per routed expert),
//! with the attention either run as it is or skipped. The forward pass around the calls
//! (norms, RoPE, routing, residuals, sampling) runs as always. So the report splits the real
//! step's distance from the read bandwidth into:
//! - what the call structure itself costs (the sums alone against the read bandwidth: the
//!   forks and joins of ~70 calls, the restarts of the prefetchers at every matrix);
//! - what the attention adds, which reads no weights (the sums with the attention);
//! - what the kernels' arithmetic adds (the real step against the sums with the attention).
//!
//! Two more variants skip the sums: the attention alone (its keys and buffers then stay in the
//! caches between calls), and neither (the forward pass's own work between the calls). With
//! them the attention's cost in a streaming step is set beside its cost with warm caches.
//!
//! The summing steps' products are left at zero, so their routing picks the same experts on
//! every step; each step still reads every one of the 167 MB once (the weights are far beyond
//! the last-level cache), as a real step does.
//!
//! ```sh
//! cargo run --release -p bench --example decode_ceiling [-- --checkpoint DIR --rounds N --steps N]
//! ```
use std::ops::Range;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use anyhow::Result;
use bench::cpu_tactics::median_spread;
use clap::Parser;
use kernels::cpu_tactic::CpuTactic;
use kernels::matrix::MatrixView;
use kernels::mla::cache::{KvCacheDtype, PAGE_TOKENS, PageTables};
use model::checkpoint::weights::{ExpertWeights, Model};
use model::exec::cpu::pool::CpuCompute;
use model::exec::cpu::weights::{CpuHeads, CpuKinds, CpuMatrix, cpu_weights};
use model::exec::cpu::{CpuOps, CpuOptions};
use model::exec::ops::{Buf, GraphKey, StepOps, StepResult, StepRows, Sublayer};
use model::exec::sampler::SampleRow;
use model::exec::{ExecError, ModelRunner, Runner, SeqInput};
use model::quantize::random_tokens;
use rayon::prelude::*;

/// Whole decode steps, real and with plain sums in place of the products, alternating.
#[derive(Parser)]
struct Options {
    /// The checkpoint directory (default: `model run`'s default `mini` model).
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    /// Rounds, each a block of steps per variant.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: u32,
    /// Steps per variant and round.
    #[arg(long, default_value_t = 24, value_parser = clap::value_parser!(u32).range(1..))]
    steps: u32,
    /// Prompt tokens before the decode steps.
    #[arg(long, default_value_t = 128)]
    prompt: usize,
}

/// Bytes one summing claim reads at least: the real dense kernels' least claim, 64 rows of
/// 1024 BF16 columns.
const TASK_BYTES: usize = 128 << 10;

/// The CPU backend with every weight-reading operation replaced by a sum of the weights' bytes
/// (outputs left at zero), on the real backend's thread pool and step; the rest of the step
/// (norms, RoPE, routing, residuals, sampling) runs as always.
struct SummingOps {
    real: CpuOps,
    /// Sum the weights (or only count them).
    sums: bool,
    /// Run the attention for real (it reads no weights) or skip it.
    attention: bool,
    /// Weight bytes summed since the last `take_bytes`.
    bytes: AtomicU64,
    /// Where given, every run of weights a call reads, (address, length), in order.
    runs: Option<std::sync::Mutex<Vec<(usize, usize)>>>,
    /// Per row: the absorbed queries', their RoPE parts' and the attention output's widths.
    widths: [usize; 3],
}

/// The byte runs a product over `w` reads: its packed data, and its scales.
fn view_runs<'w>(w: &MatrixView<'w>) -> Vec<&'w [u8]> {
    match w {
        MatrixView::Bf16 { data, .. } => {
            // SAFETY: bf16 is two plain bytes.
            vec![unsafe { std::slice::from_raw_parts(data.as_ptr().cast(), data.len() * 2) }]
        }
        MatrixView::Nvfp4(v) => vec![v.packed, v.block_scales],
    }
}

fn matrix_runs(m: &CpuMatrix) -> Vec<&[u8]> {
    m.parts.iter().flat_map(|p| view_runs(&p.view())).collect()
}

fn heads_runs(h: &CpuHeads) -> Vec<&[u8]> {
    h.views().iter().flat_map(view_runs).collect()
}

impl SummingOps {
    fn take_bytes(&self) -> u64 {
        self.bytes.swap(0, Ordering::Relaxed)
    }

    /// Sizes `b` to `len` zeros.
    fn zeros(&mut self, b: Buf, len: usize) {
        let v = self.real.activation_mut(b);
        v.clear();
        v.resize(len, 0.0);
    }

    /// Counts the bytes of `runs`, and records where they lie where asked.
    fn count(&self, runs: &[&[u8]]) {
        let bytes: usize = runs.iter().map(|r| r.len()).sum();
        self.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
        if let Some(recorded) = &self.runs {
            let mut recorded = recorded.lock().expect("not poisoned");
            recorded.extend(runs.iter().map(|r| (r.as_ptr() as usize, r.len())));
        }
    }

    /// Counts every run and sums them, one after another, in one parallel call whose threads
    /// claim guided chunks of at least [`TASK_BYTES`], as the dense products claim their rows.
    fn sum_runs(&self, runs: &[&[u8]]) {
        self.count(runs);
        if !self.sums {
            return;
        }
        let lens: Vec<usize> = runs.iter().map(|r| r.len()).collect();
        let total = AtomicU64::new(0);
        self.real.compute().run(|| {
            kernels::guided::for_each_block_chunk(&lens, TASK_BYTES, |i, bytes| {
                total.fetch_add(bench::read_sum_bytes(&runs[i][bytes]), Ordering::Relaxed);
            })
        });
        std::hint::black_box(total.into_inner());
    }
}

impl StepOps for SummingOps {
    type Kinds = CpuKinds;

    fn describe(&self) -> String {
        "cpu-summing".into()
    }

    fn pages(&self) -> &PageTables {
        self.real.pages()
    }

    fn pages_mut(&mut self) -> &mut PageTables {
        self.real.pages_mut()
    }

    fn begin_step(&mut self, step: &StepRows<'_>) -> Result<(), ExecError> {
        self.real.begin_step(step)
    }

    fn run_step(
        &mut self,
        body: &mut (dyn FnMut(&mut Self) -> Result<(), ExecError> + Send),
    ) -> Result<(), ExecError> {
        let compute = self.real.compute().clone();
        let mut result = Ok(());
        compute.run_step(&mut || result = body(self));
        result
    }

    fn replay(&mut self, _: GraphKey) -> Result<bool, ExecError> {
        Ok(false)
    }

    fn begin_capture(&mut self, _: GraphKey) -> Result<bool, ExecError> {
        Ok(false)
    }

    fn end_capture(&mut self, _: GraphKey) -> Result<(), ExecError> {
        Ok(())
    }

    fn embed(&mut self, table: &CpuMatrix, rows: Range<usize>, out: Buf) -> Result<(), ExecError> {
        self.real.embed(table, rows, out)
    }

    fn add_rms_norm(
        &mut self,
        residual: Buf,
        delta: Option<Buf>,
        weight: &Vec<f32>,
        out: Buf,
        added: Sublayer,
    ) -> Result<(), ExecError> {
        self.real.add_rms_norm(residual, delta, weight, out, added)
    }

    fn rms_norm(&mut self, x: Buf, weight: &Vec<f32>, out: Buf) -> Result<(), ExecError> {
        self.real.rms_norm(x, weight, out)
    }

    fn products(&mut self, x: Buf, outs: &[(&CpuMatrix, Buf)]) -> Result<(), ExecError> {
        let (rows, selected) = self.real.step_rows();
        let n = if x == Buf::Selected { selected } else { rows };
        for (w, out) in outs {
            let v = self.real.activation_mut(*out);
            v.clear();
            v.resize(n * w.rows(), 0.0);
        }
        let runs: Vec<&[u8]> = outs.iter().flat_map(|(w, _)| matrix_runs(w)).collect();
        self.sum_runs(&runs);
        Ok(())
    }

    fn product_add(&mut self, _: Buf, w: &CpuMatrix, _: Buf) -> Result<(), ExecError> {
        self.sum_runs(&matrix_runs(w));
        Ok(())
    }

    fn rope(&mut self, buf: Buf) -> Result<(), ExecError> {
        self.real.rope(buf)
    }

    fn append_cache(
        &mut self,
        layer: usize,
        latent: Buf,
        key_rope: Buf,
        norm: &Vec<f32>,
    ) -> Result<(), ExecError> {
        self.real.append_cache(layer, latent, key_rope, norm)
    }

    fn absorb_query(
        &mut self,
        _: Buf,
        w_uk_t: &CpuHeads,
        absorbed: Buf,
        rope: Buf,
    ) -> Result<(), ExecError> {
        let (rows, _) = self.real.step_rows();
        self.zeros(absorbed, rows * self.widths[0]);
        self.zeros(rope, rows * self.widths[1]);
        self.sum_runs(&heads_runs(w_uk_t));
        Ok(())
    }

    fn attention(
        &mut self,
        layer: usize,
        absorbed: Buf,
        rope: Buf,
        out: Buf,
    ) -> Result<(), ExecError> {
        if self.attention {
            self.real.attention(layer, absorbed, rope, out)
        } else {
            let len = self.real.activation(absorbed).len();
            self.zeros(out, len);
            Ok(())
        }
    }

    fn unabsorb(&mut self, _: Buf, w_uv: &CpuHeads, out: Buf) -> Result<(), ExecError> {
        let (rows, _) = self.real.step_rows();
        self.zeros(out, rows * self.widths[2]);
        self.sum_runs(&heads_runs(w_uv));
        Ok(())
    }

    fn silu_mul(&mut self, gate_up: Buf, out: Buf) -> Result<(), ExecError> {
        self.real.silu_mul(gate_up, out)
    }

    fn route(&mut self, layer: usize, logits: Buf, bias: &Vec<f32>) -> Result<(), ExecError> {
        self.real.route(layer, logits, bias)
    }

    fn routed_experts(
        &mut self,
        _layer: usize,
        x: Buf,
        experts: &Vec<ExpertWeights>,
        out: Buf,
    ) -> Result<(), ExecError> {
        // One task per routed expert, its three matrices in turn, as the decode path runs them.
        let mut routed: Vec<u32> = self
            .real
            .routing()
            .map_or(Vec::new(), |r| r.experts.clone());
        routed.sort_unstable();
        routed.dedup();
        let len = self.real.activation(x).len();
        self.zeros(out, len);
        let per_expert: Vec<Vec<&[u8]>> = routed
            .iter()
            .map(|&e| {
                let ex = experts[e as usize].view();
                [ex.gate, ex.up, ex.down]
                    .iter()
                    .flat_map(view_runs)
                    .collect()
            })
            .collect();
        self.count(&per_expert.concat());
        if self.sums {
            let total: u64 = self.real.compute().run(|| {
                per_expert
                    .par_iter()
                    .map(|runs| {
                        runs.iter()
                            .map(|r| bench::read_sum_bytes(r))
                            .fold(0u64, u64::wrapping_add)
                    })
                    .sum()
            });
            std::hint::black_box(total);
        }
        Ok(())
    }

    fn all_reduce(&mut self, buf: Buf) -> Result<(), ExecError> {
        self.real.all_reduce(buf)
    }

    fn select_rows(&mut self, x: Buf, out: Buf) -> Result<(), ExecError> {
        self.real.select_rows(x, out)
    }

    fn vocab_columns(
        &mut self,
        x: Buf,
        lm_head: &CpuMatrix,
        rows: Range<usize>,
        out: Buf,
    ) -> Result<(), ExecError> {
        self.real.vocab_columns(x, lm_head, rows, out)
    }

    fn argmax_shard(
        &mut self,
        logits: Buf,
        rows: Range<usize>,
        rank: usize,
        ranks: usize,
        pairs: Buf,
    ) -> Result<(), ExecError> {
        self.real.argmax_shard(logits, rows, rank, ranks, pairs)
    }

    fn argmax_ranks(&mut self, pairs: Buf, ranks: usize) -> Result<(), ExecError> {
        self.real.argmax_ranks(pairs, ranks)
    }

    fn argmax(&mut self, logits: Buf) -> Result<(), ExecError> {
        self.real.argmax(logits)
    }

    fn sample(&mut self, logits: Buf) -> Result<(), ExecError> {
        self.real.sample(logits)
    }

    fn finish_step(&mut self) -> Result<StepResult, ExecError> {
        self.real.finish_step()
    }
}

fn main() -> Result<()> {
    model::exec::cpu::heap::keep_freed_activations();
    let o = Options::parse();
    let (rounds, steps) = (o.rounds as usize, o.steps as usize);
    let (dir, model) = bench::load_model_as_run(o.checkpoint.as_deref())?;
    let compute = CpuCompute::tuned(CpuTactic::default()).map_err(anyhow::Error::msg)?;
    // Every block of steps starts from the prompt alone in a fresh sequence, so that each
    // variant attends over the same contexts (prompt + 1 … prompt + steps).
    let cache_tokens = (o.prompt + steps + 1).next_multiple_of(PAGE_TOKENS);
    let options = CpuOptions {
        compute: compute.clone(),
        ..CpuOptions::new(KvCacheDtype::Bf16, cache_tokens)
    };
    let summing = |sums: bool, attention: bool, record: bool| -> Box<dyn ModelRunner> {
        Box::new(summing_runner(
            &model,
            options.clone(),
            sums,
            attention,
            record,
        ))
    };
    // (name, runner, whether its products are real: the summing steps' logits are all zero,
    // and their decode goes on feeding the prompt's next token; whether it reads the weights)
    let mut variants: [(&str, Box<dyn ModelRunner>, bool, bool); 5] = [
        (
            "real",
            Box::new(model::exec::cpu::cpu_runner(&model, options.clone())),
            true,
            true,
        ),
        ("sums+attention", summing(true, true, false), false, true),
        ("sums only", summing(true, false, false), false, true),
        ("attention only", summing(false, true, false), false, false),
        ("neither", summing(false, false, false), false, false),
    ];
    let prompt = random_tokens(o.prompt, model.config.vocab_size, 1);
    let greedy = [SampleRow::default()];
    let prefill = |runner: &mut dyn ModelRunner| -> Result<_> {
        let seq = runner.add_sequence();
        let inputs = [SeqInput {
            seq,
            tokens: &prompt,
        }];
        Ok((seq, [runner.step(&inputs, &greedy)?[0]]))
    };
    // What a real step reads: the runs the summing backend reads in one step.
    let (step_bytes, step_runs) = {
        let mut counter = summing_runner(&model, options.clone(), false, false, true);
        let (seq, token) = prefill(&mut counter)?;
        counter.ops().take_bytes();
        let inputs = [SeqInput {
            seq,
            tokens: &token,
        }];
        counter.step(&inputs, &greedy)?;
        let bytes = counter.ops().take_bytes() as f64;
        let runs = counter
            .ops_mut()
            .runs
            .take()
            .expect("recording")
            .into_inner()
            .expect("not poisoned");
        (bytes, runs)
    };
    // The same bytes in one parallel sum, tasks of TASK_BYTES: the read bandwidth on the
    // model's own weights, without the calls.
    let flat_tasks: Vec<&[u8]> = step_runs
        .iter()
        // SAFETY: runs of the model's weights, which live as long as the model.
        .flat_map(|&(at, len)| {
            unsafe { std::slice::from_raw_parts(at as *const u8, len) }.chunks(TASK_BYTES)
        })
        .collect();
    let flat_sum = || {
        let mut time = f64::INFINITY;
        compute.run_step(&mut || {
            for _ in 0..3 {
                let start = Instant::now();
                let total: u64 = flat_tasks
                    .par_iter()
                    .map(|t| bench::read_sum_bytes(t))
                    .sum();
                std::hint::black_box(total);
                time = time.min(start.elapsed().as_secs_f64());
            }
        });
        time
    };
    let mut flat_shares = Vec::new();
    println!(
        "{}, prompt {}, {rounds} rounds of {steps} steps per variant; {:.2} MB of weights per step",
        dir.display(),
        o.prompt,
        step_bytes / 1e6
    );
    let mut step_times = vec![Vec::new(); variants.len()];
    let mut shares = vec![Vec::new(); variants.len()];
    let mut over_real = vec![Vec::new(); variants.len()];
    for round in 0..rounds {
        let (_, read) = bench::bandwidth(2);
        let mut medians = vec![0.0; variants.len()];
        for i in 0..variants.len() {
            let k = (i + round) % variants.len();
            let (_, runner, computes, _) = &mut variants[k];
            let (seq, mut token) = prefill(runner.as_mut())?;
            let mut times = Vec::with_capacity(steps);
            for _ in 0..steps {
                let start = Instant::now();
                let inputs = [SeqInput {
                    seq,
                    tokens: &token,
                }];
                let next = runner.step(&inputs, &greedy)?[0];
                if *computes {
                    token = [next];
                }
                times.push(start.elapsed().as_secs_f64());
            }
            runner.free_sequence(seq)?;
            step_times[k].extend_from_slice(&times);
            medians[k] = median_spread(&mut times).0;
        }
        let flat = flat_sum();
        let flat_share = step_bytes / flat / 1e9 / read;
        flat_shares.push(flat_share);
        let mut line = format!(
            "round {round}: read {read:.1} GB/s, flat sum {:.3} ms ({flat_share:.2}); median step ms (share of read):",
            flat * 1e3
        );
        for (k, (name, _, _, reads)) in variants.iter().enumerate() {
            let share = step_bytes / medians[k] / 1e9 / read;
            shares[k].push(share);
            over_real[k].push(medians[k] / medians[0]);
            line += &format!(" {name} {:.3}", medians[k] * 1e3);
            if *reads {
                line += &format!(" ({share:.2})");
            }
        }
        println!("{line}");
    }
    println!("over all rounds (medians):");
    println!(
        "  flat sum of one step's weights: share of the round's read bandwidth {:.2}",
        median_spread(&mut flat_shares).0
    );
    for (k, (name, _, _, reads)) in variants.iter().enumerate() {
        let share = if *reads {
            format!(
                "; share of the round's read bandwidth {:.2}",
                median_spread(&mut shares[k]).0
            )
        } else {
            String::new()
        };
        println!(
            "  {name:<15} step {:.3} ms{share}; time over real {:.3}",
            median_spread(&mut step_times[k]).0 * 1e3,
            median_spread(&mut over_real[k]).0
        );
    }
    Ok(())
}

/// A runner whose steps sum the weights' bytes instead of multiplying (see [`SummingOps`]).
fn summing_runner(
    model: &Model,
    options: CpuOptions,
    sums: bool,
    attention: bool,
    record: bool,
) -> Runner<SummingOps> {
    let weights = cpu_weights(model);
    let real = CpuOps::new(&model.config, weights.heads, options);
    let c = &model.config;
    let ops = SummingOps {
        real,
        sums,
        attention,
        bytes: AtomicU64::new(0),
        runs: record.then(Default::default),
        widths: [
            weights.heads * c.kv_lora_rank,
            weights.heads * c.qk_rope_head_dim,
            weights.heads * c.v_head_dim,
        ],
    };
    Runner::new(ops, weights, model.config.clone())
}
