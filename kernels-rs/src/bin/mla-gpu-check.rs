//! GPU check of the MLA decode kernels (`kernels-rs/src/mla/gpu_check.md`): for every MLA
//! tactic built for the present GPU, the goldens of `golden/gen_mla.py` of its cache widths
//! with one split and with the planned split count (+ combine), the cache-append kernel against
//! `PagedLatentCache`'s encoder (per widths), then bandwidth (cache bytes read per second, Kimi's
//! widths) against the device's copy bandwidth measured in the same run.
//!
//! Build: `cargo build --release --features cuda -p kernels --bin mla-gpu-check`; carry the
//! binary with `ptx/mla/` (the gate's cubins) and `golden/data/mla/`.
//! Run: `mla-gpu-check [--ptx-dir DIR] [--golden-dir DIR] [--tactics SUBSTRING] [--iters N]
//! [--no-timing]`. Exit status: 0 all passed, 1 a check failed, 2 nothing could run.
//!
//! The checks and their bounds are `kernels::mla::check`'s, shared with the host tests.

use std::path::PathBuf;
use std::process::ExitCode;

use kernels::cuda::{GpuContext, default_ptx_dir, median};
use kernels::mla::cache::KvCacheDtype;
use kernels::mla::check::{build_cache, check_append, check_decode, load_golden};
use kernels::mla::launch::{DecodeBatch, DeviceCache, MlaKernels};
use kernels::mla::{MlaDims, MlaTactic};
use kernels::tactic::Tactic;

const L: usize = MlaDims::KIMI.latent;
const R: usize = MlaDims::KIMI.rope;

const USAGE: &str = "usage: mla-gpu-check [--ptx-dir DIR] [--golden-dir DIR] [--tactics SUBSTRING]
    [--iters N] [--no-timing]
GPU check of the MLA decode kernels against the goldens, then their bandwidth. Exit status:
0 all passed, 1 a check failed, 2 nothing could run.";

