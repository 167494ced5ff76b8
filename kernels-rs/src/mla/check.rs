//! Correctness checking of the MLA kernels on any [`Device`], one harness for the GPU
//! (`mla-gpu-check`) and the host execution layer (`tests/host_mla.rs`): the goldens of
//! `golden/gen_mla.py` (PyTorch float64 over the same stored cache) with one split and with
//! split + combine, and `mla_append` against [`PagedLatentCache`]'s encoder.
//!
//! Bounds: BF16 and FP8 kinds vs the golden, row-relative ‖Δ‖∞/‖ref‖∞ ≤ [`ROW_TOL`] and
//! |Δlse| ≤ [`LSE_TOL`] (P is rounded to BF16 before P·C, as the kernel does; the lane-level
//! model of the kernel, with exact exp, lands at ≤ 2.7e-3 / 1e-3). `fp8qk` quantizes q to
//! E4M3 per head, so it is compared with the fast CPU path run on that quantized q.

use std::path::Path;

use super::cache::{KvCacheDtype, LatentCacheShape, PagedLatentCache, RawLayer};
use super::golden_hash::token_values;
use super::launch::{DecodeBatch, DeviceCache, MlaKernels};
use super::reference::{AttentionQuery, MlaProblem};
use super::{MlaDims, MlaKind, PAGE_TOKENS, cpu};
use crate::device::Device;
use crate::formats::e4m3::{Overflow, e4m3_to_f32, f32_to_e4m3};
/// Largest accepted row-relative error against the reference.
pub const ROW_TOL: f32 = 1e-2;
/// Largest accepted |Δlse|.
pub const LSE_TOL: f32 = 2e-3;
/// Largest accepted relative difference of an appended token's FP8 scale (2^-20: the
/// summation order of the RMSNorm moves it by a few ulps).
pub const SCALE_REL_TOL: f32 = 1.0 / 1_048_576.0;

/// One golden file of `golden/data/mla/`.
pub struct Golden {
    pub name: String,
    /// The cache row's widths (from the query tensors' shapes).
    pub dims: MlaDims,
    pub dtype: KvCacheDtype,
    pub static_scale: Option<f32>,
    pub lens: Vec<usize>,
    pub seeds: Vec<u64>,
    pub heads: usize,
    pub scale: f32,
    pub q_abs: Vec<f32>,
    pub q_pe: Vec<f32>,
    pub out: Vec<f32>,
    pub lse: Vec<f32>,
}

