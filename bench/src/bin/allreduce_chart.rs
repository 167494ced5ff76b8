//! The all-reduce cost model as a chart: predicted latency per algorithm against message size
//! on an 8-GPU 4+4 two-socket PCIe host, with NCCL and the per-token message (14,336 B)
//! marked, into `--out FILE.svg`, or `bench/results/allreduce-sim-8gpu.svg` with
//! `--write-results`.
//!
//! ```sh
//! cargo run --release -p bench --bin allreduce-chart -- --write-results
//! ```

use std::path::PathBuf;

use anyhow::Result;

/// The all-reduce cost model's chart (an SVG file).
#[derive(clap::Parser, Debug)]
#[command(name = "allreduce-chart")]
struct Cli {
    /// Where the chart goes.
    #[arg(
        long,
        required_unless_present = "write_results",
        conflicts_with = "write_results"
    )]
    out: Option<PathBuf>,
    /// Write it to bench/results/allreduce-sim-8gpu.svg (from the repository root).
    #[arg(long)]
    write_results: bool,
}

fn main() -> Result<()> {
    let cli: Cli = clap::Parser::parse();
    let path = match cli.out {
        Some(path) => path,
        None => bench::results_dir_for_write_results().join("allreduce-sim-8gpu.svg"),
    };
    bench::charts::allreduce::draw(&path)?;
    println!("wrote {}", path.display());
    Ok(())
}
