//! Timing the GPU families' tactics on a device, one (tactic, problem shape) at a time: what
//! the tuning lab's timed stage (`autotune`) and the CUDA sweeps
//! (`cargo bench -p bench --bench gpu_tactics`) measure. Generic over
//! [`TimedDevice`](kernels::timed_device::TimedDevice): compiled in every build, run where a
//! GPU is present.
//!
//! Every timed run sits between two device timestamps after `warmup` untimed runs, with the L2
//! flushed before each run (a buffer of twice its size rewritten, outside the timestamps), so a
//! kernel that reads less than the L2 holds is timed as a decode step runs it: after other
//! layers' weights went through the cache. What each family times:
//! - **moe_gemm**: `moe_gate_up` + `moe_down` (and the output's zeroing, as the launcher
//!   does) of one layer's routed experts at the rank's shard, all `experts` experts' weights
//!   resident (random NVFP4 codes, valid scales), the shape's active experts each given its
//!   tokens per expert (a few one more, so every token keeps `top_k` distinct experts), on the
//!   grid the device path sizes from the token count (`MoeGroupingBounds::for_tokens`);
//! - **mla**: `mla_decode` (+ `mla_combine` when split) over a zeroed latent cache, every
//!   request at the shape's context, each request's pages its own;
//! - **layers**: `dense_bf16` for the product's `m, n, k`;
//! - **allreduce**: the tactic over `ranks` ranks as streams of this one GPU (see
//!   [`RankGroup`]): the kernels' own costs, not a PCIe host's.

use std::collections::HashMap;

use kernels::allreduce::tactic::AllReduceTactic;
use kernels::device::{Device, DeviceError, DeviceExt, Result};
use kernels::layers::LayerKernels;
use kernels::mla::cache::KvCacheDtype;
use kernels::mla::launch::{DecodeIo, DeviceCache, MlaKernels};
use kernels::mla::{MlaSplitTactic, MlaTactic};
use kernels::moe_gemm::check::random_moe_weights;
use kernels::moe_gemm::launch::{
    GroupedRouting, MoeDeviceActivations, MoeDeviceRouting, MoeDeviceWeights, MoeGroupingBounds,
    MoeKernels,
};
use kernels::moe_gemm::reference::Routing;
use kernels::moe_gemm::{MoeGemmTactic, ScaleLoad};
use kernels::tactic::timing::{DeviceIdentity, Samples};
use kernels::tactic::{KernelFamily, ProblemShape, Tactic};
use kernels::timed_device::{RankGroup, TimedDevice};

/// How each (tactic, shape) is timed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TimingOptions {
    pub warmup: usize,
    pub reps: usize,
    /// Rewrite a buffer of twice the L2 before every run.
    pub flush_l2: bool,
    /// All-reduce: back-to-back calls per sample.
    pub allreduce_calls: usize,
}

impl Default for TimingOptions {
    fn default() -> Self {
        TimingOptions {
            warmup: 2,
            reps: 10,
            flush_l2: true,
            allreduce_calls: 20,
        }
    }
}

/// The routed experts the MoE shapes are drawn from (the model's `n_routed_experts` and
/// `num_experts_per_tok`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoeSetup {
    pub experts: usize,
    pub top_k: usize,
}

/// Tokens per cache page.
const PAGE: usize = 64;
/// The split workspace every MLA shape gets (the largest split count enumerated).
const MAX_SPLITS: usize = 64;
/// Any positive softmax scale: the values are zeros, the time does not depend on it.
const SOFTMAX_SCALE: f32 = 0.1447;

/// The device buffers of one MoE shape.
struct MoeInputs<D: Device> {
    bucket: String,
    routing: MoeDeviceRouting<D>,
    acts: MoeDeviceActivations<D>,
    bounds: MoeGroupingBounds,
}