fn run() -> Result<bool, String> {
    let mut args = std::env::args().skip(1);
    let (mut ptx_dir, mut golden_dir) = (default_ptx_dir(), PathBuf::from("golden/data/mla"));
    let (mut filter, mut iters, mut timing) = (None::<String>, 20usize, true);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--ptx-dir" => ptx_dir = args.next().ok_or("--ptx-dir DIR")?.into(),
            "--golden-dir" => golden_dir = args.next().ok_or("--golden-dir DIR")?.into(),
            "--tactics" => filter = args.next(),
            "--iters" => {
                iters = args
                    .next()
                    .and_then(|n| n.parse().ok())
                    .ok_or("--iters N")?
            }
            "--no-timing" => timing = false,
            other => return Err(format!("unknown argument {other}")),
        }
    }
    let gpu = GpuContext::new(0, ptx_dir).map_err(|e| e.to_string())?;
    let sm = gpu.sm().map_err(|e| e.to_string())?;
    let sms = gpu.info().multiprocessors;
    println!("device {} ({sm}, {sms} SMs)", gpu.info().name);
    // The family's space through the one tactic abstraction (kernel images: the split count
    // is planned per shape below).
    let tactics: Vec<MlaTactic> = MlaTactic::space(sm)
        .into_iter()
        .filter(|t| t.fits_on(sm))
        .filter(|t| {
            filter
                .as_ref()
                .is_none_or(|f| t.tactic_id().contains(f.as_str()))
        })
        .collect();

    let mut goldens = Vec::new();
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&golden_dir)
        .map_err(|e| format!("{}: {e}", golden_dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .filter(|p| !p.ends_with("hf_absorbed.safetensors"))
        .collect();
    paths.sort();
    for p in paths {
        let g = load_golden(&p)?;
        let (cache, queries) = build_cache(g.dims, g.dtype, g.static_scale, &g.lens, &g.seeds);
        let dev = DeviceCache::upload(&gpu, &cache, 0).map_err(|e| e.to_string())?;
        goldens.push((g, cache, queries, dev));
    }

    let mut failures = 0usize;
    let mut loaded = Vec::new();
    for &t in &tactics {
        let k = match MlaKernels::load(&gpu, t) {
            Ok(k) => k,
            Err(e) => {
                println!("FAIL {t}: {e}");
                failures += 1;
                continue;
            }
        };
        for (g, cache, queries, dev) in &goldens {
            if g.dtype.id() != if t.kind.is_fp8() { "fp8" } else { "bf16" } || g.dims != t.dims {
                continue;
            }
            let want = g.expected(t.kind, cache, queries)?;
            let max_len = g.lens.iter().copied().max().unwrap_or(0);
            let planned = t.plan_splits(g.lens.len(), g.heads, max_len, sms);
            let mut batch = DecodeBatch::upload(
                &gpu,
                cache,
                queries,
                g.heads,
                &g.q_abs,
                &g.q_pe,
                t.max_splits as usize,
            )
            .map_err(|e| e.to_string())?;
            for splits in [1, planned] {
                let ok = match check_decode(&gpu, &k, g, dev, &mut batch, splits, &want, |_| {}) {
                    Ok(c) => {
                        println!(
                            "{} {t} {:<18} splits {splits:>3}: row err {:.2e} lse err {:.2e}{}{}",
                            if c.passed() { "ok  " } else { "FAIL" },
                            g.name,
                            c.row_err,
                            c.lse_err,
                            if c.non_finite { " NON-FINITE" } else { "" },
                            if c.reproducible {
                                ""
                            } else {
                                " NOT REPRODUCIBLE"
                            }
                        );
                        c.passed()
                    }
                    Err(e) => {
                        println!("FAIL {t} {}: {e}", g.name);
                        false
                    }
                };
                failures += usize::from(!ok);
            }
        }
        loaded.push(k);
    }

    // mla_append against PagedLatentCache::write(rms_norm(x)), per widths, dtype and scale
    // mode.
    for dims in MlaDims::BUILT {
        for (dtype, static_scale) in [
            (KvCacheDtype::Bf16, None),
            (KvCacheDtype::Fp8E4m3, None),
            (KvCacheDtype::Fp8E4m3, Some(5.0f32 / 448.0)),
        ] {
            let Some(k) = loaded.iter().find(|k| {
                k.tactic.kind.is_fp8() == (dtype != KvCacheDtype::Bf16) && k.tactic.dims == dims
            }) else {
                continue;
            };
            let c = check_append(&gpu, k, dtype, static_scale)?;
            println!(
                "{} append {} {dims} static scale {static_scale:?}: {} values one step off, {} \
                 further",
                if c.passed() { "ok  " } else { "FAIL" },
                dtype.id(),
                c.one_step_off,
                c.further
            );
            failures += usize::from(!c.passed());
        }
    }

    if timing {
        let copy_bw = gpu
            .copy_bandwidth(1 << 30, 3, 10)
            .map_err(|e| e.to_string())?;
        println!("copy bandwidth {:.0} GB/s (read + write)", copy_bw / 1e9);
        for (b, len, heads) in [(1usize, 65536usize, 8usize), (1, 65536, 64), (32, 4096, 8)] {
            for dtype in [KvCacheDtype::Bf16, KvCacheDtype::Fp8E4m3] {
                let lens = vec![len; b];
                let seeds: Vec<u64> = (0..b as u64).map(|i| 9000 + i).collect();
                let (cache, queries) = build_cache(MlaDims::KIMI, dtype, None, &lens, &seeds);
                let dev = DeviceCache::upload(&gpu, &cache, 0).map_err(|e| e.to_string())?;
                let q_abs: Vec<f32> = (0..b * heads * L)
                    .map(|i| ((i % 97) as f32 - 48.0) / 200.0)
                    .collect();
                let q_pe: Vec<f32> = (0..b * heads * R)
                    .map(|i| ((i % 89) as f32 - 44.0) / 200.0)
                    .collect();
                let bytes = (b * len * dev.bytes_per_token) as f64;
                for k in loaded
                    .iter()
                    .filter(|k| k.tactic.kind.is_fp8() == dev.fp8 && k.tactic.dims == dev.dims)
                {
                    let t = k.tactic;
                    let splits = t.plan_splits(b, heads, len, sms);
                    let mut batch = DecodeBatch::upload(
                        &gpu,
                        &cache,
                        &queries,
                        heads,
                        &q_abs,
                        &q_pe,
                        t.max_splits as usize,
                    )
                    .map_err(|e| e.to_string())?;
                    let (start, end) = (
                        gpu.timing_event().map_err(|e| e.to_string())?,
                        gpu.timing_event().map_err(|e| e.to_string())?,
                    );
                    let mut times = Vec::new();
                    for i in 0..iters + 3 {
                        gpu.record(&start).map_err(|e| e.to_string())?;
                        k.decode(&gpu, &dev, &mut batch, splits, 0.1447)
                            .map_err(|e| e.to_string())?;
                        gpu.record(&end).map_err(|e| e.to_string())?;
                        end.synchronize().map_err(|e| e.to_string())?;
                        if i >= 3 {
                            times.push(start.elapsed_ms(&end).map_err(|e| e.to_string())? as f64);
                        }
                    }
                    let ms = median(&mut times);
                    let bw = bytes / (ms * 1e-3);
                    println!(
                        "time {t} B={b} len={len} H={heads} splits {splits}: {:.1} µs, {:.0} GB/s cache read, {:.0}% of copy",
                        ms * 1e3,
                        bw / 1e9,
                        100.0 * bw / copy_bw
                    );
                }
            }
        }
    }
    println!("{} tactics, {failures} failed checks", tactics.len());
    Ok(failures == 0)
}

fn main() -> ExitCode {
    // Asking for help runs nothing.
    if std::env::args().skip(1).any(|a| a == "--help" || a == "-h") {
        println!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("mla-gpu-check: {e}");
            ExitCode::from(2)
        }
    }
}
