//! GPU check of the NVFP4 MoE grouped GEMM: for every tactic built for the present GPU,
//! correctness against the CPU reference (and the committed MoE goldens, when there are any),
//! then timing with CUDA events against the device's copy bandwidth measured in the same run.
//!
//! Meant for a machine with an NVIDIA GPU and driver but no Rust: build here with
//! `cargo build --release --features cuda -p kernels --bin gpu-check`, carry the binary with
//! `ptx/` (the gate's cubins) and `golden/data/`; see `scripts/gpu-check.sh` and
//! `scripts/build-gpu-bundle.sh`.
//!
//! Correctness: fresh random inputs every run (the seed is printed and recorded); the NVFP4
//! intermediate is poisoned with 0xFF (E4M3 NaN, never produced by the kernel's encoder) and
//! the output zeroed (`moe_down` accumulates into it), so an unwritten row fails. A tactic
//! passes when no output is NaN/inf, no intermediate scale is left unwritten, and
//! `‖out − ref‖₂ / ‖ref‖₂ ≤ 1e-3` and `max|out − ref| ≤ 1e-2 · max|ref|` in each of two runs,
//! and the two runs differ by at most 1e-5 (relative L2; only the order of the atomic adds
//! may differ, so more is a race). The kernel and the reference quantize the same activations
//! the same way and differ only in f32 summation order, so a correct kernel lands near 1e-6;
//! a layout or indexing bug lands near 1. The goldens (`golden/data/moe/`, from
//! `golden/gen_moe.py`: PyTorch + ModelOpt) are compared with the same tolerance.
//!
//! Timing: weights of all 384 experts of one layer at the TP8 shard (1.2 GB, far above L2),
//! and per scenario a set of routings rotated between launches so successive launches read
//! other experts' weights from HBM. Reported: median µs of `moe_gate_up` and `moe_down`,
//! unique weight bytes read per launch over that time (TB/s, and as a fraction of the copy
//! bandwidth), and TFLOPS over the useful FLOPs `6·A·H·I`.
//!
//! Exit status: 0 when every tactic passed, 1 when any failed, 2 when no check could run
//! (no driver, no device, unsupported GPU, bad arguments).

use kernels::moe_gemm::golden_data::{self, checksum};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use cudarc::driver::CudaEvent;
use half::bf16;
use kernels::cuda::{GpuContext, default_ptx_dir, median};
use kernels::formats::nvfp4::Nvfp4Matrix;
use kernels::moe_gemm::check::{
    Case, Compare, MAX_ABS_TOL, REL_L2_TOL, check_case, compare, kernel_model, random_case,
    random_moe_weights,
};
use kernels::moe_gemm::launch::{
    ExpertWeights, GroupedRouting, MoeDeviceActivations, MoeDeviceRouting, MoeDeviceWeights,
    MoeKernels, MoeWeightsHost,
};
use kernels::moe_gemm::reference::Routing;
use kernels::moe_gemm::tactic::check_problem;
use kernels::moe_gemm::{KernelVariant, MoeGemmTactic, ScaleLoad};
use kernels::rng::Rng;
use kernels::tactic::Tactic;
use serde_json::{Value, json};

const USAGE: &str = "usage: gpu-check [--ptx-dir DIR] [--golden-dir DIR] [--out DIR] [--device N]
                 [--seed N] [--tactics SUBSTRING] [--iters N] [--no-timing]
                 [--time-budget SECONDS] [--prepare-only]
  --ptx-dir      kernel images (default: $KIMI_PTX_DIR, else ./ptx)
  --golden-dir   MoE goldens, optional (default: golden/data/moe)
  --out          results folder (default: $OUT, else bench/results/gpu)
  --tactics      only tactics whose id contains SUBSTRING
  --iters        timed iterations per (tactic, scenario) (default 30)
  --time-budget  stop timing new tactics after this many seconds (default 300)
  --prepare-only build the inputs and CPU references only (no GPU needed) and exit";

struct Args {
    ptx_dir: PathBuf,
    golden_dir: PathBuf,
    out: PathBuf,
    device: usize,
    seed: u64,
    filter: Option<String>,
    iters: usize,
    timing: bool,
    time_budget_s: f64,
    prepare_only: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        ptx_dir: default_ptx_dir(),
        golden_dir: PathBuf::from("golden/data/moe"),
        out: std::env::var_os("OUT")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("bench/results/gpu")),
        device: 0,
        // Fresh inputs every run; the seed is printed so a failure can be replayed.
        seed: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1),
        filter: None,
        iters: 30,
        timing: true,
        time_budget_s: 300.0,
        prepare_only: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        let num = |s: String| s.parse::<u64>().map_err(|e| format!("{flag}: {e}"));
        match flag.as_str() {
            "--ptx-dir" => a.ptx_dir = value()?.into(),
            "--golden-dir" => a.golden_dir = value()?.into(),
            "--out" => a.out = value()?.into(),
            "--device" => a.device = num(value()?)? as usize,
            "--seed" => a.seed = num(value()?)?,
            "--tactics" => a.filter = Some(value()?),
            "--iters" => a.iters = num(value()?)?.max(1) as usize,
            "--time-budget" => a.time_budget_s = num(value()?)? as f64,
            "--no-timing" => a.timing = false,
            "--prepare-only" => a.prepare_only = true,
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(a)
}

