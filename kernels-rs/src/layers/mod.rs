//! The decode step's small kernels (`layers.cu`): embedding gather, residual add + RMSNorm,
//! interleaved RoPE, `noaux_tc` routing, expert grouping, BF16 decode-shaped products (plain
//! and batched over heads), SiLU·up, greedy argmax, and the strided BF16 conversion and row
//! gather around them. They are the device counterparts of what the CPU forward pass
//! does between products, so that a whole step can stay on the device.
//!
//! One image per SM (tactic [`IMAGE`]): the kernels take their sizes as arguments. Every
//! launcher checks the sizes against the buffers it is given before launching, since the
//! kernels trust them.
//!
//! Their CPU references are the model's own functions (`model::forward::route`,
//! `model::forward::rms_norm`, `model::rope::Rope`, `model::sampler::argmax`) and
//! [`GroupedRouting`](crate::moe_gemm::launch::GroupedRouting); `tests/tests/host_layers.rs`
//! runs these kernels through the host execution layer against them.

pub mod sampling;

use crate::arch::Sm;
use crate::device::{Device, DeviceError, DeviceMemory, KernelParams, LaunchConfig, Result};
use crate::tactic::{KernelFamily, ProblemShape, Tactic, TacticError};

pub const FAMILY: &str = "layers";
/// The only image of the family.
pub const IMAGE: &str = "default";
/// The family's tactic: its one image, compiled with every kernel; the kernels take their
/// sizes as arguments, so there is nothing to choose yet (see `kernels::tactic::Tactic`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct LayersTactic;
/// Threads per block of every kernel (`kThreads`, their `__launch_bounds__`).
pub const THREADS: u32 = 256;
const WARPS: u32 = THREADS / 32;
/// Experts `route_noaux_tc` handles (its dynamic shared memory grows with them).
pub const MAX_EXPERTS: usize = 1024;
/// Expert groups `route_noaux_tc` handles (a 64-bit mask of the kept ones).
pub const MAX_GROUPS: usize = 64;

impl Tactic for LayersTactic {
    const FAMILY: KernelFamily = KernelFamily::Layers;

    fn tactic_id(&self) -> String {
        IMAGE.to_string()
    }

    fn parse_id(id: &str) -> std::result::Result<Self, TacticError> {
        if id == IMAGE {
            Ok(LayersTactic)
        } else {
            Err(TacticError::Parse(id.to_string()))
        }
    }

    fn validate_for(&self, _sm: Sm) -> std::result::Result<(), TacticError> {
        Ok(())
    }

    /// `route_noaux_tc`'s dynamic shared memory at its largest (one f32 score and one
    /// selection score per expert).
    fn smem_bytes(&self) -> usize {
        2 * 4 * MAX_EXPERTS
    }

    fn space(_sm: Sm) -> Vec<Self> {
        vec![LayersTactic]
    }

    fn serves(&self, shape: &ProblemShape) -> bool {
        matches!(shape, ProblemShape::Dense { .. })
    }

    fn heuristic_default(_sm: Sm, shape: &ProblemShape) -> Option<Self> {
        matches!(shape, ProblemShape::Dense { .. }).then_some(LayersTactic)
    }
}

const KERNELS: [&str; 14] = [
    "embed_gather",
    "add_rms_norm",
    "rope_interleaved",
    "route_noaux_tc",
    "group_by_expert",
    "dense_bf16",
    "silu_mul",
    "argmax_rows",
    "dense_heads_bf16",
    "to_bf16_strided",
    "gather_rows",
    "sample_rows",
    "argmax_shard",
    "argmax_ranks",
];

/// Ids `argmax_shard` carries exactly as FP32 values (below 2^24; its `kNoCandidate`).
pub const MAX_SHARDED_VOCAB: usize = 1 << 24;

/// The router's configuration (the checkpoint's `n_routed_experts`, `n_group`, `topk_group`,
/// `num_experts_per_tok`, `norm_topk_prob`, `routed_scaling_factor`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RouterShape {
    pub experts: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub top_k: usize,
    pub norm_topk_prob: bool,
    pub routed_scaling_factor: f32,
}

