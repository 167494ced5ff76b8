//! Fast CPU grouped GEMM for the routed experts, with the semantics of
//! [`moe_reference`](super::reference::moe_reference): the same W4A4 fake quantization points,
//! bit-identical dequantized weights and quantized activations, the same slot-order sum per
//! token. Only the order of the floating-point accumulation inside each dot product differs
//! (SIMD lanes and FMA), so outputs agree to rounding (see the tests for the tolerance).
//!
//! The work is split into three parallel phases, each over `(expert, row tile)` items so that
//! threads stream disjoint slices of the weights:
//! 1. fake-quantize every routed (token, slot) input row with its expert's `input_scale`;
//! 2. gate and up products, `h = silu(gate) · up`, per tile of intermediate rows;
//!    then fake-quantize `h` with `down_input_scale` per (token, slot);
//! 3. down products per tile of hidden rows; then `out[t] = Σ_k w[t,k] · y[t,k]` in slot order.
//!
//! At decode (at most [`INT_GROUP`] tokens per expert, at least two routed experts per thread)
//! the same steps run as one task per expert instead ([`ByExpert`]): each matrix is one
//! sequential run per thread and the threads join once per call.
//!
//! Each weight row is read once per call for all the tokens routed to its expert and decoded in
//! registers; nothing dequantized is ever written to memory. The tactic's
//! [`MoeDot`] picks the dot products:
//! - [`MoeDot::IntDot`]: the activations are quantized once per (token, expert input) to
//!   integer `2·e2m1` codes with their block scales ([`quantize_row_int`]), and the kernels of
//!   [`cpu_int`](super::cpu_int) compute exact integer block dots. Used when every expert is
//!   NVFP4 with input scales (a W4A4 checkpoint); otherwise the call falls back to:
//! - [`MoeDot::F32Fma`]: fake-quantized f32 activations, stored with each 16-element block in
//!   the kernels' decode order ([`interleave_blocks`]), against weights decoded to f32
//!   ([`cpu_simd`](super::cpu_simd)).
//!
//! The large buffers are reused across calls on a thread (`Scratch`); the loops allocate
//! nothing (a work item allocates at most one row or tile of scratch up front).

use rayon::prelude::*;

use std::cell::Cell;
use std::ops::Range;

use super::cpu_int::{
    INT_GROUP, IntActs, nvfp4_rows_dots_int, padded_blocks, padded_cols, quantize_row_int,
};
use super::cpu_simd::{fake_quantize_row_fast, interleave_blocks, nvfp4_rows_dots};
use super::reference::{ExpertInputAmax, ExpertView, Routing, silu};
use crate::cpu_tactic::{CpuTactic, MoeDot};
use crate::dense::dot;
use crate::isa::Isa;
use crate::matrix::MatrixView;
use crate::scratch::sized;

/// Per-call buffers, kept per thread between calls: a fresh multi-megabyte allocation is fresh
/// pages, whose first-touch faults and zeroing cost as much as streaming a good part of the
/// weights. Every element is written before it is read, so stale contents are harmless.
#[derive(Default)]
struct Scratch {
    xq: Vec<f32>,
    in_amax: Vec<f32>,
    h: Vec<f32>,
    act: Vec<f32>,
    down_amax: Vec<f32>,
    y: Vec<f32>,
    /// The integer quantized inputs of gate/up and of down ([`MoeDot::IntDot`]).
    xq_int: IntBufs,
    act_int: IntBufs,
}

/// Integer activation rows: codes, per-block corrections and scales ([`IntActs`]).
#[derive(Default)]
struct IntBufs {
    codes: Vec<i8>,
    corr: Vec<i32>,
    scales: Vec<f32>,
}

impl IntBufs {
    fn bytes(&self) -> usize {
        self.codes.capacity() + 4 * (self.corr.capacity() + self.scales.capacity())
    }
}

impl Scratch {
    fn bytes(&self) -> usize {
        4 * [
            &self.xq,
            &self.in_amax,
            &self.h,
            &self.act,
            &self.down_amax,
            &self.y,
        ]
        .iter()
        .map(|v| v.capacity())
        .sum::<usize>()
            + self.xq_int.bytes()
            + self.act_int.bytes()
    }
}

/// Larger buffers (a long prefill) are freed after the call rather than kept.
const KEEP_SCRATCH_BYTES: usize = 64 << 20;

thread_local! {
    /// Taken out for the duration of a call (so a nested call would just allocate).
    static SCRATCH: Cell<Scratch> = Cell::default();
}

