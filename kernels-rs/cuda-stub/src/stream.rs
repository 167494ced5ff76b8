//! Streams: a worker thread per stream runs its work in issue order, as the GPU runs a stream;
//! different streams run concurrently. The legacy (NULL) stream waits for the blocking streams'
//! earlier work and they for its, non-blocking streams order with neither. The `cuStream*`
//! exports other than capture (see [`crate::capture`]).

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Condvar, Mutex, OnceLock};

use cudarc::driver::sys::CUresult as E;

use crate::capture::Capture;
use crate::context::{self, Context};
use crate::error::{CUresult, R, api, note, put, refuse};
use crate::handles::Registry;
use crate::work::Work;

/// How far a stream's work has run: the sequence number of its last finished item.
#[derive(Default)]
pub struct Progress {
    done: Mutex<u64>,
    cv: Condvar,
}

impl Progress {
    pub fn wait(&self, seq: u64) {
        let mut done = self.done.lock().unwrap();
        while *done < seq {
            done = self.cv.wait(done).unwrap();
        }
    }

    pub fn reached(&self, seq: u64) -> bool {
        *self.done.lock().unwrap() >= seq
    }

    fn finish(&self, seq: u64) {
        *self.done.lock().unwrap() = seq;
        self.cv.notify_all();
    }
}

/// A point in a stream's work: done once `progress` reaches `seq`.
pub type Point = (Arc<Progress>, u64);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamKind {
    /// The NULL stream (`CU_STREAM_LEGACY`).
    Legacy,
    /// `CU_STREAM_PER_THREAD`: a blocking stream per thread.
    PerThread,
    /// Created without `CU_STREAM_NON_BLOCKING`: ordered with the legacy stream.
    Blocking,
    NonBlocking,
}

/// `CU_STREAM_NON_BLOCKING`.
pub const NON_BLOCKING: u32 = 1;
/// The special handles `CU_STREAM_LEGACY` and `CU_STREAM_PER_THREAD`.
const LEGACY_HANDLE: usize = 1;
const PER_THREAD_HANDLE: usize = 2;

struct Queue {
    tx: Option<Sender<Item>>,
    submitted: u64,
}

struct Item {
    seq: u64,
    after: Vec<Point>,
    work: Work,
}

pub struct Stream {
    pub id: u64,
    pub ctx: Arc<Context>,
    pub kind: StreamKind,
    pub priority: i32,
    queue: Mutex<Queue>,
    pub progress: Arc<Progress>,
    /// The capture this stream takes part in, if any.
    pub capture: Mutex<Option<Arc<Capture>>>,
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn registry() -> &'static Registry<Stream> {
    static STREAMS: OnceLock<Registry<Stream>> = OnceLock::new();
    STREAMS.get_or_init(Registry::default)
}

thread_local! {
    static PER_THREAD: RefCell<HashMap<u64, Arc<Stream>>> = RefCell::new(HashMap::new());
}

/// Pending work of `ctx`'s streams stops, with their workers, when the context goes.
pub fn forget_context(ctx: u64) {
    registry().remove_where(|s| s.ctx.id == ctx);
}

