//! The CPU decode step of the `mini` model at batch 1 against the machine's memory bandwidth,
//! measured in the same run.
//!
//! ```sh
//! cargo run --release -p bench --bin model-decode        # writes bench/results/model_decode.txt
//! cargo run --release -p bench --bin model-decode -- --checkpoint DIR --steps 32
//! ```
//!
//! A decode step reads every weight it multiplies with once (attention, dense and shared MLPs,
//! the router, `lm_head`, the routed experts the token chose) and the latent cache of every
//! layer. A counting backend adds those bytes up as the step runs, so the figure is the bytes
//! the step actually read, divided by its wall time, and compared with the copy and read
//! bandwidth of this machine taken just before.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use anyhow::{Context, Result};
use bench::{bandwidth, cpu_model, load_average, utc_date};
use kernels::matrix::MatrixView;
use kernels::mla::cache::{CacheError, KvCacheDtype, PagedLatentCache};
use kernels::mla::reference::MlaProblem;
use kernels::moe_gemm::reference::{ExpertInputAmax, ExpertView, Routing};
use model::checkpoint::quantize::random_tokens;
use model::exec::cpu::backend::{Backend, CpuBackend};
use model::exec::forward::{LogitRows, SeqInput};

/// The CPU backend, counting the bytes each operation must read.
#[derive(Default)]
struct CountingBackend {
    inner: CpuBackend,
    bytes: AtomicU64,
}

impl CountingBackend {
    fn take(&self) -> u64 {
        self.bytes.swap(0, Ordering::Relaxed)
    }

    fn add(&self, bytes: usize) {
        self.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
    }
}

impl Backend for CountingBackend {
    fn name(&self) -> &'static str {
        "cpu (counting bytes)"
    }

    fn matmul(&self, x: &[f32], tokens: usize, w: MatrixView<'_>, out: &mut [f32]) {
        self.add(w.bytes());
        self.inner.matmul(x, tokens, w, out);
    }

    fn moe(
        &self,
        x: &[f32],
        hidden: usize,
        routing: &Routing,
        experts: &[ExpertView<'_>],
        out: &mut [f32],
        amax: Option<&mut ExpertInputAmax>,
    ) {
        let assigned = routing.assignments(experts.len());
        let read: usize = experts
            .iter()
            .zip(&assigned)
            .filter(|(_, tokens)| !tokens.is_empty())
            .map(|(e, _)| e.gate.bytes() + e.up.bytes() + e.down.bytes())
            .sum();
        self.add(read);
        self.inner.moe(x, hidden, routing, experts, out, amax);
    }

    fn mla_attention(
        &self,
        cache: &PagedLatentCache,
        problem: &MlaProblem<'_>,
        out: &mut [f32],
        lse: &mut [f32],
    ) -> Result<(), CacheError> {
        let per_token = cache.dtype().bytes_per_token(&cache.shape());
        self.add(problem.queries.iter().map(|q| q.context * per_token).sum());
        self.inner.mla_attention(cache, problem, out, lse)
    }
}

struct Options {
    checkpoint: Option<PathBuf>,
    steps: usize,
    prompt: usize,
    write: bool,
}

fn options() -> Result<Options> {
    let mut o = Options {
        checkpoint: None,
        steps: 48,
        prompt: 512,
        write: true,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().with_context(|| format!("{arg} needs a value"));
        match arg.as_str() {
            "--checkpoint" => {
                o.checkpoint = Some(PathBuf::from(value()?));
                o.write = false;
            }
            "--steps" => o.steps = value()?.parse()?,
            "--prompt" => o.prompt = value()?.parse()?,
            "--no-write" => o.write = false,
            other => anyhow::bail!(
                "unknown option {other} (--checkpoint DIR, --steps N, --prompt N, --no-write)"
            ),
        }
    }
    Ok(o)
}

fn main() -> Result<()> {
    // As `model run` does: its steps' freed activations stay in the heap.
    model::exec::cpu::heap::keep_freed_activations();
    let o = options()?;
    let (dir, model) = bench::load_model_as_run(o.checkpoint.as_deref())?;
    let c = &model.config;
    let load_start = load_average();
    let (copy, read) = bandwidth(15);
    let mut report = String::new();
    writeln!(
        report,
        "# date: {}; cpu: {}; rayon threads: {}",
        utc_date(),
        cpu_model(),
        rayon::current_num_threads()
    )?;
    writeln!(
        report,
        "# model: {} ({} layers, hidden {}, {} experts top-{})",
        dir.display(),
        c.num_hidden_layers,
        c.hidden_size,
        c.n_routed_experts,
        c.num_experts_per_tok
    )?;
    writeln!(
        report,
        "# copy: {copy:.2} GB/s (read + written bytes); read: {read:.2} GB/s; best of 15, 512 MiB"
    )?;
    writeln!(
        report,
        "# bytes/step = weights multiplied (attention, dense, shared, router, lm_head, the routed experts chosen) + latent cache read, counted as the step runs"
    )?;
    writeln!(
        report,
        "# batch 1, prompt {} tokens then {} decode steps; GB/s over all steps; best_step_ms = the fastest step",
        o.prompt, o.steps
    )?;
    let mut summary = Vec::new();
    for dtype in [KvCacheDtype::Bf16, KvCacheDtype::Fp8E4m3] {
        let backend = CountingBackend::default();
        let mut cache = model.new_cache(dtype, o.prompt + o.steps + 1);
        let seq = cache.add_sequence();
        let prompt = random_tokens(o.prompt, c.vocab_size, 1);
        let logits = model.forward(
            &backend,
            &mut cache,
            &[SeqInput {
                seq,
                tokens: &prompt,
            }],
            LogitRows::Last,
            None,
        )?;
        backend.take();
        let mut token = model::exec::sampler::argmax(logits.row(0));
        let (mut bytes, mut seconds, mut best) = (0u64, 0f64, f64::MAX);
        for _ in 0..o.steps {
            let start = Instant::now();
            let logits = model.forward(
                &backend,
                &mut cache,
                &[SeqInput {
                    seq,
                    tokens: &[token],
                }],
                LogitRows::Last,
                None,
            )?;
            let elapsed = start.elapsed().as_secs_f64();
            token = model::exec::sampler::argmax(logits.row(0));
            // The embedding row is read outside the backend.
            bytes += backend.take() + (c.hidden_size * 2) as u64;
            seconds += elapsed;
            best = best.min(elapsed);
        }
        let gbs = bytes as f64 / seconds / 1e9;
        let line = format!(
            "model_decode kv={} tok/s={:.1} bytes/step={:.1}MB GB/s={gbs:.2} copy_ratio={:.3} read_ratio={:.3} best_step_ms={:.2}",
            dtype.id(),
            o.steps as f64 / seconds,
            bytes as f64 / o.steps as f64 / 1e6,
            gbs / copy,
            gbs / read,
            best * 1e3
        );
        println!("{line}");
        summary.push(line);
    }
    writeln!(
        report,
        "# load average (1 min) at start / end: {load_start} / {}",
        load_average()
    )?;
    for line in summary {
        writeln!(report, "{line}")?;
    }
    print!("{report}");
    if o.write {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("results/model_decode.txt");
        std::fs::write(&path, report).with_context(|| format!("writing {}", path.display()))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
