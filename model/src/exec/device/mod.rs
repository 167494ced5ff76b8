//! The device-resident executor: the whole forward pass as device work on any
//! [`Device`] — a GPU through cudarc (`cuda`), or the same kernels and launch arguments run by
//! the host execution layer on the CPU (`cuda-emulated`).
//!
//! The design follows candle's split of storage from device: weights are uploaded once as
//! device allocations ([`DeviceWeights`]), the paged latent cache lives in device memory (one
//! [`DeviceCache`] per layer, pages handed out by the same [`PageTables`] the CPU cache uses),
//! and a step's activations live in a workspace whose buffers keep their addresses from step
//! to step. One step is a fixed sequence of launches — embedding gather, per layer the
//! attention (products, RoPE, cache append, absorbed MLA decode) and the MLP or MoE (router,
//! grouping on the device, the grouped NVFP4 GEMM), the final norm and `lm_head`, greedy
//! argmax — decided by the host from the step's shape alone, never from values on the device.
//! The host writes the token ids, positions, cache slots, block tables and logit rows in (one
//! [`Device::write_bytes`] each) and reads sampled ids or logits back: [`STEP_WRITES`] and one
//! read per step, which `tests/device_executor.rs` counts.
//!
//! On a tensor-parallel rank ([`DeviceExecutor::set_all_reduce`]) the rank's all-reduce sums,
//! in stream order and inside captured graphs, the embedding rows (each rank holds its
//! vocabulary rows), the attention's and the MLP's partial products, and the
//! vocabulary-parallel head's results (see `vocabulary_parallel_head`).
//!
//! The numerics are the CPU forward pass's with the device kernels' roundings: queries reach
//! MLA in BF16, the MoE input in BF16 (as on a GPU), the norm weights as BF16 (what the
//! checkpoint stores), and FP32 sums in another order; with [`DenseTactic::CublasLt`] the dense
//! products' inputs in BF16 as well.

mod all_reduce;
mod counting;
mod launch_list;
mod weights;

#[cfg(feature = "cuda")]
pub use all_reduce::IpcAllReduce;
pub use all_reduce::{DryAllReduce, HostAddressed, ShmAllReduce, TpAllReduce};
pub use counting::{CountingDevice, DeviceTraffic, LaunchEntry};
pub use launch_list::{
    DryStep, KernelTotals, RecordedStep, decode_tactics, weights_every_step_reads,
};
pub use weights::{DeviceLayer, DeviceMlp, DeviceWeights, WeightsError};

use kernels::blas::{BlasGemm, DenseTactic};
use kernels::device::{Device, DeviceError, DeviceExt, DeviceMemory};
use kernels::layers::sampling::{SAMPLE_ROW_BYTES, SampleRow};
use kernels::layers::{DenseOutput, HeadRows, LayerKernels, OutputType, RopeSlices, RouterShape};
use kernels::mla::MlaDims;
use kernels::mla::cache::{KvCacheDtype, PAGE_TOKENS, PageTables, SeqId};
use kernels::mla::launch::{DecodeIo, DeviceCache, MlaKernels};
use kernels::mla::tactic::MlaTactic;
use kernels::moe_gemm::MoeGemmTactic;
use kernels::moe_gemm::launch::{MoeDeviceGrouping, MoeDeviceIo, MoeGroupingBounds, MoeKernels};
use kernels::tactic::{ProblemShape, Tactic};

use crate::arch::config::ModelConfig;
use crate::exec::forward::{ForwardError, LogitRows, Logits, Model, SeqInput};

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

