//! The model's weights, borrowed from memory-mapped checkpoint shards (or owned, for
//! generated models), in the shapes the forward pass uses.

use std::ops::Range;
use std::sync::Arc;

use half::bf16;
use kernels::formats::nvfp4::Nvfp4View;
use kernels::matrix::MatrixView;
use kernels::moe_gemm::reference::ExpertView;

use crate::arch::config::ModelConfig;
use crate::checkpoint::tensor_file::TensorFile;

pub use crate::arch::shard::TpShard;

/// BF16 values, either straight from a mapped shard or owned.
#[derive(Clone, Debug)]
pub enum Bf16Data {
    Mapped {
        file: Arc<TensorFile>,
        range: Range<usize>,
    },
    Owned(Arc<Vec<bf16>>),
    /// Bytes `range` of a mapping made by [`derived_on_huge_pages`].
    Derived {
        memory: Arc<memmap2::Mmap>,
        range: Range<usize>,
    },
}

impl Bf16Data {
    #[inline]
    pub fn as_slice(&self) -> &[bf16] {
        match self {
            // Alignment was checked when the weight was created.
            Self::Mapped { file, range } => bytemuck::cast_slice(file.mapped(range.clone())),
            Self::Owned(values) => values,
            // A page-aligned mapping and whole values.
            Self::Derived { memory, range } => bytemuck::cast_slice(&memory[range.clone()]),
        }
    }
}

/// Weights the model derives from the checkpoint at load (the absorbed attention's transposed
/// W_UK), in one anonymous mapping on 2 MiB pages where the kernel gives them: read once per
/// decode step like the checkpoint's own weights, and on 4 KiB pages each page is a TLB miss
/// (on a 2-vCPU KVM guest the per-head W_UK products read a heap copy at 15 GB/s where the
/// products on huge pages ran at 22–27; measured with `model run --profile-ops`).
/// `fill` writes the `values` values; returns `None` if no memory could be mapped.
pub fn derived_on_huge_pages(
    values: usize,
    fill: impl FnOnce(&mut [bf16]),
) -> Option<Arc<memmap2::Mmap>> {
    let mut map = crate::checkpoint::tensor_file::huge_page_memory(values * 2).ok()?;
    // SAFETY: an anonymous mapping is page-aligned and at least `values * 2` bytes long.
    let all: &mut [bf16] =
        unsafe { std::slice::from_raw_parts_mut(map.as_mut_ptr().cast::<bf16>(), values) };
    fill(all);
    map.make_read_only().ok().map(Arc::new)
}

/// A row-major BF16 matrix `[rows, cols]`.
#[derive(Clone, Debug)]
pub struct Bf16Weight {
    pub rows: usize,
    pub cols: usize,
    pub data: Bf16Data,
}

impl Bf16Weight {
    pub fn owned(rows: usize, cols: usize, values: Vec<bf16>) -> Self {
        assert_eq!(values.len(), rows * cols);
        Self {
            rows,
            cols,
            data: Bf16Data::Owned(Arc::new(values)),
        }
    }

    pub fn view(&self) -> MatrixView<'_> {
        MatrixView::Bf16 {
            rows: self.rows,
            cols: self.cols,
            data: self.data.as_slice(),
        }
    }

    /// Row `row` as a BF16 slice.
    #[inline]
    pub fn row(&self, row: usize) -> &[bf16] {
        &self.data.as_slice()[row * self.cols..(row + 1) * self.cols]
    }
}

/// NVFP4 bytes, mapped or owned.
#[derive(Clone, Debug)]
pub enum ByteData {
    Mapped {
        file: Arc<TensorFile>,
        range: Range<usize>,
    },
    Owned(Arc<Vec<u8>>),
}

impl ByteData {
    #[inline]
    pub fn as_slice(&self) -> &[u8] {
        match self {
            Self::Mapped { file, range } => file.mapped(range.clone()),
            Self::Owned(values) => values,
        }
    }
}

/// An NVFP4 linear layer in the ModelOpt layout, with its activation `input_scale`.
#[derive(Clone, Debug)]
pub struct Nvfp4Weight {
    pub rows: usize,
    pub cols: usize,
    pub packed: ByteData,
    pub block_scales: ByteData,
    pub global_scale: f32,
    pub input_scale: f32,
}

