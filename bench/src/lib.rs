//! What every benchmark here shares: best-of timing with the CPU time the threads actually got,
//! the machine's copy and read bandwidth measured in the same run, and the facts a result file
//! records (CPU, load, date).

pub mod charts;
pub mod cpu_tactics;
pub mod cpu_tune;
pub mod gpu_timing;
pub mod sweep;

use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use rayon::prelude::*;

/// The committed results, relative to the repository root: what `--write-results` updates.
pub const RESULTS_DIR: &str = "bench/results";

/// The folder `--write-results` writes into: [`RESULTS_DIR`] under the working directory,
/// which must be the repository root (the folder is there): a run elsewhere is refused with
/// exit code 2 before any work, rather than creating a stray `bench/results`.
pub fn results_dir_for_write_results() -> PathBuf {
    let dir = PathBuf::from(RESULTS_DIR);
    if !dir.is_dir() {
        eprintln!(
            "error: --write-results: no {RESULTS_DIR} folder under the working directory; run \
             from the repository root (or give --out PATH)"
        );
        std::process::exit(2);
    }
    dir
}

/// Prints a report on stdout and writes it to `out` when there is one (`--out PATH`, or
/// [`RESULTS_DIR`]`/NAME` under `--write-results`).
pub fn emit_report(text: &str, out: Option<&Path>) -> anyhow::Result<()> {
    print!("{text}");
    if let Some(path) = out {
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::write(path, text)
            .map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

/// The report file of a run: `--out PATH`, else `--write-results`'s [`RESULTS_DIR`]`/name`,
/// else none (stdout only).
pub fn report_path(out: Option<&Path>, write_results: bool, name: &str) -> Option<PathBuf> {
    match out {
        Some(p) => Some(p.to_path_buf()),
        None => write_results.then(|| results_dir_for_write_results().join(name)),
    }
}

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
/// ([`bandwidth_on`]), the most this machine's memory gives a loop of the widest loads.
pub fn bandwidth(passes: usize) -> (f64, f64) {
    let small = bandwidth_on(Pages::Small, COPY_BYTES, passes);
    let huge = bandwidth_on(Pages::Huge, COPY_BYTES, passes);
    (small.0.max(huge.0), small.1.max(huge.1))
}

/// BF16 weights on 2 MiB pages (as `model run --weights auto` holds them), `bytes` of them, far
/// beyond any last-level cache when a benchmark rotates its calls through them: every call
/// then streams from DRAM. Filled with small values, so products stay finite.
pub struct RotatedBf16 {
    map: memmap2::MmapMut,
}

impl RotatedBf16 {
    pub fn new(bytes: usize) -> Self {
        let map = memmap2::MmapMut::map_anon(bytes).expect("anonymous memory");
        #[cfg(target_os = "linux")]
        let _ = map.advise(memmap2::Advice::HugePage);
        let mut weights = Self { map };
        // SAFETY: the mapping is page-aligned and holds `bytes / 2` BF16 values.
        let all: &mut [half::bf16] =
            unsafe { std::slice::from_raw_parts_mut(weights.map.as_mut_ptr().cast(), bytes / 2) };
        for (i, v) in all.iter_mut().enumerate() {
            *v = half::bf16::from_f32((i % 7) as f32 * 0.1);
        }
        weights
    }

    pub fn values(&self) -> &[half::bf16] {
        // SAFETY: as in `new`.
        unsafe { std::slice::from_raw_parts(self.map.as_ptr().cast(), self.map.len() / 2) }
    }

    /// Hands out the weights one call's matrix at a time, each call the next whole matrix of
    /// the rotation.
    pub fn rotation(&self) -> Rotation<'_> {
        Rotation {
            values: self.values(),
            call: 0,
        }
    }
}

/// [`RotatedBf16::rotation`]: each call's weights, in turn through the whole buffer.
pub struct Rotation<'a> {
    values: &'a [half::bf16],
    call: usize,
}