impl RouterShape {
    /// What `route_noaux_tc` needs of the configuration.
    pub fn validate(&self) -> Result<()> {
        let bad = |why: String| Err(DeviceError::Invalid(format!("router: {why}")));
        if self.experts == 0 || self.experts > MAX_EXPERTS {
            return bad(format!(
                "{} experts; the kernel handles 1 to {MAX_EXPERTS}",
                self.experts
            ));
        }
        if self.n_group == 0
            || self.n_group > MAX_GROUPS
            || !self.experts.is_multiple_of(self.n_group)
        {
            return bad(format!(
                "{} groups of {} experts; groups must divide the experts and number at most \
                 {MAX_GROUPS}",
                self.n_group, self.experts
            ));
        }
        let selectable = if self.n_group > 1 {
            self.topk_group.min(self.n_group) * (self.experts / self.n_group)
        } else {
            self.experts
        };
        if self.top_k == 0 || self.top_k > selectable {
            return bad(format!(
                "top_k {} with {selectable} selectable experts ({} of {} groups kept)",
                self.top_k, self.topk_group, self.n_group
            ));
        }
        if self.n_group > 1 && self.topk_group == 0 {
            return bad("topk_group is 0".into());
        }
        Ok(())
    }

    fn dynamic_shared(&self) -> usize {
        (2 * self.experts + self.n_group) * 4
    }
}

/// Where the RoPE'd values sit in a row: `count` slices of `2 · pairs` values, the first at
/// `offset`, each `stride` after the previous (Kimi's q: offset 128, stride 192, 64 slices of
/// 32 pairs; the compressed KV: offset 512, one slice).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RopeSlices {
    pub offset: usize,
    pub stride: usize,
    pub count: usize,
    pub pairs: usize,
}

/// The family's kernels, loaded once.
pub struct LayerKernels<D: Device> {
    kernels: Vec<D::Kernel>,
    /// Dynamic shared memory `route_noaux_tc` was loaded with.
    route_shared: usize,
}

fn need(memory: &impl DeviceMemory, bytes: usize, kernel: &str, what: &str) -> Result<()> {
    if memory.len() < bytes {
        return Err(DeviceError::Invalid(format!(
            "{kernel}: {what} holds {} B, the launch needs {bytes} B",
            memory.len()
        )));
    }
    Ok(())
}

fn as_i32(value: usize, kernel: &str, what: &str) -> Result<i32> {
    i32::try_from(value)
        .map_err(|_| DeviceError::Invalid(format!("{kernel}: {what} {value} exceeds an int")))
}

fn rows_config(rows: usize, kernel: &str) -> Result<LaunchConfig> {
    let rows = u32::try_from(rows)
        .ok()
        .filter(|&r| r > 0 && r < i32::MAX as u32)
        .ok_or_else(|| DeviceError::Invalid(format!("{kernel}: {rows} rows")))?;
    Ok(LaunchConfig {
        grid_dim: (rows, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    })
}

const F32: usize = 4;
const BF16: usize = 2;
const I32: usize = 4;

/// A strided view of FP32 (or BF16) values in one allocation, as [`LayerKernels::dense_heads`]
/// reads and writes them: element `j` of head `h` of row `t` sits at
/// `offset + t · row_stride + h · head_stride + j` (in elements).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeadRows {
    pub offset: usize,
    pub row_stride: usize,
    pub head_stride: usize,
}

impl HeadRows {
    /// Elements the view spans for `rows` rows, `heads` heads of `width` values each.
    fn span(&self, rows: usize, heads: usize, width: usize) -> usize {
        if rows == 0 || heads == 0 || width == 0 {
            return 0;
        }
        self.offset + (rows - 1) * self.row_stride + (heads - 1) * self.head_stride + width
    }
}

/// Where a dense product's rows go in its output allocation: row `t` at element
/// `offset + t · row_stride` (`row_stride` at least the product's `n`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DenseOutput {
    pub offset: usize,
    pub row_stride: usize,
}

impl DenseOutput {
    /// Rows of `n` values one after the other from the start.
    pub fn packed(n: usize) -> Self {
        Self {
            offset: 0,
            row_stride: n,
        }
    }

    /// Elements the output spans for `rows` rows of `n` values.
    pub fn span(&self, rows: usize, n: usize) -> usize {
        if rows == 0 {
            return 0;
        }
        self.offset + (rows - 1) * self.row_stride + n
    }

    fn check(&self, rows: usize, n: usize, kernel: &str) -> Result<()> {
        if self.row_stride < n || rows == 0 || n == 0 {
            return Err(DeviceError::Invalid(format!(
                "{kernel}: {rows} rows of {n} values, {} apart",
                self.row_stride
            )));
        }
        Ok(())
    }
}

/// Which element type [`LayerKernels::dense_heads`] writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputType {
    F32,
    Bf16,
}

impl OutputType {
    fn bytes(self) -> usize {
        match self {
            Self::F32 => F32,
            Self::Bf16 => BF16,
        }
    }
}