/// The device buffers of one MLA decode shape.
struct MlaInputs<D: Device> {
    bucket: String,
    rows: usize,
    heads: usize,
    max_pages: usize,
    cached_tokens: usize,
    q_abs: D::Memory,
    q_pe: D::Memory,
    block_table: D::Memory,
    seq_lens: D::Memory,
    out: D::Memory,
    lse: D::Memory,
    part_out: D::Memory,
    part_lse: D::Memory,
}

/// The device buffers of one dense product.
struct DenseInputs<D: Device> {
    bucket: String,
    x: D::Memory,
    w: D::Memory,
    y: D::Memory,
}

/// Times tactics on one device, keeping what shapes share (expert weights, the latent cache,
/// loaded kernels, all-reduce ranks) between calls. Shapes are best visited one after the
/// other: the buffers of the last shape are kept, a new one replaces them.
pub struct Timer<'d, D: TimedDevice> {
    dev: &'d D,
    pub options: TimingOptions,
    moe_setup: MoeSetup,
    flush: Option<D::Memory>,
    flush_pass: u8,
    moe_weights: Option<MoeDeviceWeights<D>>,
    moe_kernels: HashMap<String, MoeKernels<D>>,
    moe_inputs: Option<MoeInputs<D>>,
    /// `[BF16, FP8]`
    mla_cache: [Option<DeviceCache<D>>; 2],
    mla_kernels: HashMap<String, MlaKernels<D>>,
    mla_inputs: Option<MlaInputs<D>>,
    layers: Option<LayerKernels<D>>,
    dense_inputs: Option<DenseInputs<D>>,
    ranks: HashMap<(usize, u32), (usize, Box<dyn RankGroup + 'd>)>,
}

impl<'d, D: TimedDevice> Timer<'d, D> {
    pub fn new(dev: &'d D, options: TimingOptions, moe_setup: MoeSetup) -> Result<Self> {
        let flush = if options.flush_l2 {
            Some(dev.alloc_zeroed((2 * dev.identity().l2_bytes).max(1 << 20))?)
        } else {
            None
        };
        Ok(Timer {
            dev,
            options,
            moe_setup,
            flush,
            flush_pass: 0,
            moe_weights: None,
            moe_kernels: HashMap::new(),
            moe_inputs: None,
            mla_cache: [None, None],
            mla_kernels: HashMap::new(),
            mla_inputs: None,
            layers: None,
            dense_inputs: None,
            ranks: HashMap::new(),
        })
    }

    pub fn identity(&self) -> DeviceIdentity {
        self.dev.identity()
    }

    /// Times the tactic `id` of `family` on `shape`.
    pub fn time_id(
        &mut self,
        family: KernelFamily,
        id: &str,
        shape: &ProblemShape,
    ) -> Result<Samples> {
        let parse = |e: kernels::tactic::TacticError| DeviceError::Invalid(e.to_string());
        match family {
            KernelFamily::MoeGemm => self.moe(&MoeGemmTactic::parse_id(id).map_err(parse)?, shape),
            KernelFamily::MlaDecode => {
                self.mla(&MlaSplitTactic::parse_id(id).map_err(parse)?, shape)
            }
            KernelFamily::AllReduce => {
                self.allreduce(&AllReduceTactic::parse_id(id).map_err(parse)?, shape)
            }
            KernelFamily::Layers => self.dense(shape),
            KernelFamily::Cpu => Err(DeviceError::Invalid(
                "CPU tactics are timed by autotune --cpu, not on a device".into(),
            )),
        }
    }

    /// `warmup` + `reps` runs of `work` with the L2 flushed before each.
    fn time(
        dev: &D,
        options: &TimingOptions,
        flush: &mut Option<D::Memory>,
        flush_pass: &mut u8,
        work: &mut dyn FnMut() -> Result<()>,
    ) -> Result<Samples> {
        let mut between = || match flush.as_mut() {
            Some(buf) => {
                *flush_pass = flush_pass.wrapping_add(1);
                dev.fill(buf, *flush_pass)
            }
            None => Ok(()),
        };
        dev.time_runs(options.warmup, options.reps.max(1), &mut between, work)
    }

