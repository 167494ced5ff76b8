//! CPU grouped GEMM of the routed experts against the machine's memory bandwidth, measured in
//! the same run.
//!
//! ```sh
//! cargo run --release -p bench --bin cpu-grouped-gemm                    # the table on stdout
//! cargo run --release -p bench --bin cpu-grouped-gemm -- --write-results # and bench/results/cpu_grouped_gemm.txt
//! cargo run --release -p bench --bin cpu-grouped-gemm -- --quick          # fewer passes
//! ```
//!
//! At decode a routed expert sees 1–8 tokens, so its GEMM is a stream over its weights and the
//! attainable speed is the memory bandwidth. We report GB/s on the weight bytes a call must read
//! (packed E2M1 + E4M3 block scales) and its ratio to the copy bandwidth measured here (STREAM
//! convention: bytes read + bytes written, multi-threaded, buffers far larger than the LLC),
//! plus the ratio to a read-only sweep. Each pass routes tokens to every expert of a weight set
//! much larger than the LLC (≥ 256 MiB), so each pass streams from DRAM.
//!
//! Every instruction set this CPU has runs with both dot kinds of the tactic
//! ([`MoeDot`]: f32 FMAs, integer W4A4 block dots), side by side in one run; `vs_f32` is the
//! f32 kernel's median time over this line's (same ISA and shape). `--label TEXT` adds a
//! description of the machine to the header.

use bench::{COPY_BYTES, bandwidth, cpu_model, load_average, time_passes, utc_date};
use std::fmt::Write as _;

use kernels::cpu_tactic::{CpuTactic, MoeDot};
use kernels::formats::nvfp4::{NVFP4_BLOCK, Nvfp4View};
use kernels::isa::Isa;
use kernels::matrix::MatrixView;
use kernels::moe_gemm::cpu::moe_cpu_tuned;
use kernels::moe_gemm::cpu_int::IntKernel;
use kernels::moe_gemm::reference::{ExpertView, Routing, moe_reference};
use rayon::prelude::*;

const HIDDEN: usize = 7168;
/// Kimi's routed top-k.
const TOP_K: usize = 8;
/// Minimum weight bytes per pass (≥ 8× a 32 MiB LLC).
const MIN_SET_BYTES: usize = 256 << 20;
struct Options {
    passes: usize,
    /// Weight bytes per pass (`--set-mib N`; small values measure the in-cache compute speed).
    set_bytes: usize,
    /// Only this instruction set (`--isa avx512|avx2fma|scalar`), and no reference: for
    /// profiling one kernel.
    only: Option<Isa>,
    /// Only these tokens per expert and intermediate size (`--tokens N`, `--inter N`).
    tokens: Option<usize>,
    inter: Option<usize>,
}

/// Every shape, instruction set and dot kind of the routed experts' grouped GEMM against the
/// memory bandwidth measured in the same run; the table goes to stdout.
#[derive(clap::Parser, Debug)]
#[command(name = "cpu-grouped-gemm")]
struct Cli {
    /// Fewer passes (3 instead of 15).
    #[arg(long)]
    quick: bool,
    /// Only this instruction set (avx512, avx2fma, scalar), for profiling one kernel.
    #[arg(long)]
    isa: Option<String>,
    /// Only this many tokens per expert (1, 2, 4 or 8).
    #[arg(long)]
    tokens: Option<usize>,
    /// Only this intermediate size (256 or 2048).
    #[arg(long)]
    inter: Option<usize>,
    /// Weight MiB per pass (default: at least 256 MiB; small values measure the in-cache
    /// compute speed).
    #[arg(long)]
    set_mib: Option<usize>,
    /// A description of the machine for the table's header.
    #[arg(long)]
    label: Option<String>,
    /// Also write the table to this file.
    #[arg(long, conflicts_with = "write_results")]
    out: Option<std::path::PathBuf>,
    /// Also write the table to bench/results/cpu_grouped_gemm.txt (from the repository root;
    /// a whole run only).
    #[arg(long, conflicts_with_all = ["quick", "isa", "tokens", "inter", "set_mib"])]
    write_results: bool,
}

