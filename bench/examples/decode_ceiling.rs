//! How close a batch-1 decode step can come to the read bandwidth, measured on the model's own
//! weights: whole decode steps through the real backend, alternating in one process with steps
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
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use anyhow::Result;
use bench::cpu_tactics::median_spread;
use clap::Parser;
use kernels::cpu_tactic::CpuTactic;
use kernels::matrix::MatrixView;
use kernels::mla::cache::{CacheError, KvCacheDtype, PAGE_TOKENS, PagedLatentCache};
use kernels::mla::reference::MlaProblem;
use kernels::moe_gemm::reference::{ExpertInputAmax, ExpertView, Routing};
use model::checkpoint::quantize::random_tokens;
use model::exec::cpu::backend::{Backend, TunedCpuBackend};
use model::exec::forward::{LogitRows, SeqInput};
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

/// A backend whose weight-reading calls sum the weights' bytes instead of multiplying, on the
/// real backend's thread pool and step (`run_step`), leaving the outputs at zero.
struct SummingBackend<'a> {
    real: &'a TunedCpuBackend,
    /// Sum the weights (or only count them).
    sums: bool,
    /// Run the attention for real (it reads no weights) or skip it.
    attention: bool,
    /// Weight bytes summed since the last `take_bytes`.
    bytes: AtomicU64,
    /// Where given, every run of weights a call reads, (address, length), in order.
    runs: Option<std::sync::Mutex<Vec<(usize, usize)>>>,
}

impl SummingBackend<'_> {
    fn take_bytes(&self) -> u64 {
        self.bytes.swap(0, Ordering::Relaxed)
    }

    /// The byte runs a product over `w` reads: its packed data, and its scales.
    fn runs<'w>(w: &MatrixView<'w>) -> Vec<&'w [u8]> {
        match w {
            MatrixView::Bf16 { data, .. } => {
                // SAFETY: bf16 is two plain bytes.
                vec![unsafe { std::slice::from_raw_parts(data.as_ptr().cast(), data.len() * 2) }]
            }
            MatrixView::Nvfp4(v) => vec![v.packed, v.block_scales],
        }
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
        kernels::guided::for_each_block_chunk(&lens, TASK_BYTES, |i, bytes| {
            total.fetch_add(bench::read_sum_bytes(&runs[i][bytes]), Ordering::Relaxed);
        });
        std::hint::black_box(total.into_inner());
    }
}

