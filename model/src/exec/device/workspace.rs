//! The device step's workspace: every buffer a step reads and writes besides the weights and
//! the cache, allocated once for a number of rows and kept at fixed addresses from step to
//! step (a captured graph names them), grown when a step needs more.

use kernels::device::{Device, DeviceError};
use kernels::layers::sampling::SAMPLE_ROW_BYTES;
use kernels::mla::cache::PAGE_TOKENS;

use super::support::device_expert_inter;
use crate::arch::config::ModelConfig;

/// Everything a step may need, allocated for `rows` tokens (grown when a step needs more).
pub struct Workspace<D: Device> {
    pub rows: usize,
    /// Block-table columns each row has room for (the longest sequence the cache can hold).
    pub max_pages: usize,
    pub max_splits: usize,
    /// Rows the split workspace holds (larger steps run MLA unsplit).
    pub split_rows: usize,
    /// Rows of logits the workspace holds.
    pub logit_capacity: usize,
    pub bytes: usize,
    pub ids: D::Memory,
    pub positions: D::Memory,
    pub slots: D::Memory,
    pub seq_lens: D::Memory,
    pub block_table: D::Memory,
    pub logit_rows: D::Memory,
    pub bad_id: D::Memory,
    pub x: D::Memory,
    pub h: D::Memory,
    pub delta: D::Memory,
    pub qa: D::Memory,
    pub qa_normed: D::Memory,
    pub q: D::Memory,
    pub latent: D::Memory,
    pub k_rope: D::Memory,
    pub q_abs: D::Memory,
    pub q_pe: D::Memory,
    pub o_latent: D::Memory,
    pub lse: D::Memory,
    pub part_out: D::Memory,
    pub part_lse: D::Memory,
    pub o: D::Memory,
    pub gate_up: D::Memory,
    pub act: D::Memory,
    pub router_logits: D::Memory,
    pub route_ids: D::Memory,
    pub route_weights: D::Memory,
    pub expert_offsets: D::Memory,
    pub active_experts: D::Memory,
    pub sorted_token_ids: D::Memory,
    pub sorted_weights: D::Memory,
    pub x_bf16: D::Memory,
    pub h_q: D::Memory,
    pub h_sf: D::Memory,
    pub selected: D::Memory,
    pub logits: D::Memory,
    pub argmax_pairs: D::Memory,
    pub sampled: D::Memory,
    pub sample_params: D::Memory,
    pub blas_input: D::Memory,
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
    pub fn new(dev: &D, c: &ModelConfig, shape: WorkspaceShape) -> Result<Self, DeviceError> {
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

    pub fn device_bytes(&self) -> usize {
        self.bytes
    }
}
