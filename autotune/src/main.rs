//! `autotune`: see the crate documentation and `autotune/README.md`.

use clap::Parser;

#[derive(Parser, Debug)]
#[command(
    name = "autotune",
    about = "The tuning lab: tactics gated, checked and timed per shape"
)]
struct Cli {}

fn main() {
    let _ = Cli::parse();
}
