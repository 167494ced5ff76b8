//! The devices the stand-in presents: their kind and count from the environment, their
//! attributes, and the `cuDevice*` exports.
//!
//! - `CUDA_STUB_DEVICE`: `rtx-pro-6000` (default; SM120), `h100` or `h200` (SM90).
//! - `CUDA_STUB_DEVICE_COUNT`: how many (default 1).
//! - `CUDA_STUB_P2P=0`: the devices cannot reach each other's memory (PCIe hosts without P2P).
//! - `CUDA_STUB_COMPUTE_MODE`: `default`, `exclusive-process` (one process may hold a context
//!   on a device; another gets `CUDA_ERROR_DEVICE_UNAVAILABLE`) or `prohibited`.
//! - `CUDA_STUB_MEMORY_MIB`: the memory each device reports and holds (default: the kind's).
//!   Device memory is host memory here, so a run that fills a share of the GPU
//!   (`serve --gpu-memory-utilization`) needs a device no larger than the host can back.

use std::ffi::{CStr, c_char, c_int};
use std::sync::OnceLock;

use cudarc::driver::sys::CUdevice_attribute as A;
use cudarc::driver::sys::CUresult as E;

use crate::error::{CUresult, R, api, put, refuse};

/// One kind of GPU, with the figures its driver reports.
#[derive(Debug)]
pub struct Kind {
    pub id: &'static str,
    pub name: &'static str,
    pub major: i32,
    pub minor: i32,
    pub multiprocessors: i32,
    /// Bytes, as `cuDeviceTotalMem` reports them.
    pub total_mem: u64,
    pub l2_bytes: i32,
    /// Shared memory a block may opt into (`MAX_SHARED_MEMORY_PER_BLOCK_OPTIN`).
    pub smem_optin: i32,
    pub smem_per_sm: i32,
    pub threads_per_sm: i32,
    pub blocks_per_sm: i32,
    pub clock_khz: i32,
    pub memory_clock_khz: i32,
    pub bus_width: i32,
}

impl Kind {
    /// The SM string images are built for (`sm_120a`, `sm_90a`).
    pub fn arch(&self) -> String {
        format!("sm_{}{}a", self.major, self.minor)
    }
}

/// Blackwell workstation GPU (SM120): the project's target.
pub const RTX_PRO_6000: Kind = Kind {
    id: "rtx-pro-6000",
    name: "NVIDIA RTX PRO 6000 Blackwell Workstation Edition (cuda-stub)",
    major: 12,
    minor: 0,
    multiprocessors: 188,
    total_mem: 97_887 << 20,
    l2_bytes: 128 << 20,
    smem_optin: 101_376,
    smem_per_sm: 102_400,
    threads_per_sm: 1536,
    blocks_per_sm: 24,
    clock_khz: 2_617_000,
    memory_clock_khz: 14_001_000,
    bus_width: 512,
};

/// Hopper (SM90), as lent by the device tool.
pub const H100: Kind = Kind {
    id: "h100",
    name: "NVIDIA H100 80GB HBM3 (cuda-stub)",
    major: 9,
    minor: 0,
    multiprocessors: 132,
    total_mem: 81_559 << 20,
    l2_bytes: 50 << 20,
    smem_optin: 232_448,
    smem_per_sm: 233_472,
    threads_per_sm: 2048,
    blocks_per_sm: 32,
    clock_khz: 1_980_000,
    memory_clock_khz: 2_619_000,
    bus_width: 5120,
};

/// Hopper with 141 GB of HBM3e.
pub const H200: Kind = Kind {
    id: "h200",
    name: "NVIDIA H200 (cuda-stub)",
    total_mem: 143_771 << 20,
    memory_clock_khz: 3_201_000,
    bus_width: 6144,
    ..H100
};

pub const KINDS: [&Kind; 3] = [&RTX_PRO_6000, &H100, &H200];

/// Compute modes (`CUcomputemode`).
pub const COMPUTE_MODE_DEFAULT: i32 = 0;
pub const COMPUTE_MODE_PROHIBITED: i32 = 2;
pub const COMPUTE_MODE_EXCLUSIVE_PROCESS: i32 = 3;