/// The activations of one expert's rows as a kernel reads them.
#[derive(Clone, Copy)]
enum Acts<'a> {
    /// Fake-quantized (or BF16-path) f32 rows in the kernels' block order.
    F32(&'a [f32]),
    /// Integer rows ([`quantize_row_int`]).
    Int(IntActs<'a>),
}

/// Whether an expert is NVFP4 W4A4 throughout: the integer dots apply.
fn is_w4a4(ex: &ExpertView<'_>) -> bool {
    [ex.gate, ex.up, ex.down]
        .iter()
        .all(|m| matches!(m, MatrixView::Nvfp4(_)))
        && ex.gate_up_input_scale.is_some()
        && ex.down_input_scale.is_some()
}

/// `out[t] = Σ_k weight[t,k] · expert[t,k](x[t])` with the best kernels this CPU supports;
/// a drop-in replacement for [`moe_reference`](super::reference::moe_reference).
pub fn moe_cpu(
    x: &[f32],
    hidden: usize,
    routing: &Routing,
    experts: &[ExpertView<'_>],
    out: &mut [f32],
    amax: Option<&mut ExpertInputAmax>,
) {
    moe_cpu_with(Isa::detect(), x, hidden, routing, experts, out, amax);
}

/// [`moe_cpu`] with an explicit instruction set (tests and benchmarks compare them).
///
/// # Panics
/// If this CPU does not support `isa`, if shapes disagree, or if an expert id is out of range.
pub fn moe_cpu_with(
    isa: Isa,
    x: &[f32],
    hidden: usize,
    routing: &Routing,
    experts: &[ExpertView<'_>],
    out: &mut [f32],
    amax: Option<&mut ExpertInputAmax>,
) {
    moe_cpu_tuned(
        &CpuTactic::DEFAULT,
        isa,
        x,
        hidden,
        routing,
        experts,
        out,
        amax,
    );
}

/// [`moe_cpu_with`] under a tactic: its [`moe_item_bytes`](CpuTactic::moe_item_bytes) sets the
/// work items and its [`moe_dot`](CpuTactic::moe_dot) the dot products. Tactics with the same
/// dot kind give bit-identical results (an item boundary only decides which thread computes a
/// row); the two kinds agree to rounding.
///
/// # Panics
/// As [`moe_cpu_with`], and if the tactic is invalid.
#[allow(clippy::too_many_arguments)]
pub fn moe_cpu_tuned(
    tactic: &CpuTactic,
    isa: Isa,
    x: &[f32],
    hidden: usize,
    routing: &Routing,
    experts: &[ExpertView<'_>],
    out: &mut [f32],
    amax: Option<&mut ExpertInputAmax>,
) {
    moe_cpu_split(
        Split::Auto,
        tactic,
        isa,
        x,
        hidden,
        routing,
        experts,
        out,
        amax,
    );
}

/// How a call's work is split into parallel tasks; every split gives the same bits (the tests
/// force each one; the kernels choose with [`Split::Auto`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(not(test), allow(dead_code))]
enum Split {
    /// [`ByExpert`] where [`Plan::expert_tasks_pay`], else [`Split::Phases`].
    Auto,
    /// Four parallel phases over `(expert, row tile)` items (the module documentation).
    Phases,
    /// One task per routed expert ([`ByExpert`]; calibration, which records activation
    /// maxima, always takes the phases).
    ByExpert,
}

#[allow(clippy::too_many_arguments)]
fn moe_cpu_split(
    split: Split,
    tactic: &CpuTactic,
    isa: Isa,
    x: &[f32],
    hidden: usize,
    routing: &Routing,
    experts: &[ExpertView<'_>],
    out: &mut [f32],
    amax: Option<&mut ExpertInputAmax>,
) {
    if let Err(e) = tactic.validate() {
        panic!("{e}");
    }
    // Checked once here; the SIMD kernels rely on it (and re-check cheaply).
    assert!(isa.is_supported(), "{isa:?} is not supported by this CPU");
    let tokens = routing.tokens();
    let top_k = routing.top_k;
    assert_eq!(x.len(), tokens * hidden, "x is not [{tokens}, {hidden}]");
    assert_eq!(
        out.len(),
        tokens * hidden,
        "out is not [{tokens}, {hidden}]"
    );
    assert_eq!(routing.weights.len(), routing.experts.len());
    let inters: Vec<usize> = experts
        .iter()
        .enumerate()
        .map(|(e, ex)| {
            let inter = ex.gate.rows();
            assert!(
                ex.gate.cols() == hidden
                    && ex.up.cols() == hidden
                    && ex.up.rows() == inter
                    && ex.down.rows() == hidden
                    && ex.down.cols() == inter,
                "expert {e}: gate/up must be [{inter}, {hidden}] and down [{hidden}, {inter}]"
            );
            inter
        })
        .collect();
    let plan = Plan::new(routing, experts.len(), &inters, tactic.moe_item_bytes);
    let int_dot = tactic.moe_dot == MoeDot::IntDot && experts.iter().all(is_w4a4);
    let by_expert = match split {
        Split::Auto => plan.expert_tasks_pay(),
        Split::Phases => false,
        Split::ByExpert => true,
    };
    if by_expert && amax.is_none() && hidden > 0 {
        let by_expert = ByExpert {
            isa,
            int_dot,
            x,
            hidden,
            inters: &inters,
            experts,
            plan: &plan,
        };
        by_expert.run(routing, out);
        return;
    }

    // Phase 1: the quantized inputs, one row per (token, slot) in expert order.
    let mut scratch = SCRATCH.with(Cell::take);
    let in_amax = sized(&mut scratch.in_amax, plan.rows());
    let (pc, pb) = (padded_cols(hidden), padded_blocks(hidden));
    let xq_rows = if int_dot { 0 } else { plan.rows() };
    let xq = sized(&mut scratch.xq, xq_rows * hidden);
    let int_rows = if int_dot { plan.rows() } else { 0 };
    let xq_codes = sized(&mut scratch.xq_int.codes, int_rows * pc);
    let xq_corr = sized(&mut scratch.xq_int.corr, int_rows * pb);
    let xq_scales = sized(&mut scratch.xq_int.scales, int_rows * pb);
    if hidden > 0 && int_dot {
        xq_codes
            .par_chunks_mut(pc)
            .zip(xq_corr.par_chunks_mut(pb))
            .zip(xq_scales.par_chunks_mut(pb))
            .zip(in_amax.par_iter_mut())
            .enumerate()
            .with_min_len(QUANTIZE_ROWS_PER_TASK)
            .for_each(|(r, (((codes, corr), scales), am))| {
                let (t, _) = plan.order[r];
                let row = &x[t * hidden..(t + 1) * hidden];
                *am = row.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let scale = experts[plan.row_expert[r]].gate_up_input_scale;
                ActDst::Int(codes, corr, scales).quantize(isa, row, scale);
            });
    } else if hidden > 0 {
        xq.par_chunks_mut(hidden)
            .zip(in_amax.par_iter_mut())
            .enumerate()
            .with_min_len(QUANTIZE_ROWS_PER_TASK)
            .for_each(|(r, (dst, am))| {
                let (t, _) = plan.order[r];
                let row = &x[t * hidden..(t + 1) * hidden];
                *am = row.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let scale = experts[plan.row_expert[r]].gate_up_input_scale;
                ActDst::F32(dst).quantize(isa, row, scale);
            });
    }

    // Each expert's rows of the gate/up inputs.
    let (xq, xq_codes, xq_corr, xq_scales) = (&*xq, &*xq_codes, &*xq_corr, &*xq_scales);
    let gate_up_acts = |e: usize| {
        let rows = plan.row_start[e]..plan.row_start[e + 1];
        if int_dot {
            Acts::Int(IntActs {
                cols: hidden,
                codes: &xq_codes[rows.start * pc..rows.end * pc],
                corr: &xq_corr[rows.start * pb..rows.end * pb],
                scales: &xq_scales[rows.start * pb..rows.end * pb],
                input_scale: experts[e].gate_up_input_scale.expect("W4A4 expert"),
            })
        } else {
            Acts::F32(&xq[rows.start * hidden..rows.end * hidden])
        }
    };

    // Phase 2a: h = silu(gate) · up, tiled over intermediate rows.
    let h = sized(&mut scratch.h, plan.inter_offset[experts.len()]);
    // Bytes of one gate row plus one up row: what a tile row streams.
    let gate_up_bytes = |e: usize| 2 * (experts[e].gate.bytes() / inters[e].max(1));
    let gate_up_items = plan.items(h, |e| inters[e], gate_up_bytes);
    gate_up_items
        .into_par_iter()
        .for_each_init(Vec::new, |up, item| {
            let e = item.expert;
            let (n, ex, tile) = (plan.count(e), &experts[e], item.rows.len());
            let xe = gate_up_acts(e);
            up.resize(n * tile, 0.0);
            tile_dots(isa, &ex.gate, item.rows.clone(), xe, n, item.out, tile);
            tile_dots(isa, &ex.up, item.rows.clone(), xe, n, up, tile);
            for (g, &u) in item.out.iter_mut().zip(up.iter()) {
                *g = silu(*g) * u;
            }
        });

    // Phase 2b: gather each (token, slot)'s h from its tiles and quantize it. The integer rows
    // of expert e start at int_offset[e] rows of padded_cols(inter) codes (and blocks).
    let down_amax = sized(&mut scratch.down_amax, plan.rows());
    let act = sized(&mut scratch.act, if int_dot { 0 } else { h.len() });
    let (mut code_offset, mut block_offset) = (vec![0usize], vec![0usize]);
    for (e, &inter) in inters.iter().enumerate() {
        let n = if int_dot { plan.count(e) } else { 0 };
        code_offset.push(code_offset[e] + n * padded_cols(inter));
        block_offset.push(block_offset[e] + n * padded_blocks(inter));
    }
    let act_codes = sized(&mut scratch.act_int.codes, code_offset[experts.len()]);
    let act_corr = sized(&mut scratch.act_int.corr, block_offset[experts.len()]);
    let act_scales = sized(&mut scratch.act_int.scales, block_offset[experts.len()]);
    // One destination per row: an f32 row, or integer codes, corrections and scales.
    let dst_rows: Vec<ActDst<'_>> = if int_dot {
        let codes = plan.split_rows(act_codes, |e| padded_cols(inters[e]));
        let corr = plan.split_rows(act_corr, |e| padded_blocks(inters[e]));
        let scales = plan.split_rows(act_scales, |e| padded_blocks(inters[e]));
        codes
            .into_iter()
            .zip(corr)
            .zip(scales)
            .map(|((codes, corr), scales)| ActDst::Int(codes, corr, scales))
            .collect()
    } else {
        plan.split_rows(act, |e| inters[e])
            .into_iter()
            .map(ActDst::F32)
            .collect()
    };
    dst_rows
        .into_par_iter()
        .zip(down_amax.par_iter_mut())
        .enumerate()
        .with_min_len(QUANTIZE_ROWS_PER_TASK)
        .for_each_init(Vec::new, |row, (r, (dst, am))| {
            let e = plan.row_expert[r];
            let (n, inter, i) = (plan.count(e), inters[e], r - plan.row_start[e]);
            let tile_rows = plan.tile_rows(e, gate_up_bytes);
            let base = plan.inter_offset[e];
            row.clear();
            for (tile, c0) in (0..inter).step_by(tile_rows).enumerate() {
                let len = tile_rows.min(inter - c0);
                let start = base + tile * tile_rows * n + i * len;
                row.extend_from_slice(&h[start..start + len]);
            }
            *am = row.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            dst.quantize(isa, row, experts[e].down_input_scale);
        });
    let (act, act_codes, act_corr, act_scales) = (&*act, &*act_codes, &*act_corr, &*act_scales);
    let down_acts = |e: usize| {
        if int_dot {
            let (c, b) = (
                code_offset[e]..code_offset[e + 1],
                block_offset[e]..block_offset[e + 1],
            );
            Acts::Int(IntActs {
                cols: inters[e],
                codes: &act_codes[c],
                corr: &act_corr[b.clone()],
                scales: &act_scales[b],
                input_scale: experts[e].down_input_scale.expect("W4A4 expert"),
            })
        } else {
            Acts::F32(&act[plan.inter_offset[e]..plan.inter_offset[e + 1]])
        }
    };

    // Phase 3: y = down · act, tiled over hidden rows.
    let y = sized(&mut scratch.y, plan.rows() * hidden);
    let down_bytes = |e: usize| experts[e].down.bytes() / hidden.max(1);
    let down_items = plan.items(y, |_| hidden, down_bytes);
    down_items.into_par_iter().for_each(|item| {
        let e = item.expert;
        let tile = item.rows.len();
        tile_dots(
            isa,
            &experts[e].down,
            item.rows,
            down_acts(e),
            plan.count(e),
            item.out,
            tile,
        );
    });

    // Combine in slot order, exactly as the reference: out = Σ_k (w · y).
    if hidden > 0 {
        out.par_chunks_mut(hidden)
            .enumerate()
            .with_min_len(QUANTIZE_ROWS_PER_TASK)
            .for_each(|(t, out_row)| {
                out_row.fill(0.0);
                for k in 0..top_k {
                    let r = plan.slot_row[t * top_k + k];
                    let e = plan.row_expert[r];
                    let (n, i) = (plan.count(e), r - plan.row_start[e]);
                    let w = routing.weights[t * top_k + k];
                    let tile_rows = plan.tile_rows(e, down_bytes);
                    let base = plan.row_start[e] * hidden;
                    for (tile, o) in out_row.chunks_mut(tile_rows).enumerate() {
                        let (len, start) = (o.len(), base + tile * tile_rows * n + i * o.len());
                        for (o, &v) in o.iter_mut().zip(&y[start..start + len]) {
                            *o += w * v;
                        }
                    }
                }
            });
    }

    if let Some(amax) = amax {
        amax.gate_up.resize(experts.len(), 0.0);
        amax.down.resize(experts.len(), 0.0);
        for e in 0..experts.len() {
            let rows = plan.row_start[e]..plan.row_start[e + 1];
            let fold = |v: &[f32]| v.iter().fold(0.0f32, |m, &a| m.max(a));
            amax.gate_up[e] = amax.gate_up[e].max(fold(&in_amax[rows.clone()]));
            amax.down[e] = amax.down[e].max(fold(&down_amax[rows]));
        }
    }
    if scratch.bytes() <= KEEP_SCRATCH_BYTES {
        SCRATCH.with(|s| s.set(scratch));
    }
}

/// The decode path: one task per routed expert, each the whole chain for its few tokens
/// (quantize the inputs, gate and up over all intermediate rows, quantize `h`, down over all
/// hidden rows), where the phase path runs four parallel phases with a join after each.
///
/// Why: at decode every expert streams a few hundred KB per matrix. Measured on a 2-vCPU KVM
/// guest (the `mini` preset's 64 × 384 × 1024 experts, top-8, one token,
/// `examples/moe_decode_speed`): a thread streaming the integer kernel through matrices of
/// 72 KB (the phase path's items) reads at 9.5 GB/s, through 1 MB runs at 16 GB/s; every jump
/// to a new stream costs microseconds before the prefetchers catch up. Here each matrix is
/// one run, the two quantizations run in parallel instead of on one thread, and the threads
/// wait for each other once per call instead of four times. Every product and quantization is
/// the same function of the same values as on the phase path, so the bits are the same.
struct ByExpert<'a> {
    isa: Isa,
    int_dot: bool,
    x: &'a [f32],
    hidden: usize,
    inters: &'a [usize],
    experts: &'a [ExpertView<'a>],
    plan: &'a Plan,
}

thread_local! {
    /// One expert task's buffers, taken out for the task: a few KB per expert at decode.
    static EXPERT_SCRATCH: Cell<ExpertScratch> = Cell::default();
}

/// One expert task's buffers, kept per thread between tasks (and calls).
#[derive(Default)]
struct ExpertScratch {
    input: QuantizedRows,
    gate: Vec<f32>,
    up: Vec<f32>,
    act: QuantizedRows,
}

/// Activation rows quantized for one kernel: integer codes, corrections and scales, or f32
/// rows in the kernels' block order.
#[derive(Default)]
struct QuantizedRows {
    int: IntBufs,
    f32: Vec<f32>,
}

impl QuantizedRows {
    /// Quantizes `rows(i)` for `i < n` (each `cols` wide) with `input_scale` (none: BF16
    /// experts, copied as they are) and returns them as a kernel reads them.
    fn quantize<'s>(
        &'s mut self,
        isa: Isa,
        int_dot: bool,
        n: usize,
        cols: usize,
        input_scale: Option<f32>,
        rows: impl Fn(usize) -> &'s [f32],
    ) -> Acts<'s> {
        if int_dot {
            let (pc, pb) = (padded_cols(cols), padded_blocks(cols));
            let codes = sized(&mut self.int.codes, n * pc);
            let corr = sized(&mut self.int.corr, n * pb);
            let scales = sized(&mut self.int.scales, n * pb);
            for (i, ((codes, corr), scales)) in codes
                .chunks_exact_mut(pc)
                .zip(corr.chunks_exact_mut(pb))
                .zip(scales.chunks_exact_mut(pb))
                .enumerate()
            {
                ActDst::Int(codes, corr, scales).quantize(isa, rows(i), input_scale);
            }
            Acts::Int(IntActs {
                cols,
                codes,
                corr,
                scales,
                input_scale: input_scale.expect("W4A4 expert"),
            })
        } else {
            let dst = sized(&mut self.f32, n * cols);
            for (i, dst) in dst.chunks_exact_mut(cols).enumerate() {
                ActDst::F32(dst).quantize(isa, rows(i), input_scale);
            }
            Acts::F32(dst)
        }
    }
}

