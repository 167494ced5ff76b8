//! The CPU kernel families as tunable workloads: Kimi-like decode shapes scaled to a small
//! machine, each runnable under any [`CpuTactic`]. Shared by the criterion sweeps
//! (`cargo bench -p bench --bench cpu_tactics`) and `autotune --cpu`.

use std::fmt;
use std::sync::Mutex;

use anyhow::{Context, Result};
use half::bf16;
use kernels::cpu_tactic::{CpuTactic, CpuTacticSpace};
use kernels::dense::matmul_transposed_tuned;
use kernels::formats::nvfp4::Nvfp4Matrix;
use kernels::isa::Isa;
use kernels::matrix::MatrixView;
use kernels::mla::cache::{KvCacheDtype, LatentCacheShape, PAGE_TOKENS, PagedLatentCache};
use kernels::mla::cpu::mla_attention_tuned;
use kernels::mla::reference::{AttentionQuery, MlaProblem};
use kernels::moe_gemm::cpu::moe_cpu_tuned;
use kernels::moe_gemm::reference::{ExpertView, Routing};
use kernels::rng::Rng;

use crate::sweep::SweepChart;

/// A CPU kernel family with its own knobs of [`CpuTactic`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CpuFamily {
    /// The NVFP4 grouped GEMM of the routed experts (`moe_item`, `moe_dot`).
    Moe,
    /// Dense BF16 products (`dense_min`, `dense_rows`).
    Dense,
    /// MLA decode attention, split-KV (`mla_chunk`, `mla_tasks`).
    Mla,
}

impl CpuFamily {
    pub const ALL: [CpuFamily; 3] = [CpuFamily::Moe, CpuFamily::Dense, CpuFamily::Mla];

    pub fn id(self) -> &'static str {
        match self {
            CpuFamily::Moe => "cpu-moe",
            CpuFamily::Dense => "cpu-dense",
            CpuFamily::Mla => "cpu-mla",
        }
    }

    /// Every tactic of the family's knobs in `space`, the others at `base`'s values.
    pub fn tactics(self, space: &CpuTacticSpace, base: CpuTactic) -> Vec<CpuTactic> {
        match self {
            // The item sizes at the base's dot kind, then the other dot kinds.
            CpuFamily::Moe => {
                let mut tactics = space.moe(base);
                tactics.extend(space.moe_dot(base).into_iter().filter(|t| *t != base));
                tactics
            }
            CpuFamily::Dense => space.dense(base),
            CpuFamily::Mla => space.mla(base),
        }
    }

    /// The family's knobs of `t`, as a short label for charts.
    pub fn label(self, t: &CpuTactic) -> String {
        let kib = |b: usize| format!("{}k", b >> 10);
        match self {
            CpuFamily::Moe => format!("item {} {}", kib(t.moe_item_bytes), t.moe_dot.name()),
            CpuFamily::Dense => format!(
                "min {} rows {}",
                kib(t.dense_parallel_min_bytes),
                t.dense_rows_per_task
            ),
            CpuFamily::Mla => format!("chunk {} x{}", t.mla_min_chunk, t.mla_tasks_per_thread),
        }
    }

    /// The decode shapes of the family, scaled to what runs here in a fraction of a second.
    pub fn shapes(self) -> Vec<Shape> {
        match self {
            // Kimi's hidden and TP8 expert shard (2048 / 8), top-8 of 32 experts (Kimi: 384).
            CpuFamily::Moe => [1, 4, 16, 64]
                .map(|tokens| Shape::Moe {
                    tokens,
                    hidden: 7168,
                    inter: 256,
                    experts: 32,
                    top_k: 8,
                })
                .to_vec(),
            // A small projection (the tiny models' layers), a mid one, and Kimi's q_a (7168 →
            // 1536) at decode; the mid one also at 4–64 tokens.
            CpuFamily::Dense => vec![
                Shape::Dense {
                    tokens: 1,
                    rows: 256,
                    cols: 512,
                },
                Shape::Dense {
                    tokens: 1,
                    rows: 1024,
                    cols: 1024,
                },
                Shape::Dense {
                    tokens: 1,
                    rows: 1536,
                    cols: 7168,
                },
                Shape::Dense {
                    tokens: 4,
                    rows: 1024,
                    cols: 1024,
                },
                Shape::Dense {
                    tokens: 16,
                    rows: 1024,
                    cols: 1024,
                },
                Shape::Dense {
                    tokens: 64,
                    rows: 1024,
                    cols: 1024,
                },
            ],
            // Kimi's latent (512 + 64 rope), 8 heads (64 / TP8), BF16 cache: batch × context.
            CpuFamily::Mla => [(1, 512), (1, 4096), (4, 2048), (16, 1024)]
                .map(|(batch, context)| Shape::Mla {
                    batch,
                    context,
                    heads: 8,
                    latent: 512,
                    rope: 64,
                })
                .to_vec(),
        }
    }
}

