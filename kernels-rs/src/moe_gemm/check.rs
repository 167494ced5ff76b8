//! Correctness checking of the MoE kernels on any [`Device`], one harness for the GPU (the
//! `gpu-check` binary, the GPU tests) and the host execution layer (the host tests): random
//! Kimi-shaped problems with their CPU reference, poisoned buffers, two runs, and the
//! comparison with its tolerance. Timing uses random weights of its own kind
//! ([`random_moe_weights`]).

use half::bf16;
use serde_json::{Value, json};

use super::launch::{
    ExpertWeights, GroupedRouting, H_POISON, MoeDeviceActivations, MoeDeviceRouting,
    MoeDeviceWeights, MoeGroupingBounds, MoeKernels, MoeWeightsHost,
};
use crate::device::Device;
use crate::formats::nvfp4::{Nvfp4Matrix, amax, global_scale_for_amax};
use crate::matrix::MatrixView;
use crate::moe_gemm::ScaleLoad;
use crate::moe_gemm::reference::{ExpertInputAmax, ExpertView, Routing, moe_reference};
use crate::rng::Rng;

/// Largest accepted `‖out − ref‖₂ / ‖ref‖₂`. The kernels and the reference quantize the same
/// activations the same way and differ only in f32 summation order (a correct kernel lands
/// near 1e-6; a rare flipped E2M1 rounding of the intermediate adds one quantization step of
/// one element); a layout or indexing bug lands near 1.
pub const REL_L2_TOL: f64 = 1e-3;
/// Largest accepted `max|out − ref| / max|ref|`.
pub const MAX_ABS_TOL: f64 = 1e-2;
/// Largest accepted relative L2 difference between two runs on the same inputs.
pub const RUN_TO_RUN_TOL: f64 = 1e-5;

/// A correctness case: NVFP4 experts, BF16 activations, routing and the reference output.
pub struct Case {
    pub name: String,
    pub hidden: usize,
    pub inter: usize,
    pub weights: MoeWeightsHost,
    pub routing: Routing,
    pub x_bf16: Vec<u16>,
    pub reference: Vec<f32>,
}

impl Case {
    pub fn experts(&self) -> usize {
        self.weights.experts
    }
}

