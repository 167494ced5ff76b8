//! The model's weights, borrowed from memory-mapped checkpoint shards (or owned, for
//! generated models), in the shapes the forward pass uses.

use std::ops::Range;
use std::sync::Arc;

use half::bf16;
use kernels::formats::nvfp4::Nvfp4View;
use kernels::matrix::MatrixView;
use kernels::moe_gemm::reference::ExpertView;

use crate::tensor_file::TensorFile;

/// BF16 values, either straight from a mapped shard or owned.
#[derive(Clone, Debug)]
pub enum Bf16Data {
    Mapped {
        file: Arc<TensorFile>,
        range: Range<usize>,
    },
    Owned(Arc<Vec<bf16>>),
}

impl Bf16Data {
    #[inline]
    pub fn as_slice(&self) -> &[bf16] {
        match self {
            // Alignment was checked when the weight was created.
            Self::Mapped { file, range } => bytemuck::cast_slice(file.mapped(range.clone())),
            Self::Owned(values) => values,
        }
    }
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
    pub embed: Bf16Weight,
    pub layers: Vec<LayerWeights>,
    pub norm: Vec<f32>,
    pub lm_head: Bf16Weight,
}
