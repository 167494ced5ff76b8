//! Checks of the two tactics of the dense BF16 products ([`DenseTactic`]) on Kimi-K2.5's
//! tensor-parallel decode shapes, generic over the [`Device`]:
//! - ours (`layers.cu`'s `dense_bf16`) against an f64 product of its FP32 activations;
//! - the vendor product ([`Device::blas_gemm`]: cuBLASLt on a GPU, the reference of its
//!   semantics on the host execution layer) against an f64 product of the activations rounded
//!   to BF16 (what the executor hands it), into a strided output, overwriting and
//!   accumulating, eagerly and replayed from a captured graph;
//! - the two against each other: they differ by the activations' BF16 rounding only.
//!
//! `host_dense.rs` runs them on the host execution layer (where the vendor side is the
//! reference, so that part checks the plumbing: addresses, strides, β, capture);
//! `gpu_dense.rs` runs them on a GPU, where the vendor side is cuBLASLt, and times both.

use half::bf16;
use kernels::device::{BlasGemm, Device, DeviceError, DeviceExt, DeviceMemory};
use kernels::layers::{DenseOutput, LayerKernels};
use kernels::rng::Rng;
use model::arch::config::ModelConfig;
use model::arch::presets::Preset;

/// One dense product of a rank: `[n][k]` weights.
#[derive(Clone, Copy, Debug)]
pub struct Product {
    pub name: &'static str,
    pub n: usize,
    pub k: usize,
}

/// The dense products of one Kimi-K2.5 decode step on a rank of `world` (each layer's, once).
pub fn kimi_products(world: usize) -> Vec<Product> {
    let c: ModelConfig = Preset::KimiK25.model_config();
    let (h, heads) = (c.hidden_size, c.num_attention_heads / world);
    let q_rank = c.q_lora_rank.expect("Kimi has a low-rank query");
    let shared = c.moe_intermediate_size * c.n_shared_experts / world;
    let p = |name, n, k| Product { name, n, k };
    vec![
        p("q_a_proj", q_rank, h),
        p("q_b_proj", heads * c.qk_head_dim(), q_rank),
        p("kv_a_proj (latent)", c.kv_lora_rank, h),
        p("kv_a_proj (rope)", c.qk_rope_head_dim, h),
        p("o_proj", h, heads * c.v_head_dim),
        p("router", c.n_routed_experts, h),
        p("shared gate/up", 2 * shared, h),
        p("shared down", h, shared),
        p("dense gate/up", 2 * c.intermediate_size / world, h),
        p("dense down", h, c.intermediate_size / world),
        p("lm_head", c.vocab_size.div_ceil(world), h),
    ]
}

/// Inputs of one product on the device, and what it needs to compare.
pub struct Case<D: Device> {
    pub product: Product,
    pub tokens: usize,
    pub x: Vec<f32>,
    pub x_bf16: Vec<bf16>,
    pub w: Vec<bf16>,
    pub x_d: D::Memory,
    pub x_bf16_d: D::Memory,
    pub w_d: D::Memory,
}

impl<D: Device> Case<D> {
    pub fn new(dev: &D, product: Product, tokens: usize, seed: u64) -> Self {
        let mut rng = Rng(seed);
        let x: Vec<f32> = (0..tokens * product.k).map(|_| rng.sym() * 2.0).collect();
        let w: Vec<bf16> = (0..product.n * product.k)
            .map(|_| bf16::from_f32(rng.sym() * 0.05))
            .collect();
        let x_bf16: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
        Self {
            x_d: dev.upload(&x).unwrap(),
            x_bf16_d: dev.upload(&x_bf16).unwrap(),
            w_d: dev.upload(&w).unwrap(),
            product,
            tokens,
            x,
            x_bf16,
            w,
        }
    }

    /// Our product into packed rows of `y`.
    pub fn ours(&self, dev: &D, k: &LayerKernels<D>, y: &D::Memory, accumulate: bool) {
        let Product { n, k: kk, .. } = self.product;
        k.dense_bf16(dev, &self.x_d, self.tokens, &self.w_d, kk, n, y, accumulate)
            .unwrap();
    }

    /// The vendor product into `y`, rows `out.row_stride` apart from `out.offset`.
    pub fn vendor(&self, dev: &D, y: &D::Memory, out: DenseOutput, accumulate: bool) {
        let Product { n, k, .. } = self.product;
        let gemm = BlasGemm {
            m: self.tokens,
            n,
            k,
            a: self.w_d.device_ptr(),
            b: self.x_bf16_d.device_ptr(),
            d: y.device_ptr() + (out.offset * 4) as u64,
            ldd: out.row_stride,
            accumulate,
        };
        assert!(y.len() >= (out.offset + gemm.d_span()) * 4);
        // SAFETY: the addresses are this case's uploads and `y`, checked to hold the output.
        unsafe { dev.blas_gemm(&gemm) }.unwrap();
    }

    /// `(value, magnitude)` of output `(t, j)` in f64: `Σ x·w` and `Σ |x·w|`, with the
    /// activations as FP32 or rounded to BF16.
    pub fn exact(&self, t: usize, j: usize, rounded: bool) -> (f64, f64) {
        let k = self.product.k;
        let w = &self.w[j * k..(j + 1) * k];
        let (mut sum, mut mag) = (0.0f64, 0.0f64);
        for (i, wi) in w.iter().enumerate() {
            let x = if rounded {
                self.x_bf16[t * k + i].to_f64()
            } else {
                self.x[t * k + i] as f64
            };
            let p = x * wi.to_f64();
            sum += p;
            mag += p.abs();
        }
        (sum, mag)
    }
}

