//! The model's weights as device allocations, uploaded once from the (memory-mapped)
//! checkpoint tensors: BF16 matrices as they are stored (the compressed-KV projection split
//! into its latent and RoPE rows, gate and up concatenated), norm weights as BF16, W_UK
//! transposed per head as the absorbed attention uses it, and the routed experts in the MoE
//! kernels' layout ([`MoeDeviceWeights`]).
//!
//! Every tensor's shape comes from the config and the rank's share of it, in one walk
//! ([`DeviceWeights::upload`] checks the host tensors against those shapes;
//! [`DeviceWeights::zeroed`] allocates them without values, for a dry run of a model too large
//! to hold).

use half::bf16;
use indicatif::ProgressBar;
use kernels::device::{Device, DeviceError, DeviceExt, DeviceMemory};
use kernels::formats::nvfp4::Nvfp4View;
use kernels::matrix::MatrixView;
use kernels::moe_gemm::launch::{
    ExpertWeights as KernelExpert, MoeDeviceWeights, MoeWeightsHost, MoeWeightsShape,
};
use kernels::moe_gemm::{MoeGemmTactic, ScaleLoad};

use super::support::{device_expert_inter, unsupported};
use crate::arch::config::ModelConfig;
use crate::arch::names;
use crate::arch::shard::TpShard;
use crate::checkpoint::weights::{
    Bf16Weight, DenseMlpWeights, ExpertWeights, MlpWeights, Model, MoeWeights, QueryProjection,
};
use crate::exec::error::ExecError;
use crate::exec::ops::{Measured, WeightKinds};
use crate::exec::weights::{Attention, DenseMlp, Layer, Mlp, Moe, Weights, w_uk_transposed};

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

/// The device executor's handles: device allocations in the kernels' layouts.
pub struct DeviceKinds<D: Device>(std::marker::PhantomData<D>);

impl<D: Device> WeightKinds for DeviceKinds<D> {
    type Matrix = DeviceMatrix<D>;
    type Heads = DeviceHeads<D>;
    /// BF16 for a norm's weight, FP32 for the router's correction bias.
    type Vector = D::Memory;
    type Experts = MoeDeviceWeights<D>;
}

/// A row-major BF16 matrix `[rows, cols]` (gate over up: one allocation of both).
pub struct DeviceMatrix<D: Device> {
    pub memory: D::Memory,
    pub rows: usize,
    pub cols: usize,
}

/// Per-head BF16 matrices `[rows, cols]` in one allocation: head `h` starts at element
/// `offset + h · stride`.
pub struct DeviceHeads<D: Device> {
    pub memory: D::Memory,
    pub heads: usize,
    pub offset: usize,
    pub stride: usize,
    pub rows: usize,
    pub cols: usize,
}

/// The device weights, with what the upload allocated.
pub struct DeviceWeights<D: Device> {
    pub weights: Weights<DeviceKinds<D>>,
    /// Device bytes of every weight.
    pub bytes: usize,
    /// Every allocation's tensor name and bytes, in upload order.
    pub allocations: Vec<(String, usize)>,
}

/// A row-major matrix's `[rows, cols]`.
type Shape = [usize; 2];

/// Builds a [`DeviceWeights`] from one walk over the tensors whose shapes come from the config
/// and the rank's share of it: with `host`, each tensor's values are uploaded (after checking
/// the host tensor has that shape); without, a zeroed allocation of that shape stands in.
struct Builder<'a, D: Device> {
    dev: &'a D,
    /// Counts the bytes uploaded.
    progress: ProgressBar,
    bytes: usize,
    /// Name and bytes of every allocation, in walk order.
    allocations: Vec<(String, usize)>,
}

fn mismatch(tensor: String, what: String) -> WeightsError {
    WeightsError::Unsupported {
        tensor,
        why: format!("{what} (expected from the config and the rank's share of it)"),
    }
}

