//! The small set of operations a compute backend provides to the forward pass. The CPU backend
//! implements it with the kernels crate's CPU paths; a CUDA backend implements the same calls.

use std::sync::Arc;

use kernels::cpu_tactic::CpuTactic;
use kernels::matrix::MatrixView;
use kernels::mla::cache::{CacheError, PagedLatentCache};
use kernels::mla::reference::MlaProblem;
use kernels::moe_gemm::cpu_simd::Isa;
use kernels::moe_gemm::reference::{ExpertInputAmax, ExpertView, Routing};

pub trait Backend: Send + Sync {
    fn name(&self) -> &'static str;

    /// `out = x · Wᵀ` for `x: [tokens, w.cols]`.
    fn matmul(&self, x: &[f32], tokens: usize, w: MatrixView<'_>, out: &mut [f32]);

    /// `out[h] = x[h] · w[h]ᵀ` for every head, `x: [heads, tokens, cols]`,
    /// `out: [heads, tokens, rows]` (the absorbed attention's W_UK and W_UV products), which a
    /// backend may run side by side.
    fn matmul_per_head(&self, x: &[f32], tokens: usize, w: &[MatrixView<'_>], out: &mut [f32]) {
        let Some(first) = w.first() else {
            return;
        };
        let (x_len, out_len) = (tokens * first.cols(), tokens * first.rows());
        for ((w, x), out) in w
            .iter()
            .zip(x.chunks_exact(x_len))
            .zip(out.chunks_exact_mut(out_len))
        {
            self.matmul(x, tokens, *w, out);
        }
    }

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

/// The CPU backend: rayon-parallel kernels from the `kernels` crate, with the default
/// [`CpuTactic`] (see [`TunedCpuBackend`] for another one).
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuBackend;

/// The CPU backend under a chosen [`CpuTactic`] (`model run --tactics FILE`, autotune). Every
/// knob but the thread count is passed to the kernels with each call; a tactic with a thread
/// count of its own runs the calls in a rayon pool of that size, owned by the backend (so no
/// process-wide setting: a call is handed to that pool exactly as a call from outside rayon's
/// global pool is handed to the global one).
#[derive(Clone, Debug, Default)]
pub struct TunedCpuBackend {
    tactic: CpuTactic,
    pool: Option<Arc<rayon::ThreadPool>>,
}

impl TunedCpuBackend {
    /// # Errors
    /// If the tactic is invalid or its thread pool cannot be built.
    pub fn new(tactic: CpuTactic) -> Result<Self, String> {
        tactic.validate().map_err(|e| e.to_string())?;
        let pool = if tactic.threads == 0 {
            None
        } else {
            Some(Arc::new(tactic.build_pool().map_err(|e| {
                format!("cpu tactic threads={}: {e}", tactic.threads)
            })?))
        };
        Ok(Self { tactic, pool })
    }

    pub fn tactic(&self) -> &CpuTactic {
        &self.tactic
    }

    fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        match &self.pool {
            Some(pool) => pool.install(f),
            None => f(),
        }
    }
}

impl Backend for TunedCpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn matmul(&self, x: &[f32], tokens: usize, w: MatrixView<'_>, out: &mut [f32]) {
        self.run(|| kernels::dense::matmul_transposed_tuned(&self.tactic, x, tokens, w, out));
    }

    fn matmul_per_head(&self, x: &[f32], tokens: usize, w: &[MatrixView<'_>], out: &mut [f32]) {
        self.run(|| kernels::dense::matmul_per_head_tuned(&self.tactic, x, tokens, w, out));
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
        self.run(|| {
            kernels::moe_gemm::cpu::moe_cpu_tuned(
                &self.tactic,
                Isa::detect(),
                x,
                hidden,
                routing,
                experts,
                out,
                amax,
            )
        });
    }

    fn mla_attention(
        &self,
        cache: &PagedLatentCache,
        problem: &MlaProblem<'_>,
        out: &mut [f32],
        lse: &mut [f32],
    ) -> Result<(), CacheError> {
        self.run(|| kernels::mla::cpu::mla_attention_tuned(&self.tactic, cache, problem, out, lse))
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn matmul(&self, x: &[f32], tokens: usize, w: MatrixView<'_>, out: &mut [f32]) {
        kernels::dense::matmul_transposed(x, tokens, w, out);
    }

    fn matmul_per_head(&self, x: &[f32], tokens: usize, w: &[MatrixView<'_>], out: &mut [f32]) {
        kernels::dense::matmul_per_head_tuned(&CpuTactic::DEFAULT, x, tokens, w, out);
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