// ---------------------------------------------------------------- goldens (optional)

// The MoE goldens of `golden/gen_moe.py` (branch moe-cpu; read as its test
// `tests/tests/moe_golden.rs` does). One file holds several cases, each named by the prefix of
// its tensors: `{case}.x` f32 `[T, H]` (exact in bf16), `{case}.routing` i64 `[T, K]`,
// `{case}.weights` f32 `[T, K]`, `{case}.out` f32 `[T, H]`, and per expert `e`
// `{case}.experts.{e}.{gate_up_proj,down_proj}.input_scale` plus, per projection, either the
// stored NVFP4 weight (`.weight` u8, `.weight_scale` e4m3, `.weight_scale_2`) or, for the
// Kimi-shaped cases, only `.weight_scale_2` and `.weight_checksum`: the weights are then
// regenerated from gen_moe.py's closed-form hash and checked against both.

struct GoldenFile<'a> {
    st: safetensors::SafeTensors<'a>,
}

impl GoldenFile<'_> {
    fn tensor(&self, name: &str) -> Result<safetensors::tensor::TensorView<'_>, String> {
        self.st.tensor(name).map_err(|e| format!("{name}: {e}"))
    }
    fn has(&self, name: &str) -> bool {
        self.st.tensor(name).is_ok()
    }
    fn f32s(&self, name: &str) -> Result<Vec<f32>, String> {
        let t = self.tensor(name)?;
        if t.dtype() != safetensors::Dtype::F32 {
            return Err(format!("{name}: dtype {:?}, expected F32", t.dtype()));
        }
        Ok(t.data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }
    fn i64s(&self, name: &str) -> Result<Vec<i64>, String> {
        let t = self.tensor(name)?;
        if t.dtype() != safetensors::Dtype::I64 {
            return Err(format!("{name}: dtype {:?}, expected I64", t.dtype()));
        }
        Ok(t.data()
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect())
    }
    fn scalar(&self, name: &str) -> Result<f32, String> {
        self.f32s(name)?
            .first()
            .copied()
            .ok_or_else(|| format!("{name}: empty"))
    }
    fn shape2(&self, name: &str) -> Result<(usize, usize), String> {
        match self.tensor(name)?.shape() {
            [a, b] => Ok((*a, *b)),
            s => Err(format!("{name}: shape {s:?} is not 2-D")),
        }
    }
}

/// Expert `e` of a hashed case (`golden_data::hashed_expert`), checked against the file's
/// `weight_scale_2` and checksums.
fn hashed_expert(
    f: &GoldenFile<'_>,
    prefix: &str,
    stream: u32,
    e: usize,
    hidden: usize,
    inter: usize,
) -> Result<[Nvfp4Matrix; 3], String> {
    let mats = golden_data::hashed_expert(stream, e, hidden, inter)?;
    for (p, m) in ["gate_proj", "up_proj", "down_proj"].iter().zip(&mats) {
        let golden = f.scalar(&format!("{prefix}.{p}.weight_scale_2"))?;
        if golden.to_bits() != m.global_scale.to_bits() {
            return Err(format!(
                "{prefix}.{p}: regenerated weight_scale_2 {} vs the file's {golden}",
                m.global_scale
            ));
        }
        let sums = f.i64s(&format!("{prefix}.{p}.weight_checksum"))?;
        let ours = [checksum(&m.packed), checksum(&m.block_scales)];
        if sums != ours {
            return Err(format!(
                "{prefix}.{p}: regenerated checksums {ours:?} vs the file's {sums:?}"
            ));
        }
    }
    Ok(mats)
}