impl fmt::Display for CpuFamily {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.id())
    }
}

/// One problem shape of a family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Shape {
    Moe {
        tokens: usize,
        hidden: usize,
        inter: usize,
        experts: usize,
        top_k: usize,
    },
    Dense {
        tokens: usize,
        rows: usize,
        cols: usize,
    },
    Mla {
        batch: usize,
        context: usize,
        heads: usize,
        latent: usize,
        rope: usize,
    },
}

impl Shape {
    pub fn family(&self) -> CpuFamily {
        match self {
            Shape::Moe { .. } => CpuFamily::Moe,
            Shape::Dense { .. } => CpuFamily::Dense,
            Shape::Mla { .. } => CpuFamily::Mla,
        }
    }

    /// A stable bucket name, e.g. `t4.h7168.i256.e32.k8`.
    pub fn id(&self) -> String {
        match *self {
            Shape::Moe {
                tokens,
                hidden,
                inter,
                experts,
                top_k,
            } => format!("t{tokens}.h{hidden}.i{inter}.e{experts}.k{top_k}"),
            Shape::Dense { tokens, rows, cols } => format!("t{tokens}.{rows}x{cols}"),
            Shape::Mla {
                batch,
                context,
                heads,
                latent,
                rope,
            } => format!("b{batch}.ctx{context}.h{heads}.l{latent}.r{rope}"),
        }
    }

    /// The workload, with deterministic random data.
    pub fn build(&self, seed: u64) -> Case {
        let mut rng = Rng(seed ^ 0x5EED);
        match *self {
            Shape::Moe {
                tokens,
                hidden,
                inter,
                experts,
                top_k,
            } => moe_case(&mut rng, tokens, hidden, inter, experts, top_k),
            Shape::Dense { tokens, rows, cols } => dense_case(&mut rng, tokens, rows, cols),
            Shape::Mla {
                batch,
                context,
                heads,
                latent,
                rope,
            } => mla_case(&mut rng, batch, context, heads, latent, rope),
        }
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.id())
    }
}

/// A built workload: `run(tactic)` performs one kernel call in the current rayon pool.
pub struct Case {
    /// Bytes one call reads: MoE the routed experts' NVFP4 weights and scales, dense the BF16
    /// matrix, MLA the BF16 latent cache of every row.
    pub bytes: usize,
    run: Box<dyn Fn(&CpuTactic) + Send + Sync>,
}

impl Case {
    pub fn run(&self, tactic: &CpuTactic) {
        (self.run)(tactic)
    }
}

/// Random bytes from the kernels' test-data generator.
fn random_bytes(rng: &mut Rng, n: usize) -> Vec<u8> {
    let mut out = vec![0; n];
    rng.fill_bytes(&mut out);
    out
}

/// Values uniform in [-1, 1).
fn random_values(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.sym()).collect()
}

/// A random NVFP4 matrix: random codes, block scales in a normal E4M3 range.
fn nvfp4(rng: &mut Rng, rows: usize, cols: usize) -> Nvfp4Matrix {
    let packed = random_bytes(rng, rows * cols / 2);
    let scales = (0..rows * cols / 16)
        .map(|_| 0x30 + (rng.next_u64() % 16) as u8)
        .collect();
    Nvfp4Matrix::from_parts(rows, cols, packed, scales, 1.0 / 2688.0).expect("shapes agree")
}

