//! The timed stage without a device: a per-tactic cost model. Every figure it gives is a
//! **prediction** (`FigureSource::Predicted`), never a measurement.
//!
//! A kernel costs `max(t_memory, t_compute) + t_empty + launch`, where
//! - `t_memory` = DRAM bytes / achieved bandwidth; the achieved bandwidth is the GPU's
//!   streaming bandwidth capped by Little's law: resident CTAs × bytes each keeps in flight
//!   (its cp.async stages) / memory latency. Resident CTAs come from the occupancy the
//!   manifest's registers, threads and shared memory allow (`SmLimits::blocks_per_sm`) over
//!   the SM count; when the CTAs with work exceed one wave, the last wave's idle slots count
//!   (wave quantization);
//! - `t_compute` = FLOPs of the padded tiles / (the datapath's dense peak × the fraction of
//!   SMs that have work);
//! - `t_empty`: CTAs launched with no work still cost a block launch each: `moe_gate_up` and
//!   `moe_down` size `grid.y` by the experts the step's assignments could reach
//!   (`MoeGroupingBounds`), not by the ones the router picked;
//! - `launch`: one kernel boundary inside a CUDA graph.
//!
//! The all-reduce uses the existing link-level cost model (`kernels::allreduce::cost`), with
//! the tactic's blocks × threads bounding the bandwidth it can drive.
//!
//! The parameters below are assumptions until a device run refits them (`crate::fit`: least
//! squares over the timed stage's measurements, written beside the cache as a sidecar the
//! step-time model reads).

use kernels::allreduce::cost::{Host, LinkParams};
use kernels::allreduce::tactic::AllReduceTactic;
use kernels::allreduce::topology::{Topology, fixtures};
use kernels::arch::{GpuSpec, Sm};
use kernels::mla::{MlaKind, MlaSplitTactic, MlaTactic};
use kernels::moe_gemm::launch::MoeGroupingBounds;
use kernels::moe_gemm::{KernelVariant, MoeGemmTactic};
use kernels::tactic::{ProblemShape, Tactic};

use crate::manifest::Image;

/// The grid the device path launches for an MoE shape: `MoeGroupingBounds::for_tokens` of
/// the most tokens the shape's assignments (`active_experts × tokens_per_expert`, the latter
/// rounded up) can come from, under `top_k` experts per token out of `experts`.
pub fn moe_grid_bounds(
    shape: &ProblemShape,
    experts: u32,
    top_k: u32,
) -> Option<MoeGroupingBounds> {
    let ProblemShape::Moe {
        tokens_per_expert,
        active_experts,
        ..
    } = *shape
    else {
        return None;
    };
    let top_k = top_k.max(1) as usize;
    let tokens = (active_experts as usize * tokens_per_expert as usize).div_ceil(top_k);
    Some(MoeGroupingBounds::for_tokens(
        tokens,
        top_k,
        experts as usize,
    ))
}

/// Parameters of the model (see the module documentation): assumed, or fitted to a device's
/// measurements.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CostParams {
    /// Fraction of the data-sheet bandwidth a streaming kernel reaches (1.0 where the GPU's
    /// figure is already a measured copy rate).
    pub stream_efficiency: f64,
    /// Loaded DRAM latency a cp.async round trip sees, ns.
    pub memory_latency_ns: f64,
    /// One kernel boundary inside a CUDA graph (drain + ramp), µs.
    pub launch_us: f64,
    /// A CTA that finds no work (launch + exit), µs per wave of resident slots.
    pub empty_wave_us: f64,
    /// The shuffle-based FP4 MMA emulation (SM90 check variant) against BF16 MMA throughput.
    pub emulation_slowdown: f64,
    /// Fraction of the datapath's dense peak a compute-bound kernel reaches.
    pub compute_efficiency: f64,
}

impl CostParams {
    pub fn for_gpu(gpu: &GpuSpec) -> Self {
        CostParams {
            // The RTX PRO 6000 figure is the data sheet's; the H200's is a measured copy.
            stream_efficiency: if gpu.sm == Sm::Sm120 { 0.9 } else { 1.0 },
            memory_latency_ns: 800.0,
            launch_us: 2.0,
            empty_wave_us: 0.5,
            emulation_slowdown: 16.0,
            compute_efficiency: 1.0,
        }
    }
}