impl<D: Device> Builder<'_, D> {
    fn keep(&mut self, tensor: String, memory: D::Memory) -> D::Memory {
        self.bytes += memory.len();
        self.progress.inc(memory.len() as u64);
        self.allocations.push((tensor, memory.len()));
        memory
    }

    fn upload_error(tensor: &str) -> impl FnOnce(DeviceError) -> WeightsError + '_ {
        move |source| WeightsError::Upload {
            tensor: tensor.to_string(),
            source,
        }
    }

    /// `count` values of `T`: uploaded from `host`, or zeroed.
    fn values<T: bytemuck::Pod>(
        &mut self,
        tensor: String,
        count: usize,
        host: Option<&[T]>,
    ) -> Result<D::Memory, WeightsError> {
        let memory = match host {
            Some(values) => {
                if values.len() != count {
                    return Err(mismatch(
                        tensor,
                        format!("has {} values, not {count}", values.len()),
                    ));
                }
                self.dev.upload(values)
            }
            None => self.dev.alloc_zeroed(count * std::mem::size_of::<T>()),
        }
        .map_err(Self::upload_error(&tensor))?;
        Ok(self.keep(tensor, memory))
    }

    fn bf16(
        &mut self,
        tensor: String,
        [rows, cols]: Shape,
        host: Option<&Bf16Weight>,
    ) -> Result<D::Memory, WeightsError> {
        if let Some(w) = host
            && (w.rows, w.cols) != (rows, cols)
        {
            return Err(mismatch(
                tensor,
                format!("is [{}, {}], not [{rows}, {cols}]", w.rows, w.cols),
            ));
        }
        self.values(tensor, rows * cols, host.map(|w| w.data.as_slice()))
    }

    fn matrix(
        &mut self,
        tensor: String,
        shape: Shape,
        host: Option<&Bf16Weight>,
    ) -> Result<DeviceMatrix<D>, WeightsError> {
        Ok(DeviceMatrix {
            memory: self.bf16(tensor, shape, host)?,
            rows: shape[0],
            cols: shape[1],
        })
    }

    /// Norm weights (FP32 in the model, BF16 in the checkpoint and for the kernels).
    fn norm(
        &mut self,
        tensor: String,
        len: usize,
        host: Option<&[f32]>,
    ) -> Result<D::Memory, WeightsError> {
        let v: Option<Vec<bf16>> = host.map(|w| w.iter().map(|&x| bf16::from_f32(x)).collect());
        self.values(tensor, len, v.as_deref())
    }

    /// Gate and up rows concatenated, then down: `inter` rows of this rank.
    fn dense_mlp(
        &mut self,
        mlp: &names::Mlp,
        hidden: usize,
        inter: usize,
        host: Option<&DenseMlpWeights>,
    ) -> Result<DenseMlp<DeviceKinds<D>>, WeightsError> {
        let gate_up = match host {
            Some(w) => {
                for (name, m) in [(mlp.gate_proj(), &w.gate), (mlp.up_proj(), &w.up)] {
                    if (m.rows, m.cols) != (inter, hidden) {
                        return Err(mismatch(
                            name.to_string(),
                            format!("is [{}, {}], not [{inter}, {hidden}]", m.rows, m.cols),
                        ));
                    }
                }
                let mut v = Vec::with_capacity(2 * inter * hidden);
                v.extend_from_slice(w.gate.data.as_slice());
                v.extend_from_slice(w.up.data.as_slice());
                Some(v)
            }
            None => None,
        };
        Ok(DenseMlp {
            gate_up: DeviceMatrix {
                memory: self.values(
                    format!("{} and {}", mlp.gate_proj(), mlp.up_proj()),
                    2 * inter * hidden,
                    gate_up.as_deref(),
                )?,
                rows: 2 * inter,
                cols: hidden,
            },
            down: self.matrix(
                mlp.down_proj().to_string(),
                [hidden, inter],
                host.map(|w| &w.down),
            )?,
        })
    }

    fn experts(
        &mut self,
        layer: &names::Layer,
        shape: MoeWeightsShape,
        host: Option<&MoeWeights>,
        layouts: &[ScaleLoad],
    ) -> Result<MoeDeviceWeights<D>, WeightsError> {
        let tensor = layer.routed_experts().to_string();
        let device = match host {
            Some(w) => {
                let packed = pack_experts(layer, w)?.padded_inter(shape.inter);
                if packed.shape() != shape {
                    return Err(mismatch(
                        tensor,
                        format!("are {:?}, not {shape:?}", packed.shape()),
                    ));
                }
                MoeDeviceWeights::upload(self.dev, &packed, layouts)
            }
            None => MoeDeviceWeights::zeroed(self.dev, shape, layouts),
        }
        .map_err(Self::upload_error(&tensor))?;
        self.bytes += device.device_bytes();
        self.progress.inc(device.device_bytes() as u64);
        self.allocations.extend(
            device
                .buffer_bytes()
                .into_iter()
                .map(|(name, bytes)| (format!("{tensor}.{name}"), bytes)),
        );
        Ok(device)
    }
}

