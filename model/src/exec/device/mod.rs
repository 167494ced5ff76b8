//! The device backend: [`StepOps`] as device work on any [`Device`] — a GPU through cudarc
//! (`cuda`), or the same kernels and launch arguments run by the host execution layer on the
//! CPU (`cuda-emulated`).
//!
//! The design follows candle's split of storage from device: weights are uploaded once as
//! device allocations ([`DeviceWeights`]), the paged latent cache lives in device memory (one
//! [`DeviceCache`] per layer, pages handed out by the same [`PageTables`] the CPU cache uses),
//! and a step's activations live in a workspace whose buffers keep their addresses from step
//! to step ([`workspace`]). Every operation is a fixed set of launches decided by the host
//! from the step's shape alone, never from values on the device. The host writes the token
//! ids, positions, cache slots, block tables and logit rows in (one [`Device::write_bytes`]
//! each) and reads sampled ids or logits back: [`STEP_WRITES`] and one read per step, which
//! `tests/device_executor.rs` counts. Decode steps are captured once per shape and replayed.
//!
//! On a tensor-parallel rank ([`DeviceOps::set_all_reduce`]) the rank's all-reduce sums, in
//! stream order and inside captured graphs, what the step asks it to.
//!
//! The numerics are the CPU backend's with the device kernels' roundings: queries reach MLA
//! in BF16, the MoE input in BF16 (as on a GPU), the norm weights as BF16 (what the checkpoint
//! stores), and FP32 sums in another order; with [`DenseTactic::CublasLt`] the dense products'
//! inputs in BF16 as well.

mod all_reduce;
mod counting;
mod launch_list;
mod products;
mod weights;
mod workspace;

#[cfg(feature = "cuda")]
pub use all_reduce::IpcAllReduce;
pub use all_reduce::{DryAllReduce, HostAddressed, ShmAllReduce, TpAllReduce};
pub use counting::{CountingDevice, DeviceTraffic, LaunchEntry};
pub use launch_list::{DryStep, KernelTotals, RecordedStep, weights_every_step_reads};
pub use weights::{DeviceHeads, DeviceKinds, DeviceMatrix, DeviceWeights, WeightsError};
pub use workspace::{
    SPLIT_ROWS, StepCapacity, WorkspaceShape, max_pages, workspace_buffer_bytes, workspace_bytes,
};

use std::collections::HashMap;
use std::ops::Range;

use kernels::blas::DenseTactic;
use kernels::device::{Device, DeviceExt, DeviceMemory};
use kernels::layers::{DenseOutput, HeadRows, LayerKernels, OutputType, RopeSlices, RouterShape};
use kernels::mla::MlaDims;
use kernels::mla::cache::{KvCacheDtype, PAGE_TOKENS, PageTables};
use kernels::mla::launch::{DecodeIo, DeviceCache, MlaKernels};
use kernels::mla::tactic::MlaTactic;
use kernels::moe_gemm::MoeGemmTactic;
use kernels::moe_gemm::launch::{
    MoeDeviceGrouping, MoeDeviceIo, MoeDeviceWeights, MoeGroupingBounds, MoeKernels,
};
use kernels::tactic::{ProblemShape, Tactic};

use self::products::Products;
use self::workspace::Workspace;
use super::error::ExecError;
use super::ops::{Buf, GraphKey, Logits, StepOps, StepOutput, StepResult, StepRows, Sublayer};
use super::runner::Runner;
use super::tactics::TacticSelector;
use crate::arch::config::ModelConfig;
use crate::checkpoint::weights::Model;

/// Host→device writes of one step: token ids, positions, cache slots, context lengths, block
/// tables and the rows that get logits.
pub const STEP_WRITES: usize = 6;

/// The kernels' tactics the executor runs with.
#[derive(Clone, Debug, PartialEq)]
pub struct ExecutorTactics {
    pub moe: Option<MoeGemmTactic>,
    pub mla: MlaTactic,
    /// Who computes the dense BF16 products: our `dense_bf16` or cuBLASLt.
    pub dense: DenseTactic,
}

fn unsupported(why: impl Into<String>) -> ExecError {
    ExecError::Unsupported {
        backend: "device",
        why: why.into(),
    }
}

impl ExecutorTactics {
    /// The heuristic defaults of the tuning lab for `sm` at decode shapes of this model.
    pub fn defaults(
        sm: kernels::arch::Sm,
        config: &ModelConfig,
        kv_dtype: KvCacheDtype,
    ) -> Result<Self, ExecError> {
        Self::defaults_for_rank(sm, config, kv_dtype, 1)
    }

    /// The defaults for one rank of `world` tensor-parallel ranks: its experts hold
    /// `moe_intermediate_size / world` of the intermediate columns, which the MoE tiles must
    /// divide.
    pub fn defaults_for_rank(
        sm: kernels::arch::Sm,
        config: &ModelConfig,
        kv_dtype: KvCacheDtype,
        world: usize,
    ) -> Result<Self, ExecError> {
        check_supported(config)?;
        let mla_shape = ProblemShape::mla(
            1,
            (config.num_attention_heads / world.max(1)) as u32,
            4096,
            kv_dtype == KvCacheDtype::Fp8E4m3,
            config.mla_dims(),
        );
        let mla = MlaTactic::heuristic_default(sm, &mla_shape).ok_or_else(|| {
            unsupported(format!(
                "no MLA decode tactic for {sm} reads a {} cache of {}",
                kv_dtype.id(),
                config.mla_dims()
            ))
        })?;
        let moe = if config.n_routed_experts > 0 {
            let inter = device_expert_inter(config, world);
            let shape = ProblemShape::Moe {
                tokens_per_expert: 1,
                active_experts: config.num_experts_per_tok as u32,
                hidden: config.hidden_size as u32,
                inter: inter as u32,
            };
            Some(MoeGemmTactic::heuristic_default(sm, &shape).ok_or_else(|| {
                unsupported(format!(
                    "no MoE GEMM tactic for {sm} serves hidden {} / intermediate {inter}",
                    config.hidden_size,
                ))
            })?)
        } else {
            None
        };
        Ok(Self {
            moe,
            mla,
            dense: DenseTactic::default(),
        })
    }
}