/// A predicted kernel time and what bounded it.
#[derive(Clone, Debug, PartialEq)]
pub struct Predicted {
    pub us: f64,
    pub bytes: f64,
    pub flops: f64,
    /// `memory`, `compute` or `latency` (launch + empty CTAs dominate).
    pub bound: &'static str,
}

impl Predicted {
    fn add(self, o: Predicted) -> Predicted {
        let bound = if self.us >= o.us { self.bound } else { o.bound };
        Predicted {
            us: self.us + o.us,
            bytes: self.bytes + o.bytes,
            flops: self.flops + o.flops,
            bound,
        }
    }
}

/// One kernel launch as the model sees it.
struct Launch {
    work_ctas: f64,
    empty_ctas: f64,
    /// Resident blocks per SM (occupancy).
    occupancy: u32,
    bytes: f64,
    flops: f64,
    /// Bytes one CTA keeps in flight.
    inflight: f64,
    /// Dense peak of its datapath, TFLOPS.
    peak_tflops: f64,
}

pub struct Model<'a> {
    pub gpu: &'a GpuSpec,
    pub params: CostParams,
}

impl<'a> Model<'a> {
    pub fn new(gpu: &'a GpuSpec) -> Self {
        Model {
            gpu,
            params: CostParams::for_gpu(gpu),
        }
    }

    pub fn with_params(gpu: &'a GpuSpec, params: CostParams) -> Self {
        Model { gpu, params }
    }

    fn kernel(&self, l: &Launch) -> Predicted {
        let sms = f64::from(self.gpu.sms);
        let slots = sms * f64::from(l.occupancy.max(1));
        let resident = l.work_ctas.min(slots).max(1.0);
        let stream = self.gpu.mem_bandwidth_gbs * 1e9 * self.params.stream_efficiency;
        let little = resident * l.inflight / (self.params.memory_latency_ns * 1e-9);
        let bw = stream.min(little).max(1.0);
        let mut t_mem = l.bytes / bw * 1e6;
        if l.work_ctas > slots {
            let waves = (l.work_ctas / slots).ceil();
            t_mem *= waves * slots / l.work_ctas;
        }
        let busy = (l.work_ctas / sms).min(1.0).max(1.0 / sms);
        let t_compute =
            l.flops / (l.peak_tflops * 1e12 * self.params.compute_efficiency * busy) * 1e6;
        let t_empty = (l.empty_ctas / slots) * self.params.empty_wave_us;
        let body = t_mem.max(t_compute);
        let us = body + t_empty + self.params.launch_us;
        let bound = if self.params.launch_us + t_empty > body {
            "latency"
        } else if t_mem >= t_compute {
            "memory"
        } else {
            "compute"
        };
        Predicted {
            us,
            bytes: l.bytes,
            flops: l.flops,
            bound,
        }
    }

    fn occupancy(&self, image: Option<&Image>, kernel: &str, threads: u32, smem: usize) -> u32 {
        let limits = self.gpu.sm.limits();
        // The manifest's figures when the image is there; the tactic's own otherwise (with
        // an assumed 128 registers).
        let (regs, smem) = image
            .and_then(|i| i.kernels.get(kernel))
            .map(|k| (k.registers, k.dynamic_smem + k.static_smem))
            .unwrap_or((128, smem));
        limits.blocks_per_sm(regs, threads, smem)
    }