/// The largest `|got - exact| / Σ|x·w|` over packed rows `got [tokens][n]` (+ `prior`).
pub fn worst_error<D: Device>(
    case: &Case<D>,
    got: &[f32],
    prior: Option<&[f32]>,
    rounded: bool,
) -> f64 {
    let n = case.product.n;
    let mut worst = 0.0f64;
    for t in 0..case.tokens {
        for j in 0..n {
            let (mut sum, mut mag) = case.exact(t, j, rounded);
            if let Some(p) = prior {
                sum += p[t * n + j] as f64;
                mag += (p[t * n + j] as f64).abs();
            }
            let g = got[t * n + j];
            assert!(g.is_finite(), "{} ({t}, {j}): {g}", case.product.name);
            worst = worst.max((g as f64 - sum).abs() / mag.max(1e-30));
        }
    }
    worst
}

/// FP32 sums of up to ~20k terms, relative to the sum of magnitudes.
pub const FP32_BOUND: f64 = 2e-5;

/// Whether `dev` can run the vendor's products: `Err` with the reason where its library is
/// missing; any other failure of the library panics (it is a failure, not an absence).
pub fn vendor_ready<D: Device>(dev: &D) -> Result<(), String> {
    match dev.blas_ready() {
        Ok(()) => Ok(()),
        Err(e @ DeviceError::VendorLibraryMissing { .. }) => Err(e.to_string()),
        Err(e) => panic!("the vendor library: {e}"),
    }
}

/// Runs every check on `products` at `tokens` rows; returns, per (product, tokens), the
/// worst errors of ours and of the vendor product and their largest relative difference.
pub fn check_products<D: Device>(
    dev: &D,
    k: &LayerKernels<D>,
    products: &[Product],
    tokens: &[usize],
) -> Vec<String> {
    let mut lines = Vec::new();
    // Without the vendor library (a driver-only machine) ours is still checked, and the
    // vendor's half is skipped with the reason.
    let vendor_ready = match vendor_ready(dev) {
        Ok(()) => true,
        Err(why) => {
            lines.push(format!("SKIP vendor products: {why}"));
            false
        }
    };
    for (i, &product) in products.iter().enumerate() {
        for &m in tokens {
            let case = Case::new(dev, product, m, 0xd0 + i as u64 * 31 + m as u64);
            let n = product.n;
            let packed = dev.alloc_elements::<f32>(m * n).unwrap();
            case.ours(dev, k, &packed, false);
            let ours: Vec<f32> = dev.download_first(&packed, m * n).unwrap();
            let ours_err = worst_error(&case, &ours, None, false);
            if !vendor_ready {
                let line = format!(
                    "{:<20} m {m:>2} n {n:>6} k {:>5}: ours {ours_err:.1e} of Σ|x·w|",
                    product.name, product.k
                );
                assert!(ours_err < FP32_BOUND, "ours: {line}");
                lines.push(line);
                continue;
            }
            // The vendor product into columns 3.. of rows n + 5 wide, first overwriting, then
            // accumulating onto its own result; the gaps keep a marker.
            let out = DenseOutput {
                offset: 3,
                row_stride: n + 5,
            };
            let marker = -7.25f32;
            let wide = dev.upload(&vec![marker; out.span(m, n) + 2]).unwrap();
            case.vendor(dev, &wide, out, false);
            let got: Vec<f32> = dev.download(&wide).unwrap();
            let unpack = |all: &[f32]| -> Vec<f32> {
                (0..m)
                    .flat_map(|t| all[3 + t * (n + 5)..3 + t * (n + 5) + n].to_vec())
                    .collect()
            };
            let vendor = unpack(&got);
            for (e, &v) in got.iter().enumerate() {
                let inside = e >= 3 && (e - 3) / (n + 5) < m && (e - 3) % (n + 5) < n;
                if !inside {
                    assert_eq!(
                        v, marker,
                        "{}: element {e} outside the rows written",
                        product.name
                    );
                }
            }
            let vendor_err = worst_error(&case, &vendor, None, true);
            // Accumulate, inside a captured graph, replayed once.
            dev.begin_capture().unwrap();
            case.vendor(dev, &wide, out, true);
            let graph = dev.end_capture().unwrap();
            dev.replay(&graph).unwrap();
            let twice = unpack(&dev.download::<f32>(&wide).unwrap());
            let accumulated_err = worst_error(&case, &twice, Some(&vendor), true);
            let apart = ours
                .iter()
                .zip(&vendor)
                .map(|(a, b)| ((a - b).abs() / (a.abs() + 1e-3)) as f64)
                .fold(0.0, f64::max);
            let line = format!(
                "{:<20} m {m:>2} n {n:>6} k {:>5}: ours {ours_err:.1e}, vendor {vendor_err:.1e} \
                 (accumulated in a graph {accumulated_err:.1e}) of Σ|x·w|; apart {apart:.1e}",
                product.name, product.k
            );
            assert!(ours_err < FP32_BOUND, "ours: {line}");
            assert!(vendor_err < FP32_BOUND, "vendor: {line}");
            assert!(accumulated_err < FP32_BOUND, "vendor, accumulated: {line}");
            lines.push(line);
        }
    }
    lines
}