impl Backend for SummingBackend<'_> {
    fn name(&self) -> &'static str {
        "cpu-summing"
    }

    fn matmul(&self, _x: &[f32], _tokens: usize, w: MatrixView<'_>, out: &mut [f32]) {
        out.fill(0.0);
        self.sum_runs(&Self::runs(&w));
    }

    fn matmul_per_head(&self, _x: &[f32], _tokens: usize, w: &[MatrixView<'_>], out: &mut [f32]) {
        out.fill(0.0);
        let runs: Vec<&[u8]> = w.iter().flat_map(Self::runs).collect();
        self.sum_runs(&runs);
    }

    fn matmul_many(
        &self,
        _x: &[f32],
        _tokens: usize,
        ws: &[MatrixView<'_>],
        outs: &mut [&mut [f32]],
    ) {
        for out in outs.iter_mut() {
            out.fill(0.0);
        }
        let runs: Vec<&[u8]> = ws.iter().flat_map(Self::runs).collect();
        self.sum_runs(&runs);
    }

    fn moe(
        &self,
        _x: &[f32],
        _hidden: usize,
        routing: &Routing,
        experts: &[ExpertView<'_>],
        out: &mut [f32],
        _amax: Option<&mut ExpertInputAmax>,
    ) {
        out.fill(0.0);
        // One task per routed expert, its three matrices in turn, as the decode path runs them.
        let mut routed: Vec<usize> = routing.experts.iter().map(|&e| e as usize).collect();
        routed.sort_unstable();
        routed.dedup();
        let per_expert: Vec<Vec<&[u8]>> = routed
            .iter()
            .map(|&e| {
                let ex = &experts[e];
                [ex.gate, ex.up, ex.down]
                    .iter()
                    .flat_map(Self::runs)
                    .collect()
            })
            .collect();
        self.count(&per_expert.concat());
        if !self.sums {
            return;
        }
        let total: u64 = per_expert
            .par_iter()
            .map(|runs| {
                runs.iter()
                    .map(|r| bench::read_sum_bytes(r))
                    .fold(0u64, u64::wrapping_add)
            })
            .sum();
        std::hint::black_box(total);
    }

    fn mla_attention(
        &self,
        cache: &PagedLatentCache,
        problem: &MlaProblem<'_>,
        out: &mut [f32],
        lse: &mut [f32],
    ) -> Result<(), CacheError> {
        if self.attention {
            self.real.mla_attention(cache, problem, out, lse)
        } else {
            out.fill(0.0);
            lse.fill(0.0);
            Ok(())
        }
    }

    fn run_step(&self, step: &mut (dyn FnMut() + Send)) {
        self.real.run_step(step)
    }
}

fn main() -> Result<()> {
    model::exec::cpu::heap::keep_freed_activations();
    let o = Options::parse();
    let (rounds, steps) = (o.rounds as usize, o.steps as usize);
    let (dir, model) = bench::load_model_as_run(o.checkpoint.as_deref())?;
    let real = TunedCpuBackend::new(CpuTactic::default()).map_err(anyhow::Error::msg)?;
    let summing = |sums, attention| SummingBackend {
        real: &real,
        sums,
        attention,
        bytes: AtomicU64::new(0),
        runs: None,
    };
    let (with_attention, sums_only) = (summing(true, true), summing(true, false));
    let (attention_only, neither) = (summing(false, true), summing(false, false));
    // (name, backend, whether its products are real: the summing steps' logits are all zero,
    // and their decode goes on feeding the prompt's next token; whether it reads the weights)
    let variants: [(&str, &dyn Backend, bool, bool); 5] = [
        ("real", &real, true, true),
        ("sums+attention", &with_attention, false, true),
        ("sums only", &sums_only, false, true),
        ("attention only", &attention_only, false, false),
        ("neither", &neither, false, false),
    ];
    // Every block of steps starts from the prompt alone in a fresh sequence, so that each
    // variant attends over the same contexts (prompt + 1 … prompt + steps).
    let mut cache = model.new_cache(
        KvCacheDtype::Bf16,
        (o.prompt + steps + 1).next_multiple_of(PAGE_TOKENS),
    );
    let prompt = random_tokens(o.prompt, model.config.vocab_size, 1);
    let prefill = |cache: &mut PagedLatentCache| -> Result<_> {
        let seq = cache.add_sequence();
        let inputs = [SeqInput {
            seq,
            tokens: &prompt,
        }];
        let logits = model.forward(&real, cache, &inputs, LogitRows::Last, None)?;
        Ok((seq, [model::exec::sampler::argmax(logits.row(0))]))
    };
    let (mut seq, token) = prefill(&mut cache)?;
    // What a real step reads: the runs the summing backend reads in one step.
    let (step_bytes, step_runs) = {
        let inputs = [SeqInput {
            seq,
            tokens: &token,
        }];
        let counter = SummingBackend {
            runs: Some(Default::default()),
            ..summing(false, false)
        };
        model.forward(&counter, &mut cache, &inputs, LogitRows::Last, None)?;
        let bytes = counter.take_bytes() as f64;
        let runs = counter
            .runs
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
        real.run_step(&mut || {
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
            let (_, backend, computes, _) = variants[k];
            cache.free_sequence(seq)?;
            let mut token;
            (seq, token) = prefill(&mut cache)?;
            let mut times = Vec::with_capacity(steps);
            for _ in 0..steps {
                let start = Instant::now();
                let inputs = [SeqInput {
                    seq,
                    tokens: &token,
                }];
                let logits = model.forward(backend, &mut cache, &inputs, LogitRows::Last, None)?;
                if computes {
                    token = [model::exec::sampler::argmax(logits.row(0))];
                }
                times.push(start.elapsed().as_secs_f64());
            }
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
        for (k, &(name, _, _, reads)) in variants.iter().enumerate() {
            let share = step_bytes / medians[k] / 1e9 / read;
            shares[k].push(share);
            over_real[k].push(medians[k] / medians[0]);
            line += &format!(" {name} {:.3}", medians[k] * 1e3);
            if reads {
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
    for (k, &(name, _, _, reads)) in variants.iter().enumerate() {
        let share = if reads {
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