    /// Both kernels of one MoE layer (`moe_gate_up`, `moe_down`) for `shape`, on the grid
    /// `bounds` size (as `moe_gemm::launch::launch_configs` does).
    pub fn moe(
        &self,
        t: &MoeGemmTactic,
        image: Option<&Image>,
        shape: &ProblemShape,
        bounds: &MoeGroupingBounds,
    ) -> Option<Predicted> {
        let ProblemShape::Moe {
            tokens_per_expert,
            active_experts,
            hidden,
            inter,
        } = *shape
        else {
            return None;
        };
        let (h, i) = (f64::from(hidden), f64::from(inter));
        let active = f64::from(active_experts);
        let grid_experts = bounds.max_active_experts as f64;
        let (tn, tk) = (f64::from(t.tile_n), f64::from(t.tile_k));
        let m_tiles = f64::from(tokens_per_expert.div_ceil(t.tile_m));
        // CTAs along z per expert; an expert with more tiles loops within them.
        let grid_tiles = f64::from(bounds.token_tiles(t.tile_m));
        let work_tiles = m_tiles.min(grid_tiles);
        let empty_tiles = (grid_experts * grid_tiles - active * work_tiles).max(0.0);
        let padded_tokens = m_tiles * f64::from(t.tile_m);
        let tokens = f64::from(tokens_per_expert);
        // NVFP4 weights: half a byte per element plus one E4M3 scale per 16.
        let fp4 = 0.5 + 1.0 / 16.0;
        let inflight = f64::from(t.stages.saturating_sub(1).max(1)) * tn * tk * fp4;
        let peak = match t.variant {
            KernelVariant::Sm120Native => self.gpu.fp4_dense_tflops.unwrap_or(0.0),
            KernelVariant::Portable => self.gpu.bf16_dense_tflops,
            KernelVariant::Sm120EmulatedOnSm90 => {
                self.gpu.bf16_dense_tflops / self.params.emulation_slowdown
            }
        };
        if peak <= 0.0 {
            return None;
        }
        let threads = t.threads();
        let smem = t.smem();
        let gx = i / (tn / 2.0);
        let gate_up = Launch {
            work_ctas: gx * active * work_tiles,
            empty_ctas: gx * empty_tiles,
            occupancy: self.occupancy(image, "moe_gate_up", threads, smem.gate_up),
            bytes: active * (2.0 * i * h * fp4 + tokens * h * 2.0 + tokens * i * fp4),
            flops: 2.0 * active * padded_tokens * 2.0 * i * h,
            inflight,
            peak_tflops: peak,
        };
        let dx = h / tn;
        let sk = f64::from(t.split_k);
        let down = Launch {
            work_ctas: dx * active * work_tiles * sk,
            empty_ctas: dx * empty_tiles * sk,
            occupancy: self.occupancy(image, "moe_down", threads, smem.down),
            // Weights, the NVFP4 intermediate, and f32 atomics per split into the output.
            bytes: active * (h * i * fp4 + tokens * i * fp4 + tokens * h * 4.0 * sk),
            flops: 2.0 * active * padded_tokens * h * i,
            inflight,
            peak_tflops: peak,
        };
        Some(self.kernel(&gate_up).add(self.kernel(&down)))
    }

