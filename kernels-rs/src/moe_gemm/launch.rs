//! Launching the NVFP4 MoE grouped GEMM (`moe_gemm.cu`) on any [`Device`]: weights and
//! routing in the kernels' layout, device buffers, and the launches of `moe_gate_up` and
//! `moe_down`. The GPU (`cuda::GpuContext`) and the host execution layer
//! (`cuda_host::HostDevice`) run exactly this code.
//!
//! Layouts (all read from `moe_gemm.cu`; the `MoeArgs` comments there are the contract):
//! - `w13`: `[E, 2I, H/2]` packed E2M1 (low nibble = even element), gate rows `0..I` then up
//!   rows `I..2I` of each expert; `w2`: `[E, H, I/2]`.
//! - Block scales (UE4M3 bytes) per expert, either row-major `[rows, K/16]`
//!   ([`ScaleLoad::RowMajor`]) or the 128×4 swizzle of `formats::swizzle` padded to
//!   `[pad128(rows), pad4(K/16)]` ([`ScaleLoad::Swizzled128x4`]); the tactic decides which.
//! - Per expert f32: `w13_gs` (`weight_scale_2` shared by gate and up), `a13_gs` (gate/up
//!   `input_scale`), `w2_gs`, `a2_gs` (down `input_scale`, also the global scale `h` is
//!   quantized with).
//! - Routing: `expert_offsets [E+1]` (prefix sums), `sorted_token_ids [A]` and
//!   `sorted_weights [A]` grouped by expert, tokens in increasing order within an expert
//!   (the order of `Routing::assignments`); `active_experts [1+E]`: the number of experts
//!   with a token, their ids, then -1. The grid's y dimension walks that list and its z
//!   dimension the token tiles, each CTA looping over its expert's tiles, so the grid is
//!   sized by [`MoeGroupingBounds`], not by the routing itself.
//! - `x`: `[T, H]` BF16; `h_q [A, I/2]`, `h_sf [A, I/16]` the NVFP4 intermediate; `out [T, H]`
//!   f32, **accumulated atomically** by `moe_down`, so it must be zeroed before each run.

use crate::device::{
    Device, DeviceError, DeviceExt, DeviceMemory, KernelParams, LaunchConfig, Result,
};
use crate::formats::nvfp4::Nvfp4View;
use crate::formats::swizzle::{SWIZZLE_ROWS, SWIZZLE_SCALE_COLS, SwizzledScales, round_up};
use crate::moe_gemm::reference::Routing;
use crate::moe_gemm::tactic::check_problem;
use crate::moe_gemm::{MoeGemmTactic, ScaleLoad, SmemFootprint};

pub const FAMILY: &str = "moe_gemm";
pub const GATE_UP_KERNEL: &str = "moe_gate_up";
pub const DOWN_KERNEL: &str = "moe_down";
/// Poison byte for the NVFP4 intermediate: 0xFF is E4M3 NaN, which the kernels' scale
/// encoder (clamped to [2⁻⁹, 448]) never produces, so an unwritten `h_sf` byte is detectable.
pub const H_POISON: u8 = 0xFF;

/// The kernels' single parameter, passed by value. Field order and types mirror
/// `struct MoeArgs` in `moe_gemm.cu` (device pointers are 8 bytes, `int` 4), so the layouts
/// agree without padding; the asserts below pin the offsets.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct MoeArgs {
    pub expert_offsets: u64,
    pub active_experts: u64,
    pub sorted_token_ids: u64,
    pub sorted_weights: u64,
    pub hidden: i32,
    pub inter: i32,
    pub x: u64,
    pub w13: u64,
    pub w13_sf: u64,
    pub w13_gs: u64,
    pub a13_gs: u64,
    pub h_q: u64,
    pub h_sf: u64,
    pub w2: u64,
    pub w2_sf: u64,
    pub w2_gs: u64,
    pub a2_gs: u64,
    pub out: u64,
}

const _: () = {
    assert!(std::mem::size_of::<MoeArgs>() == 136);
    assert!(std::mem::align_of::<MoeArgs>() == 8);
    assert!(std::mem::offset_of!(MoeArgs, hidden) == 32);
    assert!(std::mem::offset_of!(MoeArgs, inter) == 36);
    assert!(std::mem::offset_of!(MoeArgs, x) == 40);
    assert!(std::mem::offset_of!(MoeArgs, out) == 128);
};

/// One expert's weights as a checkpoint holds them (row-major scales).
#[derive(Clone, Copy, Debug)]
pub struct ExpertWeights<'a> {
    /// `[I, H]`
    pub gate: Nvfp4View<'a>,
    /// `[I, H]`; must share `gate`'s global scale (the kernel has one `w13_gs` per expert).
    pub up: Nvfp4View<'a>,
    /// `[H, I]`
    pub down: Nvfp4View<'a>,
    pub gate_up_input_scale: f32,
    pub down_input_scale: f32,
}

/// The sizes every buffer of a layer's routed experts follows from: what an upload of real
/// weights and a zeroed placeholder of them ([`MoeDeviceWeights::zeroed`]) share.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeWeightsShape {
    pub experts: usize,
    pub hidden: usize,
    pub inter: usize,
}

impl MoeWeightsShape {
    /// The kernels need at least one expert and both sizes in whole NVFP4 blocks.
    pub fn check(&self) -> Result<()> {
        let (e, h, i) = (self.experts, self.hidden, self.inter);
        if h == 0 || i == 0 || !h.is_multiple_of(16) || !i.is_multiple_of(16) || e == 0 {
            return Err(DeviceError::Invalid(format!(
                "experts {e}, hidden {h}, inter {i}: need ≥ 1 expert and multiples of 16"
            )));
        }
        Ok(())
    }

    /// `w13`: `[E, 2I, H/2]` bytes.
    pub fn w13_bytes(&self) -> usize {
        self.experts * 2 * self.inter * self.hidden / 2
    }

    /// `w2`: `[E, H, I/2]` bytes.
    pub fn w2_bytes(&self) -> usize {
        self.experts * self.hidden * self.inter / 2
    }

