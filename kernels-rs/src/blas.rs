//! Dense BF16 products by the vendor library, and the tactic that chooses between them and
//! ours.
//!
//! The device executor's dense products (projections, MLPs, router, `lm_head`) run either on
//! `layers.cu`'s `dense_bf16` (FP32 activations times BF16 weights, one warp per output) or
//! on cuBLASLt (the activations rounded to BF16 first: BF16 × BF16 with FP32 accumulation and
//! an FP32 output, the type the executor's residual stream needs). [`DenseTactic`] names the
//! choice; the tuning lab will decide per shape later.
//!
//! A vendor product is one [`Device::blas_gemm`](crate::device::Device::blas_gemm) call with a
//! [`BlasGemm`], which the device seam defines (it is part of what every device runs); what
//! the library accepts ([`BlasGemm::validate`]) and computes is this module's. On a GPU
//! (feature `cuda`) it is `cublasLtMatmul` on the device's stream, through cudarc with the
//! library opened at run time; on the host execution layer it is [`BlasGemm::run_on_host`], a
//! reference of cuBLASLt's semantics: the one place where the host layer stands in for
//! something other than our CUDA sources.

use std::fmt;
use std::str::FromStr;

use half::bf16;

use crate::device::{BlasGemm, Device, DeviceError, LaunchConfig};
use crate::tactic::TacticError;

/// The family a recorded vendor product is listed under (a launch list's `family/tactic
/// kernel`).
pub const FAMILY: &str = "cublaslt";
/// The product's type combination: BF16 A and B, FP32 compute, scale and output.
pub const TYPES: &str = "bf16_bf16_f32";
/// The kernel name a recorded vendor product is listed under.
pub const KERNEL: &str = "matmul";
/// A vendor product's launch geometry is the library's to choose: recorded as all zeros.
pub const LIBRARY_CHOOSES: LaunchConfig = LaunchConfig {
    grid_dim: (0, 0, 0),
    block_dim: (0, 0, 0),
    shared_mem_bytes: 0,
};

/// Which implementation runs the executor's dense BF16 products.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum DenseTactic {
    /// `layers.cu`'s `dense_bf16`: FP32 activations, BF16 weights, FP32 sums.
    #[default]
    Ours,
    /// cuBLASLt: activations rounded to BF16, FP32 accumulation and output.
    CublasLt,
}

impl DenseTactic {
    pub const ALL: [DenseTactic; 2] = [DenseTactic::Ours, DenseTactic::CublasLt];

    /// Stable identifier (command lines, logs, launch lists). Never renamed.
    pub fn id(self) -> &'static str {
        match self {
            DenseTactic::Ours => "dense_bf16",
            DenseTactic::CublasLt => "cublaslt",
        }
    }

    /// The tactic that runs on `dev`: `self`, or [`DenseTactic::Ours`] with the line to log
    /// where `self` needs a vendor library the machine lacks (a driver-only GPU machine has no
    /// cuBLASLt). Other failures of the library are errors.
    pub fn available_on<D: Device + ?Sized>(
        self,
        dev: &D,
    ) -> Result<(Self, Option<String>), DeviceError> {
        if self != DenseTactic::CublasLt {
            return Ok((self, None));
        }
        match dev.blas_ready() {
            Ok(()) => Ok((self, None)),
            Err(e @ DeviceError::VendorLibraryMissing { .. }) => Ok((
                DenseTactic::Ours,
                Some(format!(
                    "dense tactic {self} unavailable ({e}): the dense products run on {}",
                    DenseTactic::Ours
                )),
            )),
            Err(e) => Err(e),
        }
    }

    pub fn parse(id: &str) -> Result<Self, TacticError> {
        Self::ALL.into_iter().find(|t| t.id() == id).ok_or_else(|| {
            TacticError::Parse(format!(
                "dense tactic {id:?} (one of {})",
                Self::ALL.map(|t| t.id()).join(", ")
            ))
        })
    }
}

impl fmt::Display for DenseTactic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.id())
    }
}

impl FromStr for DenseTactic {
    type Err = TacticError;
    fn from_str(s: &str) -> Result<Self, TacticError> {
        Self::parse(s)
    }
}

/// What the vendor library accepts and computes, on the seam's description of a product.
impl BlasGemm {
    /// What the library and the reference take: sizes from 1 to `i32::MAX`, `ldd >= n`.
    pub fn validate(&self) -> Result<(), DeviceError> {
        let fits = |v: usize| (1..=i32::MAX as usize).contains(&v);
        if !(fits(self.m) && fits(self.n) && fits(self.k) && fits(self.ldd)) || self.ldd < self.n {
            return Err(DeviceError::Invalid(format!(
                "{FAMILY} {KERNEL}: m {} n {} k {} with rows of d {} apart",
                self.m, self.n, self.k, self.ldd
            )));
        }
        Ok(())
    }