    /// `mla_decode` (+ `mla_combine` when split) for `shape`, with the tactic's split count.
    pub fn mla(
        &self,
        st: &MlaSplitTactic,
        image: Option<&Image>,
        shape: &ProblemShape,
    ) -> Option<Predicted> {
        let t: &MlaTactic = &st.kernel;
        let ProblemShape::Mla {
            batch,
            heads,
            context,
            fp8_cache,
            ..
        } = *shape
        else {
            return None;
        };
        if !t.serves(shape) {
            return None;
        }
        let (latent, rope) = (t.dims.latent as f64, t.dims.rope as f64);
        let splits = st.splits;
        let groups = f64::from(heads.div_ceil(t.heads_per_block));
        let b = f64::from(batch);
        let c = f64::from(context);
        // Bytes per cached token: BF16 latent + RoPE, or E4M3 latent + BF16 RoPE + a scale.
        let per_token = if fp8_cache {
            latent + 2.0 * rope + 4.0
        } else {
            2.0 * (latent + rope)
        };
        let ctas = b * groups * f64::from(splits);
        let padded_heads = groups * f64::from(t.heads_per_block);
        let partial = if splits > 1 {
            b * f64::from(heads) * f64::from(splits) * (latent + 1.0) * 4.0
        } else {
            0.0
        };
        // FLOPs per head and token: q·k over latent + RoPE, then P·C over the latent.
        let (qk_flops, pc_flops) = (latent + rope, latent);
        let peak = match t.kind {
            // q·c on the E4M3 tensor cores.
            MlaKind::Fp8QkMma => {
                (qk_flops + pc_flops)
                    / (qk_flops / self.gpu.fp8_dense_tflops + pc_flops / self.gpu.bf16_dense_tflops)
            }
            _ => self.gpu.bf16_dense_tflops,
        };
        let decode = Launch {
            work_ctas: ctas,
            empty_ctas: 0.0,
            occupancy: self.occupancy(image, "mla_decode", t.threads(), t.smem().total),
            bytes: b * c * per_token + b * f64::from(heads) * (latent + rope) * 2.0 + partial,
            flops: 2.0 * b * padded_heads * c * (qk_flops + pc_flops),
            inflight: f64::from(t.stages.saturating_sub(1).max(1))
                * f64::from(t.tile_tokens)
                * per_token,
            peak_tflops: peak,
        };
        let mut p = self.kernel(&decode);
        if splits > 1 {
            let combine = Launch {
                work_ctas: b * f64::from(heads),
                empty_ctas: 0.0,
                occupancy: 8,
                bytes: partial + b * f64::from(heads) * latent * 4.0,
                flops: 0.0,
                // One CTA per (request, head), its 128 threads each with a few 16-byte loads in
                // flight over the splits' partial rows.
                inflight: 128.0 * 16.0 * 4.0,
                peak_tflops: self.gpu.bf16_dense_tflops,
            };
            p = p.add(self.kernel(&combine));
        }
        Some(p)
    }

    /// One decode product `[m, k] × [k, n]` by `dense_bf16` (one warp per output row per
    /// token: the weights are re-read per token unless L2 keeps them).
    pub fn dense(&self, shape: &ProblemShape) -> Option<Predicted> {
        let ProblemShape::Dense { m, n, k } = *shape else {
            return None;
        };
        let (m, n, k) = (f64::from(m), f64::from(n), f64::from(k));
        let weights = n * k * 2.0;
        let reads = if weights <= self.gpu.l2_bytes as f64 / 2.0 {
            1.0
        } else {
            m
        };
        let l = Launch {
            work_ctas: (n / 8.0).ceil() * m,
            empty_ctas: 0.0,
            occupancy: self.gpu.sm.limits().blocks_per_sm(32, 256, 0),
            bytes: weights * reads + m * k * 4.0 + m * n * 4.0,
            flops: 2.0 * m * n * k,
            // 8 warps, each streaming a row with 16-byte loads, a few in flight.
            inflight: 8.0 * 32.0 * 16.0 * 4.0,
            // CUDA-core FMAs, not tensor cores: ~1/16 of the BF16 tensor peak (assumption).
            peak_tflops: self.gpu.bf16_dense_tflops / 16.0,
        };
        Some(self.kernel(&l))
    }
}

/// The 8-GPU host the all-reduce is predicted on: two sockets of 4 GPUs behind one switch
/// each (the `allreduce-sim` default), with `LinkParams::default()` (calibrated to the facts
/// sheet's PCIe measurements).
pub fn allreduce_host(ranks: u32) -> Host {
    let topo = Topology::from_nvidia_smi(fixtures::TWO_SOCKETS_4X4)
        .expect("the fixture parses")
        .prefix(ranks as usize);
    Host::new(topo)
}

/// 16-byte peer loads (or stores) each all-reduce thread keeps in flight (an assumption).
const LOADS_IN_FLIGHT: f64 = 4.0;