impl ByExpert<'_> {
    fn run(&self, routing: &Routing, out: &mut [f32]) {
        let (plan, hidden) = (self.plan, self.hidden);
        // y: each expert's [count, hidden] block, in expert order.
        let mut scratch = SCRATCH.with(Cell::take);
        let y = sized(&mut scratch.y, plan.rows() * hidden);
        let mut tasks = Vec::new();
        let mut rest = &mut *y;
        for e in 0..self.experts.len() {
            let n = plan.count(e);
            if n > 0 {
                let (block, tail) = rest.split_at_mut(n * hidden);
                rest = tail;
                tasks.push((e, block));
            }
        }
        tasks.into_par_iter().for_each(|(e, y)| {
            let mut buffers = EXPERT_SCRATCH.with(Cell::take);
            self.expert(e, &mut buffers, y);
            EXPERT_SCRATCH.with(|s| s.set(buffers));
        });
        let top_k = routing.top_k;
        for (t, out_row) in out.chunks_exact_mut(hidden).enumerate() {
            out_row.fill(0.0);
            for k in 0..top_k {
                let r = plan.slot_row[t * top_k + k];
                let w = routing.weights[t * top_k + k];
                for (o, &v) in out_row.iter_mut().zip(&y[r * hidden..(r + 1) * hidden]) {
                    *o += w * v;
                }
            }
        }
        if scratch.bytes() <= KEEP_SCRATCH_BYTES {
            SCRATCH.with(|s| s.set(scratch));
        }
    }

    /// Expert `e`'s whole chain for its rows; `y` is its `[count, hidden]` output.
    fn expert(&self, e: usize, scratch: &mut ExpertScratch, y: &mut [f32]) {
        let (plan, hidden, isa) = (self.plan, self.hidden, self.isa);
        let (ex, inter, n) = (&self.experts[e], self.inters[e], plan.count(e));
        let first = plan.row_start[e];
        let ExpertScratch {
            input,
            gate,
            up,
            act,
        } = scratch;
        let xe = input.quantize(isa, self.int_dot, n, hidden, ex.gate_up_input_scale, |i| {
            let (t, _) = plan.order[first + i];
            &self.x[t * hidden..(t + 1) * hidden]
        });
        let (gate, up) = (sized(gate, n * inter), sized(up, n * inter));
        for m in [&ex.gate, &ex.up, &ex.down] {
            prime(m);
        }
        tile_dots(isa, &ex.gate, 0..inter, xe, n, gate, inter);
        tile_dots(isa, &ex.up, 0..inter, xe, n, up, inter);
        for (g, &u) in gate.iter_mut().zip(up.iter()) {
            *g = silu(*g) * u;
        }
        let gate = &*gate;
        let acts = act.quantize(isa, self.int_dot, n, inter, ex.down_input_scale, |i| {
            &gate[i * inter..(i + 1) * inter]
        });
        tile_dots(isa, &ex.down, 0..hidden, acts, n, y, hidden);
    }
}

