//! Device memory: host memory between inaccessible guard pages (a kernel running past an
//! allocation faults, and the fault is the launch's illegal address), addressed by kernels as
//! the host addresses they are. `cuMemAlloc` memory is a `memfd` mapping, so that another
//! process can map it through an IPC handle ([`crate::ipc`]); stream-ordered (pool)
//! allocations, which the driver does not export, are anonymous. Fresh memory holds 0xFF
//! bytes: the driver does not zero it. The allocation, copy and memset exports.

use std::collections::{BTreeMap, HashMap};
use std::ffi::c_void;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};

use cudarc::driver::sys::CUresult as E;

use crate::context::{self, Context};
use crate::error::{CUresult, R, api, note, put, refuse};
use crate::stream::{self, Submitted};
use crate::work::{Source, Work};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// `cuMemAlloc`: exportable through IPC.
    Device,
    /// `cuMemAllocAsync`: stream-ordered.
    Pool,
    /// Another process's `cuMemAlloc` memory, opened from an IPC handle.
    Imported,
}

pub struct Alloc {
    pub base: u64,
    pub size: usize,
    map: *mut u8,
    map_len: usize,
    /// The memfd of exportable memory, and where the data starts in it.
    pub fd: Option<OwnedFd>,
    pub fd_offset: usize,
    pub device: usize,
    pub ctx: u64,
    pub kind: Kind,
    pub id: u64,
}

// SAFETY: the mapping is owned by the allocation; the bytes are shared memory by design.
unsafe impl Send for Alloc {}
// SAFETY: as above.
unsafe impl Sync for Alloc {}

impl Drop for Alloc {
    fn drop(&mut self) {
        // SAFETY: our own mapping, unmapped once.
        unsafe { libc::munmap(self.map.cast(), self.map_len) };
    }
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn registry() -> &'static RwLock<BTreeMap<u64, Arc<Alloc>>> {
    static LIVE: OnceLock<RwLock<BTreeMap<u64, Arc<Alloc>>>> = OnceLock::new();
    LIVE.get_or_init(Default::default)
}

/// Bytes allocated per device, against its total.
fn used() -> &'static Mutex<HashMap<usize, u64>> {
    static USED: OnceLock<Mutex<HashMap<usize, u64>>> = OnceLock::new();
    USED.get_or_init(Default::default)
}

fn page() -> usize {
    // SAFETY: no preconditions.
    unsafe { libc::sysconf(libc::_SC_PAGESIZE) as usize }
}

/// The driver aligns allocations to at least 256 bytes; the data ends at the guard page, so
/// an access past the end faults unless it stays inside the last 256-byte granule.
const ALIGN: usize = 256;

/// Maps `size` bytes between guard pages, from `fd` (shared) when given.
fn map(size: usize, fd: Option<&OwnedFd>) -> R<(*mut u8, usize, usize)> {
    let p = page();
    let body = size.div_ceil(ALIGN) * ALIGN;
    let body_pages = body.div_ceil(p) * p;
    let map_len = body_pages + 2 * p;
    // SAFETY: a fresh reservation, checked below.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            map_len,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return Err(E::CUDA_ERROR_OUT_OF_MEMORY);
    }
    let base = base.cast::<u8>();
    // SAFETY: [p, p + body_pages) lies inside the reservation; replaced in place.
    let ok = unsafe {
        match fd {
            Some(fd) => {
                libc::mmap(
                    base.add(p).cast(),
                    body_pages,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED | libc::MAP_FIXED,
                    fd.as_raw_fd(),
                    0,
                ) != libc::MAP_FAILED
            }
            None => {
                libc::mprotect(
                    base.add(p).cast(),
                    body_pages,
                    libc::PROT_READ | libc::PROT_WRITE,
                ) == 0
            }
        }
    };
    if !ok {
        // SAFETY: our reservation.
        unsafe { libc::munmap(base.cast(), map_len) };
        return Err(E::CUDA_ERROR_OUT_OF_MEMORY);
    }
    let offset = body_pages - body;
    Ok((base, map_len, p + offset))
}