/// The kernels a run launches, loaded (and so checked against the device) for every tactic it
/// may select: the MLA kernels of each MLA tactic, the MoE kernels of each MoE tactic.
struct StepKernels<D: Device> {
    mla: Vec<MlaKernels<D>>,
    moe: Vec<MoeKernels<D>>,
}

impl<D: Device> StepKernels<D> {
    fn load(
        dev: &D,
        config: &ModelConfig,
        tactics: &[ExecutorTactics],
        kv_dtype: KvCacheDtype,
    ) -> Result<Self, ExecError> {
        let mut kernels = Self {
            mla: Vec::new(),
            moe: Vec::new(),
        };
        for t in tactics {
            kernels.mla_index(dev, config, t.mla, kv_dtype)?;
            if let Some(moe) = t.moe {
                kernels.moe_index(dev, moe)?;
            }
            if t.dense == DenseTactic::CublasLt {
                dev.blas_ready()?;
            }
        }
        Ok(kernels)
    }

    /// The loaded MLA kernels of `tactic`, loaded now if they were not.
    fn mla_index(
        &mut self,
        dev: &D,
        config: &ModelConfig,
        tactic: MlaTactic,
        kv_dtype: KvCacheDtype,
    ) -> Result<usize, ExecError> {
        if let Some(i) = self.mla.iter().position(|k| k.tactic == tactic) {
            return Ok(i);
        }
        if tactic.dims != config.mla_dims() {
            return Err(unsupported(format!(
                "MLA tactic {} reads cache rows of {}, the model's are {}",
                tactic.id(),
                tactic.dims,
                config.mla_dims()
            )));
        }
        if tactic.kind.is_fp8() != (kv_dtype == KvCacheDtype::Fp8E4m3) {
            return Err(unsupported(format!(
                "MLA tactic {} reads a {} cache, the executor's is {}",
                tactic.id(),
                if tactic.kind.is_fp8() { "FP8" } else { "BF16" },
                kv_dtype.id()
            )));
        }
        self.mla.push(MlaKernels::load(dev, tactic)?);
        Ok(self.mla.len() - 1)
    }

    /// The loaded MoE kernels of `tactic`, loaded now if they were not.
    fn moe_index(&mut self, dev: &D, tactic: MoeGemmTactic) -> Result<usize, ExecError> {
        if let Some(i) = self.moe.iter().position(|k| k.tactic == tactic) {
            return Ok(i);
        }
        self.moe.push(MoeKernels::load(dev, tactic)?);
        Ok(self.moe.len() - 1)
    }
}

/// Device bytes an executor holds, by purpose.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceBytes {
    pub weights: usize,
    pub cache: usize,
    pub workspace: usize,
}

impl DeviceBytes {
    pub fn total(&self) -> usize {
        self.weights + self.cache + self.workspace
    }
}

/// What the MLA kernels fix: the cache row's widths. Images are built for Kimi-K2.5's and for
/// the small golden checkpoints' ([`MlaDims::BUILT`]); any other model is refused by name.
fn check_supported(c: &ModelConfig) -> Result<(), ExecError> {
    let dims = c.mla_dims();
    if !MlaDims::BUILT.contains(&dims) {
        let built: Vec<String> = MlaDims::BUILT
            .iter()
            .map(|d| format!("{}/{}", d.latent, d.rope))
            .collect();
        return Err(unsupported(format!(
            "the MLA kernels are built for kv_lora_rank/qk_rope_head_dim {}; this model has \
             kv_lora_rank {} and qk_rope_head_dim {} (use --backend cpu)",
            built.join(", "),
            c.kv_lora_rank,
            c.qk_rope_head_dim
        )));
    }
    Ok(())
}

/// Intermediate columns each routed expert holds on the device for one of `world` ranks: the
/// rank's share, padded to the MoE kernels' K granularity
/// ([`MoeWeightsHost::padded_inter`](kernels::moe_gemm::launch::MoeWeightsHost::padded_inter)).
pub fn device_expert_inter(c: &ModelConfig, world: usize) -> usize {
    kernels::moe_gemm::launch::kernel_inter(c.moe_intermediate_size / world.max(1))
}

/// How a device runner is made.
#[derive(Clone, Debug)]
pub struct DeviceOptions {
    pub kv_dtype: KvCacheDtype,
    /// Latent cache capacity in tokens, over every sequence.
    pub cache_tokens: usize,
    pub capacity: StepCapacity,
    /// The tactics of every step, unless `selector` chooses them per step.
    pub tactics: ExecutorTactics,
    /// Chooses each step's tactics for its batch and context (`--tactics FILE`).
    pub selector: Option<TacticSelector>,
    /// The latent cache takes what this share of the device's memory leaves after the weights
    /// and the workspace (vLLM's `gpu_memory_utilization`), at least `cache_tokens`; on a
    /// device without fixed memory (the host execution layer) it is `cache_tokens`.
    pub fill_memory: Option<f64>,
    /// Logs the tactics a step runs with whenever they change; no upload progress bar.
    pub quiet: bool,
}

impl DeviceOptions {
    /// Every tactic set the runner may run: the fixed one, or each the selector can choose for
    /// this capacity and cache.
    fn tactic_sets(&self) -> Result<Vec<ExecutorTactics>, ExecError> {
        let mut sets = vec![self.tactics.clone()];
        if let Some(selector) = &self.selector {
            let max_batch = self.capacity.tokens.max(self.capacity.logit_rows);
            for s in selector.candidates(max_batch, self.cache_tokens)? {
                let t = s.executor();
                if !sets.contains(&t) {
                    sets.push(t);
                }
            }
        }
        Ok(sets)
    }

    fn moe_tactics(sets: &[ExecutorTactics]) -> Vec<MoeGemmTactic> {
        sets.iter().filter_map(|t| t.moe).collect()
    }
}