impl<D: Device> LayerKernels<D> {
    /// Loads the kernels; `route_noaux_tc` with the dynamic shared memory of up to
    /// [`MAX_EXPERTS`] experts and [`MAX_GROUPS`] groups.
    pub fn load(dev: &D) -> Result<Self> {
        let route_shared = (2 * MAX_EXPERTS + MAX_GROUPS) * F32;
        let kernels = KERNELS
            .iter()
            .map(|&name| {
                let shared = if name == "route_noaux_tc" {
                    route_shared
                } else {
                    0
                };
                dev.load_kernel(FAMILY, IMAGE, name, shared)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            kernels,
            route_shared,
        })
    }

    fn kernel(&self, name: &str) -> &D::Kernel {
        &self.kernels[KERNELS.iter().position(|&k| k == name).unwrap()]
    }

    /// `out [tokens][hidden]` f32 = rows `ids [tokens]` of the BF16 embedding, whose rows
    /// `table_rows` (of a vocabulary of `vocab`) `table [table_rows.len()][hidden]` holds: an
    /// id of the vocabulary outside them writes a zero row (a tensor-parallel rank's share,
    /// summed over the ranks after). An id outside the vocabulary writes a zero row and
    /// records itself in `bad_id` (one i32 the caller sets to -1 and reads back at its next
    /// synchronization).
    #[allow(clippy::too_many_arguments)]
    pub fn embed_gather(
        &self,
        dev: &D,
        ids: &D::Memory,
        tokens: usize,
        table: &D::Memory,
        table_rows: std::ops::Range<usize>,
        vocab: usize,
        hidden: usize,
        out: &D::Memory,
        bad_id: &D::Memory,
    ) -> Result<()> {
        const K: &str = "embed_gather";
        if table_rows.is_empty() || table_rows.end > vocab {
            return Err(DeviceError::Invalid(format!(
                "{K}: table rows {table_rows:?} of a vocabulary of {vocab}"
            )));
        }
        need(ids, tokens * I32, K, "ids")?;
        need(table, table_rows.len() * hidden * BF16, K, "table")?;
        need(out, tokens * hidden * F32, K, "out")?;
        need(bad_id, I32, K, "bad_id")?;
        let (ids_p, table_p, out_p, bad_p) = (
            ids.device_ptr(),
            table.device_ptr(),
            out.device_ptr(),
            bad_id.device_ptr(),
        );
        let (vocab, first, rows, hidden) = (
            as_i32(vocab, K, "vocab")?,
            as_i32(table_rows.start, K, "first id")?,
            as_i32(table_rows.len(), K, "table rows")?,
            as_i32(hidden, K, "hidden")?,
        );
        let mut p = KernelParams::new();
        p.arg(&ids_p)
            .arg(&table_p)
            .arg(&vocab)
            .arg(&first)
            .arg(&rows)
            .arg(&hidden)
            .arg(&out_p)
            .arg(&bad_p)
            .traffic(
                tokens * (I32 + hidden as usize * BF16),
                tokens * hidden as usize * F32,
            );
        // SAFETY: the signature is `embed_gather(const int*, const bf16*, int, int, int, int,
        // float*, int*)`; every buffer was checked against the sizes above and the kernel
        // reads only rows of ids inside [first, first + rows).
        unsafe { dev.launch(self.kernel(K), rows_config(tokens, K)?, &p) }
    }

    /// Per row of `[rows][dim]`: `residual += x` when `x` is given, then
    /// `out = RMSNorm(residual) · weight` (BF16 `weight [dim]`).
    #[allow(clippy::too_many_arguments)]
    pub fn add_rms_norm(
        &self,
        dev: &D,
        residual: &D::Memory,
        x: Option<&D::Memory>,
        weight: &D::Memory,
        eps: f32,
        rows: usize,
        dim: usize,
        out: &D::Memory,
    ) -> Result<()> {
        const K: &str = "add_rms_norm";
        need(residual, rows * dim * F32, K, "residual")?;
        if let Some(x) = x {
            need(x, rows * dim * F32, K, "x")?;
        }
        need(weight, dim * BF16, K, "weight")?;
        need(out, rows * dim * F32, K, "out")?;
        let (r, xp, w, o) = (
            residual.device_ptr(),
            x.map_or(0, |x| x.device_ptr()),
            weight.device_ptr(),
            out.device_ptr(),
        );
        let dim = as_i32(dim, K, "dim")?;
        let mut p = KernelParams::new();
        p.arg(&r).arg(&xp).arg(&w).arg(&eps).arg(&dim).arg(&o);
        let row_bytes = rows * dim as usize * F32;
        let added = if x.is_some() { row_bytes } else { 0 };
        p.traffic(row_bytes + added + dim as usize * BF16, row_bytes + added);
        // SAFETY: `add_rms_norm(float*, const float*, const bf16*, float, int, float*)`, a null
        // `x` meaning no add; sizes checked above.
        unsafe { dev.launch(self.kernel(K), rows_config(rows, K)?, &p) }
    }

