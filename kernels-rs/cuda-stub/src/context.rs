//! Contexts: one primary context per device (retained and released, reset when its count
//! reaches zero), created contexts, the per-thread stack of current contexts, sticky errors and
//! peer access; the `cuCtx*` and `cuDevicePrimaryCtx*` exports.

use std::cell::RefCell;
use std::collections::HashSet;
use std::ffi::c_int;
use std::fs::File;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use cudarc::driver::sys::CUresult as E;

use crate::device::{self, COMPUTE_MODE_EXCLUSIVE_PROCESS, COMPUTE_MODE_PROHIBITED};
use crate::error::{CUresult, R, api, note, put, refuse};
use crate::handles::{Registry, handle_of};
use crate::stream::{Stream, StreamKind};

pub struct Context {
    pub id: u64,
    pub device: usize,
    pub primary: bool,
    inner: Mutex<Inner>,
    sticky: Mutex<Option<CUresult>>,
}

#[derive(Default)]
struct Inner {
    /// A primary context is active between its first retain and its last release.
    active: bool,
    retained: u32,
    flags: u32,
    /// Devices whose memory this context's kernels may access (`cuCtxEnablePeerAccess`).
    peers: HashSet<usize>,
    legacy: Option<Arc<Stream>>,
    /// Every stream made in the context: the legacy stream orders with the blocking ones, and
    /// a context synchronization waits for all of them.
    streams: Vec<Weak<Stream>>,
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn primaries() -> &'static [Arc<Context>] {
    static PRIMARY: OnceLock<Vec<Arc<Context>>> = OnceLock::new();
    PRIMARY.get_or_init(|| {
        let count = device::config().map_or(0, |c| c.count);
        (0..count).map(|d| Context::new(d, true)).collect()
    })
}

fn created() -> &'static Registry<Context> {
    static CREATED: OnceLock<Registry<Context>> = OnceLock::new();
    CREATED.get_or_init(Registry::default)
}

thread_local! {
    static STACK: RefCell<Vec<Arc<Context>>> = const { RefCell::new(Vec::new()) };
}

impl Context {
    fn new(device: usize, primary: bool) -> Arc<Self> {
        Arc::new(Self {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            device,
            primary,
            inner: Mutex::new(Inner::default()),
            sticky: Mutex::new(None),
        })
    }

    /// The error a fault left in this context, which every later call returns.
    pub fn sticky(&self) -> Option<CUresult> {
        *self.sticky.lock().unwrap()
    }

    pub fn set_sticky(&self, code: CUresult) {
        self.sticky.lock().unwrap().get_or_insert(code);
    }

    /// Usable for work: active and without a sticky error.
    pub fn usable(&self) -> R {
        if !self.inner.lock().unwrap().active {
            return Err(E::CUDA_ERROR_CONTEXT_IS_DESTROYED);
        }
        match self.sticky() {
            Some(code) => Err(code),
            None => Ok(()),
        }
    }

    /// The legacy (NULL) stream, made on first use.
    pub fn legacy(self: &Arc<Self>) -> Arc<Stream> {
        let mut inner = self.inner.lock().unwrap();
        if let Some(s) = &inner.legacy {
            return s.clone();
        }
        let s = Stream::new(self.clone(), StreamKind::Legacy, 0);
        inner.streams.push(Arc::downgrade(&s));
        inner.legacy = Some(s.clone());
        s
    }

    pub fn add_stream(&self, stream: &Arc<Stream>) {
        let mut inner = self.inner.lock().unwrap();
        inner.streams.retain(|w| w.strong_count() > 0);
        inner.streams.push(Arc::downgrade(stream));
    }

    /// The context's live streams.
    pub fn streams(&self) -> Vec<Arc<Stream>> {
        self.inner
            .lock()
            .unwrap()
            .streams
            .iter()
            .filter_map(Weak::upgrade)
            .collect()
    }

