//! The one seam between kernel launchers and what runs the kernels.
//!
//! A [`Device`] owns device memory, loads a kernel of a (family, tactic) and launches it with
//! CUDA's kernel-parameter convention, and runs the vendor library's dense products described
//! by a [`BlasGemm`] (what the library accepts and computes is [`crate::blas`]'s). Three
//! implement it:
//! - `cuda::GpuContext` (feature `cuda`): a GPU through the CUDA driver (cudarc), with the
//!   cubins of the compile gate;
//! - `cuda_host::HostDevice` (crate `cuda-host`): the same `.cu` sources compiled for the CPU
//!   and run by the host execution layer;
//! - [`dry::DryDevice`]: memory that is only a size and an address, launches checked against
//!   the SM's limits and then dropped: a step's launch list for a model too large to hold.
//!
//! The launchers (`moe_gemm::launch`, `mla::launch`) are written once against this trait, so
//! the argument structs, grid geometry, buffer sizing and poisoning that a GPU run uses are
//! exactly what the host runs test.

use std::ffi::c_void;
use std::fmt;
use std::marker::PhantomData;
use std::path::PathBuf;

use crate::arch::Sm;
use crate::tactic::ProblemShape;

pub mod dry;

#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// `libcuda.so` (the driver library) could not be opened.
    #[error(
        "no CUDA driver: the driver library (libcuda.so.1) could not be opened; install the \
         NVIDIA driver or put its folder on LD_LIBRARY_PATH"
    )]
    NoDriver,
    /// The driver is there but has no usable device (or refused to initialize).
    #[error("no CUDA device {ordinal}: {detail}")]
    NoDevice { ordinal: usize, detail: String },
    /// The driver panicked inside cudarc (for example a symbol missing from an old driver).
    #[error("CUDA driver library is unusable during {what}: {detail}")]
    DriverPanic { what: String, detail: String },
    /// An operation of the device failed: a driver call, or a host-executed kernel's fault.
    #[error("{what}: {detail}")]
    Driver { what: String, detail: String },
    /// A vendor library (cuBLASLt, NCCL) cannot be opened: what uses it is skipped or falls
    /// back, saying so.
    #[error("{library} could not be opened: {detail}")]
    VendorLibraryMissing { library: String, detail: String },
    /// No kernel family was built for this compute capability.
    #[error(
        "device '{name}' has compute capability {major}.{minor}; kernels are built for sm_90a \
         (9.0) and sm_120a (12.0) only"
    )]
    UnsupportedDevice {
        name: String,
        major: i32,
        minor: i32,
    },
    #[error("no kernel image for {what}: tried {}", list_paths(tried))]
    MissingImage { what: String, tried: Vec<PathBuf> },
    #[error("cannot load kernel image {}: {detail}", path.display())]
    LoadImage { path: PathBuf, detail: String },
    #[error("tactic {tactic} cannot run on {sm}: {why}")]
    TacticNotRunnable {
        tactic: String,
        sm: String,
        why: String,
    },
    #[error("invalid problem for tactic {tactic}: {why}")]
    Shape { tactic: String, why: String },
    #[error("{0}")]
    Invalid(String),
}

fn list_paths(paths: &[PathBuf]) -> String {
    paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

pub type Result<T> = std::result::Result<T, DeviceError>;

/// Grid, block and dynamic shared memory of a launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchConfig {
    pub grid_dim: (u32, u32, u32),
    pub block_dim: (u32, u32, u32),
    pub shared_mem_bytes: u32,
}

/// Device-memory bytes a launch reads and writes at least: each operand once, as its
/// launcher computes it from the launch's sizes (where a count depends on values only the
/// device knows, such as routed experts or context lengths, the bound the grid is sized
/// for). Devices ignore it; a recording device lists it, for the step-time model and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct LaunchTraffic {
    pub read: u64,
    pub written: u64,
}

/// One vendor product: `d[t][j] (+)= Σ_i a[j][i] · b[t][i]` for `t < m`, `j < n`, `i < k`,
/// with `a` BF16 `[n][k]` (the weights, row-major), `b` BF16 `[m][k]` (the activations,
/// row-major), accumulation in FP32 and `d` FP32 with row `t` at `d + t · ldd`. Addresses are
/// device addresses of the device that runs it. What the library accepts and its host
/// reference are [`crate::blas`]'s.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlasGemm {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a: u64,
    pub b: u64,
    pub d: u64,
    /// Elements between rows of `d` (at least `n`).
    pub ldd: usize,
    /// Add into `d` (β = 1) instead of overwriting it (β = 0).
    pub accumulate: bool,
}

impl BlasGemm {
    /// Bytes read and written at least: each operand once (the output too when accumulating).
    pub fn traffic(&self) -> LaunchTraffic {
        let out = (self.m * self.n * 4) as u64;
        LaunchTraffic {
            read: ((self.n + self.m) * self.k * 2) as u64 + if self.accumulate { out } else { 0 },
            written: out,
        }
    }

