//! [`DryDevice`]: a [`Device`] on which no kernel runs and no byte is held, so the executor can
//! issue a real step of a model whose weights no machine here could hold (Kimi-K2.5's rank of
//! TP8 is ~70 GB) and a recording wrapper can list its launches.
//!
//! Memory is a length and an address, distinct per allocation (aligned as `cudaMalloc`
//! aligns). What a launch would be refused for on a GPU and is cheap to check is checked: the
//! dynamic shared memory a kernel is opted into against the SM's opt-in limit, a launch's ask
//! against that opt-in, block and grid dimensions against the architectural limits, and host
//! copies during a capture. Whether a kernel image exists for the (family, tactic) is not
//! checked (that needs the compile gate's images). Downloads return zeros.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use super::{BlasGemm, Device, DeviceError, DeviceMemory, KernelParams, LaunchConfig, Result};
use crate::arch::{MAX_BLOCK_DIM, MAX_GRID_DIM, MAX_THREADS_PER_BLOCK, Sm};

/// Where the first allocation's fake address lies: far from null, so a zero address in a
/// parameter block is never mistaken for one of these.
const FIRST_ADDRESS: u64 = 0x7000_0000_0000;
/// `cudaMalloc` returns addresses aligned to 256 bytes; the launchers may rely on it.
const ALLOCATION_ALIGNMENT: u64 = 256;

/// An allocation of a [`DryDevice`]: its size and its address, no bytes.
#[derive(Debug)]
pub struct DryMemory {
    ptr: u64,
    len: usize,
}

impl DeviceMemory for DryMemory {
    fn device_ptr(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
}

/// A "loaded" kernel: its names and the dynamic shared memory it was opted into.
#[derive(Clone, Debug)]
pub struct DryKernel {
    pub family: String,
    pub tactic: String,
    pub name: String,
    pub max_dynamic_shared: usize,
}

/// A captured graph: how many launches and fills it holds (replaying it does nothing).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DryGraph {
    pub launches: usize,
    pub fills: usize,
}

/// See the module documentation.
pub struct DryDevice {
    sm: Sm,
    next_address: AtomicU64,
    allocated: AtomicU64,
    /// Bytes of device memory it reports having, where it stands for a GPU of that size.
    memory: Option<u64>,
    capture: Mutex<Option<DryGraph>>,
}

/// Devices on which no kernel runs: a collective may be given peers that are not there.
pub trait Dry: Device {}

impl Dry for DryDevice {}

impl Default for DryDevice {
    fn default() -> Self {
        Self::new(Sm::Sm120)
    }
}

fn dry_error(detail: String) -> DeviceError {
    DeviceError::Driver {
        what: "dry device".into(),
        detail,
    }
}

impl DryDevice {
    /// A dry device with the limits of `sm`.
    pub fn new(sm: Sm) -> Self {
        Self {
            sm,
            next_address: AtomicU64::new(FIRST_ADDRESS),
            allocated: AtomicU64::new(0),
            memory: None,
            capture: Mutex::new(None),
        }
    }

    /// A dry device that reports `bytes` of device memory, less what it allocated, as a GPU
    /// of that size does ([`Device::memory_info`]); allocations beyond it still succeed.
    pub fn with_memory(sm: Sm, bytes: u64) -> Self {
        Self {
            memory: Some(bytes),
            ..Self::new(sm)
        }
    }

    /// Bytes of every allocation made so far (none is ever freed from the count).
    pub fn allocated_bytes(&self) -> u64 {
        self.allocated.load(Ordering::Relaxed)
    }

    fn allocation(&self, bytes: usize) -> DryMemory {
        // Zero-byte requests still get an address of their own, as a driver's do.
        let span = (bytes as u64).max(1).div_ceil(ALLOCATION_ALIGNMENT) * ALLOCATION_ALIGNMENT;
        let ptr = self.next_address.fetch_add(span, Ordering::Relaxed);
        self.allocated.fetch_add(bytes as u64, Ordering::Relaxed);
        DryMemory { ptr, len: bytes }
    }

    fn refuse_while_capturing(&self, what: &str) -> Result<()> {
        if self.capture.lock().unwrap().is_some() {
            return Err(dry_error(format!(
                "{what} while a graph is being captured (a graph holds device work only)"
            )));
        }
        Ok(())
    }