/// Uploads `model`'s weights to `dev` (a progress bar unless `quiet`) and makes its runner: a
/// latent cache of `cache_tokens` tokens and a workspace for `capacity`.
pub fn device_runner<D: Device>(
    dev: D,
    model: &Model,
    options: DeviceOptions,
) -> Result<Runner<DeviceOps<D>>, ExecError> {
    check_supported(&model.config)?;
    // The tactics are refused before the weights are uploaded, not after.
    let sets = options.tactic_sets()?;
    let kernels = StepKernels::load(&dev, &model.config, &sets, options.kv_dtype)?;
    let moe = DeviceOptions::moe_tactics(&sets);
    let weights = DeviceWeights::upload(&dev, model, &moe, options.quiet)?;
    DeviceOps::assemble(dev, &model.config, weights, kernels, options)
}

/// A device runner over weights already on `dev` (with the scale layouts of every MoE tactic
/// `options` may run: [`device_moe_tactics`]): uploaded, or [`DeviceWeights::zeroed`] for a dry
/// run.
pub fn runner_with_weights<D: Device>(
    dev: D,
    config: &ModelConfig,
    weights: DeviceWeights<D>,
    options: DeviceOptions,
) -> Result<Runner<DeviceOps<D>>, ExecError> {
    check_supported(config)?;
    let sets = options.tactic_sets()?;
    let kernels = StepKernels::load(&dev, config, &sets, options.kv_dtype)?;
    DeviceOps::assemble(dev, config, weights, kernels, options)
}

/// The MoE tactics `options` may run, whose scale layouts the weights must hold.
pub fn device_moe_tactics(options: &DeviceOptions) -> Result<Vec<MoeGemmTactic>, ExecError> {
    Ok(DeviceOptions::moe_tactics(&options.tactic_sets()?))
}

/// Latent cache tokens for `options`: `cache_tokens`, or with `fill_memory` what the device's
/// memory leaves after the weights (already held) and the workspace (sized for the longest
/// context the model takes), rounded down to whole pages.
fn cache_tokens_for<D: Device>(
    dev: &D,
    c: &ModelConfig,
    heads: usize,
    kernels: &StepKernels<D>,
    options: &DeviceOptions,
) -> Result<usize, ExecError> {
    let (Some(share), Some((free, total))) = (options.fill_memory, dev.memory_info()) else {
        return Ok(options.cache_tokens);
    };
    let workspace = workspace_bytes(
        c,
        &WorkspaceShape {
            rows: options.capacity.tokens.max(1),
            heads,
            max_pages: max_pages(c, usize::MAX),
            max_splits: kernels
                .mla
                .iter()
                .map(|k| k.tactic.max_splits as usize)
                .max()
                .unwrap_or(1),
            logit_rows: options.capacity.logit_rows,
            ranks: 1,
            vendor_dense: options.tactics.dense == DenseTactic::CublasLt,
        },
    );
    let kept_back = (total as f64 * (1.0 - share)) as usize;
    let budget = free.saturating_sub(workspace + kept_back);
    let per_token = options
        .kv_dtype
        .bytes_per_token(&kernels::mla::cache::LatentCacheShape {
            layers: c.num_hidden_layers,
            latent_dim: c.kv_lora_rank,
            rope_dim: c.qk_rope_head_dim,
        })
        * c.num_hidden_layers;
    let tokens = budget / per_token.max(1) / PAGE_TOKENS * PAGE_TOKENS;
    if tokens < options.cache_tokens {
        return Err(ExecError::Device(format!(
            "the latent cache needs {} tokens ({:.2} GiB), but {:.0}% of the device's {:.2} GiB \
             leaves {:.2} GiB after the weights and {:.2} GiB of workspace: raise \
             --gpu-memory-utilization or lower --max-num-seqs / --max-model-len",
            options.cache_tokens,
            (options.cache_tokens * per_token) as f64 / GIB,
            share * 100.0,
            total as f64 / GIB,
            budget as f64 / GIB,
            workspace as f64 / GIB,
        )));
    }
    Ok(tokens)
}

const GIB: f64 = (1u64 << 30) as f64;

/// The step being run: its shape, decided on the host.
#[derive(Clone, Copy, Debug)]
struct StepShape {
    rows: usize,
    /// Rows that get logits.
    selected: usize,
    /// Every row gets logits (the final norm's rows are the selected ones).
    every_row: bool,
    splits: u32,
    output: StepOutput,
    /// Cache tokens the rows attend over (launch traffic accounting only).
    cached_tokens: usize,
    /// The step's MLA and MoE kernels: indices into the loaded ones.
    mla: usize,
    moe: Option<usize>,
}

/// The device backend's [`StepOps`]. See the module documentation.
pub struct DeviceOps<D: Device> {
    dev: D,
    config: ModelConfig,
    heads: usize,
    ranks: usize,
    weights_bytes: usize,
    layers: LayerKernels<D>,
    kernels: StepKernels<D>,
    tactics: ExecutorTactics,
    selector: Option<TacticSelector>,
    /// What the last step ran, as logged (a new line when it changes).
    logged: Option<Vec<String>>,
    quiet: bool,
    caches: Vec<DeviceCache<D>>,
    pages: PageTables,
    kv_dtype: KvCacheDtype,
    ws: Workspace<D>,
    rope_inv_freq: D::Memory,
    attention_factor: f32,
    softmax_scale: f32,
    eps: f32,
    router: Option<RouterShape>,
    /// Decode graphs by shape and the tactics they launch.
    graphs: HashMap<(GraphKey, usize, Option<usize>), D::Graph>,
    step: StepShape,
    /// Row width of the last product written into [`Buf::GateUp`] (`2 · inter`).
    gate_up_width: usize,
    /// This rank's share of a tensor-parallel group; `None`: the whole model on one device.
    all_reduce: Option<Box<dyn TpAllReduce<D>>>,
}

