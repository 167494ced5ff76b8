//! CUDA runtime for the kernel families (cargo feature `cuda`).
//!
//! Built on `cudarc`'s driver API with **dynamic loading**: the crate compiles and links with no
//! CUDA toolkit and no driver, and `libcuda` is opened the first time a [`GpuContext`] is made.
//! cudarc panics when the library is missing, so [`GpuContext::new`] checks for it first and
//! returns [`CudaError::NoDriver`]; everything else a driver can refuse comes back as a
//! [`CudaError`] naming the kernel image, kernel and tactic involved.
//!
//! Kernels are not compiled at run time. The compile gate (`scripts/compile-gates.sh`) writes
//! one cubin per (tactic, SM) to `ptx/<family>/<sm>/<tactic>.cubin`, with the PTX beside it;
//! [`kernel_image_candidates`] says which files are tried, in order, for a device.
//!
//! [`GpuContext`] implements [`Device`](crate::device::Device): the kernel families' launchers
//! (`moe_gemm::launch`, `mla::launch`) run on it unchanged.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};

use cudarc::driver::sys::{CUdevice_attribute, CUevent_flags, CUfunction_attribute};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr,
    DevicePtrMut,
};
use cudarc::nvrtc::Ptx;

use crate::device::{BlasGemm, Device, DeviceMemory, KernelParams, LaunchConfig};

mod blas;
mod driver_errors;
use crate::arch::Sm;
pub use blas::library_present as cublaslt_present;
use driver_errors::{Context, no_panic};

pub use crate::tactic::timing::PTX_DIR_ENV;

/// Errors of the CUDA runtime are the device seam's errors.
pub use crate::device::DeviceError as CudaError;

pub type Result<T> = std::result::Result<T, CudaError>;

/// Whether the driver library can be opened. Cheap; never panics.
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the library candidates and drops them again.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// The device tensor-parallel rank `rank` runs on: rank R on device R, and where the ranks
/// outnumber the devices, round-robin (several rank processes then share a device by
/// time-slicing: a one-GPU machine runs `--tp 2`).
pub fn rank_device(rank: usize) -> Result<usize> {
    if !driver_present() {
        return Err(CudaError::NoDriver);
    }
    let count = no_panic("cuDeviceGetCount", || {
        CudaContext::device_count().during(|| "cuDeviceGetCount".into())
    })?;
    if count <= 0 {
        return Err(CudaError::NoDevice {
            ordinal: rank,
            detail: "the driver reports no device".into(),
        });
    }
    Ok(rank % count as usize)
}

/// The SM whose cubins a device of compute capability `major.minor` runs. The `a` targets
/// (sm_90a, sm_120a) are not forward compatible, so only the exact capabilities match:
/// 12.1 (GB10) cannot run sm_120a code, and 10.x cannot run either.
pub fn sm_for_compute_capability(major: i32, minor: i32) -> Option<Sm> {
    match (major, minor) {
        (9, 0) => Some(Sm::Sm90),
        (12, 0) => Some(Sm::Sm120),
        _ => None,
    }
}

/// The files tried for a kernel image, in order: the gate's cubin (machine code for exactly
/// this SM), then its PTX. The PTX is a fallback only: it is PTX ISA 9.5 from CUDA 13.5, which
/// a driver older than 13.5 cannot JIT, whereas the cubin loads on any 13.x driver.
pub fn kernel_image_candidates(ptx_dir: &Path, family: &str, sm: Sm, tactic: &str) -> [PathBuf; 2] {
    let dir = ptx_dir.join(family).join(sm.arch());
    [
        dir.join(format!("{tactic}.cubin")),
        dir.join(format!("{tactic}.ptx")),
    ]
}

/// The first existing candidate of [`kernel_image_candidates`], or an error listing them.
pub fn find_kernel_image(ptx_dir: &Path, family: &str, sm: Sm, tactic: &str) -> Result<PathBuf> {
    let tried = kernel_image_candidates(ptx_dir, family, sm, tactic);
    tried
        .iter()
        .find(|p| p.is_file())
        .cloned()
        .ok_or_else(|| CudaError::MissingImage {
            what: format!("{family} tactic {tactic} on {sm} (run scripts/compile-gates.sh)"),
            tried: tried.to_vec(),
        })
}

pub use crate::tactic::timing::default_ptx_dir;