    /// `(w13_sf, w2_sf)` bytes of all experts in `layout` (the swizzle pads each expert's
    /// scales to whole 128 × 4 atoms).
    pub fn scale_bytes(&self, layout: ScaleLoad) -> (usize, usize) {
        let (e, h, i) = (self.experts, self.hidden, self.inter);
        match layout {
            ScaleLoad::RowMajor => (e * 2 * i * h / 16, e * h * i / 16),
            ScaleLoad::Swizzled128x4 => {
                let padded = |rows: usize, scale_cols: usize| {
                    round_up(rows, SWIZZLE_ROWS) * round_up(scale_cols, SWIZZLE_SCALE_COLS)
                };
                (e * padded(2 * i, h / 16), e * padded(h, i / 16))
            }
        }
    }

    /// Bytes one expert's weights and scales occupy as a kernel reads them (row-major scales).
    pub fn bytes_per_expert(&self) -> usize {
        3 * self.hidden * self.inter / 2 + 3 * self.hidden * self.inter / 16
    }
}

/// Intermediate columns the kernels hold per expert for a checkpoint's `inter`: `inter`
/// rounded up to a multiple of 64 — the K of the block-scaled FP4 MMA (`moe_down` reduces over
/// the intermediate in whole 64-column steps) and whole 16-byte `cp.async` chunks of the NVFP4
/// intermediate. Kimi-K2.5's 2048 columns (256 per TP8 rank) need nothing; a small model's 32,
/// or a TP rank's 16 or 32, are padded by [`MoeWeightsHost::padded_inter`].
pub fn kernel_inter(inter: usize) -> usize {
    inter.next_multiple_of(INTER_GRANULE)
}

/// See [`kernel_inter`].
pub const INTER_GRANULE: usize = 64;

/// All experts' weights in the kernels' layout, on the host, with row-major scales (the
/// swizzled ones are derived per upload).
#[derive(Clone, Debug, Default)]
pub struct MoeWeightsHost {
    pub experts: usize,
    pub hidden: usize,
    pub inter: usize,
    /// `[E, 2I, H/2]`
    pub w13: Vec<u8>,
    /// `[E, 2I, H/16]` row-major
    pub w13_sf: Vec<u8>,
    /// `[E, H, I/2]`
    pub w2: Vec<u8>,
    /// `[E, H, I/16]` row-major
    pub w2_sf: Vec<u8>,
    pub w13_gs: Vec<f32>,
    pub a13_gs: Vec<f32>,
    pub w2_gs: Vec<f32>,
    pub a2_gs: Vec<f32>,
}