    pub fn moe(&mut self, t: &MoeGemmTactic, shape: &ProblemShape) -> Result<Samples> {
        let ProblemShape::Moe {
            tokens_per_expert,
            active_experts,
            hidden,
            inter,
        } = *shape
        else {
            return Err(wrong_shape(t.tactic_id(), shape));
        };
        let (hidden, inter) = (hidden as usize, inter as usize);
        let setup = self.moe_setup;
        let dev = self.dev;
        if self
            .moe_weights
            .as_ref()
            .is_none_or(|w| (w.hidden, w.inter) != (hidden, inter))
        {
            self.moe_weights = None;
            let host = random_moe_weights(0x5eed_0001, setup.experts, hidden, inter);
            self.moe_weights = Some(MoeDeviceWeights::upload(
                dev,
                &host,
                &[ScaleLoad::Swizzled128x4, ScaleLoad::RowMajor],
            )?);
        }
        let bucket = shape.bucket();
        if self.moe_inputs.as_ref().is_none_or(|m| m.bucket != bucket) {
            self.moe_inputs = None;
            let routing = moe_routing(
                active_experts as usize,
                tokens_per_expert as usize,
                setup.top_k,
                setup.experts,
            )?;
            let tokens = routing.tokens();
            let x: Vec<u16> = (0..tokens * hidden)
                .map(|i| half::bf16::from_f32(((i % 61) as f32 - 30.0) / 16.0).to_bits())
                .collect();
            let grouped = GroupedRouting::new(&routing, setup.experts)?;
            let assignments = grouped.assignments();
            self.moe_inputs = Some(MoeInputs {
                bucket,
                routing: MoeDeviceRouting::upload(dev, grouped)?,
                acts: MoeDeviceActivations::new(dev, &x, tokens, hidden, inter, assignments)?,
                bounds: MoeGroupingBounds::for_tokens(tokens, setup.top_k, setup.experts),
            });
        }
        let id = t.tactic_id();
        if !self.moe_kernels.contains_key(&id) {
            self.moe_kernels
                .insert(id.clone(), MoeKernels::load(dev, *t)?);
        }
        let Timer {
            options,
            flush,
            flush_pass,
            moe_weights,
            moe_kernels,
            moe_inputs,
            ..
        } = self;
        let (k, w, io) = (
            &moe_kernels[&id],
            moe_weights.as_ref().expect("uploaded above"),
            moe_inputs.as_mut().expect("built above"),
        );
        let bounds = io.bounds;
        Self::time(dev, options, flush, flush_pass, &mut || {
            k.run_with_bounds(dev, w, &io.routing, &mut io.acts, &bounds)
        })
    }