impl<D: Device> DeviceOps<D> {
    fn assemble(
        dev: D,
        config: &ModelConfig,
        weights: DeviceWeights<D>,
        kernels: StepKernels<D>,
        options: DeviceOptions,
    ) -> Result<Runner<DeviceOps<D>>, ExecError> {
        let c = config.clone();
        let mut kernels = kernels;
        let layers = LayerKernels::load(&dev)?;
        let DeviceWeights { weights, bytes, .. } = weights;
        let cache_tokens = cache_tokens_for(&dev, &c, weights.heads, &kernels, &options)?;
        let pages = PageTables::new(cache_tokens.div_ceil(PAGE_TOKENS).max(1));
        let caches = (0..c.num_hidden_layers)
            .map(|_| DeviceCache::alloc(&dev, options.kv_dtype, c.mla_dims(), pages.total_slots()))
            .collect::<Result<Vec<_>, _>>()?;
        let ranks = weights.shard.world.max(1);
        let ws = Workspace::new(
            &dev,
            &c,
            WorkspaceShape {
                rows: options.capacity.tokens.max(1),
                heads: weights.heads,
                max_pages: max_pages(&c, pages.total_slots()),
                max_splits: kernels
                    .mla
                    .iter()
                    .map(|k| k.tactic.max_splits as usize)
                    .max()
                    .unwrap_or(1),
                logit_rows: options.capacity.logit_rows,
                ranks,
                vendor_dense: options.tactics.dense == DenseTactic::CublasLt,
            },
        )?;
        let rope = crate::arch::rope::Rope::new(&c);
        let rope_inv_freq = dev.upload(rope.inv_freq())?;
        let router = (c.n_routed_experts > 0).then(|| RouterShape {
            experts: c.n_routed_experts,
            n_group: c.n_group.max(1),
            topk_group: c.topk_group,
            top_k: c.num_experts_per_tok,
            norm_topk_prob: c.norm_topk_prob,
            routed_scaling_factor: c.routed_scaling_factor as f32,
        });
        if let Some(r) = &router {
            r.validate()?;
        }
        let mla = kernels.mla_index(&dev, &c, options.tactics.mla, options.kv_dtype)?;
        let moe = options
            .tactics
            .moe
            .map(|t| kernels.moe_index(&dev, t))
            .transpose()?;
        let ops = Self {
            attention_factor: rope.attention_factor(),
            softmax_scale: c.softmax_scale(),
            eps: c.rms_norm_eps as f32,
            heads: weights.heads,
            ranks,
            weights_bytes: bytes,
            dev,
            layers,
            kernels,
            tactics: options.tactics,
            selector: options.selector,
            logged: None,
            quiet: options.quiet,
            caches,
            pages,
            kv_dtype: options.kv_dtype,
            ws,
            rope_inv_freq,
            router,
            graphs: HashMap::new(),
            step: StepShape {
                rows: 0,
                selected: 0,
                every_row: false,
                splits: 1,
                output: StepOutput::Logits,
                cached_tokens: 0,
                mla,
                moe,
            },
            gate_up_width: 0,
            all_reduce: None,
            config: c.clone(),
        };
        Ok(Runner::new(ops, weights, c))
    }

    /// Makes this backend one rank of a tensor-parallel group: its weights must be the rank's
    /// shard, and every step sums over the group with `all_reduce` where the step asks. Drops
    /// captured graphs (they lack the collectives).
    pub fn set_all_reduce(&mut self, all_reduce: Box<dyn TpAllReduce<D>>) -> Result<(), ExecError> {
        if all_reduce.world() != self.ranks {
            return Err(unsupported(format!(
                "an all-reduce over {} ranks for the weights of a group of {}",
                all_reduce.world(),
                self.ranks
            )));
        }
        self.graphs.clear();
        self.all_reduce = Some(all_reduce);
        Ok(())
    }

    /// Graphs captured so far.
    pub fn graph_count(&self) -> usize {
        self.graphs.len()
    }

    pub fn device(&self) -> &D {
        &self.dev
    }

    pub fn tactics(&self) -> &ExecutorTactics {
        &self.tactics
    }

    /// The tactics the last step ran with.
    pub fn step_tactics(&self) -> ExecutorTactics {
        ExecutorTactics {
            moe: self.step.moe.map(|i| self.kernels.moe[i].tactic),
            mla: self.kernels.mla[self.step.mla].tactic,
            dense: self.tactics.dense,
        }
    }

    pub fn kv_dtype(&self) -> KvCacheDtype {
        self.kv_dtype
    }

    /// Device bytes held: weights, cache and workspace.
    pub fn device_bytes(&self) -> DeviceBytes {
        DeviceBytes {
            weights: self.weights_bytes,
            cache: self.caches.iter().map(|c| c.device_bytes()).sum(),
            workspace: self.ws.device_bytes(),
        }
    }

    /// The step's MLA and MoE kernels (indices into the loaded ones) and the tuned MLA split
    /// count: the selector's choice for a step of `batch` sequences and `rows` rows whose
    /// longest sequence attends over `context` tokens, or the run's fixed tactics. A choice
    /// whose kernels are not loaded yet is loaded here (never while a graph is captured); a
    /// MoE tactic whose scale layout the weights do not hold falls back to the run's own.
    /// Logs what runs when it changes.
    fn select(
        &mut self,
        batch: usize,
        rows: usize,
        context: usize,
    ) -> Result<(usize, Option<usize>, Option<u32>), ExecError> {
        let Some(selector) = &self.selector else {
            return Ok((self.step.mla, self.step.moe, None));
        };
        // Prefill steps are shaped by their rows, decode steps by their sequences.
        let selection = selector.select(batch.max(rows.min(SPLIT_ROWS)), context)?;
        let mla = self.kernels.mla_index(
            &self.dev,
            &self.config,
            selection.mla.tactic.kernel,
            self.kv_dtype,
        )?;
        let moe = match (&selection.moe, self.tactics.moe) {
            (Some(chosen), Some(own)) if chosen.tactic.scale_load == own.scale_load => {
                Some(self.kernels.moe_index(&self.dev, chosen.tactic)?)
            }
            (_, Some(own)) => Some(self.kernels.moe_index(&self.dev, own)?),
            (_, None) => None,
        };
        let tuned_splits = selection
            .mla
            .figure
            .is_some()
            .then_some(selection.mla.tactic.splits);
        if !self.quiet {
            let mut lines = selection.describe();
            if let (Some(chosen), Some(i)) = (&selection.moe, moe)
                && self.kernels.moe[i].tactic != chosen.tactic
            {
                lines.push(format!(
                    "moe_gemm: {} instead (the weights hold its scale layout)",
                    self.kernels.moe[i].tactic.id()
                ));
            }
            if self.logged.as_ref() != Some(&lines) {
                eprintln!("step tactics (batch {batch}, context {context}):");
                for line in &lines {
                    eprintln!("  {line}");
                }
                self.logged = Some(lines);
            }
        }
        Ok((mla, moe, tuned_splits))
    }