/// Bytes at the start of each of an expert's NVFP4 matrices (and an eighth of it of their
/// scales) that a decode task prefetches before its first product.
const PRIME_BYTES: usize = 4096;

/// Prefetches the first [`PRIME_BYTES`] of `w`'s packed bytes and its first scales: the
/// kernels prefetch 8 KB ahead of where they read, so a matrix's first lines would otherwise
/// arrive one demand miss at a time, and an expert's three matrices lie apart in the
/// checkpoint. The up and down projections' lines arrive while the gate projection runs.
/// Routed experts at decode (`model run`, `mini`, Zen 5, 2 threads, primed and unprimed calls
/// alternating in one process): 0.982–0.986 of the unprimed call time (medians, 7 of 7
/// runs); 8 KB was no better than 4 KB.
fn prime(w: &MatrixView<'_>) {
    #[cfg(target_arch = "x86_64")]
    if let MatrixView::Nvfp4(v) = w {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        let lines = |bytes: &[u8], len: usize| {
            for off in (0..len.min(bytes.len())).step_by(64) {
                // SAFETY: a prefetch never faults; the address lies inside `bytes`.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(bytes.as_ptr().add(off).cast()) };
            }
        };
        lines(v.packed, PRIME_BYTES);
        lines(v.block_scales, PRIME_BYTES / 8);
    }
    let _ = w;
}