impl MoeWeightsHost {
    /// Packs checkpoint-layout experts into the kernel layout.
    pub fn from_experts(experts: &[ExpertWeights<'_>]) -> Result<Self> {
        let first = experts
            .first()
            .ok_or_else(|| DeviceError::Invalid("no experts".into()))?;
        let (inter, hidden) = (first.gate.rows, first.gate.cols);
        let mut w = MoeWeightsHost {
            experts: experts.len(),
            hidden,
            inter,
            ..Default::default()
        };
        for (e, x) in experts.iter().enumerate() {
            let shapes = [
                ("gate", x.gate.rows, x.gate.cols, inter, hidden),
                ("up", x.up.rows, x.up.cols, inter, hidden),
                ("down", x.down.rows, x.down.cols, hidden, inter),
            ];
            for (name, r, c, er, ec) in shapes {
                if (r, c) != (er, ec) {
                    return Err(DeviceError::Invalid(format!(
                        "expert {e} {name}_proj is [{r}, {c}], expected [{er}, {ec}]"
                    )));
                }
            }
            if x.gate.global_scale != x.up.global_scale {
                return Err(DeviceError::Invalid(format!(
                    "expert {e}: gate_proj and up_proj weight_scale_2 differ ({} vs {}); the \
                     fused gate/up kernel takes one per expert",
                    x.gate.global_scale, x.up.global_scale
                )));
            }
            w.w13.extend_from_slice(x.gate.packed);
            w.w13.extend_from_slice(x.up.packed);
            w.w13_sf.extend_from_slice(x.gate.block_scales);
            w.w13_sf.extend_from_slice(x.up.block_scales);
            w.w2.extend_from_slice(x.down.packed);
            w.w2_sf.extend_from_slice(x.down.block_scales);
            w.w13_gs.push(x.gate.global_scale);
            w.a13_gs.push(x.gate_up_input_scale);
            w.w2_gs.push(x.down.global_scale);
            w.a2_gs.push(x.down_input_scale);
        }
        w.check()?;
        Ok(w)
    }

    /// The same experts with `inter` intermediate columns (≥ the current, whole NVFP4 blocks):
    /// gate and up get zero rows, down zero columns, all with zero block scales. A zero row
    /// makes SiLU(0)·0 = 0 in the intermediate, which quantizes to zero codes in blocks of its
    /// own (the real blocks' scales do not change), and meets zero weights in `moe_down`: the
    /// padded experts compute exactly the unpadded ones' output.
    pub fn padded_inter(self, inter: usize) -> Self {
        assert!(
            inter >= self.inter && inter.is_multiple_of(16),
            "padding {} intermediate columns to {inter}",
            self.inter
        );
        if inter == self.inter {
            return self;
        }
        let (i, h) = (self.inter, self.hidden);
        // Parts of `rows` rows of `cols` bytes, each followed by zero rows up to `padded_rows`.
        let pad_rows = |all: &[u8], rows: usize, padded_rows: usize, cols: usize| {
            let mut out = Vec::with_capacity(all.len() / rows * padded_rows);
            for part in all.chunks_exact(rows * cols) {
                out.extend_from_slice(part);
                out.resize(out.len() + (padded_rows - rows) * cols, 0);
            }
            out
        };
        // Every row of `cols` bytes widened to `padded_cols` with zeros.
        let pad_cols = |all: &[u8], cols: usize, padded_cols: usize| {
            let mut out = Vec::with_capacity(all.len() / cols * padded_cols);
            for row in all.chunks_exact(cols) {
                out.extend_from_slice(row);
                out.resize(out.len() + padded_cols - cols, 0);
            }
            out
        };
        MoeWeightsHost {
            inter,
            // Gate rows then up rows of each expert: two parts of `i` rows per expert.
            w13: pad_rows(&self.w13, i, inter, h / 2),
            w13_sf: pad_rows(&self.w13_sf, i, inter, h / 16),
            w2: pad_cols(&self.w2, i / 2, inter / 2),
            w2_sf: pad_cols(&self.w2_sf, i / 16, inter / 16),
            ..self
        }
    }

    /// Experts, hidden and intermediate sizes.
    pub fn shape(&self) -> MoeWeightsShape {
        MoeWeightsShape {
            experts: self.experts,
            hidden: self.hidden,
            inter: self.inter,
        }
    }

    /// Checks that every buffer has the size its shape implies.
    pub fn check(&self) -> Result<()> {
        let shape = self.shape();
        shape.check()?;
        let (w13_sf, w2_sf) = shape.scale_bytes(ScaleLoad::RowMajor);
        let e = shape.experts;
        let sizes = [
            ("w13", self.w13.len(), shape.w13_bytes()),
            ("w13_sf", self.w13_sf.len(), w13_sf),
            ("w2", self.w2.len(), shape.w2_bytes()),
            ("w2_sf", self.w2_sf.len(), w2_sf),
            ("w13_gs", self.w13_gs.len(), e),
            ("a13_gs", self.a13_gs.len(), e),
            ("w2_gs", self.w2_gs.len(), e),
            ("a2_gs", self.a2_gs.len(), e),
        ];
        for (name, got, want) in sizes {
            if got != want {
                return Err(DeviceError::Invalid(format!(
                    "{name} has {got} elements, expected {want}"
                )));
            }
        }
        Ok(())
    }

    /// Bytes one expert's weights and scales occupy as a kernel reads them (row-major scales):
    /// the unique weight traffic of one active expert.
    pub fn bytes_per_expert(&self) -> usize {
        self.shape().bytes_per_expert()
    }

    /// `(w13_sf, w2_sf)` of all experts in `layout`.
    pub fn scales(&self, layout: ScaleLoad) -> (Vec<u8>, Vec<u8>) {
        match layout {
            ScaleLoad::RowMajor => (self.w13_sf.clone(), self.w2_sf.clone()),
            ScaleLoad::Swizzled128x4 => {
                let (h, i) = (self.hidden, self.inter);
                let swizzle = |all: &[u8], rows: usize, cols: usize| -> Vec<u8> {
                    let mut out = Vec::with_capacity(all.len());
                    for one in all.chunks_exact(rows * cols) {
                        out.extend_from_slice(
                            &SwizzledScales::from_row_major(one, rows, cols).data,
                        );
                    }
                    out
                };
                (
                    swizzle(&self.w13_sf, 2 * i, h / 16),
                    swizzle(&self.w2_sf, h, i / 16),
                )
            }
        }
    }
}

/// Routing grouped by expert, as the kernels read it.
#[derive(Clone, Debug, PartialEq)]
pub struct GroupedRouting {
    pub tokens: usize,
    pub top_k: usize,
    pub experts: usize,
    /// `[E + 1]`
    pub expert_offsets: Vec<i32>,
    /// `[A]`
    pub sorted_token_ids: Vec<i32>,
    /// `[A]`
    pub sorted_weights: Vec<f32>,
    /// Largest number of tokens any expert received: sizes the grid's z dimension.
    pub max_per_expert: usize,
}

impl GroupedRouting {
    pub fn new(routing: &Routing, experts: usize) -> Result<Self> {
        if routing.top_k == 0 || routing.experts.len() != routing.weights.len() {
            return Err(DeviceError::Invalid(format!(
                "routing: top_k {}, {} expert ids, {} weights",
                routing.top_k,
                routing.experts.len(),
                routing.weights.len()
            )));
        }
        if let Some(bad) = routing.experts.iter().find(|&&e| e as usize >= experts) {
            return Err(DeviceError::Invalid(format!(
                "routing names expert {bad}, but there are {experts}"
            )));
        }
        if routing.experts.len() >= i32::MAX as usize {
            return Err(DeviceError::Invalid(
                "too many assignments for i32 offsets".into(),
            ));
        }
        let per_expert = routing.assignments(experts);
        let mut g = GroupedRouting {
            tokens: routing.tokens(),
            top_k: routing.top_k,
            experts,
            expert_offsets: Vec::with_capacity(experts + 1),
            sorted_token_ids: Vec::with_capacity(routing.experts.len()),
            sorted_weights: Vec::with_capacity(routing.experts.len()),
            max_per_expert: 0,
        };
        g.expert_offsets.push(0);
        for list in &per_expert {
            for &(t, k) in list {
                g.sorted_token_ids.push(t as i32);
                g.sorted_weights
                    .push(routing.weights[t * routing.top_k + k]);
            }
            g.expert_offsets.push(g.sorted_token_ids.len() as i32);
            g.max_per_expert = g.max_per_expert.max(list.len());
        }
        Ok(g)
    }

    pub fn assignments(&self) -> usize {
        self.sorted_token_ids.len()
    }

    /// Experts that received at least one token.
    pub fn active_experts(&self) -> usize {
        self.expert_offsets
            .windows(2)
            .filter(|w| w[1] > w[0])
            .count()
    }

    /// `[1 + experts]`: the number of experts with a token, their ids in increasing order,
    /// then -1 (what `layers::group_by_expert` writes on the device).
    pub fn active_expert_list(&self) -> Vec<i32> {
        let mut list = vec![-1; self.experts + 1];
        let mut active = 0;
        for (e, w) in self.expert_offsets.windows(2).enumerate() {
            if w[1] > w[0] {
                active += 1;
                list[active] = e as i32;
            }
        }
        list[0] = active as i32;
        list
    }

    /// Bounds that fit this grouping exactly: one CTA per active expert and token tile.
    pub fn exact_bounds(&self) -> MoeGroupingBounds {
        MoeGroupingBounds {
            max_active_experts: self.active_experts(),
            tokens_per_pass: self.max_per_expert,
        }
    }
}

/// What the host knows of a grouping when it sizes the MoE grid: on the device path, only
/// the step's shape (a CUDA graph's grid cannot depend on the routing). `grid.y` is
/// `max_active_experts` (CTAs past the actual count exit at once) and `grid.z` covers
/// `tokens_per_pass` tokens of an expert; an expert with more loops over its further token
/// tiles, so any bounds compute the same output, and only the parallelism changes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeGroupingBounds {
    pub max_active_experts: usize,
    pub tokens_per_pass: usize,
}