    fn mem(&self, b: Buf) -> &D::Memory {
        buffer(&self.ws, self.step.every_row, b)
    }

    /// Rows of `b` in the current step.
    fn rows_of(&self, b: Buf) -> usize {
        match b {
            Buf::Selected | Buf::Logits | Buf::ArgmaxPairs => self.step.selected,
            _ => self.step.rows,
        }
    }

    /// Values of `b` in the current step.
    fn elements(&self, b: Buf) -> usize {
        let c = &self.config;
        match b {
            Buf::Residual | Buf::Normed | Buf::Delta | Buf::Selected => {
                self.rows_of(b) * c.hidden_size
            }
            Buf::Logits => self.step.selected * c.vocab_size,
            Buf::ArgmaxPairs => self.step.selected * self.ranks * 2,
            other => unreachable!("the step does not sum {other:?} over ranks"),
        }
    }

    fn dense(&self) -> Products<'_, D> {
        Products::new(&self.layers, self.tactics.dense, &self.ws.blas_input)
    }

    fn write_step_inputs(&mut self, step: &StepRows<'_>) -> Result<(), ExecError> {
        let ids: Vec<i32> = step.ids.iter().map(|&t| t as i32).collect();
        let positions: Vec<i32> = step.rows.iter().map(|&(_, pos)| pos as i32).collect();
        let max_pages = self.ws.max_pages;
        let mut slots = Vec::with_capacity(step.rows.len());
        let mut table = vec![0i32; step.rows.len() * max_pages];
        for (r, &(seq, pos)) in step.rows.iter().enumerate() {
            slots.push(self.pages.slot(seq, pos)? as i32);
            let pages = self.pages.block_table(seq)?;
            for (dst, &page) in table[r * max_pages..].iter_mut().zip(pages) {
                *dst = page as i32;
            }
        }
        let seq_lens: Vec<i32> = positions.iter().map(|&p| p + 1).collect();
        let selected: Vec<i32> = step.selected.iter().map(|&r| r as i32).collect();
        let (dev, ws) = (&self.dev, &mut self.ws);
        dev.write(&mut ws.ids, &ids)?;
        dev.write(&mut ws.positions, &positions)?;
        dev.write(&mut ws.slots, &slots)?;
        dev.write(&mut ws.seq_lens, &seq_lens)?;
        dev.write(&mut ws.block_table, &table)?;
        dev.write(&mut ws.logit_rows, &selected)?;
        if step.output == StepOutput::Sampled {
            dev.write(&mut ws.sample_params, step.draws)?;
        }
        Ok(())
    }

    /// The step's ids or logits, read back: the one transfer to the host.
    fn read_result(&self) -> Result<StepResult, ExecError> {
        let (c, dev, ws, r) = (&self.config, &self.dev, &self.ws, self.step.selected);
        match self.step.output {
            StepOutput::Logits => {
                let values: Vec<f32> = dev.download_first(&ws.logits, r * c.vocab_size)?;
                if let Some(i) = values.iter().position(|v| !v.is_finite()) {
                    return Err(ExecError::NonFinite {
                        place: "the final norm and lm_head (device)".into(),
                        row: i / c.vocab_size,
                        element: i % c.vocab_size,
                        value: values[i],
                    });
                }
                Ok(StepResult::Logits(Logits {
                    rows: r,
                    vocab: c.vocab_size,
                    values,
                }))
            }
            StepOutput::Greedy | StepOutput::Sampled => Ok(StepResult::Ids(
                dev.download_first::<i32>(&ws.sampled, r)?
                    .iter()
                    .map(|&i| i as u32)
                    .collect(),
            )),
        }
    }
}

/// The workspace buffer of `b`.
fn buffer<D: Device>(ws: &Workspace<D>, every_row: bool, b: Buf) -> &D::Memory {
    match b {
        Buf::Residual => &ws.x,
        Buf::Normed => &ws.h,
        Buf::Delta => &ws.delta,
        Buf::QueryLatent => &ws.qa,
        Buf::QueryLatentNormed => &ws.qa_normed,
        Buf::Query => &ws.q,
        Buf::KvLatent => &ws.latent,
        Buf::KeyRope => &ws.k_rope,
        Buf::AbsorbedQuery => &ws.q_abs,
        Buf::QueryRope => &ws.q_pe,
        Buf::AttentionLatent => &ws.o_latent,
        Buf::AttentionOut => &ws.o,
        Buf::GateUp => &ws.gate_up,
        Buf::Activated => &ws.act,
        Buf::RouterLogits => &ws.router_logits,
        // Every row gets logits: the final norm's rows are the selected ones.
        Buf::Selected if every_row => &ws.h,
        Buf::Selected => &ws.selected,
        Buf::Logits => &ws.logits,
        Buf::ArgmaxPairs => &ws.argmax_pairs,
    }
}

impl<D: Device> StepOps for DeviceOps<D> {
    type Kinds = DeviceKinds<D>;

    fn describe(&self) -> String {
        self.dev.describe()
    }

    fn pages(&self) -> &PageTables {
        &self.pages
    }

    fn pages_mut(&mut self) -> &mut PageTables {
        &mut self.pages
    }

