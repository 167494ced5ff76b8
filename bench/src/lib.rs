//! What every benchmark here shares: best-of timing with the CPU time the threads actually got,
//! the machine's copy and read bandwidth measured in the same run, and the facts a result file
//! records (CPU, load, date).

pub mod cpu_tactics;
pub mod cpu_tune;
pub mod gpu_timing;
pub mod sweep;

use std::hint::black_box;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use rayon::prelude::*;

/// Bytes of each copy buffer of the bandwidth measurement: far beyond any LLC.
pub const COPY_BYTES: usize = 512 << 20;

/// Wall time of a run and the CPU time this process's threads got during it; `median_wall`
/// is the median over the passes, the others belong to the fastest pass.
#[derive(Clone, Copy, Debug, PartialEq, PartialOrd)]
pub struct Timing {
    pub wall: f64,
    pub cpu: f64,
    pub median_wall: f64,
}

impl Timing {
    /// Fraction of the rayon threads' wall time they actually ran: below 1 when other
    /// processes compete for the cores (or threads wait on each other).
    pub fn utilization(&self) -> f64 {
        self.cpu / (self.wall * rayon::current_num_threads() as f64)
    }
}

/// The fastest of `passes` runs after one warm-up run (best-of, like the copy bandwidth: on a
/// shared machine the fastest pass is the one least disturbed), with the median wall time.
pub fn time_passes(passes: usize, mut f: impl FnMut()) -> Timing {
    f();
    let mut times: Vec<Timing> = (0..passes.max(1))
        .map(|_| {
            let cpu = process_cpu_seconds();
            let start = Instant::now();
            f();
            Timing {
                wall: start.elapsed().as_secs_f64(),
                cpu: process_cpu_seconds() - cpu,
                median_wall: 0.0,
            }
        })
        .collect();
    times.sort_by(|a, b| a.wall.total_cmp(&b.wall));
    Timing {
        median_wall: times[times.len() / 2].wall,
        ..times[0]
    }
}

/// CPU time of all threads of this process, from `/proc/self/task/*/schedstat` (nanoseconds
/// on the CPU); 0 where that is unavailable.
pub fn process_cpu_seconds() -> f64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0.0;
    };
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<f64>().ok())
        .sum::<f64>()
        / 1e9
}

/// Best-of-`passes` copy (read + written bytes per second) and read-only bandwidth, in GB/s,
/// over buffers of [`COPY_BYTES`]: the better of 4 KiB and 2 MiB pages for each
/// ([`bandwidth_on`]), the most this machine's memory gives a plain loop.
pub fn bandwidth(passes: usize) -> (f64, f64) {
    let small = bandwidth_on(Pages::Small, COPY_BYTES, passes);
    let huge = bandwidth_on(Pages::Huge, COPY_BYTES, passes);
    (small.0.max(huge.0), small.1.max(huge.1))
}

/// The page size of a bandwidth measurement's buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pages {
    /// 4 KiB pages (`MADV_NOHUGEPAGE`), what a memory-mapped file is read through.
    Small,
    /// 2 MiB transparent huge pages (`MADV_HUGEPAGE`): far fewer TLB misses while streaming,
    /// which under a hypervisor (two-dimensional page walks) is worth half as much bandwidth
    /// again (measured on a 2-vCPU KVM guest: 22 vs 34 GB/s).
    Huge,
}

/// A zeroed anonymous buffer of `words` u64 on `pages`.
fn buffer(pages: Pages, words: usize) -> memmap2::MmapMut {
    let mut map = memmap2::MmapMut::map_anon((words * 8).max(1)).expect("anonymous memory");
    #[cfg(target_os = "linux")]
    let _ = map.advise(match pages {
        Pages::Small => memmap2::Advice::NoHugePage,
        Pages::Huge => memmap2::Advice::HugePage,
    });
    // Touched in parallel so that pages are first touched by the threads that will use them.
    map.par_chunks_mut(1 << 19).for_each(|c| c.fill(1));
    map
}

fn words(map: &mut memmap2::MmapMut) -> &mut [u64] {
    // SAFETY: an anonymous mapping is page-aligned and its length a multiple of 8 here.
    unsafe { std::slice::from_raw_parts_mut(map.as_mut_ptr().cast::<u64>(), map.len() / 8) }
}

/// [`bandwidth`] on buffers of `bytes` each on `pages`: sizes around a cache's capacity show
/// where the cache ends (a hypervisor may report a last-level cache the guest cannot hold).
pub fn bandwidth_on(pages: Pages, bytes: usize, passes: usize) -> (f64, f64) {
    let n = bytes / 8;
    let (mut src_map, mut dst_map) = (buffer(pages, n), buffer(pages, n));
    let (src, dst) = (words(&mut src_map), words(&mut dst_map));
    src.par_chunks_mut(1 << 16).enumerate().for_each(|(i, c)| {
        c.iter_mut()
            .enumerate()
            .for_each(|(j, v)| *v = (i + j) as u64)
    });
    let chunk = 1 << 19;
    let mut copy = f64::MAX;
    let mut read = f64::MAX;
    for _ in 0..passes.max(3) {
        let start = Instant::now();
        dst.par_chunks_mut(chunk)
            .zip(src.par_chunks(chunk))
            .for_each(|(d, s)| d.copy_from_slice(s));
        copy = copy.min(start.elapsed().as_secs_f64());
        black_box(&dst);
        let start = Instant::now();
        let sum: u64 = src
            .par_chunks(chunk)
            .map(|c| {
                // Eight independent lanes so the sum is not latency-bound.
                let mut acc = [0u64; 8];
                for w in c.chunks_exact(8) {
                    for k in 0..8 {
                        acc[k] = acc[k].wrapping_add(w[k]);
                    }
                }
                acc.iter().fold(0u64, |a, &b| a.wrapping_add(b))
            })
            .reduce(|| 0, u64::wrapping_add);
        read = read.min(start.elapsed().as_secs_f64());
        black_box(sum);
    }
    (
        2.0 * (n * 8) as f64 / copy / 1e9,
        (n * 8) as f64 / read / 1e9,
    )
}

/// The 1-minute load average, to tell a quiet machine from a shared one.
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| "?".into())
}

pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

/// `YYYY-MM-DD HH:MM UTC` from the system clock (civil-from-days, no date crate needed).
pub fn utc_date() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs()) as i64;
    let (days, rem) = (secs.div_euclid(86400), secs.rem_euclid(86400));
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02} UTC",
        rem / 3600,
        rem % 3600 / 60
    )
}
