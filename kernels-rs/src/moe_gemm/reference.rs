//! CPU reference of the routed-expert block with the checkpoint's W4A4 semantics:
//!
//! for every token and each of its `top_k` experts `e` with routing weight `w`:
//! `y += w · down_e(q_down(silu(gate_e(q_in(x))) · up_e(q_in(x))))`
//!
//! where `q_in` / `q_down` fake-quantize activations to NVFP4 with the projection's
//! `input_scale` (per-16 dynamic block scales), exactly what an NVFP4 W4A4 kernel feeds its
//! tensor cores. BF16 experts (unquantized checkpoints) skip the activation quantization.
//!
//! Tokens are grouped per expert first, so each expert's weights are read once per call, as a
//! grouped GEMM does; per-token sums run over the `top_k` slots in order, so the result does
//! not depend on thread scheduling.

use rayon::prelude::*;

use crate::dense::dot;
use crate::formats::nvfp4::fake_quantize_row;
use crate::matrix::MatrixView;

/// One routed expert's weights. The intermediate dimension may be a tensor-parallel shard:
/// then the output is a partial sum for the all-reduce.
#[derive(Clone, Copy, Debug)]
pub struct ExpertView<'a> {
    /// `[intermediate, hidden]`
    pub gate: MatrixView<'a>,
    /// `[intermediate, hidden]`
    pub up: MatrixView<'a>,
    /// `[hidden, intermediate]`
    pub down: MatrixView<'a>,
    /// `input_scale` of gate_proj and up_proj (ModelOpt gives the fused pair one value);
    /// `None` for BF16 experts.
    pub gate_up_input_scale: Option<f32>,
    /// `input_scale` of down_proj; `None` for BF16 experts.
    pub down_input_scale: Option<f32>,
}

/// The routing decision: for each token, `top_k` expert ids and weights.
#[derive(Clone, Debug, PartialEq)]
pub struct Routing {
    pub top_k: usize,
    /// `[tokens, top_k]`
    pub experts: Vec<u32>,
    /// `[tokens, top_k]`
    pub weights: Vec<f32>,
}

impl Routing {
    pub fn tokens(&self) -> usize {
        self.experts.len().checked_div(self.top_k).unwrap_or(0)
    }

    /// For each expert, the (token, slot) pairs routed to it, in token order.
    pub fn assignments(&self, num_experts: usize) -> Vec<Vec<(usize, usize)>> {
        let mut per_expert = vec![Vec::new(); num_experts];
        for (i, &e) in self.experts.iter().enumerate() {
            per_expert[e as usize].push((i / self.top_k, i % self.top_k));
        }
        per_expert
    }
}

/// Absolute maxima of the activations entering each expert's projections, for calibrating
/// `input_scale` (ModelOpt's max calibration).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ExpertInputAmax {
    pub gate_up: Vec<f32>,
    pub down: Vec<f32>,
}