    /// Rotates, in every row `r` of `x` (f32, rows `row_stride` values apart), the slices
    /// [`RopeSlices`] names, by `positions[r]`: pairs `(2i, 2i+1)` by angle
    /// `position · inv_freq[i]`, cos and sin times `attention_factor`.
    #[allow(clippy::too_many_arguments)]
    pub fn rope_interleaved(
        &self,
        dev: &D,
        x: &D::Memory,
        rows: usize,
        row_stride: usize,
        slices: RopeSlices,
        positions: &D::Memory,
        inv_freq: &D::Memory,
        attention_factor: f32,
    ) -> Result<()> {
        const K: &str = "rope_interleaved";
        let RopeSlices {
            offset,
            stride,
            count,
            pairs,
        } = slices;
        let dim = 2 * pairs;
        let end = offset + count.saturating_sub(1) * stride + dim;
        if count == 0 || pairs == 0 || end > row_stride || (count > 1 && stride < dim) {
            return Err(DeviceError::Invalid(format!(
                "{K}: {count} slices of {dim} values, {stride} apart from {offset}, in rows of \
                 {row_stride}"
            )));
        }
        need(x, rows * row_stride * F32, K, "x")?;
        need(positions, rows * I32, K, "positions")?;
        need(inv_freq, pairs * F32, K, "inv_freq")?;
        let (xp, pos, freq) = (
            x.device_ptr(),
            positions.device_ptr(),
            inv_freq.device_ptr(),
        );
        let (row_stride, offset, stride, count, dim) = (
            as_i32(row_stride, K, "row stride")?,
            as_i32(offset, K, "offset")?,
            as_i32(stride, K, "slice stride")?,
            as_i32(count, K, "count")?,
            as_i32(dim, K, "dim")?,
        );
        let mut p = KernelParams::new();
        p.arg(&xp)
            .arg(&row_stride)
            .arg(&offset)
            .arg(&stride)
            .arg(&count)
            .arg(&dim)
            .arg(&pos)
            .arg(&freq)
            .arg(&attention_factor);
        let rotated = rows * count as usize * dim as usize * F32;
        p.traffic(rotated + rows * I32 + pairs * F32, rotated);
        // SAFETY: `rope_interleaved(float*, int, int, int, int, int, const int*, const float*,
        // float)`; every slice lies inside its row (checked above) and rows inside `x`.
        unsafe { dev.launch(self.kernel(K), rows_config(rows, K)?, &p) }
    }

    /// Routes every token of `logits [tokens][experts]` with the correction `bias [experts]`:
    /// `ids` and `weights` `[tokens][top_k]`, in the CPU router's order.
    #[allow(clippy::too_many_arguments)]
    pub fn route(
        &self,
        dev: &D,
        shape: &RouterShape,
        logits: &D::Memory,
        bias: &D::Memory,
        tokens: usize,
        ids: &D::Memory,
        weights: &D::Memory,
    ) -> Result<()> {
        const K: &str = "route_noaux_tc";
        shape.validate()?;
        debug_assert!(shape.dynamic_shared() <= self.route_shared);
        need(logits, tokens * shape.experts * F32, K, "logits")?;
        need(bias, shape.experts * F32, K, "bias")?;
        need(ids, tokens * shape.top_k * I32, K, "ids")?;
        need(weights, tokens * shape.top_k * F32, K, "weights")?;
        let (l, b, i, w) = (
            logits.device_ptr(),
            bias.device_ptr(),
            ids.device_ptr(),
            weights.device_ptr(),
        );
        let (experts, n_group, topk_group, top_k, norm) = (
            shape.experts as i32,
            shape.n_group as i32,
            shape.topk_group as i32,
            shape.top_k as i32,
            i32::from(shape.norm_topk_prob),
        );
        let scale = shape.routed_scaling_factor;
        let mut p = KernelParams::new();
        p.arg(&l)
            .arg(&b)
            .arg(&experts)
            .arg(&n_group)
            .arg(&topk_group)
            .arg(&top_k)
            .arg(&norm)
            .arg(&scale)
            .arg(&i)
            .arg(&w)
            .traffic(
                (tokens + 1) * shape.experts * F32,
                tokens * shape.top_k * (I32 + F32),
            );
        let mut cfg = rows_config(tokens, K)?;
        cfg.shared_mem_bytes = shape.dynamic_shared() as u32;
        // SAFETY: `route_noaux_tc(const float*, const float*, int, int, int, int, int, float,
        // int*, float*)`; the shape was validated (so the shared memory fits what was opted
        // into at load) and the buffers checked.
        unsafe { dev.launch(self.kernel(K), cfg, &p) }
    }

