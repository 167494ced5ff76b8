//! The tensor-parallel all-reduce of the device executor: a rank's partial sums (after
//! `o_proj`, after the MLP or MoE down products) summed over every rank, on the device, in
//! stream order, so a captured decode graph holds it like any other launch.
//!
//! Two implementations of [`TpAllReduce`]:
//! - [`ShmAllReduce`] (`cuda-emulated`): the real `allreduce.cu`, run by the host execution
//!   layer, over rank regions that live in one POSIX shared-memory segment every rank process
//!   maps — the peers' regions are reachable, as CUDA IPC makes them on a GPU — with the
//!   kernel's own generation flags.
//! - [`IpcAllReduce`] (feature `cuda`): [`kernels::allreduce::cuda::CudaIpcCommunicator`]'s
//!   kernels over CUDA IPC regions, launched on the executor's stream; the sizes its policy
//!   sends to NCCL (feature `nccl`) go to an in-place `ncclAllReduce` on the same stream,
//!   inside a captured step as outside.
//!
//! [`DryAllReduce`] issues the GPU path's launch (its tactic, grid and parameter block) on a
//! device where no kernel runs ([`Dry`]), with peers that are not there: the collective's
//! place in a recorded step's launch list.
//!
//! The residual add is not fused into the collective: the executor adds the summed partial
//! into the residual stream in the next `add_rms_norm`, as the CPU tensor-parallel forward
//! adds it after `all_reduce_sum`. Fusing the add alone (`allreduce.cu`'s residual operand)
//! would give the same bits (the add commutes) but save no launch, only the norm's write of
//! the residual: 28,672 B per collective of a Kimi-K2.5 decode step at batch 1, 3.5 MB of its
//! 6.4 GB per step. Fusing the RMSNorm as well would remove the 122 `add_rms_norm` launches
//! that follow collectives (predicted by the step-time model's 2 µs per launch: ~0.25 ms of a
//! ~10 ms batch-1 step), but needs a one-shot partition by whole rows and an epilogue that
//! sums squares in `add_rms_norm`'s order (256 strided partial sums, a warp tree, the warps
//! in order) inside the all-reduce's block, with the multiply-adds kept unfused in both
//! kernels so that a GPU's FMA contraction cannot make the two differ.

use std::ops::Range;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kernels::allreduce::algorithm::{Algorithm, Transfer};
use kernels::allreduce::cpu::default_islands;
use kernels::allreduce::layout::{HEADER_CAPACITY, HEADER_MAGIC, HEADER_WORLD, SegmentLayout};
use kernels::allreduce::shm::{JoinError, SharedSegment, create_or_join};
use kernels::allreduce::tactic::default_blocks;
use kernels::allreduce::tactic::{
    AllReduceTactic, CONTROL_BYTES, CONTROL_STATUS, DeviceOffsets, FAMILY, KERNEL, KernelStatus,
    LaunchShape, pack_params,
};
use kernels::allreduce::{DType, Islands};
use kernels::device::dry::Dry;
use kernels::device::{Device, DeviceError, DeviceExt, DeviceMemory, KernelParams, LaunchConfig};

use super::counting::CountingDevice;

/// Sums partial results across the tensor-parallel ranks, on the device.
pub trait TpAllReduce<D: Device> {
    /// Ranks taking part.
    fn world(&self) -> usize;
    /// Sums the FP32 values `elements` of `data` (indices; the start a multiple of 4, so the
    /// kernel's 16-byte vectors stay aligned) over every rank, in place, in stream order
    /// (recorded, not run, while `dev` captures a graph). Every rank must make the same calls
    /// in the same order. At most [`capacity_elements`](Self::capacity_elements) values.
    fn sum_f32(
        &mut self,
        dev: &D,
        data: &D::Memory,
        elements: Range<usize>,
    ) -> Result<(), DeviceError>;
    /// The most values one [`sum_f32`](Self::sum_f32) takes (the segment's slot).
    fn capacity_elements(&self) -> usize;
    /// After a step's result is read: the first error a collective of the step left (a peer
    /// that timed out or called another collective).
    fn check(&mut self, dev: &D) -> Result<(), DeviceError>;
}

/// Devices whose memory addresses are host addresses of this process (the host execution
/// layer), so a kernel can address a shared-memory segment mapped here.
pub trait HostAddressed: Device {}

impl HostAddressed for cuda_host::HostDevice {}
impl<D: HostAddressed> HostAddressed for CountingDevice<D> {}
impl<D: Dry> Dry for CountingDevice<D> {}