fn load_golden_case(f: &GoldenFile<'_>, file: &str, name: &str) -> Result<Case, String> {
    let (tokens, top_k) = f.shape2(&format!("{name}.routing"))?;
    let (x_tokens, hidden) = f.shape2(&format!("{name}.x"))?;
    if x_tokens != tokens {
        return Err(format!("x has {x_tokens} tokens, routing {tokens}"));
    }
    let x = f.f32s(&format!("{name}.x"))?;
    // The kernels read BF16 activations: a golden whose x is not exact in BF16 would be
    // compared against a different input.
    if let Some(v) = x.iter().find(|&&v| bf16::from_f32(v).to_f32() != v) {
        return Err(format!("x value {v} is not exact in bf16"));
    }
    let experts = (0..)
        .take_while(|e| f.has(&format!("{name}.experts.{e}.gate_up_proj.input_scale")))
        .count();
    let ids = f
        .i64s(&format!("{name}.routing"))?
        .into_iter()
        .map(|e| {
            u32::try_from(e)
                .ok()
                .filter(|&e| (e as usize) < experts)
                .ok_or_else(|| format!("routing names expert {e} of {experts}"))
        })
        .collect::<Result<Vec<u32>, String>>()?;
    let mut mats = Vec::with_capacity(experts);
    let mut scales = Vec::with_capacity(experts);
    for e in 0..experts {
        let prefix = format!("{name}.experts.{e}");
        let m = if f.has(&format!("{prefix}.gate_proj.weight")) {
            let read = |p: &str| -> Result<Nvfp4Matrix, String> {
                let base = format!("{prefix}.{p}");
                let (rows, half_cols) = f.shape2(&format!("{base}.weight"))?;
                Nvfp4Matrix::from_parts(
                    rows,
                    half_cols * 2,
                    f.tensor(&format!("{base}.weight"))?.data().to_vec(),
                    f.tensor(&format!("{base}.weight_scale"))?.data().to_vec(),
                    f.scalar(&format!("{base}.weight_scale_2"))?,
                )
                .map_err(|err| format!("{base}: {err}"))
            };
            [read("gate_proj")?, read("up_proj")?, read("down_proj")?]
        } else {
            // Hashed cases: `…_i256` / `…_i2048` name the intermediate size.
            let inter: usize = name
                .rsplit_once("_i")
                .and_then(|(_, i)| i.parse().ok())
                .ok_or_else(|| format!("{name}: no stored weights and no _i<inter> in the name"))?;
            hashed_expert(f, &prefix, golden_data::case_stream(name), e, hidden, inter)?
        };
        scales.push((
            f.scalar(&format!("{prefix}.gate_up_proj.input_scale"))?,
            f.scalar(&format!("{prefix}.down_proj.input_scale"))?,
        ));
        mats.push(m);
    }
    let inter = mats.first().map(|m| m[0].rows).ok_or("no experts")?;
    let views: Vec<ExpertWeights<'_>> = mats
        .iter()
        .zip(&scales)
        .map(|(m, &(a13, a2))| ExpertWeights {
            gate: m[0].view(),
            up: m[1].view(),
            down: m[2].view(),
            gate_up_input_scale: a13,
            down_input_scale: a2,
        })
        .collect();
    Ok(Case {
        name: format!("golden:{file}:{name}"),
        hidden,
        inter,
        weights: MoeWeightsHost::from_experts(&views).map_err(|e| e.to_string())?,
        routing: Routing {
            top_k,
            experts: ids,
            weights: f.f32s(&format!("{name}.weights"))?,
        },
        x_bf16: x.iter().map(|&v| bf16::from_f32(v).to_bits()).collect(),
        reference: f.f32s(&format!("{name}.out"))?,
    })
}

/// Every case of every `.safetensors` in `dir` whose shapes the kernels take; the others, and
/// a missing folder, are notes (the goldens are optional here; their own tests are strict).
fn golden_cases(dir: &Path, notes: &mut Vec<String>) -> Vec<Case> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        notes.push(format!("goldens: skipped, no folder {}", dir.display()));
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        notes.push(format!(
            "goldens: skipped, no .safetensors in {}",
            dir.display()
        ));
    }
    let mut out = Vec::new();
    for path in files {
        let file = path
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .to_string();
        // The goldens are a few hundred KiB; a file far beyond that is not one.
        let bytes = match kernels::files::read_bounded(&path, 1 << 30) {
            Ok(b) => b,
            Err(e) => {
                notes.push(format!("goldens: skipped {file}: {e}"));
                continue;
            }
        };
        let st = match safetensors::SafeTensors::deserialize(&bytes) {
            Ok(st) => st,
            Err(e) => {
                notes.push(format!("goldens: skipped {file}: {e}"));
                continue;
            }
        };
        let f = GoldenFile { st };
        let mut names: Vec<String> =
            f.st.names()
                .into_iter()
                .filter_map(|n| n.strip_suffix(".routing").map(str::to_string))
                .collect();
        names.sort();
        if names.is_empty() {
            notes.push(format!(
                "goldens: skipped {file}: no `<case>.routing` tensor"
            ));
        }
        for name in names {
            // Shapes no tactic takes (hidden not a multiple of 256, inter of 128) are skipped
            // before their weights are regenerated.
            if let Ok((_, hidden)) = f.shape2(&format!("{name}.x"))
                && !hidden.is_multiple_of(256)
            {
                notes.push(format!(
                    "goldens: {file}:{name} not used: hidden {hidden} is not a multiple of 256"
                ));
                continue;
            }
            match load_golden_case(&f, &file, &name) {
                Ok(c) if c.inter.is_multiple_of(128) => out.push(c),
                Ok(c) => notes.push(format!(
                    "goldens: {file}:{name} not used: inter {} is not a multiple of 128",
                    c.inter
                )),
                Err(e) => notes.push(format!("goldens: skipped {file}:{name}: {e}")),
            }
        }
    }
    out
}