fn moe_case(
    rng: &mut Rng,
    tokens: usize,
    hidden: usize,
    inter: usize,
    num_experts: usize,
    top_k: usize,
) -> Case {
    let mats: Vec<[Nvfp4Matrix; 3]> = (0..num_experts)
        .map(|_| {
            [
                nvfp4(rng, inter, hidden),
                nvfp4(rng, inter, hidden),
                nvfp4(rng, hidden, inter),
            ]
        })
        .collect();
    // Each token takes top_k distinct experts at a random offset: balanced on average.
    let mut experts = Vec::with_capacity(tokens * top_k);
    for _ in 0..tokens {
        let start = (rng.next_u64() as usize) % num_experts;
        let stride = num_experts / top_k;
        experts.extend((0..top_k).map(|k| ((start + k * stride.max(1)) % num_experts) as u32));
    }
    let used: std::collections::BTreeSet<u32> = experts.iter().copied().collect();
    let bytes = used.len() * 3 * (inter * hidden / 2 + inter * hidden / 16);
    let routing = Routing {
        top_k,
        experts,
        weights: (0..tokens * top_k)
            .map(|_| rng.sym().abs() / top_k as f32)
            .collect(),
    };
    let x = random_values(rng, tokens * hidden);
    let out = Mutex::new(vec![0.0f32; tokens * hidden]);
    let isa = Isa::detect();
    Case {
        bytes,
        run: Box::new(move |tactic| {
            let views: Vec<ExpertView<'_>> = mats
                .iter()
                .map(|[g, u, d]| ExpertView {
                    gate: MatrixView::Nvfp4(g.view()),
                    up: MatrixView::Nvfp4(u.view()),
                    down: MatrixView::Nvfp4(d.view()),
                    gate_up_input_scale: Some(1.0 / 2688.0),
                    down_input_scale: Some(0.02 / 2688.0),
                })
                .collect();
            let mut out = out.lock().expect("not poisoned");
            moe_cpu_tuned(tactic, isa, &x, hidden, &routing, &views, &mut out, None);
        }),
    }
}

fn dense_case(rng: &mut Rng, tokens: usize, rows: usize, cols: usize) -> Case {
    let w: Vec<bf16> = random_values(rng, rows * cols)
        .into_iter()
        .map(|v| bf16::from_f32(v * 0.05))
        .collect();
    let x = random_values(rng, tokens * cols);
    let out = Mutex::new(vec![0.0f32; tokens * rows]);
    Case {
        bytes: rows * cols * 2,
        run: Box::new(move |tactic| {
            let view = MatrixView::Bf16 {
                rows,
                cols,
                data: &w,
            };
            let mut out = out.lock().expect("not poisoned");
            matmul_transposed_tuned(tactic, &x, tokens, view, &mut out);
        }),
    }
}

fn mla_case(
    rng: &mut Rng,
    batch: usize,
    context: usize,
    heads: usize,
    latent: usize,
    rope: usize,
) -> Case {
    let shape = LatentCacheShape {
        layers: 1,
        latent_dim: latent,
        rope_dim: rope,
    };
    let pages = batch * context.div_ceil(PAGE_TOKENS);
    let mut cache = PagedLatentCache::new(shape, KvCacheDtype::Bf16, pages);
    let mut queries = Vec::new();
    for _ in 0..batch {
        let seq = cache.add_sequence();
        cache.reserve(seq, context).expect("pages reserved");
        for t in 0..context {
            let c = random_values(rng, latent);
            let k = random_values(rng, rope);
            cache.write(0, seq, t, &c, &k).expect("slot reserved");
        }
        cache.commit(seq, context).expect("written");
        queries.push(AttentionQuery { seq, context });
    }
    let q_abs = random_values(rng, batch * heads * latent);
    let q_pe = random_values(rng, batch * heads * rope);
    let out = Mutex::new((
        vec![0.0f32; batch * heads * latent],
        vec![0.0f32; batch * heads],
    ));
    Case {
        bytes: batch * context * (latent + rope) * 2,
        run: Box::new(move |tactic| {
            let problem = MlaProblem {
                layer: 0,
                heads,
                queries: &queries,
                q_abs: &q_abs,
                q_pe: &q_pe,
                softmax_scale: 0.1446796,
            };
            let mut guard = out.lock().expect("not poisoned");
            let (o, lse) = &mut *guard;
            mla_attention_tuned(tactic, &cache, &problem, o, lse).expect("valid problem");
        }),
    }
}

