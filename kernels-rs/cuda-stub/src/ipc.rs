//! CUDA IPC across processes. A handle names the exporting process, the memfd behind its
//! `cuMemAlloc` allocation and where the data starts; the importer opens the memfd through
//! `/proc/<pid>/fd/<fd>` (same user, as the driver requires) and maps it between guard pages.
//! As on the driver: only `cuMemAlloc` memory exports (not stream-ordered allocations), a
//! process cannot open its own handles, and opening the same handle again gives the same
//! address, counted until as many closes.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::CUresult as E;

use crate::context;
use crate::error::{CUresult, R, api, note, put, refuse};
use crate::memory::{self, Alloc, Kind};

const MAGIC: &[u8; 8] = b"stubipc1";

/// The 64 bytes of a `CUipcMemHandle`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Handle {
    pid: u32,
    fd: i32,
    id: u64,
    size: u64,
    offset: u64,
    device: u32,
}

impl Handle {
    fn encode(&self) -> [u8; 64] {
        let mut b = [0u8; 64];
        b[..8].copy_from_slice(MAGIC);
        b[8..12].copy_from_slice(&self.pid.to_le_bytes());
        b[12..16].copy_from_slice(&self.fd.to_le_bytes());
        b[16..24].copy_from_slice(&self.id.to_le_bytes());
        b[24..32].copy_from_slice(&self.size.to_le_bytes());
        b[32..40].copy_from_slice(&self.offset.to_le_bytes());
        b[40..44].copy_from_slice(&self.device.to_le_bytes());
        b
    }

    fn decode(b: &[u8; 64]) -> Option<Self> {
        if &b[..8] != MAGIC {
            return None;
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap());
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
        Some(Self {
            pid: u32_at(8),
            fd: u32_at(12) as i32,
            id: u64_at(16),
            size: u64_at(24),
            offset: u64_at(32),
            device: u32_at(40),
        })
    }
}

/// `CUipcMemHandle`: 64 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct IpcMemHandle {
    pub reserved: [u8; 64],
}

/// Handles opened in this process: handle → (allocation, opens).
type Opened = HashMap<Handle, (Arc<Alloc>, usize)>;
static OPENED: Mutex<Option<Opened>> = Mutex::new(None);

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuIpcGetMemHandle(out: *mut IpcMemHandle, ptr: u64) -> CUresult {
    api("cuIpcGetMemHandle", || {
        context::current()?;
        let a = memory::at(ptr).ok_or_else(|| {
            note(|| format!("cuIpcGetMemHandle: {ptr:#x} is not the start of an allocation"));
            E::CUDA_ERROR_INVALID_VALUE
        })?;
        let Some(fd) = a.fd.as_ref().filter(|_| a.kind == Kind::Device) else {
            return refuse(E::CUDA_ERROR_INVALID_VALUE, || {
                format!(
                    "cuIpcGetMemHandle of {ptr:#x}: only cuMemAlloc memory can be exported, \
                     this is {:?}",
                    a.kind
                )
            });
        };
        let h = Handle {
            pid: std::process::id(),
            fd: fd.as_raw_fd(),
            id: a.id,
            size: a.size as u64,
            offset: a.fd_offset as u64,
            device: a.device as u32,
        };
        // SAFETY: the caller's out-pointer (a CUipcMemHandle is 64 bytes).
        unsafe {
            put(
                out,
                IpcMemHandle {
                    reserved: h.encode(),
                },
            )
        }
    })
}

/// Opens the exporter's memfd, checking that the descriptor is still that allocation's.
fn open_memfd(h: &Handle) -> R<OwnedFd> {
    let link = format!("/proc/{}/fd/{}", h.pid, h.fd);
    let expect = format!("/memfd:cuda-stub-{}-{} (deleted)", h.pid, h.id);
    let target = std::fs::read_link(&link).map_err(|e| {
        note(|| format!("cuIpcOpenMemHandle: {link}: {e} (the exporting process is gone?)"));
        E::CUDA_ERROR_INVALID_VALUE
    })?;
    if target.to_string_lossy() != expect {
        return refuse(E::CUDA_ERROR_INVALID_VALUE, || {
            format!("cuIpcOpenMemHandle: the handle's allocation was freed ({link} is {target:?})")
        });
    }
    let f = std::fs::File::options()
        .read(true)
        .write(true)
        .open(&link)
        .map_err(|e| {
            note(|| format!("cuIpcOpenMemHandle: open {link}: {e}"));
            E::CUDA_ERROR_INVALID_VALUE
        })?;
    Ok(OwnedFd::from(f))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuIpcOpenMemHandle_v2(
    out: *mut u64,
    handle: IpcMemHandle,
    flags: u32,
) -> CUresult {
    api("cuIpcOpenMemHandle_v2", || {
        let ctx = context::current()?;
        if flags > 1 {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        let h = Handle::decode(&handle.reserved).ok_or_else(|| {
            note(|| "cuIpcOpenMemHandle: not a handle of the stand-in driver".into());
            E::CUDA_ERROR_INVALID_VALUE
        })?;
        if h.pid == std::process::id() {
            return refuse(E::CUDA_ERROR_INVALID_CONTEXT, || {
                "cuIpcOpenMemHandle of a handle this process exported (a process cannot open \
                 its own)"
                    .into()
            });
        }
        let device = h.device as usize;
        if device != ctx.device
            && !ctx.peer_enabled(device)
            && !device::peer_ok(ctx.device, device, flags)
        {
            return refuse(E::CUDA_ERROR_PEER_ACCESS_UNSUPPORTED, || {
                format!(
                    "memory of device {device} opened on device {} without peer access",
                    ctx.device
                )
            });
        }
        let mut opened = OPENED.lock().unwrap();
        let map = opened.get_or_insert_with(HashMap::new);
        if let Some((a, n)) = map.get_mut(&h) {
            *n += 1;
            // SAFETY: the caller's out-pointer.
            return unsafe { put(out, a.base) };
        }
        let fd = open_memfd(&h)?;
        let a = memory::import(&ctx, fd, h.offset as usize, h.size as usize, device)?;
        map.insert(h, (a.clone(), 1));
        // SAFETY: the caller's out-pointer.
        unsafe { put(out, a.base) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuIpcCloseMemHandle(ptr: u64) -> CUresult {
    api("cuIpcCloseMemHandle", || {
        let ctx = context::current()?;
        let mut opened = OPENED.lock().unwrap();
        let map = opened.get_or_insert_with(HashMap::new);
        let key = map
            .iter()
            .find(|(_, (a, _))| a.base == ptr)
            .map(|(h, _)| *h)
            .ok_or(E::CUDA_ERROR_INVALID_VALUE)?;
        let (a, n) = map.get_mut(&key).expect("found above");
        *n -= 1;
        if *n == 0 {
            let a = a.clone();
            map.remove(&key);
            drop(opened);
            // Kernels still reading the peer's memory finish first.
            ctx.synchronize()?;
            memory::release(&a);
        }
        Ok(())
    })
}

mod device {
    /// Whether device `from` may map device `to`'s memory: lazily enabled peer access
    /// (`CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`) where the devices can reach each other.
    pub fn peer_ok(from: usize, to: usize, flags: u32) -> bool {
        flags & 1 != 0 && from != to && crate::device::config().is_ok_and(|c| c.p2p)
    }
}
