//! Loading a checkpoint against the disk's read rate, measured in the same run.
//!
//! ```sh
//! cargo run --release -p bench --bin load-rate                     # the table on stdout
//! cargo run --release -p bench --bin load-rate -- --write-results  # and bench/results/load-rate.txt
//! cargo run --release -p bench --bin load-rate -- --checkpoint DIR --repeats 3
//! ```
//!
//! The default checkpoint is the `mini-deep` preset (`mini`'s widths at Kimi-K2.5's 61 layers,
//! ~2.8 GB in ~50,000 tensors, generated once into the model cache folder): the real layout,
//! with more tensors per byte than the real checkpoint, so per-tensor costs show. Each load is
//! what `model run` / `model serve` do before their first step, for one rank: open the
//! checkpoint, place the weights (populate the mapping, or copy it onto huge pages), build the
//! host weight tree, and make the backend's runner (the device executor uploads every weight
//! into device memory). Cold runs first drop the files from the page cache
//! (`posix_fadvise(DONTNEED)`, checked with `mincore`), so the disk is read; warm runs find
//! them cached. The reference is a plain sequential `read()` of the same files, cold and warm.

use std::fmt::Write as _;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use bench::{cpu_model, load_average, utc_date};
use kernels::mla::cache::KvCacheDtype;
use model::arch::presets::Preset;
use model::checkpoint::{Checkpoint, load_model};
use model::exec::backend::{Backend, BackendArgs, RunnerSizing};
use model::exec::cpu::choice::WeightsArg;
use model::exec::device::StepCapacity;

/// Loading a checkpoint against the disk's read rate; the table goes to stdout.
#[derive(clap::Parser)]
#[command(name = "load-rate")]
struct Args {
    /// A checkpoint folder; default: the `mini-deep` preset, generated once.
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    /// Runs of each measurement; the median is reported.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Also write the table to this file.
    #[arg(long, conflicts_with = "write_results")]
    out: Option<PathBuf>,
    /// Also write the table to bench/results/load-rate.txt (from the repository root; the
    /// default checkpoint only).
    #[arg(long, conflicts_with = "checkpoint")]
    write_results: bool,
}

/// The checkpoint's files: every shard and the small JSON files beside them.
fn files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    Ok(files)
}

fn total_bytes(files: &[PathBuf]) -> Result<u64> {
    files.iter().map(|f| Ok(std::fs::metadata(f)?.len())).sum()
}

/// Drops every file's pages from the page cache.
fn evict(files: &[PathBuf]) -> Result<()> {
    use std::os::fd::AsRawFd;
    for f in files {
        let (file, _) = kernels::files::open_regular(f)?;
        // SAFETY: a valid descriptor; advice only.
        let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        anyhow::ensure!(rc == 0, "posix_fadvise({}): error {rc}", f.display());
    }
    Ok(())
}

/// Share of the files' pages in the page cache (`mincore` over a mapping of each).
fn resident_share(files: &[PathBuf]) -> Result<f64> {
    let page = 4096usize;
    let (mut resident, mut pages) = (0usize, 0usize);
    for f in files {
        let (file, _) = kernels::files::open_regular(f)?;
        if file.metadata()?.len() == 0 {
            continue;
        }
        // SAFETY: read-only mapping of a file nobody writes during the benchmark.
        let map = unsafe { memmap2::Mmap::map(&file)? };
        let n = map.len().div_ceil(page);
        let mut vec = vec![0u8; n];
        // SAFETY: `vec` has one byte per page of the mapping.
        let rc = unsafe { libc::mincore(map.as_ptr() as *mut _, map.len(), vec.as_mut_ptr()) };
        anyhow::ensure!(rc == 0, "mincore({})", f.display());
        resident += vec.iter().filter(|&&b| b & 1 == 1).count();
        pages += n;
    }
    Ok(resident as f64 / pages.max(1) as f64)
}

/// Reads `path` to its end with `read()` into a 16 MiB buffer.
fn read_file(path: &Path) -> Result<()> {
    let mut buffer = vec![0u8; 16 << 20];
    let (mut file, _) = kernels::files::open_regular(path)?;
    let mut sum = 0u64;
    loop {
        let n = file.read(&mut buffer)?;
        if n == 0 {
            break;
        }
        sum = sum.wrapping_add(buffer[n - 1] as u64);
    }
    std::hint::black_box(sum);
    Ok(())
}

/// Reads every file once, one after the other; returns seconds.
fn read_all(files: &[PathBuf]) -> Result<f64> {
    let started = Instant::now();
    for f in files {
        read_file(f)?;
    }
    Ok(started.elapsed().as_secs_f64())
}

/// Reads every file once, the files spread over the thread pool (as the loader populates
/// its shards); returns seconds.
fn read_all_parallel(files: &[PathBuf]) -> Result<f64> {
    use rayon::prelude::*;
    let started = Instant::now();
    files.par_iter().try_for_each(|f| read_file(f))?;
    Ok(started.elapsed().as_secs_f64())
}

/// One load path of `model run`: what it opens and how.
#[derive(Clone, Copy)]
struct LoadPath {
    name: &'static str,
    backend: Backend,
    weights: WeightsArg,
}