    fn begin_step(&mut self, step: &StepRows<'_>) -> Result<(), ExecError> {
        let n = step.rows.len();
        if self.ranks > 1 && self.all_reduce.is_none() {
            return Err(unsupported(format!(
                "a rank of {} holds a shard of the model: a step needs the group's all-reduce \
                 (set_all_reduce)",
                self.ranks
            )));
        }
        let selected = step.selected.len();
        if n > self.ws.rows || selected > self.ws.logit_capacity {
            // Graphs name the old buffers.
            self.graphs.clear();
            self.ws = Workspace::new(
                &self.dev,
                &self.config,
                WorkspaceShape {
                    rows: n.max(self.ws.rows),
                    heads: self.heads,
                    max_pages: self.ws.max_pages,
                    max_splits: self.ws.max_splits,
                    logit_rows: selected.max(self.ws.logit_capacity),
                    ranks: self.ranks,
                    vendor_dense: self.tactics.dense == DenseTactic::CublasLt,
                },
            )?;
        }
        self.write_step_inputs(step)?;
        let longest = step.rows.iter().map(|&(_, pos)| pos + 1).max().unwrap_or(1);
        let (mla, moe, tuned_splits) = self.select(step.selected.len().max(1), n, longest)?;
        // A decode step's launches depend on its batch size alone (the split count is planned
        // for the cache's capacity, not the current lengths), so one graph serves every step
        // of that size and selection.
        let context = if step.decode {
            self.pages.total_slots()
        } else {
            longest
        };
        let tactic = &self.kernels.mla[mla].tactic;
        let splits = if n > self.ws.split_rows {
            1
        } else if let Some(tuned) = tuned_splits {
            tuned.clamp(1, tactic.max_splits)
        } else {
            tactic.plan_splits(
                n,
                self.heads,
                context,
                self.dev.sm()?.reference_gpu().sms as usize,
            )
        };
        self.step = StepShape {
            rows: n,
            selected,
            every_row: selected == n && step.selected.iter().enumerate().all(|(i, &s)| s == i),
            splits,
            output: step.output,
            cached_tokens: step.rows.iter().map(|&(_, pos)| pos + 1).sum(),
            mla,
            moe,
        };
        Ok(())
    }

    fn run_step(
        &mut self,
        body: &mut (dyn FnMut(&mut Self) -> Result<(), ExecError> + Send),
    ) -> Result<(), ExecError> {
        body(self)
    }

    fn replay(&mut self, key: GraphKey) -> Result<bool, ExecError> {
        match self.graphs.get(&(key, self.step.mla, self.step.moe)) {
            Some(graph) => {
                self.dev.replay(graph)?;
                Ok(true)
            }
            None => Ok(false),
        }
    }

    fn begin_capture(&mut self, _: GraphKey) -> Result<bool, ExecError> {
        self.dev.begin_capture()?;
        Ok(true)
    }

    fn end_capture(&mut self, key: GraphKey) -> Result<(), ExecError> {
        let graph = self.dev.end_capture()?;
        self.graphs
            .insert((key, self.step.mla, self.step.moe), graph);
        Ok(())
    }

    fn embed(
        &mut self,
        table: &DeviceMatrix<D>,
        vocab_rows: Range<usize>,
        out: Buf,
    ) -> Result<(), ExecError> {
        let c = &self.config;
        self.dev.fill(&mut self.ws.bad_id, 0xFF)?;
        self.layers.embed_gather(
            &self.dev,
            &self.ws.ids,
            self.step.rows,
            &table.memory,
            vocab_rows,
            c.vocab_size,
            c.hidden_size,
            self.mem(out),
            &self.ws.bad_id,
        )?;
        Ok(())
    }

    fn add_rms_norm(
        &mut self,
        residual: Buf,
        delta: Option<Buf>,
        weight: &D::Memory,
        out: Buf,
        _: Sublayer,
    ) -> Result<(), ExecError> {
        self.layers.add_rms_norm(
            &self.dev,
            self.mem(residual),
            delta.map(|d| self.mem(d)),
            weight,
            self.eps,
            self.step.rows,
            self.config.hidden_size,
            self.mem(out),
        )?;
        Ok(())
    }

    fn rms_norm(&mut self, x: Buf, weight: &D::Memory, out: Buf) -> Result<(), ExecError> {
        // The weight is BF16, one value per element of a row.
        self.layers.add_rms_norm(
            &self.dev,
            self.mem(x),
            None,
            weight,
            self.eps,
            self.step.rows,
            weight.len() / 2,
            self.mem(out),
        )?;
        Ok(())
    }

    fn products(&mut self, x: Buf, outs: &[(&DeviceMatrix<D>, Buf)]) -> Result<(), ExecError> {
        let tokens = self.rows_of(x);
        for (w, out) in outs {
            if *out == Buf::GateUp {
                self.gate_up_width = w.rows;
            }
            self.dense().product(
                &self.dev,
                self.mem(x),
                tokens,
                &w.memory,
                w.cols,
                w.rows,
                self.mem(*out),
                false,
            )?;
        }
        Ok(())
    }

    fn product_add(&mut self, x: Buf, w: &DeviceMatrix<D>, out: Buf) -> Result<(), ExecError> {
        self.dense().product(
            &self.dev,
            self.mem(x),
            self.step.rows,
            &w.memory,
            w.cols,
            w.rows,
            self.mem(out),
            true,
        )?;
        Ok(())
    }

    fn rope(&mut self, buf: Buf) -> Result<(), ExecError> {
        let c = &self.config;
        let (nope, rope) = (c.qk_nope_head_dim, c.qk_rope_head_dim);
        let qk = nope + rope;
        let (row_stride, slices) = match buf {
            Buf::Query => (
                self.heads * qk,
                RopeSlices {
                    offset: nope,
                    stride: qk,
                    count: self.heads,
                    pairs: rope / 2,
                },
            ),
            Buf::KeyRope => (
                rope,
                RopeSlices {
                    offset: 0,
                    stride: rope,
                    count: 1,
                    pairs: rope / 2,
                },
            ),
            other => {
                return Err(ExecError::InvalidRequest(format!(
                    "RoPE of {other:?}: only the queries and the RoPE key rotate"
                )));
            }
        };
        self.layers.rope_interleaved(
            &self.dev,
            self.mem(buf),
            self.step.rows,
            row_stride,
            slices,
            &self.ws.positions,
            &self.rope_inv_freq,
            self.attention_factor,
        )?;
        Ok(())
    }

