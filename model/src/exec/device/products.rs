//! The device step's dense BF16 products under its [`DenseTactic`].

use kernels::blas::DenseTactic;
use kernels::device::{BlasGemm, Device, DeviceError, DeviceMemory};
use kernels::layers::{DenseOutput, LayerKernels};

/// A step's dense BF16 products under its [`DenseTactic`]: our `dense_bf16`, or the vendor
/// library (cuBLASLt), whose input is the activations rounded to BF16 into `input` first.
pub struct Products<'a, D: Device> {
    k: &'a LayerKernels<D>,
    tactic: DenseTactic,
    input: &'a D::Memory,
}

impl<'a, D: Device> Products<'a, D> {
    pub fn new(k: &'a LayerKernels<D>, tactic: DenseTactic, input: &'a D::Memory) -> Self {
        Self { k, tactic, input }
    }

    /// `y [tokens][n] (+)= x [tokens][k] · Wᵀ`, as [`LayerKernels::dense_bf16`].
    #[allow(clippy::too_many_arguments)]
    pub fn product(
        &self,
        dev: &D,
        x: &D::Memory,
        tokens: usize,
        w: &D::Memory,
        k: usize,
        n: usize,
        y: &D::Memory,
        accumulate: bool,
    ) -> Result<(), DeviceError> {
        let out = DenseOutput::packed(n);
        self.product_into(dev, x, tokens, w, k, n, y, out, accumulate)
    }

    /// As [`product`](Self::product), rows placed as `out` says.
    #[allow(clippy::too_many_arguments)]
    pub fn product_into(
        &self,
        dev: &D,
        x: &D::Memory,
        tokens: usize,
        w: &D::Memory,
        k: usize,
        n: usize,
        y: &D::Memory,
        out: DenseOutput,
        accumulate: bool,
    ) -> Result<(), DeviceError> {
        match self.tactic {
            DenseTactic::Ours => self
                .k
                .dense_bf16_into(dev, x, tokens, w, k, n, y, out, accumulate),
            DenseTactic::CublasLt => {
                let too_small = |what: &str, have: usize, need: usize| {
                    DeviceError::Invalid(format!(
                        "{}: {what} holds {have} B, the product needs {need} B",
                        kernels::blas::FAMILY
                    ))
                };
                let gemm = BlasGemm {
                    m: tokens,
                    n,
                    k,
                    a: w.device_ptr(),
                    b: self.input.device_ptr(),
                    d: y.device_ptr() + (out.offset * 4) as u64,
                    ldd: out.row_stride,
                    accumulate,
                };
                gemm.validate()?;
                for (what, memory, need) in [
                    ("w", w, n * k * 2),
                    ("the BF16 input", self.input, tokens * k * 2),
                    ("y", y, (out.offset + gemm.d_span()) * 4),
                ] {
                    if memory.len() < need {
                        return Err(too_small(what, memory.len(), need));
                    }
                }
                self.k
                    .to_bf16_strided(dev, x, tokens, k, 0, 0, 1, k, self.input)?;
                // SAFETY: every address is an allocation of `dev` checked above to hold what
                // the product reads and writes.
                unsafe { dev.blas_gemm(&gemm) }
            }
        }
    }
}
