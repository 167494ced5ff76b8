//! The model's weights as device allocations, uploaded once from the (memory-mapped)
//! checkpoint tensors: BF16 matrices as they are stored (the compressed-KV projection split
//! into its latent and RoPE rows, gate and up concatenated), norm weights as BF16, W_UK
//! transposed per head as the absorbed attention uses it, and the routed experts in the MoE
//! kernels' layout ([`MoeDeviceWeights`]).

use half::bf16;
use indicatif::ProgressBar;
use kernels::device::{Device, DeviceError, DeviceExt, DeviceMemory};
use kernels::formats::nvfp4::Nvfp4View;
use kernels::matrix::MatrixView;
use kernels::mla::tactic::{LATENT, ROPE};
use kernels::moe_gemm::MoeGemmTactic;
use kernels::moe_gemm::launch::{ExpertWeights as KernelExpert, MoeDeviceWeights, MoeWeightsHost};

use crate::forward::Model;
use crate::weights::{
    Bf16Weight, DenseMlpWeights, ExpertWeights, MlpWeights, MoeWeights, QueryProjection,
};

#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    #[error("uploading {tensor}: {source}")]
    Upload {
        tensor: String,
        #[source]
        source: DeviceError,
    },
    #[error("{tensor}: {why}")]
    Unsupported { tensor: String, why: String },
}

pub struct DeviceAttention<D: Device> {
    /// `q_a_proj`, its norm (BF16) and the rank, when the query is low-rank.
    pub q_a: Option<(D::Memory, D::Memory, usize)>,
    /// `q_b_proj` (or the full `q_proj`).
    pub q_b: D::Memory,
    /// The first `kv_lora_rank` rows of `kv_a_proj_with_mqa`.
    pub kv_a_latent: D::Memory,
    /// Its last `qk_rope_head_dim` rows.
    pub kv_a_rope: D::Memory,
    pub kv_a_norm: D::Memory,
    /// `[heads · L, P]`: W_UK of every head, transposed.
    pub w_uk_t: D::Memory,
    pub kv_b: D::Memory,
    pub o: D::Memory,
}

pub struct DeviceDenseMlp<D: Device> {
    /// `[2 · inter, hidden]`: gate rows, then up rows.
    pub gate_up: D::Memory,
    pub down: D::Memory,
    pub inter: usize,
}

pub struct DeviceMoe<D: Device> {
    pub router: D::Memory,
    /// FP32 `[experts]`.
    pub correction_bias: D::Memory,
    pub experts: MoeDeviceWeights<D>,
    pub shared: Option<DeviceDenseMlp<D>>,
}

pub enum DeviceMlp<D: Device> {
    Dense(DeviceDenseMlp<D>),
    Moe(DeviceMoe<D>),
}

pub struct DeviceLayer<D: Device> {
    pub input_norm: D::Memory,
    pub attention: DeviceAttention<D>,
    pub post_attention_norm: D::Memory,
    pub mlp: DeviceMlp<D>,
}

pub struct DeviceWeights<D: Device> {
    /// Attention heads of this rank.
    pub heads: usize,
    pub embed: D::Memory,
    pub layers: Vec<DeviceLayer<D>>,
    pub norm: D::Memory,
    pub lm_head: D::Memory,
    bytes: usize,
}

/// Counts what it uploads, and names the tensor when an upload fails.
struct Uploader<'a, D: Device> {
    dev: &'a D,
    bytes: usize,
}