/// Random weights with per-row gains spanning a few binades, so block scales differ; x with
/// per-token gains and a few outliers; random routing with expert `0` taking every token
/// (more tokens than any tile_m: several token tiles) and the last expert none.
pub fn random_case(
    name: &str,
    rng: &mut Rng,
    tokens: usize,
    top_k: usize,
    experts: usize,
    hidden: usize,
    inter: usize,
) -> Case {
    let matrix = |rng: &mut Rng, rows: usize, cols: usize| -> Vec<f32> {
        let mut v = vec![0.0f32; rows * cols];
        for row in v.chunks_exact_mut(cols) {
            let gain = 0.02 * (1 << rng.below(4)) as f32;
            for x in row.iter_mut() {
                *x = rng.sym() * gain;
            }
        }
        v
    };
    let mut mats: Vec<[Nvfp4Matrix; 3]> = Vec::with_capacity(experts);
    for _ in 0..experts {
        let (g, u, d) = (
            matrix(rng, inter, hidden),
            matrix(rng, inter, hidden),
            matrix(rng, hidden, inter),
        );
        // The fused gate/up kernel has one weight_scale_2 per expert, as ModelOpt exports
        // the pair: quantize both with the scale of their joint amax.
        let gs = global_scale_for_amax(amax(&g).max(amax(&u)));
        let q = |v: &[f32], r, c, s| Nvfp4Matrix::quantize_with_global_scale(v, r, c, s).unwrap();
        mats.push([
            q(&g, inter, hidden, gs),
            q(&u, inter, hidden, gs),
            Nvfp4Matrix::quantize_weight(&d, hidden, inter).unwrap(),
        ]);
    }
    let mut x = vec![0.0f32; tokens * hidden];
    for row in x.chunks_exact_mut(hidden) {
        let gain = 0.5 + rng.below(8) as f32;
        for v in row.iter_mut() {
            *v = rng.sym() * gain;
        }
        row[rng.below(hidden)] *= 20.0;
    }
    // The kernel reads BF16: the reference gets the same rounded values.
    let x_bf16: Vec<u16> = x.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
    let x: Vec<f32> = x_bf16
        .iter()
        .map(|&b| bf16::from_bits(b).to_f32())
        .collect();
    assert!(
        top_k >= 1 && experts > top_k,
        "random_case: top_k {top_k} needs at least {} experts",
        top_k + 1
    );
    let mut ids = Vec::with_capacity(tokens * top_k);
    let mut ws = Vec::with_capacity(tokens * top_k);
    for _ in 0..tokens {
        let mut chosen = vec![0u32];
        while chosen.len() < top_k {
            let e = 1 + rng.below(experts - 2) as u32;
            if !chosen.contains(&e) {
                chosen.push(e);
            }
        }
        for e in chosen {
            ids.push(e);
            ws.push(0.05 + 0.3 * rng.sym().abs());
        }
    }
    let routing = Routing {
        top_k,
        experts: ids,
        weights: ws,
    };
    let a13 = global_scale_for_amax(amax(&x));
    let views = |a2: &[f32]| -> Vec<ExpertView<'_>> {
        mats.iter()
            .zip(a2)
            .map(|([g, u, d], &a2)| ExpertView {
                gate: MatrixView::Nvfp4(g.view()),
                up: MatrixView::Nvfp4(u.view()),
                down: MatrixView::Nvfp4(d.view()),
                gate_up_input_scale: Some(a13),
                down_input_scale: Some(a2),
            })
            .collect()
    };
    // Calibrate the down projection's input_scale as ModelOpt does (max of h per expert):
    // h is computed before its quantization, so the first pass's a2 does not matter.
    let mut out = vec![0.0f32; tokens * hidden];
    let mut cal = ExpertInputAmax::default();
    moe_reference(
        &x,
        hidden,
        &routing,
        &views(&vec![1.0; experts]),
        &mut out,
        Some(&mut cal),
    );
    let a2: Vec<f32> = cal
        .down
        .iter()
        .map(|&m| {
            if m > 0.0 {
                global_scale_for_amax(m)
            } else {
                1.0
            }
        })
        .collect();
    moe_reference(&x, hidden, &routing, &views(&a2), &mut out, None);
    let experts_w: Vec<ExpertWeights<'_>> = mats
        .iter()
        .zip(&a2)
        .map(|([g, u, d], &a2)| ExpertWeights {
            gate: g.view(),
            up: u.view(),
            down: d.view(),
            gate_up_input_scale: a13,
            down_input_scale: a2,
        })
        .collect();
    Case {
        name: name.into(),
        hidden,
        inter,
        weights: MoeWeightsHost::from_experts(&experts_w).unwrap(),
        routing,
        x_bf16,
        reference: out,
    }
}

/// One layer's routed experts with random NVFP4 codes and valid scales: timing needs
/// real-looking bytes (no zeros, no NaN scales), not meaningful values.
pub fn random_moe_weights(
    seed: u64,
    experts: usize,
    hidden: usize,
    inter: usize,
) -> MoeWeightsHost {
    let mut rng = Rng(seed);
    let mut w = MoeWeightsHost {
        experts,
        hidden,
        inter,
        w13: vec![0; experts * 2 * inter * hidden / 2],
        w13_sf: vec![0; experts * 2 * inter * hidden / 16],
        w2: vec![0; experts * hidden * inter / 2],
        w2_sf: vec![0; experts * hidden * inter / 16],
        w13_gs: vec![1e-3; experts],
        a13_gs: vec![1e-3; experts],
        w2_gs: vec![1e-3; experts],
        a2_gs: vec![1e-3; experts],
    };
    rng.fill_bytes(&mut w.w13);
    rng.fill_bytes(&mut w.w2);
    // UE4M3 codes 0x28..0x47: 2^-2 .. 2^1, far from NaN (0x7F) and subnormals.
    for b in w.w13_sf.iter_mut().chain(w.w2_sf.iter_mut()) {
        *b = 0x28 + (rng.next_u64() % 32) as u8;
    }
    w
}

#[derive(Clone, Debug, Default)]
pub struct Compare {
    pub rel_l2: f64,
    pub max_abs_rel: f64,
    pub non_finite: usize,
    pub unwritten_h: usize,
    /// `‖run₁ − run₂‖₂ / ‖run₁‖₂` of two runs on the same inputs: only the order of
    /// `moe_down`'s atomic f32 additions may differ, so anything above rounding is a race.
    pub run_to_run: f64,
}

