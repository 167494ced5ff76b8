//! What a stream runs: launches, copies, memsets, event records, host functions, graphs and
//! stream-ordered frees. The same items make a captured graph.

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::sys::CUresult as E;

use crate::context::Context;
use crate::error::CUresult;
use crate::event::Event;
use crate::memory::{self, Alloc};
use crate::module::Launch;
use crate::stream::HostFn;

/// The source of a copy.
#[derive(Clone)]
pub enum Source {
    /// Device memory or pinned host memory, read when the copy runs.
    Address { ptr: u64, device: bool },
    /// Pageable host memory, staged when the copy was issued (the driver's behaviour for a
    /// host-to-device copy from pageable memory).
    Staged(Arc<Vec<u8>>),
}

#[derive(Clone)]
pub enum Work {
    Launch(Arc<Launch>),
    Copy {
        dst: u64,
        dst_device: bool,
        src: Source,
        len: usize,
    },
    Fill {
        dst: u64,
        value: u32,
        /// Bytes per element: 1, 2 or 4.
        width: usize,
        count: usize,
    },
    Record {
        event: Arc<Event>,
        id: u64,
    },
    Host(HostFn),
    Graph(Arc<Vec<Work>>),
    Free(Arc<Alloc>),
    Nop,
}

/// Time the workers spent running items, by kind (`CUDA_STUB_STATS=1` prints it at exit): on
/// the stand-in the kernels run on the CPU, so a run's wall time less its kernel time
/// approximates what the same run costs beside a GPU.
pub mod stats {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Mutex, OnceLock};
    use std::time::{Duration, Instant};

    static LAUNCHES: AtomicU64 = AtomicU64::new(0);
    static COPIES: AtomicU64 = AtomicU64::new(0);
    static START: OnceLock<Instant> = OnceLock::new();
    /// Items running now, since when some have been, and the time with at least one running:
    /// streams run concurrently, so their items' durations would add up to more than the wall
    /// time they took.
    static BUSY: Mutex<(u32, Option<Instant>, Duration)> = Mutex::new((0, None, Duration::ZERO));

    /// An item starts: `launch` says which counter it adds to.
    pub fn begin(launch: bool) {
        if launch { &LAUNCHES } else { &COPIES }.fetch_add(1, Ordering::Relaxed);
        let mut b = BUSY.lock().unwrap();
        if b.0 == 0 {
            b.1 = Some(Instant::now());
        }
        b.0 += 1;
    }

    pub fn end() {
        let mut b = BUSY.lock().unwrap();
        b.0 -= 1;
        if b.0 == 0
            && let Some(since) = b.1.take()
        {
            b.2 += since.elapsed();
        }
    }

    extern "C" fn print() {
        let busy = BUSY.lock().map(|b| b.2).unwrap_or_default();
        eprintln!(
            "cuda-stub: stats: {} launches and {} copies and memsets, device work running in \
             {:.3} s of {:.3} s since cuInit",
            LAUNCHES.load(Ordering::Relaxed),
            COPIES.load(Ordering::Relaxed),
            busy.as_secs_f64(),
            START.get().map_or(0.0, |t| t.elapsed().as_secs_f64())
        );
    }

    /// At `cuInit`: prints the totals when the process exits, if asked to.
    pub fn start() {
        if START.set(Instant::now()).is_ok()
            && std::env::var_os("CUDA_STUB_STATS").is_some_and(|v| v != "0")
        {
            // SAFETY: registers a plain function with no arguments.
            unsafe { libc::atexit(print) };
        }
    }
}

/// Why an item failed: the code the context keeps, and what to tell.
pub type Failure = (CUresult, String);

fn gone(what: &str, ptr: u64, len: usize) -> Failure {
    (
        E::CUDA_ERROR_ILLEGAL_ADDRESS,
        format!("{what} of {len} B at {ptr:#x}: no longer device memory when it ran"),
    )
}

impl Work {
    /// Runs the item on the stream's worker.
    pub fn run(&self, ctx: &Context) -> Result<(), Failure> {
        match self {
            Work::Launch(l) => l.run(ctx),
            &Work::Copy {
                dst,
                dst_device,
                ref src,
                len,
            } => {
                // Device memory freed meanwhile would fault: checked, so that the worker does
                // not crash the process where the GPU would report an illegal address.
                if dst_device && memory::find(dst, len).is_none() {
                    return Err(gone("copy destination", dst, len));
                }
                match src {
                    Source::Address { ptr, device } => {
                        if *device && memory::find(*ptr, len).is_none() {
                            return Err(gone("copy source", *ptr, len));
                        }
                        // SAFETY: both ranges were checked when issued (device ones again
                        // above); host ones are the caller's contract; `copy` allows overlap.
                        unsafe { std::ptr::copy(*ptr as *const u8, dst as *mut u8, len) }
                    }
                    Source::Staged(bytes) => {
                        // SAFETY: as above; the staged bytes are ours.
                        unsafe {
                            std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst as *mut u8, len)
                        }
                    }
                }
                Ok(())
            }
            &Work::Fill {
                dst,
                value,
                width,
                count,
            } => {
                if memory::find(dst, count * width).is_none() && !memory::is_pinned(dst) {
                    return Err(gone("memset", dst, count * width));
                }
                // SAFETY: the range was checked to be live memory of `count` elements.
                unsafe { fill(dst, value, width, count) };
                Ok(())
            }
            Work::Record { event, id } => {
                event.complete(*id, Instant::now());
                Ok(())
            }
            Work::Host(h) => {
                // SAFETY: the caller's function and data, called as the driver calls them.
                unsafe { (h.f)(h.data as *mut std::ffi::c_void) };
                Ok(())
            }
            Work::Graph(nodes) => {
                for n in nodes.iter() {
                    n.run(ctx)?;
                }
                Ok(())
            }
            Work::Free(a) => {
                memory::release(a);
                Ok(())
            }
            Work::Nop => Ok(()),
        }
    }

    /// The item as a node of a captured graph. An event record inside a capture only orders
    /// the capture's nodes; in the graph it is nothing.
    pub fn as_node(&self) -> Work {
        match self {
            Work::Record { .. } => Work::Nop,
            w => w.clone(),
        }
    }
}

/// Writes `count` elements of `width` bytes, each `value`.
///
/// # Safety
/// `dst` is valid for `count * width` bytes.
unsafe fn fill(dst: u64, value: u32, width: usize, count: usize) {
    // SAFETY: the caller's contract, element by element.
    unsafe {
        match width {
            1 => std::ptr::write_bytes(dst as *mut u8, value as u8, count),
            2 => {
                for i in 0..count {
                    (dst as *mut u16).add(i).write_unaligned(value as u16);
                }
            }
            _ => {
                for i in 0..count {
                    (dst as *mut u32).add(i).write_unaligned(value);
                }
            }
        }
    }
}