/// What the check and the launchers need to know about the device.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    pub compute_capability: (i32, i32),
    /// `None` when no kernels are built for this device.
    pub sm: Option<Sm>,
    pub multiprocessors: usize,
    pub l2_bytes: usize,
    pub smem_optin_per_block: usize,
    pub total_mem: usize,
    pub driver_version: i32,
}

/// The stream every [`GpuContext`] of device `ordinal` in this process issues its work on,
/// made by the first of them and shared while any is alive.
///
/// A created stream, not the legacy (NULL) stream: the driver refuses to begin a capture on
/// the legacy stream. Shared, because work issued through different handles of one device
/// relies on one order: the executor's kernels produce what the IPC communicator
/// (`allreduce::cuda`, which opens its own `GpuContext`) sums, inside the same captured graph,
/// as both did on the legacy stream. Non-blocking: ordered with nothing else, so a
/// synchronous driver call elsewhere (a legacy-stream memset) cannot stall it, nor it them.
fn device_stream(ctx: &Arc<CudaContext>, ordinal: usize) -> Result<Arc<CudaStream>> {
    static STREAMS: Mutex<Vec<(usize, Weak<CudaStream>)>> = Mutex::new(Vec::new());
    let mut streams = STREAMS.lock().unwrap();
    streams.retain(|(_, s)| s.strong_count() > 0);
    if let Some(s) = streams
        .iter()
        .find(|(o, _)| *o == ordinal)
        .and_then(|(_, s)| s.upgrade())
    {
        return Ok(s);
    }
    let s = ctx
        .new_stream()
        .during(|| format!("cuStreamCreate on device {ordinal}"))?;
    streams.push((ordinal, Arc::downgrade(&s)));
    Ok(s)
}

/// One device, its primary context and the device's stream ([`device_stream`]); kernels are
/// loaded per tactic from [`ptx_dir`](GpuContext::ptx_dir).
pub struct GpuContext {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    info: DeviceInfo,
    ptx_dir: PathBuf,
    /// Loaded kernel images by path: the kernels of one tactic share their module.
    modules: Mutex<HashMap<PathBuf, Arc<CudaModule>>>,
    /// cuBLASLt, opened by the first [`Device::blas_ready`].
    blas: Mutex<Option<blas::Blas>>,
}