/// A layer's routed experts (NVFP4, with their input scales) in the MoE kernels' layout.
fn pack_experts(layer: &names::Layer, w: &MoeWeights) -> Result<MoeWeightsHost, WeightsError> {
    let unsupported = |e: usize, why: &str| WeightsError::Unsupported {
        tensor: layer.routed_expert(e).path().to_string(),
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
    MoeWeightsHost::from_experts(&views).map_err(|e| WeightsError::Unsupported {
        tensor: layer.routed_experts().to_string(),
        why: e.to_string(),
    })
}

impl<D: Device> DeviceWeights<D> {
    /// Uploads every weight of `model` (the whole model, or one rank's
    /// [`ModelWeights::shard`](crate::checkpoint::weights::ModelWeights::shard) of it);
    /// `moe_tactics` decide the experts' scale layouts (each layout one of them reads).
    pub fn upload(
        dev: &D,
        model: &Model,
        moe_tactics: &[MoeGemmTactic],
        quiet: bool,
    ) -> Result<Self, WeightsError> {
        let c = &model.config;
        let kv_rows = c.qk_nope_head_dim + c.v_head_dim;
        let heads = model
            .weights
            .layers
            .first()
            .map_or(c.num_attention_heads, |l| l.attention.kv_b.rows / kv_rows);
        if heads == 0 || !c.num_attention_heads.is_multiple_of(heads) {
            return Err(mismatch(
                names::layer(0).kv_b_proj().to_string(),
                format!(
                    "holds {heads} heads, not a share of the config's {}",
                    c.num_attention_heads
                ),
            ));
        }
        let world = c.num_attention_heads / heads;
        let vocab_rows = &model.weights.vocab_rows;
        let shard = TpShard::holding_vocab_rows(world, c.vocab_size, vocab_rows).ok_or_else(|| {
            mismatch(
                names::embed_tokens().to_string(),
                format!(
                    "holds vocabulary rows {vocab_rows:?}, no rank's share of {} over {world} ranks",
                    c.vocab_size
                ),
            )
        })?;
        Self::build(dev, c, shard, Some(model), moe_tactics, quiet)
    }

    /// Zeroed allocations of every weight rank `shard.rank` of `shard.world` holds, of the
    /// shapes an upload of that rank's [`ModelWeights::shard`](crate::checkpoint::weights::ModelWeights::shard)
    /// makes: the executor's footprint and launches without the weights' values (a dry run
    /// of a model too large to hold; on a real device, a step of it computes on zeros).
    pub fn zeroed(
        dev: &D,
        config: &ModelConfig,
        shard: TpShard,
        moe_tactics: &[MoeGemmTactic],
    ) -> Result<Self, WeightsError> {
        if shard.world > 1 {
            config
                .check_tensor_parallel(shard.world)
                .map_err(|why| WeightsError::Unsupported {
                    tensor: "the model".into(),
                    why,
                })?;
        }
        if shard.rank >= shard.world.max(1) {
            return Err(WeightsError::Unsupported {
                tensor: "the model".into(),
                why: format!("rank {} of {}", shard.rank, shard.world),
            });
        }
        Self::build(dev, config, shard, None, moe_tactics, true)
    }

    /// The one walk over the tensors (see [`Builder`]): shapes from `c` split as
    /// `ModelWeights::shard` splits them for `shard`.
    fn build(
        dev: &D,
        c: &ModelConfig,
        shard: TpShard,
        host: Option<&Model>,
        moe_tactics: &[MoeGemmTactic],
        quiet: bool,
    ) -> Result<Self, WeightsError> {
        let world = shard.world.max(1);
        let hidden = c.hidden_size;
        let (latent, rope) = (c.kv_lora_rank, c.qk_rope_head_dim);
        let heads = c.num_attention_heads / world;
        let vocab_rows = shard.vocab_rows(c.vocab_size);
        let (nope, v_dim, qk) = (c.qk_nope_head_dim, c.v_head_dim, c.qk_head_dim());
        let w = host.map(|m| &m.weights);
        let mut layouts: Vec<ScaleLoad> = moe_tactics.iter().map(|t| t.scale_load).collect();
        layouts.sort_by_key(|l| l.macro_value());
        layouts.dedup();
        if let Some(w) = w
            && w.layers.len() != c.num_hidden_layers
        {
            return Err(mismatch(
                names::LAYERS.trim_end_matches('.').to_string(),
                format!("has {} layers, not {}", w.layers.len(), c.num_hidden_layers),
            ));
        }
        let mut up = Builder {
            dev,
            progress: if quiet {
                ProgressBar::hidden()
            } else {
                crate::checkpoint::bytes_progress(None, "uploading weights")
            },
            bytes: 0,
            allocations: Vec::new(),
        };
        let embed = up.matrix(
            names::embed_tokens().to_string(),
            [vocab_rows.len(), hidden],
            w.map(|w| &w.embed),
        )?;
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for i in 0..c.num_hidden_layers {
            let p = names::layer(i);
            let lw = w.map(|w| &w.layers[i]);
            let at = lw.map(|l| &l.attention);
            let (q_a, q_b) = match c.q_lora_rank {
                Some(rank) => {
                    let low = at
                        .map(|a| match &a.q {
                            QueryProjection::LowRank { a, norm, b } => Ok((a, norm, b)),
                            QueryProjection::Full(_) => Err(mismatch(
                                p.q_proj().to_string(),
                                "is a full query projection, the config has q_lora_rank".into(),
                            )),
                        })
                        .transpose()?;
                    (
                        Some((
                            up.matrix(p.q_a_proj().to_string(), [rank, hidden], low.map(|l| l.0))?,
                            up.norm(
                                p.q_a_layernorm().to_string(),
                                rank,
                                low.map(|l| l.1.as_slice()),
                            )?,
                        )),
                        up.matrix(
                            p.q_b_proj().to_string(),
                            [heads * qk, rank],
                            low.map(|l| l.2),
                        )?,
                    )
                }
                None => {
                    let full = at
                        .map(|a| match &a.q {
                            QueryProjection::Full(q) => Ok(q),
                            QueryProjection::LowRank { .. } => Err(mismatch(
                                p.q_a_proj().to_string(),
                                "is a low-rank query, the config has no q_lora_rank".into(),
                            )),
                        })
                        .transpose()?;
                    (
                        None,
                        up.matrix(p.q_proj().to_string(), [heads * qk, hidden], full)?,
                    )
                }
            };
            if let Some(a) = at
                && a.kv_a.rows != latent + rope
            {
                return Err(mismatch(
                    p.kv_a_proj_with_mqa().to_string(),
                    format!(
                        "has {} rows, not kv_lora_rank + qk_rope_head_dim = {}",
                        a.kv_a.rows,
                        latent + rope
                    ),
                ));
            }
            let kv_a_latent = at.map(|a| a.kv_a.rows_slice(0, latent));
            let kv_a_rope = at.map(|a| a.kv_a.rows_slice(latent, latent + rope));
            let w_uk_t = at.map(|a| w_uk_transposed(c, &a.kv_b));
            let attention = Attention {
                q_a,
                q_b,
                kv_a_latent: up.matrix(
                    format!("{}[:{latent}]", p.kv_a_proj_with_mqa()),
                    [latent, hidden],
                    kv_a_latent.as_ref(),
                )?,
                kv_a_rope: up.matrix(
                    format!("{}[{latent}:]", p.kv_a_proj_with_mqa()),
                    [rope, hidden],
                    kv_a_rope.as_ref(),
                )?,
                kv_a_norm: up.norm(
                    p.kv_a_layernorm().to_string(),
                    c.kv_lora_rank,
                    at.map(|a| a.kv_a_norm.as_slice()),
                )?,
                w_uk_t: DeviceHeads {
                    memory: up.values(
                        format!("{} (W_UK)", p.kv_b_proj()),
                        heads * latent * nope,
                        w_uk_t.as_deref(),
                    )?,
                    heads,
                    offset: 0,
                    stride: latent * nope,
                    rows: latent,
                    cols: nope,
                },
                w_uv: DeviceHeads {
                    memory: up.bf16(
                        p.kv_b_proj().to_string(),
                        [heads * (nope + v_dim), latent],
                        at.map(|a| &a.kv_b),
                    )?,
                    heads,
                    offset: nope * latent,
                    stride: (nope + v_dim) * latent,
                    rows: v_dim,
                    cols: latent,
                },
                o: up.matrix(
                    p.o_proj().to_string(),
                    [hidden, heads * v_dim],
                    at.map(|a| &a.o),
                )?,
            };
            let mlp = if c.is_moe_layer(i) {
                let m = lw
                    .map(|l| match &l.mlp {
                        MlpWeights::Moe(m) => Ok(m),
                        MlpWeights::Dense(_) => Err(mismatch(
                            p.mlp().path().to_string(),
                            "is a dense MLP, the config makes it a MoE layer".into(),
                        )),
                    })
                    .transpose()?;
                if layouts.is_empty() {
                    return Err(WeightsError::Unsupported {
                        tensor: p.mlp().path().to_string(),
                        why: "is a MoE layer, but no MoE tactic was given".into(),
                    });
                }
                let experts = MoeWeightsShape {
                    experts: c.n_routed_experts,
                    hidden,
                    inter: device_expert_inter(c, world),
                };
                let shared_inter = c.moe_intermediate_size * c.n_shared_experts / world;
                if let Some(m) = m
                    && m.shared.is_some() != (c.n_shared_experts > 0)
                {
                    return Err(mismatch(
                        p.shared_experts().path().to_string(),
                        format!(
                            "are {}, the config has n_shared_experts {}",
                            if m.shared.is_some() {
                                "present"
                            } else {
                                "absent"
                            },
                            c.n_shared_experts
                        ),
                    ));
                }
                Mlp::Moe(Moe {
                    router: up.matrix(
                        p.router().to_string(),
                        [c.n_routed_experts, hidden],
                        m.map(|m| &m.router),
                    )?,
                    correction_bias: up.values(
                        p.e_score_correction_bias(),
                        c.n_routed_experts,
                        m.map(|m| m.correction_bias.as_slice()),
                    )?,
                    experts: up.experts(&p, experts, m, &layouts)?,
                    shared: (c.n_shared_experts > 0)
                        .then(|| {
                            up.dense_mlp(
                                &p.shared_experts(),
                                hidden,
                                shared_inter,
                                m.and_then(|m| m.shared.as_ref()),
                            )
                        })
                        .transpose()?,
                })
            } else {
                let d = lw
                    .map(|l| match &l.mlp {
                        MlpWeights::Dense(d) => Ok(d),
                        MlpWeights::Moe(_) => Err(mismatch(
                            p.mlp().path().to_string(),
                            "is a MoE layer, the config makes it dense".into(),
                        )),
                    })
                    .transpose()?;
                Mlp::Dense(up.dense_mlp(&p.mlp(), hidden, c.intermediate_size / world, d)?)
            };
            layers.push(Layer {
                input_norm: up.norm(
                    p.input_layernorm().to_string(),
                    hidden,
                    lw.map(|l| l.input_norm.as_slice()),
                )?,
                attention,
                post_attention_norm: up.norm(
                    p.post_attention_layernorm().to_string(),
                    hidden,
                    lw.map(|l| l.post_attention_norm.as_slice()),
                )?,
                mlp,
            });
        }
        let norm = up.norm(
            names::norm().to_string(),
            hidden,
            w.map(|w| w.norm.as_slice()),
        )?;
        let lm_head = up.matrix(
            names::lm_head().to_string(),
            [vocab_rows.len(), hidden],
            w.map(|w| &w.lm_head),
        )?;
        up.progress.finish_and_clear();
        Ok(Self {
            weights: Weights {
                embed,
                layers,
                norm,
                lm_head,
                shard,
                vocab_rows,
                heads,
            },
            bytes: up.bytes,
            allocations: up.allocations,
        })
    }
}

impl<D: Device> Measured for DeviceMatrix<D> {
    fn label(&self) -> String {
        format!("bf16 {}x{}", self.rows, self.cols)
    }

    fn bytes(&self) -> u64 {
        (self.rows * self.cols * 2) as u64
    }
}

impl<D: Device> Measured for DeviceHeads<D> {
    fn label(&self) -> String {
        format!("{} x bf16 {}x{}", self.heads, self.rows, self.cols)
    }

    fn bytes(&self) -> u64 {
        (self.heads * self.rows * self.cols * 2) as u64
    }
}

impl<D: Device> Measured for MoeDeviceWeights<D> {
    fn label(&self) -> String {
        format!("{} x nvfp4 experts", self.experts)
    }

    fn bytes(&self) -> u64 {
        (self.experts * self.bytes_per_expert) as u64
    }

    fn count(&self) -> usize {
        self.experts
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