impl Compare {
    pub fn passed(&self) -> bool {
        self.non_finite == 0
            && self.unwritten_h == 0
            && self.rel_l2 <= REL_L2_TOL
            && self.max_abs_rel <= MAX_ABS_TOL
            && self.run_to_run <= RUN_TO_RUN_TOL
    }
    pub fn json(&self) -> Value {
        json!({"rel_l2": self.rel_l2, "max_abs_over_max_ref": self.max_abs_rel,
               "non_finite": self.non_finite, "unwritten_h_scales": self.unwritten_h,
               "run_to_run_rel_l2": self.run_to_run, "passed": self.passed()})
    }
}

pub fn compare(out: &[f32], reference: &[f32], h_sf: &[u8]) -> Compare {
    let (mut d2, mut r2, mut dmax, mut rmax) = (0.0f64, 0.0f64, 0.0f64, 0.0f64);
    let mut non_finite = 0;
    for (&o, &r) in out.iter().zip(reference) {
        if !o.is_finite() {
            non_finite += 1;
            continue;
        }
        let d = (o as f64 - r as f64).abs();
        d2 += d * d;
        r2 += (r as f64).powi(2);
        dmax = dmax.max(d);
        rmax = rmax.max((r as f64).abs());
    }
    Compare {
        rel_l2: if r2 > 0.0 {
            (d2 / r2).sqrt()
        } else {
            d2.sqrt()
        },
        max_abs_rel: if rmax > 0.0 { dmax / rmax } else { dmax },
        non_finite,
        unwritten_h: h_sf.iter().filter(|&&b| b == H_POISON).count(),
        run_to_run: 0.0,
    }
}

/// Runs `kernels` on a case with poisoned buffers and compares with its reference.
pub fn check_case<D: Device>(
    gpu: &D,
    kernels: &MoeKernels<D>,
    dev: &(MoeDeviceWeights<D>, MoeDeviceRouting<D>),
    case: &Case,
) -> Result<Compare, String> {
    check_case_with(gpu, kernels, dev, case, |_| {})
}

/// [`check_case`], calling `before_run(run)` before each of the two runs (the host layer
/// changes its thread and block schedule there, so the runs execute in different orders).
/// The first run's grid fits the routing exactly; the second's spans every expert the
/// assignments could reach (as a CUDA graph's must) with one token tile per pass, so the CTAs
/// past the active experts exit and those of an expert with several tiles loop over them.
pub fn check_case_with<D: Device>(
    gpu: &D,
    kernels: &MoeKernels<D>,
    dev: &(MoeDeviceWeights<D>, MoeDeviceRouting<D>),
    case: &Case,
    mut before_run: impl FnMut(usize),
) -> Result<Compare, String> {
    let (w, r) = dev;
    let a = r.host.assignments();
    let mut acts = MoeDeviceActivations::new(
        gpu,
        &case.x_bf16,
        case.routing.tokens(),
        case.hidden,
        case.inter,
        a,
    )
    .map_err(|e| e.to_string())?;
    // Two runs, each on freshly poisoned buffers: the worse comparison counts, and their
    // difference exposes races (a moving error) that one run cannot.
    let mut runs = Vec::with_capacity(2);
    for run in 0..2 {
        if run > 0 {
            acts.poison(gpu).map_err(|e| e.to_string())?;
        }
        before_run(run);
        let bounds = if run == 0 {
            r.host.exact_bounds()
        } else {
            MoeGroupingBounds {
                tokens_per_pass: 1,
                ..MoeGroupingBounds::for_tokens(r.host.tokens, r.host.top_k, r.host.experts)
            }
        };
        kernels
            .run_with_bounds(gpu, w, r, &mut acts, &bounds)
            .map_err(|e| e.to_string())?;
        gpu.synchronize()
            .map_err(|e| format!("{e} (kernel fault?)"))?;
        let out = acts.read_out(gpu).map_err(|e| e.to_string())?;
        let (_, h_sf) = acts.read_h(gpu).map_err(|e| e.to_string())?;
        runs.push((compare(&out, &case.reference, &h_sf), out));
    }
    let (second, out2) = runs.pop().expect("two runs");
    let (first, out1) = runs.pop().expect("two runs");
    let mut worst = match (first.passed(), second.passed()) {
        (false, _) => first,
        (true, false) => second,
        (true, true) if second.rel_l2 > first.rel_l2 => second,
        (true, true) => first,
    };
    worst.run_to_run = compare(&out2, &out1, &[]).rel_l2;
    Ok(worst)
}