    fn append_cache(
        &mut self,
        layer: usize,
        latent: Buf,
        key_rope: Buf,
        norm: &D::Memory,
    ) -> Result<(), ExecError> {
        self.kernels.mla[self.step.mla].append_io(
            &self.dev,
            &mut self.caches[layer],
            buffer(&self.ws, self.step.every_row, latent),
            buffer(&self.ws, self.step.every_row, key_rope),
            norm,
            self.eps,
            &self.ws.slots,
            self.step.rows,
            0.0,
        )?;
        Ok(())
    }

    fn absorb_query(
        &mut self,
        query: Buf,
        w_uk_t: &DeviceHeads<D>,
        absorbed: Buf,
        rope: Buf,
    ) -> Result<(), ExecError> {
        let c = &self.config;
        let (heads, n) = (self.heads, self.step.rows);
        let (nope, latent, rope_dim) = (c.qk_nope_head_dim, c.kv_lora_rank, c.qk_rope_head_dim);
        let qk = nope + rope_dim;
        // q_abs[t, h] = q_nope[t, h] · W_UK[h], with W_UK[h]ᵀ ([L, P]) as the product's matrix.
        self.layers.dense_heads(
            &self.dev,
            self.mem(query),
            HeadRows {
                offset: 0,
                row_stride: heads * qk,
                head_stride: qk,
            },
            n,
            heads,
            &w_uk_t.memory,
            w_uk_t.offset,
            w_uk_t.stride,
            w_uk_t.cols,
            w_uk_t.rows,
            self.mem(absorbed),
            HeadRows {
                offset: 0,
                row_stride: heads * latent,
                head_stride: latent,
            },
            OutputType::Bf16,
        )?;
        self.layers.to_bf16_strided(
            &self.dev,
            self.mem(query),
            n,
            heads * qk,
            nope,
            qk,
            heads,
            rope_dim,
            self.mem(rope),
        )?;
        Ok(())
    }

    fn attention(
        &mut self,
        layer: usize,
        absorbed: Buf,
        rope: Buf,
        out: Buf,
    ) -> Result<(), ExecError> {
        let ws = &self.ws;
        let n = self.step.rows;
        let io = DecodeIo {
            rows: n,
            heads: self.heads,
            max_pages: ws.max_pages,
            max_splits: if n > ws.split_rows { 1 } else { ws.max_splits },
            q_abs: self.mem(absorbed),
            q_pe: self.mem(rope),
            block_table: &ws.block_table,
            seq_lens: &ws.seq_lens,
            out: self.mem(out),
            lse: &ws.lse,
            part_out: &ws.part_out,
            part_lse: &ws.part_lse,
            cached_tokens: self.step.cached_tokens,
        };
        self.kernels.mla[self.step.mla].decode_io(
            &self.dev,
            &self.caches[layer],
            &io,
            self.step.splits,
            self.softmax_scale,
        )?;
        Ok(())
    }

    fn unabsorb(&mut self, latent: Buf, w_uv: &DeviceHeads<D>, out: Buf) -> Result<(), ExecError> {
        let c = &self.config;
        let (heads, l, v_dim) = (self.heads, c.kv_lora_rank, c.v_head_dim);
        // o[t, h] = o_latent[t, h] · W_UV[h]ᵀ, W_UV[h] = kv_b's rows h·(P+V)+P .. (h+1)·(P+V).
        self.layers.dense_heads(
            &self.dev,
            self.mem(latent),
            HeadRows {
                offset: 0,
                row_stride: heads * l,
                head_stride: l,
            },
            self.step.rows,
            heads,
            &w_uv.memory,
            w_uv.offset,
            w_uv.stride,
            w_uv.cols,
            w_uv.rows,
            self.mem(out),
            HeadRows {
                offset: 0,
                row_stride: heads * v_dim,
                head_stride: v_dim,
            },
            OutputType::F32,
        )?;
        Ok(())
    }

    fn silu_mul(&mut self, gate_up: Buf, out: Buf) -> Result<(), ExecError> {
        self.layers.silu_mul(
            &self.dev,
            self.mem(gate_up),
            self.step.rows,
            self.gate_up_width / 2,
            self.mem(out),
        )?;
        Ok(())
    }

    fn route(&mut self, _layer: usize, logits: Buf, bias: &D::Memory) -> Result<(), ExecError> {
        let router = self.router.as_ref().expect("MoE layers have a router");
        let (n, ws) = (self.step.rows, &self.ws);
        self.layers.route(
            &self.dev,
            router,
            self.mem(logits),
            bias,
            n,
            &ws.route_ids,
            &ws.route_weights,
        )?;
        self.layers.group_by_expert(
            &self.dev,
            &ws.route_ids,
            &ws.route_weights,
            n,
            router.top_k,
            router.experts,
            &ws.expert_offsets,
            &ws.sorted_token_ids,
            &ws.sorted_weights,
            &ws.active_experts,
        )?;
        Ok(())
    }