fn f32s(st: &safetensors::SafeTensors<'_>, name: &str) -> Result<Vec<f32>, String> {
    let t = st.tensor(name).map_err(|e| format!("{name}: {e}"))?;
    Ok(t.data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// The last dimension of tensor `name`.
fn width(st: &safetensors::SafeTensors<'_>, name: &str) -> Result<usize, String> {
    let t = st.tensor(name).map_err(|e| format!("{name}: {e}"))?;
    t.shape()
        .last()
        .copied()
        .ok_or_else(|| format!("{name}: a scalar"))
}

fn i64s(st: &safetensors::SafeTensors<'_>, name: &str) -> Result<Vec<i64>, String> {
    let t = st.tensor(name).map_err(|e| format!("{name}: {e}"))?;
    Ok(t.data()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect())
}

/// Reads one golden file (queries, outputs, and how its cache was filled).
pub fn load_golden(path: &Path) -> Result<Golden, String> {
    // The committed goldens are a few hundred KiB; a file far beyond that is not one.
    const GOLDEN_FILE_LIMIT: u64 = 1 << 30;
    let bytes = crate::files::read_bounded(path, GOLDEN_FILE_LIMIT).map_err(|e| e.to_string())?;
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
    let dims = MlaDims {
        latent: width(&st, "q_abs")?,
        rope: width(&st, "q_pe")?,
    };
    Ok(Golden {
        name: prov["case"].as_str().unwrap_or("?").to_string(),
        dims,
        dtype: if storage == "bf16" {
            KvCacheDtype::Bf16
        } else {
            KvCacheDtype::Fp8E4m3
        },
        static_scale: prov["static_scale_bits"]
            .as_u64()
            .map(|b| f32::from_bits(b as u32)),
        heads: q_abs.len() / (lens.len() * dims.latent),
        seeds: i64s(&st, "seeds")?.iter().map(|&s| s as u64).collect(),
        lens,
        scale: f32s(&st, "softmax_scale")?[0],
        q_abs,
        q_pe: f32s(&st, "q_pe")?,
        out: f32s(&st, "out")?,
        lse: f32s(&st, "lse")?,
    })
}

/// A cache of rows of `dims` holding `lens` requests of hashed tokens, pages interleaved
/// round-robin.
pub fn build_cache(
    dims: MlaDims,
    dtype: KvCacheDtype,
    static_scale: Option<f32>,
    lens: &[usize],
    seeds: &[u64],
) -> (PagedLatentCache, Vec<AttentionQuery>) {
    let shape = LatentCacheShape {
        layers: 1,
        latent_dim: dims.latent,
        rope_dim: dims.rope,
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
    let (mut latent, mut rope) = (vec![0f32; dims.latent], vec![0f32; dims.rope]);
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

/// `(max row-relative error, max |Δlse|, any non-finite)` over rows of `latent` values.
pub fn compare(
    out: &[f32],
    lse: &[f32],
    want: &[f32],
    want_lse: &[f32],
    latent: usize,
) -> (f32, f32, bool) {
    let bad = out.iter().chain(lse).any(|v| !v.is_finite());
    let row = out
        .chunks(latent)
        .zip(want.chunks(latent))
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

/// q_abs (rows of `latent` values) with each (row, head) quantized to E4M3 at amax/448, as
/// `fp8qk` does in the kernel.
pub fn quantize_q(q: &[f32], latent: usize) -> Vec<f32> {
    q.chunks(latent)
        .flat_map(|h| {
            let amax = h.iter().fold(0f32, |m, x| m.max(x.abs()));
            let s = if amax > 0.0 { amax / 448.0 } else { 1.0 };
            h.iter()
                .map(move |x| e4m3_to_f32(f32_to_e4m3(x / s, Overflow::Saturate)) * s)
        })
        .collect()
}

impl Golden {
    /// The output `tactic`'s kind must reproduce: the golden itself, or for `fp8qk` the fast
    /// CPU path on the E4M3-quantized queries the kernel uses.
    pub fn expected(
        &self,
        kind: MlaKind,
        cache: &PagedLatentCache,
        queries: &[AttentionQuery],
    ) -> Result<(Vec<f32>, Vec<f32>), String> {
        if kind != MlaKind::Fp8QkMma {
            return Ok((self.out.clone(), self.lse.clone()));
        }
        let q8 = quantize_q(&self.q_abs, self.dims.latent);
        let problem = MlaProblem {
            layer: 0,
            heads: self.heads,
            queries,
            q_abs: &q8,
            q_pe: &self.q_pe,
            softmax_scale: self.scale,
        };
        let mut o = vec![0f32; self.out.len()];
        let mut l = vec![0f32; self.lse.len()];
        cpu::mla_attention(cache, &problem, &mut o, &mut l).map_err(|e| e.to_string())?;
        Ok((o, l))
    }
}

/// What one decode check measured.
#[derive(Clone, Copy, Debug, Default)]
pub struct DecodeCheck {
    pub row_err: f32,
    pub lse_err: f32,
    pub non_finite: bool,
    /// The second run's outputs equal the first's bit for bit (the kernels have no atomics,
    /// so any difference is an order dependence).
    pub reproducible: bool,
}

impl DecodeCheck {
    pub fn passed(&self) -> bool {
        !self.non_finite && self.reproducible && self.row_err <= ROW_TOL && self.lse_err <= LSE_TOL
    }
}

/// Runs `mla_decode` (+ `mla_combine` when `splits > 1`) twice on freshly poisoned outputs,
/// calling `before_run(run)` first each time, and compares with `want`.
#[allow(clippy::too_many_arguments)]
pub fn check_decode<D: Device>(
    dev: &D,
    kernels: &MlaKernels<D>,
    golden: &Golden,
    cache: &DeviceCache<D>,
    batch: &mut DecodeBatch<D>,
    splits: u32,
    want: &(Vec<f32>, Vec<f32>),
    mut before_run: impl FnMut(usize),
) -> Result<DecodeCheck, String> {
    let mut runs = Vec::with_capacity(2);
    for run in 0..2 {
        batch.poison(dev).map_err(|e| e.to_string())?;
        before_run(run);
        kernels
            .decode(dev, cache, batch, splits, golden.scale)
            .map_err(|e| e.to_string())?;
        runs.push(batch.read(dev).map_err(|e| e.to_string())?);
    }
    let (out, lse) = &runs[0];
    let (row_err, lse_err, non_finite) = compare(out, lse, &want.0, &want.1, golden.dims.latent);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    let reproducible = bits(&runs[0].0) == bits(&runs[1].0) && bits(&runs[0].1) == bits(&runs[1].1);
    Ok(DecodeCheck {
        row_err,
        lse_err,
        non_finite,
        reproducible,
    })
}

/// What the append check measured: values one rounding step off (a last-bit flip of the mean
/// square's warp-order sum) and further off (codes more than one step, FP8 scales more than
/// [`SCALE_REL_TOL`] apart, RoPE values not bit-identical).
#[derive(Clone, Copy, Debug, Default)]
pub struct AppendCheck {
    pub values: usize,
    pub one_step_off: usize,
    pub further: usize,
}

impl AppendCheck {
    pub fn passed(&self) -> bool {
        self.further == 0 && self.one_step_off * 1000 <= self.values
    }
}

/// `mla_append` of 1000 tokens (rows of the tactic's widths) against
/// `PagedLatentCache::write(rms_norm(x))`.
#[allow(non_snake_case)]
pub fn check_append<D: Device>(
    gpu: &D,
    k: &MlaKernels<D>,
    dtype: KvCacheDtype,
    static_scale: Option<f32>,
) -> Result<AppendCheck, String> {
    let n = 1000usize;
    let (L, R) = (k.tactic.dims.latent, k.tactic.dims.rope);
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
            // The scale is amax(y)/448 with y normalized by the root of an L-term sum of
            // squares, which the kernel adds in warp order: measured up to 8 ulps apart on
            // the host, so allow 2^-20 relative; an encoder bug is far larger.
            for (a, b) in hs.iter().zip(&scales) {
                far += usize::from((a - b).abs() > a.abs() * SCALE_REL_TOL);
            }
            for (a, b) in hr.iter().zip(&rope_d) {
                far += usize::from(a.to_bits() != *b);
            }
        }
        RawLayer::F32 { .. } => unreachable!("no F32 kernels"),
    }
    Ok(AppendCheck {
        values: n * L,
        one_step_off: off,
        further: far,
    })
}
