//! The all-reduce protocol on GPUs over CUDA IPC (feature `cuda`): [`CudaIpcCommunicator`].
//!
//! Each rank (one process per GPU on one host) allocates one region with `cuMemAlloc` laid out
//! like a rank's region of [`SegmentLayout`], exports it with `cuIpcGetMemHandle`, and swaps
//! handles with the other ranks through a small POSIX shared-memory segment (the CPU backend's
//! [`SharedSegment`]). Peers' regions are opened with `cuIpcOpenMemHandle_v2` (lazy peer
//! access); peers on another GPU must pass `cuDeviceCanAccessPeer`, or the custom kernels are
//! off for this communicator and NCCL carries everything. The kernels (`allreduce.cu`) run
//! the algorithm the [`ChoicePolicy`] picks per message size; with feature `nccl`, sizes where
//! the cost model prefers NCCL (and hosts without P2P) go to `ncclAllReduce` through cudarc's
//! safe wrapper, libnccl opened at run time.
//!
//! Errors, never panics: no driver, no device, a missing cubin, a refused IPC open or a dead
//! peer come back as [`AllReduceError`]. A kernel that waited past the timeout leaves an error
//! word in the rank's control block; the next check reads it, and the communicator is
//! poisoned like the CPU one.
//!
//! Two ways to call it:
//! * [`AllReduce`] on host slices (tests, the CPU-side model): copy in, launch, copy out, sync.
//! * [`CudaIpcCommunicator::all_reduce_device`] on device buffers, asynchronous on the
//!   communicator's stream and capturable in a CUDA graph (the generation lives on the
//!   device); [`CudaIpcCommunicator::check`] synchronizes and reports kernel errors.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use cudarc::driver::sys::{self, CUdeviceptr, CUipcMem_flags, CUipcMemHandle};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DevicePtrMut,
    DeviceRepr, LaunchConfig, PushKernelArg,
};

use super::algorithm::{Algorithm, Transfer};
use super::cost::Choice;
use super::cpu::default_islands;
use super::element::DType;
use super::layout::SegmentLayout;
use super::shm::{JoinError, SharedSegment, create_or_join};
use super::tactic::{
    AllReduceTactic, ArParams, CONTROL_BYTES, CONTROL_STATUS, ChoicePolicy, DeviceOffsets, FAMILY,
    KERNEL, KernelStatus, LaunchShape, MAX_RANKS, default_blocks, pack_params,
};
use super::topology::Islands;
use super::{AllReduce, AllReduceError, ReduceData};
use crate::cuda::{GpuContext, default_ptx_dir, find_kernel_image};

// SAFETY: plain-old-data with the layout of `struct ArParams` in allreduce.cu (asserted in
// tactic.rs and by a static_assert in the kernel).
unsafe impl DeviceRepr for ArParams {}

/// How a CUDA communicator is set up.
#[derive(Debug, Clone)]
pub struct CudaIpcConfig {
    /// Device ordinal in this process.
    pub device: usize,
    /// Where the compile gate's cubins are (`ptx/allreduce/<sm>/`).
    pub ptx_dir: PathBuf,
    /// Longest a kernel waits for any one peer flag, and the host for the rendezvous.
    pub timeout: Duration,
    /// Largest message in bytes.
    pub capacity_bytes: usize,
    /// Allocate push inboxes (`world` slots per phase and parity).
    pub enable_push: bool,
    /// Islands of the hierarchical algorithm; `None`: two contiguous halves.
    pub islands: Option<Islands>,
    /// Per message size: which algorithm, or NCCL.
    pub policy: ChoicePolicy,
    /// Threads per block (an image must exist: `tactic::THREADS`).
    pub threads: u32,
    /// Blocks per launch; `None`: [`default_blocks`] by size.
    pub blocks: Option<u32>,
}

impl Default for CudaIpcConfig {
    fn default() -> Self {
        CudaIpcConfig {
            device: 0,
            ptx_dir: default_ptx_dir(),
            timeout: Duration::from_secs(10),
            capacity_bytes: 1 << 20,
            enable_push: true,
            islands: None,
            policy: ChoicePolicy::fixed(Choice::Custom(Algorithm::OneShot(Transfer::Pull))),
            threads: 512,
            blocks: None,
        }
    }
}

fn dev_err(what: impl std::fmt::Display) -> AllReduceError {
    AllReduceError::Device(what.to_string())
}

fn check(what: &str, r: sys::CUresult) -> Result<(), AllReduceError> {
    match r {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        e => Err(dev_err(format_args!("{what}: {e:?}"))),
    }
}

/// Runs `f`, turning a panic inside cudarc (missing library or symbol) into an error.
fn no_panic<T>(
    what: &str,
    f: impl FnOnce() -> Result<T, AllReduceError>,
) -> Result<T, AllReduceError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|payload| {
        let detail = payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "unknown panic".into());
        Err(dev_err(format_args!(
            "{what}: the CUDA library is unusable: {detail}"
        )))
    })
}

/// A `cuMemAlloc` allocation (not a stream-ordered pool allocation: IPC handles can only be
/// taken of the former), freed on drop.
struct Region {
    ptr: CUdeviceptr,
    ctx: Arc<CudaContext>,
}

impl Region {
    /// `bytes` of zeros, on `stream`'s context.
    fn new(stream: &Arc<CudaStream>, bytes: usize) -> Result<Self, AllReduceError> {
        let ctx = stream.context();
        ctx.bind_to_thread().map_err(dev_err)?;
        let mut ptr: CUdeviceptr = 0;
        // SAFETY: out-parameter call on the bound context.
        check("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes) })?;
        let region = Region {
            ptr,
            ctx: ctx.clone(),
        };
        // Flags must start at generation 0 and slots are compared bitwise nowhere, but zero
        // everything: cheap, once, and deterministic. On the stream the kernels run on: the
        // synchronous cuMemsetD8 goes to the legacy stream, which the communicator's
        // (non-blocking) stream does not wait for, so a first collective could read flags
        // the memset has not cleared yet.
        // SAFETY: the allocation is `bytes` long; the stream belongs to its context.
        check("cuMemsetD8Async", unsafe {
            sys::cuMemsetD8Async(ptr, 0, bytes, stream.cu_stream())
        })?;
        // Zero before any peer can see the region (its handle is published next).
        stream.synchronize().map_err(dev_err)?;
        Ok(region)
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by cuMemAlloc in `new`, freed once.
            let _ = unsafe { sys::cuMemFree_v2(self.ptr) };
        }
    }
}