impl MoeGroupingBounds {
    /// The most experts `tokens · top_k` assignments can reach, and twice their mean load
    /// over those experts per pass: a decode batch's expert that draws more than that (rare
    /// under a balanced router) takes a second pass, instead of every grid carrying the
    /// worst case of `tokens` tiles per expert.
    pub fn for_tokens(tokens: usize, top_k: usize, experts: usize) -> Self {
        let assignments = tokens * top_k;
        let max_active_experts = experts.min(assignments);
        let mean_load = assignments.div_ceil(max_active_experts.max(1));
        MoeGroupingBounds {
            max_active_experts,
            tokens_per_pass: (2 * mean_load).min(tokens),
        }
    }

    /// `grid.z` before the split-K factor: token tiles of `tile_m` per pass.
    pub fn token_tiles(&self, tile_m: u32) -> u32 {
        self.tokens_per_pass.div_ceil(tile_m as usize).max(1) as u32
    }
}

/// Weights on a device; scales in each layout that was asked for.
pub struct MoeDeviceWeights<D: Device> {
    pub experts: usize,
    pub hidden: usize,
    pub inter: usize,
    pub bytes_per_expert: usize,
    w13: D::Memory,
    w2: D::Memory,
    w13_gs: D::Memory,
    a13_gs: D::Memory,
    w2_gs: D::Memory,
    a2_gs: D::Memory,
    /// `(w13_sf, w2_sf)`, indexed by `ScaleLoad::macro_value`.
    scales: [Option<(D::Memory, D::Memory)>; 2],
}

impl<D: Device> MoeDeviceWeights<D> {
    /// `(read, written)` bytes of `moe_gate_up` and of `moe_down` over `active` experts and
    /// `assignments` (token, expert) pairs of `tokens` tokens: each active expert's weights
    /// once (gate ‖ up is two thirds of an expert), the BF16 input, the NVFP4 intermediate,
    /// the grouping, and the FP32 output `moe_down` accumulates into.
    pub fn launch_traffic(
        &self,
        tokens: usize,
        assignments: usize,
        active: usize,
    ) -> [(usize, usize); 2] {
        let grouping = (self.experts + 1) * 4 + assignments * 8;
        let intermediate = assignments * self.inter / 2 + assignments * self.inter / 16;
        let out = tokens * self.hidden * 4;
        let gate_up_weights = active * self.bytes_per_expert * 2 / 3;
        [
            (
                gate_up_weights + tokens * self.hidden * 2 + grouping,
                intermediate,
            ),
            (
                active * self.bytes_per_expert - gate_up_weights + intermediate + grouping + out,
                out,
            ),
        ]
    }

    pub fn upload(dev: &D, host: &MoeWeightsHost, layouts: &[ScaleLoad]) -> Result<Self> {
        host.check()?;
        let mut scales = [None, None];
        for &layout in layouts {
            let (a, b) = host.scales(layout);
            scales[layout.macro_value() as usize] = Some((dev.upload(&a)?, dev.upload(&b)?));
        }
        Ok(Self {
            experts: host.experts,
            hidden: host.hidden,
            inter: host.inter,
            bytes_per_expert: host.bytes_per_expert(),
            w13: dev.upload(&host.w13)?,
            w2: dev.upload(&host.w2)?,
            w13_gs: dev.upload(&host.w13_gs)?,
            a13_gs: dev.upload(&host.a13_gs)?,
            w2_gs: dev.upload(&host.w2_gs)?,
            a2_gs: dev.upload(&host.a2_gs)?,
            scales,
        })
    }

    /// Zeroed buffers of the sizes [`upload`](Self::upload) makes for `shape` and `layouts`:
    /// the weights' footprint and addresses without their values (a dry run's placeholder).
    pub fn zeroed(dev: &D, shape: MoeWeightsShape, layouts: &[ScaleLoad]) -> Result<Self> {
        shape.check()?;
        let mut scales = [None, None];
        for &layout in layouts {
            let (a, b) = shape.scale_bytes(layout);
            scales[layout.macro_value() as usize] =
                Some((dev.alloc_zeroed(a)?, dev.alloc_zeroed(b)?));
        }
        let per_expert_f32 = || dev.alloc_elements::<f32>(shape.experts);
        Ok(Self {
            experts: shape.experts,
            hidden: shape.hidden,
            inter: shape.inter,
            bytes_per_expert: shape.bytes_per_expert(),
            w13: dev.alloc_zeroed(shape.w13_bytes())?,
            w2: dev.alloc_zeroed(shape.w2_bytes())?,
            w13_gs: per_expert_f32()?,
            a13_gs: per_expert_f32()?,
            w2_gs: per_expert_f32()?,
            a2_gs: per_expert_f32()?,
            scales,
        })
    }

    /// Every buffer's name and bytes (scales per layout held).
    pub fn buffer_bytes(&self) -> Vec<(String, usize)> {
        let mut out: Vec<(String, usize)> = [
            ("w13", &self.w13),
            ("w2", &self.w2),
            ("w13_gs", &self.w13_gs),
            ("a13_gs", &self.a13_gs),
            ("w2_gs", &self.w2_gs),
            ("a2_gs", &self.a2_gs),
        ]
        .into_iter()
        .map(|(name, m)| (name.to_string(), m.len()))
        .collect();
        for (layout, held) in self.scales.iter().enumerate() {
            if let Some((a, b)) = held {
                out.push((format!("w13_sf[{layout}]"), a.len()));
                out.push((format!("w2_sf[{layout}]"), b.len()));
            }
        }
        out
    }

    pub fn device_bytes(&self) -> usize {
        let sf: usize = self
            .scales
            .iter()
            .flatten()
            .map(|(a, b)| a.len() + b.len())
            .sum();
        self.w13.len() + self.w2.len() + sf
    }
}

/// A grouped routing on a device.
pub struct MoeDeviceRouting<D: Device> {
    pub host: GroupedRouting,
    expert_offsets: D::Memory,
    active_experts: D::Memory,
    sorted_token_ids: D::Memory,
    sorted_weights: D::Memory,
}

impl<D: Device> MoeDeviceRouting<D> {
    pub fn upload(dev: &D, routing: GroupedRouting) -> Result<Self> {
        // An empty routing keeps one dummy element that no kernel reads (offsets are all 0):
        // some drivers refuse zero-length allocations.
        let ids = if routing.sorted_token_ids.is_empty() {
            vec![0]
        } else {
            routing.sorted_token_ids.clone()
        };
        let ws = if routing.sorted_weights.is_empty() {
            vec![0.0]
        } else {
            routing.sorted_weights.clone()
        };
        Ok(Self {
            expert_offsets: dev.upload(&routing.expert_offsets)?,
            active_experts: dev.upload(&routing.active_expert_list())?,
            sorted_token_ids: dev.upload(&ids)?,
            sorted_weights: dev.upload(&ws)?,
            host: routing,
        })
    }
}

