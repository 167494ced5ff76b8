//! GPU check of the host execution layer itself: every probe kernel of `probes/ptx_probe.cu`
//! (one PTX instruction each: the BF16, E4M3 and — on SM120 — block-scaled FP4 `mma.sync`,
//! ldmatrix, cp.async groups, shuffles and votes, the number conversions) runs on the GPU and
//! on the host layer with the same inputs, and the outputs are compared. It checks what the
//! host tests cannot: that the fragment layouts and instruction semantics the host layer was
//! written from are the hardware's.
//!
//! Build: `cargo build --release --features cuda -p cuda-host --bin ptx-probe-check`; the
//! probe cubins come from `scripts/compile-gates.sh` (`ptx/ptx_probe/<sm>/default.cubin`).
//! Run: `ptx-probe-check [--ptx-dir DIR] [--out DIR]`.
//!
//! Bounds: ldmatrix, shuffles, votes, cp.async after its waits and the conversions must agree
//! bit for bit. MMAs: the host sums exactly and rounds once; the hardware's accumulation order
//! is undocumented, so a difference of up to 1e-6 of the tile's largest |D| passes (a wrong
//! layout is off by O(1)), and the share of bit-identical results is reported.
//!
//! Exit status: 0 all agree, 1 a probe disagrees, 2 nothing could run (no driver or device).

use std::path::PathBuf;
use std::process::ExitCode;

use cuda_host::HostDevice;
use cuda_host::probes::{self, inputs};
use kernels::arch::Sm;
use kernels::cuda::{GpuContext, default_ptx_dir};
use kernels::device::Device;
use kernels::moe_gemm::mma_sm120::LaneOperands;
use kernels::rng::Rng;
use serde_json::{Value, json};

const MMA_TOL: f64 = 1e-6;

struct Outcome {
    probe: String,
    passed: bool,
    detail: String,
}

fn mma_agreement(
    gpu: &GpuContext,
    host: &HostDevice,
    kernel: &str,
    cases: usize,
    mut make: impl FnMut(&mut Rng) -> [LaneOperands; 32],
) -> Result<Outcome, String> {
    let mut rng = Rng(0x9e37);
    let (mut identical, mut total, mut worst) = (0usize, 0usize, 0f64);
    for _ in 0..cases {
        let lanes = make(&mut rng);
        let g = probes::mma(gpu, kernel, &lanes).map_err(|e| e.to_string())?;
        let h = probes::mma(host, kernel, &lanes).map_err(|e| e.to_string())?;
        let scale = h
            .iter()
            .flatten()
            .fold(1e-30f64, |m, &v| m.max(f64::from(v).abs()));
        for (gl, hl) in g.iter().zip(&h) {
            for (&a, &b) in gl.iter().zip(hl) {
                total += 1;
                identical += usize::from(a.to_bits() == b.to_bits());
                let d = if a.is_finite() && b.is_finite() {
                    f64::from(a - b).abs() / scale
                } else {
                    f64::INFINITY
                };
                worst = worst.max(d);
            }
        }
    }
    Ok(Outcome {
        probe: kernel.into(),
        passed: worst <= MMA_TOL,
        detail: format!(
            "{cases} random tiles: {identical} of {total} results bit-identical, worst |Δ|/max|D| {worst:.1e}"
        ),
    })
}

fn bitwise<T: PartialEq>(probe: &str, what: &str, gpu: &[T], host: &[T]) -> Outcome {
    let differ =
        gpu.iter().zip(host).filter(|(a, b)| a != b).count() + gpu.len().abs_diff(host.len());
    Outcome {
        probe: probe.into(),
        passed: differ == 0,
        detail: format!("{what}: {differ} of {} differ", host.len()),
    }
}