    fn routed_experts(
        &mut self,
        _layer: usize,
        x: Buf,
        experts: &MoeDeviceWeights<D>,
        out: Buf,
    ) -> Result<(), ExecError> {
        let router = self.router.as_ref().expect("MoE layers have a router");
        let moe = &self.kernels.moe[self.step.moe.expect("MoE layers have MoE kernels")];
        let (n, hidden) = (self.step.rows, self.config.hidden_size);
        self.layers.to_bf16_strided(
            &self.dev,
            self.mem(x),
            n,
            hidden,
            0,
            0,
            1,
            hidden,
            &self.ws.x_bf16,
        )?;
        let bytes = n * hidden * 4;
        match out {
            Buf::Delta => self.dev.fill_prefix(&mut self.ws.delta, bytes, 0)?,
            other => {
                return Err(ExecError::InvalidRequest(format!(
                    "the routed experts write the layer's delta, not {other:?}"
                )));
            }
        }
        let ws = &self.ws;
        moe.run_device_grouped(
            &self.dev,
            experts,
            &MoeDeviceGrouping {
                tokens: n,
                top_k: router.top_k,
                experts: router.experts,
                bounds: MoeGroupingBounds::for_tokens(n, router.top_k, router.experts),
                expert_offsets: &ws.expert_offsets,
                active_experts: &ws.active_experts,
                sorted_token_ids: &ws.sorted_token_ids,
                sorted_weights: &ws.sorted_weights,
            },
            &MoeDeviceIo {
                x: &ws.x_bf16,
                h_q: &ws.h_q,
                h_sf: &ws.h_sf,
                out: &ws.delta,
            },
        )?;
        Ok(())
    }

    fn all_reduce(&mut self, buf: Buf) -> Result<(), ExecError> {
        let total = self.elements(buf);
        let Some(ar) = self.all_reduce.as_deref_mut() else {
            return Ok(());
        };
        let memory = match buf {
            Buf::Residual => &self.ws.x,
            Buf::Delta => &self.ws.delta,
            Buf::Logits => &self.ws.logits,
            Buf::ArgmaxPairs => &self.ws.argmax_pairs,
            other => unreachable!("the step does not sum {other:?} over ranks"),
        };
        // In slot-sized pieces (a prompt's logits outgrow the segment's slot), each a multiple of
        // the kernel's 4-value vectors.
        let piece = (ar.capacity_elements() / 4 * 4).max(4);
        for start in (0..total).step_by(piece) {
            ar.sum_f32(&self.dev, memory, start..(start + piece).min(total))?;
        }
        Ok(())
    }

    fn select_rows(&mut self, x: Buf, out: Buf) -> Result<(), ExecError> {
        if self.step.every_row {
            return Ok(());
        }
        self.layers.gather_rows(
            &self.dev,
            self.mem(x),
            self.step.rows,
            &self.ws.logit_rows,
            self.step.selected,
            self.config.hidden_size,
            self.mem(out),
        )?;
        Ok(())
    }

    fn vocab_columns(
        &mut self,
        x: Buf,
        lm_head: &DeviceMatrix<D>,
        vocab_rows: Range<usize>,
        out: Buf,
    ) -> Result<(), ExecError> {
        let (r, vocab) = (self.step.selected, self.config.vocab_size);
        match out {
            Buf::Logits => self
                .dev
                .fill_prefix(&mut self.ws.logits, r * vocab * 4, 0)?,
            other => {
                return Err(ExecError::InvalidRequest(format!(
                    "vocabulary columns go into the logits, not {other:?}"
                )));
            }
        }
        self.dense().product_into(
            &self.dev,
            self.mem(x),
            r,
            &lm_head.memory,
            lm_head.cols,
            vocab_rows.len(),
            self.mem(out),
            DenseOutput {
                offset: vocab_rows.start,
                row_stride: vocab,
            },
            false,
        )?;
        Ok(())
    }

    fn argmax_shard(
        &mut self,
        logits: Buf,
        vocab_rows: Range<usize>,
        rank: usize,
        ranks: usize,
        pairs: Buf,
    ) -> Result<(), ExecError> {
        self.layers.argmax_shard(
            &self.dev,
            self.mem(logits),
            self.step.selected,
            vocab_rows.len(),
            vocab_rows.len(),
            vocab_rows.start,
            ranks,
            rank,
            self.mem(pairs),
        )?;
        Ok(())
    }

    fn argmax_ranks(&mut self, pairs: Buf, ranks: usize) -> Result<(), ExecError> {
        self.layers.argmax_ranks(
            &self.dev,
            self.mem(pairs),
            self.step.selected,
            ranks,
            &self.ws.sampled,
        )?;
        Ok(())
    }

    fn argmax(&mut self, logits: Buf) -> Result<(), ExecError> {
        self.layers.argmax_rows(
            &self.dev,
            self.mem(logits),
            self.step.selected,
            self.config.vocab_size,
            &self.ws.sampled,
        )?;
        Ok(())
    }

    fn sample(&mut self, logits: Buf) -> Result<(), ExecError> {
        self.layers.sample_rows(
            &self.dev,
            self.mem(logits),
            self.step.selected,
            self.config.vocab_size,
            &self.ws.sample_params,
            &self.ws.sampled,
        )?;
        Ok(())
    }

    fn finish_step(&mut self) -> Result<StepResult, ExecError> {
        let result = self.read_result()?;
        if let Some(all_reduce) = self.all_reduce.as_mut() {
            all_reduce.check(&self.dev)?;
        }
        Ok(result)
    }
}

impl From<WeightsError> for ExecError {
    fn from(e: WeightsError) -> Self {
        match e {
            WeightsError::Unsupported { .. } => unsupported(e.to_string()),
            WeightsError::Upload { .. } => ExecError::Device(e.to_string()),
        }
    }
}

/// The model on one device: the runner over [`DeviceOps`].
pub type DeviceRunner<D> = Runner<DeviceOps<D>>;

impl<D: Device> Runner<DeviceOps<D>> {
    pub fn device(&self) -> &D {
        self.ops().device()
    }

    /// Device bytes held: weights, cache and workspace.
    pub fn device_bytes(&self) -> DeviceBytes {
        self.ops().device_bytes()
    }

    /// Decode graphs captured so far.
    pub fn graph_count(&self) -> usize {
        self.ops().graph_count()
    }

    /// See [`DeviceOps::set_all_reduce`].
    pub fn set_all_reduce(&mut self, all_reduce: Box<dyn TpAllReduce<D>>) -> Result<(), ExecError> {
        self.ops_mut().set_all_reduce(all_reduce)
    }
}
