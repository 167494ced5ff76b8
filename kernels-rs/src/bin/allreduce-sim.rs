//! Prints the all-reduce cost model's latency table and chosen algorithm per size.
//!
//! ```text
//! allreduce-sim [--topology <fixture name | nvidia-smi topo -m file | sysfs paths file>]
//!               [--no-collapse] [--gpus 2,4,8] [--out <file>]
//! ```
//!
//! Fixture names: two-sockets-4x4 (default), two-switches-one-socket, no-switches, mixed.

use std::process::ExitCode;

use kernels::allreduce::cost::{Host, LinkParams, render_table, table_sizes};
use kernels::allreduce::topology::{Topology, fixtures};

const FOCUS_BYTES: usize = 14_336;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("allreduce-sim: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), String> {
    let mut topology_arg = "two-sockets-4x4".to_string();
    let mut params = LinkParams::default();
    let mut gpus = vec![2, 4, 8];
    let mut out = None;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{arg} needs a value"));
        match arg.as_str() {
            "--topology" => topology_arg = value()?,
            "--no-collapse" => params.writes_collapse = false,
            "--gpus" => {
                gpus = value()?
                    .split(',')
                    .map(|g| g.parse().map_err(|e| format!("--gpus: {e}")))
                    .collect::<Result<_, _>>()?
            }
            "--out" => out = Some(value()?),
            "--help" | "-h" => {
                println!(
                    "usage: allreduce-sim [--topology NAME|FILE] [--no-collapse] [--gpus 2,4,8] [--out FILE]"
                );
                return Ok(());
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    let topology = match fixtures::named(&topology_arg) {
        Some(text) => Topology::from_nvidia_smi(text),
        None => {
            let text = kernels::files::read_text_bounded(
                std::path::Path::new(&topology_arg),
                kernels::files::TEXT_FILE_LIMIT,
            )
            .map_err(|e| e.to_string())?;
            if text
                .lines()
                .any(|l| l.trim_start().starts_with("/sys/devices/"))
            {
                Topology::from_sysfs_paths(&text)
            } else {
                Topology::from_nvidia_smi(&text)
            }
        }
    }
    .map_err(|e| format!("{topology_arg}: {e}"))?;

    let mut report = String::new();
    report += "# allreduce-sim: predicted all-reduce latency (µs) per algorithm and size\n";
    report += &format!(
        "# host: {topology_arg}; writes across root complexes collapse: {}\n",
        params.writes_collapse
    );
    report += &format!("# parameters: {params:?}\n");
    report += "# NCCL is a fixed-latency peer from measurements (24 µs flat to 64 KB), not modelled from links.\n";
    report += "# Defaults are calibrated to FACTS.md (one-shot 7.5 µs at 1 KB, 9-12 µs at 14 KB, loses to NCCL above ~48-64 KB);\n";
    report += "# refit from measurements with LinkParams::calibrate.\n\n";
    report += &topology.to_matrix_text();
    report += "\n";
    let sizes = table_sizes();
    for &g in &gpus {
        if g > topology.len() || g == 0 {
            return Err(format!("--gpus {g}: host has {} GPUs", topology.len()));
        }
        report += &render_table(&topology, g, &sizes, &params);
        report += "\n";
    }
    if topology.len() >= 8 {
        let host = Host::new(topology.prefix(8));
        let (choice, t) = host.choose(FOCUS_BYTES, &params);
        report += &format!(
            "## 8 GPUs, {FOCUS_BYTES} B (bf16 x 7168, one TP8 all-reduce at batch 1, 122 per token)\n"
        );
        report += &render_table(&topology, 8, &[FOCUS_BYTES], &params);
        report += &format!(
            "choice: {} at {t:.2} µs (NCCL {:.2} µs); 122 per token = {:.0} µs/token\n",
            choice.id(),
            host.nccl_us(FOCUS_BYTES, &params),
            122.0 * t
        );
    }
    print!("{report}");
    if let Some(path) = out {
        std::fs::write(&path, &report).map_err(|e| format!("{path}: {e}"))?;
    }
    Ok(())
}
