//! Does `autotune --cpu` speed up `model run`? Decode tok/s of the `model` binary with the
//! default CPU tactic (A) and with a tactic cache (B), in interleaved rounds A B A B …, on
//! the embedded `kimi-chat-tiny` and the generated `mini` model. The table (medians, spreads,
//! every round) goes to stdout; `--write-results` also writes `bench/results/cpu-tuning.txt`.
//!
//! ```sh
//! cargo build --release -p model -p autotune
//! target/release/autotune --cpu --out /tmp/mini.json
//! cargo run --release -p bench --bin cpu-tuning -- --only mini --tactics /tmp/mini.json
//! ```
//! (`scripts/cpu-tuning.sh` does all three, with one cache per model.) `--help` lists the
//! options.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use bench::cpu_tactics::median_spread;
use bench::{cpu_model, load_average, utc_date};

/// Decode tok/s of `model run` with the default CPU tactic (A) and a tactic cache (B), in
/// interleaved rounds; the table goes to stdout.
#[derive(clap::Parser, Debug)]
#[command(name = "cpu-tuning")]
struct Options {
    /// The tactic cache of side B (written by `autotune --cpu --out FILE`); required unless
    /// --print-checkpoint.
    #[arg(long, required_unless_present = "print_checkpoint")]
    tactics: Option<PathBuf>,
    /// Rounds per side.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// The `model` binary (default: `model` next to this binary).
    #[arg(long)]
    model_bin: Option<PathBuf>,
    /// Tokens each `model run` decodes.
    #[arg(long, default_value_t = 64)]
    max_new_tokens: usize,
    /// Only this model.
    #[arg(long, value_enum)]
    only: Option<Which>,
    /// Also write the table to this file.
    #[arg(long, conflicts_with = "write_results")]
    out: Option<PathBuf>,
    /// Also write the table to bench/results/cpu-tuning.txt (from the repository root).
    #[arg(long)]
    write_results: bool,
    /// Print the model's folder (unpacked or generated if needed) and exit, for scripts.
    #[arg(long, value_enum, exclusive = true)]
    print_checkpoint: Option<Which>,
}

/// The two models the comparison runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Which {
    /// The embedded kimi-chat-tiny.
    Tiny,
    /// The generated mini.
    Mini,
}

impl Which {
    fn checkpoint(self) -> Result<PathBuf> {
        match self {
            Which::Tiny => model::cli::serving::default_chat_checkpoint(None),
            Which::Mini => model::quantize::generator::default_checkpoint(None),
        }
    }
}

/// Decode tok/s and the CPU tactic line of one `model run`.
fn run_once(o: &Options, checkpoint: &Path, tactics: Option<&Path>) -> Result<(f64, String)> {
    let model_bin = o.model_bin.as_deref().expect("main sets the model binary");
    let mut cmd = Command::new(model_bin);
    cmd.arg("run")
        .arg("--checkpoint")
        .arg(checkpoint)
        .args(["--ignore-eos", "--prompt-len", "16", "--max-new-tokens"])
        .arg(o.max_new_tokens.to_string());
    if let Some(t) = tactics {
        cmd.arg("--tactics").arg(t);
    }
    let out = cmd
        .output()
        .with_context(|| format!("running {}", model_bin.display()))?;
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    if !out.status.success() {
        bail!("model run failed ({}): {stderr}", out.status);
    }
    let tok_s = stdout
        .lines()
        .find(|l| l.starts_with("decode:"))
        .and_then(|l| l.rsplit('=').next())
        .and_then(|v| {
            v.trim()
                .trim_end_matches("tok/s")
                .trim()
                .parse::<f64>()
                .ok()
        })
        .with_context(|| format!("no decode tok/s in: {stdout}"))?;
    let tactic = stderr
        .lines()
        .chain(stdout.lines())
        .find(|l| l.contains("tactic cpu"))
        .unwrap_or("(no tactic line)")
        .trim()
        .to_string();
    if tactics.is_some() && !tactic.contains("tactic cache") {
        // B must run the cache's tactic: a stale cache (say, built from other kernel sources
        // than this `model`) would silently compare the default with itself.
        bail!("`model run --tactics` did not use the cache: {tactic}");
    }
    Ok((tok_s, tactic))
}

fn main() -> Result<()> {
    // As `model run` does: its steps' freed activations stay in the heap.
    model::exec::cpu::heap::keep_freed_activations();
    let mut o: Options = clap::Parser::parse();
    if let Some(which) = o.print_checkpoint {
        println!("{}", which.checkpoint()?.display());
        return Ok(());
    }
    let tactics = o.tactics.clone().expect("clap requires --tactics");
    if o.model_bin.is_none() {
        o.model_bin = Some(
            std::env::current_exe()?
                .parent()
                .context("the binary's folder")?
                .join("model"),
        );
    }
    let out = bench::report_path(o.out.as_deref(), o.write_results, "cpu-tuning.txt");
    let mut models: Vec<(&str, PathBuf)> = Vec::new();
    if o.only != Some(Which::Mini) {
        models.push(("kimi-chat-tiny (embedded)", Which::Tiny.checkpoint()?));
    }
    if o.only != Some(Which::Tiny) {
        models.push(("mini (generated)", Which::Mini.checkpoint()?));
    }
    let mut text = format!(
        "# model run decode tok/s: default CPU tactic (A) vs `--tactics {}` (B), measured\n\
         # CPU: {} ({} threads, kernels' ISA {}); {}; load average at the start: {}\n\
         # interleaved rounds A B A B …, {} per side; each round one `model run --prompt-len 16 \
         --max-new-tokens {} --ignore-eos` process (release)\n\
         # spread = (max - min) / median\n\n",
        // The file's name: a committed report names no machine's paths.
        tactics
            .file_name()
            .unwrap_or(tactics.as_os_str())
            .to_string_lossy(),
        cpu_model(),
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        kernels::isa::Isa::detect(),
        utc_date(),
        load_average(),
        o.rounds,
        o.max_new_tokens
    );
    for (name, dir) in &models {
        let (mut a, mut b) = (Vec::new(), Vec::new());
        let (mut tactic_a, mut tactic_b) = (String::new(), String::new());
        // One unrecorded warm-up of each side: page cache, CPU frequency.
        run_once(&o, dir, None)?;
        run_once(&o, dir, Some(&tactics))?;
        for round in 0..o.rounds {
            let (x, ta) = run_once(&o, dir, None)?;
            let (y, tb) = run_once(&o, dir, Some(&tactics))?;
            eprintln!("{name} round {round}: A {x:.1} tok/s, B {y:.1} tok/s");
            a.push(x);
            b.push(y);
            (tactic_a, tactic_b) = (ta, tb);
        }
        let rounds: Vec<String> = a
            .iter()
            .zip(&b)
            .map(|(x, y)| format!("{x:.1}/{y:.1}"))
            .collect();
        let (ma, sa) = median_spread(&mut a.clone());
        let (mb, sb) = median_spread(&mut b.clone());
        text.push_str(&format!(
            "## {name}\n\
             A default: median {ma:.1} tok/s, spread {:.1}%, n {}   [{tactic_a}]\n\
             B tuned:   median {mb:.1} tok/s, spread {:.1}%, n {}   [{tactic_b}]\n\
             B / A: {:.3}\n\
             rounds A/B: {}\n\n",
            sa * 100.0,
            a.len(),
            sb * 100.0,
            b.len(),
            mb / ma,
            rounds.join("  ")
        ));
    }
    bench::emit_report(&text, out.as_deref())
}