fn main() {
    let cli: Cli = clap::Parser::parse();
    let out = bench::report_path(
        cli.out.as_deref(),
        cli.write_results,
        "cpu_grouped_gemm.txt",
    );
    let only = cli.isa.as_deref().map(|name| {
        let name = name.to_lowercase();
        Isa::all_supported()
            .into_iter()
            .find(|isa| format!("{isa:?}").to_lowercase() == name)
            .unwrap_or_else(|| {
                eprintln!("error: --isa {name}: not supported here");
                std::process::exit(2);
            })
    });
    let opts = Options {
        passes: if cli.quick { 3 } else { 15 },
        set_bytes: cli.set_mib.map_or(MIN_SET_BYTES, |mib| mib << 20),
        only,
        tokens: cli.tokens,
        inter: cli.inter,
    };
    let label = cli.label;
    let threads = rayon::current_num_threads();
    let cpu = cpu_model();
    let load_start = load_average();
    eprintln!("{cpu}, {threads} threads");

    let (copy, read) = bandwidth(opts.passes);
    eprintln!("copy {copy:.2} GB/s (read+write), read {read:.2} GB/s");

    let mut report = String::new();
    let mut worst: Option<f64> = None;
    // Per tokens-per-expert count: the worst ratio over the shapes, for the detected ISA.
    let mut per_tokens: Vec<(usize, f64)> = Vec::new();
    let best_isa = Isa::detect();
    let default_dot = CpuTactic::DEFAULT.moe_dot;
    let mut lines = Vec::new();
    // Kimi per GPU at TP8 (intermediate 2048/8) and unsharded.
    for inter in [256, 2048] {
        if opts.inter.is_some_and(|i| i != inter) {
            continue;
        }
        let set = WeightSet::new(inter, opts.set_bytes);
        for n in [1, 2, 4, 8] {
            if opts.tokens.is_some_and(|t| t != n) {
                continue;
            }
            let routing = set.routing(n);
            let tokens = routing.tokens();
            let x: Vec<f32> = (0..tokens * HIDDEN)
                .map(|i| ((i * 7919 % 2003) as f32 / 1001.0 - 1.0) * 0.5)
                .collect();
            let mut out = vec![0.0f32; tokens * HIDDEN];
            let experts = set.views();
            let gb = set.bytes as f64 / 1e9;
            for isa in Isa::all_supported() {
                if opts.only.is_some_and(|only| only != isa) {
                    continue;
                }
                let mut f32_median = None;
                for moe_dot in MoeDot::ALL {
                    let tactic = CpuTactic {
                        moe_dot,
                        ..CpuTactic::DEFAULT
                    };
                    let t = time_passes(opts.passes, || {
                        moe_cpu_tuned(&tactic, isa, &x, HIDDEN, &routing, &experts, &mut out, None);
                    });
                    if moe_dot == MoeDot::F32Fma {
                        f32_median = Some(t.median_wall);
                    }
                    let vs_f32 = f32_median.map_or(1.0, |m| m / t.median_wall);
                    let gbs = gb / t.wall;
                    let median_gbs = gb / t.median_wall;
                    let kernel = match moe_dot {
                        MoeDot::F32Fma => format!("{isa:?}"),
                        MoeDot::IntDot => format!("{:?}", IntKernel::for_isa(isa)),
                    };
                    let line = format!(
                        "fast isa={isa:?} dot={} kernel={kernel} hidden={HIDDEN} inter={inter} \
                     experts={} tokens_per_expert={n} weight_bytes={} best_ms={:.2} \
                     median_ms={:.2} GB/s={gbs:.2} median_GB/s={median_gbs:.2} \
                     copy_ratio={:.3} median_copy_ratio={:.3} read_ratio={:.3} vs_f32={vs_f32:.2} \
                     cpu_util={:.2}",
                        moe_dot.name(),
                        set.experts,
                        set.bytes,
                        t.wall * 1e3,
                        t.median_wall * 1e3,
                        gbs / copy,
                        median_gbs / copy,
                        gbs / read,
                        t.utilization()
                    );
                    eprintln!("{line}");
                    lines.push(line);
                    if isa == best_isa && moe_dot == default_dot {
                        let r = gbs / copy;
                        worst = Some(worst.map_or(r, |w: f64| w.min(r)));
                        match per_tokens.iter_mut().find(|(k, _)| *k == n) {
                            Some((_, w)) => *w = w.min(r),
                            None => per_tokens.push((n, r)),
                        }
                    }
                }
            }
            if opts.only.is_some() {
                continue;
            }
            // The reference is slow: one timed pass after a warm-up is enough for a ratio.
            let t = time_passes(1, || {
                moe_reference(&x, HIDDEN, &routing, &experts, &mut out, None);
            });
            let gbs = gb / t.wall;
            let line = format!(
                "reference hidden={HIDDEN} inter={inter} experts={} tokens_per_expert={n} \
                 weight_bytes={} ms={:.2} GB/s={gbs:.2} copy_ratio={:.3} read_ratio={:.3} \
                 cpu_util={:.2}",
                set.experts,
                set.bytes,
                t.wall * 1e3,
                gbs / copy,
                gbs / read,
                t.utilization()
            );
            eprintln!("{line}");
            lines.push(line);
        }
    }

    let worst = worst.unwrap_or(0.0);
    writeln!(report, "cpu_grouped_gemm copy_ratio={worst:.3}").unwrap();
    writeln!(
        report,
        "# copy_ratio above: the worst case over all shapes below for the detected ISA \
         ({best_isa:?}) and the default dot kind ({})",
        default_dot.name()
    )
    .unwrap();
    if let Some(label) = &label {
        writeln!(report, "# measured, {label}").unwrap();
    }
    let by_tokens: Vec<String> = per_tokens
        .iter()
        .map(|(n, r)| format!("{n} token(s)/expert {r:.3}"))
        .collect();
    writeln!(
        report,
        "# worst copy_ratio per decode size: {}",
        by_tokens.join(", ")
    )
    .unwrap();
    writeln!(report, "# date: {}", utc_date()).unwrap();
    writeln!(report, "# cpu: {cpu}; rayon threads: {threads}").unwrap();
    writeln!(
        report,
        "# load average (1 min) at start / end: {load_start} / {}; cpu_util below ~0.9 on a line \
         means other processes held the cores during it and its ratio understates the kernel",
        load_average()
    )
    .unwrap();
    writeln!(
        report,
        "# copy: {copy:.2} GB/s (multi-threaded copy of {} MiB, read+write bytes, best of {}); \
         read: {read:.2} GB/s (multi-threaded sum, best of {})",
        COPY_BYTES >> 20,
        opts.passes,
        opts.passes
    )
    .unwrap();
    writeln!(
        report,
        "# GB/s = weight bytes (packed E2M1 + E4M3 scales of gate, up, down) / best time of a \
         whole moe call over {} passes (median also shown); top_k={TOP_K}, every expert of \
         the set gets tokens_per_expert tokens; cpu_util is for the best pass; median_* use \
         the median pass (the machine may be shared: prefer the medians)",
        opts.passes
    )
    .unwrap();
    writeln!(
        report,
        "# command: cargo run --release -p bench --bin cpu-grouped-gemm -- --write-results{}",
        label
            .as_ref()
            .map_or(String::new(), |l| format!(" --label '{l}'"))
    )
    .unwrap();
    for line in &lines {
        writeln!(report, "{line}").unwrap();
    }
    if let Err(e) = bench::emit_report(&report, out.as_deref()) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

/// Random NVFP4 experts of one shape, `experts` of them so that the set exceeds
/// [`MIN_SET_BYTES`]. Random codes and mid-range block scales: the kernels' speed does not
/// depend on the values.
struct WeightSet {
    inter: usize,
    experts: usize,
    /// Per expert: packed and scales of gate, up, down.
    data: Vec<[(Vec<u8>, Vec<u8>); 3]>,
    bytes: usize,
}

impl WeightSet {
    fn new(inter: usize, set_bytes: usize) -> Self {
        let per_expert = 3 * HIDDEN * inter * 9 / 16;
        // A multiple of top_k so that the round-robin routing gives every expert n tokens.
        let experts = set_bytes.div_ceil(per_expert).next_multiple_of(TOP_K);
        let data: Vec<[(Vec<u8>, Vec<u8>); 3]> = (0..experts)
            .into_par_iter()
            .map(|e| {
                let mut seed = 0x9E37_79B9_7F4A_7C15u64 ^ (e as u64) << 32 ^ inter as u64;
                let mut next = move || {
                    // xorshift64*
                    seed ^= seed >> 12;
                    seed ^= seed << 25;
                    seed ^= seed >> 27;
                    seed.wrapping_mul(0x2545_F491_4F6C_DD1D)
                };
                let mut matrix = || {
                    let n = HIDDEN * inter;
                    let packed: Vec<u8> = (0..n / 2).map(|_| (next() >> 56) as u8).collect();
                    // E4M3 codes 0x30..0x3F: 0.5 to 1.875.
                    let scales: Vec<u8> = (0..n / NVFP4_BLOCK)
                        .map(|_| 0x30 | (next() >> 60) as u8)
                        .collect();
                    (packed, scales)
                };
                [matrix(), matrix(), matrix()]
            })
            .collect();
        let bytes = data
            .iter()
            .flat_map(|m| m.iter().map(|(p, s)| p.len() + s.len()))
            .sum();
        Self {
            inter,
            experts,
            data,
            bytes,
        }
    }

    fn views(&self) -> Vec<ExpertView<'_>> {
        fn view((p, s): &(Vec<u8>, Vec<u8>), rows: usize, cols: usize) -> MatrixView<'_> {
            MatrixView::Nvfp4(Nvfp4View {
                rows,
                cols,
                packed: p,
                block_scales: s,
                global_scale: 1e-3,
            })
        }
        self.data
            .iter()
            .map(|[g, u, d]| ExpertView {
                gate: view(g, self.inter, HIDDEN),
                up: view(u, self.inter, HIDDEN),
                down: view(d, HIDDEN, self.inter),
                gate_up_input_scale: Some(1.0 / 2688.0),
                down_input_scale: Some(0.05 / 2688.0),
            })
            .collect()
    }

    /// `n · experts / top_k` tokens; assignment `i = t·top_k + k` goes to expert `i mod
    /// experts`, so every expert gets exactly `n` tokens and each token distinct experts.
    fn routing(&self, n: usize) -> Routing {
        let tokens = n * self.experts / TOP_K;
        Routing {
            top_k: TOP_K,
            experts: (0..tokens * TOP_K)
                .map(|i| (i % self.experts) as u32)
                .collect(),
            weights: (0..tokens * TOP_K)
                .map(|i| 0.05 + (i % 7) as f32 * 0.01)
                .collect(),
        }
    }
}