/// The file of `family`'s sweep chart, e.g. `cpu-tactics-moe.svg`.
pub fn chart_file(family: CpuFamily) -> String {
    format!("{}.svg", family.id().replace("cpu-", "cpu-tactics-"))
}

/// `family`'s sweep chart: each tactic's time relative to the default's (`ratios[tactic]
/// [shape]`, the default's all 1) on `machine` (the CPU and the kernels' ISA).
pub fn family_chart(
    family: CpuFamily,
    machine: &str,
    shapes: Vec<String>,
    tactics: Vec<String>,
    ratios: Vec<Vec<f64>>,
    default: usize,
) -> SweepChart<'static> {
    SweepChart {
        title: format!("{family}: time / default tactic (measured, {machine})"),
        y_desc: "time / default (lower is faster)",
        shapes,
        series: tactics,
        values: ratios,
        emphasize: Some(default),
        log_y: false,
    }
}

/// The sweep charts of the results table `cpu-tactics.txt` (what `cargo bench -p bench
/// --bench cpu_tactics` writes), to redraw them without measuring again.
pub fn charts_from_table(text: &str) -> Result<Vec<(CpuFamily, SweepChart<'static>)>> {
    let cpu_line = text
        .lines()
        .find_map(|l| l.strip_prefix("# CPU: "))
        .context("no `# CPU:` line")?;
    let cpu = cpu_line.split(" (").next().unwrap_or(cpu_line);
    let isa = cpu_line
        .split("kernels' ISA ")
        .nth(1)
        .and_then(|r| r.split(')').next())
        .context("no ISA on the `# CPU:` line")?;
    let machine = format!("{cpu}, {isa}");
    // Per family: shapes, tactics, ratio per (tactic, shape), the default.
    struct Family {
        family: CpuFamily,
        shapes: Vec<String>,
        tactics: Vec<String>,
        ratios: Vec<(usize, usize, f64)>,
        default: Option<usize>,
    }
    let mut families: Vec<Family> = Vec::new();
    for line in text.lines() {
        if let Some(head) = line.strip_prefix("## ") {
            let id = head.split_whitespace().next().unwrap_or("");
            let family = CpuFamily::ALL
                .into_iter()
                .find(|f| f.id() == id)
                .with_context(|| format!("unknown family {id:?}"))?;
            families.push(Family {
                family,
                shapes: Vec::new(),
                tactics: Vec::new(),
                ratios: Vec::new(),
                default: None,
            });
            continue;
        }
        let Some(f) = families.last_mut() else {
            continue;
        };
        if let Some(shape) = line.strip_prefix("shape ") {
            f.shapes.push(shape.trim().to_string());
            continue;
        }
        // `  * item 64k   15292.3 us  spread  36.9%  n 10  ratio 0.898  (default)`
        let words: Vec<&str> = line.split_whitespace().collect();
        let (Some(us), Some(r)) = (
            words.iter().position(|w| *w == "us"),
            words.iter().position(|w| *w == "ratio"),
        ) else {
            continue;
        };
        let start = usize::from(words.first() == Some(&"*"));
        let label = words[start..us.saturating_sub(1)].join(" ");
        let ratio: f64 = words
            .get(r + 1)
            .and_then(|v| v.parse().ok())
            .with_context(|| format!("no ratio in {line:?}"))?;
        let shape = f
            .shapes
            .len()
            .checked_sub(1)
            .context("a tactic before any shape")?;
        let tactic = match f.tactics.iter().position(|t| *t == label) {
            Some(t) => t,
            None => {
                f.tactics.push(label);
                f.tactics.len() - 1
            }
        };
        if line.trim_end().ends_with("(default)") {
            f.default = Some(tactic);
        }
        f.ratios.push((tactic, shape, ratio));
    }
    families
        .into_iter()
        .map(|f| {
            let mut ratios = vec![vec![f64::NAN; f.shapes.len()]; f.tactics.len()];
            for (t, s, r) in f.ratios {
                ratios[t][s] = r;
            }
            let default = f
                .default
                .with_context(|| format!("{}: no default tactic", f.family))?;
            Ok((
                f.family,
                family_chart(f.family, &machine, f.shapes, f.tactics, ratios, default),
            ))
        })
        .collect()
}

