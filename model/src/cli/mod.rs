//! The `model` command: its subcommands, their arguments, and how errors become exit codes.
//!
//! Errors print as one `Error:` line with the cause chain. Exit codes:
//! - 0: done (`--help` and `--version` included);
//! - 1: a failure while working (I/O, a tensor-parallel rank, activations that became NaN or
//!   Inf, generation that failed), or a check that ran and failed (`compare-logits` beyond its
//!   bound). A panic is a bug: it is reported the same way with exit code 1, never Rust's 101;
//! - 2: input refused before any work: a flag clap rejects or a value out of range, a config
//!   value, a checkpoint that is missing, unreadable, damaged or not in the Hugging Face cache,
//!   an output that would destroy an input, a plan whose weights do not fit;
//! - 128 + N: ended by signal N (130 for Ctrl-C) after removing its temporaries.

pub mod args;
pub mod compare;
pub mod inspect;
pub mod logits;
pub mod plan;
pub mod run;
pub mod serving;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand};
use kernels::files::FileError;

use crate::arch::config::ConfigError;
use crate::arch::presets::Preset;
use crate::checkpoint::CheckpointError;
pub use crate::checkpoint::hub::resolve_checkpoint;
use crate::checkpoint::tensor_file::TensorFileError;
pub use crate::checkpoint::{check_tensor_parallel, load_model as load};
use crate::exec::error::ExecError;
use crate::exec::tp::RankFailed;
use crate::input::InvalidInput;
use crate::quantize::generator::generate_checkpoint;
use crate::quantize::quantize_checkpoint;
use crate::text::chat_template::TemplateError;
use crate::text::tokenizer::TokenizerError;

pub use self::args::{
    KvDtypeArg, at_least_one, fraction, kv_dtype_for, positive_finite, resolve_kv_dtype,
};
use self::logits::LogitsArgs;
use self::plan::{LaunchListArgs, PlanArgs};
use self::run::RunArgs;
use self::serving::{ChatArgs, ServeArgs, TokenizeArgs};

#[derive(Parser)]
#[command(
    name = "model",
    version,
    about = "Kimi-K2.5-NVFP4 on CPU and GPU: chat, serve, run, score, generate, quantize, plan, inspect"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
pub enum Command {
    /// Chat in the terminal: streamed answers, reasoning dimmed, tok/s (default: the small
    /// trained `kimi-chat-tiny`). With no command at all, `model` asks it one question.
    Chat(ChatArgs),
    /// An OpenAI-compatible HTTP server with continuous batching (`/v1/chat/completions`,
    /// `/v1/completions`, `/v1/models`, `/health`, `/metrics`).
    Serve(ServeArgs),
    /// Text on stdin to token ids, printed as one JSON array (needs only the tokenizer files).
    Tokenize(TokenizeArgs),
    /// Run the decode loop on CPU (default: the generated `mini` model, made once and cached).
    Run(RunArgs),
    /// Score a prompt: logits for every position from one prefill, as float32 `[T, vocab]`.
    Logits(LogitsArgs),
    /// Compare two `[T, vocab]` logits tensors per position (rel L2, top-1), e.g. a device
    /// backend's against the CPU's or a golden; exit 1 when a position exceeds the bound.
    CompareLogits {
        /// `FILE[:TENSOR]` (default tensor `logits`).
        candidate: String,
        /// `FILE[:TENSOR]`, e.g. `golden.safetensors:logits_w4a4`.
        reference: String,
        /// The largest relative L2 error a position may have (unless --as-close-as).
        #[arg(long, default_value_t = 1e-2, value_parser = args::non_negative_finite)]
        max_rel_l2: f64,
        /// Instead of --max-rel-l2: pass when the candidate's median error is at most 1.5×
        /// this other candidate's and its top-1 agreement at most 0.1 lower (a device backend
        /// "as close to the golden as the CPU", where a random model's near-tied expert
        /// choices make pointwise bounds meaningless).
        #[arg(long, value_name = "FILE[:TENSOR]")]
        as_close_as: Option<String>,
    },
    /// Write a random-weight model in the Kimi-K2.5-NVFP4 layout.
    GenerateCheckpoint {
        /// The model's shapes.
        #[arg(long, value_enum)]
        preset: Preset,
        /// The folder to write (new or empty, unless --force).
        #[arg(long)]
        out: PathBuf,
        /// Seed of the random weights: the same seed writes the same files.
        #[arg(long, default_value_t = 20261129)]
        seed: u64,
        /// Replace an existing output as a whole (without it, only a new or empty folder).
        #[arg(long)]
        force: bool,
    },
    /// Quantize a BF16 DeepSeek-V3 / Kimi checkpoint's routed experts to NVFP4 (ModelOpt
    /// layout), calibrating `input_scale` on a forward pass. Given a single `.safetensors`
    /// file instead, quantizes each 2-D `*.weight` tensor in it.
    Quantize {
        /// A BF16 checkpoint folder (or a Hugging Face repository id in the local cache), or
        /// one `.safetensors` file.
        #[arg(long)]
        input: PathBuf,
        /// A new folder (or file); never the input, inside it, or around it.
        #[arg(long)]
        output: PathBuf,
        /// Tokens of the calibration forward pass that sets each expert's `input_scale`.
        #[arg(long, default_value_t = 256)]
        calib_tokens: usize,
        /// Seed of the calibration tokens.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Replace an existing output as a whole (without it, only a new or empty folder).
        #[arg(long)]
        force: bool,
    },
    /// Memory per GPU under tensor parallelism and the longest context that fits.
    Plan(PlanArgs),
    /// The launch list of one decode step of a rank, recorded from the device executor on a
    /// dry device (no kernel runs, no weights are held): kernel, grid, bytes per launch, and
    /// totals per kernel.
    LaunchList(LaunchListArgs),
    /// Summarize a checkpoint directory or one safetensors file.
    Inspect {
        /// A checkpoint folder, a Hugging Face repository id in the local cache
        /// (`nvidia/Kimi-K2.5-NVFP4`), or one `.safetensors` file.
        path: PathBuf,
    },
}

