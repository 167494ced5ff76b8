//! One all-reduce rank as an OS process, for the multi-process tests and the CPU benchmark.
//!
//! ```text
//! allreduce-rank name=<segment> rank=<r> world=<n> [mode=check|loop|bench] [dtype=bf16|f32]
//!     [len=<elements>] [algorithms=all|<id>,<id>] [islands=0,1/2,3] [timeout-ms=<ms>]
//!     [capacity=<bytes>] [seed=<u64>] [residual=0|1] [sizes=<bytes>,<bytes>]
//! ```
//!
//! * `check`: runs each algorithm once on `testing::rank_input` and prints
//!   `result algorithm=<id> digest=<hex>`; the parent compares with the reference.
//! * `loop`: prints `ready` after the first collective, then keeps reducing until an error,
//!   which it prints as `error <message>` before exiting with status 3.
//! * `bench`: times each algorithm × size; rank 0 prints `bench ...` lines.

use std::collections::HashMap;
use std::io::Write;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use half::bf16;
use kernels::allreduce::cpu::{CpuCommunicator, CpuConfig};
use kernels::allreduce::testing::{digest, rank_input, residual_input};
use kernels::allreduce::{Algorithm, AllReduceError, DType, Element, Islands};

const USAGE: &str =
    "usage: allreduce-rank name=<segment> rank=<r> world=<n> [mode=check|loop|bench]
    [dtype=bf16|f32] [len=<elements>] [algorithms=all|<id>,<id>] [islands=0,1/2,3]
    [timeout-ms=<ms>] [capacity=<bytes>] [seed=<u64>] [residual=0|1] [sizes=<bytes>,<bytes>]
One all-reduce rank as an OS process (started by the multi-process tests and
allreduce-cpu-bench).";

struct Args(HashMap<String, String>);

impl Args {
    fn get<T: std::str::FromStr>(&self, key: &str, default: Option<T>) -> Result<T, String>
    where
        T::Err: std::fmt::Display,
    {
        match self.0.get(key) {
            Some(v) => v.parse().map_err(|e| format!("{key}={v}: {e}")),
            None => default.ok_or_else(|| format!("missing {key}=")),
        }
    }
}

fn main() -> ExitCode {
    // Asking for help runs nothing.
    if std::env::args().skip(1).any(|a| a == "--help" || a == "-h") {
        println!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            println!("error {message}");
            eprintln!("allreduce-rank: {message}");
            ExitCode::from(3)
        }
    }
}

fn run() -> Result<(), String> {
    let mut map = HashMap::new();
    for arg in std::env::args().skip(1) {
        let (k, v) = arg
            .split_once('=')
            .ok_or_else(|| format!("argument {arg:?} is not key=value"))?;
        map.insert(k.to_string(), v.to_string());
    }
    let args = Args(map);
    let name: String = args.get("name", None)?;
    let rank: usize = args.get("rank", None)?;
    let world: usize = args.get("world", None)?;
    let dtype: DType = args.get("dtype", Some(DType::Bf16))?;
    let algorithms: Vec<Algorithm> = match args
        .get::<String>("algorithms", Some("all".into()))?
        .as_str()
    {
        "all" => Algorithm::ALL.to_vec(),
        list => list
            .split(',')
            .map(|id| id.parse().map_err(|e| format!("{e}")))
            .collect::<Result<_, _>>()?,
    };
    let islands = match args.0.get("islands") {
        Some(spec) => Some(Islands::from_spec(spec).map_err(|e| e.to_string())?),
        None => None,
    };
    let config = CpuConfig {
        timeout: Duration::from_millis(args.get("timeout-ms", Some(10_000))?),
        capacity_bytes: args.get("capacity", Some(1 << 20))?,
        islands,
        ..CpuConfig::default()
    };
    let mut comm = CpuCommunicator::new(&name, rank, world, config).map_err(|e| e.to_string())?;
    let seed: u64 = args.get("seed", Some(1))?;
    let mode: String = args.get("mode", Some("check".into()))?;
    match (mode.as_str(), dtype) {
        ("check", DType::Bf16) => check::<bf16>(&mut comm, &args, &algorithms, seed),
        ("check", DType::F32) => check::<f32>(&mut comm, &args, &algorithms, seed),
        ("loop", _) => run_loop(&mut comm, &args, &algorithms),
        ("bench", DType::Bf16) => bench::<bf16>(&mut comm, &args, &algorithms),
        ("bench", DType::F32) => bench::<f32>(&mut comm, &args, &algorithms),
        (other, _) => Err(format!("unknown mode {other:?} (check, loop, bench)")),
    }
}

