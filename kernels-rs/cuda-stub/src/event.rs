//! Events: a record is an item of its stream that takes a timestamp when the stream reaches it;
//! queries, waits and elapsed times follow the last record. An event last recorded in a
//! capturing stream belongs to the capture (see [`crate::capture`]).

use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use cudarc::driver::sys::CUresult as E;

use crate::capture::Capture;
use crate::context;
use crate::error::{CUresult, R, api, put, refuse};
use crate::handles::Registry;
use crate::stream::{self, Point, Submitted};
use crate::work::Work;

/// `CU_EVENT_DISABLE_TIMING`.
const DISABLE_TIMING: u32 = 2;
const FLAGS: u32 = 0x1 | DISABLE_TIMING | 0x4;

pub struct Event {
    pub ctx: u64,
    flags: u32,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// The last record: which item of which stream, and its number.
    recorded: Option<(Point, u64)>,
    /// When the last record ran, for that record's number.
    time: Option<(u64, Instant)>,
    /// Set when last recorded in a capture: the capture, the stream and how many nodes that
    /// stream had recorded then.
    captured: Option<(Arc<Capture>, u64, usize)>,
}

static NEXT_RECORD: AtomicU64 = AtomicU64::new(1);

fn registry() -> &'static Registry<Event> {
    static EVENTS: OnceLock<Registry<Event>> = OnceLock::new();
    EVENTS.get_or_init(Registry::default)
}

pub fn forget_context(ctx: u64) {
    registry().remove_where(|e| e.ctx == ctx);
}

pub fn lookup(handle: *mut c_void) -> R<Arc<Event>> {
    crate::initialized()?;
    registry().get(handle).ok_or(E::CUDA_ERROR_INVALID_HANDLE)
}

impl Event {
    /// The worker reached record `id`.
    pub fn complete(&self, id: u64, at: Instant) {
        let mut st = self.state.lock().unwrap();
        if st.recorded.as_ref().is_some_and(|(_, r)| *r == id) {
            st.time = Some((id, at));
        }
    }

    /// Where a wait on this event must wait: the last record, or nothing (never recorded).
    pub fn point(&self) -> Option<Point> {
        self.state
            .lock()
            .unwrap()
            .recorded
            .as_ref()
            .map(|(p, _)| p.clone())
    }

    /// The capture the event was last recorded in, with the stream and its node count then.
    pub fn captured(&self) -> Option<(Arc<Capture>, u64, usize)> {
        self.state.lock().unwrap().captured.clone()
    }

    fn refuse_if_captured(&self, what: &str) -> R {
        if self.captured().is_some() {
            return refuse(E::CUDA_ERROR_CAPTURED_EVENT, || {
                format!("{what} on an event last recorded in a capturing stream")
            });
        }
        Ok(())
    }

    fn done(&self) -> bool {
        self.point().is_none_or(|(p, seq)| p.reached(seq))
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventCreate(out: *mut *mut c_void, flags: u32) -> CUresult {
    api("cuEventCreate", || {
        let ctx = context::current()?;
        if flags & !FLAGS != 0 {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        let ev = Arc::new(Event {
            ctx: ctx.id,
            flags,
            state: Mutex::new(State::default()),
        });
        // SAFETY: the caller's out-pointer.
        unsafe { put(out, registry().insert(ev)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventDestroy_v2(event: *mut c_void) -> CUresult {
    api("cuEventDestroy_v2", || {
        crate::initialized()?;
        registry()
            .remove(event)
            .map(|_| ())
            .ok_or(E::CUDA_ERROR_INVALID_HANDLE)
    })
}

fn record(event: *mut c_void, stream: *mut c_void) -> R {
    let ev = lookup(event)?;
    let s = stream::resolve_for_work(stream)?;
    if ev.ctx != s.ctx.id {
        return Err(E::CUDA_ERROR_INVALID_HANDLE);
    }
    let id = NEXT_RECORD.fetch_add(1, Ordering::Relaxed);
    let work = Work::Record {
        event: ev.clone(),
        id,
    };
    // Held while the item is queued: the worker, which may reach it at once, waits to see it.
    let mut st = ev.state.lock().unwrap();
    let capture = s.capture.lock().unwrap().clone();
    match capture {
        Some(c) => {
            let nodes = c.record_event(&s)?;
            st.captured = Some((c, s.id, nodes));
            st.recorded = None;
        }
        None => {
            st.captured = None;
            st.time = None;
            match stream::submit(&s, work, Vec::new()) {
                Ok(Submitted::Queued(point)) => st.recorded = Some((point, id)),
                Ok(Submitted::Captured) => unreachable!("the stream was not capturing"),
                Err(e) => {
                    st.recorded = None;
                    return Err(e);
                }
            }
        }
    }
    Ok(())
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventRecord(event: *mut c_void, stream: *mut c_void) -> CUresult {
    api("cuEventRecord", || record(event, stream))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventRecordWithFlags(
    event: *mut c_void,
    stream: *mut c_void,
    flags: u32,
) -> CUresult {
    api("cuEventRecordWithFlags", || {
        if flags > 1 {
            return Err(E::CUDA_ERROR_INVALID_VALUE);
        }
        record(event, stream)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventQuery(event: *mut c_void) -> CUresult {
    api("cuEventQuery", || {
        let ev = lookup(event)?;
        ev.refuse_if_captured("cuEventQuery")?;
        if ev.done() {
            if let Some(p) = ev.point() {
                crate::hazard::observed(&p);
            }
            Ok(())
        } else {
            Err(E::CUDA_ERROR_NOT_READY)
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventSynchronize(event: *mut c_void) -> CUresult {
    api("cuEventSynchronize", || {
        let ev = lookup(event)?;
        ev.refuse_if_captured("cuEventSynchronize")?;
        if let Some(point) = ev.point() {
            point.0.wait(point.1);
            crate::hazard::observed(&point);
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventElapsedTime_v2(
    ms: *mut f32,
    start: *mut c_void,
    end: *mut c_void,
) -> CUresult {
    api("cuEventElapsedTime_v2", || {
        let (a, b) = (lookup(start)?, lookup(end)?);
        a.refuse_if_captured("cuEventElapsedTime")?;
        b.refuse_if_captured("cuEventElapsedTime")?;
        if (a.flags | b.flags) & DISABLE_TIMING != 0 {
            return Err(E::CUDA_ERROR_INVALID_HANDLE);
        }
        let time = |e: &Event| -> R<Option<Instant>> {
            let st = e.state.lock().unwrap();
            let Some((_, id)) = &st.recorded else {
                // Never recorded.
                return Err(E::CUDA_ERROR_INVALID_HANDLE);
            };
            Ok(st.time.filter(|(t, _)| t == id).map(|(_, at)| at))
        };
        match (time(&a)?, time(&b)?) {
            (Some(t0), Some(t1)) => {
                let v = if t1 >= t0 {
                    (t1 - t0).as_secs_f64() * 1e3
                } else {
                    -((t0 - t1).as_secs_f64() * 1e3)
                };
                // SAFETY: the caller's out-pointer.
                unsafe { put(ms, v as f32) }
            }
            _ => Err(E::CUDA_ERROR_NOT_READY),
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventElapsedTime(
    ms: *mut f32,
    start: *mut c_void,
    end: *mut c_void,
) -> CUresult {
    // SAFETY: same contract.
    unsafe { cuEventElapsedTime_v2(ms, start, end) }
}