/// Where NCCL is missing (no libnccl, no NCCL id at the rendezvous, a build without feature
/// `nccl`) the sizes the policy gives it go to our kernels, with one line saying so (rank 0).
fn without_nccl(config: &mut CudaIpcConfig, rank: usize) {
    if !config.policy.uses_nccl() {
        return;
    }
    config.policy = config.policy.without_nccl();
    if rank == 0 {
        eprintln!(
            "all-reduce: NCCL is unavailable (libnccl, or a build without feature `nccl`): the \
             message sizes the policy gave it run on the custom kernels ({:?})",
            config.policy.choices()
        );
    }
}

/// Rendezvous segment: header page, then one 256-byte line per rank.
mod rdv {
    pub const MAGIC: u64 = 0x6172_6375_6461_6970; // "arcudaip"
    pub const HDR_MAGIC: usize = 0;
    pub const HDR_WORLD: usize = 8;
    pub const HDR_REGION: usize = 16;
    /// 0 unset, 1 NCCL id below is valid, 2 rank 0 could not create one.
    #[cfg_attr(not(feature = "nccl"), allow(dead_code))]
    pub const HDR_NCCL_STATE: usize = 64;
    #[cfg_attr(not(feature = "nccl"), allow(dead_code))]
    pub const HDR_NCCL_ID: usize = 128;
    pub const RANKS: usize = 4096;
    pub const LINE: usize = 256;
    pub const READY: usize = 0;
    pub const PID: usize = 8;
    pub const OPENED: usize = 16;
    pub const CLOSED: usize = 24;
    pub const BUS_ID: usize = 32; // 32 bytes, NUL terminated
    pub const HANDLE: usize = 64; // CUipcMemHandle, 64 bytes
    pub fn line(rank: usize) -> usize {
        RANKS + rank * LINE
    }
    pub fn bytes() -> usize {
        RANKS + super::MAX_RANKS * LINE
    }
    const _: () = {
        assert!(HDR_NCCL_ID + 128 <= RANKS);
        assert!(BUS_ID + 32 <= HANDLE);
        assert!(HANDLE + 64 <= LINE);
        assert!(std::mem::size_of::<super::CUipcMemHandle>() == 64);
    };
}

fn seg_bytes(seg: &SharedSegment, offset: usize, len: usize) -> &[u8] {
    assert!(offset + len <= seg.len());
    // SAFETY: in bounds; these bytes are written before a release store that the reader
    // acquired, and never rewritten afterwards.
    unsafe { std::slice::from_raw_parts(seg.base().add(offset), len) }
}

fn seg_write(seg: &SharedSegment, offset: usize, bytes: &[u8]) {
    assert!(offset + bytes.len() <= seg.len());
    // SAFETY: in bounds; only this rank writes its own line (rank 0 the header), before the
    // release store that publishes it.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), seg.base().add(offset), bytes.len()) }
}