    pub fn peer_enabled(&self, device: usize) -> bool {
        device == self.device || self.inner.lock().unwrap().peers.contains(&device)
    }

    /// Waits for every stream's work issued so far.
    pub fn synchronize(&self) -> R {
        for s in self.streams() {
            s.wait_idle();
        }
        self.sticky().map_or(Ok(()), Err)
    }

    fn activate(&self) -> R {
        let mode = device::config().map_or(0, |c| c.compute_mode);
        if mode == COMPUTE_MODE_PROHIBITED {
            return refuse(E::CUDA_ERROR_DEVICE_UNAVAILABLE, || {
                format!("device {}: compute mode PROHIBITED", self.device)
            });
        }
        if mode == COMPUTE_MODE_EXCLUSIVE_PROCESS {
            exclusive_lock(self.device)?;
        }
        self.inner.lock().unwrap().active = true;
        Ok(())
    }

    /// Frees what the context holds (its last release, or its destruction): the driver
    /// drains its work and tears its streams, memory and modules down.
    fn reset(self: &Arc<Self>) {
        let _ = self.synchronize();
        let mut inner = self.inner.lock().unwrap();
        inner.active = false;
        inner.legacy = None;
        inner.streams.clear();
        inner.peers.clear();
        drop(inner);
        crate::stream::forget_context(self.id);
        crate::event::forget_context(self.id);
        crate::module::forget_context(self.id);
        crate::memory::forget_context(self.id);
        *self.sticky.lock().unwrap() = None;
    }
}

/// In EXCLUSIVE_PROCESS mode one process at a time may hold contexts on a device: a lock file
/// per device, held by this process until it exits.
fn exclusive_lock(device: usize) -> R {
    static HELD: Mutex<Vec<(usize, File)>> = Mutex::new(Vec::new());
    let mut held = HELD.lock().unwrap();
    if held.iter().any(|(d, _)| *d == device) {
        return Ok(());
    }
    let dir = std::env::var_os("TMPDIR").unwrap_or_else(|| "/tmp".into());
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    let path = std::path::Path::new(&dir).join(format!(
        "cuda-stub-{uid}-{}-{device}.lock",
        device::kind().id
    ));
    let file = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| {
            note(|| format!("{}: {e}", path.display()));
            E::CUDA_ERROR_OPERATING_SYSTEM
        })?;
    use std::os::fd::AsRawFd;
    // SAFETY: a valid descriptor; the lock is released when the process exits.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        return refuse(E::CUDA_ERROR_DEVICE_UNAVAILABLE, || {
            format!(
                "device {device} is in EXCLUSIVE_PROCESS compute mode and another process holds \
                 a context on it"
            )
        });
    }
    held.push((device, file));
    Ok(())
}

/// The context current on this thread, usable for work; `CUDA_ERROR_INVALID_CONTEXT` when the
/// thread has none, as on a real driver.
pub fn current() -> R<Arc<Context>> {
    crate::initialized()?;
    let ctx = STACK.with(|s| s.borrow().last().cloned());
    match ctx {
        Some(c) => {
            c.usable()?;
            Ok(c)
        }
        None => refuse(E::CUDA_ERROR_INVALID_CONTEXT, || {
            format!(
                "no context is current on thread {:?} (cuCtxSetCurrent first)",
                std::thread::current().id()
            )
        }),
    }
}

/// The context behind a `CUcontext` handle.
pub fn lookup(handle: *mut std::ffi::c_void) -> R<Arc<Context>> {
    if let Some(c) = primaries()
        .iter()
        .find(|c| handle_of::<_, std::ffi::c_void>(c) == handle)
    {
        return Ok(c.clone());
    }
    created().get(handle).ok_or(E::CUDA_ERROR_INVALID_CONTEXT)
}

/// Every context made so far (primary ones included).
pub fn primary(device: usize) -> Arc<Context> {
    primaries()[device].clone()
}