/// What the environment configured, read once.
#[derive(Debug)]
pub struct Config {
    pub kind: &'static Kind,
    pub count: usize,
    pub p2p: bool,
    pub compute_mode: i32,
    /// Bytes each device reports (`cuDeviceTotalMem`, `cuMemGetInfo`) and lets be allocated.
    pub total_mem: u64,
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// The configuration, or why the environment is wrong (a clear line on stderr; `cuInit` then
/// fails with `CUDA_ERROR_NO_DEVICE`).
pub fn config() -> Result<&'static Config, &'static str> {
    static CONFIG: OnceLock<Result<Config, String>> = OnceLock::new();
    let parsed = CONFIG.get_or_init(|| {
        let kind = match env("CUDA_STUB_DEVICE") {
            None => &RTX_PRO_6000,
            Some(id) => *KINDS.iter().find(|k| k.id == id).ok_or_else(|| {
                format!(
                    "CUDA_STUB_DEVICE={id}: not a device kind of the stand-in ({})",
                    KINDS.map(|k| k.id).join(", ")
                )
            })?,
        };
        let count = match env("CUDA_STUB_DEVICE_COUNT") {
            None => 1,
            Some(n) => n
                .parse::<usize>()
                .ok()
                .filter(|&n| (1..=64).contains(&n))
                .ok_or_else(|| format!("CUDA_STUB_DEVICE_COUNT={n}: not a count in 1..=64"))?,
        };
        let compute_mode = match env("CUDA_STUB_COMPUTE_MODE").as_deref() {
            None | Some("default") => COMPUTE_MODE_DEFAULT,
            Some("exclusive-process") => COMPUTE_MODE_EXCLUSIVE_PROCESS,
            Some("prohibited") => COMPUTE_MODE_PROHIBITED,
            Some(m) => {
                return Err(format!(
                    "CUDA_STUB_COMPUTE_MODE={m}: one of default, exclusive-process, prohibited"
                ));
            }
        };
        let total_mem = match env("CUDA_STUB_MEMORY_MIB") {
            None => kind.total_mem,
            Some(m) => m
                .parse::<u64>()
                .ok()
                .filter(|&m| (1..=kind.total_mem >> 20).contains(&m))
                .map(|m| m << 20)
                .ok_or_else(|| {
                    format!(
                        "CUDA_STUB_MEMORY_MIB={m}: not a size in 1..={} MiB (the {}'s memory)",
                        kind.total_mem >> 20,
                        kind.id
                    )
                })?,
        };
        Ok(Config {
            kind,
            count,
            total_mem,
            p2p: env("CUDA_STUB_P2P").is_none_or(|v| v != "0"),
            compute_mode,
        })
    });
    match parsed {
        Ok(c) => Ok(c),
        Err(e) => Err(e.as_str()),
    }
}

/// The device's PCI bus id, `0000:BB:00.0`, one bus per device.
pub fn bus_id(ordinal: usize) -> String {
    format!("0000:{:02x}:00.0", 0x18 + ordinal)
}

/// The attribute's value for device `ordinal`, or `None` for a number that is no attribute.
pub fn attribute(kind: &Kind, ordinal: usize, attr: u32) -> Option<i32> {
    let c = config().ok()?;
    let is = |a: A| a as u32 == attr;
    let v = if is(A::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK)
        || is(A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X)
        || is(A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y)
    {
        1024
    } else if is(A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z) {
        64
    } else if is(A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X) {
        i32::MAX
    } else if is(A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y) || is(A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z)
    {
        65535
    } else if is(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK) {
        48 << 10
    } else if is(A::CU_DEVICE_ATTRIBUTE_TOTAL_CONSTANT_MEMORY) {
        64 << 10
    } else if is(A::CU_DEVICE_ATTRIBUTE_WARP_SIZE) {
        32
    } else if is(A::CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK)
        || is(A::CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR)
    {
        65536
    } else if is(A::CU_DEVICE_ATTRIBUTE_CLOCK_RATE) {
        kind.clock_khz
    } else if is(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT) {
        kind.multiprocessors
    } else if is(A::CU_DEVICE_ATTRIBUTE_COMPUTE_MODE) {
        c.compute_mode
    } else if is(A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID) {
        0x18 + ordinal as i32
    } else if is(A::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE) {
        kind.memory_clock_khz
    } else if is(A::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH) {
        kind.bus_width
    } else if is(A::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE) {
        kind.l2_bytes
    } else if is(A::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR) {
        kind.threads_per_sm
    } else if is(A::CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT) {
        2
    } else if is(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR) {
        kind.major
    } else if is(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR) {
        kind.minor
    } else if is(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR) {
        kind.smem_per_sm
    } else if is(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN) {
        kind.smem_optin
    } else if is(A::CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR) {
        kind.blocks_per_sm
    } else if is(A::CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK) {
        1024
    } else if is(A::CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT) {
        512
    } else if is(A::CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING)
        || is(A::CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS)
        || is(A::CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY)
        || is(A::CU_DEVICE_ATTRIBUTE_STREAM_PRIORITIES_SUPPORTED)
        || is(A::CU_DEVICE_ATTRIBUTE_GLOBAL_L1_CACHE_SUPPORTED)
        || is(A::CU_DEVICE_ATTRIBUTE_LOCAL_L1_CACHE_SUPPORTED)
        || is(A::CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY)
        || is(A::CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH)
        || is(A::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED)
        || is(A::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED)
        || is(A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)
        || is(A::CU_DEVICE_ATTRIBUTE_COMPUTE_PREEMPTION_SUPPORTED)
        || is(A::CU_DEVICE_ATTRIBUTE_ECC_ENABLED)
    {
        1
    } else if attr < A::CU_DEVICE_ATTRIBUTE_MAX as u32 {
        // A real attribute the stand-in has no figure for (textures, surfaces, MPS, ...):
        // nothing here depends on them, and 0 is "not supported" for the flags among them.
        0
    } else {
        return None;
    };
    Some(v)
}

/// `ordinal` as a device of the configuration, after `cuInit`.
pub fn device(dev: c_int) -> R<usize> {
    crate::initialized()?;
    let count = config().map_err(|_| E::CUDA_ERROR_NO_DEVICE)?.count;
    if dev < 0 || dev as usize >= count {
        return refuse(E::CUDA_ERROR_INVALID_DEVICE, || {
            format!("device {dev}: the stand-in has {count} (CUDA_STUB_DEVICE_COUNT)")
        });
    }
    Ok(dev as usize)
}

pub fn kind() -> &'static Kind {
    config().map_or(&RTX_PRO_6000, |c| c.kind)
}