/// A CPU model of what `moe_gate_up` + `moe_down` compute, written from the addressing in
/// `moe_gemm.cu` (`weight_sf_offset`, the w13 gate/up row map, the h_q/h_sf row strides,
/// `expert_offsets`/`sorted_token_ids`/`sorted_weights`), reading the buffers exactly as
/// the host side prepares them. Ignores tiling, which cannot change what is read where.
/// Serial f64 sums: for small problems and for checking the host layouts without a GPU.
pub fn kernel_model(
    w: &MoeWeightsHost,
    layout: ScaleLoad,
    g: &GroupedRouting,
    x: &[f32],
) -> Vec<f32> {
    use crate::formats::e2m1::e2m1_to_f32;
    use crate::formats::e4m3::ue4m3_to_f32;
    use crate::formats::nvfp4::fake_quantize_row;
    let (h, i) = (w.hidden, w.inter);
    let (w13_sf, w2_sf) = w.scales(layout);
    let swizzled = layout == ScaleLoad::Swizzled128x4;
    // moe_gemm.cu weight_sf_offset(row, col4, k_blocks) + the scale's index in the u32.
    let sf_at = |all: &[u8], base: usize, row: usize, kb: usize, k_blocks: usize| -> f32 {
        let off = if swizzled {
            let cols4 = k_blocks.div_ceil(4);
            (((row / 128) * cols4 + kb / 4) * 32 + row % 32) * 16 + (row % 128 / 32) * 4
        } else {
            row * k_blocks + (kb / 4) * 4
        };
        ue4m3_to_f32(all[base + off + kb % 4])
    };
    let weight = |q: &[u8], qbase: usize, row: usize, k: usize, cols: usize| -> f32 {
        let byte = q[qbase + row * (cols / 2) + k / 2];
        e2m1_to_f32(if k.is_multiple_of(2) { byte } else { byte >> 4 })
    };
    let sf_rows13 = if swizzled {
        (2 * i).div_ceil(128) * 128
    } else {
        2 * i
    };
    let sf_cols13 = if swizzled {
        (h / 16).div_ceil(4) * 4
    } else {
        h / 16
    };
    let sf_rows2 = if swizzled { h.div_ceil(128) * 128 } else { h };
    let sf_cols2 = if swizzled {
        (i / 16).div_ceil(4) * 4
    } else {
        i / 16
    };
    let mut out = vec![0.0f32; g.tokens * h];
    for e in 0..g.experts {
        let (begin, end) = (
            g.expert_offsets[e] as usize,
            g.expert_offsets[e + 1] as usize,
        );
        for a in begin..end {
            let tok = g.sorted_token_ids[a] as usize;
            let mut xq = vec![0.0f32; h];
            fake_quantize_row(&x[tok * h..(tok + 1) * h], w.a13_gs[e], &mut xq);
            let dot13 = |row: usize| -> f64 {
                (0..h)
                    .map(|k| {
                        let wv = weight(&w.w13, e * 2 * i * (h / 2), row, k, h)
                            * sf_at(&w13_sf, e * sf_rows13 * sf_cols13, row, k / 16, h / 16);
                        xq[k] as f64 * wv as f64
                    })
                    .sum::<f64>()
                    * w.w13_gs[e] as f64
            };
            let hv: Vec<f32> = (0..i)
                .map(|j| {
                    let (gate, up) = (dot13(j) as f32, dot13(i + j) as f32);
                    gate / (1.0 + (-gate).exp()) * up
                })
                .collect();
            let mut hq = vec![0.0f32; i];
            fake_quantize_row(&hv, w.a2_gs[e], &mut hq);
            for r in 0..h {
                let acc: f64 = (0..i)
                    .map(|k| {
                        let wv = weight(&w.w2, e * h * (i / 2), r, k, i)
                            * sf_at(&w2_sf, e * sf_rows2 * sf_cols2, r, k / 16, i / 16);
                        hq[k] as f64 * wv as f64
                    })
                    .sum::<f64>()
                    * w.w2_gs[e] as f64;
                out[tok * h + r] += (acc * g.sorted_weights[a] as f64) as f32;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::moe_gemm::launch::kernel_inter;

    /// A random case ([`random_case`]: tokens, top-k, experts, hidden, inter), its
    /// grouping and its BF16 input widened.
    fn random_grouped(seed: u64, shape: [usize; 5]) -> (Case, GroupedRouting, Vec<f32>) {
        let [tokens, top_k, experts, hidden, inter] = shape;
        let case = random_case(
            "random",
            &mut Rng(seed),
            tokens,
            top_k,
            experts,
            hidden,
            inter,
        );
        let g = GroupedRouting::new(&case.routing, case.experts()).unwrap();
        let x = case
            .x_bf16
            .iter()
            .map(|&b| half::bf16::from_bits(b).to_f32())
            .collect();
        (case, g, x)
    }

    #[test]
    fn host_layout_read_as_the_kernels_do_matches_the_reference() {
        // 2I = 192 rows and H = 160 rows: the swizzle's 128-row padding is exercised, and
        // H/16 = 10 scale columns pads to 12.
        let (case, g, x) = random_grouped(3, [6, 3, 6, 160, 96]);
        for layout in [ScaleLoad::Swizzled128x4, ScaleLoad::RowMajor] {
            let out = kernel_model(&case.weights, layout, &g, &x);
            let c = compare(&out, &case.reference, &[]);
            assert!(c.passed(), "{layout:?}: {c:?}");
            assert!(c.rel_l2 < 1e-5, "{layout:?}: {c:?}");
        }
    }

    /// Experts padded to the kernels' intermediate granularity (32 → 64 columns: a small
    /// model's experts, or a TP rank's share) compute what the unpadded ones do, read as the
    /// kernels read them, in both scale layouts; and padding is the identity where nothing is
    /// missing.
    #[test]
    fn padded_experts_compute_the_unpadded_ones_output() {
        assert_eq!(
            [16, 32, 64, 128, 256, 2048].map(kernel_inter),
            [64, 64, 64, 128, 256, 2048]
        );
        let (case, g, x) = random_grouped(5, [7, 2, 5, 128, 32]);
        let padded = case.weights.clone().padded_inter(kernel_inter(32));
        padded.check().unwrap();
        assert_eq!(padded.inter, 64);
        assert_eq!(
            padded.clone().padded_inter(64).w13,
            padded.w13,
            "no-op padding"
        );
        for layout in [ScaleLoad::Swizzled128x4, ScaleLoad::RowMajor] {
            let plain = kernel_model(&case.weights, layout, &g, &x);
            let wide = kernel_model(&padded, layout, &g, &x);
            assert_eq!(plain, wide, "{layout:?}");
            let c = compare(&wide, &case.reference, &[]);
            assert!(c.passed() && c.rel_l2 < 1e-5, "{layout:?}: {c:?}");
        }
        // The padded tensors hold the checkpoint's bytes where they were and zeros elsewhere.
        let (h, i, ip) = (case.hidden, 32, 64);
        for e in 0..case.experts() {
            for half in 0..2 {
                let src = &case.weights.w13[(2 * e + half) * i * h / 2..][..i * h / 2];
                let dst = &padded.w13[(2 * e + half) * ip * h / 2..][..ip * h / 2];
                assert_eq!(&dst[..i * h / 2], src);
                assert!(dst[i * h / 2..].iter().all(|&b| b == 0));
            }
        }
        for (row, padded_row) in case
            .weights
            .w2_sf
            .chunks(i / 16)
            .zip(padded.w2_sf.chunks(ip / 16))
        {
            assert_eq!(&padded_row[..i / 16], row);
            assert!(padded_row[i / 16..].iter().all(|&b| b == 0));
        }
    }

    #[test]
    fn timing_weights_have_valid_scales() {
        let w = random_moe_weights(1, 2, 256, 128);
        w.check().unwrap();
        assert!(w.w13_sf.iter().all(|&b| (0x28..0x48).contains(&b)));
    }
}
