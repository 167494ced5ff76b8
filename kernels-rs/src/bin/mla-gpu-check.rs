//! GPU check of the MLA decode kernels (`kernels-rs/src/mla/gpu_check.md`): for every MLA
//! tactic built for the present GPU, the goldens of `golden/gen_mla.py` with one split and with
//! the planned split count (+ combine), the cache-append kernel against `PagedLatentCache`'s
//! encoder, then bandwidth (cache bytes read per second) against the device's copy bandwidth
//! measured in the same run.
//!
//! Build: `cargo build --release --features cuda -p kernels --bin mla-gpu-check`; carry the
//! binary with `ptx/mla/` (the gate's cubins) and `golden/data/mla/`.
//! Run: `mla-gpu-check [--ptx-dir DIR] [--golden-dir DIR] [--tactics SUBSTRING] [--iters N]
//! [--no-timing]`. Exit status: 0 all passed, 1 a check failed, 2 nothing could run.
//!
//! Bounds: BF16 and FP8 kinds vs the golden (float64 over the same stored cache): row-relative
//! ‖Δ‖∞/‖ref‖∞ ≤ 1e-2 and |Δlse| ≤ 2e-3 (the lane-level model of the kernel, with exact exp,
//! lands at ≤ 2.7e-3 / 1e-3: P is rounded to BF16). `fp8qk` quantizes q to E4M3 per head, so
//! it is compared with the fast CPU path run on that quantized q, with the same bounds.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use kernels::cuda::{GpuContext, default_ptx_dir, median};
use kernels::formats::e4m3::{Overflow, e4m3_to_f32, f32_to_e4m3};
use kernels::mla::cache::{KvCacheDtype, LatentCacheShape, PagedLatentCache, RawLayer};
use kernels::mla::golden_hash::token_values;
use kernels::mla::launch::{DecodeBatch, DeviceCache, MlaKernels};
use kernels::mla::reference::{AttentionQuery, MlaProblem};
use kernels::mla::{MlaKind, MlaTactic, PAGE_TOKENS, cpu};

const L: usize = 512;
const R: usize = 64;
const ROW_TOL: f32 = 1e-2;
const LSE_TOL: f32 = 2e-3;

struct Golden {
    name: String,
    dtype: KvCacheDtype,
    static_scale: Option<f32>,
    lens: Vec<usize>,
    seeds: Vec<u64>,
    heads: usize,
    scale: f32,
    q_abs: Vec<f32>,
    q_pe: Vec<f32>,
    out: Vec<f32>,
    lse: Vec<f32>,
}

fn f32s(st: &safetensors::SafeTensors<'_>, name: &str) -> Result<Vec<f32>, String> {
    let t = st.tensor(name).map_err(|e| format!("{name}: {e}"))?;
    Ok(t.data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

fn i64s(st: &safetensors::SafeTensors<'_>, name: &str) -> Result<Vec<i64>, String> {
    let t = st.tensor(name).map_err(|e| format!("{name}: {e}"))?;
    Ok(t.data()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect())
}

fn load_golden(path: &Path) -> Result<Golden, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| e.to_string())?;
    let prov = meta
        .metadata()
        .as_ref()
        .and_then(|m| m.get("provenance"))
        .ok_or("no provenance")?;
    let prov: serde_json::Value = serde_json::from_str(prov).map_err(|e| e.to_string())?;
    let storage = prov["storage"].as_str().ok_or("no storage")?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| e.to_string())?;
    let lens: Vec<usize> = i64s(&st, "lens")?.iter().map(|&n| n as usize).collect();
    let q_abs = f32s(&st, "q_abs")?;
    Ok(Golden {
        name: prov["case"].as_str().unwrap_or("?").to_string(),
        dtype: if storage == "bf16" {
            KvCacheDtype::Bf16
        } else {
            KvCacheDtype::Fp8E4m3
        },
        static_scale: prov["static_scale_bits"]
            .as_u64()
            .map(|b| f32::from_bits(b as u32)),
        heads: q_abs.len() / (lens.len() * L),
        seeds: i64s(&st, "seeds")?.iter().map(|&s| s as u64).collect(),
        lens,
        scale: f32s(&st, "softmax_scale")?[0],
        q_abs,
        q_pe: f32s(&st, "q_pe")?,
        out: f32s(&st, "out")?,
        lse: f32s(&st, "lse")?,
    })
}