impl GpuContext {
    /// Opens device `ordinal`. Returns [`CudaError::NoDriver`] (never panics) when the driver
    /// library is missing.
    pub fn new(ordinal: usize, ptx_dir: impl Into<PathBuf>) -> Result<Self> {
        if !driver_present() {
            return Err(CudaError::NoDriver);
        }
        let ptx_dir = ptx_dir.into();
        no_panic("context creation", || {
            let ctx = CudaContext::new(ordinal).map_err(|e| CudaError::NoDevice {
                ordinal,
                detail: e.to_string(),
            })?;
            // One stream, in-order: every ordering the launches need is stream order. cudarc's
            // per-slice event tracking would add an event record per argument per launch,
            // which would also sit inside the timed regions.
            // SAFETY: the crate orders its streams itself: one per device (`device_stream`),
            // and the all-reduce's per-rank streams synchronize before their buffers are
            // shared.
            unsafe { ctx.disable_event_tracking() };
            let stream = device_stream(&ctx, ordinal)?;
            let attr = |a: CUdevice_attribute| -> Result<usize> {
                Ok(ctx
                    .attribute(a)
                    .during(|| format!("device attribute {a:?}"))? as usize)
            };
            let compute_capability = ctx
                .compute_capability()
                .during(|| "cuDeviceGetAttribute(compute capability)".into())?;
            let mut driver_version = 0i32;
            // SAFETY: plain out-parameter call.
            unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver_version) }
                .result()
                .during(|| "cuDriverGetVersion".into())?;
            let info = DeviceInfo {
                ordinal,
                name: ctx.name().during(|| "cuDeviceGetName".into())?,
                compute_capability,
                sm: sm_for_compute_capability(compute_capability.0, compute_capability.1),
                multiprocessors: attr(
                    CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                )?,
                l2_bytes: attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)?,
                smem_optin_per_block: attr(
                    CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                )?,
                total_mem: ctx.total_mem().during(|| "cuDeviceTotalMem".into())?,
                driver_version,
            };
            Ok(Self {
                ctx,
                stream,
                info,
                ptx_dir,
                modules: Mutex::new(HashMap::new()),
                blas: Mutex::new(None),
            })
        })
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    pub fn ptx_dir(&self) -> &Path {
        &self.ptx_dir
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The SM kernels are built for, or [`CudaError::UnsupportedDevice`].
    pub fn sm(&self) -> Result<Sm> {
        self.info.sm.ok_or_else(|| CudaError::UnsupportedDevice {
            name: self.info.name.clone(),
            major: self.info.compute_capability.0,
            minor: self.info.compute_capability.1,
        })
    }

    pub fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .during(|| "stream synchronize".into())
    }

    /// An event that records timestamps (cudarc's default event has timing disabled).
    pub fn timing_event(&self) -> Result<CudaEvent> {
        self.ctx
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .during(|| "cuEventCreate".into())
    }

    pub fn record(&self, event: &CudaEvent) -> Result<()> {
        event.record(&self.stream).during(|| "cuEventRecord".into())
    }

    /// Device copy bandwidth: median over `iters` of a `bytes`-sized device-to-device copy,
    /// counting bytes read plus bytes written, in bytes per second. The ceiling the MoE
    /// kernels' weight bandwidth is compared with.
    pub fn copy_bandwidth(&self, bytes: usize, warmup: usize, iters: usize) -> Result<f64> {
        let n = bytes / 4;
        let src: CudaSlice<u32> = self
            .stream
            .alloc_zeros(n)
            .during(|| format!("alloc {bytes} B"))?;
        let mut dst: CudaSlice<u32> = self
            .stream
            .alloc_zeros(n)
            .during(|| format!("alloc {bytes} B"))?;
        let (start, end) = (self.timing_event()?, self.timing_event()?);
        let mut times = Vec::with_capacity(iters);
        for i in 0..warmup + iters {
            self.record(&start)?;
            self.stream
                .memcpy_dtod(&src, &mut dst)
                .during(|| "cuMemcpyDtoDAsync".into())?;
            self.record(&end)?;
            end.synchronize().during(|| "event synchronize".into())?;
            if i >= warmup {
                times.push(
                    start
                        .elapsed_ms(&end)
                        .during(|| "cuEventElapsedTime".into())? as f64,
                );
            }
        }
        let ms = median(&mut times);
        Ok(2.0 * (n * 4) as f64 / (ms * 1e-3))
    }
}

/// Loads a kernel image (cubin, or PTX text) into the context.
pub(crate) fn load_module(gpu: &GpuContext, path: &Path) -> Result<Arc<CudaModule>> {
    if let Some(m) = gpu.modules.lock().unwrap().get(path) {
        return Ok(m.clone());
    }
    // Every image of `ptx/` together is well under 1 MiB.
    const IMAGE_LIMIT: u64 = 64 << 20;
    let bytes =
        crate::files::read_bounded(path, IMAGE_LIMIT).map_err(|e| CudaError::LoadImage {
            path: path.to_path_buf(),
            detail: e.to_string(),
        })?;
    let is_ptx = path.extension().is_some_and(|e| e == "ptx");
    let image = if is_ptx {
        // PTX text is handed to cuModuleLoadData NUL-terminated (from_src adds the NUL).
        Ptx::from_src(String::from_utf8(bytes).map_err(|e| CudaError::LoadImage {
            path: path.to_path_buf(),
            detail: format!("PTX is not UTF-8: {e}"),
        })?)
    } else {
        Ptx::from_binary(bytes)
    };
    let module = gpu
        .context()
        .load_module(image)
        .map_err(|e| CudaError::LoadImage {
            path: path.to_path_buf(),
            detail: format!(
                "cuModuleLoadData: {e}{}",
                if is_ptx {
                    " (the PTX is ISA 9.5 from CUDA 13.5; older drivers cannot JIT it)"
                } else {
                    ""
                }
            ),
        })?;
    gpu.modules
        .lock()
        .unwrap()
        .insert(path.to_path_buf(), module.clone());
    Ok(module)
}

/// Device memory of a [`GpuContext`]: the allocation and its address (fixed for its life).
pub struct GpuMemory {
    slice: CudaSlice<u8>,
    ptr: u64,
    len: usize,
}