fn run(ptx_dir: PathBuf) -> Result<Vec<Outcome>, String> {
    let gpu = GpuContext::new(0, ptx_dir).map_err(|e| e.to_string())?;
    let sm = gpu.sm().map_err(|e| e.to_string())?;
    println!("ptx-probe-check: {} ({sm})", gpu.describe());
    let host = HostDevice::new(sm);
    let mut out = Vec::new();
    let e = |e: kernels::device::DeviceError| e.to_string();

    out.push(mma_agreement(&gpu, &host, "probe_mma_bf16", 20, |r| {
        inputs::bf16_problem(r).3
    })?);
    out.push(mma_agreement(&gpu, &host, "probe_mma_e4m3", 20, |r| {
        inputs::e4m3_problem(r).3
    })?);
    if sm == Sm::Sm120 {
        out.push(mma_agreement(&gpu, &host, "probe_mma_nvf4", 40, |r| {
            inputs::nvf4_problem(r).1
        })?);
    } else {
        println!("ptx-probe-check: probe_mma_nvf4 needs sm_120a; {sm} skips it");
    }

    let tile = inputs::ldmatrix_tile();
    for num in [1, 2, 4] {
        for trans in [0, 1] {
            let g = probes::ldmatrix(&gpu, &tile, num, trans).map_err(e)?;
            let h = probes::ldmatrix(&host, &tile, num, trans).map_err(e)?;
            out.push(bitwise(
                &format!("ldmatrix.x{num}{}", if trans == 1 { ".trans" } else { "" }),
                "registers",
                &g,
                &h,
            ));
        }
    }

    let threads = 64u32;
    let src: Vec<u8> = (0..2 * 16 * threads as usize)
        .map(|i| (i * 7 + 1) as u8 | 1)
        .collect();
    let g = probes::cp_async(&gpu, &src, threads, 48).map_err(e)?;
    let h = probes::cp_async(&host, &src, threads, 48).map_err(e)?;
    // Before any wait the GPU may show any state; after wait_group 1 only the first group is
    // defined, after wait_group 0 everything.
    let half = src.len() / 2;
    out.push(bitwise(
        "cp.async wait_group 1",
        "first group",
        &g.middle[..half],
        &h.middle[..half],
    ));
    out.push(bitwise("cp.async wait_group 0", "bytes", &g.late, &h.late));
    let landed_early = g.early[..half]
        .iter()
        .zip(&h.late[..half])
        .filter(|(a, b)| a == b)
        .count();
    println!(
        "ptx-probe-check: cp.async: {landed_early} of {half} bytes had already landed before any \
         wait on the GPU (the host shows none: it is the race the host layer makes visible)"
    );

    let w = inputs::warp_input();
    let g = probes::warp(&gpu, &w).map_err(e)?;
    let h = probes::warp(&host, &w).map_err(e)?;
    out.push(bitwise("shuffles and votes", "lane results", &g, &h));

    let values = inputs::conversion_values(&mut Rng(99), 200_000);
    let g = probes::convert(&gpu, &values).map_err(e)?;
    let h = probes::convert(&host, &values).map_err(e)?;
    out.push(bitwise("__float2bfloat16_rn", "values", &g.bf16, &h.bf16));
    out.push(bitwise(
        "e4m3 satfinite",
        "values",
        &g.e4m3_satfinite,
        &h.e4m3_satfinite,
    ));
    out.push(bitwise(
        "e4m3 nosat",
        "values",
        &g.e4m3_nosat,
        &h.e4m3_nosat,
    ));
    out.push(bitwise(
        "e5m2 satfinite",
        "values",
        &g.e5m2_satfinite,
        &h.e5m2_satfinite,
    ));
    out.push(bitwise(
        "__hmul bf16",
        "squares",
        &g.bf16_square,
        &h.bf16_square,
    ));
    Ok(out)
}

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let mut ptx_dir = default_ptx_dir();
    let mut out_dir: Option<PathBuf> = std::env::var_os("OUT").map(PathBuf::from);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--ptx-dir" => ptx_dir = args.next().map(PathBuf::from).unwrap_or(ptx_dir),
            "--out" => out_dir = args.next().map(PathBuf::from),
            other => {
                eprintln!("ptx-probe-check: unknown argument {other}");
                return ExitCode::from(2);
            }
        }
    }
    let outcomes = match run(ptx_dir) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("ptx-probe-check: {e}");
            return ExitCode::from(2);
        }
    };
    let mut rows: Vec<Value> = Vec::new();
    for o in &outcomes {
        println!(
            "{} {:<24} {}",
            if o.passed { "ok  " } else { "FAIL" },
            o.probe,
            o.detail
        );
        rows.push(json!({"probe": o.probe, "passed": o.passed, "detail": o.detail}));
    }
    let failed = outcomes.iter().filter(|o| !o.passed).count();
    println!(
        "ptx-probe-check: {} probes, {failed} disagree",
        outcomes.len()
    );
    if let Some(dir) = out_dir {
        let _ = std::fs::create_dir_all(&dir);
        let text = serde_json::to_string_pretty(&json!({"probes": rows, "failed": failed}))
            .unwrap_or_default();
        if let Err(e) = std::fs::write(dir.join("ptx-probe-check.json"), text) {
            eprintln!("ptx-probe-check: cannot write results: {e}");
        }
    }
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