    /// Runs the product on the host: the reference of cuBLASLt's semantics ([`reference`]).
    ///
    /// # Safety
    /// `a`, `b` and `d` must be host addresses of live, aligned buffers of at least `n · k`
    /// BF16, `m · k` BF16 and [`d_span`](Self::d_span) FP32 values, `d` not overlapping the
    /// others, and nothing else may use them meanwhile.
    pub unsafe fn run_on_host(&self) -> Result<(), DeviceError> {
        self.validate()?;
        // SAFETY: the caller's contract.
        let (a, b, d) = unsafe {
            (
                std::slice::from_raw_parts(self.a as *const bf16, self.n * self.k),
                std::slice::from_raw_parts(self.b as *const bf16, self.m * self.k),
                std::slice::from_raw_parts_mut(self.d as *mut f32, self.d_span()),
            )
        };
        reference(a, b, d, self);
        Ok(())
    }
}

/// cuBLASLt's semantics for [`BlasGemm`] on host slices: each output the FP32 sum of the
/// exact BF16 × BF16 products (exact in FP32: 8-bit significands), in increasing `i`, then
/// `+ d` when accumulating (α = 1, β = 1). The library sums in an order of its own (split-K,
/// tensor-core fragments), so a GPU agrees with this to FP32 rounding, not bit for bit.
pub fn reference(a: &[bf16], b: &[bf16], d: &mut [f32], g: &BlasGemm) {
    let (m, n, k) = (g.m, g.n, g.k);
    assert!(a.len() >= n * k && b.len() >= m * k && d.len() >= g.d_span());
    for t in 0..m {
        let bt = &b[t * k..(t + 1) * k];
        for j in 0..n {
            let aj = &a[j * k..(j + 1) * k];
            let mut acc = 0.0f32;
            for (x, w) in bt.iter().zip(aj) {
                acc += x.to_f32() * w.to_f32();
            }
            let out = &mut d[t * g.ldd + j];
            *out = if g.accumulate { acc + *out } else { acc };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tactic_ids_round_trip_and_unknown_ones_are_refused() {
        for t in DenseTactic::ALL {
            assert_eq!(DenseTactic::parse(t.id()).unwrap(), t);
            assert_eq!(t.to_string().parse::<DenseTactic>().unwrap(), t);
        }
        let e = DenseTactic::parse("cublas").unwrap_err().to_string();
        assert!(e.contains("dense_bf16, cublaslt"), "{e}");
        assert_eq!(DenseTactic::default(), DenseTactic::Ours);
    }

    /// The reference against an f64 product of the same BF16 values, with a strided,
    /// accumulated output whose gaps keep their values.
    #[test]
    fn the_reference_sums_bf16_products_in_fp32() {
        let (m, n, k, ldd) = (3, 5, 700, 8);
        let value = |i: usize| bf16::from_f32(((i * 7919) % 263) as f32 / 131.0 - 1.0);
        let a: Vec<bf16> = (0..n * k).map(value).collect();
        let b: Vec<bf16> = (0..m * k).map(|i| value(i + 11)).collect();
        let prior: Vec<f32> = (0..m * ldd).map(|i| i as f32 * 0.25).collect();
        for accumulate in [false, true] {
            let g = BlasGemm {
                m,
                n,
                k,
                a: 0,
                b: 0,
                d: 0,
                ldd,
                accumulate,
            };
            let mut d = prior.clone();
            reference(&a, &b, &mut d, &g);
            for t in 0..m {
                for j in 0..ldd {
                    let got = d[t * ldd + j];
                    if j >= n {
                        assert_eq!(got, prior[t * ldd + j], "gap ({t}, {j}) written");
                        continue;
                    }
                    let exact: f64 = (0..k)
                        .map(|i| a[j * k + i].to_f64() * b[t * k + i].to_f64())
                        .sum::<f64>()
                        + if accumulate {
                            prior[t * ldd + j] as f64
                        } else {
                            0.0
                        };
                    assert!(
                        (got as f64 - exact).abs() < 1e-4,
                        "({t}, {j}): {got} vs {exact}"
                    );
                }
            }
        }
        let bad = BlasGemm {
            m: 1,
            n: 4,
            k: 1,
            a: 0,
            b: 0,
            d: 0,
            ldd: 3,
            accumulate: false,
        };
        assert!(bad.validate().unwrap_err().to_string().contains("cublaslt"));
    }
}
