//! [`HostDevice`]: the host execution layer behind `kernels::device::Device`, emulating one
//! SM's limits, so the launchers written for the GPU run here unchanged.

use std::sync::Mutex;

use kernels::arch::Sm;
use kernels::device::{
    BlasGemm, Device, DeviceError, DeviceMemory, KernelParams, LaunchConfig, Result,
};

use crate::{DeviceBuffer, Function, LaunchOptions, LaunchStats, Module, Schedule, launch};

impl DeviceMemory for DeviceBuffer {
    fn device_ptr(&self) -> u64 {
        self.ptr()
    }
    fn len(&self) -> usize {
        DeviceBuffer::len(self)
    }
}

/// A loaded host kernel and the dynamic shared memory it was opted into.
#[derive(Clone, Copy, Debug)]
pub struct HostKernel {
    pub function: Function,
    pub max_dynamic_shared: usize,
}

/// What one launch was and did (the runtime's counters).
#[derive(Clone, Debug)]
pub struct LaunchRecord {
    pub family: &'static str,
    pub tactic: &'static str,
    pub kernel: &'static str,
    pub config: LaunchConfig,
    pub stats: LaunchStats,
}

/// The host execution layer as a device with the limits of `sm` (dynamic shared memory per
/// block: 101,376 B on SM120, 232,448 B on SM90). Launches run to completion before
/// [`Device::launch`] returns.
pub struct HostDevice {
    sm: Sm,
    options: Mutex<LaunchOptions>,
    history: Mutex<Vec<LaunchRecord>>,
    /// The graph being captured, if any.
    capture: Mutex<Option<Vec<HostOp>>>,
}

/// One recorded operation of a [`HostGraph`].
#[derive(Clone, Debug)]
enum HostOp {
    Launch {
        kernel: HostKernel,
        config: LaunchConfig,
        /// Each parameter's bytes, as the capture saw them.
        params: Vec<Vec<u8>>,
    },
    Fill {
        ptr: u64,
        len: usize,
        byte: u8,
    },
    /// A vendor product, run by the reference of its semantics.
    Blas(BlasGemm),
}

/// A captured sequence of launches and fills: the host layer's CUDA graph. Replaying it runs
/// the same kernels with the same parameter bytes on whatever the buffers hold then.
#[derive(Clone, Debug, Default)]
pub struct HostGraph {
    ops: Vec<HostOp>,
}

impl HostGraph {
    /// Launches in the graph.
    pub fn launches(&self) -> usize {
        self.ops
            .iter()
            .filter(|op| matches!(op, HostOp::Launch { .. }))
            .count()
    }
}

fn host_error(what: String) -> DeviceError {
    DeviceError::Driver {
        what: "host execution".into(),
        detail: what,
    }
}

impl HostDevice {
    pub fn new(sm: Sm) -> Self {
        let options = LaunchOptions {
            max_dynamic_shared: sm.smem_optin_per_block() as u32,
            ..LaunchOptions::default()
        };
        Self {
            sm,
            options: Mutex::new(options),
            history: Mutex::new(Vec::new()),
            capture: Mutex::new(None),
        }
    }

    /// The options every launch uses from now on (the shared-memory limit stays the SM's).
    pub fn set_options(&self, options: LaunchOptions) {
        *self.options.lock().unwrap() = LaunchOptions {
            max_dynamic_shared: self.sm.smem_optin_per_block() as u32,
            ..options
        };
    }

    pub fn options(&self) -> LaunchOptions {
        self.options.lock().unwrap().clone()
    }

    pub fn set_schedule(&self, schedule: Schedule) {
        self.options.lock().unwrap().schedule = schedule;
    }

    /// Every launch since the device was made (or since the last [`take_history`]).
    ///
    /// [`take_history`]: HostDevice::take_history
    pub fn take_history(&self) -> Vec<LaunchRecord> {
        std::mem::take(&mut *self.history.lock().unwrap())
    }
}

impl HostDevice {
    fn refuse_while_capturing(&self, what: &str) -> Result<()> {
        if self.capture.lock().unwrap().is_some() {
            return Err(host_error(format!(
                "{what} while a graph is being captured (a graph holds device work only)"
            )));
        }
        Ok(())
    }

    /// Runs a launch now (the un-captured path of [`Device::launch`]).
    ///
    /// # Safety
    /// As [`Device::launch`].
    unsafe fn launch_now(
        &self,
        kernel: &HostKernel,
        cfg: LaunchConfig,
        params: &KernelParams<'_>,
    ) -> Result<()> {
        let options = self.options();
        // SAFETY: forwarded from the caller (parameters match, addresses are live buffers).
        let stats = unsafe { launch(&kernel.function, cfg, params, &options) }
            .map_err(|e| host_error(e.to_string()))?;
        let m = kernel.function.module();
        self.history.lock().unwrap().push(LaunchRecord {
            family: m.family_name(),
            tactic: m.tactic(),
            kernel: kernel.function.name(),
            config: cfg,
            stats,
        });
        Ok(())
    }
}

impl Device for HostDevice {
    type Memory = DeviceBuffer;
    type Kernel = HostKernel;
    type Graph = HostGraph;

    fn describe(&self) -> String {
        format!("host execution layer emulating {}", self.sm)
    }

    fn sm(&self) -> Result<Sm> {
        Ok(self.sm)
    }

    fn max_dynamic_shared(&self) -> usize {
        self.sm.smem_optin_per_block()
    }

    fn alloc_zeroed(&self, bytes: usize) -> Result<DeviceBuffer> {
        DeviceBuffer::zeroed(bytes).map_err(|e| host_error(e.to_string()))
    }