impl Nvfp4Weight {
    pub fn view(&self) -> Nvfp4View<'_> {
        Nvfp4View {
            rows: self.rows,
            cols: self.cols,
            packed: self.packed.as_slice(),
            block_scales: self.block_scales.as_slice(),
            global_scale: self.global_scale,
        }
    }
}

/// A routed expert's projection: NVFP4 in the shipped checkpoint, BF16 in the original one.
#[derive(Clone, Debug)]
pub enum ExpertMatrix {
    Bf16(Bf16Weight),
    Nvfp4(Nvfp4Weight),
}

impl ExpertMatrix {
    pub fn view(&self) -> MatrixView<'_> {
        match self {
            Self::Bf16(w) => w.view(),
            Self::Nvfp4(w) => MatrixView::Nvfp4(w.view()),
        }
    }

    pub fn input_scale(&self) -> Option<f32> {
        match self {
            Self::Bf16(_) => None,
            Self::Nvfp4(w) => Some(w.input_scale),
        }
    }
}

#[derive(Clone, Debug)]
pub struct ExpertWeights {
    pub gate: ExpertMatrix,
    pub up: ExpertMatrix,
    pub down: ExpertMatrix,
}

impl ExpertWeights {
    pub fn view(&self) -> ExpertView<'_> {
        // The fused gate/up GEMM quantizes its input once; ModelOpt exports one input_scale
        // for the pair, and where two differ the larger one keeps both in range.
        let gate_up_input_scale = match (self.gate.input_scale(), self.up.input_scale()) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
        ExpertView {
            gate: self.gate.view(),
            up: self.up.view(),
            down: self.down.view(),
            gate_up_input_scale,
            down_input_scale: self.down.input_scale(),
        }
    }
}

#[derive(Clone, Debug)]
pub enum QueryProjection {
    /// `q_a_proj` → RMSNorm → `q_b_proj`.
    LowRank {
        a: Bf16Weight,
        norm: Vec<f32>,
        b: Bf16Weight,
    },
    /// A plain `q_proj`.
    Full(Bf16Weight),
}

#[derive(Clone, Debug)]
pub struct AttentionWeights {
    pub q: QueryProjection,
    /// `kv_a_proj_with_mqa`: `[kv_lora_rank + rope, hidden]`.
    pub kv_a: Bf16Weight,
    pub kv_a_norm: Vec<f32>,
    /// `kv_b_proj`: `[heads · (nope + v), kv_lora_rank]`; rows `h·(P+V) .. h·(P+V)+P` are
    /// `W_UK` of head `h`, the next `V` rows its `W_UV`.
    pub kv_b: Bf16Weight,
    pub o: Bf16Weight,
}

#[derive(Clone, Debug)]
pub struct DenseMlpWeights {
    pub gate: Bf16Weight,
    pub up: Bf16Weight,
    pub down: Bf16Weight,
}

#[derive(Clone, Debug)]
pub struct MoeWeights {
    /// `mlp.gate.weight`: `[experts, hidden]`.
    pub router: Bf16Weight,
    /// `e_score_correction_bias`: added to the scores for selection only.
    pub correction_bias: Vec<f32>,
    pub experts: Vec<ExpertWeights>,
    pub shared: Option<DenseMlpWeights>,
}

#[derive(Clone, Debug)]
pub enum MlpWeights {
    Dense(DenseMlpWeights),
    Moe(MoeWeights),
}

#[derive(Clone, Debug)]
pub struct LayerWeights {
    pub input_norm: Vec<f32>,
    pub attention: AttentionWeights,
    pub post_attention_norm: Vec<f32>,
    pub mlp: MlpWeights,
}

#[derive(Clone, Debug)]
pub struct ModelWeights {
    /// The embedding's rows `vocab_rows` (all of them unless this is a tensor-parallel shard).
    pub embed: Bf16Weight,
    pub layers: Vec<LayerWeights>,
    pub norm: Vec<f32>,
    /// `lm_head`'s rows `vocab_rows`.
    pub lm_head: Bf16Weight,
    /// The vocabulary ids whose rows of `embed` and `lm_head` these weights hold:
    /// `0..vocab_size`, or a rank's [`TpShard::vocab_rows`].
    pub vocab_rows: Range<usize>,
}