type CuCtx = *mut std::ffi::c_void;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(out: *mut CuCtx, dev: c_int) -> CUresult {
    api("cuDevicePrimaryCtxRetain", || {
        let d = device::device(dev)?;
        let ctx = primary(d);
        let first = ctx.inner.lock().unwrap().retained == 0;
        if first && !ctx.inner.lock().unwrap().active {
            ctx.activate()?;
        }
        ctx.inner.lock().unwrap().retained += 1;
        // SAFETY: the caller's out-pointer.
        unsafe { put(out, handle_of(&ctx)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: c_int) -> CUresult {
    api("cuDevicePrimaryCtxRelease_v2", || {
        let ctx = primary(device::device(dev)?);
        let last = {
            let mut inner = ctx.inner.lock().unwrap();
            if inner.retained == 0 {
                return Err(E::CUDA_ERROR_INVALID_CONTEXT);
            }
            inner.retained -= 1;
            inner.retained == 0
        };
        if last {
            ctx.reset();
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxGetState(
    dev: c_int,
    flags: *mut u32,
    active: *mut c_int,
) -> CUresult {
    api("cuDevicePrimaryCtxGetState", || {
        let ctx = primary(device::device(dev)?);
        let inner = ctx.inner.lock().unwrap();
        // SAFETY: the caller's out-pointers.
        unsafe {
            put(flags, inner.flags)?;
            put(active, c_int::from(inner.active))
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxSetFlags_v2(dev: c_int, flags: u32) -> CUresult {
    api("cuDevicePrimaryCtxSetFlags_v2", || {
        primary(device::device(dev)?).inner.lock().unwrap().flags = flags;
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxReset_v2(dev: c_int) -> CUresult {
    api("cuDevicePrimaryCtxReset_v2", || {
        primary(device::device(dev)?).reset();
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v4(
    out: *mut CuCtx,
    _params: *mut std::ffi::c_void,
    flags: u32,
    dev: c_int,
) -> CUresult {
    api("cuCtxCreate_v4", || {
        let d = device::device(dev)?;
        if out.is_null() {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        let ctx = Context::new(d, false);
        ctx.activate()?;
        ctx.inner.lock().unwrap().flags = flags;
        let handle = created().insert(ctx.clone());
        // A created context is pushed onto the calling thread's stack.
        STACK.with(|s| s.borrow_mut().push(ctx));
        // SAFETY: checked non-null above.
        unsafe { put(out, handle) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxDestroy_v2(ctx: CuCtx) -> CUresult {
    api("cuCtxDestroy_v2", || {
        crate::initialized()?;
        let c = created().remove(ctx).ok_or(E::CUDA_ERROR_INVALID_CONTEXT)?;
        c.reset();
        STACK.with(|s| s.borrow_mut().retain(|x| !Arc::ptr_eq(x, &c)));
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxSetCurrent(ctx: CuCtx) -> CUresult {
    api("cuCtxSetCurrent", || {
        crate::initialized()?;
        let c = if ctx.is_null() {
            None
        } else {
            Some(lookup(ctx)?)
        };
        STACK.with(|s| {
            let mut s = s.borrow_mut();
            s.pop();
            s.extend(c);
        });
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetCurrent(out: *mut CuCtx) -> CUresult {
    api("cuCtxGetCurrent", || {
        crate::initialized()?;
        let h = STACK.with(|s| s.borrow().last().map(handle_of));
        // SAFETY: the caller's out-pointer.
        unsafe { put(out, h.unwrap_or(std::ptr::null_mut())) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxPushCurrent_v2(ctx: CuCtx) -> CUresult {
    api("cuCtxPushCurrent_v2", || {
        crate::initialized()?;
        let c = lookup(ctx)?;
        STACK.with(|s| s.borrow_mut().push(c));
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxPopCurrent_v2(out: *mut CuCtx) -> CUresult {
    api("cuCtxPopCurrent_v2", || {
        crate::initialized()?;
        let c = STACK
            .with(|s| s.borrow_mut().pop())
            .ok_or(E::CUDA_ERROR_INVALID_CONTEXT)?;
        if !out.is_null() {
            // SAFETY: non-null out-pointer of the caller.
            unsafe { put(out, handle_of(&c))? };
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetDevice(out: *mut c_int) -> CUresult {
    api("cuCtxGetDevice", || {
        let c = current()?;
        // SAFETY: the caller's out-pointer.
        unsafe { put(out, c.device as c_int) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxSynchronize() -> CUresult {
    api("cuCtxSynchronize", || {
        let c = current()?;
        // Waiting for the whole context waits for every capturing stream too: refused while
        // any of them captures, whatever the mode, and the captures are invalidated.
        crate::capture::refuse_context_sync(&c)?;
        c.synchronize()
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxSetFlags(flags: u32) -> CUresult {
    api("cuCtxSetFlags", || {
        current()?.inner.lock().unwrap().flags = flags;
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetFlags(out: *mut u32) -> CUresult {
    api("cuCtxGetFlags", || {
        let f = current()?.inner.lock().unwrap().flags;
        // SAFETY: the caller's out-pointer.
        unsafe { put(out, f) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetApiVersion(ctx: CuCtx, out: *mut u32) -> CUresult {
    api("cuCtxGetApiVersion", || {
        crate::initialized()?;
        if !ctx.is_null() {
            lookup(ctx)?;
        }
        // SAFETY: the caller's out-pointer.
        unsafe { put(out, 13000) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetStreamPriorityRange(
    least: *mut c_int,
    greatest: *mut c_int,
) -> CUresult {
    api("cuCtxGetStreamPriorityRange", || {
        current()?;
        // SAFETY: the caller's out-pointers (either may be null).
        unsafe {
            if !least.is_null() {
                put(least, 0)?;
            }
            if !greatest.is_null() {
                put(greatest, -5)?;
            }
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetLimit(out: *mut usize, limit: u32) -> CUresult {
    api("cuCtxGetLimit", || {
        current()?;
        // Stack size, printf FIFO, malloc heap, ...: the driver's defaults.
        let v = match limit {
            0 => 1024,
            1 => 1 << 20,
            2 => 8 << 20,
            3 => 2,
            4 => 2048,
            5 => 64,
            6 => 0,
            _ => return Err(E::CUDA_ERROR_UNSUPPORTED_LIMIT),
        };
        // SAFETY: the caller's out-pointer.
        unsafe { put(out, v) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxSetLimit(limit: u32, _value: usize) -> CUresult {
    api("cuCtxSetLimit", || {
        current()?;
        if limit > 6 {
            return Err(E::CUDA_ERROR_UNSUPPORTED_LIMIT);
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxEnablePeerAccess(peer: CuCtx, flags: u32) -> CUresult {
    api("cuCtxEnablePeerAccess", || {
        let c = current()?;
        let p = lookup(peer)?;
        if flags != 0 {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        if p.device == c.device {
            return refuse(E::CUDA_ERROR_INVALID_DEVICE, || {
                format!("peer access from device {} to itself", c.device)
            });
        }
        if !device::config().is_ok_and(|cfg| cfg.p2p) {
            return refuse(E::CUDA_ERROR_PEER_ACCESS_UNSUPPORTED, || {
                format!("devices {} and {} (CUDA_STUB_P2P=0)", c.device, p.device)
            });
        }
        if !c.inner.lock().unwrap().peers.insert(p.device) {
            return Err(E::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED);
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxDisablePeerAccess(peer: CuCtx) -> CUresult {
    api("cuCtxDisablePeerAccess", || {
        let c = current()?;
        let p = lookup(peer)?;
        if !c.inner.lock().unwrap().peers.remove(&p.device) {
            return Err(E::CUDA_ERROR_PEER_ACCESS_NOT_ENABLED);
        }
        Ok(())
    })
}