    fn check_launch(&self, kernel: &DryKernel, cfg: LaunchConfig) -> Result<()> {
        let refuse = |why: String| DeviceError::TacticNotRunnable {
            tactic: kernel.tactic.clone(),
            sm: self.sm.to_string(),
            why: format!("{}: {why} ({cfg})", kernel.name),
        };
        if cfg.shared_mem_bytes as usize > kernel.max_dynamic_shared {
            return Err(refuse(format!(
                "the launch asks for {} B of dynamic shared memory, the kernel was loaded for {} B",
                cfg.shared_mem_bytes, kernel.max_dynamic_shared
            )));
        }
        let (b, g) = (cfg.block_dim, cfg.grid_dim);
        let within = |d: (u32, u32, u32), max: (u32, u32, u32)| {
            (1..=max.0).contains(&d.0) && (1..=max.1).contains(&d.1) && (1..=max.2).contains(&d.2)
        };
        if !within(b, MAX_BLOCK_DIM) || b.0 * b.1 * b.2 > MAX_THREADS_PER_BLOCK {
            return Err(refuse(format!(
                "block {b:?}: each dimension at least 1 and at most {MAX_BLOCK_DIM:?}, at most \
                 {MAX_THREADS_PER_BLOCK} threads"
            )));
        }
        if !within(g, MAX_GRID_DIM) {
            return Err(refuse(format!(
                "grid {g:?}: each dimension at least 1 and at most {MAX_GRID_DIM:?}"
            )));
        }
        Ok(())
    }
}

impl Device for DryDevice {
    type Memory = DryMemory;
    type Kernel = DryKernel;
    type Graph = DryGraph;

    fn describe(&self) -> String {
        format!("dry device with the limits of {} (no kernel runs)", self.sm)
    }

    fn sm(&self) -> Result<Sm> {
        Ok(self.sm)
    }

    fn max_dynamic_shared(&self) -> usize {
        self.sm.smem_optin_per_block()
    }

    fn memory_info(&self) -> Option<(usize, usize)> {
        let total = self.memory?;
        Some((
            total.saturating_sub(self.allocated_bytes()) as usize,
            total as usize,
        ))
    }

    fn alloc_zeroed(&self, bytes: usize) -> Result<DryMemory> {
        Ok(self.allocation(bytes))
    }

    fn upload_bytes(&self, bytes: &[u8]) -> Result<DryMemory> {
        self.refuse_while_capturing("a host-to-device copy")?;
        Ok(self.allocation(bytes.len()))
    }

    fn download_bytes(&self, memory: &DryMemory) -> Result<Vec<u8>> {
        self.refuse_while_capturing("a device-to-host copy")?;
        Ok(vec![0; memory.len])
    }

    fn download_prefix(&self, memory: &DryMemory, bytes: usize) -> Result<Vec<u8>> {
        self.refuse_while_capturing("a device-to-host copy")?;
        Ok(vec![0; bytes.min(memory.len)])
    }

    fn fill_prefix(&self, _memory: &mut DryMemory, _bytes: usize, _byte: u8) -> Result<()> {
        if let Some(graph) = self.capture.lock().unwrap().as_mut() {
            graph.fills += 1;
        }
        Ok(())
    }

    fn blas_ready(&self) -> Result<()> {
        Ok(())
    }

    /// Checked like the library would check it, then dropped.
    unsafe fn blas_gemm(&self, gemm: &BlasGemm) -> Result<()> {
        gemm.validate()
    }

    fn write_bytes(&self, memory: &mut DryMemory, bytes: &[u8]) -> Result<()> {
        self.refuse_while_capturing("a host-to-device copy")?;
        if bytes.len() > memory.len {
            return Err(DeviceError::Invalid(format!(
                "write of {} B into an allocation of {} B",
                bytes.len(),
                memory.len
            )));
        }
        Ok(())
    }

    fn load_kernel(
        &self,
        family: &str,
        tactic: &str,
        name: &str,
        dynamic_shared: usize,
    ) -> Result<DryKernel> {
        let limit = self.sm.smem_optin_per_block();
        if dynamic_shared > limit {
            return Err(DeviceError::TacticNotRunnable {
                tactic: tactic.to_string(),
                sm: self.sm.to_string(),
                why: format!("{name}: {dynamic_shared} B dynamic shared memory > {limit} B"),
            });
        }
        Ok(DryKernel {
            family: family.to_string(),
            tactic: tactic.to_string(),
            name: name.to_string(),
            max_dynamic_shared: dynamic_shared,
        })
    }

