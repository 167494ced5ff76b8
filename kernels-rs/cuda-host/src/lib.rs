//! The host execution layer: the kernels' CUDA C++ sources, unmodified, compiled for the CPU
//! and launched from Rust the way the CUDA driver launches them.
//!
//! - `build.rs` compiles every tactic of every kernel family (`moe_gemm.cu`, `mla_decode.cu`,
//!   `allreduce.cu`) with g++, one [`Module`] per (family, tactic), against the CUDA surface
//!   of `runtime/include` (`cuda_host.h`, stand-ins for `cuda_bf16.h` and `cuda_fp8.h`).
//! - `runtime/runtime.cpp` runs a launch: blocks on worker threads, the threads of a block as
//!   fibers that switch at barriers and warp collectives, `__shared__` memory per block.
//! - The kernels' inline PTX (`kernels-rs/include/ptx_helpers.cuh`) has a host branch per
//!   instruction, implemented in `runtime/ptx_host.cpp` from the PTX ISA: cp.async groups,
//!   ldmatrix, the BF16, E4M3 and block-scaled FP4 `mma.sync`, acquire/release flags,
//!   `%globaltimer`.
//! - [`launch`] takes CUDA's kernel-parameter convention ([`KernelParams`]: a pointer per
//!   argument, the same `#[repr(C)]` structs the cudarc path pushes) and checks every
//!   argument's size against the kernel's parameter types.
//! - [`HostDevice`] implements `kernels::device::Device`, so the MoE and MLA launchers that
//!   drive a GPU drive the host layer unchanged.
//! - [`DeviceBuffer`] is "device memory": host memory with guard pages on both sides, so an
//!   out-of-bounds access faults, and the fault becomes an error naming the kernel, block and
//!   thread instead of a crash.
//!
//! What this checks: the CUDA source's indexing, synchronization, fragment layouts and
//! numerics. What it cannot: timing, the hardware memory model beyond C++ acquire/release,
//! occupancy, and the compiled SASS (the compile gates check that).

mod buffer;
mod device;
pub mod ffi;
pub mod probes;

use std::ffi::CStr;
use std::fmt;
use std::time::Duration;

pub use buffer::DeviceBuffer;
pub use device::{HostDevice, HostGraph, HostKernel, LaunchRecord};
pub use kernels::device::{KernelParams, LaunchConfig};

include!(concat!(env!("OUT_DIR"), "/modules.rs"));

#[derive(Debug, thiserror::Error)]
pub enum HostError {
    #[error("no host module for {family} tactic {tactic} (compiled: {available})")]
    NoModule {
        family: String,
        tactic: String,
        available: String,
    },
    #[error("module {family}/{tactic} has no kernel {name} (it has: {available})")]
    NoKernel {
        family: String,
        tactic: String,
        name: String,
        available: String,
    },
    #[error("launch of {kernel}: {why}")]
    Arguments { kernel: String, why: String },
    #[error("{0}")]
    Launch(String),
    #[error("device memory: {0}")]
    Memory(String),
}

pub type Result<T> = std::result::Result<T, HostError>;

fn text(p: *const std::ffi::c_char) -> &'static str {
    if p.is_null() {
        return "";
    }
    // SAFETY: the generated modules hold NUL-terminated string literals with static lifetime.
    unsafe { CStr::from_ptr(p) }.to_str().unwrap_or("")
}

/// One kernel source compiled for one tactic.
#[derive(Clone, Copy)]
pub struct Module {
    raw: &'static ffi::RawModule,
}

impl Module {
    /// Every compiled module.
    pub fn all() -> impl Iterator<Item = Module> {
        MODULE_TABLE.iter().map(|f| {
            // SAFETY: each generated function returns a pointer to a static module.
            let raw = unsafe { &*f() };
            Module { raw }
        })
    }

    /// The modules of one family, in tactic-id order.
    pub fn family(family: &str) -> Vec<Module> {
        Self::all().filter(|m| m.family_name() == family).collect()
    }