/// Magic of a device all-reduce segment (not the CPU communicator's: the two never share one).
const SEGMENT_MAGIC: u64 = 0x6465_7674_7061_7231; // "devtpar1"
/// The emulated path launches one block: the host layer then needs no co-resident launch, and
/// one flag round per phase is what a decode-sized message costs on a GPU too.
const EMULATED_BLOCKS: u32 = 1;
const EMULATED_THREADS: u32 = 256;
/// One-shot pull: every rank reads every peer's outbox and sums in rank order (also what the
/// GPU communicator's default policy picks at every size).
const ALGORITHM: Algorithm = Algorithm::OneShot(Transfer::Pull);
/// Threads per block of the GPU collective's launches (an image of `tactic::THREADS`).
const GPU_THREADS: u32 = 512;

/// The tactic the GPU path launches for a message of `bytes`: blocks by size.
fn gpu_tactic(algorithm: Algorithm, bytes: usize) -> AllReduceTactic {
    AllReduceTactic {
        algorithm,
        dtype: DType::F32,
        threads: GPU_THREADS,
        blocks: default_blocks(bytes),
    }
}

/// `(read, written)` bytes of a one-shot pull of `bytes` over `world` ranks: this rank's
/// values into its outbox, every rank's outbox read, the sum written back.
fn one_shot_pull_traffic(bytes: usize, world: usize) -> (usize, usize) {
    (bytes * (1 + world), bytes * 2)
}

/// The device address of `elements` of FP32 `data`, checked against the allocation and the
/// kernel's alignment.
fn f32_range<M: DeviceMemory>(data: &M, elements: &Range<usize>) -> Result<u64, DeviceError> {
    if elements.is_empty() || elements.end * 4 > data.len() || !elements.start.is_multiple_of(4) {
        return Err(DeviceError::Invalid(format!(
            "all-reduce of FP32 values {elements:?} over an allocation of {} B (a non-empty \
             range inside it, starting at a multiple of 4)",
            data.len()
        )));
    }
    Ok(data.device_ptr() + (elements.start * 4) as u64)
}

fn setup_error(what: impl std::fmt::Display) -> DeviceError {
    DeviceError::Driver {
        what: "tensor-parallel all-reduce".into(),
        detail: what.to_string(),
    }
}

/// One rank's view of a segment laid out as `SegmentLayout` (the peers' regions as this
/// device addresses them) and the one-shot pull kernel over it: the launch the emulated and the
/// dry all-reduce share.
struct OneShotRank<D: Device> {
    rank: usize,
    world: usize,
    offsets: DeviceOffsets,
    islands: Islands,
    peers: Vec<u64>,
    kernel: D::Kernel,
    control: D::Memory,
}

impl<D: Device> OneShotRank<D> {
    /// `peers_base`: where rank 0's region starts (the regions follow as `layout` places
    /// them); the kernel is the image of `image`.
    fn new(
        dev: &D,
        rank: usize,
        world: usize,
        layout: &SegmentLayout,
        peers_base: u64,
        image: AllReduceTactic,
    ) -> Result<Self, DeviceError> {
        Ok(Self {
            rank,
            world,
            offsets: DeviceOffsets::new(layout),
            islands: default_islands(world),
            peers: (0..world)
                .map(|r| peers_base + layout.region(r) as u64)
                .collect(),
            kernel: dev.load_kernel(FAMILY, &image.image_id(), KERNEL, 0)?,
            control: dev.alloc_zeroed(CONTROL_BYTES)?,
        })
    }

    /// Launches the one-shot pull over the FP32 values `elements` of `data` on `blocks` ×
    /// `threads`.
    ///
    /// # Safety
    /// The peers' addresses must be the regions of a live segment (or, on a device that runs
    /// no kernel, any addresses).
    unsafe fn launch(
        &self,
        dev: &D,
        data: &D::Memory,
        elements: Range<usize>,
        (blocks, threads): (u32, u32),
        timeout_ns: u64,
    ) -> Result<(), DeviceError> {
        let address = f32_range(data, &elements)?;
        let shape = LaunchShape {
            algorithm: ALGORITHM,
            dtype: DType::F32,
            len: elements.len(),
            rank: self.rank,
            offsets: self.offsets,
            islands: &self.islands,
            timeout_ns,
        };
        let params = pack_params(
            &shape,
            &self.peers,
            address,
            None,
            self.control.device_ptr(),
        )
        .map_err(setup_error)?;
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let (read, written) = one_shot_pull_traffic(elements.len() * 4, self.world);
        let mut args = KernelParams::new();
        args.arg(&params).traffic(read, written);
        // SAFETY: the parameter is the kernel's one `ArParams`; its addresses are `data`'s
        // range (inside the allocation, checked above), this rank's control block and the
        // peers' regions (the caller's contract).
        unsafe { dev.launch(&self.kernel, cfg, &args) }
    }

    fn capacity_elements(&self) -> usize {
        self.offsets.capacity / 4
    }