    /// The product's `m, n, k`, as dense launches name theirs.
    pub fn problem(&self) -> ProblemShape {
        ProblemShape::Dense {
            m: self.m as u32,
            n: self.n as u32,
            k: self.k as u32,
        }
    }

    /// Elements of `d` the product spans.
    pub fn d_span(&self) -> usize {
        (self.m - 1) * self.ldd + self.n
    }
}

/// Kernel arguments in CUDA's `kernelParams` form: one pointer per parameter, to a value laid
/// out as the kernel's parameter type (`#[repr(C)]` structs, device pointers as `u64`,
/// scalars). Borrowed for the launch.
#[derive(Default)]
pub struct KernelParams<'a> {
    ptrs: Vec<*mut c_void>,
    sizes: Vec<usize>,
    traffic: LaunchTraffic,
    problem: Option<ProblemShape>,
    _borrow: PhantomData<&'a ()>,
}

impl<'a> KernelParams<'a> {
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends one by-value parameter.
    pub fn arg<T: Copy>(&mut self, value: &'a T) -> &mut Self {
        self.ptrs.push(value as *const T as *mut c_void);
        self.sizes.push(std::mem::size_of::<T>());
        self
    }

    /// Records the bytes the launch reads and writes (see [`LaunchTraffic`]).
    pub fn traffic(&mut self, read: usize, written: usize) -> &mut Self {
        self.traffic = LaunchTraffic {
            read: read as u64,
            written: written as u64,
        };
        self
    }

    /// Names the problem the launch computes where a cost model prices it by shape (a dense
    /// product's `m, n, k`). Devices ignore it; a recording device lists it.
    pub fn problem(&mut self, shape: ProblemShape) -> &mut Self {
        self.problem = Some(shape);
        self
    }

    /// What [`problem`](Self::problem) recorded.
    pub fn launch_problem(&self) -> Option<&ProblemShape> {
        self.problem.as_ref()
    }

    /// What [`traffic`](Self::traffic) recorded (zero when the launcher did not say).
    pub fn launch_traffic(&self) -> LaunchTraffic {
        self.traffic
    }

    pub fn len(&self) -> usize {
        self.ptrs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ptrs.is_empty()
    }

    /// Byte size of each parameter, in order.
    pub fn sizes(&self) -> &[usize] {
        &self.sizes
    }

    /// Appends one by-value parameter given as its bytes (a replayed capture's copy).
    pub fn arg_bytes(&mut self, bytes: &'a [u8]) -> &mut Self {
        self.ptrs.push(bytes.as_ptr() as *mut c_void);
        self.sizes.push(bytes.len());
        self
    }

    /// Copies of every parameter's bytes, in order (what a capture keeps).
    pub fn to_bytes(&self) -> Vec<Vec<u8>> {
        self.ptrs
            .iter()
            .zip(&self.sizes)
            .map(|(&p, &n)| {
                // SAFETY: each pointer was made from a borrowed value of exactly `n` bytes,
                // alive for 'a.
                unsafe { std::slice::from_raw_parts(p as *const u8, n) }.to_vec()
            })
            .collect()
    }

    /// The pointer array `cuLaunchKernel` takes (a copy; the values stay borrowed).
    pub fn raw(&self) -> Vec<*mut c_void> {
        self.ptrs.clone()
    }
}

/// Memory on a device, addressed by kernels through [`device_ptr`](DeviceMemory::device_ptr).
pub trait DeviceMemory: Send + Sync {
    fn device_ptr(&self) -> u64;
    /// Size in bytes.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Something kernels run on. See the module documentation.
pub trait Device {
    type Memory: DeviceMemory;
    /// A loaded kernel, ready to launch.
    type Kernel;
    /// A captured sequence of launches and fills, replayed as one unit (a CUDA graph).
    type Graph;

    /// For messages: the GPU's name, or what the host layer emulates.
    fn describe(&self) -> String;
    /// The SM whose tactics and limits apply.
    fn sm(&self) -> Result<Sm>;
    /// Dynamic shared memory a block may opt into.
    fn max_dynamic_shared(&self) -> usize;
    /// `(free, total)` bytes of device memory now, where the device has a fixed amount (a GPU);
    /// `None` for memory that is the host's.
    fn memory_info(&self) -> Option<(usize, usize)> {
        None
    }