    /// Groups `tokens · top_k` routing entries (`ids`, `weights`, as [`route`](Self::route)
    /// writes them) by expert: `expert_offsets [experts + 1]`, `sorted_token_ids` and
    /// `sorted_weights [tokens · top_k]`, the MoE kernels' layout, tokens in increasing order
    /// within an expert, and `active_experts [1 + experts]` (the count of experts with a
    /// token, their ids, then -1; as `GroupedRouting::active_expert_list`). Ids must be below
    /// `experts` (the router guarantees it).
    #[allow(clippy::too_many_arguments)]
    pub fn group_by_expert(
        &self,
        dev: &D,
        ids: &D::Memory,
        weights: &D::Memory,
        tokens: usize,
        top_k: usize,
        experts: usize,
        expert_offsets: &D::Memory,
        sorted_token_ids: &D::Memory,
        sorted_weights: &D::Memory,
        active_experts: &D::Memory,
    ) -> Result<()> {
        const K: &str = "group_by_expert";
        let assignments = tokens * top_k;
        need(ids, assignments * I32, K, "ids")?;
        need(weights, assignments * F32, K, "weights")?;
        need(expert_offsets, (experts + 1) * I32, K, "expert_offsets")?;
        need(sorted_token_ids, assignments * I32, K, "sorted_token_ids")?;
        need(sorted_weights, assignments * F32, K, "sorted_weights")?;
        need(active_experts, (experts + 1) * I32, K, "active_experts")?;
        let (i, w, o, st, sw, ae) = (
            ids.device_ptr(),
            weights.device_ptr(),
            expert_offsets.device_ptr(),
            sorted_token_ids.device_ptr(),
            sorted_weights.device_ptr(),
            active_experts.device_ptr(),
        );
        let (a, k, e) = (
            as_i32(assignments, K, "assignments")?,
            as_i32(top_k, K, "top_k")?,
            as_i32(experts, K, "experts")?,
        );
        let mut p = KernelParams::new();
        p.arg(&i)
            .arg(&w)
            .arg(&a)
            .arg(&k)
            .arg(&e)
            .arg(&o)
            .arg(&st)
            .arg(&sw)
            .arg(&ae)
            .traffic(
                assignments * (I32 + F32),
                2 * (experts + 1) * I32 + assignments * (I32 + F32),
            );
        // SAFETY: `group_by_expert(const int*, const float*, int, int, int, int*, int*,
        // float*, int*)`, one block; sizes checked above.
        unsafe { dev.launch(self.kernel(K), rows_config(1, K)?, &p) }
    }

    /// `y [tokens][n] (+)= x [tokens][k] · Wᵀ` with BF16 `w [n][k]`.
    #[allow(clippy::too_many_arguments)]
    pub fn dense_bf16(
        &self,
        dev: &D,
        x: &D::Memory,
        tokens: usize,
        w: &D::Memory,
        k: usize,
        n: usize,
        y: &D::Memory,
        accumulate: bool,
    ) -> Result<()> {
        let rows = DenseOutput::packed(n);
        self.dense_bf16_into(dev, x, tokens, w, k, n, y, rows, accumulate)
    }