/// A cache holding `lens` requests of hashed tokens, pages interleaved round-robin.
fn build_cache(
    dtype: KvCacheDtype,
    static_scale: Option<f32>,
    lens: &[usize],
    seeds: &[u64],
) -> (PagedLatentCache, Vec<AttentionQuery>) {
    let shape = LatentCacheShape {
        layers: 1,
        latent_dim: L,
        rope_dim: R,
    };
    let pages: usize = lens.iter().map(|n| n.div_ceil(PAGE_TOKENS)).sum();
    let mut cache = PagedLatentCache::new(shape, dtype, pages + 1);
    cache.set_fp8_static_scale(static_scale);
    let seqs: Vec<_> = lens.iter().map(|_| cache.add_sequence()).collect();
    let mut reserved = vec![0usize; lens.len()];
    while reserved.iter().zip(lens).any(|(r, n)| r < n) {
        for (i, &n) in lens.iter().enumerate() {
            if reserved[i] < n {
                let more = PAGE_TOKENS.min(n - reserved[i]);
                cache.reserve(seqs[i], reserved[i] + more).unwrap();
                reserved[i] += more;
            }
        }
    }
    let (mut latent, mut rope) = (vec![0f32; L], vec![0f32; R]);
    for (i, &n) in lens.iter().enumerate() {
        for t in 0..n {
            token_values(seeds[i], t, &mut latent, &mut rope);
            cache.write(0, seqs[i], t, &latent, &rope).unwrap();
        }
        cache.commit(seqs[i], n).unwrap();
    }
    let queries = seqs
        .iter()
        .zip(lens)
        .map(|(&seq, &context)| AttentionQuery { seq, context })
        .collect();
    (cache, queries)
}

/// `(max row-relative error, max |Δlse|, any non-finite)`.
fn compare(out: &[f32], lse: &[f32], want: &[f32], want_lse: &[f32]) -> (f32, f32, bool) {
    let bad = out.iter().chain(lse).any(|v| !v.is_finite());
    let row = out
        .chunks(L)
        .zip(want.chunks(L))
        .map(|(o, w)| {
            let d = o.iter().zip(w).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            d / w.iter().fold(1e-30f32, |m, v| m.max(v.abs()))
        })
        .fold(0f32, f32::max);
    let l = lse
        .iter()
        .zip(want_lse)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    (row, l, bad)
}

