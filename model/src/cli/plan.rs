//! `model plan` (memory per GPU under tensor parallelism, the longest context that fits) and
//! `model launch-list` (one decode step's launches, recorded on a dry device).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use kernels::mla::cache::KvCacheDtype;

use super::args::{at_least_one, fraction, positive_finite};
use crate::arch::config::ModelConfig;
use crate::arch::presets::Preset;
use crate::arch::shard::TpShard;
use crate::checkpoint::hub::resolve_checkpoint;
use crate::checkpoint::{Checkpoint, check_tensor_parallel};
use crate::exec::backend::parse_sm;
use crate::exec::plan::{GIB, PlanRequest, fewest_gpus_that_fit, plan};
use crate::input::InvalidInput;

#[derive(clap::Args)]
pub struct PlanArgs {
    /// A checkpoint folder, or a Hugging Face repository id in the local cache
    /// (`nvidia/Kimi-K2.5-NVFP4`): its config is planned (weights are not read).
    #[arg(long, conflicts_with = "preset")]
    checkpoint: Option<PathBuf>,
    /// A built-in model's shapes instead of a checkpoint.
    #[arg(long, value_enum)]
    preset: Option<Preset>,
    /// GPUs in the tensor-parallel group; the model must split evenly over them.
    #[arg(long, default_value_t = 8, value_parser = at_least_one)]
    gpus: usize,
    /// Memory of each GPU in GiB (96: RTX PRO 6000).
    #[arg(long, default_value_t = 96.0, value_parser = positive_finite)]
    gpu_mem_gib: f64,
    /// Share of each GPU's memory the engine may use, in (0, 1].
    #[arg(long, default_value_t = 0.90, value_parser = fraction)]
    memory_utilization: f64,
    /// `bf16` or `fp8`; without it both are shown.
    #[arg(long)]
    kv_dtype: Option<String>,
    /// The context to check for, in tokens. Default: the model's max_position_embeddings.
    #[arg(long, value_parser = at_least_one)]
    max_model_len: Option<usize>,
    /// Tokens per forward pass the activation workspace is sized for.
    #[arg(long, default_value_t = 8192, value_parser = at_least_one)]
    max_batched_tokens: usize,
    /// Sequences per step (rows of logits the workspace holds).
    #[arg(long, default_value_t = 256, value_parser = at_least_one)]
    max_num_seqs: usize,
}

#[derive(clap::Args)]
pub struct LaunchListArgs {
    /// The built-in model whose step is listed.
    #[arg(long, value_enum, default_value = "kimi-k2.5")]
    preset: Preset,
    /// Ranks of the tensor-parallel group; the list is rank `--rank`'s.
    #[arg(long, default_value_t = 8, value_parser = at_least_one)]
    tp: usize,
    /// The rank whose launches are listed, in 0..--tp.
    #[arg(long, default_value_t = 0)]
    rank: usize,
    /// Sequences in the decode step.
    #[arg(long, default_value_t = 1, value_parser = at_least_one)]
    batch: usize,
    /// Tokens every sequence attends over (its new one included).
    #[arg(long, default_value_t = 4096, value_parser = at_least_one)]
    context: usize,
    /// `bf16` or `fp8`.
    #[arg(long, default_value = "bf16")]
    kv_dtype: String,
    /// The SM whose limits and tactics apply: 120 (RTX PRO 6000) or 90 (H200).
    #[arg(long, default_value = "120", value_parser = parse_sm)]
    sm: kernels::arch::Sm,
    /// Tactic cache (`autotune ... --out FILE`) to take the MoE and MLA tactics from; without
    /// it, the heuristic defaults.
    #[arg(long, value_parser = kernels::tactic::cache::cache_path_arg)]
    tactics: Option<PathBuf>,
    /// Also write the list to this file.
    #[arg(long)]
    out: Option<PathBuf>,
}

/// The most sequences a listed step may hold: vLLM's largest default `max_num_seqs` (its
/// decode graphs stop at 512). The recording keeps ~0.4 MB per sequence (measured), so a batch
/// of 10⁹ would need hundreds of TB.
pub const LAUNCH_LIST_MAX_BATCH: usize = 1024;