impl Bf16Weight {
    /// Rows `start..end`, still borrowed from the mapping where it was.
    pub fn rows_slice(&self, start: usize, end: usize) -> Self {
        let data = match &self.data {
            Bf16Data::Mapped { file, range } => Bf16Data::Mapped {
                file: file.clone(),
                range: range.start + start * self.cols * 2..range.start + end * self.cols * 2,
            },
            Bf16Data::Owned(values) => Bf16Data::Owned(Arc::new(
                values[start * self.cols..end * self.cols].to_vec(),
            )),
            Bf16Data::Derived { memory, range } => Bf16Data::Derived {
                memory: memory.clone(),
                range: range.start + start * self.cols * 2..range.start + end * self.cols * 2,
            },
        };
        Self {
            rows: end - start,
            cols: self.cols,
            data,
        }
    }

    /// Columns `start..end` (a copy: the columns are not contiguous).
    pub fn cols_slice(&self, start: usize, end: usize) -> Self {
        let values = self.data.as_slice();
        let sliced = (0..self.rows)
            .flat_map(|r| {
                values[r * self.cols + start..r * self.cols + end]
                    .iter()
                    .copied()
            })
            .collect();
        Self::owned(self.rows, end - start, sliced)
    }
}

impl ByteData {
    fn sub(&self, range: Range<usize>) -> Self {
        match self {
            Self::Mapped { file, range: whole } => Self::Mapped {
                file: file.clone(),
                range: whole.start + range.start..whole.start + range.end,
            },
            Self::Owned(bytes) => Self::Owned(Arc::new(bytes[range].to_vec())),
        }
    }
}

impl Nvfp4Weight {
    /// Rows `start..end`.
    pub fn rows_slice(&self, start: usize, end: usize) -> Self {
        let (packed_row, scale_row) = (self.cols / 2, self.cols / kernels::formats::NVFP4_BLOCK);
        Self {
            rows: end - start,
            packed: self.packed.sub(start * packed_row..end * packed_row),
            block_scales: self.block_scales.sub(start * scale_row..end * scale_row),
            ..self.clone()
        }
    }

    /// Columns `start..end`, both multiples of the 16-element block (a copy).
    pub fn cols_slice(&self, start: usize, end: usize) -> Self {
        let block = kernels::formats::NVFP4_BLOCK;
        assert!(
            start.is_multiple_of(block) && end.is_multiple_of(block),
            "NVFP4 column slice {start}..{end} is not block aligned"
        );
        let (packed, scales) = (self.packed.as_slice(), self.block_scales.as_slice());
        let (packed_row, scale_row) = (self.cols / 2, self.cols / block);
        let mut new_packed = Vec::with_capacity(self.rows * (end - start) / 2);
        let mut new_scales = Vec::with_capacity(self.rows * (end - start) / block);
        for r in 0..self.rows {
            new_packed
                .extend_from_slice(&packed[r * packed_row + start / 2..r * packed_row + end / 2]);
            new_scales.extend_from_slice(
                &scales[r * scale_row + start / block..r * scale_row + end / block],
            );
        }
        Self {
            cols: end - start,
            packed: ByteData::Owned(Arc::new(new_packed)),
            block_scales: ByteData::Owned(Arc::new(new_scales)),
            ..self.clone()
        }
    }
}

impl ExpertMatrix {
    pub fn rows_slice(&self, start: usize, end: usize) -> Self {
        match self {
            Self::Bf16(w) => Self::Bf16(w.rows_slice(start, end)),
            Self::Nvfp4(w) => Self::Nvfp4(w.rows_slice(start, end)),
        }
    }

    pub fn cols_slice(&self, start: usize, end: usize) -> Self {
        match self {
            Self::Bf16(w) => Self::Bf16(w.cols_slice(start, end)),
            Self::Nvfp4(w) => Self::Nvfp4(w.cols_slice(start, end)),
        }
    }
}

