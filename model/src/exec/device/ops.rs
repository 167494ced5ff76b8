//! The device backend's [`StepOps`] implementor, [`DeviceOps`]: what it holds (the kernels of
//! every tactic a run may select, the latent cache, the workspace, the decode graphs), how a
//! runner on it is made, and the host's part of a step: the tactics chosen for its shape, its
//! inputs written and its result read back. The operations themselves are [`step`]'s.

mod step;

use std::collections::HashMap;

use kernels::blas::DenseTactic;
use kernels::device::{Device, DeviceExt};
use kernels::layers::{LayerKernels, RouterShape};
use kernels::mla::cache::{KvCacheDtype, PAGE_TOKENS, PageTables};
use kernels::mla::launch::{DeviceCache, MlaKernels};
use kernels::mla::tactic::MlaTactic;
use kernels::moe_gemm::MoeGemmTactic;
use kernels::moe_gemm::launch::MoeKernels;

use super::all_reduce::TpAllReduce;
use super::products::Products;
use super::support::{ExecutorTactics, check_supported, unsupported};
use super::weights::DeviceWeights;
use super::workspace::{
    SPLIT_ROWS, StepCapacity, Workspace, WorkspaceShape, max_pages, workspace_bytes,
};
use crate::arch::config::ModelConfig;
use crate::arch::rope::Rope;
use crate::checkpoint::weights::Model;
use crate::exec::error::ExecError;
use crate::exec::ops::{Buf, GraphKey, Logits, StepOutput, StepResult, StepRows};
use crate::exec::runner::Runner;
use crate::exec::tactics::TacticSelector;

/// Host→device writes of one step: token ids, positions, cache slots, context lengths, block
/// tables and the rows that get logits.
pub const STEP_WRITES: usize = 6;

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

/// The step workspace's shape for `options`, this rank's `heads` of `ranks`, and a latent cache
/// of `cache_slots` tokens.
fn workspace_shape<D: Device>(
    c: &ModelConfig,
    options: &DeviceOptions,
    kernels: &StepKernels<D>,
    heads: usize,
    cache_slots: usize,
    ranks: usize,
) -> WorkspaceShape {
    WorkspaceShape {
        rows: options.capacity.tokens.max(1),
        heads,
        max_pages: max_pages(c, cache_slots),
        max_splits: kernels
            .mla
            .iter()
            .map(|k| k.tactic.max_splits as usize)
            .max()
            .unwrap_or(1),
        logit_rows: options.capacity.logit_rows,
        ranks,
        vendor_dense: options.tactics.dense == DenseTactic::CublasLt,
    }
}

/// Latent cache tokens for `options`: `cache_tokens`, or with `fill_memory` what the device's
/// memory leaves after the weights (already held) and the workspace (sized for the longest
/// context the model takes), rounded down to whole pages.
fn cache_tokens_for<D: Device>(
    dev: &D,
    c: &ModelConfig,
    heads: usize,
    ranks: usize,
    kernels: &StepKernels<D>,
    options: &DeviceOptions,
) -> Result<usize, ExecError> {
    let Some((free, total)) = dev.memory_info() else {
        return Ok(options.cache_tokens);
    };
    // A cache of a fixed size (`--kv-cache-tokens`) must fit what the device leaves too: an
    // allocation past it fails deep in the driver, or its byte count overflows.
    let share = options.fill_memory.unwrap_or(1.0);
    let workspace = workspace_bytes(
        c,
        &workspace_shape(c, options, kernels, heads, usize::MAX, ranks),
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
        if options.fill_memory.is_none() {
            return Err(ExecError::InvalidRequest(format!(
                "--kv-cache-tokens {} needs {:.2} GiB, but the device leaves {:.2} GiB after the \
                 weights and {:.2} GiB of workspace",
                options.cache_tokens,
                options.cache_tokens.saturating_mul(per_token) as f64 / GIB,
                budget as f64 / GIB,
                workspace as f64 / GIB,
            )));
        }
        return Err(ExecError::Device(format!(
            "the latent cache needs {} tokens ({:.2} GiB), but {:.0}% of the device's {:.2} GiB \
             leaves {:.2} GiB after the weights and {:.2} GiB of workspace: raise \
             --gpu-memory-utilization or lower --max-num-seqs / --max-model-len",
            options.cache_tokens,
            options.cache_tokens.saturating_mul(per_token) as f64 / GIB,
            share * 100.0,
            total as f64 / GIB,
            budget as f64 / GIB,
            workspace as f64 / GIB,
        )));
    }
    Ok(match options.fill_memory {
        Some(_) => tokens,
        None => options.cache_tokens,
    })
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
        let ranks = weights.shard.world.max(1);
        let cache_tokens = cache_tokens_for(&dev, &c, weights.heads, ranks, &kernels, &options)?;
        let pages = PageTables::new(cache_tokens.div_ceil(PAGE_TOKENS).max(1));
        let caches = (0..c.num_hidden_layers)
            .map(|_| DeviceCache::alloc(&dev, options.kv_dtype, c.mla_dims(), pages.total_slots()))
            .collect::<Result<Vec<_>, _>>()?;
        let ws = Workspace::new(
            &dev,
            &c,
            workspace_shape(
                &c,
                &options,
                &kernels,
                weights.heads,
                pages.total_slots(),
                ranks,
            ),
        )?;
        let rope = Rope::new(&c);
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