/// Median and spread (max − min over the samples, relative to the median) of `samples`.
pub fn median_spread(samples: &mut [f64]) -> (f64, f64) {
    if samples.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    samples.sort_by(f64::total_cmp);
    let n = samples.len();
    let median = if n % 2 == 1 {
        samples[n / 2]
    } else {
        0.5 * (samples[n / 2 - 1] + samples[n / 2])
    };
    (median, (samples[n - 1] - samples[0]) / median)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_family_runs_a_small_case_under_every_tactic_of_its_space() {
        let space = CpuTactic::space(2);
        let small = [
            Shape::Moe {
                tokens: 3,
                hidden: 64,
                inter: 32,
                experts: 4,
                top_k: 2,
            },
            Shape::Dense {
                tokens: 2,
                rows: 40,
                cols: 48,
            },
            Shape::Mla {
                batch: 2,
                context: 70,
                heads: 2,
                latent: 32,
                rope: 16,
            },
        ];
        for shape in small {
            let case = shape.build(1);
            assert!(case.bytes > 0);
            for t in shape.family().tactics(&space, CpuTactic::DEFAULT) {
                case.run(&t);
            }
        }
    }

    #[test]
    fn the_results_table_gives_back_each_familys_chart() {
        let text = "# CPU kernel tactic sweeps (measured; criterion, 10 samples per point)\n\
            # CPU: AMD EPYC (2 threads, kernels' ISA Avx2Fma); load average at the end: 8.36\n\n\
            ## cpu-mla (measured)\n\
            shape b1.ctx512.h8.l512.r64\n\
            \x20   chunk 64 x1                  1018.0 us  spread  81.2%  n 10  ratio 1.179\n\
            \x20 * chunk 256 x4                  863.3 us  spread  39.6%  n 10  ratio 1.000  (default)\n\
            \x20 winner: moe_item=128k,dense_min=512k,dense_rows=64,mla_chunk=256,mla_tasks=4,threads=0\n\
            shape b4.ctx2048.h8.l512.r64\n\
            \x20 * chunk 64 x1                 10857.5 us  spread   8.9%  n 10  ratio 0.613\n\
            \x20   chunk 256 x4                17707.1 us  spread 181.7%  n 10  ratio 1.000  (default)\n";
        let charts = charts_from_table(text).unwrap();
        assert_eq!(charts.len(), 1);
        let (family, chart) = &charts[0];
        assert_eq!(*family, CpuFamily::Mla);
        assert_eq!(chart.series, ["chunk 64 x1", "chunk 256 x4"]);
        assert_eq!(
            chart.shapes,
            ["b1.ctx512.h8.l512.r64", "b4.ctx2048.h8.l512.r64"]
        );
        assert_eq!(chart.values, vec![vec![1.179, 0.613], vec![1.0, 1.0]]);
        assert_eq!(chart.emphasize, Some(1));
        assert_eq!((chart.winner(0), chart.winner(1)), (Some(1), Some(0)));
        assert!(chart.title.contains("AMD EPYC, Avx2Fma"), "{}", chart.title);
        assert_eq!(chart_file(*family), "cpu-tactics-mla.svg");
    }

    #[test]
    fn median_and_spread() {
        assert_eq!(median_spread(&mut [3.0, 1.0, 2.0]), (2.0, 1.0));
        assert_eq!(median_spread(&mut [4.0, 1.0, 2.0, 3.0]), (2.5, 3.0 / 2.5));
    }
}