impl DenseMlpWeights {
    /// The intermediate rows `start..end`: gate/up rows, down columns.
    fn shard(&self, start: usize, end: usize) -> Self {
        Self {
            gate: self.gate.rows_slice(start, end),
            up: self.up.rows_slice(start, end),
            down: self.down.cols_slice(start, end),
        }
    }
}

impl ModelWeights {
    /// This rank's shard: attention heads and every MLP's intermediate dimension split across
    /// ranks (outputs become partial sums for the all-reduce), the embedding's and `lm_head`'s
    /// rows split by vocabulary ([`TpShard::vocab_rows`]: an embedding row outside the shard
    /// is zeros to the all-reduce, and each rank scores its own ids); norms, the router and
    /// the latent projections (`q_a`, `kv_a`) replicated.
    pub fn shard(&self, config: &ModelConfig, shard: TpShard) -> Result<Self, String> {
        if shard.world == 1 {
            return Ok(self.clone());
        }
        config.check_tensor_parallel(shard.world)?;
        let (h0, h1) = shard.range(config.num_attention_heads);
        let (qk, kv_rows, v) = (
            config.qk_head_dim(),
            config.qk_nope_head_dim + config.v_head_dim,
            config.v_head_dim,
        );
        let layers = self
            .layers
            .iter()
            .map(|layer| {
                let a = &layer.attention;
                let q = match &a.q {
                    QueryProjection::LowRank { a: qa, norm, b } => QueryProjection::LowRank {
                        a: qa.clone(),
                        norm: norm.clone(),
                        b: b.rows_slice(h0 * qk, h1 * qk),
                    },
                    QueryProjection::Full(wq) => {
                        QueryProjection::Full(wq.rows_slice(h0 * qk, h1 * qk))
                    }
                };
                let attention = AttentionWeights {
                    q,
                    kv_a: a.kv_a.clone(),
                    kv_a_norm: a.kv_a_norm.clone(),
                    kv_b: a.kv_b.rows_slice(h0 * kv_rows, h1 * kv_rows),
                    o: a.o.cols_slice(h0 * v, h1 * v),
                };
                let mlp = match &layer.mlp {
                    MlpWeights::Dense(d) => {
                        let (s, e) = shard.range(d.gate.rows);
                        MlpWeights::Dense(d.shard(s, e))
                    }
                    MlpWeights::Moe(m) => {
                        let (s, e) = shard.range(config.moe_intermediate_size);
                        let experts = m
                            .experts
                            .iter()
                            .map(|x| ExpertWeights {
                                gate: x.gate.rows_slice(s, e),
                                up: x.up.rows_slice(s, e),
                                down: x.down.cols_slice(s, e),
                            })
                            .collect();
                        let shared = match &m.shared {
                            Some(d) => {
                                let (s, e) = shard.range(d.gate.rows);
                                Some(d.shard(s, e))
                            }
                            None => None,
                        };
                        MlpWeights::Moe(MoeWeights {
                            router: m.router.clone(),
                            correction_bias: m.correction_bias.clone(),
                            experts,
                            shared,
                        })
                    }
                };
                LayerWeights {
                    input_norm: layer.input_norm.clone(),
                    attention,
                    post_attention_norm: layer.post_attention_norm.clone(),
                    mlp,
                }
            })
            .collect();
        if self.vocab_rows != (0..config.vocab_size) {
            return Err(format!(
                "sharding weights that already hold only vocabulary rows {:?}",
                self.vocab_rows
            ));
        }
        let vocab_rows = shard.vocab_rows(config.vocab_size);
        Ok(Self {
            embed: self.embed.rows_slice(vocab_rows.start, vocab_rows.end),
            layers,
            norm: self.norm.clone(),
            lm_head: self.lm_head.rows_slice(vocab_rows.start, vocab_rows.end),
            vocab_rows,
        })
    }
}

/// The model: its configuration and its (host) weights, the whole model or one rank's shard.
#[derive(Clone, Debug)]
pub struct Model {
    pub config: ModelConfig,
    pub weights: ModelWeights,
}

impl Model {
    pub fn new(config: ModelConfig, weights: ModelWeights) -> Self {
        Self { config, weights }
    }
}