/// Rows one task of the quantization and combine phases takes at least: a row is about a
/// microsecond of work, and a decode step's eight are done before another thread would have
/// woken for them.
const QUANTIZE_ROWS_PER_TASK: usize = 16;

/// Where one row's quantized activations go: an f32 row in the kernels' block order, or
/// integer codes, corrections and scales ([`quantize_row_int`]).
enum ActDst<'a> {
    F32(&'a mut [f32]),
    Int(&'a mut [i8], &'a mut [i32], &'a mut [f32]),
}

impl ActDst<'_> {
    /// Quantizes `row` with `input_scale` into this destination; an f32 row without one (a
    /// BF16 expert) is copied as it is.
    ///
    /// # Panics
    /// For integer activations without an input scale (only W4A4 experts get them).
    fn quantize(self, isa: Isa, row: &[f32], input_scale: Option<f32>) {
        match self {
            ActDst::Int(codes, corr, scales) => {
                let scale = input_scale.expect("W4A4 expert");
                quantize_row_int(row, scale, codes, corr, scales);
            }
            ActDst::F32(dst) => {
                match input_scale {
                    Some(scale) => fake_quantize_row_fast(isa, row, scale, dst),
                    None => dst.copy_from_slice(row),
                }
                interleave_blocks(dst);
            }
        }
    }
}

/// `out[t · stride + j] = x[t] · w[rows.start + j]` for `t < n`: NVFP4 tiles go through the
/// SIMD kernels (integer or f32); BF16 weights (unquantized checkpoints) are widened row by
/// row and dotted.
fn tile_dots(
    isa: Isa,
    w: &MatrixView<'_>,
    rows: Range<usize>,
    x: Acts<'_>,
    n: usize,
    out: &mut [f32],
    stride: usize,
) {
    match (w, x) {
        (MatrixView::Nvfp4(v), Acts::Int(x)) => {
            nvfp4_rows_dots_int(isa, v, rows, &x, n, out, stride)
        }
        (MatrixView::Nvfp4(v), Acts::F32(x)) => nvfp4_rows_dots(isa, v, rows, x, n, out, stride),
        (MatrixView::Bf16 { .. }, Acts::Int(_)) => {
            unreachable!("integer activations are only made for W4A4 experts")
        }
        (MatrixView::Bf16 { cols, .. }, Acts::F32(x)) => {
            let mut row = vec![0.0f32; *cols];
            for (j, r) in rows.enumerate() {
                w.row_into(r, &mut row);
                // The activations are stored in the kernels' block order; so must the row be.
                interleave_blocks(&mut row);
                for t in 0..n {
                    out[t * stride + j] = dot(&x[t * cols..(t + 1) * cols], &row);
                }
            }
        }
    }
}

/// Where each (token, slot) goes: rows are grouped by expert, in token order within an expert
/// (the order of [`Routing::assignments`]).
struct Plan {
    /// `(token, slot)` of each row.
    order: Vec<(usize, usize)>,
    /// Expert of each row.
    row_expert: Vec<usize>,
    /// Row index of each `token · top_k + slot`.
    slot_row: Vec<usize>,
    /// First row of each expert; `[experts + 1]`.
    row_start: Vec<usize>,
    /// Offset of each expert's `[count, inter]` block in the `h`/`act` buffers; `[experts + 1]`.
    inter_offset: Vec<usize>,
    /// Weight bytes one work item aims for ([`CpuTactic::moe_item_bytes`]).
    item_bytes: usize,
}

/// One parallel work item: output rows `rows` of `expert`'s weight matrix, for all of its
/// tokens; `out` is `[count, rows.len()]`.
struct Item<'a> {
    expert: usize,
    rows: Range<usize>,
    out: &'a mut [f32],
}

