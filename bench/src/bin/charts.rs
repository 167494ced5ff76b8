//! Redraws every chart in a results folder from the data stored beside it, without measuring
//! or predicting again (see [`bench::charts::redraw_all`]):
//!
//! ```sh
//! cargo run -p bench --bin charts -- --write-results   # bench/results
//! cargo run -p bench --bin charts -- DIR               # a copy of it elsewhere
//! ```

use std::path::PathBuf;

use anyhow::Result;

/// Redraws the charts of a results folder from its data files.
#[derive(clap::Parser, Debug)]
#[command(name = "charts")]
#[command(group = clap::ArgGroup::new("where").required(true).args(["dir", "write_results"]))]
struct Cli {
    /// A results folder: its charts are redrawn beside their data.
    dir: Option<PathBuf>,
    /// Redraw the committed charts in bench/results (run from the repository's root).
    #[arg(long)]
    write_results: bool,
}

fn main() -> Result<()> {
    let cli: Cli = clap::Parser::parse();
    let dir = match cli.dir {
        Some(dir) => dir,
        None => bench::results_dir_for_write_results(),
    };
    for chart in bench::charts::redraw_all(&dir)? {
        println!("wrote {}", chart.display());
    }
    Ok(())
}
