//! Does `autotune --cpu` speed up `model run`? Decode tok/s of the `model` binary with the
//! default CPU tactic (A) and with a tactic cache (B), in interleaved rounds A B A B …, on
//! the embedded `kimi-chat-tiny` and the generated `mini` model. Writes
//! `bench/results/cpu-tuning.txt` (medians, spreads, every round).
//!
//! ```sh
//! cargo build --release -p model -p autotune
//! target/release/autotune --cpu --out cpu-tactics.json
//! cargo run --release -p bench --bin cpu-tuning -- --tactics cpu-tactics.json
//! ```
//! (`scripts/cpu-tuning.sh` does all three, with one cache per model.) Options: `--rounds N`
//! (default 5 per side), `--model-bin PATH` (default: `model` next to this binary),
//! `--max-new-tokens N`, `--only tiny|mini`, `--out FILE`, `--no-write`,
//! `--print-checkpoint tiny|mini` (print the model's folder and exit).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use bench::cpu_tactics::median_spread;
use bench::{cpu_model, load_average, utc_date};

struct Options {
    tactics: PathBuf,
    rounds: usize,
    model_bin: PathBuf,
    max_new_tokens: usize,
    only: Option<String>,
    /// Where the table goes; default `bench/results/cpu-tuning.txt`.
    out: Option<PathBuf>,
    write: bool,
}

fn options() -> Result<Options> {
    let mut args = std::env::args().skip(1);
    let mut o = Options {
        tactics: PathBuf::new(),
        rounds: 5,
        model_bin: std::env::current_exe()?
            .parent()
            .context("the binary's folder")?
            .join("model"),
        max_new_tokens: 64,
        only: None,
        out: None,
        write: true,
    };
    while let Some(a) = args.next() {
        let mut value = || args.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--tactics" => o.tactics = value()?.into(),
            "--rounds" => o.rounds = value()?.parse()?,
            "--model-bin" => o.model_bin = value()?.into(),
            "--max-new-tokens" => o.max_new_tokens = value()?.parse()?,
            "--only" => o.only = Some(value()?),
            "--no-write" => o.write = false,
            "--out" => o.out = Some(value()?.into()),
            "--print-checkpoint" => {
                // The folder of `tiny` or `mini` (unpacked or generated if needed), for scripts.
                let dir = match value()?.as_str() {
                    "tiny" => model::cli::serving::default_chat_checkpoint(None)?,
                    "mini" => model::quantize::generator::default_checkpoint(None)?,
                    other => bail!("--print-checkpoint tiny|mini, not {other}"),
                };
                println!("{}", dir.display());
                std::process::exit(0);
            }
            _ => bail!("unknown argument {a}"),
        }
    }
    if o.tactics.as_os_str().is_empty() {
        bail!("--tactics FILE (a cache written by `autotune --cpu`) is required");
    }
    Ok(o)
}

/// Decode tok/s and the CPU tactic line of one `model run`.
fn run_once(o: &Options, checkpoint: &Path, tactics: Option<&Path>) -> Result<(f64, String)> {
    let mut cmd = Command::new(&o.model_bin);
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
        .with_context(|| format!("running {}", o.model_bin.display()))?;
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
    let o = options()?;
    let mut models: Vec<(&str, PathBuf)> = Vec::new();
    if o.only.as_deref() != Some("mini") {
        models.push((
            "kimi-chat-tiny (embedded)",
            model::cli::serving::default_chat_checkpoint(None)?,
        ));
    }
    if o.only.as_deref() != Some("tiny") {
        models.push((
            "mini (generated)",
            model::quantize::generator::default_checkpoint(None)?,
        ));
    }
    let mut text = format!(
        "# model run decode tok/s: default CPU tactic (A) vs `--tactics {}` (B), measured\n\
         # CPU: {} ({} threads, kernels' ISA {:?}); {}; load average at the start: {}\n\
         # interleaved rounds A B A B …, {} per side; each round one `model run --prompt-len 16 \
         --max-new-tokens {} --ignore-eos` process (release)\n\
         # spread = (max - min) / median\n\n",
        o.tactics.display(),
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
        run_once(&o, dir, Some(&o.tactics))?;
        for round in 0..o.rounds {
            let (x, ta) = run_once(&o, dir, None)?;
            let (y, tb) = run_once(&o, dir, Some(&o.tactics))?;
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
    print!("{text}");
    if o.write {
        let path = o.out.clone().unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("results/cpu-tuning.txt")
        });
        std::fs::write(&path, &text)?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}
