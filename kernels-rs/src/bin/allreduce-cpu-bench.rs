//! CPU benchmark of the shared-memory all-reduce: latency and bus bandwidth per algorithm for
//! 2, 4 and 8 rank processes and messages of 16 B to 8 MiB (bf16).
//!
//! ```text
//! allreduce-cpu-bench [--ranks 2,4,8] [--sizes 16,...] [--out bench/results/allreduce-cpu.txt]
//! ```
//!
//! Spawns `allreduce-rank mode=bench` processes (the sibling binary) per rank count. Also
//! measures single-thread memcpy bandwidth in the same run, so the numbers can be read as ratios
//! to copy bandwidth (absolute times only mean something on the GPU).

use std::process::{Command, ExitCode, Stdio};
use std::time::Instant;

use kernels::allreduce::shm::unique_segment_name;

const USAGE: &str = "usage: allreduce-cpu-bench [--ranks 2,4,8] [--sizes 16,64,...] [--out FILE]
CPU benchmark of the shared-memory all-reduce (rank processes: the sibling allreduce-rank);
the table goes to stdout, and to FILE with --out.";

const DEFAULT_SIZES: &str = "16,64,256,1024,4096,14336,65536,262144,1048576,4194304,8388608";

fn main() -> ExitCode {
    // Asking for help runs nothing.
    if std::env::args().skip(1).any(|a| a == "--help" || a == "-h") {
        println!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("allreduce-cpu-bench: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Single-thread memcpy GB/s at `bytes` (best of a few repetitions).
fn memcpy_gbps(bytes: usize) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let reps = (256 << 20) / bytes.max(1) + 1;
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let t = Instant::now();
        for _ in 0..reps {
            dst.copy_from_slice(std::hint::black_box(&src));
        }
        best = best.min(t.elapsed().as_secs_f64() / reps as f64);
    }
    std::hint::black_box(&dst);
    bytes as f64 / best / 1e9
}

fn run() -> Result<(), String> {
    let mut ranks = vec![2usize, 4, 8];
    let mut sizes = DEFAULT_SIZES.to_string();
    let mut out = None;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{arg} needs a value"));
        match arg.as_str() {
            "--ranks" => {
                ranks = value()?
                    .split(',')
                    .map(|r| r.parse().map_err(|e| format!("--ranks: {e}")))
                    .collect::<Result<_, _>>()?
            }
            "--sizes" => sizes = value()?,
            "--out" => out = Some(value()?),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    let max_bytes: usize = sizes
        .split(',')
        .filter_map(|s| s.parse().ok())
        .max()
        .unwrap_or(1 << 20);
    let rank_bin = std::env::current_exe()
        .map_err(|e| e.to_string())?
        .with_file_name("allreduce-rank");
    if !rank_bin.exists() {
        return Err(format!(
            "{} not found; build it with `cargo build --release -p kernels --bins`",
            rank_bin.display()
        ));
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut report = String::new();
    report += "# allreduce-cpu-bench: shared-memory all-reduce between OS processes (bf16)\n";
    report += &format!(
        "# host: {cores} CPU cores. Rank counts above {cores} are OVERSUBSCRIBED: ranks time-share cores and\n"
    );
    report += "# waiting ranks yield, so latency there measures the scheduler (context switches), not the protocol.\n";
    report += "# latency = median µs per collective on rank 0 (min in parentheses); busbw = bytes/latency x 2(n-1)/n (NCCL convention).\n";
    report += "# copy = single-thread memcpy GB/s at that size measured in this run; busbw/copy is the comparable ratio.\n";
    report += "# These are CPU numbers for the protocol's correctness-under-load and relative costs, not GPU predictions.\n";
    report += "# One run on a shared 2-core machine: medians move by up to ~2-4x between runs where the min is far below\n";
    report += "# the median (scheduler-bound cases); compare algorithms within one table, not across runs.\n\n";
    let copy: Vec<(usize, f64)> = sizes
        .split(',')
        .filter_map(|s| s.parse().ok())
        .map(|b| (b, memcpy_gbps(b)))
        .collect();
    for &n in &ranks {
        let name = unique_segment_name("bench");
        let children: Vec<_> = (0..n)
            .map(|rank| {
                Command::new(&rank_bin)
                    .args([
                        format!("name={name}"),
                        format!("rank={rank}"),
                        format!("world={n}"),
                        "mode=bench".into(),
                        "dtype=bf16".into(),
                    ])
                    .args([
                        format!("sizes={sizes}"),
                        format!("capacity={max_bytes}"),
                        "timeout-ms=60000".into(),
                    ])
                    .stdout(Stdio::piped())
                    .spawn()
                    .map_err(|e| format!("spawn {}: {e}", rank_bin.display()))
            })
            .collect::<Result<_, _>>()?;
        let mut lines = String::new();
        for (rank, child) in children.into_iter().enumerate() {
            let output = child.wait_with_output().map_err(|e| e.to_string())?;
            if !output.status.success() {
                return Err(format!(
                    "{n} ranks: rank {rank} failed: {}",
                    String::from_utf8_lossy(&output.stdout)
                ));
            }
            if rank == 0 {
                lines = String::from_utf8_lossy(&output.stdout).into_owned();
            }
        }
        let note = if n > cores { " (oversubscribed)" } else { "" };
        report += &format!("## {n} ranks{note}\n");
        report += &format!(
            "{:<26} {:>9} {:>22} {:>12} {:>10} {:>10}\n",
            "algorithm", "bytes", "latency µs (min)", "busbw GB/s", "copy GB/s", "busbw/copy"
        );
        for line in lines.lines().filter(|l| l.starts_with("bench ")) {
            let field = |key: &str| {
                line.split_whitespace()
                    .find_map(|kv| kv.strip_prefix(key).and_then(|v| v.strip_prefix('=')))
                    .unwrap_or("?")
                    .to_string()
            };
            let bytes: usize = field("bytes")
                .parse()
                .map_err(|_| format!("bad line {line:?}"))?;
            let median: f64 = field("median_us")
                .parse()
                .map_err(|_| format!("bad line {line:?}"))?;
            let min: f64 = field("min_us")
                .parse()
                .map_err(|_| format!("bad line {line:?}"))?;
            let busbw = bytes as f64 / (median * 1e-6) / 1e9 * 2.0 * (n as f64 - 1.0) / n as f64;
            let copy_gbps = copy
                .iter()
                .find(|(b, _)| *b == bytes)
                .map_or(f64::NAN, |(_, g)| *g);
            report += &format!(
                "{:<26} {:>9} {:>22} {:>12.3} {:>10.2} {:>10.4}\n",
                field("algorithm"),
                bytes,
                format!("{median:.2} ({min:.2})"),
                busbw,
                copy_gbps,
                busbw / copy_gbps
            );
        }
        report += "\n";
        eprintln!("{n} ranks done");
    }
    print!("{report}");
    if let Some(path) = out {
        std::fs::write(&path, &report).map_err(|e| format!("{path}: {e}"))?;
    }
    Ok(())
}