impl DeviceMemory for GpuMemory {
    fn device_ptr(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
}

/// A loaded kernel with what the driver reports about it.
pub struct GpuKernel {
    pub function: CudaFunction,
    /// The image it came from (cubin, or PTX as a fallback).
    pub image: PathBuf,
    pub name: String,
    pub tactic: String,
    pub registers: i32,
    pub max_threads_per_block: i32,
    pub static_shared_bytes: usize,
}

impl GpuContext {
    fn memory(&self, slice: CudaSlice<u8>, len: usize) -> GpuMemory {
        let ptr = {
            let (ptr, _sync) = slice.device_ptr(&self.stream);
            ptr
        };
        GpuMemory { slice, ptr, len }
    }
}

impl Device for GpuContext {
    type Graph = cudarc::driver::CudaGraph;
    type Memory = GpuMemory;
    type Kernel = GpuKernel;

    fn describe(&self) -> String {
        format!(
            "{} (compute capability {}.{})",
            self.info.name, self.info.compute_capability.0, self.info.compute_capability.1
        )
    }

    fn sm(&self) -> Result<Sm> {
        GpuContext::sm(self)
    }

    fn memory_info(&self) -> Option<(usize, usize)> {
        self.ctx.mem_get_info().ok()
    }

    fn max_dynamic_shared(&self) -> usize {
        self.info.smem_optin_per_block
    }

    fn alloc_zeroed(&self, bytes: usize) -> Result<GpuMemory> {
        // Zero-byte allocations are refused by some drivers.
        let slice = self
            .stream
            .alloc_zeros::<u8>(bytes.max(1))
            .during(|| format!("alloc {bytes} B"))?;
        Ok(self.memory(slice, bytes))
    }

    fn upload_bytes(&self, bytes: &[u8]) -> Result<GpuMemory> {
        if bytes.is_empty() {
            return self.alloc_zeroed(0);
        }
        let slice = self
            .stream
            .clone_htod(bytes)
            .during(|| format!("upload {} B", bytes.len()))?;
        Ok(self.memory(slice, bytes.len()))
    }

    fn download_bytes(&self, memory: &GpuMemory) -> Result<Vec<u8>> {
        self.synchronize()?;
        let mut v = self
            .stream
            .clone_dtoh(&memory.slice)
            .during(|| format!("download {} B", memory.len))?;
        // cuMemcpyDtoHAsync into pageable memory returns when the copy is done, but that is
        // the driver's documented behaviour, not cudarc's contract: wait explicitly.
        self.synchronize()?;
        v.truncate(memory.len);
        Ok(v)
    }

    fn download_prefix(&self, memory: &GpuMemory, bytes: usize) -> Result<Vec<u8>> {
        let bytes = bytes.min(memory.len);
        if bytes == 0 {
            return Ok(Vec::new());
        }
        self.synchronize()?;
        let view = memory.slice.slice(0..bytes);
        let mut v = vec![0u8; bytes];
        self.stream
            .memcpy_dtoh(&view, &mut v)
            .during(|| format!("download {bytes} B"))?;
        self.synchronize()?;
        Ok(v)
    }

    fn fill_prefix(&self, memory: &mut GpuMemory, bytes: usize, byte: u8) -> Result<()> {
        let n = bytes.min(memory.len);
        if n == 0 {
            return Ok(());
        }
        // A raw driver call: the context must be current on the calling thread, which may not
        // be the thread that made this value.
        self.ctx
            .bind_to_thread()
            .during(|| "bind the device's context".into())?;
        let (ptr, _sync) = memory.slice.device_ptr_mut(&self.stream);
        // SAFETY: ptr is a live allocation of n bytes on this stream's context.
        unsafe { cudarc::driver::result::memset_d8_async(ptr, byte, n, self.stream.cu_stream()) }
            .during(|| format!("fill {n} B with {byte:#04x}"))
    }

    fn write_bytes(&self, memory: &mut GpuMemory, bytes: &[u8]) -> Result<()> {
        if bytes.len() > memory.len {
            return Err(CudaError::Invalid(format!(
                "write of {} B into an allocation of {} B",
                bytes.len(),
                memory.len
            )));
        }
        if bytes.is_empty() {
            return Ok(());
        }
        let mut view = memory.slice.slice_mut(0..bytes.len());
        self.stream
            .memcpy_htod(bytes, &mut view)
            .during(|| format!("write {} B", bytes.len()))
    }