impl Stream {
    pub fn new(ctx: Arc<Context>, kind: StreamKind, priority: i32) -> Arc<Self> {
        let (tx, rx) = channel::<Item>();
        let progress = Arc::new(Progress::default());
        let stream = Arc::new(Self {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            ctx: ctx.clone(),
            kind,
            priority,
            queue: Mutex::new(Queue {
                tx: Some(tx),
                submitted: 0,
            }),
            progress: progress.clone(),
            capture: Mutex::new(None),
        });
        crate::hazard::stream_made(stream.id, &(stream.progress.clone(), 0));
        let name = format!("cuda-stub s{}", stream.id);
        std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                for item in rx {
                    for (p, seq) in &item.after {
                        p.wait(*seq);
                    }
                    let counted = match &item.work {
                        Work::Launch(_) | Work::Graph(_) => Some(true),
                        Work::Copy { .. } | Work::Fill { .. } => Some(false),
                        _ => None,
                    };
                    if let Some(launch) = counted {
                        crate::work::stats::begin(launch);
                    }
                    if ctx.sticky().is_none()
                        && let Err((code, why)) = item.work.run(&ctx)
                    {
                        // Always told: the host layer's account of a fault is the only one.
                        eprintln!("cuda-stub: {}: {why}", crate::error::name(code));
                        ctx.set_sticky(code);
                    }
                    if counted.is_some() {
                        crate::work::stats::end();
                    }
                    progress.finish(item.seq);
                }
            })
            .expect("spawn a stream worker");
        stream
    }

    pub fn is_blocking(&self) -> bool {
        matches!(self.kind, StreamKind::Blocking | StreamKind::PerThread)
    }

    /// The point the stream's work issued so far reaches.
    pub fn tail(&self) -> Point {
        (self.progress.clone(), self.queue.lock().unwrap().submitted)
    }

    /// Queues `work` after the stream's earlier work, and after `after`; the legacy stream and
    /// the blocking streams also wait for each other's earlier work. Work on a capturing
    /// stream goes into its graph instead (see [`submit`]).
    fn enqueue(&self, work: Work, mut after: Vec<Point>) -> R<Point> {
        match self.kind {
            StreamKind::Legacy => {
                for s in self.ctx.streams() {
                    if s.is_blocking() {
                        after.push(s.tail());
                    }
                }
            }
            StreamKind::Blocking | StreamKind::PerThread => {
                after.push(self.ctx.legacy().tail());
            }
            StreamKind::NonBlocking => {}
        }
        let mut q = self.queue.lock().unwrap();
        let tx = q.tx.as_ref().ok_or(E::CUDA_ERROR_INVALID_HANDLE)?.clone();
        q.submitted += 1;
        let seq = q.submitted;
        crate::hazard::issue(self.id, self.label(), seq, &after, &work);
        tx.send(Item { seq, after, work })
            .map_err(|_| E::CUDA_ERROR_INVALID_HANDLE)?;
        Ok((self.progress.clone(), seq))
    }

    /// Waits for the work issued so far (a host synchronization).
    pub fn wait_idle(&self) {
        let tail = self.tail();
        tail.0.wait(tail.1);
        crate::hazard::observed(&tail);
    }

    fn label(&self) -> &'static str {
        match self.kind {
            StreamKind::Legacy => "the legacy stream",
            StreamKind::PerThread => "a per-thread stream",
            StreamKind::Blocking => "a blocking stream",
            StreamKind::NonBlocking => "a non-blocking stream",
        }
    }
}

/// Where a submitted piece of work went.
pub enum Submitted {
    /// Queued: runs when the point is reached.
    Queued(Point),
    /// Recorded into the stream's capture.
    Captured,
}

/// Issues `work` on `stream`: into its capture if it is capturing, else queued. The legacy
/// stream is unusable while a blocking stream of its context captures: the work would depend
/// on the capture (`CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`, and the capture is invalidated).
pub fn submit(stream: &Arc<Stream>, work: Work, after: Vec<Point>) -> R<Submitted> {
    stream.ctx.usable()?;
    let capture = stream.capture.lock().unwrap().clone();
    if let Some(c) = capture {
        c.record(stream, work)?;
        return Ok(Submitted::Captured);
    }
    if stream.kind == StreamKind::Legacy {
        crate::capture::refuse_legacy_use(&stream.ctx, true)?;
    }
    Ok(Submitted::Queued(stream.enqueue(work, after)?))
}

/// Issues `work` and waits until it has run (a copy the host must see finished).
pub fn submit_and_wait(stream: &Arc<Stream>, work: Work) -> R {
    if let Submitted::Queued(point) = submit(stream, work, Vec::new())? {
        point.0.wait(point.1);
        crate::hazard::observed(&point);
    }
    stream.ctx.sticky().map_or(Ok(()), Err)
}

/// The stream behind a `CUstream` handle: NULL and `CU_STREAM_LEGACY` are the current
/// context's legacy stream, `CU_STREAM_PER_THREAD` this thread's.
pub fn resolve(handle: *mut c_void) -> R<Arc<Stream>> {
    match handle as usize {
        0 | LEGACY_HANDLE => Ok(context::current()?.legacy()),
        PER_THREAD_HANDLE => {
            let ctx = context::current()?;
            Ok(PER_THREAD.with(|m| {
                m.borrow_mut()
                    .entry(ctx.id)
                    .or_insert_with(|| {
                        let s = Stream::new(ctx.clone(), StreamKind::PerThread, 0);
                        ctx.add_stream(&s);
                        s
                    })
                    .clone()
            }))
        }
        _ => {
            crate::initialized()?;
            let s = registry().get(handle).ok_or_else(|| {
                note(|| format!("stream handle {handle:?} is not a live stream"));
                E::CUDA_ERROR_INVALID_HANDLE
            })?;
            s.ctx.usable()?;
            Ok(s)
        }
    }
}