    fn alloc_zeroed(&self, bytes: usize) -> Result<Self::Memory>;
    fn upload_bytes(&self, bytes: &[u8]) -> Result<Self::Memory>;
    /// Copies a whole allocation back; waits for the device's work first.
    fn download_bytes(&self, memory: &Self::Memory) -> Result<Vec<u8>>;
    /// Copies the first `bytes` bytes of an allocation back (all of it if shorter); waits for
    /// the device's work first. A step reads back only the rows it produced.
    fn download_prefix(&self, memory: &Self::Memory, bytes: usize) -> Result<Vec<u8>> {
        let mut v = self.download_bytes(memory)?;
        v.truncate(bytes);
        Ok(v)
    }
    /// Sets every byte of an allocation to `byte` (stream order; captured into a graph).
    fn fill(&self, memory: &mut Self::Memory, byte: u8) -> Result<()> {
        let bytes = memory.len();
        self.fill_prefix(memory, bytes, byte)
    }
    /// Sets the first `bytes` bytes of an allocation (all of it if shorter) to `byte`: a step
    /// clears only the rows it uses.
    fn fill_prefix(&self, memory: &mut Self::Memory, bytes: usize, byte: u8) -> Result<()>;
    /// Copies `bytes` into the start of an existing allocation (stream order): inputs of a
    /// step go into buffers whose addresses stay fixed, as a captured CUDA graph needs.
    fn write_bytes(&self, memory: &mut Self::Memory, bytes: &[u8]) -> Result<()>;

    /// Loads kernel `name` of the (family, tactic) image and allows it `dynamic_shared` bytes
    /// of dynamic shared memory.
    fn load_kernel(
        &self,
        family: &str,
        tactic: &str,
        name: &str,
        dynamic_shared: usize,
    ) -> Result<Self::Kernel>;

    /// Launches `kernel`; may return before it finishes (stream order).
    ///
    /// # Safety
    /// The parameters must match the kernel's signature, and every device address in them
    /// must be an allocation of this device large enough for what the kernel does with it.
    unsafe fn launch(
        &self,
        kernel: &Self::Kernel,
        cfg: LaunchConfig,
        params: &KernelParams<'_>,
    ) -> Result<()>;

    /// Makes [`blas_gemm`](Device::blas_gemm) usable (a GPU opens cuBLASLt and allocates its
    /// workspace), so that nothing is set up while a graph is captured; refuses where there is
    /// no vendor library.
    fn blas_ready(&self) -> Result<()>;

    /// A dense product by the vendor library ([`crate::blas`]: cuBLASLt on a GPU, the
    /// reference of its semantics on the host execution layer), in stream order and captured
    /// into a graph like a launch.
    ///
    /// # Safety
    /// Every address in `gemm` must be an allocation of this device holding what it describes.
    unsafe fn blas_gemm(&self, gemm: &BlasGemm) -> Result<()>;

    /// Waits for every launch and copy issued so far.
    fn synchronize(&self) -> Result<()>;

    /// From now until [`end_capture`](Device::end_capture), launches and fills are recorded
    /// into a graph instead of run. Copies between host and device are refused meanwhile (a
    /// graph replays device work only: a step writes its inputs before replaying).
    fn begin_capture(&self) -> Result<()>;
    /// Ends the capture and returns the graph of what was recorded.
    fn end_capture(&self) -> Result<Self::Graph>;
    /// Runs a captured graph (stream order). The buffers it names must still be alive, and
    /// every value its launches were given is the captured one: only buffer contents change.
    fn replay(&self, graph: &Self::Graph) -> Result<()>;
}

/// Typed conveniences over a [`Device`]'s byte interface.
pub trait DeviceExt: Device {
    fn upload<T: bytemuck::Pod>(&self, values: &[T]) -> Result<Self::Memory> {
        self.upload_bytes(bytemuck::cast_slice(values))
    }

    fn download<T: bytemuck::Pod>(&self, memory: &Self::Memory) -> Result<Vec<T>> {
        let bytes = self.download_bytes(memory)?;
        let n = bytes.len() / std::mem::size_of::<T>();
        let mut out = vec![T::zeroed(); n];
        bytemuck::cast_slice_mut::<T, u8>(&mut out)
            .copy_from_slice(&bytes[..n * std::mem::size_of::<T>()]);
        Ok(out)
    }

    fn write<T: bytemuck::Pod>(&self, memory: &mut Self::Memory, values: &[T]) -> Result<()> {
        self.write_bytes(memory, bytemuck::cast_slice(values))
    }

    /// The first `count` values of an allocation of `T`s.
    fn download_first<T: bytemuck::Pod>(
        &self,
        memory: &Self::Memory,
        count: usize,
    ) -> Result<Vec<T>> {
        let bytes = self.download_prefix(memory, count * std::mem::size_of::<T>())?;
        let n = bytes.len() / std::mem::size_of::<T>();
        let mut out = vec![T::zeroed(); n];
        bytemuck::cast_slice_mut::<T, u8>(&mut out)
            .copy_from_slice(&bytes[..n * std::mem::size_of::<T>()]);
        Ok(out)
    }

    /// An allocation of `count` zeroed `T`s; zero-sized requests get one element, since some
    /// drivers refuse empty allocations.
    fn alloc_elements<T>(&self, count: usize) -> Result<Self::Memory> {
        self.alloc_zeroed(count.max(1) * std::mem::size_of::<T>())
    }
}

impl<D: Device + ?Sized> DeviceExt for D {}

impl fmt::Display for LaunchConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "grid {:?}, block {:?}, {} B dynamic shared memory",
            self.grid_dim, self.block_dim, self.shared_mem_bytes
        )
    }
}
