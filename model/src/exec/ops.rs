//! The seam every backend serves: the operations of one forward step ([`StepOps`]).
//!
//! [`super::deepseek`] writes the model's step once, as a sequence of these operations over
//! named activations ([`Buf`]) and the backend's own weight handles ([`WeightKinds`]). A
//! backend holds one buffer per name, sized for the step, laid out as its operations agree
//! among themselves: the step names a buffer and never indexes one, so the CPU keeps FP32 rows
//! where a GPU keeps BF16 queries, and each fuses what its kernels fuse. Three backends serve
//! it: the CPU kernels ([`super::cpu::CpuOps`]), and the device executor on a GPU or on the host
//! execution layer ([`super::device::DeviceOps`]).
//!
//! A later hybrid placement (routed experts on the CPU, the rest on a GPU) is one more
//! implementation: a backend that holds both, moves `Normed` to the host before
//! [`StepOps::routed_experts`] and `Delta` back after it.

use std::ops::Range;

use kernels::mla::cache::{PageTables, SeqId};

use super::error::ExecError;
use super::sampler::SampleRow;
use crate::arch::names;

/// The activations a step passes between its operations. Shapes per row of the step (`rows`),
/// or per row that gets logits (`logit rows`); `heads` is this rank's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Buf {
    /// The residual stream `[rows, hidden]`.
    Residual,
    /// A norm's output `[rows, hidden]`: what a sublayer reads.
    Normed,
    /// A sublayer's output `[rows, hidden]` before it joins the residual (a rank's partial sum
    /// under tensor parallelism).
    Delta,
    /// `q_a_proj`'s output `[rows, q_lora_rank]`.
    QueryLatent,
    /// Its RMSNorm.
    QueryLatentNormed,
    /// The queries `[rows, heads, nope + rope]`.
    Query,
    /// The new tokens' compressed KV latent `[rows, kv_lora_rank]`, before its norm.
    KvLatent,
    /// The new tokens' shared RoPE key `[rows, rope]`.
    KeyRope,
    /// The queries absorbed into latent space, `q_nope · W_UK`: `[rows, heads, kv_lora_rank]`.
    AbsorbedQuery,
    /// The queries' RoPE parts `[rows, heads, rope]`.
    QueryRope,
    /// Attention's output in latent space `[rows, heads, kv_lora_rank]`.
    AttentionLatent,
    /// Back out of latent space, `· W_UVᵀ`: `[rows, heads, v_head_dim]`.
    AttentionOut,
    /// An MLP's gate and up products `[rows, 2 · inter]`.
    GateUp,
    /// `silu(gate) · up` `[rows, inter]`.
    Activated,
    /// `[rows, n_routed_experts]`.
    RouterLogits,
    /// The final norm's rows that get logits `[logit rows, hidden]`.
    Selected,
    /// `[logit rows, vocab]`, or a vocabulary-parallel rank's `[logit rows, its ids]` before a
    /// greedy pick.
    Logits,
    /// Per logit row and rank, the rank's best (value, id) of its vocabulary ids.
    ArgmaxPairs,
}

impl Buf {
    pub const COUNT: usize = Buf::ArgmaxPairs as usize + 1;
}

/// The sublayer whose output was last added into the residual stream: where a backend that
/// checks the stream for NaN or Inf says the fault arose.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sublayer {
    Embedding,
    Attention(usize),
    Mlp(usize),
}

impl std::fmt::Display for Sublayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Embedding => f.write_str(names::EMBED_TOKENS),
            Self::Attention(layer) => write!(f, "layer {layer} ({})", names::SELF_ATTN),
            Self::Mlp(layer) => write!(f, "layer {layer} ({})", names::MLP),
        }
    }
}

/// What a step returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StepOutput {
    /// Logits of the selected rows.
    Logits,
    /// Greedy ids of the selected rows.
    Greedy,
    /// One draw per selected row, under the step's [`SampleRow`]s.
    Sampled,
}

/// The result of a step.
#[derive(Clone, Debug)]
pub enum StepResult {
    Logits(Logits),
    /// One id per selected row (greedy or sampled).
    Ids(Vec<u32>),
}

/// Which rows get logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitRows {
    /// The last token of every input (decoding).
    Last,
    /// Every token (scoring a prompt).
    All,
}

/// Logits `[rows, vocab]`.
#[derive(Clone, Debug)]
pub struct Logits {
    pub rows: usize,
    pub vocab: usize,
    pub values: Vec<f32>,
}

impl Logits {
    pub fn row(&self, row: usize) -> &[f32] {
        &self.values[row * self.vocab..(row + 1) * self.vocab]
    }
}