/// The `model` binary.
pub fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if !e.use_stderr() => {
            // --help and --version.
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            let text = e.render().to_string();
            let text = text.strip_prefix("error: ").unwrap_or(&text);
            eprint!("Error: {text}");
            return ExitCode::from(2);
        }
    };
    // Output into a closed pipe (`model inspect DIR | head -1`) ends the process quietly, as
    // it does every Unix tool, instead of a panic in `println!`. Not for the server: a client
    // that hangs up must cost it a write error, not its life.
    if !matches!(cli.command, Some(Command::Serve(_))) {
        // SAFETY: setting a signal disposition before any thread exists.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    crate::exec::cpu::heap::keep_freed_activations();
    std::panic::set_hook(Box::new(|info| {
        eprintln!("Error: internal failure (a bug, please report it): {info}");
    }));
    match std::panic::catch_unwind(|| dispatch(cli)) {
        Ok(Ok(())) => ExitCode::SUCCESS,
        Ok(Err(error)) => {
            crate::cleanup::wait_if_interrupted();
            eprintln!("Error: {}", cause_chain(&error));
            ExitCode::from(exit_code(&error))
        }
        // The hook has reported it.
        Err(_) => ExitCode::from(1),
    }
}

/// The error and its causes on one line, each said once.
fn cause_chain(error: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in error.chain() {
        let cause = cause.to_string();
        // A cause that brings its own prefix (a library's message) must not double ours.
        let cause = cause.trim_start_matches("Error: ");
        if text.contains(cause) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(cause);
    }
    text
}

/// 2 when the error is about input the engine refuses (the files and text it was given
/// included), 1 otherwise (a rank reports its own
/// code through the launcher).
fn exit_code(error: &anyhow::Error) -> u8 {
    for cause in error.chain() {
        let refused = cause.is::<InvalidInput>()
            || cause.is::<ConfigError>()
            || cause.is::<CheckpointError>()
            || cause.is::<TensorFileError>()
            || cause.is::<FileError>()
            || cause.is::<TokenizerError>()
            || cause
                .downcast_ref::<TemplateError>()
                .is_some_and(|e| matches!(e, TemplateError::Load { .. }))
            // What `read_to_string` and `read_line` say of text that is not UTF-8 (stdin).
            || cause
                .downcast_ref::<std::io::Error>()
                .is_some_and(|e| e.kind() == std::io::ErrorKind::InvalidData)
            || cause
                .downcast_ref::<ExecError>()
                .is_some_and(|e| e.is_invalid_input() || e.is_unsupported());
        if refused {
            return 2;
        }
        if let Some(failed) = cause.downcast_ref::<RankFailed>() {
            return if failed.status.code() == Some(2) {
                2
            } else {
                1
            };
        }
    }
    1
}

