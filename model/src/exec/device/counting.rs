//! A [`Device`] wrapper that records what crosses the host↔device boundary and every launch
//! (kernel, tactic image, grid, bytes read and written): the transfer-count test and the
//! launch list of a step.

use std::sync::Mutex;

use kernels::arch::Sm;
use kernels::blas;
use kernels::device::{BlasGemm, Device, KernelParams, LaunchConfig, LaunchTraffic, Result};
use kernels::tactic::ProblemShape;

/// One launch as the executor issued it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchEntry {
    pub family: String,
    pub tactic: String,
    pub kernel: String,
    pub config: LaunchConfig,
    /// Device-memory bytes the launch reads and writes at least, as its launcher counts them.
    pub traffic: LaunchTraffic,
    /// The problem the launcher named, if any (dense products: `m, n, k`).
    pub problem: Option<ProblemShape>,
}

/// Host↔device traffic and launches since the last [`CountingDevice::take`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceTraffic {
    /// Allocations filled from the host (`upload_bytes`).
    pub uploads: usize,
    /// Copies into existing allocations (`write_bytes`).
    pub writes: usize,
    /// Copies back to the host.
    pub downloads: usize,
    pub bytes_to_device: usize,
    pub bytes_to_host: usize,
    /// Device-side memsets (not transfers; listed for completeness).
    pub fills: usize,
    /// Launches, those of replayed graphs included.
    pub launches: Vec<LaunchEntry>,
    /// Graph replays.
    pub replays: usize,
    capture_start: Option<usize>,
}

impl DeviceTraffic {
    /// Transfers in either direction.
    pub fn transfers(&self) -> usize {
        self.uploads + self.writes + self.downloads
    }
}

pub struct CountingDevice<D: Device> {
    pub inner: D,
    traffic: Mutex<DeviceTraffic>,
}

pub struct CountedKernel<K> {
    inner: K,
    family: String,
    tactic: String,
    name: String,
}

impl<D: Device> CountingDevice<D> {
    pub fn new(inner: D) -> Self {
        Self {
            inner,
            traffic: Mutex::new(DeviceTraffic::default()),
        }
    }

    /// What happened since the last call (or since the device was made).
    pub fn take(&self) -> DeviceTraffic {
        std::mem::take(&mut *self.traffic.lock().unwrap())
    }

    fn record(&self, f: impl FnOnce(&mut DeviceTraffic)) {
        f(&mut self.traffic.lock().unwrap());
    }
}

impl<D: Device> Device for CountingDevice<D> {
    type Memory = D::Memory;
    type Kernel = CountedKernel<D::Kernel>;
    /// The inner graph and the launches it holds (listed again at each replay).
    type Graph = (D::Graph, Vec<LaunchEntry>);

    fn describe(&self) -> String {
        self.inner.describe()
    }

    fn sm(&self) -> Result<Sm> {
        self.inner.sm()
    }

    fn memory_info(&self) -> Option<(usize, usize)> {
        self.inner.memory_info()
    }

    fn max_dynamic_shared(&self) -> usize {
        self.inner.max_dynamic_shared()
    }

    fn alloc_zeroed(&self, bytes: usize) -> Result<Self::Memory> {
        self.inner.alloc_zeroed(bytes)
    }

    fn upload_bytes(&self, bytes: &[u8]) -> Result<Self::Memory> {
        self.record(|t| {
            t.uploads += 1;
            t.bytes_to_device += bytes.len();
        });
        self.inner.upload_bytes(bytes)
    }

    fn download_bytes(&self, memory: &Self::Memory) -> Result<Vec<u8>> {
        let v = self.inner.download_bytes(memory)?;
        self.record(|t| {
            t.downloads += 1;
            t.bytes_to_host += v.len();
        });
        Ok(v)
    }

    fn download_prefix(&self, memory: &Self::Memory, bytes: usize) -> Result<Vec<u8>> {
        let v = self.inner.download_prefix(memory, bytes)?;
        self.record(|t| {
            t.downloads += 1;
            t.bytes_to_host += v.len();
        });
        Ok(v)
    }

    fn fill_prefix(&self, memory: &mut Self::Memory, bytes: usize, byte: u8) -> Result<()> {
        self.record(|t| t.fills += 1);
        self.inner.fill_prefix(memory, bytes, byte)
    }

    fn write_bytes(&self, memory: &mut Self::Memory, bytes: &[u8]) -> Result<()> {
        self.record(|t| {
            t.writes += 1;
            t.bytes_to_device += bytes.len();
        });
        self.inner.write_bytes(memory, bytes)
    }

    fn load_kernel(
        &self,
        family: &str,
        tactic: &str,
        name: &str,
        dynamic_shared: usize,
    ) -> Result<Self::Kernel> {
        Ok(CountedKernel {
            inner: self
                .inner
                .load_kernel(family, tactic, name, dynamic_shared)?,
            family: family.to_string(),
            tactic: tactic.to_string(),
            name: name.to_string(),
        })
    }

    unsafe fn launch(
        &self,
        kernel: &Self::Kernel,
        cfg: LaunchConfig,
        params: &KernelParams<'_>,
    ) -> Result<()> {
        self.record(|t| {
            t.launches.push(LaunchEntry {
                family: kernel.family.clone(),
                tactic: kernel.tactic.clone(),
                kernel: kernel.name.clone(),
                config: cfg,
                traffic: params.launch_traffic(),
                problem: params.launch_problem().cloned(),
            })
        });
        // SAFETY: forwarded unchanged; the caller's contract is the inner device's.
        unsafe { self.inner.launch(&kernel.inner, cfg, params) }
    }

    fn blas_ready(&self) -> Result<()> {
        self.inner.blas_ready()
    }

    unsafe fn blas_gemm(&self, gemm: &BlasGemm) -> Result<()> {
        self.record(|t| {
            t.launches.push(LaunchEntry {
                family: blas::FAMILY.into(),
                tactic: blas::TYPES.into(),
                kernel: blas::KERNEL.into(),
                config: blas::LIBRARY_CHOOSES,
                traffic: gemm.traffic(),
                problem: Some(gemm.problem()),
            })
        });
        // SAFETY: forwarded unchanged.
        unsafe { self.inner.blas_gemm(gemm) }
    }

    fn synchronize(&self) -> Result<()> {
        self.inner.synchronize()
    }

    fn begin_capture(&self) -> Result<()> {
        self.record(|t| t.capture_start = Some(t.launches.len()));
        self.inner.begin_capture()
    }

    fn end_capture(&self) -> Result<Self::Graph> {
        let launches = {
            let mut t = self.traffic.lock().unwrap();
            let start = t.capture_start.take().unwrap_or(t.launches.len());
            t.launches.split_off(start)
        };
        Ok((self.inner.end_capture()?, launches))
    }

    fn replay(&self, graph: &Self::Graph) -> Result<()> {
        self.record(|t| {
            t.replays += 1;
            t.launches.extend(graph.1.iter().cloned());
        });
        self.inner.replay(&graph.0)
    }
}
