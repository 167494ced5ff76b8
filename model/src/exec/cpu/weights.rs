//! The CPU backend's weights: the host tensors as they are (borrowed from the mapped
//! checkpoint, or owned), cut as the step reads them, plus the one derived copy, W_UK of every
//! head transposed for the absorbed attention.

use kernels::matrix::MatrixView;

use crate::arch::config::ModelConfig;
use crate::checkpoint::weights::{
    Bf16Data, Bf16Weight, DenseMlpWeights, ExpertWeights, MlpWeights, Model, QueryProjection,
    derived_on_huge_pages,
};
use crate::exec::ops::{Measured, WeightKinds};
use crate::exec::weights::{Attention, DenseMlp, Layer, Mlp, Moe, Weights, w_uk_transpose_into};

/// The CPU backend's handles.
pub struct CpuKinds;

impl WeightKinds for CpuKinds {
    type Matrix = CpuMatrix;
    type Heads = CpuHeads;
    type Vector = Vec<f32>;
    type Experts = Vec<ExpertWeights>;
}

/// One BF16 matrix, or several stacked by rows (gate over up) that stay where the checkpoint
/// keeps them: a product with it computes each part's rows as one call does, and writes them
/// part after part (`[part 0: tokens × rows₀][part 1: tokens × rows₁]`).
#[derive(Clone, Debug)]
pub struct CpuMatrix {
    pub parts: Vec<Bf16Weight>,
}

impl CpuMatrix {
    pub fn one(w: Bf16Weight) -> Self {
        Self { parts: vec![w] }
    }

    pub fn rows(&self) -> usize {
        self.parts.iter().map(|p| p.rows).sum()
    }

    pub fn cols(&self) -> usize {
        self.parts.first().map_or(0, |p| p.cols)
    }

    pub fn bytes(&self) -> usize {
        self.parts.iter().map(|p| p.rows * p.cols * 2).sum()
    }
}

/// Per-head matrices inside one BF16 tensor: head `h` is the `rows` rows from `first + h ·
/// stride`.
#[derive(Clone, Debug)]
pub struct CpuHeads {
    pub data: Bf16Weight,
    pub heads: usize,
    pub first: usize,
    pub stride: usize,
    pub rows: usize,
}

impl CpuHeads {
    pub fn views(&self) -> Vec<MatrixView<'_>> {
        let (cols, data) = (self.data.cols, self.data.data.as_slice());
        (0..self.heads)
            .map(|h| {
                let first = (self.first + h * self.stride) * cols;
                MatrixView::Bf16 {
                    rows: self.rows,
                    cols,
                    data: &data[first..first + self.rows * cols],
                }
            })
            .collect()
    }

    pub fn bytes(&self) -> usize {
        self.heads * self.rows * self.data.cols * 2
    }
}

/// The step's weights over `model`'s host tensors (no copy but W_UKᵀ).
pub fn cpu_weights(model: &Model) -> Weights<CpuKinds> {
    let c = &model.config;
    let w = &model.weights;
    let absorbed = transposed_w_uk(c, &w.layers);
    let heads = w
        .layers
        .first()
        .map_or(c.num_attention_heads, |l| heads_of(c, &l.attention.kv_b));
    let layers = w
        .layers
        .iter()
        .zip(absorbed)
        .map(|(l, w_uk_t)| {
            let a = &l.attention;
            let (latent, nope, v) = (c.kv_lora_rank, c.qk_nope_head_dim, c.v_head_dim);
            let heads = heads_of(c, &a.kv_b);
            let (q_a, q_b) = match &a.q {
                QueryProjection::LowRank { a, norm, b } => {
                    (Some((CpuMatrix::one(a.clone()), norm.clone())), b.clone())
                }
                QueryProjection::Full(q) => (None, q.clone()),
            };
            Layer {
                input_norm: l.input_norm.clone(),
                attention: Attention {
                    q_a,
                    q_b: CpuMatrix::one(q_b),
                    kv_a_latent: CpuMatrix::one(a.kv_a.rows_slice(0, latent)),
                    kv_a_rope: CpuMatrix::one(a.kv_a.rows_slice(latent, a.kv_a.rows)),
                    kv_a_norm: a.kv_a_norm.clone(),
                    w_uk_t: CpuHeads {
                        data: w_uk_t,
                        heads,
                        first: 0,
                        stride: latent,
                        rows: latent,
                    },
                    w_uv: CpuHeads {
                        data: a.kv_b.clone(),
                        heads,
                        first: nope,
                        stride: nope + v,
                        rows: v,
                    },
                    o: CpuMatrix::one(a.o.clone()),
                },
                post_attention_norm: l.post_attention_norm.clone(),
                mlp: match &l.mlp {
                    MlpWeights::Dense(d) => Mlp::Dense(dense(d)),
                    MlpWeights::Moe(m) => Mlp::Moe(Moe {
                        router: CpuMatrix::one(m.router.clone()),
                        correction_bias: m.correction_bias.clone(),
                        experts: m.experts.clone(),
                        shared: m.shared.as_ref().map(dense),
                    }),
                },
            }
        })
        .collect();
    Weights {
        embed: CpuMatrix::one(w.embed.clone()),
        layers,
        norm: w.norm.clone(),
        lm_head: CpuMatrix::one(w.lm_head.clone()),
        shard: crate::arch::shard::TpShard::holding_vocab_rows(
            c.num_attention_heads / heads.max(1),
            c.vocab_size,
            &w.vocab_rows,
        )
        .unwrap_or(crate::arch::shard::TpShard::SINGLE),
        vocab_rows: w.vocab_rows.clone(),
        heads,
    }
}

