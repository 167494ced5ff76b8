//! Guided self-scheduling: every thread of the current rayon pool claims the next chunk of a
//! range of work units from one shared counter, each claim a share of what is left, so the
//! first claims are long (few stream restarts) and the last ones short (the threads end
//! together).
//!
//! Why not tasks of a fixed size: a batch-1 decode step is ~50 products, most of 1–4 MB, each
//! ending in a join. With fixed 128 KB tasks the thread that finishes first waits up to a
//! task's time for the other at every join, and every task restarts the prefetchers on a new
//! stream. Measured on `mini`'s decode steps (`examples/decode_ceiling`, 2 vCPUs of a Xeon,
//! variants alternating in one process, medians over the rounds): with each product replaced
//! by a plain sum of its bytes, the calls took 0.92-0.94 of the time of 128 KB tasks with
//! guided claims of at least 16 KB (two runs of 8 rounds); the real step with the dense
//! products claimed this way (at least 64 rows) took 0.973 of the step with 64-row tasks (20
//! rounds; 0.959 and 0.988 in two runs of 10 rounds at 8 rows).

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Each claim takes `1 / (CLAIM_DIVISOR · threads)` of the units left.
const CLAIM_DIVISOR: usize = 2;

/// Runs `work` over `0..units` in chunks that the current pool's threads claim as they come
/// free: each claim takes what is left over `2 · threads`, at least `min_chunk` units. Every
/// unit is passed exactly once; the chunks of one thread are not in order. Returns when all
/// are done. On a pool of one thread, or for at most `min_chunk` units, one call on this
/// thread.
pub fn for_each_chunk(units: usize, min_chunk: usize, work: impl Fn(Range<usize>) + Sync) {
    let threads = rayon::current_num_threads();
    let min_chunk = min_chunk.max(1);
    if units == 0 {
        return;
    }
    if threads == 1 || units <= min_chunk {
        work(0..units);
        return;
    }
    let next = AtomicUsize::new(0);
    // Relaxed suffices: a successful exchange gives the claimant its units alone, and the
    // scope's end orders every chunk's writes before the caller's reads.
    let claim_until_done = || {
        let mut start = next.load(Ordering::Relaxed);
        while start < units {
            let chunk = ((units - start) / (CLAIM_DIVISOR * threads)).max(min_chunk);
            let end = (start + chunk).min(units);
            match next.compare_exchange_weak(start, end, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => {
                    work(start..end);
                    start = next.load(Ordering::Relaxed);
                }
                Err(now) => start = now,
            }
        }
    };
    rayon::scope(|scope| {
        for _ in 1..threads {
            scope.spawn(|_| claim_until_done());
        }
        claim_until_done();
    });
}

/// [`for_each_chunk`] over the units of several blocks laid end to end, block `i` holding
/// `lens[i]` units: `work(i, range)` for every block's part of every claim, `range` counted
/// within block `i` (a claim may span blocks; empty parts are skipped).
pub fn for_each_block_chunk(
    lens: &[usize],
    min_chunk: usize,
    work: impl Fn(usize, Range<usize>) + Sync,
) {
    let mut starts = Vec::with_capacity(lens.len());
    let mut units = 0;
    for &n in lens {
        starts.push(units);
        units += n;
    }
    for_each_chunk(units, min_chunk, |claim| {
        // The last block starting at or before the claim (empty blocks share a start).
        let mut i = starts.partition_point(|&s| s <= claim.start) - 1;
        let mut at = claim.start;
        while at < claim.end {
            let (first, last) = (at - starts[i], (claim.end - starts[i]).min(lens[i]));
            if first < last {
                work(i, first..last);
            }
            at = starts[i] + last.max(first);
            i += 1;
        }
    });
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    fn chunks_of(threads: usize, units: usize, min_chunk: usize) -> Vec<Range<usize>> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("a pool");
        let seen = Mutex::new(Vec::new());
        pool.install(|| {
            for_each_chunk(units, min_chunk, |r| {
                seen.lock().expect("unpoisoned").push(r)
            })
        });
        let mut seen = seen.into_inner().expect("unpoisoned");
        seen.sort_by_key(|r| r.start);
        seen
    }

    #[test]
    fn every_unit_is_claimed_once_in_shrinking_chunks_of_at_least_the_minimum() {
        for threads in [1, 2, 3, 8] {
            for (units, min_chunk) in [(0, 4), (1, 4), (5, 4), (1000, 1), (32768, 8), (97, 0)] {
                let chunks = chunks_of(threads, units, min_chunk);
                let mut at = 0;
                for r in &chunks {
                    assert_eq!(
                        r.start, at,
                        "{threads} threads, {units} units: a gap or overlap"
                    );
                    assert!(!r.is_empty());
                    // Only the last chunk may be short of the minimum.
                    assert!(r.len() >= min_chunk.max(1) || r.end == units);
                    at = r.end;
                }
                assert_eq!(
                    at, units,
                    "{threads} threads, {units} units: not all claimed"
                );
                if threads > 1 && units >= 1000 {
                    let (first, last) = (&chunks[0], &chunks[chunks.len() - 1]);
                    assert_eq!(first.len(), units / (CLAIM_DIVISOR * threads));
                    assert!(last.len() < first.len() / 4, "{chunks:?}");
                }
            }
        }
    }

    #[test]
    fn block_chunks_cover_every_unit_of_every_block_once() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .expect("a pool");
        for lens in [
            vec![],
            vec![0, 0],
            vec![5],
            vec![0, 300, 0, 0, 17, 1, 4096, 0],
        ] {
            for min_chunk in [1, 7, 64] {
                let seen = Mutex::new(Vec::new());
                pool.install(|| {
                    for_each_block_chunk(&lens, min_chunk, |i, r| {
                        assert!(!r.is_empty() && r.end <= lens[i], "{lens:?}: {i} {r:?}");
                        seen.lock().expect("unpoisoned").extend(r.map(|u| (i, u)));
                    })
                });
                let mut seen = seen.into_inner().expect("unpoisoned");
                seen.sort_unstable();
                let want: Vec<(usize, usize)> = lens
                    .iter()
                    .enumerate()
                    .flat_map(|(i, &n)| (0..n).map(move |u| (i, u)))
                    .collect();
                assert_eq!(seen, want, "{lens:?}, min {min_chunk}");
            }
        }
    }
}
