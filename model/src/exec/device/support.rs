//! What the device kernels run with and what they fix: the executor's tactics and their
//! defaults for a model, the cache-row widths the MLA images are built for, and the routed
//! experts' intermediate columns as the MoE kernels pad them. Below both the executor and the
//! tactic selection ([`crate::exec::tactics`]), which choose among these.

use kernels::blas::DenseTactic;
use kernels::mla::MlaDims;
use kernels::mla::cache::KvCacheDtype;
use kernels::mla::tactic::MlaTactic;
use kernels::moe_gemm::MoeGemmTactic;
use kernels::tactic::{ProblemShape, Tactic};

use crate::arch::config::ModelConfig;
use crate::exec::error::ExecError;

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

/// The device backend's refusal of a model or an option it does not run.
pub(super) fn unsupported(why: impl Into<String>) -> ExecError {
    ExecError::Unsupported {
        backend: "device",
        why: why.into(),
    }
}

/// What the MLA kernels fix: the cache row's widths. Images are built for Kimi-K2.5's and for
/// the small golden checkpoints' ([`MlaDims::BUILT`]); any other model is refused by name.
pub(super) fn check_supported(c: &ModelConfig) -> Result<(), ExecError> {
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