/// Activations, the NVFP4 intermediate and the output of one batch.
pub struct MoeDeviceActivations<D: Device> {
    pub tokens: usize,
    pub hidden: usize,
    pub inter: usize,
    /// Assignments (`tokens · top_k`) the intermediate has rows for.
    pub assignments: usize,
    x: D::Memory,
    h_q: D::Memory,
    h_sf: D::Memory,
    out: D::Memory,
}

impl<D: Device> MoeDeviceActivations<D> {
    /// `x_bf16`: `[tokens, hidden]` BF16 bit patterns.
    pub fn new(
        dev: &D,
        x_bf16: &[u16],
        tokens: usize,
        hidden: usize,
        inter: usize,
        assignments: usize,
    ) -> Result<Self> {
        if x_bf16.len() != tokens * hidden {
            return Err(DeviceError::Invalid(format!(
                "x has {} values, expected {tokens}×{hidden}",
                x_bf16.len()
            )));
        }
        // Zero-byte allocations are invalid: empty batches keep one unread element.
        let rows = assignments.max(1);
        let x_padded;
        let x_bf16 = if x_bf16.is_empty() {
            x_padded = [0u16; 8];
            &x_padded[..]
        } else {
            x_bf16
        };
        let mut a = Self {
            tokens,
            hidden,
            inter,
            assignments,
            x: dev.upload(x_bf16)?,
            h_q: dev.alloc_zeroed(rows * inter / 2)?,
            h_sf: dev.alloc_zeroed(rows * inter / 16)?,
            out: dev.alloc_elements::<f32>(tokens * hidden)?,
        };
        a.poison(dev)?;
        Ok(a)
    }

    /// Fills the intermediate with [`H_POISON`] and zeroes `out` (it is accumulated into, so
    /// it cannot be poisoned; an unwritten output stays 0 where the reference is not).
    pub fn poison(&mut self, dev: &D) -> Result<()> {
        dev.fill(&mut self.h_q, H_POISON)?;
        dev.fill(&mut self.h_sf, H_POISON)?;
        self.zero_out(dev)
    }

    pub fn zero_out(&mut self, dev: &D) -> Result<()> {
        dev.fill(&mut self.out, 0)
    }

    /// Copies `out` to the host (after every launch has finished).
    pub fn read_out(&self, dev: &D) -> Result<Vec<f32>> {
        let mut v: Vec<f32> = dev.download(&self.out)?;
        v.truncate(self.tokens * self.hidden);
        Ok(v)
    }

    /// `(h_q, h_sf)` of the assignments.
    pub fn read_h(&self, dev: &D) -> Result<(Vec<u8>, Vec<u8>)> {
        let mut q = dev.download_bytes(&self.h_q)?;
        let mut sf = dev.download_bytes(&self.h_sf)?;
        q.truncate(self.assignments * self.inter / 2);
        sf.truncate(self.assignments * self.inter / 16);
        Ok((q, sf))
    }
}

/// The two kernels of one tactic, loaded and configured for launch.
pub struct MoeKernels<D: Device> {
    pub tactic: MoeGemmTactic,
    pub smem: SmemFootprint,
    pub gate_up: D::Kernel,
    pub down: D::Kernel,
}

impl<D: Device> MoeKernels<D> {
    /// Checks that the tactic can run on the device, loads both kernels and raises their
    /// dynamic shared-memory limit to what the tactic needs.
    pub fn load(dev: &D, tactic: MoeGemmTactic) -> Result<Self> {
        let sm = dev.sm()?;
        let id = tactic.id();
        let not_runnable = |why: String| DeviceError::TacticNotRunnable {
            tactic: id.clone(),
            sm: sm.to_string(),
            why,
        };
        tactic.validate().map_err(|e| not_runnable(e.to_string()))?;
        if !tactic.variant.runs_on(sm) {
            return Err(not_runnable(format!(
                "variant {:?} is not built for {sm}",
                tactic.variant
            )));
        }
        let smem = tactic.smem();
        let limit = dev.max_dynamic_shared();
        if smem.max() > limit {
            return Err(not_runnable(format!(
                "needs {} B of shared memory, the device allows {limit} B per block",
                smem.max()
            )));
        }
        Ok(Self {
            tactic,
            smem,
            gate_up: dev.load_kernel(FAMILY, &id, GATE_UP_KERNEL, smem.gate_up)?,
            down: dev.load_kernel(FAMILY, &id, DOWN_KERNEL, smem.down)?,
        })
    }

    fn check(
        &self,
        w: &MoeDeviceWeights<D>,
        r: &MoeDeviceRouting<D>,
        a: &MoeDeviceActivations<D>,
        bounds: &MoeGroupingBounds,
    ) -> Result<()> {
        let t = &self.tactic;
        check_problem(t, w.hidden, w.inter)?;
        let bad = |why: String| {
            Err(DeviceError::Shape {
                tactic: t.id(),
                why,
            })
        };
        if (a.hidden, a.inter) != (w.hidden, w.inter) {
            return bad(format!(
                "activations are for hidden {} / inter {}, weights for {} / {}",
                a.hidden, a.inter, w.hidden, w.inter
            ));
        }
        if r.host.experts != w.experts {
            return bad(format!(
                "routing over {} experts, weights have {}",
                r.host.experts, w.experts
            ));
        }
        if r.host.tokens != a.tokens || r.host.assignments() > a.assignments {
            return bad(format!(
                "routing has {} tokens / {} assignments, buffers {} / {}",
                r.host.tokens,
                r.host.assignments(),
                a.tokens,
                a.assignments
            ));
        }
        check_grid(t, w.experts, bounds)?;
        if w.scales[t.scale_load.macro_value() as usize].is_none() {
            return bad(format!(
                "weights were uploaded without {:?} scales",
                t.scale_load
            ));
        }
        Ok(())
    }

    fn args(
        &self,
        w: &MoeDeviceWeights<D>,
        r: &MoeDeviceRouting<D>,
        a: &MoeDeviceActivations<D>,
    ) -> MoeArgs {
        let grouping = [
            &r.expert_offsets,
            &r.active_experts,
            &r.sorted_token_ids,
            &r.sorted_weights,
        ];
        let io = MoeDeviceIo {
            x: &a.x,
            h_q: &a.h_q,
            h_sf: &a.h_sf,
            out: &a.out,
        };
        self.args_from(w, grouping, &io)
    }