    pub fn find(family: &str, tactic: &str) -> Result<Module> {
        Self::all()
            .find(|m| m.family_name() == family && m.tactic() == tactic)
            .ok_or_else(|| HostError::NoModule {
                family: family.into(),
                tactic: tactic.into(),
                available: Self::family(family)
                    .iter()
                    .map(|m| m.tactic())
                    .collect::<Vec<_>>()
                    .join(", "),
            })
    }

    pub fn family_name(&self) -> &'static str {
        text(self.raw.family)
    }

    pub fn tactic(&self) -> &'static str {
        text(self.raw.tactic)
    }

    /// The `-D` flags the source was compiled with (the tactic's `nvcc_defines`).
    pub fn defines(&self) -> &'static str {
        text(self.raw.defines)
    }

    fn kernels(&self) -> &'static [ffi::RawKernel] {
        // SAFETY: `kernels` points to `num_kernels` static entries.
        unsafe { std::slice::from_raw_parts(self.raw.kernels, self.raw.num_kernels as usize) }
    }

    pub fn function(&self, name: &str) -> Result<Function> {
        self.kernels()
            .iter()
            .find(|k| text(k.name) == name)
            .map(|raw| Function { raw, module: *self })
            .ok_or_else(|| HostError::NoKernel {
                family: self.family_name().into(),
                tactic: self.tactic().into(),
                name: name.into(),
                available: self
                    .kernels()
                    .iter()
                    .map(|k| text(k.name))
                    .collect::<Vec<_>>()
                    .join(", "),
            })
    }
}

impl fmt::Debug for Module {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Module({}/{})", self.family_name(), self.tactic())
    }
}

/// One kernel of a module.
#[derive(Clone, Copy)]
pub struct Function {
    raw: &'static ffi::RawKernel,
    module: Module,
}

impl Function {
    pub fn name(&self) -> &'static str {
        text(self.raw.name)
    }

    pub fn module(&self) -> Module {
        self.module
    }

    /// `sizeof` each parameter's type, as the C++ compiler sees the kernel's signature.
    pub fn param_sizes(&self) -> &'static [u32] {
        // SAFETY: `param_sizes` holds `num_params` entries.
        unsafe { std::slice::from_raw_parts(self.raw.param_sizes, self.raw.num_params as usize) }
    }

    fn label(&self) -> String {
        format!(
            "{} ({}/{})",
            self.name(),
            self.module.family_name(),
            self.module.tactic()
        )
    }
}

impl fmt::Debug for Function {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.label())
    }
}

/// In which order the fibers of a block, and the blocks of a grid, run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Schedule {
    /// Index order everywhere.
    Forward,
    /// Reverse index order everywhere.
    Reverse,
    /// A seeded permutation at the start and at every barrier and collective.
    Shuffled(u64),
}

#[derive(Clone, Debug)]
pub struct LaunchOptions {
    /// Worker threads; `None`: one per available CPU.
    pub workers: Option<u32>,
    /// Every block on its own thread, all at once (kernels whose blocks wait for each other).
    pub co_resident: bool,
    pub schedule: Schedule,
    /// Fill dynamic shared memory (and every cp.async destination until its wait) with 0xFF.
    pub poison_shared: bool,
    pub timeout: Option<Duration>,
    /// The emulated device's dynamic shared memory limit per block.
    pub max_dynamic_shared: u32,
}

/// Whether the kernel modules were built with the GPU's numerics (feature `gpu-numerics`:
/// FMA contraction, `expf` 1-2 ulp off): tests whose bounds hold only for the exact build
/// choose the GPU's bound with it.
pub const GPU_NUMERICS: bool = cfg!(feature = "gpu-numerics");

/// `CUDA_HOST_SCHEDULE`: `forward` (default), `reverse` or `shuffled:SEED`, the order every
/// launch with default options runs its blocks and threads in (scripts/race-mutations.py runs
/// the host tests under each).
fn default_schedule() -> Schedule {
    match std::env::var("CUDA_HOST_SCHEDULE").as_deref() {
        Ok("reverse") => Schedule::Reverse,
        Ok(s) if s.starts_with("shuffled:") => {
            Schedule::Shuffled(s["shuffled:".len()..].parse().unwrap_or(1))
        }
        _ => Schedule::Forward,
    }
}