impl Plan {
    fn new(routing: &Routing, num_experts: usize, inters: &[usize], item_bytes: usize) -> Self {
        let mut row_start = vec![0usize; num_experts + 1];
        for &e in &routing.experts {
            assert!(
                (e as usize) < num_experts,
                "expert id {e} out of range ({num_experts} experts)"
            );
            row_start[e as usize + 1] += 1;
        }
        for e in 0..num_experts {
            row_start[e + 1] += row_start[e];
        }
        let rows = routing.experts.len();
        let mut next = row_start.clone();
        let mut order = vec![(0, 0); rows];
        let mut row_expert = vec![0; rows];
        let mut slot_row = vec![0; rows];
        for (i, &e) in routing.experts.iter().enumerate() {
            let r = next[e as usize];
            next[e as usize] += 1;
            order[r] = (i / routing.top_k, i % routing.top_k);
            row_expert[r] = e as usize;
            slot_row[i] = r;
        }
        let mut inter_offset = vec![0usize; num_experts + 1];
        for e in 0..num_experts {
            inter_offset[e + 1] = inter_offset[e] + (row_start[e + 1] - row_start[e]) * inters[e];
        }
        Self {
            order,
            row_expert,
            slot_row,
            row_start,
            inter_offset,
            item_bytes,
        }
    }

    fn rows(&self) -> usize {
        self.order.len()
    }

    /// Whether one task per expert ([`ByExpert`]) is the better split: every routed expert
    /// has at most [`INT_GROUP`] rows (decode: one kernel pass covers them all) and there are
    /// at least two experts per thread to balance the threads.
    fn expert_tasks_pay(&self) -> bool {
        let counts = (0..self.row_start.len() - 1).map(|e| self.count(e));
        let used = counts.clone().filter(|&n| n > 0).count();
        counts.max().is_some_and(|n| n <= INT_GROUP) && used >= 2 * rayon::current_num_threads()
    }

    fn count(&self, e: usize) -> usize {
        self.row_start[e + 1] - self.row_start[e]
    }

    /// Weight rows per item for expert `e`, whose rows take `row_bytes(e)` bytes each: a
    /// multiple of 16 (whole cache lines of scales, at least one tile) near the tactic's
    /// item size.
    fn tile_rows(&self, e: usize, row_bytes: impl Fn(usize) -> usize) -> usize {
        (self.item_bytes / row_bytes(e).max(1))
            .next_multiple_of(16)
            .max(16)
    }

    /// Splits `buf` (laid out expert by expert, `[count, out_rows]` each, tile-major inside)
    /// into work items over tiles of each used expert's `out_rows(e)` weight rows.
    fn items<'a>(
        &self,
        buf: &'a mut [f32],
        out_rows: impl Fn(usize) -> usize,
        row_bytes: impl Fn(usize) -> usize + Copy,
    ) -> Vec<Item<'a>> {
        let mut items = Vec::new();
        let mut rest = buf;
        for e in 0..self.row_start.len() - 1 {
            let n = self.count(e);
            if n == 0 {
                continue;
            }
            let (total, tile) = (out_rows(e), self.tile_rows(e, row_bytes));
            for r0 in (0..total).step_by(tile) {
                let rows = r0..(r0 + tile).min(total);
                let (out, tail) = rest.split_at_mut(n * rows.len());
                rest = tail;
                items.push(Item {
                    expert: e,
                    rows,
                    out,
                });
            }
        }
        assert!(rest.is_empty(), "work items do not cover the buffer");
        items
    }

    /// Splits `buf` (expert by expert, `[count, width(e)]` each) into one slice per row.
    fn split_rows<'a, T>(
        &self,
        buf: &'a mut [T],
        width: impl Fn(usize) -> usize,
    ) -> Vec<&'a mut [T]> {
        let mut rows = Vec::with_capacity(self.rows());
        let mut rest = buf;
        for r in 0..self.rows() {
            let (row, tail) = rest.split_at_mut(width(self.row_expert[r]));
            rest = tail;
            rows.push(row);
        }
        rows
    }
}

#[cfg(test)]
mod tests {
    use half::bf16;

    use super::*;
    use crate::formats::nvfp4::Nvfp4Matrix;
    use crate::moe_gemm::reference::moe_reference;
    use crate::rng::Rng;

    struct Weights {
        mats: Vec<[Nvfp4Matrix; 3]>,
        scales: Vec<(f32, f32)>,
    }

    impl Weights {
        fn new(rng: &mut Rng, num_experts: usize, hidden: usize, inter: usize) -> Self {
            let mats = (0..num_experts)
                .map(|_| {
                    let q = |rng: &mut Rng, r, c| {
                        Nvfp4Matrix::quantize_weight(&rng.sym_values(r * c, 0.05), r, c).unwrap()
                    };
                    [
                        q(rng, inter, hidden),
                        q(rng, inter, hidden),
                        q(rng, hidden, inter),
                    ]
                })
                .collect();
            // Per-expert input scales, some too small so block scales saturate.
            let scales = (0..num_experts)
                .map(|e| (1.0 / (2688.0 * (1 + e % 3) as f32), 0.02 / 2688.0))
                .collect();
            Self { mats, scales }
        }