pub fn launch_list_command(args: LaunchListArgs) -> Result<()> {
    use crate::exec::device::DryStep;
    use crate::exec::tactics::TacticSelector;
    let config = args.preset.model_config();
    if args.rank >= args.tp {
        bail!(InvalidInput(format!(
            "--rank {} of --tp {}: ranks are 0..{}",
            args.rank, args.tp, args.tp
        )));
    }
    check_tensor_parallel(Path::new(args.preset.id()), &config, args.tp)?;
    let kv_dtype = KvCacheDtype::parse(&args.kv_dtype).ok_or_else(|| {
        InvalidInput(format!(
            "--kv-dtype {}: expected bf16 or fp8",
            args.kv_dtype
        ))
    })?;
    if args.batch > LAUNCH_LIST_MAX_BATCH {
        bail!(InvalidInput(format!(
            "--batch {}: a listed step holds at most {LAUNCH_LIST_MAX_BATCH} sequences",
            args.batch
        )));
    }
    if args.context > config.max_position_embeddings {
        bail!(InvalidInput(format!(
            "--context {}: the model's max_position_embeddings is {}",
            args.context, config.max_position_embeddings
        )));
    }
    let (selector, warning) = TacticSelector::from_cache(
        args.tactics.as_deref(),
        args.sm,
        &config,
        kv_dtype,
        args.tp,
        kernels::blas::DenseTactic::default(),
    );
    if let Some(w) = &warning {
        eprintln!("{w}");
    }
    let tactics_source = match (&args.tactics, &warning) {
        (Some(path), None) => format!("per step from the tactic cache {}", path.display()),
        _ => "heuristic defaults".to_string(),
    };
    let step = DryStep {
        model: args.preset.id().into(),
        config,
        sm: args.sm,
        shard: TpShard {
            rank: args.rank,
            world: args.tp,
        },
        batch: args.batch,
        context: args.context,
        kv_dtype,
        selector,
        tactics_source,
    }
    .record()?;
    let mut regenerate = format!(
        "cargo run --release -p model -- launch-list --preset {} --tp {} --rank {} --batch {} \
         --context {} --kv-dtype {} --sm {}",
        args.preset.id(),
        args.tp,
        args.rank,
        args.batch,
        args.context,
        kv_dtype.id(),
        args.sm
    );
    if let Some(t) = &args.tactics {
        regenerate += &format!(" --tactics {}", t.display());
    }
    if let Some(o) = &args.out {
        regenerate += &format!(" --out {}", o.display());
    }
    let text = step.render(&regenerate);
    print!("{text}");
    if let Some(path) = &args.out {
        std::fs::write(path, &text).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

pub fn plan_command(args: PlanArgs) -> Result<()> {
    let (config, nvfp4, model) = match (&args.checkpoint, args.preset) {
        (Some(arg), _) => {
            let dir = &resolve_checkpoint("--checkpoint", arg)?;
            let checkpoint = Checkpoint::open(dir)?;
            let nvfp4 = checkpoint.config.quant.is_some();
            (checkpoint.model_config().clone(), nvfp4, dir.clone())
        }
        (None, Some(preset)) => (preset.model_config(), true, PathBuf::from(preset.id())),
        (None, None) => bail!(InvalidInput(
            "give --checkpoint DIR or --preset NAME".into()
        )),
    };
    // The split `run --tp` would refuse is no plan.
    check_tensor_parallel(&model, &config, args.gpus)?;
    let dtypes = match &args.kv_dtype {
        Some(text) => vec![
            KvCacheDtype::parse(text)
                .ok_or_else(|| InvalidInput(format!("--kv-dtype {text}: expected bf16 or fp8")))?,
        ],
        None => vec![KvCacheDtype::Bf16, KvCacheDtype::Fp8E4m3],
    };
    let request = |kv_dtype| PlanRequest {
        gpus: args.gpus,
        gpu_mem_gib: args.gpu_mem_gib,
        memory_utilization: args.memory_utilization,
        kv_dtype,
        max_model_len: args.max_model_len.unwrap_or(config.max_position_embeddings),
        max_batched_tokens: args.max_batched_tokens,
        max_num_seqs: args.max_num_seqs,
        nvfp4_experts: nvfp4,
    };
    // The weights and reserves do not depend on the cache's dtype: one check for all.
    check_weights_fit(&config, &request(dtypes[0]))?;
    let mut contexts = Vec::new();
    for kv_dtype in dtypes {
        let request = request(kv_dtype);
        let result = plan(&config, &request);
        println!("{}", result.render(&request));
        contexts.push((kv_dtype, result.max_context_tokens));
    }
    if let [(_, bf16), (_, fp8)] = contexts.as_slice()
        && *bf16 > 0
    {
        println!(
            "an FP8 latent cache holds {:.2}x the context of a BF16 one ({fp8} vs {bf16} tokens)",
            *fp8 as f64 / *bf16 as f64
        );
    }
    Ok(())
}

/// The most GPUs the search for a split that fits tries.
const MOST_GPUS_SEARCHED: usize = 1024;

/// Refuses a plan whose weights, runtime reserve and activations leave no room for the latent
/// cache on each GPU, saying how many GPUs would (the same plan, at each split the model
/// accepts).
fn check_weights_fit(config: &ModelConfig, request: &PlanRequest) -> Result<()> {
    let planned = plan(config, request);
    if planned.weights_fit() {
        return Ok(());
    }
    let splits = |gpus: usize| config.check_tensor_parallel(gpus).is_ok();
    let need = match fewest_gpus_that_fit(config, request, MOST_GPUS_SEARCHED, splits) {
        Some(gpus) => format!("need >= {gpus} GPUs"),
        None => format!(
            "no split over up to {MOST_GPUS_SEARCHED} GPUs fits; more memory per GPU is needed"
        ),
    };
    let gib = |bytes: f64| bytes / GIB;
    bail!(InvalidInput(format!(
        "--gpus {}: weights {:.1} GiB > usable {:.1} GiB per GPU ({:.1} GiB at {:.0}%, less \
         {:.1} GiB of runtime reserve and {:.1} GiB of activations for --max-batched-tokens \
         {}); {need}",
        request.gpus,
        gib(planned.weights),
        gib(planned.usable_for_weights()).max(0.0),
        request.gpu_mem_gib,
        request.memory_utilization * 100.0,
        gib(planned.runtime_reserve),
        gib(planned.activation_reserve),
        request.max_batched_tokens,
    )))
}
