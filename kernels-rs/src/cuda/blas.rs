//! cuBLASLt behind [`Device::blas_gemm`](crate::device::Device::blas_gemm) on a GPU: cudarc's
//! bindings with `libcublasLt` opened at run time (no toolkit needed to build), one handle and
//! one workspace per [`GpuContext`](super::GpuContext), and per product shape the descriptors
//! and the algorithm the library's heuristic picks, made once (host calls only, so a product
//! inside a captured graph needs nothing set up during the capture).

use std::collections::HashMap;
use std::ffi::c_void;
use std::mem::size_of;
use std::sync::Arc;

use cudarc::cublaslt::result::{self as lt, CublasError};
use cudarc::cublaslt::sys;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

use super::driver_errors::{Context, no_panic};
use crate::blas::{FAMILY, KERNEL};
use crate::device::{BlasGemm, DeviceError, Result};

/// The workspace NVIDIA recommends for Hopper and later (SM90, SM120): 32 MiB.
const WORKSPACE_BYTES: usize = 32 << 20;
/// `CUBLAS_OP_N` and `CUBLAS_OP_T` of `cublasOperation_t`.
const OP_N: i32 = 0;
const OP_T: i32 = 1;

/// Whether `libcublasLt` can be opened. Never panics.
pub fn library_present() -> bool {
    // SAFETY: only tries to dlopen the library candidates and drops them again.
    unsafe { sys::is_culib_present() }
}

fn lt_error(what: impl FnOnce() -> String) -> impl FnOnce(CublasError) -> DeviceError {
    move |e| DeviceError::Driver {
        what: what(),
        detail: format!("{e:?}"),
    }
}

