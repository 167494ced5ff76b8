//! Stream capture with the driver's rules:
//! - capture may not begin on the legacy stream (`CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`);
//! - while a capture in GLOBAL mode runs (in any thread) or one not in RELAXED mode runs in the
//!   calling thread, "potentially unsafe" calls — `cuMemAlloc`, `cuMemFree`, synchronous copies
//!   and memsets — are refused with `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` and invalidate the
//!   capture; the calling thread's own mode (`cuThreadExchangeStreamCaptureMode`) decides
//!   whether other threads' GLOBAL captures count;
//! - synchronizing a capturing stream, or the context, is refused and invalidates the capture;
//! - the legacy stream cannot be used while a blocking stream of its context captures
//!   (`CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`);
//! - other streams join a capture by waiting on an event recorded in it, and must be joined
//!   back before it ends (`CUDA_ERROR_STREAM_CAPTURE_UNJOINED`); a capture ends on its origin
//!   stream (`..._UNMATCHED`), from its thread unless RELAXED (`..._WRONG_THREAD`).
//!
//! The graph exports are in [`crate::graph`].

use std::cell::Cell;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::thread::ThreadId;

use cudarc::driver::sys::CUresult as E;

use crate::context::Context;
use crate::error::{CUresult, R, api, put, refuse};
use crate::event::Event;
use crate::graph::Graph;
use crate::stream::{self, Stream, StreamKind};
use crate::work::Work;

pub const MODE_GLOBAL: u32 = 0;
pub const MODE_THREAD_LOCAL: u32 = 1;
pub const MODE_RELAXED: u32 = 2;

pub struct Capture {
    pub id: u64,
    pub mode: u32,
    pub thread: ThreadId,
    pub origin: u64,
    pub ctx: u64,
    state: Mutex<State>,
}

struct Member {
    stream: Weak<Stream>,
    id: u64,
    /// Nodes this stream added.
    nodes: usize,
    /// How many of them another member of the capture has waited for.
    joined: usize,
}

struct State {
    nodes: Vec<Work>,
    invalid: bool,
    members: Vec<Member>,
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);
/// Captures under way in this process.
static ACTIVE: Mutex<Vec<Arc<Capture>>> = Mutex::new(Vec::new());

thread_local! {
    static THREAD_MODE: Cell<u32> = const { Cell::new(MODE_GLOBAL) };
}

fn mode_name(mode: u32) -> &'static str {
    match mode {
        MODE_GLOBAL => "GLOBAL",
        MODE_THREAD_LOCAL => "THREAD_LOCAL",
        _ => "RELAXED",
    }
}

