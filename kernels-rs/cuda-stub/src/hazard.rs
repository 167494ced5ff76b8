//! Unordered accesses between streams, found from the order the driver knows, not from timing.
//!
//! Each item a stream runs gets a vector clock when it is issued: its stream's earlier items,
//! the items its explicit waits (events) and implicit ones (the legacy stream against blocking
//! streams) follow, and what a host synchronization has already seen finish (kept for the
//! whole process: a thread may hand work to another after synchronizing). Per allocation the
//! last accesses of each stream are kept; a new item conflicts with another stream's earlier
//! access its clock does not cover, where at least one of the two is the driver's own copy or
//! memset (kernels that touch the same memory from several streams may order themselves on
//! the device, as the all-reduce's flags do, so two kernels are never reported):
//! - a copy's or memset's write against any access;
//! - a copy's read against a write or a kernel;
//! - a kernel against a copy or memset.
//!
//! A kernel's accesses are the allocations its parameters point into (every aligned 8-byte
//! word of its parameters that is a device address). A conflict is a bug that a GPU may or may
//! not show: the process stops with a report (`CUDA_STUB_RACES=warn` only reports).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, OnceLock};

use crate::error::note;
use crate::memory;
use crate::stream::Point;
use crate::work::{Source, Work};

type Clock = HashMap<u64, u64>;

/// How an item touches an allocation.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    DriverWrite,
    DriverRead,
    Kernel,
}

#[derive(Clone, Default)]
struct Last {
    any: (u64, String),
    non_read: (u64, String),
    driver: (u64, String),
}

#[derive(Default)]
struct State {
    /// Per stream, the clocks of its recent items by sequence number.
    history: HashMap<u64, BTreeMap<u64, Arc<Clock>>>,
    /// Per progress counter (a stream's), its stream id.
    streams: HashMap<usize, u64>,
    /// What host synchronizations have seen finish.
    observed: Clock,
    /// Per allocation (its base), per stream, the last accesses.
    accesses: HashMap<u64, HashMap<u64, Last>>,
}

fn state() -> &'static Mutex<State> {
    static S: OnceLock<Mutex<State>> = OnceLock::new();
    S.get_or_init(Default::default)
}

/// How many item clocks a stream keeps: waits name recent items.
const HISTORY: usize = 512;

fn merge(into: &mut Clock, from: &Clock) {
    for (&s, &q) in from {
        let e = into.entry(s).or_insert(0);
        *e = (*e).max(q);
    }
}

fn clock_at(st: &State, stream: u64, seq: u64) -> Option<Arc<Clock>> {
    st.history
        .get(&stream)?
        .range(..=seq)
        .next_back()
        .map(|(_, c)| c.clone())
}

fn key(p: &Point) -> usize {
    Arc::as_ptr(&p.0) as usize
}

/// Registers a stream's progress counter, so that waits on it can be traced to the stream.
pub fn stream_made(stream: u64, progress: &Point) {
    state()
        .lock()
        .unwrap()
        .streams
        .insert(key(progress), stream);
}

/// A host synchronization saw `point` finish.
pub fn observed(point: &Point) {
    let mut st = state().lock().unwrap();
    let Some(&stream) = st.streams.get(&key(point)) else {
        return;
    };
    if let Some(c) = clock_at(&st, stream, point.1) {
        merge(&mut st.observed, &c);
    }
}

/// An allocation is gone: its accesses with it.
pub fn forget(base: u64) {
    state().lock().unwrap().accesses.remove(&base);
}

fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("CUDA_STUB_RACES").as_deref() != Ok("off"))
}

fn stop_on_race() -> bool {
    static STOP: OnceLock<bool> = OnceLock::new();
    *STOP.get_or_init(|| std::env::var("CUDA_STUB_RACES").as_deref() != Ok("warn"))
}

/// The allocations `work` touches and how, with a description of the item.
fn accesses(work: &Work, out: &mut Vec<(u64, Mode, String)>) {
    let mut add = |ptr: u64, len: usize, mode: Mode, what: String| {
        if let Some(a) = memory::find(ptr, len.max(1)) {
            out.push((a.base, mode, what));
        }
    };
    match work {
        Work::Copy { dst, src, len, .. } => {
            add(
                *dst,
                *len,
                Mode::DriverWrite,
                format!("a copy of {len} B to {dst:#x}"),
            );
            if let Source::Address { ptr, device: true } = src {
                add(
                    *ptr,
                    *len,
                    Mode::DriverRead,
                    format!("a copy of {len} B from {ptr:#x}"),
                );
            }
        }
        Work::Fill {
            dst, width, count, ..
        } => add(
            *dst,
            width * count,
            Mode::DriverWrite,
            format!("a memset of {} B at {dst:#x}", width * count),
        ),
        Work::Launch(l) => {
            for ptr in l.pointer_words() {
                add(ptr, 1, Mode::Kernel, format!("kernel {}", l.name()));
            }
        }
        Work::Graph(nodes) => {
            for n in nodes.iter() {
                accesses(n, out);
            }
        }
        Work::Record { .. } | Work::Host(_) | Work::Free(_) | Work::Nop => {}
    }
}

/// Item `seq` of `stream` (`label` names the stream) is issued after `after`: its clock, and
/// the conflicts of its accesses with other streams' earlier ones.
pub fn issue(stream: u64, label: &str, seq: u64, after: &[Point], work: &Work) {
    if !enabled() {
        return;
    }
    let mut mine = Vec::new();
    accesses(work, &mut mine);
    let mut st = state().lock().unwrap();
    let mut clock = st
        .history
        .get(&stream)
        .and_then(|h| h.values().next_back().map(|c| (**c).clone()))
        .unwrap_or_default();
    let observed = st.observed.clone();
    merge(&mut clock, &observed);
    for p in after {
        if let Some(&s) = st.streams.get(&key(p))
            && let Some(c) = clock_at(&st, s, p.1)
        {
            merge(&mut clock, &c);
        }
    }
    clock.insert(stream, seq);
    let mut races = Vec::new();
    for (base, mode, what) in &mine {
        let per_stream = st.accesses.entry(*base).or_default();
        for (&other, last) in per_stream.iter() {
            if other == stream {
                continue;
            }
            let covered = clock.get(&other).copied().unwrap_or(0);
            let (seq_then, then) = match mode {
                Mode::DriverWrite => &last.any,
                Mode::DriverRead => &last.non_read,
                Mode::Kernel => &last.driver,
            };
            if *seq_then > covered {
                races.push(format!(
                    "{what} on stream {stream} ({label}, item {seq}) and {then} on stream \
                     {other} (item {seq_then}) touch allocation {base:#x} with nothing ordering \
                     them (stream order, an event wait, or a host synchronization)"
                ));
            }
        }
        let last = per_stream.entry(stream).or_default();
        let entry = (seq, what.clone());
        last.any = entry.clone();
        if *mode != Mode::DriverRead {
            last.non_read = entry.clone();
        }
        if *mode != Mode::Kernel {
            last.driver = entry;
        }
    }
    let history = st.history.entry(stream).or_default();
    history.insert(seq, Arc::new(clock));
    while history.len() > HISTORY {
        history.pop_first();
    }
    drop(st);
    for r in &races {
        note(|| format!("RACE: {r}"));
    }
    if !races.is_empty() && stop_on_race() {
        eprintln!(
            "cuda-stub: stopping on an unordered access (a GPU may or may not show it); \
             CUDA_STUB_RACES=warn only reports"
        );
        std::process::abort();
    }
}