// ---------------------------------------------------------------- timing

struct Scenario {
    tokens: usize,
    top_k: usize,
    routings: Vec<MoeDeviceRouting<GpuContext>>,
    acts: MoeDeviceActivations<GpuContext>,
}

/// Routings that cycle through all experts: each token's `top_k` experts are consecutive in
/// a random permutation, and successive routings continue where the last one stopped, so a
/// cycle of launches touches every expert (the whole 1.2 GB) once.
fn rotating_routings(rng: &mut Rng, tokens: usize, top_k: usize, experts: usize) -> Vec<Routing> {
    let mut perm: Vec<u32> = (0..experts as u32).collect();
    for i in (1..experts).rev() {
        perm.swap(i, rng.below(i + 1));
    }
    let per_launch = tokens * top_k;
    let count = experts.div_ceil(per_launch).clamp(1, 64);
    (0..count)
        .map(|r| {
            let ids: Vec<u32> = (0..per_launch)
                .map(|i| perm[(r * per_launch + i) % experts])
                .collect();
            Routing {
                top_k,
                weights: (0..per_launch).map(|_| 0.125).collect(),
                experts: ids,
            }
        })
        .collect()
}

/// Host side of the timing setup: the weights of one layer's 384 experts at the TP8 shard
/// (inter 256 of 2048), and per batch size a set of rotating routings and activations.
struct TimingInputs {
    weights: MoeWeightsHost,
    /// `(tokens, top_k, routings, x as BF16 bits)`
    scenarios: Vec<(usize, usize, Vec<GroupedRouting>, Vec<u16>)>,
}

fn timing_inputs(rng: &mut Rng) -> TimingInputs {
    let (experts, hidden, inter, top_k) = (384, 7168, 256, 8);
    let weights = random_moe_weights(rng.next_u64(), experts, hidden, inter);
    let scenarios = [1usize, 16, 128]
        .into_iter()
        .map(|tokens| {
            let routings = rotating_routings(rng, tokens, top_k, experts)
                .iter()
                .map(|r| GroupedRouting::new(r, experts).expect("routing within the experts"))
                .collect();
            let x = (0..tokens * hidden)
                .map(|_| bf16::from_f32(rng.sym() * 4.0).to_bits())
                .collect();
            (tokens, top_k, routings, x)
        })
        .collect();
    TimingInputs { weights, scenarios }
}

/// The correctness cases: Kimi-K2.5's hidden size at the TP8 and TP4 intermediate shards,
/// a decode-sized batch and one where an expert gets more tokens than any tile_m, plus the
/// goldens found in `golden_dir`.
fn correctness_cases(rng: &mut Rng, golden_dir: &Path, notes: &mut Vec<String>) -> Vec<Case> {
    let mut cases = vec![
        random_case("decode_t4_e16_i256", rng, 4, 8, 16, 7168, 256),
        random_case("grouped_t80_e16_i512", rng, 80, 8, 16, 7168, 512),
    ];
    cases.extend(golden_cases(golden_dir, notes));
    cases
}