    fn load_kernel(
        &self,
        family: &str,
        tactic: &str,
        name: &str,
        dynamic_shared: usize,
    ) -> Result<GpuKernel> {
        let sm = GpuContext::sm(self)?;
        let limit = self.info.smem_optin_per_block;
        let not_runnable = |why: String| CudaError::TacticNotRunnable {
            tactic: tactic.to_string(),
            sm: sm.to_string(),
            why,
        };
        let image = find_kernel_image(&self.ptx_dir, family, sm, tactic)?;
        let module = match load_module(self, &image) {
            Ok(m) => m,
            // A cubin the driver rejects (e.g. built for another SM revision): try the PTX.
            Err(first) => {
                let [_, ptx] = kernel_image_candidates(&self.ptx_dir, family, sm, tactic);
                if image != ptx && ptx.is_file() {
                    load_module(self, &ptx).map_err(|second| CudaError::LoadImage {
                        path: image.clone(),
                        detail: format!("{first}; PTX fallback failed too: {second}"),
                    })?
                } else {
                    return Err(first);
                }
            }
        };
        let function = module
            .load_function(name)
            .map_err(|e| CudaError::LoadImage {
                path: image.clone(),
                detail: format!("kernel {name} of tactic {tactic}: {e}"),
            })?;
        let static_shared = function
            .shared_size_bytes()
            .during(|| format!("{name} ({tactic}): static shared memory"))?
            as usize;
        if static_shared + dynamic_shared > limit {
            return Err(not_runnable(format!(
                "{name}: {static_shared} B static + {dynamic_shared} B dynamic shared memory > \
                 {limit} B"
            )));
        }
        // Above 48 KiB the dynamic size must be opted into per function.
        function
            .set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                dynamic_shared as i32,
            )
            .during(|| {
                format!("{name} ({tactic}): set max dynamic shared memory {dynamic_shared} B")
            })?;
        let max_threads_per_block = function
            .max_threads_per_block()
            .during(|| format!("{name} ({tactic}): max threads per block"))?;
        let registers = function
            .num_regs()
            .during(|| format!("{name} ({tactic}): registers"))?;
        Ok(GpuKernel {
            function,
            image,
            name: name.to_string(),
            tactic: tactic.to_string(),
            registers,
            max_threads_per_block,
            static_shared_bytes: static_shared,
        })
    }

    unsafe fn launch(
        &self,
        kernel: &GpuKernel,
        cfg: LaunchConfig,
        params: &KernelParams<'_>,
    ) -> Result<()> {
        let threads = cfg.block_dim.0 * cfg.block_dim.1 * cfg.block_dim.2;
        if threads as i64 > kernel.max_threads_per_block as i64 {
            return Err(CudaError::TacticNotRunnable {
                tactic: kernel.tactic.clone(),
                sm: GpuContext::sm(self)
                    .map(|s| s.to_string())
                    .unwrap_or_default(),
                why: format!(
                    "{}: the driver allows {} threads per block, the launch has {threads}",
                    kernel.name, kernel.max_threads_per_block
                ),
            });
        }
        let mut raw = params.raw();
        // A raw driver call: see `fill_prefix`.
        self.ctx
            .bind_to_thread()
            .during(|| "bind the device's context".into())?;
        // SAFETY: the caller guarantees the parameters match the kernel and every address in
        // them is a live allocation of this context; the stream belongs to the context.
        unsafe {
            cudarc::driver::result::launch_kernel(
                kernel.function.cu_function(),
                cfg.grid_dim,
                cfg.block_dim,
                cfg.shared_mem_bytes,
                self.stream.cu_stream(),
                &mut raw,
            )
        }
        .during(|| format!("launch {} of {} ({cfg})", kernel.name, kernel.tactic))
    }

    fn blas_ready(&self) -> Result<()> {
        let mut blas = self.blas.lock().unwrap();
        if blas.is_none() {
            *blas = Some(blas::Blas::open(&self.stream)?);
        }
        Ok(())
    }

    unsafe fn blas_gemm(&self, gemm: &BlasGemm) -> Result<()> {
        self.blas_ready()?;
        // The library launches on the calling thread's current context.
        self.ctx
            .bind_to_thread()
            .during(|| "bind the device's context".into())?;
        let mut blas = self.blas.lock().unwrap();
        let blas = blas.as_mut().expect("opened by blas_ready");
        // SAFETY: forwarded from the caller (live allocations of this context).
        unsafe { blas.gemm(&self.stream, gemm) }
    }