fn dispatch(cli: Cli) -> Result<()> {
    // No subcommand: the front door's main job, a question in, reasoning and answer out.
    let command = match cli.command {
        Some(command) => command,
        None => Command::Chat(serving::demo_chat_args()),
    };
    match command {
        Command::Chat(args) => serving::run_chat(args),
        Command::Serve(args) => serving::run_serve(args),
        Command::Tokenize(args) => serving::run_tokenize(args),
        Command::Run(args) => run::run(args),
        Command::Logits(args) => logits::logits(args),
        Command::CompareLogits {
            candidate,
            reference,
            max_rel_l2,
            as_close_as,
        } => logits::compare_logits(&candidate, &reference, max_rel_l2, as_close_as.as_deref()),
        Command::GenerateCheckpoint {
            preset,
            out,
            seed,
            force,
        } => {
            generate_checkpoint(preset, &out, seed, force)?;
            println!("wrote the {} preset to {}", preset.id(), out.display());
            Ok(())
        }
        Command::Quantize {
            input,
            output,
            calib_tokens,
            seed,
            force,
        } => {
            let input = resolve_checkpoint("--input", &input)?;
            if input.is_file() {
                inspect::quantize_file(&input, &output, force)
            } else {
                quantize_checkpoint(&input, &output, calib_tokens, seed, 4 << 30, force)?;
                println!("wrote NVFP4 checkpoint {}", output.display());
                Ok(())
            }
        }
        Command::Plan(args) => plan::plan_command(args),
        Command::LaunchList(args) => plan::launch_list_command(args),
        Command::Inspect { path } => {
            let path = resolve_checkpoint("inspect", &path)?;
            if path.is_dir() {
                inspect::inspect_checkpoint(&path)
            } else {
                inspect::inspect_file(&path)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    /// Every argument of every subcommand, at any depth, as `PATH: --flag`, that has no help
    /// line (clap's own `--help` and `--version` aside).
    fn arguments_without_help(command: &clap::Command, path: &str, found: &mut Vec<String>) {
        for arg in command.get_arguments() {
            let id = arg.get_id().as_str();
            if id == "help" || id == "version" {
                continue;
            }
            let help = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
            if help.trim().is_empty() {
                let name = match arg.get_long() {
                    Some(long) => format!("--{long}"),
                    None => id.to_string(),
                };
                found.push(format!("{path}: {name}"));
            }
        }
        for sub in command.get_subcommands() {
            if sub.get_name() == "help" {
                continue;
            }
            let sub_path = format!("{path} {}", sub.get_name());
            if sub.get_about().is_none() {
                found.push(format!("{sub_path}: no about line"));
            }
            arguments_without_help(sub, &sub_path, found);
        }
    }

    #[test]
    fn every_argument_of_every_subcommand_has_a_help_line() {
        let command = Cli::command();
        command.clone().debug_assert();
        let mut found = Vec::new();
        arguments_without_help(&command, "model", &mut found);
        assert!(
            found.is_empty(),
            "arguments without help:\n{}",
            found.join("\n")
        );
        // The walk reaches the flattened engine and backend arguments.
        let chat = command.find_subcommand("chat").unwrap();
        for flag in ["seed", "temperature", "checkpoint", "backend", "verbose"] {
            assert!(
                chat.get_arguments().any(|a| a.get_long() == Some(flag)),
                "chat has --{flag}"
            );
        }
    }

    #[test]
    fn the_exit_code_of_a_missing_checkpoint_is_2() {
        let missing = std::path::Path::new("/nonexistent-checkpoint-folder/of/a/test");
        let error = anyhow::Error::new(resolve_checkpoint("--checkpoint", missing).unwrap_err());
        assert_eq!(exit_code(&error), 2);
        let error = anyhow::Error::new(
            resolve_checkpoint(
                "--checkpoint",
                std::path::Path::new("nobody-owns/this-repo"),
            )
            .unwrap_err(),
        );
        assert_eq!(exit_code(&error), 2);
        assert!(
            error
                .to_string()
                .contains("hf download nobody-owns/this-repo"),
            "{error}"
        );
    }
}
