//! The C ABI of `runtime/include/cuda_host_runtime.h`.

use std::ffi::{c_char, c_void};

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Dim3 {
    pub x: u32,
    pub y: u32,
    pub z: u32,
}

#[repr(C)]
pub struct RawKernel {
    pub name: *const c_char,
    pub invoke: unsafe extern "C" fn(*mut *mut c_void),
    pub num_params: u32,
    pub param_sizes: *const u32,
}

#[repr(C)]
pub struct RawModule {
    pub family: *const c_char,
    pub tactic: *const c_char,
    pub defines: *const c_char,
    pub kernels: *const RawKernel,
    pub num_kernels: u32,
}

// SAFETY: modules and kernels are immutable statics of the C++ side.
unsafe impl Sync for RawModule {}
// SAFETY: as above.
unsafe impl Sync for RawKernel {}

pub const SCHEDULE_FORWARD: u32 = 0;
pub const SCHEDULE_REVERSE: u32 = 1;
pub const SCHEDULE_SHUFFLED: u32 = 2;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct RawLaunchOptions {
    pub workers: u32,
    pub co_resident: u32,
    pub schedule: u32,
    pub poison_shared: u32,
    pub seed: u64,
    pub timeout_ms: u64,
    pub max_dynamic_shared: u32,
    pub reserved: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct RawLaunchStats {
    pub blocks: u64,
    pub threads: u64,
    pub context_switches: u64,
    pub barriers: u64,
    pub warp_collectives: u64,
    pub mma: u64,
    pub cp_async_bytes: u64,
}

unsafe extern "C" {
    #[allow(clippy::too_many_arguments)]
    pub fn cuhost_launch(
        kernel: *const RawKernel,
        grid: Dim3,
        block: Dim3,
        dynamic_shared_bytes: u32,
        params: *mut *mut c_void,
        options: *const RawLaunchOptions,
        stats: *mut RawLaunchStats,
        err: *mut c_char,
        err_len: usize,
    ) -> i32;
    pub fn cuhost_max_dynamic_shared() -> u32;
}