/// One all-reduce of `shape` by tactic `t` on `host` with link parameters `base`: the link
/// model's time for its algorithm, with the bandwidth its blocks × threads can drive (each
/// thread [`LOADS_IN_FLIGHT`] 16-byte accesses per link round trip, a few in flight) as the
/// achieved fraction of the links (times `base`'s own `bandwidth_scale`).
pub fn allreduce(
    host: &Host,
    base: &LinkParams,
    t: &AllReduceTactic,
    shape: &ProblemShape,
) -> Option<Predicted> {
    let ProblemShape::AllReduce {
        elements, dtype, ..
    } = shape
    else {
        return None;
    };
    if dtype != t.dtype.id() || !host.supports(t.algorithm) {
        return None;
    }
    let bytes = *elements as usize * t.dtype.size();
    let mut p = base.clone();
    // A flag round trip of at least 0.1 µs bounds what one block's loads in flight can move
    // (a host whose GPUs share one memory has no hop latency of its own).
    let round_trip_s = (2.0 * p.hop_latency_us).max(0.1) * 1e-6;
    let per_block_gbps = f64::from(t.threads) * 16.0 * LOADS_IN_FLIGHT / round_trip_s / 1e9;
    p.bandwidth_scale =
        base.bandwidth_scale * (f64::from(t.blocks) * per_block_gbps / p.one_hop_gbps).min(1.0);
    let us = host.predict_us(t.algorithm, bytes, &p);
    Some(Predicted {
        us,
        bytes: bytes as f64,
        flops: 0.0,
        bound: "link",
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kernels::arch::RTX_PRO_6000;
    use kernels::tactic::Tactic;

    fn batch1() -> ProblemShape {
        ProblemShape::Moe {
            tokens_per_expert: 1,
            active_experts: 8,
            hidden: 7168,
            inter: 256,
        }
    }

    #[test]
    fn predictions_respect_the_memory_roofline() {
        let m = Model::new(&RTX_PRO_6000);
        let bw = RTX_PRO_6000.mem_bandwidth_gbs * 1e9;
        let bounds = MoeGroupingBounds::for_tokens(1, 8, 384);
        for t in MoeGemmTactic::space(Sm::Sm120) {
            let p = m.moe(&t, None, &batch1(), &bounds).unwrap();
            assert!(p.us > p.bytes / bw * 1e6, "{t}: {p:?}");
        }
        for t in MlaSplitTactic::space(Sm::Sm120) {
            let s = ProblemShape::mla(8, 8, 8192, t.kernel.kind.is_fp8(), t.kernel.dims);
            let p = m.mla(&t, None, &s).unwrap();
            assert!(p.us > p.bytes / bw * 1e6, "{t}: {p:?}");
        }
    }

    /// A grid with `grid.y` over all 384 experts (as the kernels had before they walked the
    /// active list) leaves 376 of them without tokens at batch 1: the model charges their
    /// CTAs, and the grid the device path now launches (the 8 experts one token can reach)
    /// does not.
    #[test]
    fn idle_experts_ctas_cost_time_at_batch_one() {
        let m = Model::new(&RTX_PRO_6000);
        let t = MoeGemmTactic::heuristic_default(Sm::Sm120, &batch1()).unwrap();
        let every_expert = MoeGroupingBounds {
            max_active_experts: 384,
            tokens_per_pass: 1,
        };
        let reachable = moe_grid_bounds(&batch1(), 384, 8).unwrap();
        assert_eq!(reachable, MoeGroupingBounds::for_tokens(1, 8, 384));
        assert_eq!(reachable.max_active_experts, 8);
        let all = m.moe(&t, None, &batch1(), &every_expert).unwrap();
        let active_only = m.moe(&t, None, &batch1(), &reachable).unwrap();
        println!(
            "{t} at batch 1 (predicted): grid over 384 experts {:.1} µs, over the 8 reachable \
             {:.1} µs",
            all.us, active_only.us
        );
        assert!(active_only.us < all.us);
    }

    #[test]
    fn more_blocks_never_slow_the_predicted_all_reduce_down() {
        let host = allreduce_host(8);
        let s = ProblemShape::AllReduce {
            elements: 7168 * 32,
            dtype: "bf16".into(),
            ranks: 8,
        };
        for t in AllReduceTactic::space(Sm::Sm120)
            .iter()
            .filter(|t| t.serves(&s))
        {
            let mut more = *t;
            more.blocks = 8;
            let (a, b) = (
                allreduce(&host, &LinkParams::default(), t, &s).map(|p| p.us),
                allreduce(&host, &LinkParams::default(), &more, &s).map(|p| p.us),
            );
            if let (Some(a), Some(b)) = (a, b) {
                assert!(b <= a + 1e-9, "{t}: {a} < {b}");
            }
        }
    }
}