impl<D: Device> Uploader<'_, D> {
    fn values<T: bytemuck::Pod>(
        &mut self,
        tensor: impl Fn() -> String,
        values: &[T],
    ) -> Result<D::Memory, WeightsError> {
        let memory = self
            .dev
            .upload(values)
            .map_err(|source| WeightsError::Upload {
                tensor: tensor(),
                source,
            })?;
        self.bytes += memory.len();
        Ok(memory)
    }

    fn bf16(
        &mut self,
        tensor: impl Fn() -> String,
        w: &Bf16Weight,
    ) -> Result<D::Memory, WeightsError> {
        self.values(tensor, w.data.as_slice())
    }

    /// Norm weights (FP32 in the model, BF16 in the checkpoint and for the kernels).
    fn norm(&mut self, tensor: impl Fn() -> String, w: &[f32]) -> Result<D::Memory, WeightsError> {
        let v: Vec<bf16> = w.iter().map(|&x| bf16::from_f32(x)).collect();
        self.values(tensor, &v)
    }

    fn dense_mlp(
        &mut self,
        prefix: &str,
        w: &DenseMlpWeights,
    ) -> Result<DeviceDenseMlp<D>, WeightsError> {
        let mut gate_up = Vec::with_capacity((w.gate.rows + w.up.rows) * w.gate.cols);
        gate_up.extend_from_slice(w.gate.data.as_slice());
        gate_up.extend_from_slice(w.up.data.as_slice());
        Ok(DeviceDenseMlp {
            gate_up: self.values(|| format!("{prefix}.gate_proj/up_proj"), &gate_up)?,
            down: self.bf16(|| format!("{prefix}.down_proj"), &w.down)?,
            inter: w.gate.rows,
        })
    }

    fn experts(
        &mut self,
        prefix: &str,
        w: &MoeWeights,
        tactic: MoeGemmTactic,
    ) -> Result<MoeDeviceWeights<D>, WeightsError> {
        let unsupported = |e: usize, why: &str| WeightsError::Unsupported {
            tensor: format!("{prefix}.experts.{e}"),
            why: why.to_string(),
        };
        fn nvfp4<'a>(m: MatrixView<'a>) -> Option<Nvfp4View<'a>> {
            match m {
                MatrixView::Nvfp4(v) => Some(v),
                MatrixView::Bf16 { .. } => None,
            }
        }
        let bf16_expert = |e: usize| {
            unsupported(
                e,
                "is BF16; the device MoE kernels take NVFP4 routed experts (use --backend cpu)",
            )
        };
        let views = w
            .experts
            .iter()
            .map(ExpertWeights::view)
            .enumerate()
            .map(|(e, v)| {
                Ok(KernelExpert {
                    gate: nvfp4(v.gate).ok_or_else(|| bf16_expert(e))?,
                    up: nvfp4(v.up).ok_or_else(|| bf16_expert(e))?,
                    down: nvfp4(v.down).ok_or_else(|| bf16_expert(e))?,
                    gate_up_input_scale: v
                        .gate_up_input_scale
                        .ok_or_else(|| unsupported(e, "has no gate/up input_scale"))?,
                    down_input_scale: v
                        .down_input_scale
                        .ok_or_else(|| unsupported(e, "has no down input_scale"))?,
                })
            })
            .collect::<Result<Vec<_>, WeightsError>>()?;
        let host = MoeWeightsHost::from_experts(&views).map_err(|e| WeightsError::Unsupported {
            tensor: format!("{prefix}.experts"),
            why: e.to_string(),
        })?;
        let uploaded =
            MoeDeviceWeights::upload(self.dev, &host, &[tactic.scale_load]).map_err(|source| {
                WeightsError::Upload {
                    tensor: format!("{prefix}.experts"),
                    source,
                }
            })?;
        self.bytes += uploaded.device_bytes();
        Ok(uploaded)
    }
}