impl<'a> Rotation<'a> {
    /// The next call's `len` values: the next of the buffer's whole runs of `len`.
    pub fn next(&mut self, len: usize) -> &'a [half::bf16] {
        let sets = self.values.len() / len;
        assert!(sets > 0, "{len} values do not fit the rotated weights");
        self.call += 1;
        &self.values[(self.call % sets) * len..][..len]
    }
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
    let mut copy = f64::MAX;
    let mut read = f64::MAX;
    for _ in 0..passes.max(3) {
        let start = Instant::now();
        dst.par_chunks_mut(PASS_CHUNK_WORDS)
            .zip(src.par_chunks(PASS_CHUNK_WORDS))
            .for_each(|(d, s)| d.copy_from_slice(s));
        copy = copy.min(start.elapsed().as_secs_f64());
        black_box(&dst);
        let start = Instant::now();
        black_box(read_pass(src));
        read = read.min(start.elapsed().as_secs_f64());
    }
    (
        2.0 * (n * 8) as f64 / copy / 1e9,
        (n * 8) as f64 / read / 1e9,
    )
}

/// The read bandwidth a loop of the widest loads sustains on every thread over `window`, in
/// GB/s: back-to-back passes summing a buffer of `bytes` on `pages`, all the bytes read over
/// all the time taken. [`bandwidth_on`] keeps its best pass, what the memory gives at its best
/// moment. Where a shared host's bandwidth jumps between levels for fractions of a second
/// (measured on a 2-vCPU Zen 4 KVM guest: passes at 28-34 GB/s, with stretches of 0.1-1 s at
/// 45-60), one pass inside such a stretch sets the best, and a decode lasting a fifth of a
/// second mostly falls outside them. This is what a stream as long as the window gets.
pub fn sustained_read(pages: Pages, bytes: usize, window: std::time::Duration) -> f64 {
    let mut map = buffer(pages, bytes / 8);
    let src = words(&mut map);
    let (start, mut read) = (Instant::now(), 0usize);
    while read == 0 || start.elapsed() < window {
        black_box(read_pass(src));
        read += src.len() * 8;
    }
    read as f64 / start.elapsed().as_secs_f64() / 1e9
}

/// Words of a bandwidth pass's parallel chunks (4 MiB).
const PASS_CHUNK_WORDS: usize = 1 << 19;

/// One read pass over `words` on every thread: the wrapping sum of its chunks' [`read_sum`]s.
fn read_pass(words: &[u64]) -> u64 {
    words
        .par_chunks(PASS_CHUNK_WORDS)
        .map(read_sum)
        .reduce(|| 0, u64::wrapping_add)
}

/// The wrapping sum of `words`, read with the widest vectors this CPU has: a plain loop
/// (eight independent `u64` lanes, which the baseline target compiles to SSE2) read 12 %
/// less than 64-byte loads on an AVX-512 machine (measured on Zen 5: 68 against 77 GB/s),
/// and the kernels it is compared with use the widest loads.
pub fn read_sum(words: &[u64]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU supports AVX-512F (just checked).
            return unsafe { wide::sum_avx512(words) };
        }
        if is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2 (just checked).
            return unsafe { wide::sum_avx2(words) };
        }
    }
    sum_lanes(words)
}

/// [`read_sum`] of any bytes: the aligned words with the widest vectors, the few bytes before
/// and after them one at a time (weights in a checkpoint start wherever their tensor does).
pub fn read_sum_bytes(bytes: &[u8]) -> u64 {
    // SAFETY: u64 has no invalid bit patterns.
    let (head, words, tail) = unsafe { bytes.align_to::<u64>() };
    let edge = head.iter().chain(tail).map(|&b| u64::from(b)).sum::<u64>();
    read_sum(words).wrapping_add(edge)
}

/// Eight independent lanes so that the sum is not latency-bound.
fn sum_lanes(words: &[u64]) -> u64 {
    let mut acc = [0u64; 8];
    let whole = words.chunks_exact(8);
    let tail = whole.remainder();
    for w in whole {
        for k in 0..8 {
            acc[k] = acc[k].wrapping_add(w[k]);
        }
    }
    acc.iter().chain(tail).fold(0u64, |a, &b| a.wrapping_add(b))
}

#[cfg(target_arch = "x86_64")]
mod wide {
    use std::arch::x86_64::*;