        fn views(&self) -> Vec<ExpertView<'_>> {
            self.mats
                .iter()
                .zip(&self.scales)
                .map(|([g, u, d], &(si, sd))| ExpertView {
                    gate: MatrixView::Nvfp4(g.view()),
                    up: MatrixView::Nvfp4(u.view()),
                    down: MatrixView::Nvfp4(d.view()),
                    gate_up_input_scale: Some(si),
                    down_input_scale: Some(sd),
                })
                .collect()
        }
    }

    /// Random top-k routing with distinct experts per token; experts in `empty` get nothing and
    /// `heavy` (if any) is in every token's first slot.
    fn routing(
        rng: &mut Rng,
        tokens: usize,
        top_k: usize,
        num_experts: usize,
        empty: &[usize],
        heavy: Option<usize>,
    ) -> Routing {
        let allowed: Vec<usize> = (0..num_experts).filter(|e| !empty.contains(e)).collect();
        assert!(allowed.len() >= top_k);
        let mut experts = Vec::new();
        for _ in 0..tokens {
            let mut chosen: Vec<usize> = heavy.into_iter().collect();
            while chosen.len() < top_k {
                let e = allowed[rng.below(allowed.len())];
                if !chosen.contains(&e) {
                    chosen.push(e);
                }
            }
            experts.extend(chosen.iter().map(|&e| e as u32));
        }
        let weights = (0..tokens * top_k).map(|_| rng.sym().abs()).collect();
        Routing {
            top_k,
            experts,
            weights,
        }
    }

    /// Relative L2 distance and the largest absolute difference.
    fn distance(ours: &[f32], reference: &[f32]) -> (f64, f64) {
        let (mut num, mut den, mut max) = (0.0f64, 0.0f64, 0.0f64);
        for (&a, &b) in ours.iter().zip(reference) {
            let d = (a - b) as f64;
            num += d * d;
            den += (b as f64) * (b as f64);
            max = max.max(d.abs());
        }
        ((num / den.max(f64::MIN_POSITIVE)).sqrt(), max)
    }

    /// Tolerance against the reference: the two differ only in the rounding of the dot
    /// products (accumulation order and FMA fusion for f32; only the cross-block sums for the
    /// exact integer blocks), so 1e-5 relative L2 leaves two orders of magnitude over f32
    /// rounding of these dot products. (A rounding difference that flips one activation across
    /// an E2M1 rounding midpoint would exceed it; none occurs in these cases.)
    const REL_L2: f64 = 1e-5;

    /// Checks both dot kinds against the reference; returns the default tactic's output.
    fn check(
        isa: Isa,
        what: &str,
        x: &[f32],
        hidden: usize,
        routing: &Routing,
        experts: &[ExpertView<'_>],
    ) -> Vec<f32> {
        let tokens = routing.tokens();
        let mut want = vec![0.0; tokens * hidden];
        let mut want_amax = ExpertInputAmax::default();
        moe_reference(x, hidden, routing, experts, &mut want, Some(&mut want_amax));
        let mut default = Vec::new();
        for moe_dot in MoeDot::ALL {
            let tactic = CpuTactic {
                moe_dot,
                ..CpuTactic::DEFAULT
            };
            let what = format!("{what} {}", moe_dot.name());
            let mut got = vec![f32::NAN; tokens * hidden];
            let mut got_amax = ExpertInputAmax::default();
            moe_cpu_tuned(
                &tactic,
                isa,
                x,
                hidden,
                routing,
                experts,
                &mut got,
                Some(&mut got_amax),
            );
            let (rel, max) = distance(&got, &want);
            assert!(
                rel <= REL_L2,
                "{isa:?} {what}: rel L2 {rel:e}, max abs {max:e}"
            );
            assert_eq!(
                got_amax.gate_up, want_amax.gate_up,
                "{isa:?} {what}: input amax"
            );
            for (a, b) in got_amax.down.iter().zip(&want_amax.down) {
                assert!(
                    (a - b).abs() <= 1e-5 * b,
                    "{isa:?} {what}: down amax {a} vs {b}"
                );
            }
            if moe_dot == MoeDot::IntDot && experts.iter().all(is_w4a4) {
                // The integer kernels of every ISA agree bit for bit, and so does the rest.
                let mut scalar = vec![f32::NAN; tokens * hidden];
                moe_cpu_tuned(
                    &tactic,
                    Isa::Scalar,
                    x,
                    hidden,
                    routing,
                    experts,
                    &mut scalar,
                    None,
                );
                assert!(
                    got.iter()
                        .zip(&scalar)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{isa:?} {what}: not bit-identical to the scalar integer path"
                );
            }
            if moe_dot == CpuTactic::DEFAULT.moe_dot {
                default = got;
            }
        }
        default
    }

    #[test]
    fn matches_the_reference_on_many_routings() {
        let mut rng = Rng(7);
        // (hidden, inter, experts, tokens, top_k): odd block counts exercise the kernels' tails;
        // 40 tokens on one expert exercise several token groups.
        let shapes = [
            (64, 32, 4, 1, 1),
            (48, 80, 6, 3, 2),
            (256, 128, 8, 5, 4),
            (128, 64, 5, 40, 2),
            (512, 96, 16, 8, 8),
        ];
        for (case, &(hidden, inter, num_experts, tokens, top_k)) in shapes.iter().enumerate() {
            let w = Weights::new(&mut rng, num_experts, hidden, inter);
            let experts = w.views();
            for (variant, (empty, heavy)) in [
                (vec![], None),
                (vec![num_experts - 1], Some(0)),
                (vec![1], None),
            ]
            .into_iter()
            .enumerate()
            {
                if num_experts - empty.len() < top_k {
                    continue;
                }
                let routing = routing(&mut rng, tokens, top_k, num_experts, &empty, heavy);
                let x = rng.sym_values(tokens * hidden, 1.0);
                for isa in Isa::all_supported() {
                    check(
                        isa,
                        &format!("case {case}.{variant}"),
                        &x,
                        hidden,
                        &routing,
                        &experts,
                    );
                }
            }
        }
    }

    #[test]
    fn tensor_parallel_shards_sum_to_the_full_expert() {
        let mut rng = Rng(11);
        let (hidden, inter, num_experts, tokens, top_k, shards) = (96, 64, 3, 4, 2, 2);
        let full = Weights::new(&mut rng, num_experts, hidden, inter);
        let routing = routing(&mut rng, tokens, top_k, num_experts, &[], None);
        let x = rng.sym_values(tokens * hidden, 1.0);
        let isa = Isa::detect();
        let whole = check(isa, "full", &x, hidden, &routing, &full.views());
        let part = inter / shards;
        let mut sum = vec![0.0f32; tokens * hidden];
        for s in 0..shards {
            // Shard s holds intermediate rows [s·part, (s+1)·part) of gate/up and the same
            // columns of down; the block scales travel with their elements.
            let shard = |m: &Nvfp4Matrix, rows: bool| {
                let (r, c) = if rows { (part, hidden) } else { (hidden, part) };
                let mut packed = Vec::new();
                let mut scales = Vec::new();
                for i in 0..r {
                    let (row, c0) = if rows {
                        (s * part + i, 0)
                    } else {
                        (i, s * part)
                    };
                    let start = row * m.cols + c0;
                    packed.extend_from_slice(&m.packed[start / 2..(start + c) / 2]);
                    scales.extend_from_slice(&m.block_scales[start / 16..(start + c) / 16]);
                }
                Nvfp4Matrix::from_parts(r, c, packed, scales, m.global_scale).unwrap()
            };
            let sharded = Weights {
                mats: full
                    .mats
                    .iter()
                    .map(|[g, u, d]| [shard(g, true), shard(u, true), shard(d, false)])
                    .collect(),
                scales: full.scales.clone(),
            };
            let partial = check(
                isa,
                &format!("shard {s}"),
                &x,
                hidden,
                &routing,
                &sharded.views(),
            );
            for (a, b) in sum.iter_mut().zip(&partial) {
                *a += b;
            }
        }
        let (rel, max) = distance(&sum, &whole);
        assert!(
            rel <= REL_L2,
            "sum of shards: rel L2 {rel:e}, max abs {max:e}"
        );
    }

    #[test]
    fn bf16_experts_and_empty_inputs() {
        let mut rng = Rng(3);
        let (hidden, inter) = (40, 24);
        let mats: Vec<Vec<bf16>> = (0..6)
            .map(|_| {
                rng.sym_values(hidden * inter, 0.2)
                    .iter()
                    .map(|&v| bf16::from_f32(v))
                    .collect()
            })
            .collect();
        let experts: Vec<ExpertView> = mats
            .chunks_exact(3)
            .map(|m| ExpertView {
                gate: MatrixView::Bf16 {
                    rows: inter,
                    cols: hidden,
                    data: &m[0],
                },
                up: MatrixView::Bf16 {
                    rows: inter,
                    cols: hidden,
                    data: &m[1],
                },
                down: MatrixView::Bf16 {
                    rows: hidden,
                    cols: inter,
                    data: &m[2],
                },
                gate_up_input_scale: None,
                down_input_scale: None,
            })
            .collect();
        let routing = Routing {
            top_k: 2,
            experts: vec![1, 0, 1, 0, 0, 1],
            weights: rng.sym_values(6, 1.0),
        };
        let x = rng.sym_values(3 * hidden, 1.0);
        for isa in Isa::all_supported() {
            check(isa, "bf16", &x, hidden, &routing, &experts);
        }
        // No tokens at all.
        let none = Routing {
            top_k: 2,
            experts: vec![],
            weights: vec![],
        };
        let mut out = vec![];
        moe_cpu(&[], hidden, &none, &experts, &mut out, None);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(24))]
        /// One task per expert and the four phases compute every product and quantization
        /// from the same values: the same bits, on every ISA this CPU has, either dot kind.
        #[test]
        fn one_task_per_expert_gives_the_phases_bits(
            seed in 0u64..1000,
            case in 0usize..4,
            tokens in 1usize..=INT_GROUP,
            int_dot in proptest::bool::ANY,
        ) {
            let tactic = CpuTactic {
                moe_dot: if int_dot { MoeDot::IntDot } else { MoeDot::F32Fma },
                ..CpuTactic::DEFAULT
            };
            // Ragged and whole groups of 256, a heavy expert (one task of `tokens` rows).
            let (hidden, inter, num_experts, top_k, heavy) = [
                (256, 96, 6, 2, None),
                (512, 64, 8, 8, None),
                (128, 320, 5, 3, Some(2)),
                (1024, 384, 16, 8, None),
            ][case];
            let mut rng = Rng(seed);
            let w = Weights::new(&mut rng, num_experts, hidden, inter);
            let experts = w.views();
            let routing = routing(&mut rng, tokens, top_k, num_experts, &[], heavy);
            let x = rng.sym_values(tokens * hidden, 1.0);
            for isa in Isa::all_supported() {
                let run = |split| {
                    let mut out = vec![f32::NAN; tokens * hidden];
                    moe_cpu_split(split, &tactic, isa, &x, hidden, &routing, &experts, &mut out, None);
                    out
                };
                let (phases, by_expert) = (run(Split::Phases), run(Split::ByExpert));
                proptest::prop_assert!(
                    phases.iter().all(|v| v.is_finite()),
                    "{isa:?}: the phases gave non-finite outputs"
                );
                proptest::prop_assert!(
                    by_expert.iter().zip(&phases).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{isa:?} int_dot={int_dot}: one task per expert differs from the phases"
                );
            }
        }

        /// The work-item size only decides which thread computes which rows: any valid tactic
        /// is bit-identical to the default with its dot kind, on every ISA this CPU has.
        #[test]
        fn every_tactic_is_bit_identical_to_the_default(
            item_bytes in 1usize..(64 << 10),
            threads in 1usize..4,
            seed in 0u64..1000,
            case in 0usize..3,
            int_dot in proptest::bool::ANY,
        ) {
            let moe_dot = if int_dot { MoeDot::IntDot } else { MoeDot::F32Fma };
            let base = CpuTactic {
                moe_dot,
                ..CpuTactic::DEFAULT
            };
            let tactic = CpuTactic {
                moe_item_bytes: item_bytes,
                threads,
                ..base
            };
            let (hidden, inter, num_experts, tokens, top_k) =
                [(256, 96, 4, 1, 2), (128, 320, 6, 9, 3), (512, 64, 8, 4, 8)][case];
            let mut rng = Rng(seed);
            let w = Weights::new(&mut rng, num_experts, hidden, inter);
            let experts = w.views();
            let routing = routing(&mut rng, tokens, top_k, num_experts, &[], None);
            let x = rng.sym_values(tokens * hidden, 1.0);
            let pool = tactic.build_pool().unwrap();
            for isa in Isa::all_supported() {
                let mut want = vec![0.0; tokens * hidden];
                moe_cpu_tuned(&base, isa, &x, hidden, &routing, &experts, &mut want, None);
                let mut got = vec![f32::NAN; tokens * hidden];
                pool.install(|| {
                    moe_cpu_tuned(&tactic, isa, &x, hidden, &routing, &experts, &mut got, None)
                });
                proptest::prop_assert!(
                    got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{isa:?} {tactic}"
                );
            }
        }
    }
}