/// What a step runs on: its rows (each a sequence's token at a position), the rows that get
/// logits and how they are turned into the result.
#[derive(Clone, Debug)]
pub struct StepRows<'a> {
    /// Token id of every row, in order.
    pub ids: &'a [u32],
    /// The sequence and position of every row.
    pub rows: &'a [(SeqId, usize)],
    /// Rows that get logits, in order.
    pub selected: &'a [usize],
    /// One per selected row when sampling.
    pub draws: &'a [SampleRow],
    pub output: StepOutput,
    /// Every input is one new token (a decode step): its launches depend on the row count
    /// alone, so a backend may replay a captured graph.
    pub decode: bool,
}

/// What a weight handle tells the op profile ([`super::profile`]): a label of its kind and
/// shape, and the bytes a pass over it reads.
pub trait Measured {
    fn label(&self) -> String;
    fn bytes(&self) -> u64;
    /// Matrices it holds (a layer's routed experts: one per expert).
    fn count(&self) -> usize {
        1
    }
}

/// The weight handles of a backend: how it holds each kind of tensor the step reads.
pub trait WeightKinds {
    /// A BF16 matrix `[rows, cols]` (the step computes `x · Wᵀ`); possibly several stacked, as
    /// gate over up.
    type Matrix: Send + Sync + Measured;
    /// Per-head matrices of the absorbed attention (W_UKᵀ and W_UV of every head).
    type Heads: Send + Sync + Measured;
    /// A vector: a norm's weight, the router's correction bias.
    type Vector: Send + Sync;
    /// A layer's routed experts.
    type Experts: Send + Sync + Measured;
}

/// The operations of a forward step. See the module documentation; [`super::deepseek`] says in
/// which order they run, and each backend what they compute where.
pub trait StepOps {
    type Kinds: WeightKinds;

    /// For messages: the backend and its device.
    fn describe(&self) -> String;

    /// The latent cache's page bookkeeping (the storage is the backend's).
    fn pages(&self) -> &PageTables;
    fn pages_mut(&mut self) -> &mut PageTables;