impl ExecutorTactics {
    /// The heuristic defaults of the tuning lab for `sm` at decode shapes of this model.
    pub fn defaults(
        sm: kernels::arch::Sm,
        config: &ModelConfig,
        kv_dtype: KvCacheDtype,
    ) -> Result<Self, ExecutorError> {
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
    ) -> Result<Self, ExecutorError> {
        check_supported(config)?;
        let mla_shape = ProblemShape::mla(
            1,
            (config.num_attention_heads / world.max(1)) as u32,
            4096,
            kv_dtype == KvCacheDtype::Fp8E4m3,
            config.mla_dims(),
        );
        let mla = MlaTactic::heuristic_default(sm, &mla_shape).ok_or_else(|| {
            ExecutorError::Unsupported(format!(
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
                ExecutorError::Unsupported(format!(
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

#[derive(Debug, thiserror::Error)]
pub enum ExecutorError {
    #[error(transparent)]
    Device(#[from] DeviceError),
    #[error(transparent)]
    Forward(#[from] ForwardError),
    #[error(transparent)]
    Weights(#[from] WeightsError),
    /// The model's shape is outside what the device kernels implement.
    #[error("the device kernels cannot run this model: {0}")]
    Unsupported(String),
}

/// Everything a step may need, allocated for `rows` tokens (grown when a step needs more).
struct Workspace<D: Device> {
    rows: usize,
    /// Block-table columns each row has room for (the longest sequence the cache can hold).
    max_pages: usize,
    max_splits: usize,
    /// Rows the split workspace holds (larger steps run MLA unsplit).
    split_rows: usize,
    /// Rows of logits the workspace holds.
    logit_capacity: usize,
    bytes: usize,
    ids: D::Memory,
    positions: D::Memory,
    slots: D::Memory,
    seq_lens: D::Memory,
    block_table: D::Memory,
    logit_rows: D::Memory,
    bad_id: D::Memory,
    x: D::Memory,
    h: D::Memory,
    delta: D::Memory,
    qa: D::Memory,
    qa_normed: D::Memory,
    q: D::Memory,
    latent: D::Memory,
    k_rope: D::Memory,
    q_abs: D::Memory,
    q_pe: D::Memory,
    o_latent: D::Memory,
    lse: D::Memory,
    part_out: D::Memory,
    part_lse: D::Memory,
    o: D::Memory,
    gate_up: D::Memory,
    act: D::Memory,
    router_logits: D::Memory,
    route_ids: D::Memory,
    route_weights: D::Memory,
    expert_offsets: D::Memory,
    active_experts: D::Memory,
    sorted_token_ids: D::Memory,
    sorted_weights: D::Memory,
    x_bf16: D::Memory,
    h_q: D::Memory,
    h_sf: D::Memory,
    selected: D::Memory,
    logits: D::Memory,
    argmax_pairs: D::Memory,
    sampled: D::Memory,
    sample_params: D::Memory,
    blas_input: D::Memory,
}

/// Steps with more rows than this run MLA unsplit: prefill has parallelism enough in its
/// rows, and the split workspace (rows × heads × splits × 512 floats) stays small.
pub const SPLIT_ROWS: usize = 64;

/// What a workspace is sized for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkspaceShape {
    /// Tokens per step.
    pub rows: usize,
    /// Attention heads of this rank.
    pub heads: usize,
    /// Block-table columns per row: the pages of the longest sequence the cache can hold.
    pub max_pages: usize,
    /// Most MLA splits a step of up to [`SPLIT_ROWS`] rows may use.
    pub max_splits: usize,
    /// Rows of logits a step may return (its sequences when decoding; every token when
    /// scoring a prompt).
    pub logit_rows: usize,
    /// Tensor-parallel ranks (1: one device): each rank's greedy pick of its vocabulary
    /// columns takes a slot per rank.
    pub ranks: usize,
    /// The dense products run on the vendor library ([`DenseTactic::CublasLt`]), which takes
    /// their inputs as BF16: a buffer for the widest of them.
    pub vendor_dense: bool,
}

/// Tokens per step and rows of logits per step an executor is sized for (it grows when a
/// step needs more).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepCapacity {
    pub tokens: usize,
    pub logit_rows: usize,
}

/// Bytes of every workspace buffer, in [`Workspace`]'s field order: what the executor
/// allocates, and what `model plan` reports as the activation workspace.
pub fn workspace_buffer_bytes(c: &ModelConfig, s: &WorkspaceShape) -> Vec<(&'static str, usize)> {
    // As `DeviceExt::alloc_elements`: an empty request still gets one element.
    let n = |count: usize, size: usize| count.max(1) * size;
    let (rows, heads) = (s.rows.max(1), s.heads);
    let (hidden, qk) = (c.hidden_size, c.qk_head_dim());
    let (latent, rope) = (c.kv_lora_rank, c.qk_rope_head_dim);
    let q_rank = c.q_lora_rank.unwrap_or(1);
    let inter = c
        .intermediate_size
        .max(c.moe_intermediate_size * c.n_shared_experts.max(1));
    let experts = c.n_routed_experts.max(1);
    let assignments = rows * c.num_experts_per_tok.max(1);
    let moe_inter = device_expert_inter(c, 1);
    let split_rows = rows.min(SPLIT_ROWS);
    let logit_rows = s.logit_rows.clamp(1, rows);
    vec![
        ("ids", n(rows, 4)),
        ("positions", n(rows, 4)),
        ("slots", n(rows, 4)),
        ("seq_lens", n(rows, 4)),
        ("block_table", n(rows * s.max_pages, 4)),
        ("logit_rows", n(logit_rows, 4)),
        ("bad_id", n(1, 4)),
        ("x", n(rows * hidden, 4)),
        ("h", n(rows * hidden, 4)),
        ("delta", n(rows * hidden, 4)),
        ("qa", n(rows * q_rank, 4)),
        ("qa_normed", n(rows * q_rank, 4)),
        ("q", n(rows * heads * qk, 4)),
        ("latent", n(rows * latent, 4)),
        ("k_rope", n(rows * rope, 4)),
        ("q_abs", n(rows * heads * latent, 2)),
        ("q_pe", n(rows * heads * rope, 2)),
        ("o_latent", n(rows * heads * latent, 4)),
        ("lse", n(rows * heads, 4)),
        ("part_out", n(split_rows * heads * s.max_splits * latent, 4)),
        ("part_lse", n(split_rows * heads * s.max_splits, 4)),
        ("o", n(rows * heads * c.v_head_dim, 4)),
        ("gate_up", n(rows * 2 * inter, 4)),
        ("act", n(rows * inter, 4)),
        ("router_logits", n(rows * experts, 4)),
        ("route_ids", n(assignments, 4)),
        ("route_weights", n(assignments, 4)),
        ("expert_offsets", n(experts + 1, 4)),
        ("active_experts", n(experts + 1, 4)),
        ("sorted_token_ids", n(assignments, 4)),
        ("sorted_weights", n(assignments, 4)),
        ("x_bf16", n(rows * hidden, 2)),
        ("h_q", (assignments * moe_inter / 2).max(1)),
        ("h_sf", (assignments * moe_inter / 16).max(1)),
        ("selected", n(logit_rows * hidden, 4)),
        // Whole rows on every rank: a vocabulary-parallel rank gathers them for sampling and
        // for logits asked of the step.
        ("logits", n(logit_rows * c.vocab_size, 4)),
        ("argmax_pairs", n(logit_rows * s.ranks.max(1) * 2, 4)),
        ("sampled", n(logit_rows, 4)),
        ("sample_params", n(logit_rows, SAMPLE_ROW_BYTES)),
        (
            "blas_input",
            n(
                if s.vendor_dense {
                    rows * [hidden, q_rank, heads * c.v_head_dim, inter]
                        .into_iter()
                        .max()
                        .unwrap_or(1)
                } else {
                    0
                },
                2,
            ),
        ),
    ]
}

/// Total bytes of [`workspace_buffer_bytes`].
pub fn workspace_bytes(c: &ModelConfig, s: &WorkspaceShape) -> usize {
    workspace_buffer_bytes(c, s).iter().map(|(_, b)| b).sum()
}

/// Block-table columns for a cache of `slots` token slots under `config`.
pub fn max_pages(c: &ModelConfig, slots: usize) -> usize {
    slots
        .min(c.max_position_embeddings)
        .div_ceil(PAGE_TOKENS)
        .max(1)
}

impl<D: Device> Workspace<D> {
    fn new(dev: &D, c: &ModelConfig, shape: WorkspaceShape) -> Result<Self, DeviceError> {
        let sizes = workspace_buffer_bytes(c, &shape);
        let mut buffers = sizes
            .iter()
            .map(|&(_, bytes)| dev.alloc_zeroed(bytes))
            .collect::<Result<Vec<_>, _>>()?
            .into_iter();
        let mut next = || buffers.next().expect("one buffer per field");
        Ok(Self {
            rows: shape.rows.max(1),
            logit_capacity: shape.logit_rows.clamp(1, shape.rows.max(1)),
            max_pages: shape.max_pages,
            max_splits: shape.max_splits,
            split_rows: shape.rows.clamp(1, SPLIT_ROWS),
            ids: next(),
            positions: next(),
            slots: next(),
            seq_lens: next(),
            block_table: next(),
            logit_rows: next(),
            bad_id: next(),
            x: next(),
            h: next(),
            delta: next(),
            qa: next(),
            qa_normed: next(),
            q: next(),
            latent: next(),
            k_rope: next(),
            q_abs: next(),
            q_pe: next(),
            o_latent: next(),
            lse: next(),
            part_out: next(),
            part_lse: next(),
            o: next(),
            gate_up: next(),
            act: next(),
            router_logits: next(),
            route_ids: next(),
            route_weights: next(),
            expert_offsets: next(),
            active_experts: next(),
            sorted_token_ids: next(),
            sorted_weights: next(),
            x_bf16: next(),
            h_q: next(),
            h_sf: next(),
            selected: next(),
            logits: next(),
            argmax_pairs: next(),
            sampled: next(),
            sample_params: next(),
            blas_input: next(),
            bytes: sizes.iter().map(|(_, b)| b).sum(),
        })
    }

    fn device_bytes(&self) -> usize {
        self.bytes
    }
}

/// What a step returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StepOutput {
    /// Logits of the selected rows, read back.
    Logits,
    /// Greedy ids of the selected rows (argmax on the device); only they are read back.
    Greedy,
    /// One draw per selected row (`sample_rows` on the device, under the step's
    /// [`SampleRow`]s: one more write); only the ids are read back.
    Sampled,
}

/// The result of a step: logits (when asked for) or the greedy ids of the selected rows.
#[derive(Clone, Debug)]
pub enum StepResult {
    Logits(Logits),
    Greedy(Vec<u32>),
    Sampled(Vec<u32>),
}

/// The model on one device. See the module documentation.
pub struct DeviceExecutor<D: Device> {
    dev: D,
    config: ModelConfig,
    heads: usize,
    weights: DeviceWeights<D>,
    layer_kernels: LayerKernels<D>,
    mla: MlaKernels<D>,
    moe: Option<MoeKernels<D>>,
    tactics: ExecutorTactics,
    caches: Vec<DeviceCache<D>>,
    pages: PageTables,
    kv_dtype: KvCacheDtype,
    workspace: Workspace<D>,
    rope_inv_freq: D::Memory,
    attention_factor: f32,
    softmax_scale: f32,
    eps: f32,
    router: Option<RouterShape>,
    /// Decode steps replay a captured graph per (batch size, output) when on.
    use_graphs: bool,
    graphs: std::collections::HashMap<(usize, StepOutput), D::Graph>,
    /// Cache tokens the current step's rows attend over (launch traffic accounting only).
    step_cached_tokens: usize,
    /// This rank's share of a tensor-parallel group; `None`: the whole model on one device.
    all_reduce: Option<Box<dyn TpAllReduce<D>>>,
}

impl<D: Device> DeviceExecutor<D> {
    /// Uploads `model`'s weights to `dev` (with a progress bar unless `quiet`), allocates a
    /// latent cache of `cache_tokens` tokens in `kv_dtype` and a workspace for `max_rows`
    /// tokens per step, and loads the kernels of `tactics`.
    pub fn new(
        dev: D,
        model: &Model,
        kv_dtype: KvCacheDtype,
        cache_tokens: usize,
        capacity: StepCapacity,
        tactics: ExecutorTactics,
        quiet: bool,
    ) -> Result<Self, ExecutorError> {
        check_supported(&model.config)?;
        // The tactics are refused before the weights are uploaded, not after.
        let kernels = StepKernels::load(&dev, &model.config, &tactics, kv_dtype)?;
        let weights = DeviceWeights::upload(&dev, model, tactics.moe, quiet)?;
        Self::assemble(
            dev,
            &model.config,
            weights,
            kernels,
            kv_dtype,
            cache_tokens,
            capacity,
            tactics,
        )
    }

    /// As [`new`](Self::new), with weights already on `dev` (made for `tactics.moe`'s scale
    /// layout): uploaded, or [`DeviceWeights::zeroed`] for a dry run.
    pub fn with_weights(
        dev: D,
        config: &ModelConfig,
        weights: DeviceWeights<D>,
        kv_dtype: KvCacheDtype,
        cache_tokens: usize,
        capacity: StepCapacity,
        tactics: ExecutorTactics,
    ) -> Result<Self, ExecutorError> {
        check_supported(config)?;
        let kernels = StepKernels::load(&dev, config, &tactics, kv_dtype)?;
        Self::assemble(
            dev,
            config,
            weights,
            kernels,
            kv_dtype,
            cache_tokens,
            capacity,
            tactics,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn assemble(
        dev: D,
        config: &ModelConfig,
        weights: DeviceWeights<D>,
        kernels: StepKernels<D>,
        kv_dtype: KvCacheDtype,
        cache_tokens: usize,
        capacity: StepCapacity,
        tactics: ExecutorTactics,
    ) -> Result<Self, ExecutorError> {
        let c = config.clone();
        let StepKernels {
            mla,
            moe,
            layers: layer_kernels,
        } = kernels;
        let heads = weights.heads;
        let pages = PageTables::new(cache_tokens.div_ceil(PAGE_TOKENS).max(1));
        let caches = (0..c.num_hidden_layers)
            .map(|_| DeviceCache::alloc(&dev, kv_dtype, c.mla_dims(), pages.total_slots()))
            .collect::<Result<Vec<_>, _>>()?;
        let workspace = Workspace::new(
            &dev,
            &c,
            WorkspaceShape {
                rows: capacity.tokens.max(1),
                heads,
                max_pages: max_pages(&c, pages.total_slots()),
                max_splits: mla.tactic.max_splits as usize,
                logit_rows: capacity.logit_rows,
                ranks: weights.shard.world.max(1),
                vendor_dense: tactics.dense == DenseTactic::CublasLt,
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
        Ok(Self {
            attention_factor: rope.attention_factor(),
            softmax_scale: c.softmax_scale(),
            eps: c.rms_norm_eps as f32,
            dev,
            heads,
            weights,
            layer_kernels,
            mla,
            moe,
            tactics,
            caches,
            pages,
            kv_dtype,
            workspace,
            rope_inv_freq,
            router,
            use_graphs: false,
            graphs: Default::default(),
            step_cached_tokens: 0,
            all_reduce: None,
            config: c,
        })
    }

    /// Makes this executor one rank of a tensor-parallel group: `model` (given to
    /// [`new`](Self::new)) must be this rank's shard, and every step sums over the group with
    /// `all_reduce`, where the CPU forward calls `all_reduce_sum`: the embedding rows (each
    /// rank holds its vocabulary rows), the partial products of attention and of the MLP or
    /// MoE, and the vocabulary-parallel head's results (the ranks' greedy picks, or their
    /// columns of the logits). Drops captured graphs (they lack the collectives).
    pub fn set_all_reduce(
        &mut self,
        all_reduce: Box<dyn TpAllReduce<D>>,
    ) -> Result<(), ExecutorError> {
        if all_reduce.world() != self.weights.shard.world {
            return Err(ExecutorError::Unsupported(format!(
                "an all-reduce over {} ranks for the weights of rank {} of {}",
                all_reduce.world(),
                self.weights.shard.rank,
                self.weights.shard.world
            )));
        }
        self.graphs.clear();
        self.all_reduce = Some(all_reduce);
        Ok(())
    }

    /// Decode steps (one new token per sequence) capture their launches once per batch size
    /// and output kind, and replay that graph afterwards (`false` drops the graphs).
    pub fn set_graphs(&mut self, on: bool) {
        self.use_graphs = on;
        if !on {
            self.graphs.clear();
        }
    }

    /// Graphs captured so far.
    pub fn graph_count(&self) -> usize {
        self.graphs.len()
    }

    pub fn device(&self) -> &D {
        &self.dev
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn weights(&self) -> &DeviceWeights<D> {
        &self.weights
    }

    pub fn tactics(&self) -> &ExecutorTactics {
        &self.tactics
    }

    pub fn kv_dtype(&self) -> KvCacheDtype {
        self.kv_dtype
    }

    pub fn add_sequence(&mut self) -> SeqId {
        self.pages.add_sequence()
    }

    pub fn free_sequence(&mut self, seq: SeqId) -> Result<(), ExecutorError> {
        self.pages
            .free_sequence(seq)
            .map_err(|e| ExecutorError::Forward(e.into()))
    }

    pub fn seq_len(&self, seq: SeqId) -> Result<usize, ExecutorError> {
        self.pages
            .seq_len(seq)
            .map_err(|e| ExecutorError::Forward(e.into()))
    }

    /// Device bytes held: weights, cache and workspace.
    pub fn device_bytes(&self) -> DeviceBytes {
        DeviceBytes {
            weights: self.weights.device_bytes(),
            cache: self.caches.iter().map(|c| c.device_bytes()).sum(),
            workspace: self.workspace.device_bytes(),
        }
    }

    /// Runs `inputs` through the model, appending their tokens to the cache: logits or greedy
    /// ids of `logit_rows` ([`StepOutput::Sampled`] needs the draws: see
    /// [`Self::step_sampled`]).
    pub fn step(
        &mut self,
        inputs: &[SeqInput<'_>],
        logit_rows: LogitRows,
        output: StepOutput,
    ) -> Result<StepResult, ExecutorError> {
        if output == StepOutput::Sampled {
            return Err(ForwardError::InvalidRequest(
                "a sampled step needs its draws (step_sampled)".into(),
            )
            .into());
        }
        self.run_step(inputs, logit_rows, output, &[])
    }

    /// Runs `inputs` and draws one token for the last row of each, under `draws[i]`, on the
    /// device; only the ids come back.
    pub fn step_sampled(
        &mut self,
        inputs: &[SeqInput<'_>],
        draws: &[SampleRow],
    ) -> Result<Vec<u32>, ExecutorError> {
        if draws.len() != inputs.len() {
            return Err(ForwardError::InvalidRequest(format!(
                "{} draws for {} sequences",
                draws.len(),
                inputs.len()
            ))
            .into());
        }
        match self.run_step(inputs, LogitRows::Last, StepOutput::Sampled, draws)? {
            StepResult::Sampled(ids) => Ok(ids),
            _ => unreachable!("a sampled step returns ids"),
        }
    }

    fn run_step(
        &mut self,
        inputs: &[SeqInput<'_>],
        logit_rows: LogitRows,
        output: StepOutput,
        draws: &[SampleRow],
    ) -> Result<StepResult, ExecutorError> {
        let c = &self.config;
        let mut rows: Vec<(SeqId, usize)> = Vec::new();
        for input in inputs {
            let start = self.pages.seq_len(input.seq).map_err(ForwardError::from)?;
            for (i, &token) in input.tokens.iter().enumerate() {
                if token as usize >= c.vocab_size {
                    return Err(ForwardError::TokenOutOfRange {
                        token,
                        vocab: c.vocab_size,
                    }
                    .into());
                }
                if start + i >= c.max_position_embeddings {
                    return Err(ForwardError::ContextTooLong {
                        pos: start + i,
                        max: c.max_position_embeddings,
                    }
                    .into());
                }
                rows.push((input.seq, start + i));
            }
        }
        let n = rows.len();
        if n == 0 {
            return Err(ForwardError::InvalidRequest("a step without tokens".into()).into());
        }
        if self.weights.shard.world > 1 && self.all_reduce.is_none() {
            return Err(ExecutorError::Unsupported(format!(
                "rank {} of {} holds a shard of the model: a step needs the group's all-reduce \
                 (set_all_reduce)",
                self.weights.shard.rank, self.weights.shard.world
            )));
        }
        for input in inputs {
            self.pages
                .reserve(input.seq, input.tokens.len())
                .map_err(ForwardError::from)?;
        }
        let selected: Vec<i32> = match logit_rows {
            LogitRows::All => (0..n as i32).collect(),
            LogitRows::Last => {
                let mut end = 0;
                inputs
                    .iter()
                    .map(|i| {
                        end += i.tokens.len();
                        end as i32 - 1
                    })
                    .collect()
            }
        };
        if n > self.workspace.rows || selected.len() > self.workspace.logit_capacity {
            // Graphs name the old buffers.
            self.graphs.clear();
            self.workspace = Workspace::new(
                &self.dev,
                &self.config,
                WorkspaceShape {
                    rows: n.max(self.workspace.rows),
                    heads: self.heads,
                    max_pages: self.workspace.max_pages,
                    max_splits: self.workspace.max_splits,
                    logit_rows: selected.len().max(self.workspace.logit_capacity),
                    ranks: self.weights.shard.world.max(1),
                    vendor_dense: self.tactics.dense == DenseTactic::CublasLt,
                },
            )?;
        }
        self.write_step_inputs(inputs, &rows, &selected, draws)?;
        self.step_cached_tokens = rows.iter().map(|&(_, pos)| pos + 1).sum();
        // A decode step's launches depend on its batch size alone (the split count is planned
        // for the cache's capacity, not the current lengths), so one graph serves every step
        // of that size.
        let decode = inputs.iter().all(|i| i.tokens.len() == 1);
        let context = if decode {
            self.pages.total_slots()
        } else {
            rows.iter().map(|&(_, pos)| pos + 1).max().unwrap_or(1)
        };
        let splits = if n > self.workspace.split_rows {
            1
        } else {
            self.mla.tactic.plan_splits(
                n,
                self.heads,
                context,
                self.dev.sm()?.reference_gpu().sms as usize,
            )
        };
        let every_row =
            selected.len() == n && selected.iter().enumerate().all(|(i, &s)| s == i as i32);
        if self.use_graphs && decode {
            let key = (n, output);
            if !self.graphs.contains_key(&key) {
                self.dev.begin_capture()?;
                let launched = self.launch_step(n, selected.len(), every_row, splits, output);
                let graph = self.dev.end_capture();
                launched?;
                self.graphs.insert(key, graph?);
            }
            self.dev.replay(&self.graphs[&key])?;
        } else {
            self.launch_step(n, selected.len(), every_row, splits, output)?;
        }
        let result = self.read_result(selected.len(), output)?;
        if let Some(all_reduce) = self.all_reduce.as_mut() {
            all_reduce.check(&self.dev)?;
        }
        for input in inputs {
            self.pages
                .commit(input.seq, input.tokens.len())
                .map_err(ForwardError::from)?;
        }
        Ok(result)
    }

    fn write_step_inputs(
        &mut self,
        inputs: &[SeqInput<'_>],
        rows: &[(SeqId, usize)],
        selected: &[i32],
        draws: &[SampleRow],
    ) -> Result<(), ExecutorError> {
        let ws = &mut self.workspace;
        let ids: Vec<i32> = inputs
            .iter()
            .flat_map(|i| i.tokens.iter().map(|&t| t as i32))
            .collect();
        let positions: Vec<i32> = rows.iter().map(|&(_, pos)| pos as i32).collect();
        let mut slots = Vec::with_capacity(rows.len());
        let mut table = vec![0i32; rows.len() * ws.max_pages];
        for (r, &(seq, pos)) in rows.iter().enumerate() {
            slots.push(self.pages.slot(seq, pos).map_err(ForwardError::from)? as i32);
            let pages = self.pages.block_table(seq).map_err(ForwardError::from)?;
            for (dst, &page) in table[r * ws.max_pages..].iter_mut().zip(pages) {
                *dst = page as i32;
            }
        }
        let seq_lens: Vec<i32> = positions.iter().map(|&p| p + 1).collect();
        let dev = &self.dev;
        dev.write(&mut ws.ids, &ids)?;
        dev.write(&mut ws.positions, &positions)?;
        dev.write(&mut ws.slots, &slots)?;
        dev.write(&mut ws.seq_lens, &seq_lens)?;
        dev.write(&mut ws.block_table, &table)?;
        dev.write(&mut ws.logit_rows, selected)?;
        if !draws.is_empty() {
            dev.write(&mut ws.sample_params, draws)?;
        }
        Ok(())
    }

    /// Every launch of a step: the layers, then the final norm, `lm_head` and (greedy) argmax.
    fn launch_step(
        &mut self,
        n: usize,
        selected: usize,
        every_row: bool,
        splits: u32,
        output: StepOutput,
    ) -> Result<(), ExecutorError> {
        self.run_layers(n, splits)?;
        self.launch_head(n, selected, every_row, output)
    }

    fn run_layers(&mut self, n: usize, splits: u32) -> Result<(), ExecutorError> {
        let c = &self.config;
        let (dev, k, ws, w) = (
            &self.dev,
            &self.layer_kernels,
            &mut self.workspace,
            &self.weights,
        );
        let mut all_reduce = self.all_reduce.as_deref_mut();
        let hidden = c.hidden_size;
        dev.fill(&mut ws.bad_id, 0xFF)?;
        k.embed_gather(
            dev,
            &ws.ids,
            n,
            &w.embed,
            w.vocab_rows.clone(),
            c.vocab_size,
            hidden,
            &ws.x,
            &ws.bad_id,
        )?;
        // Each rank holds its vocabulary's rows, zeros for the others: the sum is the row.
        if let Some(ar) = all_reduce.as_mut() {
            ar.sum_f32(dev, &ws.x, 0..n * hidden)?;
        }
        // A rank's attention and MLP outputs are partial sums over its heads and intermediate
        // columns: summed over the group before they join the residual.
        let mut sum_partials = |ws: &Workspace<D>| match all_reduce.as_mut() {
            Some(ar) => ar.sum_f32(dev, &ws.delta, 0..n * hidden),
            None => Ok(()),
        };
        for (layer, lw) in w.layers.iter().enumerate() {
            // The previous layer's MLP output joins the residual in this layer's first norm.
            let pending = (layer > 0).then_some(&ws.delta);
            k.add_rms_norm(
                dev,
                &ws.x,
                pending,
                &lw.input_norm,
                self.eps,
                n,
                hidden,
                &ws.h,
            )?;
            attention(
                AttentionCtx {
                    dev,
                    k,
                    mla: &self.mla,
                    c,
                    heads: self.heads,
                    eps: self.eps,
                    rope_inv_freq: &self.rope_inv_freq,
                    attention_factor: self.attention_factor,
                    softmax_scale: self.softmax_scale,
                    splits,
                    cached_tokens: self.step_cached_tokens,
                    dense: self.tactics.dense,
                },
                lw,
                &mut self.caches[layer],
                ws,
                n,
            )?;
            sum_partials(ws)?;
            k.add_rms_norm(
                dev,
                &ws.x,
                Some(&ws.delta),
                &lw.post_attention_norm,
                self.eps,
                n,
                hidden,
                &ws.h,
            )?;
            match &lw.mlp {
                DeviceMlp::Dense(d) => {
                    dense_mlp(dev, k, self.tactics.dense, d, n, hidden, ws, false)?;
                }
                DeviceMlp::Moe(m) => {
                    let router = self.router.as_ref().expect("MoE layers have a router");
                    let moe = self.moe.as_ref().expect("MoE layers have MoE kernels");
                    Products::new(k, self.tactics.dense, ws).product(
                        dev,
                        &ws.h,
                        n,
                        &m.router,
                        hidden,
                        router.experts,
                        &ws.router_logits,
                        false,
                    )?;
                    k.route(
                        dev,
                        router,
                        &ws.router_logits,
                        &m.correction_bias,
                        n,
                        &ws.route_ids,
                        &ws.route_weights,
                    )?;
                    k.group_by_expert(
                        dev,
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
                    k.to_bf16_strided(dev, &ws.h, n, hidden, 0, 0, 1, hidden, &ws.x_bf16)?;
                    dev.fill(&mut ws.delta, 0)?;
                    moe.run_device_grouped(
                        dev,
                        &m.experts,
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
                    if let Some(shared) = &m.shared {
                        dense_mlp(dev, k, self.tactics.dense, shared, n, hidden, ws, true)?;
                    }
                }
            }
            sum_partials(ws)?;
        }
        Ok(())
    }

    fn launch_head(
        &mut self,
        n: usize,
        r: usize,
        every_row: bool,
        output: StepOutput,
    ) -> Result<(), ExecutorError> {
        let c = &self.config;
        let (dev, k, ws, w) = (
            &self.dev,
            &self.layer_kernels,
            &mut self.workspace,
            &self.weights,
        );
        let hidden = c.hidden_size;
        k.add_rms_norm(
            dev,
            &ws.x,
            Some(&ws.delta),
            &w.norm,
            self.eps,
            n,
            hidden,
            &ws.h,
        )?;
        let final_rows = if every_row {
            &ws.h
        } else {
            k.gather_rows(dev, &ws.h, n, &ws.logit_rows, r, hidden, &ws.selected)?;
            &ws.selected
        };
        if let Some(ar) = self.all_reduce.as_deref_mut() {
            return vocabulary_parallel_head(
                VocabHead {
                    dev,
                    k,
                    dense: self.tactics.dense,
                    w,
                    rows: r,
                    hidden,
                    vocab: c.vocab_size,
                    every_row,
                },
                ar,
                ws,
                output,
            );
        }
        Products::new(k, self.tactics.dense, ws).product(
            dev,
            final_rows,
            r,
            &w.lm_head,
            hidden,
            c.vocab_size,
            &ws.logits,
            false,
        )?;
        match output {
            StepOutput::Logits => {}
            StepOutput::Greedy => k.argmax_rows(dev, &ws.logits, r, c.vocab_size, &ws.sampled)?,
            StepOutput::Sampled => k.sample_rows(
                dev,
                &ws.logits,
                r,
                c.vocab_size,
                &ws.sample_params,
                &ws.sampled,
            )?,
        }
        Ok(())
    }

    /// Reads a step's result back: the one transfer to the host.
    fn read_result(&self, r: usize, output: StepOutput) -> Result<StepResult, ExecutorError> {
        let (c, dev, ws) = (&self.config, &self.dev, &self.workspace);
        match output {
            StepOutput::Logits => {
                let values: Vec<f32> = dev.download_first(&ws.logits, r * c.vocab_size)?;
                if let Some(i) = values.iter().position(|v| !v.is_finite()) {
                    return Err(ForwardError::NonFinite {
                        place: "the final norm and lm_head (device)".into(),
                        row: i / c.vocab_size,
                        element: i % c.vocab_size,
                        value: values[i],
                    }
                    .into());
                }
                Ok(StepResult::Logits(Logits {
                    rows: r,
                    vocab: c.vocab_size,
                    values,
                }))
            }
            StepOutput::Greedy | StepOutput::Sampled => {
                let ids: Vec<u32> = dev
                    .download_first::<i32>(&ws.sampled, r)?
                    .iter()
                    .map(|&i| i as u32)
                    .collect();
                Ok(if output == StepOutput::Greedy {
                    StepResult::Greedy(ids)
                } else {
                    StepResult::Sampled(ids)
                })
            }
        }
    }
}

/// A step's dense BF16 products under its [`DenseTactic`]: our `dense_bf16`, or the vendor
/// library (cuBLASLt), whose input is the activations rounded to BF16 into `input` first.
struct Products<'a, D: Device> {
    k: &'a LayerKernels<D>,
    tactic: DenseTactic,
    input: &'a D::Memory,
}

impl<'a, D: Device> Products<'a, D> {
    fn new(k: &'a LayerKernels<D>, tactic: DenseTactic, ws: &'a Workspace<D>) -> Self {
        Self {
            k,
            tactic,
            input: &ws.blas_input,
        }
    }

    /// `y [tokens][n] (+)= x [tokens][k] · Wᵀ`, as [`LayerKernels::dense_bf16`].
    #[allow(clippy::too_many_arguments)]
    fn product(
        &self,
        dev: &D,
        x: &D::Memory,
        tokens: usize,
        w: &D::Memory,
        k: usize,
        n: usize,
        y: &D::Memory,
        accumulate: bool,
    ) -> Result<(), DeviceError> {
        let out = DenseOutput::packed(n);
        self.product_into(dev, x, tokens, w, k, n, y, out, accumulate)
    }

    /// As [`product`](Self::product), rows placed as `out` says.
    #[allow(clippy::too_many_arguments)]
    fn product_into(
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
    ) -> Result<(), DeviceError> {
        match self.tactic {
            DenseTactic::Ours => self
                .k
                .dense_bf16_into(dev, x, tokens, w, k, n, y, out, accumulate),
            DenseTactic::CublasLt => {
                let too_small = |what: &str, have: usize, need: usize| {
                    DeviceError::Invalid(format!(
                        "{}: {what} holds {have} B, the product needs {need} B",
                        kernels::blas::FAMILY
                    ))
                };
                let gemm = BlasGemm {
                    m: tokens,
                    n,
                    k,
                    a: w.device_ptr(),
                    b: self.input.device_ptr(),
                    d: y.device_ptr() + (out.offset * 4) as u64,
                    ldd: out.row_stride,
                    accumulate,
                };
                gemm.validate()?;
                for (what, memory, need) in [
                    ("w", w, n * k * 2),
                    ("the BF16 input", self.input, tokens * k * 2),
                    ("y", y, (out.offset + gemm.d_span()) * 4),
                ] {
                    if memory.len() < need {
                        return Err(too_small(what, memory.len(), need));
                    }
                }
                self.k
                    .to_bf16_strided(dev, x, tokens, k, 0, 0, 1, k, self.input)?;
                // SAFETY: every address is an allocation of `dev` checked above to hold what
                // the product reads and writes.
                unsafe { dev.blas_gemm(&gemm) }
            }
        }
    }
}

/// What the vocabulary-parallel head of a step works on.
struct VocabHead<'a, D: Device> {
    dev: &'a D,
    k: &'a LayerKernels<D>,
    dense: DenseTactic,
    w: &'a DeviceWeights<D>,
    /// Rows that get logits.
    rows: usize,
    hidden: usize,
    vocab: usize,
    /// The normed rows are `h` itself (every row gets logits), else `selected`.
    every_row: bool,
}

/// `lm_head` on a tensor-parallel rank, which holds the rows of its vocabulary ids
/// ([`DeviceWeights::vocab_rows`]), and the step's result from every rank's columns:
/// - greedy: each rank's best (value, id) into its slot of `argmax_pairs`, the slots summed
///   over the ranks (a gather: a value plus zeros is exact), the best slot the lower id on ties:
///   the id `argmax_rows` picks from whole rows, for 2 × ranks values moved per row;
/// - logits and sampling: each rank's columns into zeroed full-vocabulary rows, summed over
///   the ranks (a gather again, exact), so every rank holds the whole rows the single-device
///   step computes and `sample_rows` draws what it draws there. Sampling from a row split
///   over ranks and drawing the same token would need the key searches' counts and the
///   ordered sums across ranks at every step of the search, a collective per key bit.
fn vocabulary_parallel_head<D: Device>(
    v: VocabHead<'_, D>,
    ar: &mut dyn TpAllReduce<D>,
    ws: &mut Workspace<D>,
    output: StepOutput,
) -> Result<(), ExecutorError> {
    let VocabHead {
        dev,
        k,
        dense,
        w,
        rows,
        hidden,
        vocab,
        every_row,
    } = v;
    let (shard, ids) = (w.shard, w.vocab_rows.clone());
    if output == StepOutput::Greedy {
        let normed = if every_row { &ws.h } else { &ws.selected };
        let lm_head = Products::new(k, dense, ws);
        lm_head.product(
            dev,
            normed,
            rows,
            &w.lm_head,
            hidden,
            ids.len(),
            &ws.logits,
            false,
        )?;
        k.argmax_shard(
            dev,
            &ws.logits,
            rows,
            ids.len(),
            ids.len(),
            ids.start,
            shard.world,
            shard.rank,
            &ws.argmax_pairs,
        )?;
        ar.sum_f32(dev, &ws.argmax_pairs, 0..rows * shard.world * 2)?;
        k.argmax_ranks(dev, &ws.argmax_pairs, rows, shard.world, &ws.sampled)?;
        return Ok(());
    }
    dev.fill_prefix(&mut ws.logits, rows * vocab * 4, 0)?;
    let normed = if every_row { &ws.h } else { &ws.selected };
    let columns = DenseOutput {
        offset: ids.start,
        row_stride: vocab,
    };
    Products::new(k, dense, ws).product_into(
        dev,
        normed,
        rows,
        &w.lm_head,
        hidden,
        ids.len(),
        &ws.logits,
        columns,
        false,
    )?;
    // In slot-sized pieces (a prompt's logits outgrow the segment's slot), each a multiple of
    // the kernel's 4-value vectors.
    let piece = (ar.capacity_elements() / 4 * 4).max(4);
    let total = rows * vocab;
    for start in (0..total).step_by(piece) {
        ar.sum_f32(dev, &ws.logits, start..(start + piece).min(total))?;
    }
    if output == StepOutput::Sampled {
        k.sample_rows(dev, &ws.logits, rows, vocab, &ws.sample_params, &ws.sampled)?;
    }
    Ok(())
}

/// The kernels a step launches, loaded (and so checked against the device) for a tactic set.
struct StepKernels<D: Device> {
    mla: MlaKernels<D>,
    moe: Option<MoeKernels<D>>,
    layers: LayerKernels<D>,
}

impl<D: Device> StepKernels<D> {
    fn load(
        dev: &D,
        config: &ModelConfig,
        tactics: &ExecutorTactics,
        kv_dtype: KvCacheDtype,
    ) -> Result<Self, ExecutorError> {
        let mla = MlaKernels::load(dev, tactics.mla)?;
        if mla.tactic.dims != config.mla_dims() {
            return Err(ExecutorError::Unsupported(format!(
                "MLA tactic {} reads cache rows of {}, the model's are {}",
                mla.tactic.id(),
                mla.tactic.dims,
                config.mla_dims()
            )));
        }
        if mla.tactic.kind.is_fp8() != (kv_dtype == KvCacheDtype::Fp8E4m3) {
            return Err(ExecutorError::Unsupported(format!(
                "MLA tactic {} reads a {} cache, the executor's is {}",
                mla.tactic.id(),
                if mla.tactic.kind.is_fp8() {
                    "FP8"
                } else {
                    "BF16"
                },
                kv_dtype.id()
            )));
        }
        if tactics.dense == DenseTactic::CublasLt {
            dev.blas_ready()?;
        }
        Ok(Self {
            mla,
            moe: tactics.moe.map(|t| MoeKernels::load(dev, t)).transpose()?,
            layers: LayerKernels::load(dev)?,
        })
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
fn check_supported(c: &ModelConfig) -> Result<(), ExecutorError> {
    let dims = c.mla_dims();
    if !MlaDims::BUILT.contains(&dims) {
        let built: Vec<String> = MlaDims::BUILT
            .iter()
            .map(|d| format!("{}/{}", d.latent, d.rope))
            .collect();
        return Err(ExecutorError::Unsupported(format!(
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

struct AttentionCtx<'a, D: Device> {
    dev: &'a D,
    k: &'a LayerKernels<D>,
    mla: &'a MlaKernels<D>,
    c: &'a ModelConfig,
    heads: usize,
    eps: f32,
    rope_inv_freq: &'a D::Memory,
    attention_factor: f32,
    softmax_scale: f32,
    splits: u32,
    cached_tokens: usize,
    dense: DenseTactic,
}

/// One layer's attention, `ws.h` → `ws.delta`: the query and compressed-KV products, RoPE,
/// the cache append, the absorbed products around MLA decode, and `o_proj`.
fn attention<D: Device>(
    a: AttentionCtx<'_, D>,
    lw: &DeviceLayer<D>,
    cache: &mut DeviceCache<D>,
    ws: &Workspace<D>,
    n: usize,
) -> Result<(), ExecutorError> {
    let (dev, k, c, heads) = (a.dev, a.k, a.c, a.heads);
    let dense = Products::new(k, a.dense, ws);
    let (hidden, nope, v_dim) = (c.hidden_size, c.qk_nope_head_dim, c.v_head_dim);
    let (latent, rope) = (c.kv_lora_rank, c.qk_rope_head_dim);
    let qk = nope + rope;
    let at = &lw.attention;
    match &at.q_a {
        Some((q_a, q_a_norm, rank)) => {
            dense.product(dev, &ws.h, n, q_a, hidden, *rank, &ws.qa, false)?;
            k.add_rms_norm(dev, &ws.qa, None, q_a_norm, a.eps, n, *rank, &ws.qa_normed)?;
            dense.product(
                dev,
                &ws.qa_normed,
                n,
                &at.q_b,
                *rank,
                heads * qk,
                &ws.q,
                false,
            )?;
        }
        None => dense.product(dev, &ws.h, n, &at.q_b, hidden, heads * qk, &ws.q, false)?,
    }
    dense.product(
        dev,
        &ws.h,
        n,
        &at.kv_a_latent,
        hidden,
        latent,
        &ws.latent,
        false,
    )?;
    dense.product(
        dev,
        &ws.h,
        n,
        &at.kv_a_rope,
        hidden,
        rope,
        &ws.k_rope,
        false,
    )?;
    k.rope_interleaved(
        dev,
        &ws.k_rope,
        n,
        rope,
        RopeSlices {
            offset: 0,
            stride: rope,
            count: 1,
            pairs: rope / 2,
        },
        &ws.positions,
        a.rope_inv_freq,
        a.attention_factor,
    )?;
    a.mla.append_io(
        dev,
        cache,
        &ws.latent,
        &ws.k_rope,
        &at.kv_a_norm,
        a.eps,
        &ws.slots,
        n,
        0.0,
    )?;
    k.rope_interleaved(
        dev,
        &ws.q,
        n,
        heads * qk,
        RopeSlices {
            offset: nope,
            stride: qk,
            count: heads,
            pairs: rope / 2,
        },
        &ws.positions,
        a.rope_inv_freq,
        a.attention_factor,
    )?;
    // q_abs[t, h] = q_nope[t, h] · W_UK[h], with W_UK[h]ᵀ ([L, P]) as the product's matrix.
    k.dense_heads(
        dev,
        &ws.q,
        HeadRows {
            offset: 0,
            row_stride: heads * qk,
            head_stride: qk,
        },
        n,
        heads,
        &at.w_uk_t,
        0,
        latent * nope,
        nope,
        latent,
        &ws.q_abs,
        HeadRows {
            offset: 0,
            row_stride: heads * latent,
            head_stride: latent,
        },
        OutputType::Bf16,
    )?;
    k.to_bf16_strided(dev, &ws.q, n, heads * qk, nope, qk, heads, rope, &ws.q_pe)?;
    a.mla.decode_io(
        dev,
        cache,
        &DecodeIo {
            rows: n,
            heads,
            max_pages: ws.max_pages,
            max_splits: if n > ws.split_rows { 1 } else { ws.max_splits },
            q_abs: &ws.q_abs,
            q_pe: &ws.q_pe,
            block_table: &ws.block_table,
            seq_lens: &ws.seq_lens,
            out: &ws.o_latent,
            lse: &ws.lse,
            part_out: &ws.part_out,
            part_lse: &ws.part_lse,
            cached_tokens: a.cached_tokens,
        },
        a.splits,
        a.softmax_scale,
    )?;
    // o[t, h] = o_latent[t, h] · W_UV[h]ᵀ, W_UV[h] = kv_b's rows h·(P+V)+P .. (h+1)·(P+V).
    k.dense_heads(
        dev,
        &ws.o_latent,
        HeadRows {
            offset: 0,
            row_stride: heads * latent,
            head_stride: latent,
        },
        n,
        heads,
        &at.kv_b,
        nope * latent,
        (nope + v_dim) * latent,
        latent,
        v_dim,
        &ws.o,
        HeadRows {
            offset: 0,
            row_stride: heads * v_dim,
            head_stride: v_dim,
        },
        OutputType::F32,
    )?;
    dense.product(
        dev,
        &ws.o,
        n,
        &at.o,
        heads * v_dim,
        hidden,
        &ws.delta,
        false,
    )?;
    Ok(())
}

/// A BF16 SwiGLU MLP, `ws.h` → `ws.delta` (added to it when `accumulate`: the shared experts
/// after the routed ones).
#[allow(clippy::too_many_arguments)]
fn dense_mlp<D: Device>(
    dev: &D,
    k: &LayerKernels<D>,
    tactic: DenseTactic,
    w: &weights::DeviceDenseMlp<D>,
    n: usize,
    hidden: usize,
    ws: &Workspace<D>,
    accumulate: bool,
) -> Result<(), ExecutorError> {
    let dense = Products::new(k, tactic, ws);
    dense.product(
        dev,
        &ws.h,
        n,
        &w.gate_up,
        hidden,
        2 * w.inter,
        &ws.gate_up,
        false,
    )?;
    k.silu_mul(dev, &ws.gate_up, n, w.inter, &ws.act)?;
    dense.product(
        dev, &ws.act, n, &w.down, w.inter, hidden, &ws.delta, accumulate,
    )?;
    Ok(())
}

impl From<ExecutorError> for ForwardError {
    fn from(e: ExecutorError) -> Self {
        match e {
            ExecutorError::Forward(f) => f,
            other => ForwardError::Device(other.to_string()),
        }
    }
}

impl<D: Device> crate::exec::generate::Stepper for DeviceExecutor<D> {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn add_sequence(&mut self) -> SeqId {
        DeviceExecutor::add_sequence(self)
    }

    fn free_sequence(&mut self, seq: SeqId) -> Result<(), ForwardError> {
        Ok(DeviceExecutor::free_sequence(self, seq)?)
    }

    fn step_last(
        &mut self,
        inputs: &[SeqInput<'_>],
        draws: &[SampleRow],
    ) -> Result<Vec<u32>, ForwardError> {
        // Greedy steps need no draw parameters: one write fewer.
        if draws.iter().all(|d| d.temperature <= 0.0) {
            return match self.step(inputs, LogitRows::Last, StepOutput::Greedy)? {
                StepResult::Greedy(ids) => Ok(ids),
                _ => unreachable!("a greedy step returns ids"),
            };
        }
        Ok(self.step_sampled(inputs, draws)?)
    }
}