/// A memfd of `size` bytes (rounded to pages).
fn memfd(size: usize, id: u64) -> R<OwnedFd> {
    let name = std::ffi::CString::new(format!("cuda-stub-{}-{id}", std::process::id())).unwrap();
    // SAFETY: a NUL-terminated name; the result is checked.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        note(|| format!("memfd_create: {}", std::io::Error::last_os_error()));
        return Err(E::CUDA_ERROR_OUT_OF_MEMORY);
    }
    // SAFETY: a descriptor we own from here on.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let len = size.div_ceil(ALIGN) * ALIGN;
    let len = len.div_ceil(page()) * page();
    // SAFETY: our descriptor.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
        return Err(E::CUDA_ERROR_OUT_OF_MEMORY);
    }
    Ok(fd)
}

/// The process's descriptor limit raised to its hard limit: every exportable allocation keeps
/// its memfd open.
pub fn raise_fd_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: plain out-parameter calls.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

/// Allocates `size` bytes of `kind` on `ctx`'s device.
pub fn allocate(ctx: &Context, size: usize, kind: Kind) -> R<Arc<Alloc>> {
    if size == 0 {
        return Err(E::CUDA_ERROR_INVALID_VALUE);
    }
    let total = crate::device::total_mem();
    {
        let mut used = used().lock().unwrap();
        let u = used.entry(ctx.device).or_default();
        if *u + size as u64 > total {
            return refuse(E::CUDA_ERROR_OUT_OF_MEMORY, || {
                format!(
                    "{size} B on device {} with {} of {total} B in use",
                    ctx.device, *u
                )
            });
        }
        *u += size as u64;
    }
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    let made = (|| {
        let fd = if kind == Kind::Device {
            Some(memfd(size, id)?)
        } else {
            None
        };
        let (map, map_len, offset) = map(size, fd.as_ref())?;
        Ok::<_, CUresult>(Alloc {
            // SAFETY: `offset` is inside the mapping.
            base: unsafe { map.add(offset) } as u64,
            size,
            map,
            map_len,
            fd_offset: offset - page(),
            fd,
            device: ctx.device,
            ctx: ctx.id,
            kind,
            id,
        })
    })();
    let a = match made {
        Ok(a) => Arc::new(a),
        Err(e) => {
            *used().lock().unwrap().get_mut(&ctx.device).unwrap() -= size as u64;
            return Err(e);
        }
    };
    if poison() {
        // SAFETY: the data region is `size` writable bytes.
        unsafe { std::ptr::write_bytes(a.base as *mut u8, 0xFF, size) };
    }
    registry().write().unwrap().insert(a.base, a.clone());
    Ok(a)
}

/// Registers memory another process exported (see [`crate::ipc`]).
pub fn import(
    ctx: &Context,
    fd: OwnedFd,
    fd_offset: usize,
    size: usize,
    device: usize,
) -> R<Arc<Alloc>> {
    let p = page();
    let body = size.div_ceil(ALIGN) * ALIGN;
    let body_pages = (fd_offset + body).div_ceil(p) * p;
    let (map, map_len, _) = map(body_pages, Some(&fd))?;
    let a = Arc::new(Alloc {
        // SAFETY: one guard page, then the file from its start: the data at `fd_offset`.
        base: unsafe { map.add(p + fd_offset) } as u64,
        size,
        map,
        map_len,
        fd: Some(fd),
        fd_offset,
        device,
        ctx: ctx.id,
        kind: Kind::Imported,
        id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
    });
    registry().write().unwrap().insert(a.base, a.clone());
    Ok(a)
}

fn poison() -> bool {
    static POISON: OnceLock<bool> = OnceLock::new();
    *POISON.get_or_init(|| std::env::var_os("CUDA_STUB_POISON").is_none_or(|v| v != "0"))
}

/// The allocation holding `[ptr, ptr + len)`, if one does.
pub fn find(ptr: u64, len: usize) -> Option<Arc<Alloc>> {
    let live = registry().read().unwrap();
    let (_, a) = live.range(..=ptr).next_back()?;
    (ptr + len as u64 <= a.base + a.size as u64).then(|| a.clone())
}

/// The allocation starting exactly at `ptr`.
pub fn at(ptr: u64) -> Option<Arc<Alloc>> {
    registry().read().unwrap().get(&ptr).cloned()
}