    fn upload_bytes(&self, bytes: &[u8]) -> Result<DeviceBuffer> {
        self.refuse_while_capturing("a host-to-device copy")?;
        DeviceBuffer::from_slice(bytes).map_err(|e| host_error(e.to_string()))
    }

    fn download_bytes(&self, memory: &DeviceBuffer) -> Result<Vec<u8>> {
        self.refuse_while_capturing("a device-to-host copy")?;
        Ok(memory.bytes().to_vec())
    }

    fn download_prefix(&self, memory: &DeviceBuffer, bytes: usize) -> Result<Vec<u8>> {
        self.refuse_while_capturing("a device-to-host copy")?;
        Ok(memory.bytes()[..bytes.min(memory.len())].to_vec())
    }

    fn fill_prefix(&self, memory: &mut DeviceBuffer, bytes: usize, byte: u8) -> Result<()> {
        let len = bytes.min(memory.len());
        if let Some(ops) = self.capture.lock().unwrap().as_mut() {
            ops.push(HostOp::Fill {
                ptr: memory.ptr(),
                len,
                byte,
            });
            return Ok(());
        }
        memory.bytes_mut()[..len].fill(byte);
        Ok(())
    }

    fn write_bytes(&self, memory: &mut DeviceBuffer, bytes: &[u8]) -> Result<()> {
        self.refuse_while_capturing("a host-to-device copy")?;
        if bytes.len() > memory.len() {
            return Err(DeviceError::Invalid(format!(
                "write of {} B into an allocation of {} B",
                bytes.len(),
                memory.len()
            )));
        }
        memory.bytes_mut()[..bytes.len()].copy_from_slice(bytes);
        Ok(())
    }

    fn load_kernel(
        &self,
        family: &str,
        tactic: &str,
        name: &str,
        dynamic_shared: usize,
    ) -> Result<HostKernel> {
        let limit = self.sm.smem_optin_per_block();
        if dynamic_shared > limit {
            return Err(DeviceError::TacticNotRunnable {
                tactic: tactic.to_string(),
                sm: self.sm.to_string(),
                why: format!("{name}: {dynamic_shared} B dynamic shared memory > {limit} B"),
            });
        }
        let function = Module::find(family, tactic)
            .and_then(|m| m.function(name))
            .map_err(|e| DeviceError::MissingImage {
                what: e.to_string(),
                tried: Vec::new(),
            })?;
        Ok(HostKernel {
            function,
            max_dynamic_shared: dynamic_shared,
        })
    }

    unsafe fn launch(
        &self,
        kernel: &HostKernel,
        cfg: LaunchConfig,
        params: &KernelParams<'_>,
    ) -> Result<()> {
        // As on a GPU, a launch may not use more dynamic shared memory than the kernel was
        // opted into.
        if cfg.shared_mem_bytes as usize > kernel.max_dynamic_shared {
            return Err(host_error(format!(
                "{}: launch asks for {} B of dynamic shared memory, the kernel was loaded for {} B",
                kernel.function.name(),
                cfg.shared_mem_bytes,
                kernel.max_dynamic_shared
            )));
        }
        if let Some(ops) = self.capture.lock().unwrap().as_mut() {
            ops.push(HostOp::Launch {
                kernel: *kernel,
                config: cfg,
                params: params.to_bytes(),
            });
            return Ok(());
        }
        // SAFETY: forwarded from the caller.
        unsafe { self.launch_now(kernel, cfg, params) }
    }

    fn blas_ready(&self) -> Result<()> {
        Ok(())
    }

    /// The host layer's stand-in for cuBLASLt: [`BlasGemm::run_on_host`], the reference of
    /// the library's semantics (not a CUDA source: the vendor's code is not ours to run).
    unsafe fn blas_gemm(&self, gemm: &BlasGemm) -> Result<()> {
        gemm.validate()?;
        if let Some(ops) = self.capture.lock().unwrap().as_mut() {
            ops.push(HostOp::Blas(*gemm));
            return Ok(());
        }
        // SAFETY: this device's addresses are host addresses; the caller guarantees the
        // buffers (Device::blas_gemm's contract), and launches run one at a time.
        unsafe { gemm.run_on_host() }
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    fn begin_capture(&self) -> Result<()> {
        let mut capture = self.capture.lock().unwrap();
        if capture.is_some() {
            return Err(host_error("a capture is already under way".into()));
        }
        *capture = Some(Vec::new());
        Ok(())
    }

    fn end_capture(&self) -> Result<HostGraph> {
        let ops = self
            .capture
            .lock()
            .unwrap()
            .take()
            .ok_or_else(|| host_error("end_capture without begin_capture".into()))?;
        Ok(HostGraph { ops })
    }

    fn replay(&self, graph: &HostGraph) -> Result<()> {
        self.refuse_while_capturing("a graph replay")?;
        for op in &graph.ops {
            match op {
                HostOp::Launch {
                    kernel,
                    config,
                    params,
                } => {
                    let mut p = KernelParams::new();
                    for bytes in params {
                        p.arg_bytes(bytes);
                    }
                    // SAFETY: the parameters are the bytes the captured launch was given, which
                    // met `launch`'s contract then; the graph's owner keeps those buffers alive.
                    unsafe { self.launch_now(kernel, *config, &p) }?;
                }
                &HostOp::Fill { ptr, len, byte } => {
                    // SAFETY: `ptr..ptr + len` was a live buffer of this device when captured,
                    // and the graph's owner keeps it alive.
                    unsafe { std::ptr::write_bytes(ptr as *mut u8, byte, len) };
                }
                HostOp::Blas(gemm) => {
                    // SAFETY: as for a launch: the captured product met blas_gemm's contract,
                    // and the graph's owner keeps its buffers alive.
                    unsafe { gemm.run_on_host() }?;
                }
            }
        }
        Ok(())
    }
}