    /// The kernels' argument block from the weights, the grouping buffers
    /// (`expert_offsets`, `active_experts`, `sorted_token_ids`, `sorted_weights`) and the
    /// activations; the tactic's scale layout must have been uploaded (the callers check).
    fn args_from(
        &self,
        w: &MoeDeviceWeights<D>,
        [
            expert_offsets,
            active_experts,
            sorted_token_ids,
            sorted_weights,
        ]: [&D::Memory; 4],
        io: &MoeDeviceIo<'_, D>,
    ) -> MoeArgs {
        let (w13_sf, w2_sf) = w.scales[self.tactic.scale_load.macro_value() as usize]
            .as_ref()
            .expect("checked by the caller");
        MoeArgs {
            expert_offsets: expert_offsets.device_ptr(),
            active_experts: active_experts.device_ptr(),
            sorted_token_ids: sorted_token_ids.device_ptr(),
            sorted_weights: sorted_weights.device_ptr(),
            hidden: w.hidden as i32,
            inter: w.inter as i32,
            x: io.x.device_ptr(),
            w13: w.w13.device_ptr(),
            w13_sf: w13_sf.device_ptr(),
            w13_gs: w.w13_gs.device_ptr(),
            a13_gs: w.a13_gs.device_ptr(),
            h_q: io.h_q.device_ptr(),
            h_sf: io.h_sf.device_ptr(),
            w2: w.w2.device_ptr(),
            w2_sf: w2_sf.device_ptr(),
            w2_gs: w.w2_gs.device_ptr(),
            a2_gs: w.a2_gs.device_ptr(),
            out: io.out.device_ptr(),
        }
    }

    /// Launch configurations `(moe_gate_up, moe_down)`; `None` when no expert can have a
    /// token (a zero grid dimension is invalid).
    pub fn launch_configs(
        &self,
        hidden: usize,
        inter: usize,
        bounds: &MoeGroupingBounds,
    ) -> Option<(LaunchConfig, LaunchConfig)> {
        launch_configs(&self.tactic, hidden, inter, bounds)
    }

    /// Launches `moe_gate_up`: `x` → `h_q`, `h_sf`, on a grid that fits the routing exactly.
    pub fn launch_gate_up(
        &self,
        dev: &D,
        w: &MoeDeviceWeights<D>,
        r: &MoeDeviceRouting<D>,
        a: &mut MoeDeviceActivations<D>,
    ) -> Result<()> {
        self.launch(dev, w, r, a, &r.host.exact_bounds(), true)
    }

    /// Launches `moe_down`: `h` → `out` (accumulated: zero `out` first), on a grid that fits
    /// the routing exactly.
    pub fn launch_down(
        &self,
        dev: &D,
        w: &MoeDeviceWeights<D>,
        r: &MoeDeviceRouting<D>,
        a: &mut MoeDeviceActivations<D>,
    ) -> Result<()> {
        self.launch(dev, w, r, a, &r.host.exact_bounds(), false)
    }

    /// Zeroes `out`, then runs both kernels on a grid that fits the routing exactly.
    pub fn run(
        &self,
        dev: &D,
        w: &MoeDeviceWeights<D>,
        r: &MoeDeviceRouting<D>,
        a: &mut MoeDeviceActivations<D>,
    ) -> Result<()> {
        self.run_with_bounds(dev, w, r, a, &r.host.exact_bounds())
    }

    /// [`run`](Self::run) on the grid `bounds` size: bounds that do not cover the routing
    /// (fewer token tiles per pass than an expert has) make the CTAs loop; bounds below the
    /// active experts are refused, since the CTAs of the experts past them would be missing.
    pub fn run_with_bounds(
        &self,
        dev: &D,
        w: &MoeDeviceWeights<D>,
        r: &MoeDeviceRouting<D>,
        a: &mut MoeDeviceActivations<D>,
        bounds: &MoeGroupingBounds,
    ) -> Result<()> {
        a.zero_out(dev)?;
        self.launch(dev, w, r, a, bounds, true)?;
        self.launch(dev, w, r, a, bounds, false)
    }

    fn launch(
        &self,
        dev: &D,
        w: &MoeDeviceWeights<D>,
        r: &MoeDeviceRouting<D>,
        a: &mut MoeDeviceActivations<D>,
        bounds: &MoeGroupingBounds,
        gate_up: bool,
    ) -> Result<()> {
        self.check(w, r, a, bounds)?;
        if bounds.max_active_experts < r.host.active_experts() {
            return Err(DeviceError::Shape {
                tactic: self.tactic.id(),
                why: format!(
                    "grid for {} active experts, the routing has {}",
                    bounds.max_active_experts,
                    r.host.active_experts()
                ),
            });
        }
        let Some((cfg_gu, cfg_down)) = self.launch_configs(w.hidden, w.inter, bounds) else {
            return Ok(());
        };
        let args = self.args(w, r, a);
        let (kernel, cfg) = if gate_up {
            (&self.gate_up, cfg_gu)
        } else {
            (&self.down, cfg_down)
        };
        let routing = &r.host;
        let active = routing
            .expert_offsets
            .windows(2)
            .filter(|o| o[1] > o[0])
            .count();
        let [gu, down] = w.launch_traffic(routing.tokens, routing.sorted_token_ids.len(), active);
        let (read, written) = if gate_up { gu } else { down };
        let mut params = KernelParams::new();
        params.arg(&args).traffic(read, written);
        // SAFETY: `args` matches the kernel's single by-value parameter (`MoeArgs`), every
        // pointer in it is a live allocation of `dev` sized by `check` for this launch's grid,
        // and the dynamic shared memory was opted into at load.
        unsafe { dev.launch(kernel, cfg, &params) }
    }
}

