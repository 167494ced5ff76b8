//! The driver's result codes, their names and descriptions (`cuGetErrorName`,
//! `cuGetErrorString`), the guard every export runs under, and the stand-in's own notes.

use std::collections::HashMap;
use std::ffi::{CString, c_char};
use std::sync::{Mutex, OnceLock};

pub use cudarc::driver::sys::CUresult;
use cudarc::driver::sys::CUresult as E;

/// What every internal function returns: the driver's code on failure.
pub type R<T = ()> = Result<T, CUresult>;

/// Runs an export's body: its result code, and a panic (a bug of the stand-in) reported on
/// stderr and turned into `CUDA_ERROR_UNKNOWN` instead of unwinding into the caller.
pub fn api(name: &str, f: impl FnOnce() -> R) -> CUresult {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(())) => E::CUDA_SUCCESS,
        Ok(Err(e)) => e,
        Err(payload) => {
            let what = payload
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            eprintln!("cuda-stub: {name} panicked (a bug of the stand-in driver): {what}");
            E::CUDA_ERROR_UNKNOWN
        }
    }
}

/// Writes `value` through an out-parameter, refusing a null pointer as the driver does.
///
/// # Safety
/// `out` is null or valid for a write of `T`.
pub unsafe fn put<T>(out: *mut T, value: T) -> R {
    if out.is_null() {
        return Err(E::CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-null, and the caller's contract.
    unsafe { out.write(value) };
    Ok(())
}

/// Whether the stand-in explains its refusals on stderr (`CUDA_STUB_QUIET=1` silences it). A
/// real driver says nothing; the stand-in names the rule, so that a refused call in a test log
/// says which rule and where.
pub fn note(what: impl FnOnce() -> String) {
    static QUIET: OnceLock<bool> = OnceLock::new();
    if !*QUIET.get_or_init(|| std::env::var_os("CUDA_STUB_QUIET").is_some_and(|v| v != "0")) {
        eprintln!("cuda-stub: {}", what());
    }
}

/// Refuses with `code`, saying why (see [`note`]).
pub fn refuse<T>(code: CUresult, why: impl FnOnce() -> String) -> R<T> {
    note(|| format!("{}: {}", name(code), why()));
    Err(code)
}

/// The driver's description of each code this stand-in returns (the strings `cuGetErrorString`
/// gives for them); the others get their name.
fn description(code: CUresult) -> Option<&'static str> {
    Some(match code {
        E::CUDA_SUCCESS => "no error",
        E::CUDA_ERROR_INVALID_VALUE => "invalid argument",
        E::CUDA_ERROR_OUT_OF_MEMORY => "out of memory",
        E::CUDA_ERROR_NOT_INITIALIZED => "initialization error",
        E::CUDA_ERROR_DEINITIALIZED => "driver shutting down",
        E::CUDA_ERROR_DEVICE_UNAVAILABLE => "CUDA-capable device(s) is/are busy or unavailable",
        E::CUDA_ERROR_NO_DEVICE => "no CUDA-capable device is detected",
        E::CUDA_ERROR_INVALID_DEVICE => "invalid device ordinal",
        E::CUDA_ERROR_INVALID_IMAGE => "device kernel image is invalid",
        E::CUDA_ERROR_INVALID_CONTEXT => "invalid device context",
        E::CUDA_ERROR_NO_BINARY_FOR_GPU => {
            "no kernel image is available for execution on the device"
        }
        E::CUDA_ERROR_PEER_ACCESS_UNSUPPORTED => {
            "peer access is not supported between these two devices"
        }
        E::CUDA_ERROR_INVALID_PTX => "a PTX JIT compilation failed",
        E::CUDA_ERROR_JIT_COMPILER_NOT_FOUND => "PTX JIT compiler library not found",
        E::CUDA_ERROR_FILE_NOT_FOUND => "file not found",
        E::CUDA_ERROR_INVALID_HANDLE => "invalid resource handle",
        E::CUDA_ERROR_ILLEGAL_STATE => "the operation cannot be performed in the present state",
        E::CUDA_ERROR_NOT_FOUND => "named symbol not found",
        E::CUDA_ERROR_NOT_READY => "device not ready",
        E::CUDA_ERROR_ILLEGAL_ADDRESS => "an illegal memory access was encountered",
        E::CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES => "too many resources requested for launch",
        E::CUDA_ERROR_LAUNCH_TIMEOUT => "the launch timed out and was terminated",
        E::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {
            "peer access is already enabled to the context"
        }
        E::CUDA_ERROR_PEER_ACCESS_NOT_ENABLED => "peer access has not been enabled",
        E::CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE => "primary context active",
        E::CUDA_ERROR_CONTEXT_IS_DESTROYED => "context is destroyed",
        E::CUDA_ERROR_ILLEGAL_INSTRUCTION => "an illegal instruction was encountered",
        E::CUDA_ERROR_MISALIGNED_ADDRESS => "misaligned address",
        E::CUDA_ERROR_LAUNCH_FAILED => "unspecified launch failure",
        E::CUDA_ERROR_NOT_PERMITTED => "operation not permitted",
        E::CUDA_ERROR_NOT_SUPPORTED => "operation not supported",
        E::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED => {
            "operation not permitted when stream is capturing"
        }
        E::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED => {
            "operation failed due to a previous error during capture"
        }
        E::CUDA_ERROR_STREAM_CAPTURE_MERGE => {
            "operation would result in a merge of separate capture sequences"
        }
        E::CUDA_ERROR_STREAM_CAPTURE_UNMATCHED => {
            "capture was not ended in the same stream as it began"
        }
        E::CUDA_ERROR_STREAM_CAPTURE_UNJOINED => "capturing stream has unjoined work",
        E::CUDA_ERROR_STREAM_CAPTURE_ISOLATION => {
            "dependency created on uncaptured work in another stream"
        }
        E::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT => {
            "operation would make the legacy stream depend on a capturing blocking stream"
        }
        E::CUDA_ERROR_CAPTURED_EVENT => {
            "operation not permitted on an event last recorded in a capturing stream"
        }
        E::CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD => {
            "attempt to terminate a thread-local capture sequence from another thread"
        }
        E::CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE => {
            "the graph update was not performed because it included changes which violated \
             constraints specific to instantiated graph update"
        }
        E::CUDA_ERROR_UNKNOWN => "unknown error",
        _ => return None,
    })
}

/// `CUDA_ERROR_INVALID_VALUE` style name of a code.
pub fn name(code: CUresult) -> String {
    format!("{code:?}")
}

/// The code whose numeric value is `raw`, if the driver API has one.
fn from_raw(raw: u32) -> Option<CUresult> {
    ALL.iter().copied().find(|&c| c as u32 == raw)
}

/// The codes of CUDA 13.0's `CUresult`, as `cudarc` declares them.
const ALL: &[CUresult] = &[
    E::CUDA_SUCCESS,
    E::CUDA_ERROR_INVALID_VALUE,
    E::CUDA_ERROR_OUT_OF_MEMORY,
    E::CUDA_ERROR_NOT_INITIALIZED,
    E::CUDA_ERROR_DEINITIALIZED,
    E::CUDA_ERROR_PROFILER_DISABLED,
    E::CUDA_ERROR_PROFILER_NOT_INITIALIZED,
    E::CUDA_ERROR_PROFILER_ALREADY_STARTED,
    E::CUDA_ERROR_PROFILER_ALREADY_STOPPED,
    E::CUDA_ERROR_STUB_LIBRARY,
    E::CUDA_ERROR_DEVICE_UNAVAILABLE,
    E::CUDA_ERROR_NO_DEVICE,
    E::CUDA_ERROR_INVALID_DEVICE,
    E::CUDA_ERROR_DEVICE_NOT_LICENSED,
    E::CUDA_ERROR_INVALID_IMAGE,
    E::CUDA_ERROR_INVALID_CONTEXT,
    E::CUDA_ERROR_CONTEXT_ALREADY_CURRENT,
    E::CUDA_ERROR_MAP_FAILED,
    E::CUDA_ERROR_UNMAP_FAILED,
    E::CUDA_ERROR_ARRAY_IS_MAPPED,
    E::CUDA_ERROR_ALREADY_MAPPED,
    E::CUDA_ERROR_NO_BINARY_FOR_GPU,
    E::CUDA_ERROR_ALREADY_ACQUIRED,
    E::CUDA_ERROR_NOT_MAPPED,
    E::CUDA_ERROR_NOT_MAPPED_AS_ARRAY,
    E::CUDA_ERROR_NOT_MAPPED_AS_POINTER,
    E::CUDA_ERROR_ECC_UNCORRECTABLE,
    E::CUDA_ERROR_UNSUPPORTED_LIMIT,
    E::CUDA_ERROR_CONTEXT_ALREADY_IN_USE,
    E::CUDA_ERROR_PEER_ACCESS_UNSUPPORTED,
    E::CUDA_ERROR_INVALID_PTX,
    E::CUDA_ERROR_INVALID_GRAPHICS_CONTEXT,
    E::CUDA_ERROR_NVLINK_UNCORRECTABLE,
    E::CUDA_ERROR_JIT_COMPILER_NOT_FOUND,
    E::CUDA_ERROR_UNSUPPORTED_PTX_VERSION,
    E::CUDA_ERROR_JIT_COMPILATION_DISABLED,
    E::CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY,
    E::CUDA_ERROR_INVALID_SOURCE,
    E::CUDA_ERROR_FILE_NOT_FOUND,
    E::CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND,
    E::CUDA_ERROR_SHARED_OBJECT_INIT_FAILED,
    E::CUDA_ERROR_OPERATING_SYSTEM,
    E::CUDA_ERROR_INVALID_HANDLE,
    E::CUDA_ERROR_ILLEGAL_STATE,
    E::CUDA_ERROR_NOT_FOUND,
    E::CUDA_ERROR_NOT_READY,
    E::CUDA_ERROR_ILLEGAL_ADDRESS,
    E::CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES,
    E::CUDA_ERROR_LAUNCH_TIMEOUT,
    E::CUDA_ERROR_LAUNCH_INCOMPATIBLE_TEXTURING,
    E::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED,
    E::CUDA_ERROR_PEER_ACCESS_NOT_ENABLED,
    E::CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE,
    E::CUDA_ERROR_CONTEXT_IS_DESTROYED,
    E::CUDA_ERROR_ASSERT,
    E::CUDA_ERROR_TOO_MANY_PEERS,
    E::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
    E::CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED,
    E::CUDA_ERROR_HARDWARE_STACK_ERROR,
    E::CUDA_ERROR_ILLEGAL_INSTRUCTION,
    E::CUDA_ERROR_MISALIGNED_ADDRESS,
    E::CUDA_ERROR_INVALID_ADDRESS_SPACE,
    E::CUDA_ERROR_INVALID_PC,
    E::CUDA_ERROR_LAUNCH_FAILED,
    E::CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE,
    E::CUDA_ERROR_NOT_PERMITTED,
    E::CUDA_ERROR_NOT_SUPPORTED,
    E::CUDA_ERROR_SYSTEM_NOT_READY,
    E::CUDA_ERROR_SYSTEM_DRIVER_MISMATCH,
    E::CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE,
    E::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
    E::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
    E::CUDA_ERROR_STREAM_CAPTURE_MERGE,
    E::CUDA_ERROR_STREAM_CAPTURE_UNMATCHED,
    E::CUDA_ERROR_STREAM_CAPTURE_UNJOINED,
    E::CUDA_ERROR_STREAM_CAPTURE_ISOLATION,
    E::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT,
    E::CUDA_ERROR_CAPTURED_EVENT,
    E::CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD,
    E::CUDA_ERROR_TIMEOUT,
    E::CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE,
    E::CUDA_ERROR_UNKNOWN,
];

/// The C strings handed out, made once per code and kept for the life of the process (the API
/// returns pointers the caller never frees).
fn interned(code: CUresult, text: impl FnOnce() -> String) -> *const c_char {
    static STRINGS: OnceLock<Mutex<HashMap<(u32, bool), CString>>> = OnceLock::new();
    let mut map = STRINGS.get_or_init(Default::default).lock().unwrap();
    let text = text();
    let key = (code as u32, text.starts_with("CUDA_"));
    map.entry(key)
        .or_insert_with(|| CString::new(text).expect("no NUL in the tables"))
        .as_ptr()
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorName(error: u32, pstr: *mut *const c_char) -> CUresult {
    api("cuGetErrorName", || match from_raw(error) {
        // SAFETY: the caller passes a valid out-pointer (or null, refused by `put`).
        Some(code) => unsafe { put(pstr, interned(code, || name(code))) },
        None => {
            // SAFETY: as above.
            let _ = unsafe { put(pstr, std::ptr::null()) };
            Err(E::CUDA_ERROR_INVALID_VALUE)
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorString(error: u32, pstr: *mut *const c_char) -> CUresult {
    api("cuGetErrorString", || match from_raw(error) {
        Some(code) => {
            let text = description(code).map_or_else(|| name(code), str::to_string);
            // SAFETY: the caller passes a valid out-pointer (or null, refused by `put`).
            unsafe { put(pstr, interned(code, || text)) }
        }
        None => {
            // SAFETY: as above.
            let _ = unsafe { put(pstr, std::ptr::null()) };
            Err(E::CUDA_ERROR_INVALID_VALUE)
        }
    })
}