/// Waits until `word` of every rank's line is non-zero, or the deadline.
fn wait_all(
    seg: &SharedSegment,
    world: usize,
    word: usize,
    deadline: Instant,
    what: &str,
) -> Result<(), AllReduceError> {
    for r in 0..world {
        while seg.atomic(rdv::line(r) + word).load(Ordering::Acquire) == 0 {
            if Instant::now() > deadline {
                return Err(AllReduceError::Setup(format!(
                    "rank {r} did not reach '{what}' in time"
                )));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    Ok(())
}

#[cfg(feature = "nccl")]
mod nccl {
    //! NCCL through cudarc's safe wrapper; libnccl is opened at run time.
    use super::*;
    use cudarc::nccl::{Comm, Id, ReduceOp};

    pub struct Nccl(pub Comm);

    // SAFETY: an NCCL communicator may be used from any thread as long as calls on it are not
    // concurrent (NCCL user guide, "Thread safety"); `Nccl` is only reached through the owning
    // communicator's `&mut self`, so moving it to another thread is sound. cudarc's `Comm`
    // is !Send only because it holds a raw pointer.
    unsafe impl Send for Nccl {}

    pub fn available() -> bool {
        // SAFETY: only tries to dlopen the candidates.
        unsafe { cudarc::nccl::sys::is_culib_present() }
    }

    pub fn new_id() -> Result<[u8; 128], AllReduceError> {
        no_panic("ncclGetUniqueId", || {
            let id = Id::new().map_err(|e| dev_err(format_args!("ncclGetUniqueId: {e:?}")))?;
            Ok((*id.internal()).map(|c| c as u8))
        })
    }

    pub fn init(
        stream: Arc<CudaStream>,
        rank: usize,
        world: usize,
        id: [u8; 128],
    ) -> Result<Nccl, AllReduceError> {
        no_panic("ncclCommInitRank", || {
            let id = Id::uninit(id.map(|b| b as ::core::ffi::c_char));
            Comm::from_rank(stream, rank, world, id)
                .map(Nccl)
                .map_err(|e| dev_err(format_args!("ncclCommInitRank: {e:?}")))
        })
    }

    impl Nccl {
        /// In-place sum of `len` elements at the start of `buf`.
        pub fn all_reduce(
            &self,
            dtype: DType,
            buf: &mut CudaSlice<u8>,
            len: usize,
        ) -> Result<(), AllReduceError> {
            let r = match dtype {
                DType::Bf16 => {
                    // SAFETY: `buf` holds at least len bf16 (checked by the caller); any bit
                    // pattern is a valid bf16.
                    let mut v = unsafe { buf.transmute_mut::<half::bf16>(len) }
                        .ok_or_else(|| dev_err("NCCL buffer too small"))?;
                    self.0.all_reduce_in_place(&mut v, &ReduceOp::Sum)
                }
                DType::F32 => {
                    // SAFETY: as above, for f32.
                    let mut v = unsafe { buf.transmute_mut::<f32>(len) }
                        .ok_or_else(|| dev_err("NCCL buffer too small"))?;
                    self.0.all_reduce_in_place(&mut v, &ReduceOp::Sum)
                }
            };
            r.map(|_| ())
                .map_err(|e| dev_err(format_args!("ncclAllReduce: {e:?}")))
        }

        /// In-place sum of `len` elements at device address `data`, enqueued on the
        /// communicator's stream (graph-capturable: NCCL ≥ 2.9 records its kernels into a
        /// capture like any launch).
        ///
        /// # Safety
        /// `data` holds `len` elements of `dtype` on this communicator's device, and nothing
        /// else writes them until the call completes in stream order.
        pub unsafe fn all_reduce_raw(
            &self,
            dtype: DType,
            data: u64,
            len: usize,
        ) -> Result<(), AllReduceError> {
            let r = match dtype {
                DType::Bf16 => self.0.all_reduce_in_place(
                    &mut Raw::<half::bf16>::new(data, len, self.0.stream()),
                    &ReduceOp::Sum,
                ),
                DType::F32 => self.0.all_reduce_in_place(
                    &mut Raw::<f32>::new(data, len, self.0.stream()),
                    &ReduceOp::Sum,
                ),
            };
            r.map(|_| ())
                .map_err(|e| dev_err(format_args!("ncclAllReduce: {e:?}")))
        }
    }

    /// A device range given by its address, for cudarc's NCCL calls (which take slices): the
    /// executor's buffers are not cudarc slices of this communicator.
    struct Raw<T> {
        ptr: CUdeviceptr,
        len: usize,
        stream: Arc<CudaStream>,
        _element: std::marker::PhantomData<T>,
    }

    impl<T> Raw<T> {
        fn new(ptr: u64, len: usize, stream: Arc<CudaStream>) -> Self {
            Self {
                ptr,
                len,
                stream,
                _element: std::marker::PhantomData,
            }
        }
    }

    impl<T> cudarc::driver::DeviceSlice<T> for Raw<T> {
        fn len(&self) -> usize {
            self.len
        }
        fn stream(&self) -> &Arc<CudaStream> {
            &self.stream
        }
    }

    impl<T> cudarc::driver::DevicePtrMut<T> for Raw<T> {
        fn device_ptr_mut<'a>(
            &'a mut self,
            _stream: &'a CudaStream,
        ) -> (CUdeviceptr, cudarc::driver::SyncOnDrop<'a>) {
            // One stream (the executor's): stream order is all the ordering there is.
            (self.ptr, cudarc::driver::SyncOnDrop::Sync(None))
        }
    }
}

/// One rank of the CUDA all-reduce.
pub struct CudaIpcCommunicator {
    gpu: GpuContext,
    stream: Arc<CudaStream>,
    rank: usize,
    world: usize,
    offsets: DeviceOffsets,
    islands: Islands,
    config: CudaIpcConfig,
    /// Peers' regions as opened here (`None` at this rank's own index).
    opened: Vec<Option<CUdeviceptr>>,
    /// Every rank's region as the kernel addresses it.
    peers: Vec<u64>,
    /// Declared after `opened` users; dropped after the peers are closed (see `Drop`).
    region: Option<Region>,
    ctl: CudaSlice<u8>,
    stage: CudaSlice<u8>,
    stage_residual: CudaSlice<u8>,
    images: HashMap<String, (Arc<CudaModule>, CudaFunction)>,
    /// Whether our kernels can run (all peers reachable by P2P or on this device).
    custom_ok: bool,
    #[cfg(feature = "nccl")]
    nccl: Option<nccl::Nccl>,
    segment: Option<SharedSegment>,
    pids: Vec<u32>,
    poisoned: Option<String>,
    calls: u64,
}

/// What one rank contributes to a group made inside one process (see
/// [`CudaIpcCommunicator::in_process_group`]).
struct Parts {
    gpu: GpuContext,
    stream: Arc<CudaStream>,
    region: Region,
}

impl CudaIpcCommunicator {
    /// Joins (rank 0: creates) the rendezvous `name` for `world` ranks, one process each.
    pub fn new(
        name: &str,
        rank: usize,
        world: usize,
        config: CudaIpcConfig,
    ) -> Result<Self, AllReduceError> {
        no_panic("all-reduce setup", || {
            Self::new_inner(name, rank, world, config)
        })
    }

    fn new_inner(
        name: &str,
        rank: usize,
        world: usize,
        config: CudaIpcConfig,
    ) -> Result<Self, AllReduceError> {
        if world == 0 || world > MAX_RANKS || rank >= world {
            return Err(AllReduceError::Setup(format!(
                "rank {rank} of world {world} (the kernels address 1..={MAX_RANKS} ranks)"
            )));
        }
        let layout = SegmentLayout::new(world, config.capacity_bytes, config.enable_push);
        let offsets = DeviceOffsets::new(&layout);
        let gpu = GpuContext::new(config.device, config.ptx_dir.clone()).map_err(dev_err)?;
        let ctx = gpu.context().clone();
        let stream = gpu.stream().clone();
        let region = Region::new(&stream, offsets.region_bytes)?;
        let deadline = Instant::now() + config.timeout;

        // Rendezvous: publish handle and bus id, wait for everyone, open the peers.
        let mut handle = CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: out-parameter call; `region.ptr` is the base of a cuMemAlloc allocation.
        check("cuIpcGetMemHandle", unsafe {
            sys::cuIpcGetMemHandle(&mut handle, region.ptr)
        })?;
        let my_bus = bus_id(&ctx)?;
        let shm_err = |op, source| AllReduceError::Shm {
            op,
            name: name.to_string(),
            source,
        };
        let mut segment = create_or_join(
            name,
            rank,
            rdv::bytes(),
            rdv::HDR_MAGIC,
            rdv::MAGIC,
            deadline,
            |s| {
                s.atomic(rdv::HDR_WORLD)
                    .store(world as u64, Ordering::Relaxed);
                s.atomic(rdv::HDR_REGION)
                    .store(offsets.region_bytes as u64, Ordering::Relaxed);
            },
        )
        .map_err(|e| match e {
            JoinError::Io { op, source } => shm_err(op, source),
            JoinError::NotPublished => AllReduceError::Setup(format!(
                "rank {rank}: rendezvous {name:?} did not appear within {:?}",
                config.timeout
            )),
        })?;
        let found = (
            segment.atomic(rdv::HDR_WORLD).load(Ordering::Relaxed),
            segment.atomic(rdv::HDR_REGION).load(Ordering::Relaxed),
        );
        if found != (world as u64, offsets.region_bytes as u64) {
            return Err(AllReduceError::Setup(format!(
                "rank {rank}: rendezvous {name:?} has (world, region bytes) = {found:?}, this rank expects {:?}",
                (world, offsets.region_bytes)
            )));
        }
        let line = rdv::line(rank);
        // The handle is 64 opaque bytes; copied as such into the segment.
        let handle_bytes: [u8; 64] = handle.reserved.map(|c| c as u8);
        seg_write(&segment, line + rdv::HANDLE, &handle_bytes);
        seg_write(&segment, line + rdv::BUS_ID, &my_bus);
        segment
            .atomic(line + rdv::PID)
            .store(u64::from(std::process::id()), Ordering::Relaxed);
        #[cfg(feature = "nccl")]
        if rank == 0 {
            // Created whether or not the policy uses NCCL now: the P2P check below may hand
            // everything to NCCL, and every rank must agree on whether it exists.
            let state = if config.policy.uses_nccl() && nccl::available() {
                match nccl::new_id() {
                    Ok(id) => {
                        seg_write(&segment, rdv::HDR_NCCL_ID, &id);
                        1
                    }
                    Err(_) => 2,
                }
            } else {
                2
            };
            segment
                .atomic(rdv::HDR_NCCL_STATE)
                .store(state, Ordering::Relaxed);
        }
        segment
            .atomic(line + rdv::READY)
            .store(1, Ordering::Release);
        wait_all(&segment, world, rdv::READY, deadline, "ready")?;

        let mut opened: Vec<Option<CUdeviceptr>> = vec![None; world];
        let mut peers = vec![0u64; world];
        let mut custom_ok = true;
        let mut why_not = String::new();
        peers[rank] = region.ptr;
        for peer in (0..world).filter(|&p| p != rank) {
            let pl = rdv::line(peer);
            let bus: [u8; 32] = seg_bytes(&segment, pl + rdv::BUS_ID, 32)
                .try_into()
                .expect("32 bytes");
            if bus != my_bus && !can_access_peer(&ctx, &bus)? {
                custom_ok = false;
                why_not = format!(
                    "rank {peer}'s GPU {} is not P2P-reachable from {}",
                    bus_str(&bus),
                    bus_str(&my_bus)
                );
                continue;
            }
            let mut h = CUipcMemHandle { reserved: [0; 64] };
            for (d, s) in h
                .reserved
                .iter_mut()
                .zip(seg_bytes(&segment, pl + rdv::HANDLE, 64))
            {
                *d = *s as ::core::ffi::c_char;
            }
            let mut ptr: CUdeviceptr = 0;
            // SAFETY: out-parameter call with a handle another process exported.
            let r = unsafe {
                sys::cuIpcOpenMemHandle_v2(
                    &mut ptr,
                    h,
                    CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                )
            };
            check(&format!("cuIpcOpenMemHandle of rank {peer}'s region"), r)?;
            opened[peer] = Some(ptr);
            peers[peer] = ptr;
        }
        // OPENED is 1, or 2 when this rank cannot reach some peer: then no rank runs the
        // custom kernels (a rank that refused would leave the others waiting on its flags).
        segment
            .atomic(line + rdv::OPENED)
            .store(1 + u64::from(!custom_ok), Ordering::Release);
        wait_all(&segment, world, rdv::OPENED, deadline, "opened")?;
        if let Some(r) = (0..world).find(|&r| {
            segment
                .atomic(rdv::line(r) + rdv::OPENED)
                .load(Ordering::Acquire)
                == 2
        }) && custom_ok
        {
            custom_ok = false;
            why_not = format!("rank {r} cannot reach all of its peers by P2P");
        }
        if rank == 0 {
            // Everyone has mapped it: no name left behind whatever happens next.
            segment.unlink().map_err(|e| shm_err("unlink", e))?;
        }
        let pids = (0..world)
            .map(|r| {
                segment
                    .atomic(rdv::line(r) + rdv::PID)
                    .load(Ordering::Relaxed) as u32
            })
            .collect();

        #[cfg(feature = "nccl")]
        let nccl = {
            let state = segment.atomic(rdv::HDR_NCCL_STATE).load(Ordering::Relaxed);
            if state == 1 {
                let id: [u8; 128] = seg_bytes(&segment, rdv::HDR_NCCL_ID, 128)
                    .try_into()
                    .expect("128 bytes");
                Some(nccl::init(stream.clone(), rank, world, id)?)
            } else {
                None
            }
        };
        if !custom_ok {
            #[cfg(feature = "nccl")]
            let fallback = nccl.is_some();
            #[cfg(not(feature = "nccl"))]
            let fallback = false;
            if !fallback {
                return Err(AllReduceError::Setup(format!(
                    "rank {rank}: {why_not}, and no NCCL fallback (build with feature `nccl`, \
                     install libnccl, and give the policy an NCCL choice)"
                )));
            }
        }
        #[cfg(feature = "nccl")]
        let have_nccl = nccl.is_some();
        #[cfg(not(feature = "nccl"))]
        let have_nccl = false;
        let mut config = config;
        if custom_ok && !have_nccl {
            without_nccl(&mut config, rank);
        }
        let parts = Parts {
            gpu,
            stream,
            region,
        };
        let mut comm = Self::assemble(parts, rank, world, offsets, config, peers)?;
        comm.opened = opened;
        comm.custom_ok = custom_ok;
        comm.segment = Some(segment);
        comm.pids = pids;
        #[cfg(feature = "nccl")]
        {
            comm.nccl = nccl;
        }
        Ok(comm)
    }

    /// `world` ranks inside this process, one stream each on device `config.device`, peers'
    /// regions addressed directly (no IPC: a process cannot open its own IPC handles). For
    /// checking the kernels on one GPU, where separate processes would only time-slice: the
    /// ranks' kernels run concurrently, so they exercise the protocol at full speed (over HBM,
    /// not PCIe). Call each rank from its own thread.
    pub fn in_process_group(
        world: usize,
        config: CudaIpcConfig,
    ) -> Result<Vec<Self>, AllReduceError> {
        no_panic("all-reduce setup", || Self::in_process_inner(world, config))
    }

    fn in_process_inner(
        world: usize,
        mut config: CudaIpcConfig,
    ) -> Result<Vec<Self>, AllReduceError> {
        // One process: no NCCL group here.
        without_nccl(&mut config, 0);
        if world == 0 || world > MAX_RANKS {
            return Err(AllReduceError::Setup(format!(
                "world {world} (the kernels address 1..={MAX_RANKS} ranks)"
            )));
        }
        let layout = SegmentLayout::new(world, config.capacity_bytes, config.enable_push);
        let offsets = DeviceOffsets::new(&layout);
        let mut parts = Vec::new();
        for _ in 0..world {
            let gpu = GpuContext::new(config.device, config.ptx_dir.clone()).map_err(dev_err)?;
            let stream = gpu.context().new_stream().map_err(dev_err)?;
            let region = Region::new(&stream, offsets.region_bytes)?;
            parts.push(Parts {
                gpu,
                stream,
                region,
            });
        }
        let peers: Vec<u64> = parts.iter().map(|p| p.region.ptr).collect();
        parts
            .into_iter()
            .enumerate()
            .map(|(rank, p)| Self::assemble(p, rank, world, offsets, config.clone(), peers.clone()))
            .collect()
    }

    /// A communicator that only runs NCCL (feature `nccl`): for ranks on several nodes, where
    /// CUDA IPC does not reach. `id` comes from [`nccl_unique_id`] on rank 0, handed to the
    /// other ranks by the launcher (the IPC rendezvous is a shared-memory segment, one host
    /// only).
    #[cfg(feature = "nccl")]
    pub fn nccl_only(
        rank: usize,
        world: usize,
        id: [u8; 128],
        config: CudaIpcConfig,
    ) -> Result<Self, AllReduceError> {
        no_panic("NCCL setup", || {
            if world == 0 || rank >= world {
                return Err(AllReduceError::Setup(format!(
                    "rank {rank} of world {world}"
                )));
            }
            if !nccl::available() {
                return Err(dev_err("libnccl could not be opened"));
            }
            let layout = SegmentLayout::new(world, config.capacity_bytes, false);
            let offsets = DeviceOffsets::new(&layout);
            let gpu = GpuContext::new(config.device, config.ptx_dir.clone()).map_err(dev_err)?;
            let stream = gpu.stream().clone();
            // Our kernels never run here; a page keeps `assemble` uniform.
            let region = Region::new(&stream, 4096)?;
            let nccl = nccl::init(stream.clone(), rank, world, id)?;
            let config = CudaIpcConfig {
                policy: ChoicePolicy::fixed(Choice::Nccl),
                ..config
            };
            let parts = Parts {
                gpu,
                stream,
                region,
            };
            let mut comm = Self::assemble(parts, rank, world, offsets, config, vec![0; world])?;
            comm.custom_ok = false;
            comm.nccl = Some(nccl);
            Ok(comm)
        })
    }

    fn assemble(
        parts: Parts,
        rank: usize,
        world: usize,
        offsets: DeviceOffsets,
        config: CudaIpcConfig,
        peers: Vec<u64>,
    ) -> Result<Self, AllReduceError> {
        let islands = config
            .islands
            .clone()
            .unwrap_or_else(|| default_islands(world));
        if islands.world_size() != world {
            return Err(AllReduceError::Setup(format!(
                "islands {} do not cover world {world}",
                islands.to_spec()
            )));
        }
        let Parts {
            gpu,
            stream,
            region,
        } = parts;
        let alloc = |bytes: usize| -> Result<CudaSlice<u8>, AllReduceError> {
            stream.alloc_zeros::<u8>(bytes).map_err(dev_err)
        };
        let ctl = alloc(CONTROL_BYTES)?;
        let stage = alloc(offsets.capacity)?;
        let stage_residual = alloc(offsets.capacity)?;
        stream.synchronize().map_err(dev_err)?;
        let mut comm = CudaIpcCommunicator {
            gpu,
            stream,
            rank,
            world,
            offsets,
            islands,
            config,
            opened: vec![None; world],
            peers,
            region: Some(region),
            ctl,
            stage,
            stage_residual,
            images: HashMap::new(),
            custom_ok: true,
            #[cfg(feature = "nccl")]
            nccl: None,
            segment: None,
            pids: vec![0; world],
            poisoned: None,
            calls: 0,
        };
        // Load every image the policy can pick now, not inside a (possibly captured) call.
        for choice in comm.config.policy.choices() {
            if let Choice::Custom(a) = choice {
                for dtype in [DType::Bf16, DType::F32] {
                    comm.function(a, dtype)?;
                }
            }
        }
        Ok(comm)
    }

    pub fn islands(&self) -> &Islands {
        &self.islands
    }

    pub fn capacity_bytes(&self) -> usize {
        self.offsets.capacity
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub fn gpu(&self) -> &GpuContext {
        &self.gpu
    }

    /// Whether the NCCL fallback is live.
    pub fn has_nccl(&self) -> bool {
        #[cfg(feature = "nccl")]
        {
            self.nccl.is_some()
        }
        #[cfg(not(feature = "nccl"))]
        {
            false
        }
    }

    fn function(
        &mut self,
        algorithm: Algorithm,
        dtype: DType,
    ) -> Result<CudaFunction, AllReduceError> {
        let image = AllReduceTactic {
            algorithm,
            dtype,
            threads: self.config.threads,
            blocks: 1,
        };
        image.validate().map_err(AllReduceError::Setup)?;
        let id = image.image_id();
        if let Some((_, f)) = self.images.get(&id) {
            return Ok(f.clone());
        }
        let sm = self.gpu.sm().map_err(dev_err)?;
        let path = find_kernel_image(&self.config.ptx_dir, FAMILY, sm, &id).map_err(dev_err)?;
        let module = crate::cuda::load_module(&self.gpu, &path).map_err(dev_err)?;
        let f = module
            .load_function(KERNEL)
            .map_err(|e| dev_err(format_args!("{}: {KERNEL}: {e}", path.display())))?;
        self.images.insert(id, (module, f.clone()));
        Ok(f)
    }

    /// The policy's choice, or NCCL when our kernels are off for this communicator (a peer
    /// without P2P, or an NCCL-only communicator).
    pub fn choose(&self, bytes: usize) -> Choice {
        if self.custom_ok {
            self.config.policy.choose(bytes)
        } else {
            Choice::Nccl
        }
    }

    fn tactic(&self, algorithm: Algorithm, dtype: DType, bytes: usize) -> AllReduceTactic {
        AllReduceTactic {
            algorithm,
            dtype,
            threads: self.config.threads,
            blocks: self.config.blocks.unwrap_or_else(|| default_blocks(bytes)),
        }
    }

    fn ensure_usable(&self) -> Result<(), AllReduceError> {
        match &self.poisoned {
            Some(why) => Err(AllReduceError::Poisoned(why.clone())),
            None => Ok(()),
        }
    }

    /// Launches `algorithm` on `len` elements at device address `data` (in place), with the
    /// residual at `residual` if any, on the communicator's stream. Asynchronous.
    ///
    /// # Safety
    /// `data` (and `residual`) must be live device allocations of at least `len` elements of
    /// `dtype`, not written by anything else until the launch completes; every rank must make
    /// the same call (algorithm, dtype, len) in the same order.
    pub unsafe fn launch_raw(
        &mut self,
        tactic: AllReduceTactic,
        len: usize,
        data: u64,
        residual: Option<u64>,
    ) -> Result<(), AllReduceError> {
        self.ensure_usable()?;
        if !self.custom_ok {
            return Err(dev_err(
                "custom kernels are off: a peer is not P2P-reachable (NCCL carries this communicator)",
            ));
        }
        tactic.validate().map_err(AllReduceError::Setup)?;
        // The image loaded is the configured thread count's: a block of another size would
        // run code compiled for a different one.
        if tactic.threads != self.config.threads {
            return Err(AllReduceError::Setup(format!(
                "{tactic}: this communicator runs the {}-thread images",
                self.config.threads
            )));
        }
        let f = self.function(tactic.algorithm, tactic.dtype)?;
        let (ctl, _sync) = self.ctl.device_ptr(&self.stream);
        let shape = LaunchShape {
            algorithm: tactic.algorithm,
            dtype: tactic.dtype,
            len,
            rank: self.rank,
            offsets: self.offsets,
            islands: &self.islands,
            timeout_ns: self.config.timeout.as_nanos().min(u64::MAX as u128) as u64,
        };
        let params = pack_params(&shape, &self.peers, data, residual, ctl).map_err(|why| {
            if len * tactic.dtype.size() > self.offsets.capacity {
                AllReduceError::TooLarge {
                    bytes: len * tactic.dtype.size(),
                    capacity: self.offsets.capacity,
                }
            } else {
                AllReduceError::Setup(why)
            }
        })?;
        let cfg = LaunchConfig {
            grid_dim: (tactic.blocks, 1, 1),
            block_dim: (tactic.threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut builder = self.stream.launch_builder(&f);
        builder.arg(&params);
        // SAFETY: `params` matches the kernel's single by-value parameter; its pointers are
        // this communicator's live buffers and the caller's (see the contract above).
        unsafe { builder.launch(cfg) }
            .map(|_| ())
            .map_err(|e| dev_err(format_args!("launch {tactic}: {e}")))?;
        self.calls += 1;
        Ok(())
    }

    /// Sums `data` (elements of `dtype`) across ranks in place on the device, asynchronously;
    /// graph-capturable. Returns what the policy chose. Kernel errors (timeout, mismatch)
    /// surface at the next [`check`](Self::check).
    pub fn all_reduce_device<T: DeviceRepr>(
        &mut self,
        dtype: DType,
        data: &mut CudaSlice<T>,
        residual: Option<&CudaSlice<T>>,
    ) -> Result<Choice, AllReduceError> {
        if std::mem::size_of::<T>() != dtype.size() {
            return Err(AllReduceError::Setup(format!(
                "{} elements are {} bytes, the slice's {}",
                dtype.id(),
                dtype.size(),
                std::mem::size_of::<T>()
            )));
        }
        let len = data.len();
        if let Some(r) = residual
            && r.len() != len
        {
            return Err(AllReduceError::ResidualLength {
                residual: r.len(),
                data: len,
            });
        }
        let choice = self.choose(len * dtype.size());
        let Choice::Custom(algorithm) = choice else {
            return Err(dev_err(
                "the policy picks NCCL for this size: use the host API (all_reduce), which owns \
                 a staging buffer NCCL can run in place",
            ));
        };
        let tactic = self.tactic(algorithm, dtype, len * dtype.size());
        let stream = self.stream.clone();
        let (r, _rs) = match residual {
            Some(r) => {
                let (p, s) = r.device_ptr(&stream);
                (Some(p), Some(s))
            }
            None => (None, None),
        };
        let (d, _ds) = data.device_ptr_mut(&stream);
        // SAFETY: both are live slices of `len` elements of `dtype`-sized T.
        unsafe { self.launch_raw(tactic, len, d, r)? };
        Ok(choice)
    }

    /// Waits for the stream and reads the kernel's status word: `Ok` or the first error
    /// (which poisons the communicator).
    pub fn check(&mut self) -> Result<(), AllReduceError> {
        self.ensure_usable()?;
        let mut ctl = [0u8; CONTROL_BYTES];
        let r = self
            .stream
            .memcpy_dtoh(&self.ctl, &mut ctl[..])
            .and_then(|_| self.stream.synchronize())
            .map_err(|e| dev_err(format_args!("synchronize after all-reduce: {e}")));
        if let Err(e) = r {
            self.poisoned = Some(e.to_string());
            return Err(e);
        }
        let word = u64::from_le_bytes(
            ctl[CONTROL_STATUS..CONTROL_STATUS + 8]
                .try_into()
                .expect("8 bytes"),
        );
        let err = match KernelStatus::decode(word) {
            KernelStatus::Ok => return Ok(()),
            KernelStatus::Timeout {
                peer,
                phase,
                generation,
            } => match self.peer_exited(peer) {
                Some(pid) => AllReduceError::PeerDied {
                    rank: self.rank,
                    peer,
                    pid,
                    generation,
                },
                None => AllReduceError::Timeout {
                    rank: self.rank,
                    peer,
                    phase,
                    generation,
                    waited: self.config.timeout,
                },
            },
            KernelStatus::Mismatch {
                peer,
                phase,
                generation,
            } => AllReduceError::Mismatch {
                rank: self.rank,
                peer,
                generation,
                theirs: format!("another collective (phase {phase} flag tag differs)"),
                ours: "this call".into(),
            },
            KernelStatus::Unknown(w) => dev_err(format_args!("kernel status word {w:#x}")),
        };
        self.poisoned = Some(err.to_string());
        Err(err)
    }

    fn peer_exited(&self, peer: usize) -> Option<u32> {
        let pid = *self.pids.get(peer)?;
        if pid == 0 || pid == std::process::id() {
            return None;
        }
        // A zombie counts as gone: its memory and its half of the exchange are.
        (crate::process::process_state(pid) == crate::process::ProcessState::Gone).then_some(pid)
    }

    /// Host-slice path: stage, run `choice`, copy back, synchronize, check.
    fn run_host<T: super::Element>(
        &mut self,
        choice: Choice,
        data: &mut [T],
        residual: Option<&[T]>,
    ) -> Result<(), AllReduceError> {
        self.ensure_usable()?;
        let bytes = std::mem::size_of_val(data);
        if bytes > self.offsets.capacity {
            return Err(AllReduceError::TooLarge {
                bytes,
                capacity: self.offsets.capacity,
            });
        }
        if let Some(r) = residual
            && r.len() != data.len()
        {
            return Err(AllReduceError::ResidualLength {
                residual: r.len(),
                data: data.len(),
            });
        }
        let stream = self.stream.clone();
        let up = |dst: &mut CudaSlice<u8>, src: &[u8]| -> Result<(), AllReduceError> {
            let mut view = dst.slice_mut(0..src.len());
            stream.memcpy_htod(src, &mut view).map_err(dev_err)
        };
        up(&mut self.stage, bytemuck::cast_slice(data))?;
        match choice {
            Choice::Custom(algorithm) => {
                if algorithm.transfer() == Transfer::Push && self.offsets.inbox0 == 0 {
                    return Err(AllReduceError::PushDisabled(algorithm));
                }
                let residual_ptr = match residual {
                    Some(r) => {
                        up(&mut self.stage_residual, bytemuck::cast_slice(r))?;
                        Some(self.stage_residual.device_ptr(&stream).0)
                    }
                    None => None,
                };
                let d = self.stage.device_ptr_mut(&stream).0;
                let tactic = self.tactic(algorithm, T::DTYPE, bytes);
                // SAFETY: the staging buffers hold `capacity` bytes ≥ the message.
                unsafe { self.launch_raw(tactic, data.len(), d, residual_ptr)? };
            }
            Choice::Nccl => self.nccl_in_stage(T::DTYPE, data.len(), residual)?,
        }
        let n = bytes;
        let view = self.stage.slice(0..n);
        stream
            .memcpy_dtoh(&view, bytemuck::cast_slice_mut::<T, u8>(data))
            .map_err(dev_err)?;
        self.check()
    }

    #[cfg(feature = "nccl")]
    fn nccl_in_stage<T: super::Element>(
        &mut self,
        dtype: DType,
        len: usize,
        residual: Option<&[T]>,
    ) -> Result<(), AllReduceError> {
        let Some(nccl) = &self.nccl else {
            return Err(dev_err("the policy picked NCCL, but NCCL is not available"));
        };
        if residual.is_some() {
            // NCCL has no fused residual: adding it afterwards would round twice instead of
            // once, so refuse rather than silently differ from `reference_reduce`.
            return Err(dev_err(
                "NCCL cannot fuse the residual add; call without residual or use a custom algorithm",
            ));
        }
        // NCCL's reduction order is its own (ring/tree): results are a correct sum, but not
        // bit-identical to `reference_reduce` or across message sizes.
        nccl.all_reduce(dtype, &mut self.stage, len)
    }

    /// Sums `len` elements of `dtype` at device address `data` in place with NCCL, on the
    /// communicator's stream, inside a captured graph as outside: the path for the sizes the
    /// policy sends to NCCL. NCCL's reduction order is its own (ring or tree), so the result is
    /// a correct sum, not bit-identical to `reference_reduce`.
    ///
    /// # Safety
    /// `data` holds `len` elements of `dtype` on this communicator's device, not written by
    /// anything else until the call completes in stream order; every rank makes the same call.
    #[cfg(feature = "nccl")]
    pub unsafe fn nccl_raw(
        &mut self,
        dtype: DType,
        len: usize,
        data: u64,
    ) -> Result<(), AllReduceError> {
        self.ensure_usable()?;
        let Some(nccl) = &self.nccl else {
            return Err(dev_err(
                "the policy picked NCCL, but NCCL is not available (libnccl, or an NCCL id at \
                 the rendezvous)",
            ));
        };
        // SAFETY: forwarded from the caller.
        unsafe { nccl.all_reduce_raw(dtype, data, len) }?;
        self.calls += 1;
        Ok(())
    }

    /// Without feature `nccl`: the error saying so.
    ///
    /// # Safety
    /// None needed: nothing is launched.
    #[cfg(not(feature = "nccl"))]
    pub unsafe fn nccl_raw(
        &mut self,
        _dtype: DType,
        _len: usize,
        _data: u64,
    ) -> Result<(), AllReduceError> {
        Err(dev_err(
            "the policy picked NCCL, but this build has no NCCL (feature `nccl`)",
        ))
    }

    #[cfg(not(feature = "nccl"))]
    fn nccl_in_stage<T: super::Element>(
        &mut self,
        _dtype: DType,
        _len: usize,
        _residual: Option<&[T]>,
    ) -> Result<(), AllReduceError> {
        Err(dev_err(
            "the policy picked NCCL, but this build has no NCCL (feature `nccl`)",
        ))
    }

    /// Runs `algorithm` on host data regardless of the policy (tests, the GPU check).
    pub fn all_reduce_with<T: super::Element>(
        &mut self,
        algorithm: Algorithm,
        data: &mut [T],
        residual: Option<&[T]>,
    ) -> Result<(), AllReduceError> {
        self.run_host(Choice::Custom(algorithm), data, residual)
    }
}

impl AllReduce for CudaIpcCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world
    }
    fn all_reduce(&mut self, data: ReduceData<'_>) -> Result<Algorithm, AllReduceError> {
        let choice = self.choose(data.bytes());
        match data {
            ReduceData::Bf16 { data, residual } => self.run_host(choice, data, residual)?,
            ReduceData::F32 { data, residual } => self.run_host(choice, data, residual)?,
        }
        // The trait reports our algorithms; NCCL is reported as the flat algorithm whose
        // reduction order it does NOT promise (documented on `Choice::Nccl` results).
        Ok(match choice {
            Choice::Custom(a) => a,
            Choice::Nccl => Algorithm::OneShot(Transfer::Pull),
        })
    }
}

impl Drop for CudaIpcCommunicator {
    fn drop(&mut self) {
        // Peers may still read our region until they finish their last call: wait (bounded)
        // until every rank has closed its mappings before our region is freed.
        let _ = self.stream.synchronize();
        let _ = self.gpu.context().bind_to_thread();
        for ptr in self.opened.iter().flatten() {
            // SAFETY: opened by cuIpcOpenMemHandle_v2, closed once.
            let _ = unsafe { sys::cuIpcCloseMemHandle(*ptr) };
        }
        if let Some(seg) = &self.segment {
            seg.atomic(rdv::line(self.rank) + rdv::CLOSED)
                .store(1, Ordering::Release);
            let deadline = Instant::now() + self.config.timeout.min(Duration::from_secs(5));
            let _ = wait_all(seg, self.world, rdv::CLOSED, deadline, "closed");
        }
        self.region.take();
    }
}

fn bus_id(ctx: &Arc<CudaContext>) -> Result<[u8; 32], AllReduceError> {
    let mut buf = [0 as ::core::ffi::c_char; 32];
    // SAFETY: the buffer is 32 bytes; the driver writes a NUL-terminated id.
    check("cuDeviceGetPCIBusId", unsafe {
        sys::cuDeviceGetPCIBusId(buf.as_mut_ptr(), 32, ctx.cu_device())
    })?;
    Ok(buf.map(|c| c as u8))
}

fn bus_str(bus: &[u8; 32]) -> String {
    let end = bus.iter().position(|&b| b == 0).unwrap_or(32);
    String::from_utf8_lossy(&bus[..end]).into_owned()
}

/// Whether this process's device can access the device with PCI bus id `bus`. A device this
/// process cannot see (CUDA_VISIBLE_DEVICES) is assumed reachable: the IPC open will say.
fn can_access_peer(ctx: &Arc<CudaContext>, bus: &[u8; 32]) -> Result<bool, AllReduceError> {
    let mut dev: sys::CUdevice = 0;
    // SAFETY: `bus` is NUL terminated (written by cuDeviceGetPCIBusId).
    let r = unsafe { sys::cuDeviceGetByPCIBusId(&mut dev, bus.as_ptr().cast()) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Ok(true);
    }
    let mut can = 0;
    // SAFETY: out-parameter call.
    check("cuDeviceCanAccessPeer", unsafe {
        sys::cuDeviceCanAccessPeer(&mut can, ctx.cu_device(), dev)
    })?;
    Ok(can != 0)
}

/// A fresh NCCL unique id (rank 0 of an [`CudaIpcCommunicator::nccl_only`] group).
#[cfg(feature = "nccl")]
pub fn nccl_unique_id() -> Result<[u8; 128], AllReduceError> {
    if !nccl::available() {
        return Err(dev_err("libnccl could not be opened"));
    }
    nccl::new_id()
}

/// The error a communicator reports when there is no driver (for tests and tools that want
/// to tell "no GPU" from a real failure).
pub fn is_no_device(e: &AllReduceError) -> bool {
    matches!(e, AllReduceError::Device(msg) if msg.starts_with("no CUDA"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_driver_construction_is_an_error_not_a_panic() {
        let name = super::super::shm::unique_segment_name("cuda-unit");
        let config = CudaIpcConfig {
            timeout: Duration::from_millis(200),
            ..CudaIpcConfig::default()
        };
        match CudaIpcCommunicator::new(&name, 0, 1, config.clone()) {
            Err(e) if !crate::cuda::driver_present() => {
                assert!(is_no_device(&e), "{e}");
                assert!(e.to_string().contains("libcuda"), "{e}");
            }
            // With a driver: succeeds (world 1) or fails for a device reason; never panics.
            _ => {}
        }
        match CudaIpcCommunicator::in_process_group(2, config) {
            Err(e) if !crate::cuda::driver_present() => assert!(is_no_device(&e), "{e}"),
            _ => {}
        }
        assert!(super::super::shm::live_segments(&name).is_empty());
    }

    #[test]
    fn bad_world_is_rejected_before_touching_the_driver() {
        let e = CudaIpcCommunicator::new("x", 3, 2, CudaIpcConfig::default())
            .err()
            .unwrap();
        assert!(matches!(e, AllReduceError::Setup(_)), "{e}");
        let e = CudaIpcCommunicator::in_process_group(MAX_RANKS + 1, CudaIpcConfig::default())
            .err()
            .unwrap();
        assert!(matches!(e, AllReduceError::Setup(_)), "{e}");
    }
}