/// `out[t] = Σ_k weight[t,k] · expert[t,k](x[t])` over `x: [tokens, hidden]`.
/// If `amax` is given, records the activation maxima per expert (before quantization).
pub fn moe_reference(
    x: &[f32],
    hidden: usize,
    routing: &Routing,
    experts: &[ExpertView<'_>],
    out: &mut [f32],
    amax: Option<&mut ExpertInputAmax>,
) {
    let tokens = routing.tokens();
    let top_k = routing.top_k;
    assert_eq!(x.len(), tokens * hidden);
    assert_eq!(out.len(), tokens * hidden);
    let assignments = routing.assignments(experts.len());

    // Per (token, slot) expert outputs, summed afterwards in slot order.
    let per_expert: Vec<(Vec<f32>, f32, f32)> = experts
        .par_iter()
        .zip(&assignments)
        .map(|(expert, assigned)| expert_forward(x, hidden, expert, assigned))
        .collect();

    let mut slot_outputs = vec![0.0f32; tokens * top_k * hidden];
    for ((outputs, _, _), assigned) in per_expert.iter().zip(&assignments) {
        for (i, &(t, k)) in assigned.iter().enumerate() {
            let w = routing.weights[t * top_k + k];
            let dst = &mut slot_outputs[(t * top_k + k) * hidden..(t * top_k + k + 1) * hidden];
            for (d, &v) in dst.iter_mut().zip(&outputs[i * hidden..(i + 1) * hidden]) {
                *d = w * v;
            }
        }
    }
    for (t, out_row) in out.chunks_exact_mut(hidden).enumerate() {
        out_row.fill(0.0);
        for k in 0..top_k {
            for (o, &v) in out_row
                .iter_mut()
                .zip(&slot_outputs[(t * top_k + k) * hidden..(t * top_k + k + 1) * hidden])
            {
                *o += v;
            }
        }
    }
    if let Some(amax) = amax {
        amax.gate_up.resize(experts.len(), 0.0);
        amax.down.resize(experts.len(), 0.0);
        for (e, (_, gate_up, down)) in per_expert.iter().enumerate() {
            amax.gate_up[e] = amax.gate_up[e].max(*gate_up);
            amax.down[e] = amax.down[e].max(*down);
        }
    }
}

/// Runs one expert on its assigned tokens; returns `[assigned, hidden]` outputs and the
/// activation maxima at its two quantization points.
fn expert_forward(
    x: &[f32],
    hidden: usize,
    expert: &ExpertView<'_>,
    assigned: &[(usize, usize)],
) -> (Vec<f32>, f32, f32) {
    let n = assigned.len();
    if n == 0 {
        return (Vec::new(), 0.0, 0.0);
    }
    let inter = expert.gate.rows();
    let mut inputs = vec![0.0f32; n * hidden];
    let mut amax_in = 0.0f32;
    for (i, &(t, _)) in assigned.iter().enumerate() {
        let row = &x[t * hidden..(t + 1) * hidden];
        amax_in = row.iter().fold(amax_in, |m, v| m.max(v.abs()));
        let dst = &mut inputs[i * hidden..(i + 1) * hidden];
        match expert.gate_up_input_scale {
            Some(scale) => fake_quantize_row(row, scale, dst),
            None => dst.copy_from_slice(row),
        }
    }
    let mut gate = vec![0.0f32; inter];
    let mut up = vec![0.0f32; inter];
    let mut act = vec![0.0f32; n * inter];
    let mut row_values = vec![0.0f32; hidden];
    // gate and up: each weight row read once for all assigned tokens.
    let mut gate_t = vec![0.0f32; n * inter];
    let mut up_t = vec![0.0f32; n * inter];
    for j in 0..inter {
        expert.gate.row_into(j, &mut row_values);
        for i in 0..n {
            gate_t[i * inter + j] = dot(&inputs[i * hidden..(i + 1) * hidden], &row_values);
        }
        expert.up.row_into(j, &mut row_values);
        for i in 0..n {
            up_t[i * inter + j] = dot(&inputs[i * hidden..(i + 1) * hidden], &row_values);
        }
    }
    let mut amax_down = 0.0f32;
    for i in 0..n {
        gate.copy_from_slice(&gate_t[i * inter..(i + 1) * inter]);
        up.copy_from_slice(&up_t[i * inter..(i + 1) * inter]);
        let h: Vec<f32> = gate.iter().zip(&up).map(|(&g, &u)| silu(g) * u).collect();
        amax_down = h.iter().fold(amax_down, |m, v| m.max(v.abs()));
        let dst = &mut act[i * inter..(i + 1) * inter];
        match expert.down_input_scale {
            Some(scale) => fake_quantize_row(&h, scale, dst),
            None => dst.copy_from_slice(&h),
        }
    }
    let mut outputs = vec![0.0f32; n * hidden];
    let mut down_row = vec![0.0f32; inter];
    for j in 0..hidden {
        expert.down.row_into(j, &mut down_row);
        for i in 0..n {
            outputs[i * hidden + j] = dot(&act[i * inter..(i + 1) * inter], &down_row);
        }
    }
    (outputs, amax_in, amax_down)
}

#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::nvfp4::{Nvfp4Matrix, fake_quantize_activations};
    use half::bf16;

    fn values(n: usize, seed: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|i| (((i * 7919 + seed * 104729) % 2003) as f32 / 1001.0 - 1.0) * scale)
            .collect()
    }

    #[test]
    fn matches_a_per_token_loop_with_fake_quantized_activations() {
        let (hidden, inter, num_experts, tokens, top_k) = (32, 48, 4, 5, 2);
        let weights: Vec<[Nvfp4Matrix; 3]> = (0..num_experts)
            .map(|e| {
                [
                    Nvfp4Matrix::quantize_weight(
                        &values(inter * hidden, e * 3, 0.3),
                        inter,
                        hidden,
                    )
                    .unwrap(),
                    Nvfp4Matrix::quantize_weight(
                        &values(inter * hidden, e * 3 + 1, 0.3),
                        inter,
                        hidden,
                    )
                    .unwrap(),
                    Nvfp4Matrix::quantize_weight(
                        &values(hidden * inter, e * 3 + 2, 0.3),
                        hidden,
                        inter,
                    )
                    .unwrap(),
                ]
            })
            .collect();
        let (in_scale, down_scale) = (1.0 / 2688.0, 0.5 / 2688.0);
        let experts: Vec<ExpertView> = weights
            .iter()
            .map(|[g, u, d]| ExpertView {
                gate: MatrixView::Nvfp4(g.view()),
                up: MatrixView::Nvfp4(u.view()),
                down: MatrixView::Nvfp4(d.view()),
                gate_up_input_scale: Some(in_scale),
                down_input_scale: Some(down_scale),
            })
            .collect();
        // Expert 3 gets no token; expert 0 gets most.
        let routing = Routing {
            top_k,
            experts: vec![0, 1, 0, 2, 1, 0, 0, 2, 2, 0],
            weights: values(tokens * top_k, 9, 1.0),
        };
        let x = values(tokens * hidden, 11, 1.0);
        let mut out = vec![0.0; tokens * hidden];
        let mut amax = ExpertInputAmax::default();
        moe_reference(&x, hidden, &routing, &experts, &mut out, Some(&mut amax));
        assert_eq!(amax.gate_up[3], 0.0);
        assert!(amax.gate_up[0] > 0.0 && amax.down[0] > 0.0);

        for t in 0..tokens {
            let xq = fake_quantize_activations(&x[t * hidden..(t + 1) * hidden], hidden, in_scale)
                .unwrap();
            let mut expected = vec![0.0f32; hidden];
            for k in 0..top_k {
                let [g, u, d] = &weights[routing.experts[t * top_k + k] as usize];
                let (gd, ud, dd) = (g.dequantize(), u.dequantize(), d.dequantize());
                let h: Vec<f32> = (0..inter)
                    .map(|j| {
                        let gv: f32 = (0..hidden).map(|i| xq[i] * gd[j * hidden + i]).sum();
                        let uv: f32 = (0..hidden).map(|i| xq[i] * ud[j * hidden + i]).sum();
                        silu(gv) * uv
                    })
                    .collect();
                let hq = fake_quantize_activations(&h, inter, down_scale).unwrap();
                for (j, e) in expected.iter_mut().enumerate() {
                    *e += routing.weights[t * top_k + k]
                        * (0..inter).map(|i| hq[i] * dd[j * inter + i]).sum::<f32>();
                }
            }
            for (a, b) in out[t * hidden..(t + 1) * hidden].iter().zip(&expected) {
                assert!(
                    (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                    "token {t}: {a} vs {b}"
                );
            }
        }
    }

    #[test]
    fn bf16_experts_skip_activation_quantization() {
        let (hidden, inter) = (16, 16);
        let w: Vec<bf16> = values(hidden * inter, 1, 0.5)
            .iter()
            .map(|&v| bf16::from_f32(v))
            .collect();
        let m = MatrixView::Bf16 {
            rows: inter,
            cols: hidden,
            data: &w,
        };
        let expert = ExpertView {
            gate: m,
            up: m,
            down: m,
            gate_up_input_scale: None,
            down_input_scale: None,
        };
        let routing = Routing {
            top_k: 1,
            experts: vec![0],
            weights: vec![2.0],
        };
        let x = values(hidden, 3, 1.0);
        let mut out = vec![0.0; hidden];
        moe_reference(&x, hidden, &routing, &[expert], &mut out, None);
        let wf: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
        let h: Vec<f32> = (0..inter)
            .map(|j| {
                let v: f32 = (0..hidden).map(|i| x[i] * wf[j * hidden + i]).sum();
                silu(v) * v
            })
            .collect();
        for j in 0..hidden {
            let expected = 2.0 * (0..inter).map(|i| h[i] * wf[j * inter + i]).sum::<f32>();
            assert!((out[j] - expected).abs() < 1e-4);
        }
    }
}