impl Capture {
    fn member<'a>(st: &'a mut State, stream: &Arc<Stream>) -> &'a mut Member {
        if let Some(i) = st.members.iter().position(|m| m.id == stream.id) {
            return &mut st.members[i];
        }
        st.members.push(Member {
            stream: Arc::downgrade(stream),
            id: stream.id,
            nodes: 0,
            joined: 0,
        });
        st.members.last_mut().unwrap()
    }

    /// Adds `work` issued on member `stream` to the graph.
    pub fn record(&self, stream: &Arc<Stream>, work: Work) -> R {
        let mut st = self.state.lock().unwrap();
        if st.invalid {
            return Err(E::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
        }
        st.nodes.push(work.as_node());
        Self::member(&mut st, stream).nodes += 1;
        Ok(())
    }

    /// An event recorded in member `stream`: how many nodes the stream has added so far.
    pub fn record_event(&self, stream: &Arc<Stream>) -> R<usize> {
        let mut st = self.state.lock().unwrap();
        if st.invalid {
            return Err(E::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
        }
        Ok(Self::member(&mut st, stream).nodes)
    }

    pub fn invalidate(&self) {
        self.state.lock().unwrap().invalid = true;
    }

    pub fn is_invalid(&self) -> bool {
        self.state.lock().unwrap().invalid
    }
}

fn active() -> Vec<Arc<Capture>> {
    ACTIVE.lock().unwrap().clone()
}

/// Refuses a potentially unsafe call (see the module documentation), invalidating the
/// captures that forbid it.
pub fn refuse_unsafe_call(what: &str) -> R {
    let mode = THREAD_MODE.with(Cell::get);
    if mode == MODE_RELAXED {
        return Ok(());
    }
    let me = std::thread::current().id();
    let forbidding: Vec<Arc<Capture>> = active()
        .into_iter()
        .filter(|c| {
            (c.thread == me && c.mode != MODE_RELAXED)
                || (mode == MODE_GLOBAL && c.thread != me && c.mode == MODE_GLOBAL)
        })
        .collect();
    let Some(first) = forbidding.first() else {
        return Ok(());
    };
    for c in &forbidding {
        c.invalidate();
    }
    refuse(E::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, || {
        format!(
            "{what} while stream {} captures in {} mode{} (the capture is invalidated)",
            first.origin,
            mode_name(first.mode),
            if first.thread == me {
                " on this thread"
            } else {
                " on another thread"
            }
        )
    })
}

/// The legacy stream is unusable while a blocking stream of `ctx` captures; `invalidate`
/// for work (which would depend on the capture), not for a query.
pub fn refuse_legacy_use(ctx: &Context, invalidate: bool) -> R {
    let capturing: Vec<Arc<Capture>> = ctx
        .streams()
        .iter()
        .filter(|s| s.is_blocking())
        .filter_map(|s| s.capture.lock().unwrap().clone())
        .collect();
    if let Some(c) = capturing.first() {
        if invalidate {
            for c in &capturing {
                c.invalidate();
            }
        }
        return refuse(E::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, || {
            format!(
                "the legacy stream is used while blocking stream {} captures",
                c.origin
            )
        });
    }
    Ok(())
}

/// Synchronizing (or querying) a capturing stream is refused and invalidates its capture.
pub fn refuse_sync_of(s: &Arc<Stream>, what: &str) -> R {
    if let Some(c) = s.capture.lock().unwrap().clone() {
        c.invalidate();
        return refuse(E::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, || {
            format!("{what} of stream {} while it captures", s.id)
        });
    }
    if s.kind == StreamKind::Legacy {
        refuse_legacy_use(&s.ctx, true)?;
    }
    Ok(())
}

/// A context synchronization waits for every stream: refused while any of them captures.
pub fn refuse_context_sync(ctx: &Context) -> R {
    let caps: Vec<Arc<Capture>> = active().into_iter().filter(|c| c.ctx == ctx.id).collect();
    if let Some(c) = caps.first() {
        for c in &caps {
            c.invalidate();
        }
        return refuse(E::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, || {
            format!("cuCtxSynchronize while stream {} captures", c.origin)
        });
    }
    Ok(())
}

/// Invalidates the capture `s` takes part in (a refused item on it).
pub fn invalidate_stream_capture(s: &Stream) {
    if let Some(c) = s.capture.lock().unwrap().as_ref() {
        c.invalidate();
    }
}

/// `cuStreamWaitEvent`: an ordering on queued work, or inside a capture an edge (joining the
/// stream to the event's capture if it was not in it).
pub fn wait_event(s: &Arc<Stream>, ev: &Arc<Event>) -> R {
    let mine = s.capture.lock().unwrap().clone();
    match (ev.captured(), mine) {
        (Some((cap, _, _)), _) if !ACTIVE.lock().unwrap().iter().any(|c| Arc::ptr_eq(c, &cap)) => {
            refuse(E::CUDA_ERROR_CAPTURED_EVENT, || {
                "waiting on an event recorded in a capture that has ended".into()
            })
        }
        (Some((cap, from, count)), mine) => {
            if let Some(m) = &mine
                && !Arc::ptr_eq(m, &cap)
            {
                m.invalidate();
                return refuse(E::CUDA_ERROR_STREAM_CAPTURE_MERGE, || {
                    format!("stream {} waits on an event of another capture", s.id)
                });
            }
            let mut st = cap.state.lock().unwrap();
            if st.invalid {
                return Err(E::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
            }
            if let Some(m) = st.members.iter_mut().find(|m| m.id == from) {
                m.joined = m.joined.max(count);
            }
            Capture::member(&mut st, s);
            drop(st);
            *s.capture.lock().unwrap() = Some(cap);
            Ok(())
        }
        (None, Some(m)) => {
            m.invalidate();
            refuse(E::CUDA_ERROR_STREAM_CAPTURE_ISOLATION, || {
                format!(
                    "capturing stream {} waits on an event recorded outside the capture",
                    s.id
                )
            })
        }
        (None, None) => {
            let after = ev.point().into_iter().collect();
            stream::submit(s, Work::Nop, after).map(|_| ())
        }
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamBeginCapture_v2(stream: *mut c_void, mode: u32) -> CUresult {
    api("cuStreamBeginCapture_v2", || {
        let s = stream::resolve_for_work(stream)?;
        if s.kind == StreamKind::Legacy {
            return refuse(E::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, || {
                "capture may not be initiated on the legacy (NULL) stream: capture on a \
                 created stream"
                    .into()
            });
        }
        if mode > MODE_RELAXED {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        let mut slot = s.capture.lock().unwrap();
        if slot.is_some() {
            return refuse(E::CUDA_ERROR_ILLEGAL_STATE, || {
                format!("stream {} is already capturing", s.id)
            });
        }
        let cap = Arc::new(Capture {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            mode,
            thread: std::thread::current().id(),
            origin: s.id,
            ctx: s.ctx.id,
            state: Mutex::new(State {
                nodes: Vec::new(),
                invalid: false,
                members: vec![Member {
                    stream: Arc::downgrade(&s),
                    id: s.id,
                    nodes: 0,
                    joined: 0,
                }],
            }),
        });
        *slot = Some(cap.clone());
        ACTIVE.lock().unwrap().push(cap);
        Ok(())
    })
}

fn end(s: &Arc<Stream>) -> R<Graph> {
    let cap = s.capture.lock().unwrap().clone().ok_or_else(|| {
        crate::error::note(|| format!("cuStreamEndCapture: stream {} is not capturing", s.id));
        E::CUDA_ERROR_ILLEGAL_STATE
    })?;
    if cap.origin != s.id {
        cap.invalidate();
        return refuse(E::CUDA_ERROR_STREAM_CAPTURE_UNMATCHED, || {
            format!(
                "stream {} ends a capture that began on stream {}",
                s.id, cap.origin
            )
        });
    }
    if cap.mode != MODE_RELAXED && cap.thread != std::thread::current().id() {
        return refuse(E::CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD, || {
            format!(
                "a {} capture ended from another thread than the one that began it",
                mode_name(cap.mode)
            )
        });
    }
    ACTIVE.lock().unwrap().retain(|c| !Arc::ptr_eq(c, &cap));
    let st = std::mem::replace(
        &mut *cap.state.lock().unwrap(),
        State {
            nodes: Vec::new(),
            invalid: true,
            members: Vec::new(),
        },
    );
    for m in &st.members {
        if let Some(ms) = m.stream.upgrade() {
            *ms.capture.lock().unwrap() = None;
        }
    }
    if st.invalid {
        return refuse(E::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, || {
            format!(
                "the capture of stream {} was invalidated by an earlier error",
                s.id
            )
        });
    }
    if let Some(m) = st
        .members
        .iter()
        .find(|m| m.id != s.id && m.nodes > m.joined)
    {
        return refuse(E::CUDA_ERROR_STREAM_CAPTURE_UNJOINED, || {
            format!(
                "stream {} joined the capture and has work the origin stream never waited for",
                m.id
            )
        });
    }
    Ok(Graph::new(s.ctx.clone(), st.nodes))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamEndCapture(
    stream: *mut c_void,
    out: *mut *mut c_void,
) -> CUresult {
    api("cuStreamEndCapture", || {
        let s = stream::resolve_for_work(stream)?;
        if out.is_null() {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        match end(&s) {
            Ok(g) => {
                // SAFETY: checked non-null.
                unsafe { put(out, crate::graph::register(g)) }
            }
            Err(e) => {
                if e != E::CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD {
                    // SAFETY: checked non-null.
                    unsafe { put(out, std::ptr::null_mut())? };
                }
                Err(e)
            }
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamIsCapturing(stream: *mut c_void, out: *mut u32) -> CUresult {
    api("cuStreamIsCapturing", || {
        let s = stream::resolve(stream)?;
        if s.kind == StreamKind::Legacy {
            refuse_legacy_use(&s.ctx, false)?;
        }
        let status = match s.capture.lock().unwrap().as_ref() {
            None => 0,
            Some(c) if c.is_invalid() => 2,
            Some(_) => 1,
        };
        // SAFETY: the caller's out-pointer.
        unsafe { put(out, status) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuThreadExchangeStreamCaptureMode(mode: *mut u32) -> CUresult {
    api("cuThreadExchangeStreamCaptureMode", || {
        if mode.is_null() {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: non-null in/out parameter of the caller.
        let want = unsafe { *mode };
        if want > MODE_RELAXED {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        let old = THREAD_MODE.with(|m| m.replace(want));
        // SAFETY: as above.
        unsafe { put(mode, old) }
    })
}