    pub fn mla(&mut self, st: &MlaSplitTactic, shape: &ProblemShape) -> Result<Samples> {
        let ProblemShape::Mla {
            batch,
            heads,
            context,
            fp8_cache,
            ..
        } = *shape
        else {
            return Err(wrong_shape(st.tactic_id(), shape));
        };
        let t: MlaTactic = st.kernel;
        let dims = t.dims;
        if t.kind.is_fp8() != fp8_cache || shape.mla_dims() != Some(dims) {
            return Err(wrong_shape(st.tactic_id(), shape));
        }
        let (rows, heads, context) = (batch as usize, heads as usize, context as usize);
        let dev = self.dev;
        let pages_per_row = context.div_ceil(PAGE).max(1);
        let slots = rows * pages_per_row * PAGE;
        let which = usize::from(fp8_cache);
        if self.mla_cache[which]
            .as_ref()
            .is_none_or(|c| c.slots < slots || c.dims != dims)
        {
            // One cache per dtype, grown to the largest shape seen (a zeroed cache: the
            // kernels read every byte whatever it holds).
            self.mla_cache[which] = None;
            let dtype = if fp8_cache {
                KvCacheDtype::Fp8E4m3
            } else {
                KvCacheDtype::Bf16
            };
            self.mla_cache[which] = Some(DeviceCache::alloc(dev, dtype, dims, slots)?);
        }
        let bucket = shape.bucket();
        if self.mla_inputs.as_ref().is_none_or(|m| m.bucket != bucket) {
            self.mla_inputs = None;
            let q = rows * heads;
            let bf = |n: usize, m: usize| -> Vec<u16> {
                (0..n)
                    .map(|i| {
                        half::bf16::from_f32(((i % m) as f32 - m as f32 / 2.0) / 200.0).to_bits()
                    })
                    .collect()
            };
            let table: Vec<i32> = (0..rows * pages_per_row).map(|p| p as i32).collect();
            let lens = vec![context as i32; rows];
            self.mla_inputs = Some(MlaInputs {
                bucket,
                rows,
                heads,
                max_pages: pages_per_row,
                cached_tokens: rows * context,
                q_abs: dev.upload(&bf(q * dims.latent, 97))?,
                q_pe: dev.upload(&bf(q * dims.rope, 89))?,
                block_table: dev.upload(&table)?,
                seq_lens: dev.upload(&lens)?,
                out: dev.alloc_elements::<f32>(q * dims.latent)?,
                lse: dev.alloc_elements::<f32>(q)?,
                part_out: dev.alloc_elements::<f32>(q * MAX_SPLITS * dims.latent)?,
                part_lse: dev.alloc_elements::<f32>(q * MAX_SPLITS)?,
            });
        }
        let id = t.id();
        if !self.mla_kernels.contains_key(&id) {
            self.mla_kernels
                .insert(id.clone(), MlaKernels::load(dev, t)?);
        }
        let Timer {
            options,
            flush,
            flush_pass,
            mla_cache,
            mla_kernels,
            mla_inputs,
            ..
        } = self;
        let (k, cache, m) = (
            &mla_kernels[&id],
            mla_cache[which].as_ref().expect("allocated above"),
            mla_inputs.as_ref().expect("built above"),
        );
        let io = DecodeIo {
            rows: m.rows,
            heads: m.heads,
            max_pages: m.max_pages,
            max_splits: MAX_SPLITS,
            q_abs: &m.q_abs,
            q_pe: &m.q_pe,
            block_table: &m.block_table,
            seq_lens: &m.seq_lens,
            out: &m.out,
            lse: &m.lse,
            part_out: &m.part_out,
            part_lse: &m.part_lse,
            cached_tokens: m.cached_tokens,
        };
        let splits = st.splits;
        Self::time(dev, options, flush, flush_pass, &mut || {
            k.decode_io(dev, cache, &io, splits, SOFTMAX_SCALE)
        })
    }

    pub fn dense(&mut self, shape: &ProblemShape) -> Result<Samples> {
        let ProblemShape::Dense { m, n, k } = *shape else {
            return Err(wrong_shape("layers".into(), shape));
        };
        let (m, n, k) = (m as usize, n as usize, k as usize);
        let dev = self.dev;
        if self.layers.is_none() {
            self.layers = Some(LayerKernels::load(dev)?);
        }
        let bucket = shape.bucket();
        if self
            .dense_inputs
            .as_ref()
            .is_none_or(|d| d.bucket != bucket)
        {
            self.dense_inputs = None;
            let x: Vec<f32> = (0..m * k)
                .map(|i| ((i % 53) as f32 - 26.0) / 64.0)
                .collect();
            let mut w = dev.alloc_elements::<u16>(n * k)?;
            // 0x3C3C: a BF16 of about 0.0115 in every element.
            dev.fill(&mut w, 0x3C)?;
            self.dense_inputs = Some(DenseInputs {
                bucket,
                x: dev.upload(&x)?,
                w,
                y: dev.alloc_elements::<f32>(m * n)?,
            });
        }
        let Timer {
            options,
            flush,
            flush_pass,
            layers,
            dense_inputs,
            ..
        } = self;
        let (kern, d) = (
            layers.as_ref().expect("loaded above"),
            dense_inputs.as_ref().expect("built above"),
        );
        Self::time(dev, options, flush, flush_pass, &mut || {
            kern.dense_bf16(dev, &d.x, m, &d.w, k, n, &d.y, false)
        })
    }