/// q_abs with each (row, head) quantized to E4M3 at amax/448, as `fp8qk` does in the kernel.
fn quantize_q(q: &[f32]) -> Vec<f32> {
    q.chunks(L)
        .flat_map(|h| {
            let amax = h.iter().fold(0f32, |m, x| m.max(x.abs()));
            let s = if amax > 0.0 { amax / 448.0 } else { 1.0 };
            h.iter()
                .map(move |x| e4m3_to_f32(f32_to_e4m3(x / s, Overflow::Saturate)) * s)
        })
        .collect()
}

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
    let tactics: Vec<MlaTactic> = MlaTactic::enumerate(sm)
        .into_iter()
        .filter(|t| filter.as_ref().is_none_or(|f| t.id().contains(f.as_str())))
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
        let (cache, queries) = build_cache(g.dtype, g.static_scale, &g.lens, &g.seeds);
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
            if g.dtype.id() != if t.kind.is_fp8() { "fp8" } else { "bf16" } {
                continue;
            }
            let (want, want_lse) = if t.kind == MlaKind::Fp8QkMma {
                let q8 = quantize_q(&g.q_abs);
                let problem = MlaProblem {
                    layer: 0,
                    heads: g.heads,
                    queries,
                    q_abs: &q8,
                    q_pe: &g.q_pe,
                    softmax_scale: g.scale,
                };
                let mut o = vec![0f32; g.out.len()];
                let mut l = vec![0f32; g.lse.len()];
                cpu::mla_attention(cache, &problem, &mut o, &mut l).map_err(|e| e.to_string())?;
                (o, l)
            } else {
                (g.out.clone(), g.lse.clone())
            };
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
                batch.poison(&gpu).map_err(|e| e.to_string())?;
                let r = k
                    .decode(&gpu, dev, &mut batch, splits, g.scale)
                    .and_then(|_| batch.read(&gpu));
                let ok = match r {
                    Ok((out, lse)) => {
                        let (row, l, bad) = compare(&out, &lse, &want, &want_lse);
                        let ok = !bad && row <= ROW_TOL && l <= LSE_TOL;
                        println!(
                            "{} {t} {:<18} splits {splits:>3}: row err {row:.2e} lse err {l:.2e}{}",
                            if ok { "ok  " } else { "FAIL" },
                            g.name,
                            if bad { " NON-FINITE" } else { "" }
                        );
                        ok
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

    // mla_append against PagedLatentCache::write(rms_norm(x)), per dtype and scale mode.
    for (dtype, static_scale) in [
        (KvCacheDtype::Bf16, None),
        (KvCacheDtype::Fp8E4m3, None),
        (KvCacheDtype::Fp8E4m3, Some(5.0f32 / 448.0)),
    ] {
        let Some(k) = loaded
            .iter()
            .find(|k| k.tactic.kind.is_fp8() == (dtype != KvCacheDtype::Bf16))
        else {
            continue;
        };
        failures += usize::from(!check_append(&gpu, k, dtype, static_scale)?);
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
                let (cache, queries) = build_cache(dtype, None, &lens, &seeds);
                let dev = DeviceCache::upload(&gpu, &cache, 0).map_err(|e| e.to_string())?;
                let q_abs: Vec<f32> = (0..b * heads * L)
                    .map(|i| ((i % 97) as f32 - 48.0) / 200.0)
                    .collect();
                let q_pe: Vec<f32> = (0..b * heads * R)
                    .map(|i| ((i % 89) as f32 - 44.0) / 200.0)
                    .collect();
                let bytes = (b * len * dev.bytes_per_token) as f64;
                for k in loaded.iter().filter(|k| k.tactic.kind.is_fp8() == dev.fp8) {
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

fn check_append(
    gpu: &GpuContext,
    k: &MlaKernels<GpuContext>,
    dtype: KvCacheDtype,
    static_scale: Option<f32>,
) -> Result<bool, String> {
    let n = 1000usize;
    let shape = LatentCacheShape {
        layers: 1,
        latent_dim: L,
        rope_dim: R,
    };
    let mut host = PagedLatentCache::new(shape, dtype, n.div_ceil(PAGE_TOKENS));
    host.set_fp8_static_scale(static_scale);
    let seq = host.add_sequence();
    host.reserve(seq, n).unwrap();
    let val = |i: usize| ((i.wrapping_mul(2_654_435_761) >> 5) % 4001) as f32 / 1000.0 - 2.0;
    let latent: Vec<f32> = (0..n * L)
        .map(|i| val(i) * (1.0 + (i / L % 7) as f32))
        .collect();
    let rope: Vec<f32> = (0..n * R).map(|i| val(i + 77)).collect();
    // The kernel reads the norm weight as BF16: give the host the same values.
    let weight: Vec<f32> = (0..L)
        .map(|j| half::bf16::from_f32(1.0 + val(j + 5) / 8.0).to_f32())
        .collect();
    let eps = 1e-6f32;
    for t in 0..n {
        let x = &latent[t * L..(t + 1) * L];
        let ms = x.iter().map(|v| v * v).sum::<f32>() / L as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        let y: Vec<f32> = x.iter().zip(&weight).map(|(v, w)| w * (v * inv)).collect();
        host.write(0, seq, t, &y, &rope[t * R..(t + 1) * R])
            .unwrap();
    }
    host.commit(seq, n).unwrap();
    let slots: Vec<i32> = host
        .slots(seq, n)
        .unwrap()
        .iter()
        .map(|&s| s as i32)
        .collect();
    let empty = PagedLatentCache::new(shape, dtype, n.div_ceil(PAGE_TOKENS));
    let mut dev = DeviceCache::upload(gpu, &empty, 0).map_err(|e| e.to_string())?;
    k.append(
        gpu,
        &mut dev,
        &latent,
        &rope,
        &weight,
        eps,
        &slots,
        static_scale.unwrap_or(0.0),
    )
    .map_err(|e| e.to_string())?;
    let (kv, scales, rope_d) = dev.download(gpu).map_err(|e| e.to_string())?;
    // Warp-order sums of the mean square may flip a last-bit rounding: count, don't demand 0.
    let (mut off, mut far) = (0usize, 0usize);
    match host.raw_layer(0) {
        RawLayer::Bf16 { values } => {
            for (i, v) in values.iter().enumerate() {
                let d = u16::from_le_bytes([kv[2 * i], kv[2 * i + 1]]);
                let diff = (i32::from(d) - i32::from(v.to_bits())).abs();
                off += usize::from(diff != 0);
                far += usize::from(diff > 1);
            }
        }
        RawLayer::Fp8 {
            latent: codes,
            scales: hs,
            rope: hr,
        } => {
            for (a, b) in codes.iter().zip(&kv) {
                let diff = (i32::from(*a) - i32::from(*b)).abs();
                off += usize::from(diff != 0);
                far += usize::from(diff > 1);
            }
            for (a, b) in hs.iter().zip(&scales) {
                far += usize::from((a.to_bits() as i64 - b.to_bits() as i64).abs() > 1);
            }
            for (a, b) in hr.iter().zip(&rope_d) {
                far += usize::from(a.to_bits() != *b);
            }
        }
        RawLayer::F32 { .. } => unreachable!("no F32 kernels"),
    }
    let ok = far == 0 && off * 1000 <= n * L;
    println!(
        "{} append {} static scale {static_scale:?}: {off} values one step off, {far} further",
        if ok { "ok  " } else { "FAIL" },
        dtype.id()
    );
    Ok(ok)
}

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("mla-gpu-check: {e}");
            ExitCode::from(2)
        }
    }
}