impl Default for LaunchOptions {
    fn default() -> Self {
        Self {
            workers: None,
            co_resident: false,
            schedule: default_schedule(),
            poison_shared: true,
            timeout: Some(Duration::from_secs(600)),
            max_dynamic_shared: max_dynamic_shared(),
        }
    }
}

/// What a launch did, counted by the runtime.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LaunchStats {
    pub blocks: u64,
    pub threads: u64,
    pub context_switches: u64,
    pub barriers: u64,
    pub warp_collectives: u64,
    pub mma: u64,
    pub cp_async_bytes: u64,
}

/// The largest dynamic shared memory a launch can have (SM90's opt-in limit).
pub fn max_dynamic_shared() -> u32 {
    // SAFETY: a pure function of the runtime.
    unsafe { ffi::cuhost_max_dynamic_shared() }
}

/// Runs `function` over `cfg.grid_dim` × `cfg.block_dim` on the CPU and waits for it.
///
/// # Safety
/// Every pointer inside the arguments must be valid for what the kernel does with it: in
/// practice, addresses of live [`DeviceBuffer`]s large enough for the launch.
pub unsafe fn launch(
    function: &Function,
    cfg: LaunchConfig,
    args: &KernelParams<'_>,
    options: &LaunchOptions,
) -> Result<LaunchStats> {
    let expected = function.param_sizes();
    if expected.len() != args.len()
        || expected
            .iter()
            .zip(args.sizes())
            .any(|(&e, &g)| e as usize != g)
    {
        return Err(HostError::Arguments {
            kernel: function.label(),
            why: format!(
                "the kernel's parameters have sizes {expected:?}, the arguments {:?}",
                args.sizes()
            ),
        });
    }
    let (schedule, seed) = match options.schedule {
        Schedule::Forward => (ffi::SCHEDULE_FORWARD, 0),
        Schedule::Reverse => (ffi::SCHEDULE_REVERSE, 0),
        Schedule::Shuffled(seed) => (ffi::SCHEDULE_SHUFFLED, seed),
    };
    let opt = ffi::RawLaunchOptions {
        workers: options.workers.unwrap_or(0),
        co_resident: u32::from(options.co_resident),
        schedule,
        poison_shared: u32::from(options.poison_shared),
        seed,
        timeout_ms: options.timeout.map_or(0, |d| d.as_millis().max(1) as u64),
        max_dynamic_shared: options.max_dynamic_shared,
        reserved: 0,
    };
    let dim = |(x, y, z): (u32, u32, u32)| ffi::Dim3 { x, y, z };
    let mut stats = ffi::RawLaunchStats::default();
    let mut err = vec![0u8; 2048];
    let mut ptrs = args.raw();
    // SAFETY: the kernel entry is static; the argument pointers outlive the call (borrowed by
    // `args`), their sizes match the parameter types (checked above), and the caller
    // guarantees the addresses inside them.
    let rc = unsafe {
        ffi::cuhost_launch(
            function.raw,
            dim(cfg.grid_dim),
            dim(cfg.block_dim),
            cfg.shared_mem_bytes,
            ptrs.as_mut_ptr(),
            &opt,
            &mut stats,
            err.as_mut_ptr().cast(),
            err.len(),
        )
    };
    if rc != 0 {
        let end = err.iter().position(|&b| b == 0).unwrap_or(err.len());
        return Err(HostError::Launch(format!(
            "{} (grid {:?}, block {:?}, {} B shared): {}",
            function.label(),
            cfg.grid_dim,
            cfg.block_dim,
            cfg.shared_mem_bytes,
            String::from_utf8_lossy(&err[..end])
        )));
    }
    Ok(LaunchStats {
        blocks: stats.blocks,
        threads: stats.threads,
        context_switches: stats.context_switches,
        barriers: stats.barriers,
        warp_collectives: stats.warp_collectives,
        mma: stats.mma,
        cp_async_bytes: stats.cp_async_bytes,
    })
}