impl<D: Device> DeviceWeights<D> {
    /// Uploads every weight of `model`; `moe_tactic` decides the experts' scale layout.
    pub fn upload(
        dev: &D,
        model: &Model,
        moe_tactic: Option<MoeGemmTactic>,
        quiet: bool,
    ) -> Result<Self, WeightsError> {
        let c = &model.config;
        let w = &model.weights;
        let (nope, v_dim) = (c.qk_nope_head_dim, c.v_head_dim);
        let heads = w.layers.first().map_or(c.num_attention_heads, |l| {
            l.attention.kv_b.rows / (nope + v_dim)
        });
        let bar = if quiet {
            ProgressBar::hidden()
        } else {
            crate::checkpoint::progress_bar(w.layers.len() as u64 + 1, "upload")
        };
        let mut up = Uploader { dev, bytes: 0 };
        let embed = up.bf16(|| "model.embed_tokens".into(), &w.embed)?;
        let mut layers = Vec::with_capacity(w.layers.len());
        for (i, lw) in w.layers.iter().enumerate() {
            let p = format!("model.layers.{i}");
            let at = &lw.attention;
            let (q_a, q_b) = match &at.q {
                QueryProjection::LowRank { a, norm, b } => (
                    Some((
                        up.bf16(|| format!("{p}.self_attn.q_a_proj"), a)?,
                        up.norm(|| format!("{p}.self_attn.q_a_layernorm"), norm)?,
                        a.rows,
                    )),
                    up.bf16(|| format!("{p}.self_attn.q_b_proj"), b)?,
                ),
                QueryProjection::Full(q) => (None, up.bf16(|| format!("{p}.self_attn.q_proj"), q)?),
            };
            if at.kv_a.rows != LATENT + ROPE {
                return Err(WeightsError::Unsupported {
                    tensor: format!("{p}.self_attn.kv_a_proj_with_mqa"),
                    why: format!(
                        "has {} rows, the kernels need {}",
                        at.kv_a.rows,
                        LATENT + ROPE
                    ),
                });
            }
            let attention = DeviceAttention {
                q_a,
                q_b,
                kv_a_latent: up.bf16(
                    || format!("{p}.self_attn.kv_a_proj_with_mqa[:{LATENT}]"),
                    &at.kv_a.rows_slice(0, LATENT),
                )?,
                kv_a_rope: up.bf16(
                    || format!("{p}.self_attn.kv_a_proj_with_mqa[{LATENT}:]"),
                    &at.kv_a.rows_slice(LATENT, LATENT + ROPE),
                )?,
                kv_a_norm: up.norm(|| format!("{p}.self_attn.kv_a_layernorm"), &at.kv_a_norm)?,
                w_uk_t: up.bf16(
                    || format!("{p}.self_attn.kv_b_proj (W_UK)"),
                    model.w_uk_t(i),
                )?,
                kv_b: up.bf16(|| format!("{p}.self_attn.kv_b_proj"), &at.kv_b)?,
                o: up.bf16(|| format!("{p}.self_attn.o_proj"), &at.o)?,
            };
            let mlp = match &lw.mlp {
                MlpWeights::Dense(d) => DeviceMlp::Dense(up.dense_mlp(&format!("{p}.mlp"), d)?),
                MlpWeights::Moe(m) => {
                    let tactic = moe_tactic.ok_or_else(|| WeightsError::Unsupported {
                        tensor: format!("{p}.mlp"),
                        why: "is a MoE layer, but no MoE tactic was given".into(),
                    })?;
                    DeviceMlp::Moe(DeviceMoe {
                        router: up.bf16(|| format!("{p}.mlp.gate"), &m.router)?,
                        correction_bias: up.values(
                            || format!("{p}.mlp.gate.e_score_correction_bias"),
                            &m.correction_bias,
                        )?,
                        experts: up.experts(&format!("{p}.mlp"), m, tactic)?,
                        shared: m
                            .shared
                            .as_ref()
                            .map(|s| up.dense_mlp(&format!("{p}.mlp.shared_experts"), s))
                            .transpose()?,
                    })
                }
            };
            layers.push(DeviceLayer {
                input_norm: up.norm(|| format!("{p}.input_layernorm"), &lw.input_norm)?,
                attention,
                post_attention_norm: up.norm(
                    || format!("{p}.post_attention_layernorm"),
                    &lw.post_attention_norm,
                )?,
                mlp,
            });
            bar.inc(1);
        }
        let norm = up.norm(|| "model.norm".into(), &w.norm)?;
        let lm_head = up.bf16(|| "lm_head".into(), &w.lm_head)?;
        bar.inc(1);
        bar.finish_and_clear();
        Ok(Self {
            heads,
            embed,
            layers,
            norm,
            lm_head,
            bytes: up.bytes,
        })
    }

    /// Device bytes of every uploaded weight.
    pub fn device_bytes(&self) -> usize {
        self.bytes
    }
}