/// Descriptors and algorithm of one product shape.
struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    d: sys::cublasLtMatrixLayout_t,
    algo: sys::cublasLtMatmulAlgo_t,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each was created once by `Plan::new` and is destroyed once here; a failed
        // destroy leaks a descriptor, which is all it can do.
        unsafe {
            let _ = lt::destroy_matrix_layout(self.a);
            let _ = lt::destroy_matrix_layout(self.b);
            let _ = lt::destroy_matrix_layout(self.d);
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

/// `(m, n, k, ldd)` of a product and the alignment of its A, B and D addresses: what its
/// descriptors and algorithm depend on (β is a call argument).
type Shape = (usize, usize, usize, usize, [u32; 3]);

/// The alignment, in bytes, cuBLASLt may assume of `ptr`: its largest power-of-two divisor,
/// at most 256. Told nothing, the heuristic assumes 256 and may pick a kernel with vector
/// loads that an address inside an allocation (`lm_head`'s output columns of a TP rank, an
/// offset into the workspace) does not allow: the alignment is part of the plan.
fn alignment(ptr: u64) -> u32 {
    1 << ptr.trailing_zeros().min(8)
}

/// The library state of one context. See the module documentation.
pub(crate) struct Blas {
    handle: sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    plans: HashMap<Shape, Plan>,
}

// SAFETY: the handle and descriptors are plain library objects, used under the context's
// mutex only; cuBLASLt handles may move between threads.
unsafe impl Send for Blas {}

impl Drop for Blas {
    fn drop(&mut self) {
        self.plans.clear();
        // SAFETY: created once in `open`, destroyed once here, after every plan.
        unsafe {
            let _ = lt::destroy_handle(self.handle);
        }
    }
}

impl Blas {
    /// Opens the library and allocates the workspace on `stream`'s context.
    pub(crate) fn open(stream: &Arc<CudaStream>) -> Result<Self> {
        if !library_present() {
            return Err(DeviceError::VendorLibraryMissing {
                library: "libcublasLt".into(),
                detail: "install the CUDA cuBLAS runtime or put its folder on LD_LIBRARY_PATH"
                    .into(),
            });
        }
        no_panic("cuBLASLt initialization", || {
            let handle = lt::create_handle().map_err(lt_error(|| "cublasLtCreate".into()))?;
            let workspace = stream
                .alloc_zeros::<u8>(WORKSPACE_BYTES)
                .during(|| format!("{FAMILY}: workspace of {WORKSPACE_BYTES} B"));
            match workspace {
                Ok(workspace) => Ok(Self {
                    handle,
                    workspace,
                    plans: HashMap::new(),
                }),
                Err(e) => {
                    // SAFETY: just created, used by nothing.
                    unsafe {
                        let _ = lt::destroy_handle(handle);
                    }
                    Err(e)
                }
            }
        })
    }

    /// The plan of `g`'s shape, made on first use.
    fn plan(&mut self, g: &BlasGemm) -> Result<Shape> {
        let align = [alignment(g.a), alignment(g.b), alignment(g.d)];
        let key = (g.m, g.n, g.k, g.ldd, align);
        if !self.plans.contains_key(&key) {
            let plan = no_panic("cuBLASLt descriptors", || Plan::new(self.handle, g, align))?;
            self.plans.insert(key, plan);
        }
        Ok(key)
    }

    /// Enqueues `g` on `stream`.
    ///
    /// # Safety
    /// `g`'s addresses are live allocations of `stream`'s context holding what it describes.
    pub(crate) unsafe fn gemm(&mut self, stream: &Arc<CudaStream>, g: &BlasGemm) -> Result<()> {
        g.validate()?;
        let key = self.plan(g)?;
        let (handle, plan) = (self.handle, &self.plans[&key]);
        let (workspace, _sync) = self.workspace.device_ptr(stream);
        let (alpha, beta) = (1.0f32, if g.accumulate { 1.0f32 } else { 0.0 });
        no_panic("cublasLtMatmul", || {
            // SAFETY: the descriptors describe `g`'s buffers (the caller's contract), C is D
            // (β = 1 accumulates in place), the workspace is this context's.
            unsafe {
                lt::matmul(
                    handle,
                    plan.desc,
                    (&alpha as *const f32).cast::<c_void>(),
                    (&beta as *const f32).cast::<c_void>(),
                    g.a as *const c_void,
                    plan.a,
                    g.b as *const c_void,
                    plan.b,
                    g.d as *const c_void,
                    plan.d,
                    g.d as *mut c_void,
                    plan.d,
                    &plan.algo,
                    workspace as *mut c_void,
                    WORKSPACE_BYTES,
                    stream.cu_stream() as sys::cudaStream_t,
                )
            }
            .map_err(lt_error(|| {
                format!(
                    "{FAMILY} {KERNEL} m {} n {} k {} ldd {}",
                    g.m, g.n, g.k, g.ldd
                )
            }))
        })
    }
}

impl Plan {
    /// Column-major, as the library sees it: `Dᵀ [n × m] = op(A) [n × k] · B [k × m]` with
    /// `A` the row-major weights `[n][k]` (a `k × n` column-major matrix, transposed), `B` the
    /// row-major activations `[m][k]` (`k × m`, as is) and `D` the output rows (`n × m`,
    /// leading dimension `ldd`).
    fn new(handle: sys::cublasLtHandle_t, g: &BlasGemm, align: [u32; 3]) -> Result<Self> {
        use sys::cublasLtMatmulDescAttributes_t as Attr;
        use sys::cudaDataType_t as T;
        let what = || format!("{FAMILY} descriptors for m {} n {} k {}", g.m, g.n, g.k);
        let (m, n, k, ldd) = (g.m as u64, g.n as u64, g.k as u64, g.ldd as i64);
        let desc =
            lt::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, T::CUDA_R_32F)
                .map_err(lt_error(what))?;
        let mut plan = Self {
            desc,
            a: std::ptr::null_mut(),
            b: std::ptr::null_mut(),
            d: std::ptr::null_mut(),
            // SAFETY: a plain C struct of integers, overwritten by the heuristic below.
            algo: unsafe { std::mem::zeroed() },
        };
        // SAFETY: `desc` is live; each attribute gets a value of its documented type.
        unsafe {
            lt::set_matmul_desc_attribute(
                plan.desc,
                Attr::CUBLASLT_MATMUL_DESC_TRANSA,
                (&OP_T as *const i32).cast(),
                size_of::<i32>(),
            )
            .map_err(lt_error(what))?;
            lt::set_matmul_desc_attribute(
                plan.desc,
                Attr::CUBLASLT_MATMUL_DESC_TRANSB,
                (&OP_N as *const i32).cast(),
                size_of::<i32>(),
            )
            .map_err(lt_error(what))?;
        }
        plan.a =
            lt::create_matrix_layout(T::CUDA_R_16BF, k, n, k as i64).map_err(lt_error(what))?;
        plan.b =
            lt::create_matrix_layout(T::CUDA_R_16BF, k, m, k as i64).map_err(lt_error(what))?;
        plan.d = lt::create_matrix_layout(T::CUDA_R_32F, n, m, ldd).map_err(lt_error(what))?;
        let pref = lt::create_matmul_pref().map_err(lt_error(what))?;
        // SAFETY: `pref` and the descriptors are live; the attribute is a usize.
        let heuristic = unsafe {
            let set = lt::set_matmul_pref_attribute(
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&WORKSPACE_BYTES as *const usize).cast(),
                size_of::<usize>(),
            );
            use sys::cublasLtMatmulPreferenceAttributes_t as Pref;
            // C is D (accumulation in place).
            let aligns = [
                (Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align[0]),
                (Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align[1]),
                (Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align[2]),
                (Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align[2]),
            ];
            let set = aligns.iter().fold(set, |set, (attr, bytes)| {
                set.and_then(|()| {
                    lt::set_matmul_pref_attribute(
                        pref,
                        *attr,
                        (bytes as *const u32).cast(),
                        size_of::<u32>(),
                    )
                })
            });
            let found = set.and_then(|()| {
                lt::get_matmul_algo_heuristic(
                    handle, plan.desc, plan.a, plan.b, plan.d, plan.d, pref,
                )
            });
            let _ = lt::destroy_matmul_pref(pref);
            found.map_err(lt_error(what))?
        };
        plan.algo = heuristic.algo;
        Ok(plan)
    }
}
