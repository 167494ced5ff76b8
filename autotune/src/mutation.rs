//! A deliberately wrong tactic, to prove the correct stage prunes one: [`Perturbed`] wraps a
//! device and, for the kernels of one (family, tactic), drops the last block of every launch's
//! x dimension — the bug of a grid computed one tile short. Every other tactic runs unchanged.

use kernels::arch::Sm;
use kernels::device::{Device, KernelParams, LaunchConfig, Result};

pub struct Perturbed<'a, D: Device> {
    pub inner: &'a D,
    /// The tactic id whose launches are perturbed.
    pub tactic: String,
}

pub struct PerturbedKernel<K> {
    inner: K,
    perturb: bool,
}

impl<D: Device> Device for Perturbed<'_, D> {
    type Memory = D::Memory;
    type Kernel = PerturbedKernel<D::Kernel>;
    type Graph = D::Graph;

    fn describe(&self) -> String {
        format!(
            "{} (launches of {} perturbed)",
            self.inner.describe(),
            self.tactic
        )
    }

    fn sm(&self) -> Result<Sm> {
        self.inner.sm()
    }

    fn max_dynamic_shared(&self) -> usize {
        self.inner.max_dynamic_shared()
    }

    fn alloc_zeroed(&self, bytes: usize) -> Result<Self::Memory> {
        self.inner.alloc_zeroed(bytes)
    }

    fn upload_bytes(&self, bytes: &[u8]) -> Result<Self::Memory> {
        self.inner.upload_bytes(bytes)
    }

    fn download_bytes(&self, memory: &Self::Memory) -> Result<Vec<u8>> {
        self.inner.download_bytes(memory)
    }

    fn download_prefix(&self, memory: &Self::Memory, bytes: usize) -> Result<Vec<u8>> {
        self.inner.download_prefix(memory, bytes)
    }

    fn fill_prefix(&self, memory: &mut Self::Memory, bytes: usize, byte: u8) -> Result<()> {
        self.inner.fill_prefix(memory, bytes, byte)
    }

    fn write_bytes(&self, memory: &mut Self::Memory, bytes: &[u8]) -> Result<()> {
        self.inner.write_bytes(memory, bytes)
    }

    fn load_kernel(
        &self,
        family: &str,
        tactic: &str,
        name: &str,
        dynamic_shared: usize,
    ) -> Result<Self::Kernel> {
        Ok(PerturbedKernel {
            inner: self
                .inner
                .load_kernel(family, tactic, name, dynamic_shared)?,
            perturb: tactic == self.tactic,
        })
    }

    unsafe fn launch(
        &self,
        kernel: &Self::Kernel,
        mut cfg: LaunchConfig,
        params: &KernelParams<'_>,
    ) -> Result<()> {
        if kernel.perturb && cfg.grid_dim.0 > 1 {
            cfg.grid_dim.0 -= 1;
        }
        // SAFETY: forwarded; a smaller grid touches a subset of what the full one does.
        unsafe { self.inner.launch(&kernel.inner, cfg, params) }
    }

    fn blas_ready(&self) -> Result<()> {
        self.inner.blas_ready()
    }

    unsafe fn blas_gemm(&self, gemm: &kernels::device::BlasGemm) -> Result<()> {
        // SAFETY: forwarded; the vendor library is never perturbed.
        unsafe { self.inner.blas_gemm(gemm) }
    }

    fn synchronize(&self) -> Result<()> {
        self.inner.synchronize()
    }

    fn begin_capture(&self) -> Result<()> {
        self.inner.begin_capture()
    }

    fn end_capture(&self) -> Result<Self::Graph> {
        self.inner.end_capture()
    }

    fn replay(&self, graph: &Self::Graph) -> Result<()> {
        self.inner.replay(graph)
    }
}