    /// The status word the kernel left in this rank's control block, as an error unless it
    /// reports success.
    fn check(&self, dev: &D) -> Result<(), DeviceError> {
        let words: Vec<u64> = dev.download_first(&self.control, CONTROL_STATUS / 8 + 1)?;
        match KernelStatus::decode(words[CONTROL_STATUS / 8]) {
            KernelStatus::Ok => Ok(()),
            status => Err(setup_error(format_args!(
                "rank {} of {}: {status:?}",
                self.rank, self.world
            ))),
        }
    }
}

/// The emulated all-reduce: see the module documentation.
pub struct ShmAllReduce<D: Device> {
    /// Keeps every rank's region mapped; the name is unlinked once all ranks have attached.
    segment: SharedSegment,
    timeout: Duration,
    ranks: OneShotRank<D>,
}

impl<D: HostAddressed> ShmAllReduce<D> {
    /// Joins (rank 0: creates) segment `name` for `world` ranks, each message at most
    /// `capacity_bytes`; waits up to `timeout` for every rank to attach, and lets a collective
    /// wait that long for a peer.
    pub fn join(
        dev: &D,
        name: &str,
        rank: usize,
        world: usize,
        capacity_bytes: usize,
        timeout: Duration,
    ) -> Result<Self, DeviceError> {
        let layout = SegmentLayout::new(world, capacity_bytes, false);
        let deadline = Instant::now() + timeout;
        let mut segment = create_or_join(
            name,
            rank,
            layout.total(),
            HEADER_MAGIC,
            SEGMENT_MAGIC,
            deadline,
            |s| {
                s.atomic(HEADER_WORLD)
                    .store(world as u64, Ordering::Relaxed);
                s.atomic(HEADER_CAPACITY)
                    .store(layout.capacity as u64, Ordering::Relaxed);
            },
        )
        .map_err(|e| match e {
            JoinError::Io { op, source } => setup_error(format_args!("{op} {name:?}: {source}")),
            JoinError::NotPublished => setup_error(format_args!(
                "rank {rank}: segment {name:?} did not appear within {timeout:?}"
            )),
        })?;
        let found = (
            segment.atomic(HEADER_WORLD).load(Ordering::Relaxed),
            segment.atomic(HEADER_CAPACITY).load(Ordering::Relaxed),
        );
        if found != (world as u64, layout.capacity as u64) {
            return Err(setup_error(format_args!(
                "rank {rank}: segment {name:?} has (world, capacity) = {found:?}, this rank expects {:?}",
                (world, layout.capacity)
            )));
        }
        segment
            .atomic(layout.pid(rank))
            .store(u64::from(std::process::id()), Ordering::Relaxed);
        segment
            .atomic(layout.attached(rank))
            .store(1, Ordering::Release);
        while (0..world).any(|r| segment.atomic(layout.attached(r)).load(Ordering::Acquire) == 0) {
            if Instant::now() > deadline {
                return Err(setup_error(format_args!(
                    "rank {rank}: not every rank attached to {name:?} within {timeout:?}"
                )));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        // Every rank has it mapped: the name can go, so no kill can leak it.
        segment
            .unlink()
            .map_err(|e| setup_error(format_args!("unlinking {name:?}: {e}")))?;
        let image = AllReduceTactic {
            algorithm: ALGORITHM,
            dtype: DType::F32,
            threads: EMULATED_THREADS,
            blocks: EMULATED_BLOCKS,
        };
        let ranks = OneShotRank::new(dev, rank, world, &layout, segment.base() as u64, image)?;
        Ok(Self {
            segment,
            timeout,
            ranks,
        })
    }

    /// The segment's name (already unlinked from `/dev/shm`).
    pub fn segment_name(&self) -> &str {
        self.segment.name()
    }
}

impl<D: HostAddressed> TpAllReduce<D> for ShmAllReduce<D> {
    fn world(&self) -> usize {
        self.ranks.world
    }

    fn sum_f32(
        &mut self,
        dev: &D,
        data: &D::Memory,
        elements: Range<usize>,
    ) -> Result<(), DeviceError> {
        let timeout_ns = self.timeout.as_nanos().min(u64::MAX as u128) as u64;
        let grid = (EMULATED_BLOCKS, EMULATED_THREADS);
        // SAFETY: the peers' regions are those of the segment this value keeps mapped.
        unsafe { self.ranks.launch(dev, data, elements, grid, timeout_ns) }
    }

    fn capacity_elements(&self) -> usize {
        self.ranks.capacity_elements()
    }

    fn check(&mut self, dev: &D) -> Result<(), DeviceError> {
        self.ranks.check(dev)
    }
}

/// The all-reduce on GPUs: `CudaIpcCommunicator`'s kernels over CUDA IPC regions.
#[cfg(feature = "cuda")]
pub struct IpcAllReduce {
    communicator: kernels::allreduce::cuda::CudaIpcCommunicator,
}

#[cfg(feature = "cuda")]
impl IpcAllReduce {
    /// Joins rendezvous `name` as `rank` of `world` on GPU `device` (the executor's), messages
    /// up to `capacity_bytes`. Fails cleanly (an error, no panic) without a driver.
    pub fn join(
        device: usize,
        ptx_dir: &std::path::Path,
        name: &str,
        rank: usize,
        world: usize,
        capacity_bytes: usize,
        timeout: Duration,
    ) -> Result<Self, DeviceError> {
        use kernels::allreduce::cuda::{CudaIpcCommunicator, CudaIpcConfig};
        let config = CudaIpcConfig {
            device,
            ptx_dir: ptx_dir.to_path_buf(),
            timeout,
            capacity_bytes,
            ..CudaIpcConfig::default()
        };
        let communicator =
            CudaIpcCommunicator::new(name, rank, world, config).map_err(setup_error)?;
        Ok(Self { communicator })
    }
}

#[cfg(feature = "cuda")]
impl TpAllReduce<kernels::cuda::GpuContext> for IpcAllReduce {
    fn world(&self) -> usize {
        self.communicator.islands().world_size()
    }

    fn sum_f32(
        &mut self,
        _dev: &kernels::cuda::GpuContext,
        data: &kernels::cuda::GpuMemory,
        elements: Range<usize>,
    ) -> Result<(), DeviceError> {
        use kernels::allreduce::cost::Choice;
        let address = f32_range(data, &elements)?;
        let elements = elements.len();
        let bytes = elements * 4;
        let algorithm = match self.communicator.choose(bytes) {
            Choice::Custom(algorithm) => algorithm,
            // In place on the executor's stream, captured into the decode graph like our
            // kernels (NCCL's own summation order: not bit-identical to the custom kernels').
            Choice::Nccl => {
                // SAFETY: `address` starts `elements` FP32 values inside a live allocation of
                // the executor's device; NCCL runs on the communicator's stream, the context's
                // default stream the executor launches on, so stream order protects them.
                let summed = unsafe { self.communicator.nccl_raw(DType::F32, elements, address) };
                return summed.map_err(setup_error);
            }
        };
        let tactic = gpu_tactic(algorithm, bytes);
        // SAFETY: `address` starts `elements` FP32 values inside a live allocation of the
        // executor's device; the communicator's stream is that context's default stream, the
        // executor's, so stream order keeps the step's other launches off it meanwhile.
        unsafe {
            self.communicator
                .launch_raw(tactic, elements, address, None)
        }
        .map_err(setup_error)
    }

    fn capacity_elements(&self) -> usize {
        self.communicator.capacity_bytes() / 4
    }

    fn check(&mut self, _dev: &kernels::cuda::GpuContext) -> Result<(), DeviceError> {
        self.communicator.check().map_err(setup_error)
    }
}

/// The GPU path's collective for one rank, on a device where no kernel runs: see the module
/// documentation. The peers' regions are one allocation of this device laid out as the
/// communicator's segment, so the parameter block is the one a GPU launch would get.
pub struct DryAllReduce<D: Device> {
    ranks: OneShotRank<D>,
    /// Keeps the peers' addresses allocated.
    _segment: D::Memory,
}

impl<D: Dry> DryAllReduce<D> {
    /// Rank `rank` of `world`, messages up to `capacity_bytes`.
    pub fn new(
        dev: &D,
        rank: usize,
        world: usize,
        capacity_bytes: usize,
    ) -> Result<Self, DeviceError> {
        if rank >= world {
            return Err(setup_error(format_args!("rank {rank} of {world}")));
        }
        let layout = SegmentLayout::new(world, capacity_bytes, false);
        let segment = dev.alloc_zeroed(layout.total())?;
        // Every message size launches the same image; blocks differ only in the grid.
        let image = gpu_tactic(ALGORITHM, capacity_bytes);
        Ok(Self {
            ranks: OneShotRank::new(dev, rank, world, &layout, segment.device_ptr(), image)?,
            _segment: segment,
        })
    }
}

impl<D: Dry> TpAllReduce<D> for DryAllReduce<D> {
    fn world(&self) -> usize {
        self.ranks.world
    }

    fn sum_f32(
        &mut self,
        dev: &D,
        data: &D::Memory,
        elements: Range<usize>,
    ) -> Result<(), DeviceError> {
        let tactic = gpu_tactic(ALGORITHM, elements.len() * 4);
        tactic.validate().map_err(setup_error)?;
        // SAFETY: a `Dry` device runs no kernel.
        unsafe {
            self.ranks
                .launch(dev, data, elements, (tactic.blocks, tactic.threads), 0)
        }
    }

    fn capacity_elements(&self) -> usize {
        self.ranks.capacity_elements()
    }

    fn check(&mut self, dev: &D) -> Result<(), DeviceError> {
        self.ranks.check(dev)
    }
}