fn check<T: Element>(
    comm: &mut CpuCommunicator,
    args: &Args,
    algorithms: &[Algorithm],
    seed: u64,
) -> Result<(), String> {
    let len: usize = args.get("len", Some(1000))?;
    let use_residual = args.get::<u8>("residual", Some(0))? == 1;
    let residual: Vec<T> = residual_input(seed, len);
    for (i, &algorithm) in algorithms.iter().enumerate() {
        let mut data: Vec<T> = rank_input(seed + i as u64, comm_rank(comm), len);
        comm.all_reduce_with(algorithm, &mut data, use_residual.then_some(&residual[..]))
            .map_err(|e| e.to_string())?;
        println!(
            "result algorithm={} digest={:016x}",
            algorithm.id(),
            digest(&data)
        );
    }
    Ok(())
}

fn comm_rank(comm: &CpuCommunicator) -> usize {
    kernels::allreduce::AllReduce::rank(comm)
}

fn run_loop(
    comm: &mut CpuCommunicator,
    args: &Args,
    algorithms: &[Algorithm],
) -> Result<(), String> {
    let len: usize = args.get("len", Some(4096))?;
    let mut data: Vec<f32> = rank_input(7, comm_rank(comm), len);
    for iteration in 0u64.. {
        let algorithm = algorithms[iteration as usize % algorithms.len()];
        // Keep magnitudes bounded across iterations.
        data.iter_mut()
            .for_each(|x| *x = (*x * 0.125).clamp(-1e3, 1e3));
        comm.all_reduce_with(algorithm, &mut data, None)
            .map_err(|e: AllReduceError| format!("iteration {iteration}: {e}"))?;
        if iteration == 0 {
            println!("ready");
            std::io::stdout().flush().ok();
        }
    }
    Ok(())
}

/// Iterations for a message: many for small ones (latency noise), few for large ones.
fn iterations(bytes: usize) -> usize {
    (16 << 20) / bytes.max(1) / 4 + 5
}

fn bench<T: Element>(
    comm: &mut CpuCommunicator,
    args: &Args,
    algorithms: &[Algorithm],
) -> Result<(), String> {
    let sizes: Vec<usize> = args
        .get::<String>("sizes", Some("16,1024,14336,65536,1048576".into()))?
        .split(',')
        .map(|s| s.parse().map_err(|e| format!("sizes: {e}")))
        .collect::<Result<_, _>>()?;
    let rank = comm_rank(comm);
    for &algorithm in algorithms {
        for &bytes in &sizes {
            let len = (bytes / std::mem::size_of::<T>()).max(1);
            let input: Vec<T> = rank_input(3, rank, len);
            let mut data = input.clone();
            let iters = iterations(bytes).min(200);
            let mut times = Vec::with_capacity(iters);
            for i in 0..iters + 3 {
                // Fresh input every time (untimed), so repeated sums never drift into inf/NaN.
                data.copy_from_slice(&input);
                let start = Instant::now();
                comm.all_reduce_with(algorithm, &mut data, None)
                    .map_err(|e| e.to_string())?;
                if i >= 3 {
                    times.push(start.elapsed().as_secs_f64() * 1e6);
                }
            }
            times.sort_by(f64::total_cmp);
            if rank == 0 {
                let mean = times.iter().sum::<f64>() / times.len() as f64;
                println!(
                    "bench algorithm={} bytes={bytes} iters={iters} min_us={:.2} median_us={:.2} mean_us={mean:.2}",
                    algorithm.id(),
                    times[0],
                    times[times.len() / 2]
                );
            }
        }
    }
    Ok(())
}