    /// The all-reduce on `ranks` ranks as streams of this device (one group per rank count and
    /// thread count, kept): `reps` samples of the mean of `allreduce_calls` calls.
    pub fn allreduce(&mut self, t: &AllReduceTactic, shape: &ProblemShape) -> Result<Samples> {
        let ProblemShape::AllReduce {
            elements, ranks, ..
        } = *shape
        else {
            return Err(wrong_shape(t.tactic_id(), shape));
        };
        if !t.serves(shape) {
            return Err(wrong_shape(t.tactic_id(), shape));
        }
        let bytes = elements as usize * t.dtype.size();
        let key = (ranks as usize, t.threads);
        if self
            .ranks
            .get(&key)
            .is_none_or(|(capacity, _)| *capacity < bytes)
        {
            self.ranks.remove(&key);
            let capacity = bytes.max(1 << 20);
            let group = self.dev.allreduce_ranks(key.0, key.1, capacity)?;
            self.ranks.insert(key, (capacity, group));
        }
        let (_, group) = self.ranks.get_mut(&key).expect("inserted above");
        group.time(
            *t,
            bytes,
            self.options.reps.max(1),
            self.options.allreduce_calls,
        )
    }
}

fn wrong_shape(tactic: String, shape: &ProblemShape) -> DeviceError {
    DeviceError::Shape {
        tactic,
        why: format!("does not serve {}", shape.bucket()),
    }
}

/// A routing in which `active` of `experts` experts (spread evenly over them) get
/// `tokens_per_expert` tokens each — a few get one more, so that every token has `top_k`
/// distinct experts — from `⌈active · tokens_per_expert / top_k⌉` tokens.
pub fn moe_routing(
    active: usize,
    tokens_per_expert: usize,
    top_k: usize,
    experts: usize,
) -> Result<Routing> {
    if top_k == 0 || active < top_k || active > experts || tokens_per_expert == 0 {
        return Err(DeviceError::Invalid(format!(
            "MoE timing routing: {active} active experts of {experts}, top-{top_k}, \
             {tokens_per_expert} tokens per expert"
        )));
    }
    let tokens = (active * tokens_per_expert).div_ceil(top_k);
    let stride = experts / active;
    let ids = (0..tokens * top_k)
        .map(|a| ((a % active) * stride) as u32)
        .collect();
    Ok(Routing {
        top_k,
        experts: ids,
        weights: vec![1.0 / top_k as f32; tokens * top_k],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timing_routings_give_each_active_expert_its_tokens() {
        for (active, tpe) in [(8, 1), (31, 2), (240, 2), (376, 2)] {
            let r = moe_routing(active, tpe, 8, 384).unwrap();
            let g = GroupedRouting::new(&r, 384).unwrap();
            assert_eq!(g.active_experts(), active, "{active}×{tpe}");
            let counts: Vec<i32> = g
                .expert_offsets
                .windows(2)
                .map(|o| o[1] - o[0])
                .filter(|&c| c > 0)
                .collect();
            assert!(
                counts
                    .iter()
                    .all(|&c| c as usize == tpe || c as usize == tpe + 1),
                "{counts:?}"
            );
            // Every token's experts are distinct.
            for token in r.experts.chunks(8) {
                let mut t = token.to_vec();
                t.sort_unstable();
                t.dedup();
                assert_eq!(t.len(), 8);
            }
        }
        assert!(moe_routing(4, 1, 8, 384).is_err());
        assert!(moe_routing(8, 0, 8, 384).is_err());
    }
}