/// `--prepare-only`: everything the check does on the host, without a GPU: shows that the
/// inputs build (no panic), how long that takes on this machine, and that the host layouts,
/// read as `moe_gemm.cu` addresses them, reproduce each case's reference (the small ones).
fn prepare_only(args: &Args) -> ExitCode {
    let mut rng = Rng(args.seed);
    let t0 = Instant::now();
    let mut notes = Vec::new();
    let cases = correctness_cases(&mut rng, &args.golden_dir, &mut notes);
    for n in &notes {
        println!("gpu-check: {n}");
    }
    for c in &cases {
        let g = GroupedRouting::new(&c.routing, c.experts()).expect("case routing");
        let _ = c.weights.scales(ScaleLoad::Swizzled128x4);
        println!(
            "gpu-check: case {}: {} tokens, {} assignments, max {} per expert, reference |out|max {:.3e}",
            c.name,
            c.routing.tokens(),
            g.assignments(),
            g.max_per_expert,
            c.reference.iter().fold(0.0f32, |m, v| m.max(v.abs()))
        );
    }
    println!(
        "gpu-check: cases built in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    // The host layouts read the way the kernels address them (a serial CPU model of
    // moe_gemm.cu) must reproduce each case's reference: checks everything up to the launch.
    let mut failed = 0;
    for c in &cases {
        let g = GroupedRouting::new(&c.routing, c.experts()).expect("case routing");
        if g.assignments() * c.hidden * c.inter > 200_000_000 {
            continue;
        }
        let x: Vec<f32> = c
            .x_bf16
            .iter()
            .map(|&b| bf16::from_bits(b).to_f32())
            .collect();
        for layout in [ScaleLoad::Swizzled128x4, ScaleLoad::RowMajor] {
            let cmp = compare(&kernel_model(&c.weights, layout, &g, &x), &c.reference, &[]);
            println!(
                "{} kernel-model {} {layout:?}: rel_l2 {:.1e} max {:.1e}",
                if cmp.passed() { "PASS" } else { "FAIL" },
                c.name,
                cmp.rel_l2,
                cmp.max_abs_rel
            );
            failed += usize::from(!cmp.passed());
        }
    }
    if args.timing {
        let t0 = Instant::now();
        let inputs = timing_inputs(&mut rng);
        let _ = inputs.weights.scales(ScaleLoad::Swizzled128x4);
        for (tokens, _, routings, _) in &inputs.scenarios {
            println!(
                "gpu-check: timing T={tokens}: {} rotating routings, {} active experts each",
                routings.len(),
                routings[0].active_experts()
            );
        }
        println!(
            "gpu-check: timing inputs ({:.2} GB of weights) built in {:.1} s",
            (inputs.weights.w13.len() + inputs.weights.w2.len()) as f64 / 1e9,
            t0.elapsed().as_secs_f64()
        );
    }
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

#[derive(Clone, Debug)]
struct Timing {
    tokens: usize,
    iters: usize,
    gate_up_us: f64,
    down_us: f64,
    total_us: f64,
    weight_bytes: f64,
    tb_s: f64,
    copy_fraction: f64,
    tflops: f64,
}

fn time_tactic(
    gpu: &GpuContext,
    k: &MoeKernels<GpuContext>,
    w: &MoeDeviceWeights<GpuContext>,
    sc: &mut Scenario,
    warmup: usize,
    iters: usize,
    copy_bw: f64,
) -> Result<Timing, String> {
    let err = |e: kernels::cuda::CudaError| e.to_string();
    let n = warmup + iters;
    let mut events = Vec::with_capacity(4 * n);
    for _ in 0..4 * n {
        events.push(gpu.timing_event().map_err(err)?);
    }
    for i in 0..n {
        let r = &sc.routings[i % sc.routings.len()];
        let ev = &events[4 * i..4 * i + 4];
        gpu.record(&ev[0]).map_err(err)?;
        k.launch_gate_up(gpu, w, r, &mut sc.acts).map_err(err)?;
        gpu.record(&ev[1]).map_err(err)?;
        sc.acts.zero_out(gpu).map_err(err)?;
        gpu.record(&ev[2]).map_err(err)?;
        k.launch_down(gpu, w, r, &mut sc.acts).map_err(err)?;
        gpu.record(&ev[3]).map_err(err)?;
    }
    gpu.synchronize()
        .map_err(|e| format!("{e} (kernel fault?)"))?;
    let ms = |a: &CudaEvent, b: &CudaEvent| a.elapsed_ms(b).map(|v| v as f64);
    let (mut gu, mut dn, mut tot, mut bw) = (vec![], vec![], vec![], vec![]);
    let mut bytes_sum = 0.0;
    for i in warmup..n {
        let ev = &events[4 * i..4 * i + 4];
        let g = ms(&ev[0], &ev[1]).map_err(|e| e.to_string())?;
        let d = ms(&ev[2], &ev[3]).map_err(|e| e.to_string())?;
        let r = &sc.routings[i % sc.routings.len()];
        let bytes = (r.host.active_experts() * w.bytes_per_expert) as f64;
        bytes_sum += bytes;
        gu.push(g * 1e3);
        dn.push(d * 1e3);
        tot.push((g + d) * 1e3);
        bw.push(bytes / ((g + d) * 1e-3));
    }
    let total_us = median(&mut tot);
    let flops = 6.0 * (sc.tokens * sc.top_k) as f64 * w.hidden as f64 * w.inter as f64;
    let tb_s = median(&mut bw) / 1e12;
    Ok(Timing {
        tokens: sc.tokens,
        iters,
        gate_up_us: median(&mut gu),
        down_us: median(&mut dn),
        total_us,
        weight_bytes: bytes_sum / iters as f64,
        tb_s,
        copy_fraction: tb_s * 1e12 / copy_bw,
        tflops: flops / (total_us * 1e-6) / 1e12,
    })
}

// ---------------------------------------------------------------- main

struct TacticResult {
    tactic: MoeGemmTactic,
    image: Option<PathBuf>,
    registers: Option<(i32, i32)>,
    checks: Vec<(String, Result<Compare, String>)>,
    timings: Vec<Result<Timing, String>>,
}

impl TacticResult {
    fn passed(&self) -> bool {
        !self.checks.is_empty()
            && self
                .checks
                .iter()
                .all(|(_, c)| c.as_ref().is_ok_and(Compare::passed))
    }
}

fn main() -> ExitCode {
    // Asking for help runs nothing.
    if std::env::args().skip(1).any(|a| a == "--help" || a == "-h") {
        println!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("gpu-check: {e}");
            }
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    if args.prepare_only {
        return prepare_only(&args);
    }
    let started = Instant::now();
    let gpu = match GpuContext::new(args.device, &args.ptx_dir) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("gpu-check: skipped: no GPU ({e})");
            return ExitCode::from(2);
        }
    };
    let info = gpu.info().clone();
    println!(
        "gpu-check: device {} '{}' cc {}.{}, {} SMs, L2 {} MB, smem opt-in {} B, {:.1} GB, \
         driver {}.{}",
        info.ordinal,
        info.name,
        info.compute_capability.0,
        info.compute_capability.1,
        info.multiprocessors,
        info.l2_bytes >> 20,
        info.smem_optin_per_block,
        info.total_mem as f64 / 1e9,
        info.driver_version / 1000,
        info.driver_version % 1000 / 10
    );
    let sm = match gpu.sm() {
        Ok(sm) => sm,
        Err(e) => {
            eprintln!("gpu-check: {e}");
            return ExitCode::from(2);
        }
    };
    // The family's space through the one tactic abstraction: what the gate built for this SM,
    // each validated against its limits.
    let tactics: Vec<MoeGemmTactic> = MoeGemmTactic::space(sm)
        .into_iter()
        .filter(|t| t.fits_on(sm))
        .filter(|t| {
            args.filter
                .as_ref()
                .is_none_or(|f| t.tactic_id().contains(f))
        })
        .collect();
    println!(
        "gpu-check: {} tactics for {sm} from {}, seed {}",
        tactics.len(),
        args.ptx_dir.display(),
        args.seed
    );
    if tactics.is_empty() {
        eprintln!("gpu-check: no tactic matches");
        return ExitCode::from(2);
    }

    // Correctness cases (Kimi-K2.5 hidden size; TP8 and TP4 intermediate shards).
    let mut rng = Rng(args.seed);
    let t0 = Instant::now();
    let mut notes = Vec::new();
    let cases = correctness_cases(&mut rng, &args.golden_dir, &mut notes);
    for n in &notes {
        println!("gpu-check: {n}");
    }
    println!(
        "gpu-check: {} correctness cases ready in {:.1} s (CPU reference)",
        cases.len(),
        t0.elapsed().as_secs_f64()
    );
    let layouts = [ScaleLoad::Swizzled128x4, ScaleLoad::RowMajor];
    let mut dev_cases = Vec::new();
    for c in &cases {
        let up = MoeDeviceWeights::upload(&gpu, &c.weights, &layouts).and_then(|w| {
            let g = GroupedRouting::new(&c.routing, c.experts())?;
            Ok((w, MoeDeviceRouting::upload(&gpu, g)?))
        });
        dev_cases.push(up.map_err(|e| e.to_string()));
    }

    let mut results: Vec<TacticResult> = Vec::new();
    for &t in &tactics {
        let mut r = TacticResult {
            tactic: t,
            image: None,
            registers: None,
            checks: Vec::new(),
            timings: Vec::new(),
        };
        match MoeKernels::load(&gpu, t) {
            Err(e) => r.checks.push(("load".into(), Err(e.to_string()))),
            Ok(k) => {
                r.image = Some(k.gate_up.image.clone());
                r.registers = Some((k.gate_up.registers, k.down.registers));
                for (c, dev) in cases.iter().zip(&dev_cases) {
                    // A golden may have shapes a tactic cannot take (the tiny test models);
                    // the random cases are Kimi's shapes, which every tactic must take.
                    if let Err(e) = check_problem(&t, c.hidden, c.inter)
                        && c.name.starts_with("golden:")
                    {
                        println!("gpu-check: {t}: {} skipped: {e}", c.name);
                        continue;
                    }
                    let res = match dev {
                        Ok(dev) => check_case(&gpu, &k, dev, c),
                        Err(e) => Err(e.clone()),
                    };
                    r.checks.push((c.name.clone(), res));
                }
            }
        }
        let status = if r.passed() { "PASS" } else { "FAIL" };
        let detail: Vec<String> = r
            .checks
            .iter()
            .map(|(n, c)| match c {
                Ok(c) => format!(
                    "{n}: rel_l2 {:.1e} max {:.1e} rerun {:.0e}{}{}",
                    c.rel_l2,
                    c.max_abs_rel,
                    c.run_to_run,
                    if c.non_finite > 0 {
                        format!(" nonfinite {}", c.non_finite)
                    } else {
                        String::new()
                    },
                    if c.unwritten_h > 0 {
                        format!(" unwritten-h {}", c.unwritten_h)
                    } else {
                        String::new()
                    }
                ),
                Err(e) => format!("{n}: ERROR {e}"),
            })
            .collect();
        println!("{status} {t}  {}", detail.join("; "));
        results.push(r);
    }
    drop(dev_cases);

    // Timing.
    let mut copy_bw = f64::NAN;
    let mut timing_notes = Vec::new();
    if args.timing && results.iter().any(TacticResult::passed) {
        match gpu.copy_bandwidth(1 << 30, 3, 10) {
            Ok(bw) => copy_bw = bw,
            Err(e) => timing_notes.push(format!("copy bandwidth failed: {e}")),
        }
        println!(
            "gpu-check: device copy bandwidth {:.2} TB/s (1 GiB cuMemcpyDtoD, read + write)",
            copy_bw / 1e12
        );
        let t0 = Instant::now();
        let inputs = timing_inputs(&mut rng);
        let (experts, hidden, inter) = (
            inputs.weights.experts,
            inputs.weights.hidden,
            inputs.weights.inter,
        );
        let setup = MoeDeviceWeights::upload(&gpu, &inputs.weights, &layouts).and_then(|w| {
            let mut scenarios = Vec::new();
            for (tokens, top_k, routings, x) in &inputs.scenarios {
                let routings = routings
                    .iter()
                    .map(|g| MoeDeviceRouting::upload(&gpu, g.clone()))
                    .collect::<kernels::cuda::Result<Vec<_>>>()?;
                let acts =
                    MoeDeviceActivations::new(&gpu, x, *tokens, hidden, inter, tokens * top_k)?;
                scenarios.push(Scenario {
                    tokens: *tokens,
                    top_k: *top_k,
                    routings,
                    acts,
                });
            }
            Ok((w, scenarios))
        });
        drop(inputs);
        match setup {
            Err(e) => timing_notes.push(format!("timing setup failed: {e}")),
            Ok((w, mut scenarios)) => {
                println!(
                    "gpu-check: timing weights: {experts} experts × {:.2} MB = {:.2} GB on \
                     device, ready in {:.1} s",
                    w.bytes_per_expert as f64 / 1e6,
                    w.device_bytes() as f64 / 1e9,
                    t0.elapsed().as_secs_f64()
                );
                for r in results.iter_mut().filter(|r| r.passed()) {
                    if started.elapsed().as_secs_f64() > args.time_budget_s {
                        timing_notes.push(format!("{}: not timed (time budget)", r.tactic));
                        continue;
                    }
                    let k = match MoeKernels::load(&gpu, r.tactic) {
                        Ok(k) => k,
                        Err(e) => {
                            r.timings.push(Err(e.to_string()));
                            continue;
                        }
                    };
                    // The emulated MMA runs in f64 (for correctness, not speed): time it
                    // only at batch 1, briefly.
                    let emulated = r.tactic.variant == KernelVariant::Sm120EmulatedOnSm90;
                    for sc in scenarios.iter_mut() {
                        if emulated && sc.tokens > 1 {
                            continue;
                        }
                        let iters = if emulated { 5 } else { args.iters };
                        let t = time_tactic(&gpu, &k, &w, sc, 3, iters, copy_bw);
                        r.timings.push(t);
                    }
                    let line: Vec<String> = r
                        .timings
                        .iter()
                        .map(|t| match t {
                            Ok(t) => format!(
                                "T={}: {:.1} µs ({:.1}+{:.1}) {:.2} TB/s {:.0}% copy {:.2} TFLOPS",
                                t.tokens,
                                t.total_us,
                                t.gate_up_us,
                                t.down_us,
                                t.tb_s,
                                100.0 * t.copy_fraction,
                                t.tflops
                            ),
                            Err(e) => format!("ERROR {e}"),
                        })
                        .collect();
                    println!("TIME {}  {}", r.tactic, line.join("; "));
                }
            }
        }
    } else if !args.timing {
        timing_notes.push("timing disabled (--no-timing)".into());
    }
    for n in &timing_notes {
        println!("gpu-check: {n}");
    }

    // Report.
    let passed = results.iter().filter(|r| r.passed()).count();
    let failed = results.len() - passed;
    let report = json!({
        "device": {"name": info.name, "compute_capability": [info.compute_capability.0, info.compute_capability.1],
                   "sm": sm.arch(), "multiprocessors": info.multiprocessors, "l2_bytes": info.l2_bytes,
                   "smem_optin_per_block": info.smem_optin_per_block, "total_mem": info.total_mem,
                   "driver_version": info.driver_version},
        "seed": args.seed,
        "ptx_dir": args.ptx_dir.display().to_string(),
        "tolerance": {"rel_l2": REL_L2_TOL, "max_abs_over_max_ref": MAX_ABS_TOL},
        "cases": cases.iter().map(|c| json!({"name": c.name, "tokens": c.routing.tokens(),
            "top_k": c.routing.top_k, "experts": c.experts(), "hidden": c.hidden, "inter": c.inter})).collect::<Vec<_>>(),
        "copy_bandwidth_bytes_per_s": if copy_bw.is_finite() { json!(copy_bw) } else { Value::Null },
        "notes": notes.iter().chain(&timing_notes).collect::<Vec<_>>(),
        "tactics": results.iter().map(|r| {
            let checks: BTreeMap<String, Value> = r.checks.iter().map(|(n, c)| (n.clone(), match c {
                Ok(c) => c.json(),
                Err(e) => json!({"error": e, "passed": false}),
            })).collect();
            json!({
                "tactic": r.tactic.id(),
                "variant": format!("{:?}", r.tactic.variant),
                "image": r.image.as_ref().map(|p| p.display().to_string()),
                "registers": r.registers.map(|(a, b)| json!({"moe_gate_up": a, "moe_down": b})),
                "smem": {"moe_gate_up": r.tactic.smem().gate_up, "moe_down": r.tactic.smem().down},
                "passed": r.passed(),
                "checks": checks,
                "timings": r.timings.iter().map(|t| match t {
                    Ok(t) => json!({"tokens": t.tokens, "iters": t.iters, "gate_up_us": t.gate_up_us,
                        "down_us": t.down_us, "total_us": t.total_us, "weight_bytes": t.weight_bytes,
                        "weight_tb_per_s": t.tb_s, "fraction_of_copy": t.copy_fraction, "tflops": t.tflops}),
                    Err(e) => json!({"error": e}),
                }).collect::<Vec<_>>(),
            })
        }).collect::<Vec<_>>(),
        "passed": passed,
        "failed": failed,
        "wall_s": started.elapsed().as_secs_f64(),
    });
    let table = text_table(&results, copy_bw);
    if let Err(e) = write_outputs(&args.out, &report, &table) {
        eprintln!(
            "gpu-check: cannot write results to {}: {e}",
            args.out.display()
        );
    } else {
        println!("gpu-check: results in {}", args.out.display());
    }
    println!("{table}");
    println!("{passed} passed, {failed} failed");
    if failed == 0 && passed > 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn text_table(results: &[TacticResult], copy_bw: f64) -> String {
    let mut s = format!(
        "{:<44} {:>4} {:>9} {:>5} {:>10} {:>10} {:>10} {:>8} {:>6} {:>8}\n",
        "tactic",
        "ok",
        "rel_l2",
        "T",
        "gate_up µs",
        "down µs",
        "total µs",
        "TB/s",
        "%copy",
        "TFLOPS"
    );
    for r in results {
        let worst = r
            .checks
            .iter()
            .filter_map(|(_, c)| c.as_ref().ok().map(|c| c.rel_l2))
            .fold(f64::NAN, f64::max);
        let ok = if r.passed() { "PASS" } else { "FAIL" };
        let timings: Vec<&Timing> = r.timings.iter().filter_map(|t| t.as_ref().ok()).collect();
        if timings.is_empty() {
            s += &format!("{:<44} {:>4} {:>9.1e}\n", r.tactic.id(), ok, worst);
        }
        for (i, t) in timings.iter().enumerate() {
            let (name, ok, rel) = if i == 0 {
                (r.tactic.id(), ok, format!("{worst:.1e}"))
            } else {
                (String::new(), "", String::new())
            };
            s += &format!(
                "{:<44} {:>4} {:>9} {:>5} {:>10.1} {:>10.1} {:>10.1} {:>8.3} {:>6.1} {:>8.2}\n",
                name,
                ok,
                rel,
                t.tokens,
                t.gate_up_us,
                t.down_us,
                t.total_us,
                t.tb_s,
                100.0 * t.copy_fraction,
                t.tflops
            );
        }
    }
    if copy_bw.is_finite() {
        s += &format!("device copy bandwidth: {:.3} TB/s\n", copy_bw / 1e12);
    }
    s
}

fn write_outputs(dir: &Path, report: &Value, table: &str) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(
        dir.join("gpu-check.json"),
        serde_json::to_string_pretty(report).unwrap_or_default() + "\n",
    )?;
    std::fs::write(dir.join("gpu-check.txt"), table)
}