    /// Takes a step's rows: their ids, positions, cache slots and block tables, the rows that
    /// get logits and their draws (on a device: the host's writes of the step).
    fn begin_step(&mut self, step: &StepRows<'_>) -> Result<(), ExecError>;

    /// Runs `body` as one step (the CPU: on its thread pool, with fewer threads while other
    /// processes keep the cores busy).
    fn run_step(
        &mut self,
        body: &mut (dyn FnMut(&mut Self) -> Result<(), ExecError> + Send),
    ) -> Result<(), ExecError>;

    /// Replays the graph captured for decode steps of `key`, if the backend captured one.
    fn replay(&mut self, key: GraphKey) -> Result<bool, ExecError>;
    /// Starts recording a decode step's operations into a graph for `key` instead of running
    /// them; `false` where the backend does not capture.
    fn begin_capture(&mut self, key: GraphKey) -> Result<bool, ExecError>;
    /// Ends the recording started by [`begin_capture`](Self::begin_capture); the graph is
    /// then replayed.
    fn end_capture(&mut self, key: GraphKey) -> Result<(), ExecError>;

    /// `out` = rows `ids` of the embedding, whose rows `vocab_rows` `table` holds (zero rows
    /// for the ids of other ranks).
    fn embed(
        &mut self,
        table: &<Self::Kinds as WeightKinds>::Matrix,
        vocab_rows: Range<usize>,
        out: Buf,
    ) -> Result<(), ExecError>;
    /// `residual += delta` (when given), then `out = RMSNorm(residual) · weight`. `added` names
    /// what the residual last received.
    fn add_rms_norm(
        &mut self,
        residual: Buf,
        delta: Option<Buf>,
        weight: &<Self::Kinds as WeightKinds>::Vector,
        out: Buf,
        added: Sublayer,
    ) -> Result<(), ExecError>;
    /// `out = RMSNorm(x) · weight`.
    fn rms_norm(
        &mut self,
        x: Buf,
        weight: &<Self::Kinds as WeightKinds>::Vector,
        out: Buf,
    ) -> Result<(), ExecError>;
    /// `out_i = x · W_iᵀ` for every pair: products that read the same input (one call where the
    /// backend can).
    fn products(
        &mut self,
        x: Buf,
        outs: &[(&<Self::Kinds as WeightKinds>::Matrix, Buf)],
    ) -> Result<(), ExecError>;
    /// `out += x · Wᵀ`.
    fn product_add(
        &mut self,
        x: Buf,
        w: &<Self::Kinds as WeightKinds>::Matrix,
        out: Buf,
    ) -> Result<(), ExecError>;
    /// Rotates the positional part of `buf` by each row's position: every head's RoPE part of
    /// [`Buf::Query`], or the whole of [`Buf::KeyRope`].
    fn rope(&mut self, buf: Buf) -> Result<(), ExecError>;
    /// Writes the step's rows into `layer` of the latent cache: `RMSNorm(latent) · norm` and
    /// the rotated key.
    fn append_cache(
        &mut self,
        layer: usize,
        latent: Buf,
        key_rope: Buf,
        norm: &<Self::Kinds as WeightKinds>::Vector,
    ) -> Result<(), ExecError>;
    /// From [`Buf::Query`]: `absorbed[t, h] = q_nope[t, h] · W_UK[h]` (the product with every
    /// head's W_UKᵀ) and `rope[t, h] = q_pe[t, h]`.
    fn absorb_query(
        &mut self,
        query: Buf,
        w_uk_t: &<Self::Kinds as WeightKinds>::Heads,
        absorbed: Buf,
        rope: Buf,
    ) -> Result<(), ExecError>;
    /// Absorbed MLA attention of every row over `layer`'s cache (its sequence's tokens up to
    /// and including its own position).
    fn attention(
        &mut self,
        layer: usize,
        absorbed: Buf,
        rope: Buf,
        out: Buf,
    ) -> Result<(), ExecError>;
    /// `out[t, h] = latent[t, h] · W_UV[h]ᵀ`.
    fn unabsorb(
        &mut self,
        latent: Buf,
        w_uv: &<Self::Kinds as WeightKinds>::Heads,
        out: Buf,
    ) -> Result<(), ExecError>;
    /// `out = silu(gate) · up` of an MLP's [`Buf::GateUp`].
    fn silu_mul(&mut self, gate_up: Buf, out: Buf) -> Result<(), ExecError>;
    /// `noaux_tc` routing of `layer` from the router's logits (the bias chooses, the unbiased
    /// scores weigh), kept for [`routed_experts`](Self::routed_experts).
    fn route(
        &mut self,
        layer: usize,
        logits: Buf,
        bias: &<Self::Kinds as WeightKinds>::Vector,
    ) -> Result<(), ExecError>;
    /// `out = Σ_k weight[t, k] · expert[t, k](x[t])` under the routing of
    /// [`route`](Self::route) (out is overwritten).
    fn routed_experts(
        &mut self,
        layer: usize,
        x: Buf,
        experts: &<Self::Kinds as WeightKinds>::Experts,
        out: Buf,
    ) -> Result<(), ExecError>;
    /// Distinct experts the last [`route`](Self::route) chose, where the host knows them (the
    /// profile's byte counts).
    fn routed_experts_used(&self) -> Option<usize> {
        None
    }
    /// Sums `buf` over the tensor-parallel ranks, in place (identical bits on every rank).
    fn all_reduce(&mut self, buf: Buf) -> Result<(), ExecError>;
    /// `out` = the rows of `x` that get logits.
    fn select_rows(&mut self, x: Buf, out: Buf) -> Result<(), ExecError>;
    /// `out` = full-vocabulary rows, zero but for the columns `vocab_rows` = `x · lm_headᵀ`
    /// (a vocabulary-parallel rank's part, gathered by an all-reduce).
    fn vocab_columns(
        &mut self,
        x: Buf,
        lm_head: &<Self::Kinds as WeightKinds>::Matrix,
        vocab_rows: Range<usize>,
        out: Buf,
    ) -> Result<(), ExecError>;
    /// A vocabulary-parallel rank's greedy pick: each row's best (value, id) of `logits` (the
    /// rank's ids `vocab_rows`, packed) into its slot of `pairs`, the other slots zero.
    fn argmax_shard(
        &mut self,
        logits: Buf,
        vocab_rows: Range<usize>,
        rank: usize,
        ranks: usize,
        pairs: Buf,
    ) -> Result<(), ExecError>;
    /// The step's ids: the best of each row's gathered pairs, the lower id on ties.
    fn argmax_ranks(&mut self, pairs: Buf, ranks: usize) -> Result<(), ExecError>;
    /// The step's ids: the first index of each row's largest logit.
    fn argmax(&mut self, logits: Buf) -> Result<(), ExecError>;
    /// The step's ids: one draw per row under the step's draws.
    fn sample(&mut self, logits: Buf) -> Result<(), ExecError>;
    /// The step's result, read back (on a device: the step's one transfer to the host).
    fn finish_step(&mut self) -> Result<StepResult, ExecError>;
}

/// Decode steps of one shape: their launches depend on the row count and the output alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GraphKey {
    pub rows: usize,
    pub output: StepOutput,
}

/// One sequence's new tokens in a step.
#[derive(Clone, Copy, Debug)]
pub struct SeqInput<'a> {
    pub seq: SeqId,
    pub tokens: &'a [u32],
}
