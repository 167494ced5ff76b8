//! The Rust half of the peer benchmark against llama.cpp (`bench/peer/run.sh` runs it):
//!
//! - `peer-llamacpp bandwidth [--mib N] [--window-ms M]`: the machine's read and copy
//!   bandwidth on every thread (best of 10 passes over 512 MiB, or N MiB), on 4 KiB and on
//!   2 MiB pages, and the better of the two as `read_gb_s`/`copy_gb_s`; and the read bandwidth
//!   sustained over M ms (1000) of back-to-back passes on 2 MiB pages as
//!   `read_sustained_gb_s` ([`bench::sustained_read`]), as one JSON line;
//! - `peer-llamacpp chart --json bench/results/peer-llamacpp.json --out FILE.svg`: the
//!   measured medians as grouped bars, one group per row (prefill 128/512, decode b1/b4),
//!   one bar per engine that ran, tok/s on a log axis ([`bench::charts::peer`]).

use std::path::{Path, PathBuf};

use anyhow::Result;

const BANDWIDTH_PASSES: usize = 10;
/// How long `bandwidth` sustains its read by default: longer than a batch-1 decode run of the
/// peer benchmark (32 tokens, about 0.2 s), short enough to run before and after each.
const SUSTAINED_WINDOW_MS: usize = 1000;

/// The Rust half of the peer benchmark against llama.cpp.
#[derive(clap::Parser, Debug)]
#[command(name = "peer-llamacpp")]
struct Cli {
    #[command(subcommand)]
    command: PeerCommand,
}

#[derive(clap::Subcommand, Debug)]
enum PeerCommand {
    /// The machine's read and copy bandwidth (4 KiB and 2 MiB pages) and the sustained read,
    /// as one JSON line on stdout.
    Bandwidth {
        /// Buffer MiB of each pass.
        #[arg(long, default_value_t = bench::COPY_BYTES >> 20, value_parser = positive)]
        mib: usize,
        /// Milliseconds of back-to-back read passes for the sustained read.
        #[arg(long, default_value_t = SUSTAINED_WINDOW_MS, value_parser = positive)]
        window_ms: usize,
    },
    /// The measured medians as grouped bars (an SVG file).
    Chart {
        /// The peer benchmark's results (bench/results/peer-llamacpp.json).
        #[arg(long)]
        json: PathBuf,
        /// Where the chart goes.
        #[arg(long)]
        out: PathBuf,
    },
}

/// A whole number above 0.
fn positive(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!("{text}: expected a positive whole number")),
    }
}

fn main() -> Result<()> {
    let cli: Cli = clap::Parser::parse();
    match cli.command {
        PeerCommand::Bandwidth { mib, window_ms } => {
            let small = bench::bandwidth_on(bench::Pages::Small, mib << 20, BANDWIDTH_PASSES);
            let huge = bench::bandwidth_on(bench::Pages::Huge, mib << 20, BANDWIDTH_PASSES);
            let window = std::time::Duration::from_millis(window_ms as u64);
            let sustained = bench::sustained_read(bench::Pages::Huge, mib << 20, window);
            println!(
                "{}",
                serde_json::json!({
                    "read_gb_s": small.1.max(huge.1),
                    "copy_gb_s": small.0.max(huge.0),
                    "read_4k_pages_gb_s": small.1,
                    "read_2m_pages_gb_s": huge.1,
                    "read_sustained_gb_s": sustained,
                    "sustained_window_ms": window_ms,
                    "buffer_mib": mib,
                    "threads": rayon::current_num_threads(),
                })
            );
            Ok(())
        }
        PeerCommand::Chart { json, out } => chart(&json, &out),
    }
}

fn chart(json: &Path, out: &Path) -> Result<()> {
    bench::charts::peer::draw_file(json, out)?;
    println!("wrote {}", out.display());
    Ok(())
}