    fn synchronize(&self) -> Result<()> {
        GpuContext::synchronize(self)
    }

    fn begin_capture(&self) -> Result<()> {
        self.stream
            .begin_capture(
                cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
            .during(|| "cuStreamBeginCapture".into())
    }

    fn end_capture(&self) -> Result<cudarc::driver::CudaGraph> {
        self.stream
            .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0))
            .during(|| "cuStreamEndCapture".into())?
            .ok_or_else(|| CudaError::Invalid("the capture recorded no work".into()))
    }

    fn replay(&self, graph: &cudarc::driver::CudaGraph) -> Result<()> {
        graph.launch().during(|| "cuGraphLaunch".into())
    }
}

/// Median of the values (sorted in place); NaN for an empty slice.
pub fn median(values: &mut [f64]) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n % 2 == 1 {
        values[n / 2]
    } else {
        0.5 * (values[n / 2 - 1] + values[n / 2])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_exact_capabilities_select_an_sm() {
        assert_eq!(sm_for_compute_capability(9, 0), Some(Sm::Sm90));
        assert_eq!(sm_for_compute_capability(12, 0), Some(Sm::Sm120));
        // sm_90a / sm_120a code is not forward compatible.
        assert_eq!(sm_for_compute_capability(12, 1), None);
        assert_eq!(sm_for_compute_capability(10, 0), None);
        assert_eq!(sm_for_compute_capability(8, 9), None);
    }

    #[test]
    fn kernel_image_paths_follow_the_gate_layout() {
        let [cubin, ptx] = kernel_image_candidates(
            Path::new("ptx"),
            "moe_gemm",
            Sm::Sm90,
            "portable_n128_m8_k256_w4_s2_sk1_wa_sfsw",
        );
        assert_eq!(
            cubin,
            Path::new("ptx/moe_gemm/sm_90a/portable_n128_m8_k256_w4_s2_sk1_wa_sfsw.cubin")
        );
        assert_eq!(
            ptx,
            Path::new("ptx/moe_gemm/sm_90a/portable_n128_m8_k256_w4_s2_sk1_wa_sfsw.ptx")
        );
    }

    #[test]
    fn cubin_is_preferred_and_ptx_is_the_fallback() {
        let dir = std::env::temp_dir().join(format!("kimi-cuda-test-{}", std::process::id()));
        let sub = dir.join("moe_gemm/sm_120a");
        std::fs::create_dir_all(&sub).unwrap();
        let id = "native_n128_m8_k256_w4_s2_sk1_wa_sfsw";
        let err = find_kernel_image(&dir, "moe_gemm", Sm::Sm120, id).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains(&format!("{id}.cubin")), "{msg}");
        assert!(msg.contains(&format!("{id}.ptx")), "{msg}");
        assert!(msg.contains("sm_120a"), "{msg}");
        std::fs::write(sub.join(format!("{id}.ptx")), "// ptx").unwrap();
        assert_eq!(
            find_kernel_image(&dir, "moe_gemm", Sm::Sm120, id).unwrap(),
            sub.join(format!("{id}.ptx"))
        );
        std::fs::write(sub.join(format!("{id}.cubin")), [0x7f, b'E', b'L', b'F']).unwrap();
        assert_eq!(
            find_kernel_image(&dir, "moe_gemm", Sm::Sm120, id).unwrap(),
            sub.join(format!("{id}.cubin"))
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn missing_driver_is_an_error_not_a_panic() {
        // Without a driver (CI, this build machine) the error must name the cause; with one,
        // creating the context may succeed or fail for a device reason, but must not panic.
        match GpuContext::new(0, "ptx") {
            Err(CudaError::NoDriver) => {
                assert!(!driver_present());
                let msg = CudaError::NoDriver.to_string();
                assert!(msg.starts_with("no CUDA driver"), "{msg}");
                assert!(msg.contains("libcuda"), "{msg}");
            }
            Ok(gpu) => assert!(driver_present() && !gpu.info().name.is_empty()),
            Err(other) => assert!(driver_present(), "{other}"),
        }
    }

    #[test]
    fn median_of_even_and_odd_counts() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
        assert!(median(&mut []).is_nan());
    }
}