/// A routing grouped on the device in the same step (by `layers::group_by_expert`): the host
/// knows only `bounds` (usually [`MoeGroupingBounds::for_tokens`]), which size the grid; the
/// CTAs past the active experts return at once and those of an expert with more tokens than
/// a pass covers loop. That keeps a decode step free of host decisions (and capturable as a
/// CUDA graph).
pub struct MoeDeviceGrouping<'a, D: Device> {
    pub tokens: usize,
    pub top_k: usize,
    pub experts: usize,
    pub bounds: MoeGroupingBounds,
    /// `[experts + 1]` i32
    pub expert_offsets: &'a D::Memory,
    /// `[1 + experts]` i32: the active count, then the active experts' ids
    pub active_experts: &'a D::Memory,
    /// `[tokens · top_k]` i32
    pub sorted_token_ids: &'a D::Memory,
    /// `[tokens · top_k]` f32
    pub sorted_weights: &'a D::Memory,
}

/// The MoE's activations in device buffers the caller owns: `x [tokens][hidden]` BF16, the
/// NVFP4 intermediate `h_q [tokens · top_k][inter / 2]` and `h_sf [tokens · top_k][inter /
/// 16]`, and `out [tokens][hidden]` f32 (accumulated into).
pub struct MoeDeviceIo<'a, D: Device> {
    pub x: &'a D::Memory,
    pub h_q: &'a D::Memory,
    pub h_sf: &'a D::Memory,
    pub out: &'a D::Memory,
}

impl<D: Device> MoeKernels<D> {
    /// Runs `moe_gate_up` then `moe_down` over a device-side grouping, accumulating into
    /// `io.out` (which the caller zeroes, or fills with what the routed experts add to).
    pub fn run_device_grouped(
        &self,
        dev: &D,
        w: &MoeDeviceWeights<D>,
        g: &MoeDeviceGrouping<'_, D>,
        io: &MoeDeviceIo<'_, D>,
    ) -> Result<()> {
        let t = &self.tactic;
        check_problem(t, w.hidden, w.inter)?;
        let bad = |why: String| {
            Err(DeviceError::Shape {
                tactic: t.id(),
                why,
            })
        };
        let assignments = g.tokens * g.top_k;
        if g.experts != w.experts {
            return bad(format!(
                "routing over {} experts, weights have {}",
                g.experts, w.experts
            ));
        }
        let sizes = [
            (
                "expert_offsets",
                g.expert_offsets.len(),
                (g.experts + 1) * 4,
            ),
            (
                "active_experts",
                g.active_experts.len(),
                (g.experts + 1) * 4,
            ),
            (
                "sorted_token_ids",
                g.sorted_token_ids.len(),
                assignments * 4,
            ),
            ("sorted_weights", g.sorted_weights.len(), assignments * 4),
            ("x", io.x.len(), g.tokens * w.hidden * 2),
            ("h_q", io.h_q.len(), assignments * w.inter / 2),
            ("h_sf", io.h_sf.len(), assignments * w.inter / 16),
            ("out", io.out.len(), g.tokens * w.hidden * 4),
        ];
        for (name, have, want) in sizes {
            if have < want {
                return bad(format!("{name} holds {have} B, the launch needs {want} B"));
            }
        }
        // Any grouping of `tokens · top_k` assignments has at most that many active experts.
        let reachable = g.experts.min(assignments);
        if g.bounds.max_active_experts < reachable {
            return bad(format!(
                "grid for {} active experts, {} tokens × top-{} can reach {reachable}",
                g.bounds.max_active_experts, g.tokens, g.top_k
            ));
        }
        check_grid(t, w.experts, &g.bounds)?;
        if w.scales[t.scale_load.macro_value() as usize].is_none() {
            return bad(format!(
                "weights were uploaded without {:?} scales",
                t.scale_load
            ));
        }
        let Some((cfg_gu, cfg_down)) = launch_configs(t, w.hidden, w.inter, &g.bounds) else {
            return Ok(());
        };
        let grouping = [
            g.expert_offsets,
            g.active_experts,
            g.sorted_token_ids,
            g.sorted_weights,
        ];
        let args = self.args_from(w, grouping, io);
        // The routing is on the device: at most the grid's bound of experts is active.
        let [gu, down] = w.launch_traffic(g.tokens, assignments, g.bounds.max_active_experts);
        let mut params = KernelParams::new();
        params.arg(&args).traffic(gu.0, gu.1);
        // SAFETY: `args` matches the kernels' by-value `MoeArgs`; every buffer was checked
        // above for `tokens` rows and `tokens · top_k` assignments, which bound what any
        // grouping of them can address; grid.y covers every expert the assignments can reach
        // and the CTAs loop over their expert's token tiles, so every row is computed once;
        // the dynamic shared memory was opted into at load.
        unsafe { dev.launch(&self.gate_up, cfg_gu, &params)? };
        params.traffic(down.0, down.1);
        // SAFETY: as above, the same arguments for `moe_down`.
        unsafe { dev.launch(&self.down, cfg_down, &params) }
    }
}

/// Grid dimensions within CUDA's y/z limit.
fn check_grid(t: &MoeGemmTactic, experts: usize, bounds: &MoeGroupingBounds) -> Result<()> {
    let z = bounds.token_tiles(t.tile_m) as usize * t.split_k as usize;
    if bounds.max_active_experts > experts.min(65_535) || z > 65_535 {
        return Err(DeviceError::Shape {
            tactic: t.id(),
            why: format!(
                "grid y {} (of {experts} experts) / z {z} beyond the experts or 65535",
                bounds.max_active_experts
            ),
        });
    }
    Ok(())
}