/// Bytes of memory each device has (`CUDA_STUB_MEMORY_MIB`, else the kind's).
pub fn total_mem() -> u64 {
    config().map_or(RTX_PRO_6000.total_mem, |c| c.total_mem)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGet(out: *mut c_int, ordinal: c_int) -> CUresult {
    api("cuDeviceGet", || {
        let d = device(ordinal)?;
        // SAFETY: the caller's out-pointer.
        unsafe { put(out, d as c_int) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetCount(out: *mut c_int) -> CUresult {
    api("cuDeviceGetCount", || {
        crate::initialized()?;
        let n = config().map_or(0, |c| c.count);
        // SAFETY: the caller's out-pointer.
        unsafe { put(out, n as c_int) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: c_int) -> CUresult {
    api("cuDeviceGetName", || {
        device(dev)?;
        if name.is_null() || len <= 0 {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        let text = kind().name.as_bytes();
        let n = text.len().min(len as usize - 1);
        // SAFETY: the caller's buffer holds `len` bytes; n + 1 <= len.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr(), name.cast::<u8>(), n);
            *name.add(n) = 0;
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetAttribute(out: *mut c_int, attr: u32, dev: c_int) -> CUresult {
    api("cuDeviceGetAttribute", || {
        let d = device(dev)?;
        let v = attribute(kind(), d, attr).ok_or(E::CUDA_ERROR_INVALID_VALUE)?;
        // SAFETY: the caller's out-pointer.
        unsafe { put(out, v) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(out: *mut usize, dev: c_int) -> CUresult {
    api("cuDeviceTotalMem_v2", || {
        device(dev)?;
        // SAFETY: the caller's out-pointer.
        unsafe { put(out, total_mem() as usize) }
    })
}

/// A UUID per (kind, ordinal), stable across runs.
fn uuid(dev: usize) -> [u8; 16] {
    let mut u = [0u8; 16];
    let seed = kind().id.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    u[..8].copy_from_slice(&seed.to_le_bytes());
    u[8..].copy_from_slice(&(dev as u64).to_le_bytes());
    u
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetUuid_v2(out: *mut [u8; 16], dev: c_int) -> CUresult {
    api("cuDeviceGetUuid_v2", || {
        let d = device(dev)?;
        // SAFETY: the caller's out-pointer (a CUuuid is 16 bytes).
        unsafe { put(out, uuid(d)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetUuid(out: *mut [u8; 16], dev: c_int) -> CUresult {
    // SAFETY: same contract.
    unsafe { cuDeviceGetUuid_v2(out, dev) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetPCIBusId(out: *mut c_char, len: c_int, dev: c_int) -> CUresult {
    api("cuDeviceGetPCIBusId", || {
        let d = device(dev)?;
        let id = bus_id(d);
        if out.is_null() || len <= id.len() as c_int {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: the caller's buffer holds `len` > id.len() bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(id.as_ptr(), out.cast::<u8>(), id.len());
            *out.add(id.len()) = 0;
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetByPCIBusId(out: *mut c_int, bus: *const c_char) -> CUresult {
    api("cuDeviceGetByPCIBusId", || {
        crate::initialized()?;
        if bus.is_null() {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: a NUL-terminated string, the API's contract.
        let text = unsafe { CStr::from_ptr(bus) }
            .to_string_lossy()
            .to_lowercase();
        let count = config().map_or(0, |c| c.count);
        // The driver takes `[domain]:bus:device.function`.
        let found = (0..count).find(|&d| {
            let id = bus_id(d);
            id == text || id.strip_prefix("0000:") == Some(text.as_str())
        });
        match found {
            // SAFETY: the caller's out-pointer.
            Some(d) => unsafe { put(out, d as c_int) },
            None => Err(E::CUDA_ERROR_INVALID_DEVICE),
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceCanAccessPeer(
    out: *mut c_int,
    dev: c_int,
    peer: c_int,
) -> CUresult {
    api("cuDeviceCanAccessPeer", || {
        let (d, p) = (device(dev)?, device(peer)?);
        let can = d != p && config().is_ok_and(|c| c.p2p);
        // SAFETY: the caller's out-pointer.
        unsafe { put(out, c_int::from(can)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDriverGetVersion(out: *mut c_int) -> CUresult {
    // CUDA 13.0, the oldest 13.x driver the project supports (cudarc's `cuda-13000`).
    // SAFETY: the caller's out-pointer.
    api("cuDriverGetVersion", || unsafe { put(out, 13000) })
}
