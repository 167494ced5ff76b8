//! The small set of operations a compute backend provides to the forward pass. The CPU backend
//! implements it with the kernels crate's CPU paths; a CUDA backend implements the same calls.

use kernels::matrix::MatrixView;
use kernels::mla::cache::{CacheError, PagedLatentCache};
use kernels::mla::reference::MlaProblem;
use kernels::moe_gemm::reference::{ExpertInputAmax, ExpertView, Routing};

pub trait Backend: Send + Sync {
    fn name(&self) -> &'static str;

    /// `out = x · Wᵀ` for `x: [tokens, w.cols]`.
    fn matmul(&self, x: &[f32], tokens: usize, w: MatrixView<'_>, out: &mut [f32]);

    /// Routed experts (grouped GEMM), W4A4 for NVFP4 experts; records activation maxima when
    /// `amax` is given (calibration).
    fn moe(
        &self,
        x: &[f32],
        hidden: usize,
        routing: &Routing,
        experts: &[ExpertView<'_>],
        out: &mut [f32],
        amax: Option<&mut ExpertInputAmax>,
    );

    /// Absorbed MLA attention over the paged latent cache: latent outputs and log-sum-exp.
    fn mla_attention(
        &self,
        cache: &PagedLatentCache,
        problem: &MlaProblem<'_>,
        out: &mut [f32],
        lse: &mut [f32],
    ) -> Result<(), CacheError>;

    /// Sums a tensor-parallel partial result across ranks in place (identical bits on every
    /// rank). A single-rank backend has nothing to do.
    fn all_reduce_sum(&self, _data: &mut [f32]) -> Result<(), String> {
        Ok(())
    }
}

/// The CPU backend: rayon-parallel kernels from the `kernels` crate.
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuBackend;

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn matmul(&self, x: &[f32], tokens: usize, w: MatrixView<'_>, out: &mut [f32]) {
        kernels::dense::matmul_transposed(x, tokens, w, out);
    }

    fn moe(
        &self,
        x: &[f32],
        hidden: usize,
        routing: &Routing,
        experts: &[ExpertView<'_>],
        out: &mut [f32],
        amax: Option<&mut ExpertInputAmax>,
    ) {
        kernels::moe_gemm::cpu::moe_cpu(x, hidden, routing, experts, out, amax);
    }

    fn mla_attention(
        &self,
        cache: &PagedLatentCache,
        problem: &MlaProblem<'_>,
        out: &mut [f32],
        lse: &mut [f32],
    ) -> Result<(), CacheError> {
        kernels::mla::cpu::mla_attention(cache, problem, out, lse)
    }
}