/// Launch configurations `(moe_gate_up, moe_down)` of `tactic` for a problem; `None` when no
/// expert can have a token (a zero grid dimension is invalid).
pub fn launch_configs(
    tactic: &MoeGemmTactic,
    hidden: usize,
    inter: usize,
    bounds: &MoeGroupingBounds,
) -> Option<(LaunchConfig, LaunchConfig)> {
    if bounds.max_active_experts == 0 || bounds.tokens_per_pass == 0 {
        return None;
    }
    let t = tactic;
    let smem = t.smem();
    let m_tiles = bounds.token_tiles(t.tile_m);
    let experts = bounds.max_active_experts;
    let block = (t.threads(), 1, 1);
    Some((
        // grid: (inter / (TN/2), most active experts, token tiles per pass)
        LaunchConfig {
            grid_dim: (
                (inter / (t.tile_n as usize / 2)) as u32,
                experts as u32,
                m_tiles,
            ),
            block_dim: block,
            shared_mem_bytes: smem.gate_up as u32,
        },
        // grid: (hidden / TN, most active experts, token tiles per pass · SPLIT_K)
        LaunchConfig {
            grid_dim: (
                (hidden / t.tile_n as usize) as u32,
                experts as u32,
                m_tiles * t.split_k,
            ),
            block_dim: block,
            shared_mem_bytes: smem.down as u32,
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::Sm;

    /// A zeroed placeholder has every buffer of the size an upload of real experts makes, in
    /// both scale layouts, for sizes the swizzle pads (48 rows, 3 scale columns) and not.
    #[test]
    fn zeroed_weights_have_the_uploads_buffer_sizes() {
        let dev = crate::device::dry::DryDevice::default();
        for (experts, hidden, inter) in [(3, 48, 32), (2, 256, 128)] {
            let shape = MoeWeightsShape {
                experts,
                hidden,
                inter,
            };
            let (w13_sf, w2_sf) = shape.scale_bytes(ScaleLoad::RowMajor);
            let host = MoeWeightsHost {
                experts,
                hidden,
                inter,
                w13: vec![0; shape.w13_bytes()],
                w13_sf: vec![0; w13_sf],
                w2: vec![0; shape.w2_bytes()],
                w2_sf: vec![0; w2_sf],
                w13_gs: vec![1.0; experts],
                a13_gs: vec![1.0; experts],
                w2_gs: vec![1.0; experts],
                a2_gs: vec![1.0; experts],
            };
            for layouts in [
                &[ScaleLoad::RowMajor][..],
                &[ScaleLoad::Swizzled128x4],
                &[ScaleLoad::RowMajor, ScaleLoad::Swizzled128x4],
            ] {
                let uploaded = MoeDeviceWeights::upload(&dev, &host, layouts).unwrap();
                let zeroed = MoeDeviceWeights::zeroed(&dev, host.shape(), layouts).unwrap();
                assert_eq!(
                    uploaded.buffer_bytes(),
                    zeroed.buffer_bytes(),
                    "{layouts:?}"
                );
                assert_eq!(uploaded.bytes_per_expert, zeroed.bytes_per_expert);
            }
        }
    }

    fn routing() -> Routing {
        Routing {
            top_k: 2,
            experts: vec![2, 0, 0, 2, 2, 1],
            weights: vec![0.1, 0.2, 0.3, 0.4, 0.5, 0.6],
        }
    }

    #[test]
    fn grouping_follows_expert_then_token_order() {
        let g = GroupedRouting::new(&routing(), 4).unwrap();
        assert_eq!(g.expert_offsets, vec![0, 2, 3, 6, 6]);
        assert_eq!(g.sorted_token_ids, vec![0, 1, 2, 0, 1, 2]);
        assert_eq!(g.sorted_weights, vec![0.2, 0.3, 0.6, 0.1, 0.4, 0.5]);
        assert_eq!(g.max_per_expert, 3);
        assert_eq!(g.active_experts(), 3);
        assert_eq!(g.active_expert_list(), vec![3, 0, 1, 2, -1]);
        assert_eq!(
            g.exact_bounds(),
            MoeGroupingBounds {
                max_active_experts: 3,
                tokens_per_pass: 3
            }
        );
        assert!(GroupedRouting::new(&routing(), 2).is_err());
    }

    #[test]
    fn swizzled_scales_match_the_kernel_offsets() {
        // moe_gemm.cu weight_sf_offset: ((rt·cols4 + col4)·32 + r%32)·16 + (r/32)·4 (+ j).
        let (e, h, i) = (2, 128, 64);
        let mut w = MoeWeightsHost {
            experts: e,
            hidden: h,
            inter: i,
            w13: vec![0; e * 2 * i * h / 2],
            w13_sf: (0..e * 2 * i * h / 16).map(|v| (v % 251) as u8).collect(),
            w2: vec![0; e * h * i / 2],
            w2_sf: vec![0; e * h * i / 16],
            ..Default::default()
        };
        for v in [&mut w.w13_gs, &mut w.a13_gs, &mut w.w2_gs, &mut w.a2_gs] {
            *v = vec![1.0; e];
        }
        w.check().unwrap();
        let (sw, _) = w.scales(ScaleLoad::Swizzled128x4);
        let (rows, kb) = (2 * i, h / 16);
        let (prow, pcols) = (rows.div_ceil(128) * 128, kb.div_ceil(4) * 4);
        assert_eq!(sw.len(), e * prow * pcols);
        for ex in 0..e {
            for r in 0..rows {
                for c in 0..kb {
                    let off = (((r / 128) * (pcols / 4) + c / 4) * 32 + r % 32) * 16
                        + (r % 128 / 32) * 4
                        + c % 4;
                    assert_eq!(
                        sw[ex * prow * pcols + off],
                        w.w13_sf[ex * rows * kb + r * kb + c]
                    );
                }
            }
        }
    }

    #[test]
    fn device_bounds_cover_what_the_assignments_can_reach() {
        // Kimi-K2.5: 384 experts, top-8. Batch 1 reaches 8 experts, batch 32 at most 256, a
        // prefill chunk of 8192 tokens all 384 with twice its mean load of 171 per pass.
        let b = |tokens| MoeGroupingBounds::for_tokens(tokens, 8, 384);
        let pair = |g: MoeGroupingBounds| (g.max_active_experts, g.tokens_per_pass);
        assert_eq!(pair(b(1)), (8, 1));
        assert_eq!(pair(b(8)), (64, 2));
        assert_eq!(pair(b(32)), (256, 2));
        assert_eq!(pair(b(8192)), (384, 342));
        assert_eq!(pair(b(0)), (0, 0));
        assert_eq!(b(8192).token_tiles(16), 22);
        // TP8 batch 1, the 128-row tile: 4 × 8 gate/up CTAs and 56 × 8 down CTAs, where a
        // grid over every expert launched 4 × 384 and 56 × 384.
        let t = MoeGemmTactic::enumerate(Sm::Sm120)
            .into_iter()
            .find(|t| t.tile_n == 128 && t.tile_m == 8)
            .unwrap();
        let (gu, down) = launch_configs(&t, 7168, 256, &b(1)).unwrap();
        assert_eq!(gu.grid_dim, (4, 8, 1));
        assert_eq!(down.grid_dim, (56, 8, 1));
        assert!(launch_configs(&t, 7168, 256, &b(0)).is_none());
    }

    #[test]
    fn moe_args_is_a_flat_136_byte_block() {
        assert_eq!(std::mem::size_of::<MoeArgs>(), 136);
    }
}