/// Forgets an allocation; its pages go when the last reference (a queued item) does.
pub fn release(a: &Arc<Alloc>) {
    crate::hazard::forget(a.base);
    if registry().write().unwrap().remove(&a.base).is_some()
        && a.kind != Kind::Imported
        && let Some(u) = used().lock().unwrap().get_mut(&a.device)
    {
        *u -= a.size as u64;
    }
}

/// Frees what a context allocated (its destruction or last release).
pub fn forget_context(ctx: u64) {
    let gone: Vec<Arc<Alloc>> = registry()
        .read()
        .unwrap()
        .values()
        .filter(|a| a.ctx == ctx)
        .cloned()
        .collect();
    for a in &gone {
        release(a);
    }
    PINNED.lock().unwrap().retain(|_, (_, c)| *c != ctx);
}

/// Pinned host allocations (`cuMemHostAlloc`): start → (length, context).
static PINNED: Mutex<BTreeMap<u64, (usize, u64)>> = Mutex::new(BTreeMap::new());

pub fn is_pinned(ptr: u64) -> bool {
    let p = PINNED.lock().unwrap();
    p.range(..=ptr)
        .next_back()
        .is_some_and(|(&b, &(n, _))| ptr < b + n as u64)
}

/// Checks `[ptr, ptr + len)` is device memory, naming the call that was given it otherwise.
fn device_range(what: &str, ptr: u64, len: usize) -> R<Arc<Alloc>> {
    find(ptr, len).ok_or_else(|| {
        note(|| format!("{what}: {len} B at {ptr:#x} is not inside one device allocation"));
        E::CUDA_ERROR_INVALID_VALUE
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(out: *mut u64, size: usize) -> CUresult {
    api("cuMemAlloc_v2", || {
        let ctx = context::current()?;
        crate::capture::refuse_unsafe_call("cuMemAlloc")?;
        let a = allocate(&ctx, size, Kind::Device)?;
        // SAFETY: the caller's out-pointer.
        unsafe { put(out, a.base) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFree_v2(ptr: u64) -> CUresult {
    api("cuMemFree_v2", || {
        let ctx = context::current()?;
        crate::capture::refuse_unsafe_call("cuMemFree")?;
        let a = at(ptr).ok_or(E::CUDA_ERROR_INVALID_VALUE)?;
        if a.kind == Kind::Imported {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        // The driver frees only once the device is done with the memory.
        ctx.synchronize()?;
        release(&a);
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocAsync(
    out: *mut u64,
    size: usize,
    stream: *mut c_void,
) -> CUresult {
    api("cuMemAllocAsync", || {
        let s = stream::resolve_for_work(stream)?;
        if s.capture.lock().unwrap().is_some() {
            // A real driver records a graph memory node; the stand-in does not model them.
            return refuse(E::CUDA_ERROR_NOT_SUPPORTED, || {
                "cuMemAllocAsync during a capture: graph memory nodes are not modelled by the \
                 stand-in driver (allocate before capturing)"
                    .into()
            });
        }
        let a = allocate(&s.ctx, size, Kind::Pool)?;
        // SAFETY: the caller's out-pointer.
        unsafe { put(out, a.base) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFreeAsync(ptr: u64, stream: *mut c_void) -> CUresult {
    api("cuMemFreeAsync", || {
        let s = stream::resolve_for_work(stream)?;
        let a = at(ptr).ok_or(E::CUDA_ERROR_INVALID_VALUE)?;
        if a.kind == Kind::Imported {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        if s.capture.lock().unwrap().is_some() {
            return refuse(E::CUDA_ERROR_NOT_SUPPORTED, || {
                "cuMemFreeAsync during a capture: graph memory nodes are not modelled by the \
                 stand-in driver"
                    .into()
            });
        }
        stream::submit(&s, Work::Free(a), Vec::new())?;
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    api("cuMemGetInfo_v2", || {
        let ctx = context::current()?;
        let t = crate::device::total_mem();
        let u = used()
            .lock()
            .unwrap()
            .get(&ctx.device)
            .copied()
            .unwrap_or(0);
        // SAFETY: the caller's out-pointers.
        unsafe {
            put(free, (t - u) as usize)?;
            put(total, t as usize)
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemHostAlloc(
    out: *mut *mut c_void,
    size: usize,
    _flags: u32,
) -> CUresult {
    api("cuMemHostAlloc", || {
        let ctx = context::current()?;
        crate::capture::refuse_unsafe_call("cuMemHostAlloc")?;
        if size == 0 {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        let (map, _, offset) = map(size, None)?;
        // SAFETY: inside the mapping.
        let p = unsafe { map.add(offset) };
        PINNED.lock().unwrap().insert(p as u64, (size, ctx.id));
        // SAFETY: the caller's out-pointer.
        unsafe { put(out, p.cast()) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocHost_v2(out: *mut *mut c_void, size: usize) -> CUresult {
    // SAFETY: same contract.
    unsafe { cuMemHostAlloc(out, size, 0) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFreeHost(ptr: *mut c_void) -> CUresult {
    api("cuMemFreeHost", || {
        let ctx = context::current()?;
        crate::capture::refuse_unsafe_call("cuMemFreeHost")?;
        ctx.synchronize()?;
        // The pages stay mapped (a reservation the size of the allocation is not worth the
        // bookkeeping of its guard pages); the range stops being pinned.
        PINNED
            .lock()
            .unwrap()
            .remove(&(ptr as u64))
            .map(|_| ())
            .ok_or(E::CUDA_ERROR_INVALID_VALUE)
    })
}

/// How a copy synchronizes with the host, per the driver's "API synchronization behavior".
#[derive(Clone, Copy, PartialEq, Eq)]
enum Call {
    /// `cuMemcpy*` without `Async`: on the legacy stream.
    Sync,
    Async,
}

/// The stream a copy or memset goes to: the legacy stream for the synchronous forms, which
/// are refused during a capture that forbids them.
fn on_stream(what: &str, call: Call, stream: *mut c_void) -> R<Arc<stream::Stream>> {
    match call {
        Call::Sync => {
            let ctx = context::current()?;
            crate::capture::refuse_unsafe_call(what)?;
            Ok(ctx.legacy())
        }
        Call::Async => stream::resolve_for_work(stream),
    }
}

/// Issues a copy of `len` bytes; `dst_dev` / `src_dev` say which ends are device memory.
fn copy(what: &str, call: Call, stream: *mut c_void, dst: u64, src: u64, len: usize) -> R {
    let s = on_stream(what, call, stream)?;
    let (dst_dev, src_dev) = (find(dst, 1).is_some(), find(src, 1).is_some());
    if dst_dev {
        device_range(what, dst, len)?;
    }
    if src_dev {
        device_range(what, src, len)?;
    }
    if len == 0 {
        return Ok(());
    }
    let pageable = |p: u64, dev: bool| !dev && !is_pinned(p);
    let capturing = s.capture.lock().unwrap().is_some();
    if capturing && (pageable(src, src_dev) || pageable(dst, dst_dev)) {
        // A graph cannot hold a copy from or to pageable host memory.
        crate::capture::invalidate_stream_capture(&s);
        return refuse(E::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, || {
            format!("{what} of pageable host memory during a capture")
        });
    }
    let source = if pageable(src, src_dev) && dst_dev {
        // SAFETY: the caller's host buffer of `len` bytes, read now.
        let bytes = unsafe { std::slice::from_raw_parts(src as *const u8, len) }.to_vec();
        Source::Staged(Arc::new(bytes))
    } else {
        Source::Address {
            ptr: src,
            device: src_dev,
        }
    };
    let work = Work::Copy {
        dst,
        dst_device: dst_dev,
        src: source,
        len,
    };
    // The host waits for: any synchronous copy but device to device; an asynchronous one into
    // pageable memory, or between host buffers.
    let host_waits = match call {
        Call::Sync => !(dst_dev && src_dev),
        Call::Async => pageable(dst, dst_dev) || (!dst_dev && !src_dev),
    };
    if host_waits {
        stream::submit_and_wait(&s, work)
    } else {
        stream::submit(&s, work, Vec::new()).map(|_: Submitted| ())
    }
}

macro_rules! copy_export {
    ($name:ident, $call:expr, ($($arg:ident: $ty:ty),*), $dst:expr, $src:expr, $len:expr, $stream:expr) => {
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> CUresult {
            api(stringify!($name), || copy(stringify!($name), $call, $stream, $dst, $src, $len))
        }
    };
}

copy_export!(cuMemcpyHtoD_v2, Call::Sync, (dst: u64, src: *const c_void, n: usize), dst, src as u64, n, std::ptr::null_mut());
copy_export!(cuMemcpyDtoH_v2, Call::Sync, (dst: *mut c_void, src: u64, n: usize), dst as u64, src, n, std::ptr::null_mut());
copy_export!(cuMemcpyDtoD_v2, Call::Sync, (dst: u64, src: u64, n: usize), dst, src, n, std::ptr::null_mut());
copy_export!(cuMemcpy, Call::Sync, (dst: u64, src: u64, n: usize), dst, src, n, std::ptr::null_mut());
copy_export!(cuMemcpyHtoDAsync_v2, Call::Async, (dst: u64, src: *const c_void, n: usize, s: *mut c_void), dst, src as u64, n, s);
copy_export!(cuMemcpyDtoHAsync_v2, Call::Async, (dst: *mut c_void, src: u64, n: usize, s: *mut c_void), dst as u64, src, n, s);
copy_export!(cuMemcpyDtoDAsync_v2, Call::Async, (dst: u64, src: u64, n: usize, s: *mut c_void), dst, src, n, s);
copy_export!(cuMemcpyAsync, Call::Async, (dst: u64, src: u64, n: usize, s: *mut c_void), dst, src, n, s);

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyPeerAsync(
    dst: u64,
    _dst_ctx: *mut c_void,
    src: u64,
    _src_ctx: *mut c_void,
    n: usize,
    s: *mut c_void,
) -> CUresult {
    api("cuMemcpyPeerAsync", || {
        copy("cuMemcpyPeerAsync", Call::Async, s, dst, src, n)
    })
}

/// Issues a memset of `count` elements of `width` bytes.
fn memset(
    what: &str,
    call: Call,
    stream: *mut c_void,
    dst: u64,
    value: u32,
    width: usize,
    count: usize,
) -> R {
    if !dst.is_multiple_of(width as u64) {
        return Err(E::CUDA_ERROR_INVALID_VALUE);
    }
    let s = on_stream(what, call, stream)?;
    let pinned = is_pinned(dst);
    if !pinned {
        device_range(what, dst, count * width)?;
    }
    if count == 0 {
        return Ok(());
    }
    let work = Work::Fill {
        dst,
        value,
        width,
        count,
    };
    // Asynchronous to the host, except the synchronous form on pinned host memory.
    if call == Call::Sync && pinned {
        stream::submit_and_wait(&s, work)
    } else {
        stream::submit(&s, work, Vec::new()).map(|_| ())
    }
}

macro_rules! memset_export {
    ($name:ident, $call:expr, $vt:ty, $width:expr) => {
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(dst: u64, value: $vt, count: usize) -> CUresult {
            api(stringify!($name), || {
                memset(
                    stringify!($name),
                    $call,
                    std::ptr::null_mut(),
                    dst,
                    value as u32,
                    $width,
                    count,
                )
            })
        }
    };
    ($name:ident, $call:expr, $vt:ty, $width:expr, async) => {
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            dst: u64,
            value: $vt,
            count: usize,
            s: *mut c_void,
        ) -> CUresult {
            api(stringify!($name), || {
                memset(
                    stringify!($name),
                    $call,
                    s,
                    dst,
                    value as u32,
                    $width,
                    count,
                )
            })
        }
    };
}

memset_export!(cuMemsetD8_v2, Call::Sync, u8, 1);
memset_export!(cuMemsetD16_v2, Call::Sync, u16, 2);
memset_export!(cuMemsetD32_v2, Call::Sync, u32, 4);
memset_export!(cuMemsetD8Async, Call::Async, u8, 1, async);
memset_export!(cuMemsetD16Async, Call::Async, u16, 2, async);
memset_export!(cuMemsetD32Async, Call::Async, u32, 4, async);