    unsafe fn launch(
        &self,
        kernel: &DryKernel,
        cfg: LaunchConfig,
        _params: &KernelParams<'_>,
    ) -> Result<()> {
        self.check_launch(kernel, cfg)?;
        if let Some(graph) = self.capture.lock().unwrap().as_mut() {
            graph.launches += 1;
        }
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    fn begin_capture(&self) -> Result<()> {
        let mut capture = self.capture.lock().unwrap();
        if capture.is_some() {
            return Err(dry_error("a capture is already under way".into()));
        }
        *capture = Some(DryGraph::default());
        Ok(())
    }

    fn end_capture(&self) -> Result<DryGraph> {
        self.capture
            .lock()
            .unwrap()
            .take()
            .ok_or_else(|| dry_error("end_capture without begin_capture".into()))
    }

    fn replay(&self, _graph: &DryGraph) -> Result<()> {
        self.refuse_while_capturing("a graph replay")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::DeviceExt;

    fn kernel(dev: &DryDevice, smem: usize) -> Result<DryKernel> {
        dev.load_kernel("family", "tactic", "kernel", smem)
    }

    fn launch(dev: &DryDevice, k: &DryKernel, grid: (u32, u32, u32), smem: u32) -> Result<()> {
        let cfg = LaunchConfig {
            grid_dim: grid,
            block_dim: (256, 1, 1),
            shared_mem_bytes: smem,
        };
        // SAFETY: a dry launch reads no parameter.
        unsafe { dev.launch(k, cfg, &KernelParams::new()) }
    }

    #[test]
    fn allocations_are_distinct_aligned_and_hold_no_bytes() {
        let dev = DryDevice::default();
        let huge = 70usize << 30;
        let a = dev.alloc_zeroed(huge).unwrap();
        let b = dev.alloc_zeroed(0).unwrap();
        let c = dev.upload(&[1u32, 2, 3]).unwrap();
        assert_eq!((a.len(), b.len(), c.len()), (huge, 0, 12));
        assert!(a.device_ptr() + huge as u64 <= b.device_ptr());
        assert!(b.device_ptr() < c.device_ptr());
        for m in [&a, &b, &c] {
            assert_eq!(m.device_ptr() % ALLOCATION_ALIGNMENT, 0);
        }
        assert_eq!(dev.download_first::<u32>(&c, 2).unwrap(), vec![0, 0]);
        assert_eq!(dev.allocated_bytes(), huge as u64 + 12);
    }

    #[test]
    fn what_a_gpu_refuses_is_refused() {
        for sm in Sm::ALL {
            let dev = DryDevice::new(sm);
            let limit = sm.smem_optin_per_block();
            assert_eq!(dev.max_dynamic_shared(), limit);
            assert!(kernel(&dev, limit + 1).is_err(), "{sm}");
            let k = kernel(&dev, limit).unwrap();
            launch(&dev, &k, (1, MAX_GRID_DIM.1, 1), limit as u32).unwrap();
            let small = kernel(&dev, 1024).unwrap();
            assert!(launch(&dev, &small, (1, 1, 1), 1025).is_err());
            assert!(launch(&dev, &k, (0, 1, 1), 0).is_err());
            assert!(launch(&dev, &k, (1, MAX_GRID_DIM.1 + 1, 1), 0).is_err());
        }
        let dev = DryDevice::default();
        let mut m = dev.alloc_zeroed(8).unwrap();
        assert!(dev.write_bytes(&mut m, &[0; 9]).is_err());
        dev.begin_capture().unwrap();
        assert!(dev.write_bytes(&mut m, &[0; 4]).is_err());
        assert!(dev.download_bytes(&m).is_err());
        let k = kernel(&dev, 0).unwrap();
        launch(&dev, &k, (4, 1, 1), 0).unwrap();
        dev.fill(&mut m, 0).unwrap();
        let graph = dev.end_capture().unwrap();
        assert_eq!(
            graph,
            DryGraph {
                launches: 1,
                fills: 1
            }
        );
        dev.replay(&graph).unwrap();
        assert!(dev.end_capture().is_err());
    }
}
