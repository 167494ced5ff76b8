//! The CPU backend's choices a command line makes, shared by `model run`, `generate`, `serve`
//! and `chat`: the kernels' tactic (from the tuning lab's cache or by hand) and where the
//! weights are read from.

use std::path::Path;

use kernels::cpu_tactic::{CpuChoice, CpuTactic, choose_from_cache, decode_entry_shape};
use kernels::tactic::ProblemShape;

use crate::arch::config::ModelConfig;
use crate::checkpoint::{Checkpoint, WeightPlacement};

/// The CPU kernels' tactic (tile sizes, parallel thresholds, threads): from the tactic cache
/// of `--tactics FILE` (`autotune --cpu --out FILE`), or by hand.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct CpuTacticArgs {
    /// A CPU kernel tactic id, e.g. `moe_item=64k,dense_min=256k,threads=2` (keys left out keep
    /// the default's value); overrides the `--tactics` cache's.
    #[arg(long)]
    pub cpu_tactic: Option<CpuTactic>,
    /// Where the CPU backend reads the weights from: `huge-pages` (a copy on 2 MiB pages,
    /// faster decode), `mapped` (the files' mapping, no copy) or `auto` (huge pages where the
    /// kernel offers them and the copy fits in half of the available memory). Other backends
    /// read the mapping.
    #[arg(long, value_enum, default_value_t = WeightsArg::Auto)]
    pub weights: WeightsArg,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum WeightsArg {
    #[default]
    Auto,
    Mapped,
    HugePages,
}

impl CpuTacticArgs {
    /// Where the CPU backend reads `checkpoint`'s weights from.
    pub fn placement(&self, checkpoint: &Checkpoint) -> WeightPlacement {
        match self.weights {
            WeightsArg::Auto => WeightPlacement::auto(checkpoint.file_bytes()),
            WeightsArg::HugePages => WeightPlacement::HugePages,
            WeightsArg::Mapped => WeightPlacement::Mapped,
        }
    }

    /// The CPU tactic this process runs `config`'s model with, from `--cpu-tactic`, else the
    /// cache at `tactics` (missing, corrupt, stale, or without a CPU entry: the default, and
    /// the line says why), else the default; logs it in one line unless `quiet` (the launcher
    /// of ranks, or a rank other than 0).
    pub fn choose(&self, tactics: Option<&Path>, config: &ModelConfig, quiet: bool) -> CpuTactic {
        let choice = match (&self.cpu_tactic, tactics) {
            (Some(t), _) => CpuChoice {
                tactic: *t,
                description: format!("tactic cpu: {t} (--cpu-tactic)"),
                warning: None,
            },
            (None, Some(path)) => choose_from_cache(path, &decode_shape(config)),
            (None, None) => CpuChoice::default_choice(),
        };
        if !quiet && crate::start_details::start_details_shown() {
            match &choice.warning {
                // The cache's warning (missing, corrupt, or a GPU cache) is printed once, by
                // the GPU families' log of the same file: here only why the default is used.
                Some(w) => eprintln!(
                    "tactic cpu: {} (default; {})",
                    choice.tactic,
                    w.trim_start_matches("warning: ")
                        .trim_end_matches("; using the heuristic defaults")
                        .trim_end_matches("; using the default CPU tactic")
                ),
                None => eprintln!("{}", choice.description),
            }
        }
        choice.tactic
    }
}

/// The shape `autotune --cpu` files a model's decode entry under.
pub fn decode_shape(c: &ModelConfig) -> ProblemShape {
    decode_entry_shape(
        c.hidden_size,
        c.moe_intermediate_size,
        c.n_routed_experts,
        c.num_experts_per_tok,
    )
}