const PATHS: [LoadPath; 3] = [
    LoadPath {
        name: "cpu, --weights mapped (populate the mapping)",
        backend: Backend::Cpu,
        weights: WeightsArg::Mapped,
    },
    LoadPath {
        name: "cpu, --weights huge-pages (copy onto 2 MiB pages)",
        backend: Backend::Cpu,
        weights: WeightsArg::HugePages,
    },
    LoadPath {
        name: "cuda-emulated (populate, upload to device memory)",
        backend: Backend::CudaEmulated,
        weights: WeightsArg::Auto,
    },
];

/// Loads `dir` as `path` and makes its runner, as `model run` does before its first step;
/// returns seconds.
fn load(dir: &Path, path: LoadPath) -> Result<f64> {
    let mut backend = BackendArgs {
        backend: path.backend,
        ..BackendArgs::default()
    };
    backend.cpu.weights = path.weights;
    let started = Instant::now();
    let opened = Checkpoint::open(dir)?;
    let placement = backend.weight_placement(&opened);
    drop(opened);
    let model = load_model(dir, model::arch::shard::TpShard::SINGLE, |_| placement)?;
    let sizing = RunnerSizing {
        kv_dtype: KvCacheDtype::Bf16,
        cache_tokens: 1024,
        capacity: StepCapacity {
            tokens: 64,
            logit_rows: 1,
        },
        fill_memory: false,
    };
    let runner = backend.open_runner(&model, None, sizing, true)?;
    let seconds = started.elapsed().as_secs_f64();
    drop(runner);
    drop(model);
    Ok(seconds)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<()> {
    let args: Args = clap::Parser::parse();
    let out = bench::report_path(args.out.as_deref(), args.write_results, "load-rate.txt");
    let dir = match &args.checkpoint {
        Some(dir) => dir.clone(),
        None => model::quantize::generator::generated_checkpoint(Preset::MiniDeep, None)?,
    };
    let files = files(&dir)?;
    let bytes = total_bytes(&files)?;
    let gb = bytes as f64 / 1e9;
    let tensors = Checkpoint::open(&dir)?.tensor_names().count();
    let repeats = args.repeats.max(1);
    let load_before = load_average();

    let mut report = String::new();
    writeln!(
        report,
        "# date: {}; cpu: {}; rayon threads: {}; load average before: {load_before}",
        utc_date(),
        cpu_model(),
        rayon::current_num_threads()
    )?;
    writeln!(
        report,
        "# checkpoint: {} ({} files, {gb:.2} GB, {tensors} tensors); median of {repeats} runs",
        dir.file_name().map_or("?".into(), |n| n.to_string_lossy()),
        files.len()
    )?;

    // The references: the disk (cold) and the page cache (warm), read sequentially.
    let (mut cold_sequential, mut cold_parallel, mut evicted) =
        (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..repeats {
        evict(&files)?;
        evicted.push(resident_share(&files)?);
        cold_sequential.push(read_all(&files)?);
        evict(&files)?;
        cold_parallel.push(read_all_parallel(&files)?);
    }
    let warm_read = median(
        (0..repeats)
            .map(|_| read_all(&files))
            .collect::<Result<_>>()?,
    );
    let (cold_sequential, cold_parallel) = (median(cold_sequential), median(cold_parallel));
    // The disk's read rate: the faster of one reader and one reader per pool thread.
    let cold_read = cold_sequential.min(cold_parallel);
    let evicted = evicted.iter().copied().fold(0.0, f64::max);
    writeln!(
        report,
        "# after each eviction at most {:.1}% of the files' pages stayed in the page cache",
        evicted * 100.0
    )?;
    writeln!(report)?;
    writeln!(
        report,
        "{:<58} {:>8} {:>8} {:>14}",
        "what (one rank)", "seconds", "GB/s", "x read rate"
    )?;
    let mut row = |what: &str, seconds: f64, reference: f64| {
        writeln!(
            report,
            "{what:<58} {seconds:>8.2} {:>8.2} {:>14.2}",
            gb / seconds,
            reference / seconds
        )
    };
    row(
        "cold: read() of the files, one after the other",
        cold_sequential,
        cold_read,
    )?;
    row(
        &format!(
            "cold: read() of the files, {} at once",
            rayon::current_num_threads()
        ),
        cold_parallel,
        cold_read,
    )?;
    for path in PATHS {
        let times = (0..repeats)
            .map(|_| {
                evict(&files)?;
                load(&dir, path)
            })
            .collect::<Result<Vec<_>>>()?;
        row(&format!("cold: {}", path.name), median(times), cold_read)?;
    }
    row(
        "warm: read() of the files (page cache)",
        warm_read,
        warm_read,
    )?;
    for path in PATHS {
        read_all(&files)?;
        let times = (0..repeats)
            .map(|_| load(&dir, path))
            .collect::<Result<Vec<_>>>()?;
        row(&format!("warm: {}", path.name), median(times), warm_read)?;
    }
    writeln!(
        report,
        "\n# x read rate: the load's GB/s over the reference's (cold: the faster cold read() above, the disk's read rate; warm: the warm read()), measured"
    )?;
    writeln!(report, "# load average after: {}", load_average())?;
    bench::emit_report(&report, out.as_deref())
}
