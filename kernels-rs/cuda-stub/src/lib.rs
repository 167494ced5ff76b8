//! A stand-in CUDA driver: `libcuda_stub.so`, loaded as `libcuda.so.1` (see
//! `scripts/stub-driver.sh`), exporting the driver API that cudarc and this project call, so the
//! driver-facing code — `kernels::cuda::GpuContext`, streams, graph capture, IPC, events,
//! module loading — runs in CI on machines without a GPU.
//!
//! It is a model of the driver's rules, not a mock of its answers:
//! - devices with the attributes of an RTX PRO 6000 (SM120) or an H100/H200 (SM90)
//!   ([`device`]), primary and created contexts current per thread, and every call that needs
//!   a context refusing without one (`CUDA_ERROR_INVALID_CONTEXT`) ([`context`]);
//! - device memory in host memory between guard pages, copies and memsets with the driver's
//!   host synchronization per kind of copy ([`memory`]), IPC handles across processes through
//!   `memfd` shared memory ([`ipc`]);
//! - one worker thread per stream running its work in order, the legacy stream ordered with
//!   the blocking streams and not with non-blocking ones, events with timestamps ([`stream`],
//!   [`event`]);
//! - stream capture with the driver's refusals (the legacy stream, synchronous calls during a
//!   global capture, allocations) and graphs instantiated, launched and updated ([`capture`]);
//! - kernel images that name a (family, tactic) of the host execution layer (`cuda-host`),
//!   whose builds of the same `.cu` sources run the launches; function attributes with the
//!   48 KB dynamic shared memory opt-in enforced ([`module`]);
//! - the driver's result codes, names and descriptions ([`error`]);
//! - beyond the driver: a copy or memset that nothing orders against another stream's access
//!   to the same memory stops the process with a report ([`hazard`]), and `CUDA_STUB_STATS=1`
//!   prints how long device work ran on the CPU ([`work::stats`]).
//!
//! A kernel that faults (a guard page, a barrier some threads cannot reach, the time limit)
//! makes its context's error sticky, as on a GPU: every later call in that context returns it.
//! The stand-in prints the host layer's description of the fault, and names the rule behind
//! each refusal, on stderr (`CUDA_STUB_QUIET=1` silences the latter).

// The exports are the C API's names and contracts (documented by NVIDIA, not here).
#![allow(non_snake_case, clippy::missing_safety_doc)]

pub mod capture;
pub mod context;
pub mod device;
pub mod error;
pub mod event;
pub mod graph;
pub mod handles;
pub mod hazard;
pub mod ipc;
pub mod memory;
pub mod module;
pub mod stream;
pub mod work;

use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::driver::sys::CUresult as E;

use error::{CUresult, R, api, note};

static INITIALIZED: AtomicBool = AtomicBool::new(false);

/// `CUDA_ERROR_NOT_INITIALIZED` until `cuInit` succeeded.
pub fn initialized() -> R {
    if INITIALIZED.load(Ordering::Acquire) {
        Ok(())
    } else {
        Err(E::CUDA_ERROR_NOT_INITIALIZED)
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuInit(flags: u32) -> CUresult {
    api("cuInit", || {
        if flags != 0 {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        if let Err(why) = device::config() {
            note(|| format!("cuInit: {why}"));
            return Err(E::CUDA_ERROR_NO_DEVICE);
        }
        memory::raise_fd_limit();
        work::stats::start();
        INITIALIZED.store(true, Ordering::Release);
        Ok(())
    })
}