    /// As [`dense_bf16`](Self::dense_bf16), with row `t` of the product at element
    /// `out.offset + t · out.row_stride` of `y` (a vocabulary-parallel `lm_head` writes its
    /// columns of full-vocabulary rows).
    #[allow(clippy::too_many_arguments)]
    pub fn dense_bf16_into(
        &self,
        dev: &D,
        x: &D::Memory,
        tokens: usize,
        w: &D::Memory,
        k: usize,
        n: usize,
        y: &D::Memory,
        out: DenseOutput,
        accumulate: bool,
    ) -> Result<()> {
        const K: &str = "dense_bf16";
        out.check(tokens, n, K)?;
        need(x, tokens * k * F32, K, "x")?;
        need(w, n * k * BF16, K, "w")?;
        need(y, out.span(tokens, n) * F32, K, "y")?;
        let (xp, wp, yp) = (
            x.device_ptr(),
            w.device_ptr(),
            y.device_ptr() + (out.offset * F32) as u64,
        );
        let (kk, nn, ldy, acc) = (
            as_i32(k, K, "k")?,
            as_i32(n, K, "n")?,
            as_i32(out.row_stride, K, "row stride")?,
            i32::from(accumulate),
        );
        let mut p = KernelParams::new();
        p.arg(&xp)
            .arg(&wp)
            .arg(&kk)
            .arg(&nn)
            .arg(&yp)
            .arg(&ldy)
            .arg(&acc);
        let out_bytes = tokens * n * F32;
        p.traffic(
            tokens * k * F32 + n * k * BF16 + if accumulate { out_bytes } else { 0 },
            out_bytes,
        )
        .problem(ProblemShape::Dense {
            m: tokens as u32,
            n: nn as u32,
            k: kk as u32,
        });
        let tokens = u32::try_from(tokens)
            .ok()
            .filter(|&t| t > 0 && t <= 65_535)
            .ok_or_else(|| DeviceError::Invalid(format!("{K}: {tokens} tokens (1 to 65535)")))?;
        let cfg = LaunchConfig {
            grid_dim: ((n as u32).div_ceil(WARPS), tokens, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: `dense_bf16(const float*, const bf16*, int, int, float*, int, int)`; the
        // grid covers n rows × tokens and the kernel skips rows past n; the last output
        // element was checked against `y` above.
        unsafe { dev.launch(self.kernel(K), cfg, &p) }
    }

    /// `h [rows][inter] = SiLU(gate) · up` for `gate_up [rows][2 · inter]` = gate ‖ up.
    pub fn silu_mul(
        &self,
        dev: &D,
        gate_up: &D::Memory,
        rows: usize,
        inter: usize,
        h: &D::Memory,
    ) -> Result<()> {
        const K: &str = "silu_mul";
        need(gate_up, rows * 2 * inter * F32, K, "gate_up")?;
        need(h, rows * inter * F32, K, "h")?;
        let (g, hp) = (gate_up.device_ptr(), h.device_ptr());
        let inter = as_i32(inter, K, "inter")?;
        let mut p = KernelParams::new();
        p.arg(&g).arg(&inter).arg(&hp);
        p.traffic(rows * 2 * inter as usize * F32, rows * inter as usize * F32);
        // SAFETY: `silu_mul(const float*, int, float*)`; sizes checked above.
        unsafe { dev.launch(self.kernel(K), rows_config(rows, K)?, &p) }
    }

    /// `ids [rows]` = the index of each row's largest value in `logits [rows][vocab]`, the
    /// first on ties.
    pub fn argmax_rows(
        &self,
        dev: &D,
        logits: &D::Memory,
        rows: usize,
        vocab: usize,
        ids: &D::Memory,
    ) -> Result<()> {
        const K: &str = "argmax_rows";
        need(logits, rows * vocab * F32, K, "logits")?;
        need(ids, rows * I32, K, "ids")?;
        let (l, i) = (logits.device_ptr(), ids.device_ptr());
        let vocab = as_i32(vocab, K, "vocab")?;
        let mut p = KernelParams::new();
        p.arg(&l).arg(&vocab).arg(&i);
        p.traffic(rows * vocab as usize * F32, rows * I32);
        // SAFETY: `argmax_rows(const float*, int, int*)`; sizes checked above.
        unsafe { dev.launch(self.kernel(K), rows_config(rows, K)?, &p) }
    }

    /// The vocabulary-parallel greedy pick of rank `rank` of `ranks`: per row of `logits`
    /// (`count` values of ids `first_id ..`, rows `row_stride` apart), its best (value, id),
    /// the first id on ties, into slot `rank` of `pairs [rows][ranks][2]` (FP32), the other
    /// slots zeroed: an all-reduce sum over the ranks then gathers every slot exactly, and
    /// [`argmax_ranks`](Self::argmax_ranks) picks what [`argmax_rows`](Self::argmax_rows)
    /// picks from whole rows.
    #[allow(clippy::too_many_arguments)]
    pub fn argmax_shard(
        &self,
        dev: &D,
        logits: &D::Memory,
        rows: usize,
        row_stride: usize,
        count: usize,
        first_id: usize,
        ranks: usize,
        rank: usize,
        pairs: &D::Memory,
    ) -> Result<()> {
        const K: &str = "argmax_shard";
        if count == 0 || row_stride < count || rank >= ranks || first_id + count > MAX_SHARDED_VOCAB
        {
            return Err(DeviceError::Invalid(format!(
                "{K}: ids {first_id}..{} (ids up to {MAX_SHARDED_VOCAB}) in rows of {row_stride}, \
                 rank {rank} of {ranks}",
                first_id + count
            )));
        }
        need(logits, ((rows - 1) * row_stride + count) * F32, K, "logits")?;
        need(pairs, rows * ranks * 2 * F32, K, "pairs")?;
        let (l, pp) = (logits.device_ptr(), pairs.device_ptr());
        let (stride, n, first, world, me) = (
            as_i32(row_stride, K, "row stride")?,
            as_i32(count, K, "count")?,
            as_i32(first_id, K, "first id")?,
            as_i32(ranks, K, "ranks")?,
            as_i32(rank, K, "rank")?,
        );
        let mut p = KernelParams::new();
        p.arg(&l)
            .arg(&stride)
            .arg(&n)
            .arg(&first)
            .arg(&world)
            .arg(&me)
            .arg(&pp)
            .traffic(rows * count * F32, rows * ranks * 2 * F32);
        // SAFETY: `argmax_shard(const float*, int, int, int, int, int, float*)`; the last
        // value read and the pairs written were checked above.
        unsafe { dev.launch(self.kernel(K), rows_config(rows, K)?, &p) }
    }

    /// `ids [rows]` = the best of each row's gathered pairs `[ranks][2]` (as
    /// [`argmax_shard`](Self::argmax_shard) writes them, summed over the ranks), the lower id
    /// on ties.
    pub fn argmax_ranks(
        &self,
        dev: &D,
        pairs: &D::Memory,
        rows: usize,
        ranks: usize,
        ids: &D::Memory,
    ) -> Result<()> {
        const K: &str = "argmax_ranks";
        need(pairs, rows * ranks * 2 * F32, K, "pairs")?;
        need(ids, rows * I32, K, "ids")?;
        let (pp, i) = (pairs.device_ptr(), ids.device_ptr());
        let world = as_i32(ranks, K, "ranks")?;
        let mut p = KernelParams::new();
        p.arg(&pp)
            .arg(&world)
            .arg(&i)
            .traffic(rows * ranks * 2 * F32, rows * I32);
        // SAFETY: `argmax_ranks(const float*, int, int*)`; sizes checked above.
        unsafe { dev.launch(self.kernel(K), rows_config(rows, K)?, &p) }
    }

    /// Per head `h < heads`: `y[t, h] = x[t, h] · W_hᵀ` for `t < tokens`, with `W_h` the BF16
    /// `[n][k]` matrix at element `w_offset + h · w_head_stride` of `w`. `x` (FP32, `k` values
    /// per head) and `y` (`n` values per head, `y_type`) are strided views ([`HeadRows`]); the
    /// absorbed attention's per-head products in one launch.
    #[allow(clippy::too_many_arguments)]
    pub fn dense_heads(
        &self,
        dev: &D,
        x: &D::Memory,
        x_rows: HeadRows,
        tokens: usize,
        heads: usize,
        w: &D::Memory,
        w_offset: usize,
        w_head_stride: usize,
        k: usize,
        n: usize,
        y: &D::Memory,
        y_rows: HeadRows,
        y_type: OutputType,
    ) -> Result<()> {
        const K: &str = "dense_heads_bf16";
        if tokens == 0 || heads == 0 || k == 0 || n == 0 {
            return Err(DeviceError::Invalid(format!(
                "{K}: {tokens} tokens × {heads} heads of [{n}][{k}]"
            )));
        }
        need(x, x_rows.span(tokens, heads, k) * F32, K, "x")?;
        need(
            w,
            (w_offset + (heads - 1) * w_head_stride + n * k) * BF16,
            K,
            "w",
        )?;
        need(y, y_rows.span(tokens, heads, n) * y_type.bytes(), K, "y")?;
        let xp = x.device_ptr() + (x_rows.offset * F32) as u64;
        let wp = w.device_ptr() + (w_offset * BF16) as u64;
        let yp = y.device_ptr() + (y_rows.offset * y_type.bytes()) as u64;
        let (xs_t, xs_h) = (
            as_i32(x_rows.row_stride, K, "x row stride")?,
            as_i32(x_rows.head_stride, K, "x head stride")?,
        );
        let (ys_t, ys_h) = (
            as_i32(y_rows.row_stride, K, "y row stride")?,
            as_i32(y_rows.head_stride, K, "y head stride")?,
        );
        let ws_h = w_head_stride as i64;
        let (kk, nn) = (as_i32(k, K, "k")?, as_i32(n, K, "n")?);
        let bf = i32::from(y_type == OutputType::Bf16);
        let mut p = KernelParams::new();
        p.arg(&xp)
            .arg(&xs_t)
            .arg(&xs_h)
            .arg(&wp)
            .arg(&ws_h)
            .arg(&kk)
            .arg(&nn)
            .arg(&yp)
            .arg(&ys_t)
            .arg(&ys_h)
            .arg(&bf)
            .traffic(
                heads * (tokens * k * F32 + n * k * BF16),
                heads * tokens * n * y_type.bytes(),
            )
            // Every head's product at once: one product of `heads · n` outputs.
            .problem(ProblemShape::Dense {
                m: tokens as u32,
                n: (heads * n) as u32,
                k: kk as u32,
            });
        let (tokens, heads) = match (u32::try_from(tokens), u32::try_from(heads)) {
            (Ok(t), Ok(h)) if t <= 65_535 && h <= 65_535 => (t, h),
            _ => {
                return Err(DeviceError::Invalid(format!(
                    "{K}: {tokens} tokens × {heads} heads (each 1 to 65535)"
                )));
            }
        };
        let cfg = LaunchConfig {
            grid_dim: ((n as u32).div_ceil(WARPS), tokens, heads),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: `dense_heads_bf16(const float*, int, int, const bf16*, long long, int, int,
        // void*, int, int, int)`; the last element each view addresses was checked against its
        // buffer above, and the kernel skips rows past n.
        unsafe { dev.launch(self.kernel(K), cfg, &p) }
    }

    /// `out [rows][count][width]` BF16 = the FP32 slices of `input` that [`RopeSlices`]-like
    /// geometry names: slice `s` of row `r` starts at `r · row_stride + offset + s · stride`.
    #[allow(clippy::too_many_arguments)]
    pub fn to_bf16_strided(
        &self,
        dev: &D,
        input: &D::Memory,
        rows: usize,
        row_stride: usize,
        offset: usize,
        stride: usize,
        count: usize,
        width: usize,
        out: &D::Memory,
    ) -> Result<()> {
        const K: &str = "to_bf16_strided";
        if count == 0 || width == 0 || offset + (count - 1) * stride + width > row_stride {
            return Err(DeviceError::Invalid(format!(
                "{K}: {count} slices of {width} values, {stride} apart from {offset}, in rows \
                 of {row_stride}"
            )));
        }
        need(input, rows * row_stride * F32, K, "input")?;
        need(out, rows * count * width * BF16, K, "out")?;
        let (ip, op) = (input.device_ptr(), out.device_ptr());
        let (rs, off, st, c, wd) = (
            as_i32(row_stride, K, "row stride")?,
            as_i32(offset, K, "offset")?,
            as_i32(stride, K, "stride")?,
            as_i32(count, K, "count")?,
            as_i32(width, K, "width")?,
        );
        let mut p = KernelParams::new();
        p.arg(&ip)
            .arg(&rs)
            .arg(&off)
            .arg(&st)
            .arg(&c)
            .arg(&wd)
            .arg(&op)
            .traffic(rows * count * width * F32, rows * count * width * BF16);
        // SAFETY: `to_bf16_strided(const float*, int, int, int, int, int, bf16*)`; every slice
        // lies inside its row (checked above) and both buffers hold `rows` rows.
        unsafe { dev.launch(self.kernel(K), rows_config(rows, K)?, &p) }
    }

    /// `out [selected][width] = input[rows[i]]` for FP32 rows; `rows` (i32, device) must index
    /// rows of `input`, which holds `input_rows`.
    #[allow(clippy::too_many_arguments)]
    pub fn gather_rows(
        &self,
        dev: &D,
        input: &D::Memory,
        input_rows: usize,
        rows: &D::Memory,
        selected: usize,
        width: usize,
        out: &D::Memory,
    ) -> Result<()> {
        const K: &str = "gather_rows";
        need(input, input_rows * width * F32, K, "input")?;
        need(rows, selected * I32, K, "rows")?;
        need(out, selected * width * F32, K, "out")?;
        let (ip, rp, op) = (input.device_ptr(), rows.device_ptr(), out.device_ptr());
        let wd = as_i32(width, K, "width")?;
        let mut p = KernelParams::new();
        p.arg(&ip)
            .arg(&rp)
            .arg(&wd)
            .arg(&op)
            .traffic(selected * (I32 + width * F32), selected * width * F32);
        // SAFETY: `gather_rows(const float*, const int*, int, float*)`; sizes checked above;
        // the caller guarantees the row indices (the executor builds them from its own rows).
        unsafe { dev.launch(self.kernel(K), rows_config(selected, K)?, &p) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_space_round_trips() {
        crate::tactic::assert_space_round_trips::<LayersTactic>();
    }
}