    /// Words per iteration: four vectors, independent sums.
    const AVX512_WORDS: usize = 32;
    const AVX2_WORDS: usize = 16;

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn sum_avx512(words: &[u64]) -> u64 {
        let whole = words.len() / AVX512_WORDS * AVX512_WORDS;
        let p = words.as_ptr();
        let mut acc = [_mm512_setzero_si512(); 4];
        let mut i = 0;
        while i < whole {
            for (k, a) in acc.iter_mut().enumerate() {
                // SAFETY: i + 8k + 8 <= whole <= words.len().
                let v = unsafe { _mm512_loadu_si512(p.add(i + 8 * k).cast()) };
                *a = _mm512_add_epi64(*a, v);
            }
            i += AVX512_WORDS;
        }
        let s = _mm512_add_epi64(
            _mm512_add_epi64(acc[0], acc[1]),
            _mm512_add_epi64(acc[2], acc[3]),
        );
        (_mm512_reduce_add_epi64(s) as u64).wrapping_add(super::sum_lanes(&words[whole..]))
    }

    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn sum_avx2(words: &[u64]) -> u64 {
        let whole = words.len() / AVX2_WORDS * AVX2_WORDS;
        let p = words.as_ptr();
        let mut acc = [_mm256_setzero_si256(); 4];
        let mut i = 0;
        while i < whole {
            for (k, a) in acc.iter_mut().enumerate() {
                // SAFETY: i + 4k + 4 <= whole <= words.len().
                let v = unsafe { _mm256_loadu_si256(p.add(i + 4 * k).cast()) };
                *a = _mm256_add_epi64(*a, v);
            }
            i += AVX2_WORDS;
        }
        let s = _mm256_add_epi64(
            _mm256_add_epi64(acc[0], acc[1]),
            _mm256_add_epi64(acc[2], acc[3]),
        );
        let mut lanes = [0u64; 4];
        // SAFETY: `lanes` is 32 bytes.
        unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast(), s) };
        lanes
            .iter()
            .fold(super::sum_lanes(&words[whole..]), |a, &b| a.wrapping_add(b))
    }
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

/// The model in the checkpoint at `dir` (the default `mini` model of `model run` if `None`,
/// generated on first use) with its weights where `model run` reads them (`--weights auto`),
/// so that a benchmark times what a run does; and the directory it came from.
pub fn load_model_as_run(
    dir: Option<&std::path::Path>,
) -> anyhow::Result<(std::path::PathBuf, model::checkpoint::weights::Model)> {
    let dir = match dir {
        Some(dir) => dir.to_path_buf(),
        None => model::quantize::generator::default_checkpoint(None)?,
    };
    let mut checkpoint = model::checkpoint::Checkpoint::open(&dir)?;
    checkpoint.place_weights(model::checkpoint::WeightPlacement::auto(
        checkpoint.file_bytes(),
    ));
    let model = model::checkpoint::weights::Model::new(
        checkpoint.model_config().clone(),
        checkpoint.load_weights()?,
    );
    Ok((dir, model))
}

#[cfg(test)]
mod read_sum_tests {
    #[test]
    fn every_width_sums_every_word_once() {
        // Lengths around each loop's step leave tails of every size.
        for len in [0usize, 1, 7, 8, 15, 16, 17, 31, 32, 33, 100, 1000] {
            let words: Vec<u64> = (0..len as u64).map(|i| (i << 40) ^ (i * 7919)).collect();
            let want = words.iter().fold(0u64, |a, &b| a.wrapping_add(b));
            assert_eq!(super::sum_lanes(&words), want, "lanes, {len} words");
            assert_eq!(super::read_sum(&words), want, "widest, {len} words");
            #[cfg(target_arch = "x86_64")]
            if is_x86_feature_detected!("avx2") {
                // SAFETY: AVX2 is present.
                assert_eq!(
                    unsafe { super::wide::sum_avx2(&words) },
                    want,
                    "avx2, {len} words"
                );
            }
        }
    }
}

#[cfg(test)]
mod sustained_read_tests {
    use std::time::{Duration, Instant};

    /// The read lasts at least its window, reads the buffer at least once even in a window
    /// shorter than a pass, and reports a finite rate.
    #[test]
    fn a_sustained_read_fills_its_window_and_reads_at_least_once() {
        for window_ms in [0u64, 20] {
            let window = Duration::from_millis(window_ms);
            let start = Instant::now();
            let rate = super::sustained_read(super::Pages::Small, 1 << 20, window);
            assert!(
                start.elapsed() >= window,
                "returned before its {window_ms} ms"
            );
            assert!(
                rate.is_finite() && rate > 0.0,
                "{rate} GB/s over {window_ms} ms"
            );
        }
    }
}