/// Like [`resolve`], for calls that issue work: the stream must belong to the current context,
/// which the calling thread must have (the driver checks both).
pub fn resolve_for_work(handle: *mut c_void) -> R<Arc<Stream>> {
    let ctx = context::current()?;
    let s = resolve(handle)?;
    if s.ctx.id != ctx.id {
        return refuse(E::CUDA_ERROR_INVALID_HANDLE, || {
            format!(
                "stream {} belongs to a context of device {}, the current one is device {}'s",
                s.id, s.ctx.device, ctx.device
            )
        });
    }
    Ok(s)
}

fn create(out: *mut *mut c_void, flags: u32, priority: c_int) -> R {
    let ctx = context::current()?;
    if flags & !NON_BLOCKING != 0 {
        return Err(E::CUDA_ERROR_INVALID_VALUE);
    }
    let kind = if flags & NON_BLOCKING != 0 {
        StreamKind::NonBlocking
    } else {
        StreamKind::Blocking
    };
    let s = Stream::new(ctx.clone(), kind, priority.clamp(-5, 0));
    ctx.add_stream(&s);
    let h = registry().insert(s);
    // SAFETY: the caller's out-pointer.
    unsafe { put(out, h) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamCreate(out: *mut *mut c_void, flags: u32) -> CUresult {
    api("cuStreamCreate", || create(out, flags, 0))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamCreateWithPriority(
    out: *mut *mut c_void,
    flags: u32,
    priority: c_int,
) -> CUresult {
    api("cuStreamCreateWithPriority", || {
        create(out, flags, priority)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamDestroy_v2(stream: *mut c_void) -> CUresult {
    api("cuStreamDestroy_v2", || {
        crate::initialized()?;
        let s = registry()
            .remove(stream)
            .ok_or(E::CUDA_ERROR_INVALID_HANDLE)?;
        // The driver releases the stream once its work is done; the worker ends with its queue.
        s.queue.lock().unwrap().tx = None;
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamSynchronize(stream: *mut c_void) -> CUresult {
    api("cuStreamSynchronize", || {
        let s = resolve(stream)?;
        crate::capture::refuse_sync_of(&s, "cuStreamSynchronize")?;
        if s.kind == StreamKind::Legacy {
            // Waiting for the legacy stream waits for the blocking streams' earlier work too.
            submit_and_wait(&s, Work::Nop)
        } else {
            s.wait_idle();
            s.ctx.sticky().map_or(Ok(()), Err)
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamQuery(stream: *mut c_void) -> CUresult {
    api("cuStreamQuery", || {
        let s = resolve(stream)?;
        crate::capture::refuse_sync_of(&s, "cuStreamQuery")?;
        let tail = s.tail();
        if let Some(code) = s.ctx.sticky() {
            return Err(code);
        }
        if tail.0.reached(tail.1) {
            crate::hazard::observed(&tail);
            Ok(())
        } else {
            Err(E::CUDA_ERROR_NOT_READY)
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamWaitEvent(
    stream: *mut c_void,
    event: *mut c_void,
    flags: u32,
) -> CUresult {
    api("cuStreamWaitEvent", || {
        let s = resolve_for_work(stream)?;
        let ev = crate::event::lookup(event)?;
        if flags > 1 {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        crate::capture::wait_event(&s, &ev)
    })
}

/// A host function queued on a stream (`cuLaunchHostFunc`).
#[derive(Clone, Copy)]
pub struct HostFn {
    pub f: unsafe extern "C" fn(*mut c_void),
    pub data: usize,
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchHostFunc(
    stream: *mut c_void,
    f: Option<unsafe extern "C" fn(*mut c_void)>,
    data: *mut c_void,
) -> CUresult {
    api("cuLaunchHostFunc", || {
        let s = resolve_for_work(stream)?;
        let f = f.ok_or(E::CUDA_ERROR_INVALID_VALUE)?;
        submit(
            &s,
            Work::Host(HostFn {
                f,
                data: data as usize,
            }),
            Vec::new(),
        )?;
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamGetCtx(stream: *mut c_void, out: *mut *mut c_void) -> CUresult {
    api("cuStreamGetCtx", || {
        let s = resolve(stream)?;
        // SAFETY: the caller's out-pointer.
        unsafe { put(out, crate::handles::handle_of(&s.ctx)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamGetFlags(stream: *mut c_void, out: *mut u32) -> CUresult {
    api("cuStreamGetFlags", || {
        let s = resolve(stream)?;
        let f = u32::from(s.kind == StreamKind::NonBlocking) * NON_BLOCKING;
        // SAFETY: the caller's out-pointer.
        unsafe { put(out, f) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamGetPriority(stream: *mut c_void, out: *mut c_int) -> CUresult {
    api("cuStreamGetPriority", || {
        let s = resolve(stream)?;
        // SAFETY: the caller's out-pointer.
        unsafe { put(out, s.priority) }
    })
}