fn dense(d: &DenseMlpWeights) -> DenseMlp<CpuKinds> {
    DenseMlp {
        gate_up: CpuMatrix {
            parts: vec![d.gate.clone(), d.up.clone()],
        },
        down: CpuMatrix::one(d.down.clone()),
    }
}

/// Heads of a layer whose `kv_b_proj` is `kv_b`: all of them, or a rank's share.
fn heads_of(c: &ModelConfig, kv_b: &Bf16Weight) -> usize {
    kv_b.rows / (c.qk_nope_head_dim + c.v_head_dim)
}

/// W_UK of every head of every layer, transposed to `[heads · L, P]` so that absorbing it into
/// the query is a product `q_nope · (W_UKᵀ)ᵀ` like every other: one third of `kv_b` copied. In
/// one mapping on huge pages ([`derived_on_huge_pages`]), or owned vectors where nothing could
/// be mapped.
fn transposed_w_uk(
    c: &ModelConfig,
    layers: &[crate::checkpoint::weights::LayerWeights],
) -> Vec<Bf16Weight> {
    let sizes: Vec<usize> = layers
        .iter()
        .map(|l| heads_of(c, &l.attention.kv_b) * c.kv_lora_rank * c.qk_nope_head_dim)
        .collect();
    let total: usize = sizes.iter().sum();
    let memory = derived_on_huge_pages(total, |all| {
        let mut rest = all;
        for (l, &n) in layers.iter().zip(&sizes) {
            let (layer, tail) = rest.split_at_mut(n);
            w_uk_transpose_into(c, &l.attention.kv_b, layer);
            rest = tail;
        }
    });
    let mut start = 0;
    layers
        .iter()
        .zip(&sizes)
        .map(|(l, &n)| {
            let rows = heads_of(c, &l.attention.kv_b) * c.kv_lora_rank;
            let data = match &memory {
                Some(memory) => Bf16Data::Derived {
                    memory: memory.clone(),
                    range: start * 2..(start + n) * 2,
                },
                None => {
                    let mut t = vec![half::bf16::ZERO; n];
                    w_uk_transpose_into(c, &l.attention.kv_b, &mut t);
                    Bf16Data::Owned(std::sync::Arc::new(t))
                }
            };
            start += n;
            Bf16Weight {
                rows,
                cols: c.qk_nope_head_dim,
                data,
            }
        })
        .collect()
}

impl Measured for CpuMatrix {
    fn label(&self) -> String {
        let rows: Vec<String> = self.parts.iter().map(|p| p.rows.to_string()).collect();
        format!("bf16 {}x{}", rows.join("+"), self.cols())
    }

    fn bytes(&self) -> u64 {
        CpuMatrix::bytes(self) as u64
    }
}

impl Measured for CpuHeads {
    fn label(&self) -> String {
        format!("{} x bf16 {}x{}", self.heads, self.rows, self.data.cols)
    }

    fn bytes(&self) -> u64 {
        CpuHeads::bytes(self) as u64
    }
}

impl Measured for Vec<ExpertWeights> {
    fn label(&self) -> String {
        match self.first() {
            Some(e) => {
                let dtype = match &e.gate {
                    crate::checkpoint::weights::ExpertMatrix::Bf16(_) => "bf16",
                    crate::checkpoint::weights::ExpertMatrix::Nvfp4(_) => "nvfp4",
                };
                let gate = e.gate.view();
                format!("{} x {dtype} {}x{}", self.len(), gate.rows(), gate.cols())
            }
            None => "no experts".into(),
        }
    }

    fn bytes(&self) -> u64 {
        self.iter()
            .map(|e| (e.gate.view().bytes() + e.up.view().bytes() + e.down.view().bytes()) as u64)
            .sum()
    }

    fn count(&self) -> usize {
        self.len()
    }
}
