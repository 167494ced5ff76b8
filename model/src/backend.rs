//! The small set of operations a compute backend provides to the forward pass. The CPU backend
//! implements it with the kernels crate's CPU paths; a CUDA backend implements the same calls.

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

/// The CPU backend under a chosen [`CpuTactic`] (`model run --tactics FILE`, autotune). Its
/// thread count applies to the rayon pool the calls run in, which the process owner builds
/// (see [`CpuTactic::threads`]); every other knob is passed to the kernels with each call.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TunedCpuBackend {
    pub tactic: CpuTactic,
}

impl TunedCpuBackend {
    /// # Panics
    /// If the tactic is invalid (a parsed tactic has been validated).
    pub fn new(tactic: CpuTactic) -> Self {
        if let Err(e) = tactic.validate() {
            panic!("{e}");
        }
        Self { tactic }
    }
}

impl Backend for TunedCpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn matmul(&self, x: &[f32], tokens: usize, w: MatrixView<'_>, out: &mut [f32]) {
        kernels::dense::matmul_transposed_tuned(&self.tactic, x, tokens, w, out);
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
        kernels::moe_gemm::cpu::moe_cpu_tuned(
            &self.tactic,
            Isa::detect(),
            x,
            hidden,
            routing,
            experts,
            out,
            amax,
        );
    }

    fn mla_attention(
        &self,
        cache: &PagedLatentCache,
        problem: &MlaProblem<'_>,
        out: &mut [f32],
        lse: &mut [f32],
    ) -> Result<(), CacheError> {
        kernels::mla::cpu::mla_attention_tuned(&self.tactic, cache, problem, out, lse)
    }
}

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

/// Applies a tactic's thread count to this process: builds rayon's global pool with
/// [`CpuTactic::threads`] threads (0 leaves rayon's default, every core). It must run before
/// anything uses rayon, once per process, which is why it lives at the binary's start and not
/// in the backend: the pool is process-wide and can be built only once.
///
/// # Errors
/// If the global pool was already built with another size.
pub fn install_cpu_threads(tactic: &CpuTactic) -> Result<(), String> {
    if tactic.threads == 0 {
        return Ok(());
    }
    match rayon::ThreadPoolBuilder::new()
        .num_threads(tactic.threads)
        .build_global()
    {
        Ok(()) => Ok(()),
        Err(_) if rayon::current_num_threads() == tactic.threads => Ok(()),
        Err(e) => Err(format!(
            "cpu tactic threads={}: rayon's pool already has {} threads ({e})",
            tactic.threads,
            rayon::current_num_threads()
        )),
    }
}
