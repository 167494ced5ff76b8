//! The golden checkpoints on the device executor and on the CPU forward pass, side by side:
//! loading, prefill and greedy decoding on either, shared by `tests/device_executor.rs` and
//! `tests/device_golden_models.rs`.

use kernels::device::Device;
use kernels::mla::cache::KvCacheDtype;
use model::backend::CpuBackend;
use model::checkpoint::Checkpoint;
use model::executor::{
    DeviceExecutor, ExecutorTactics, HostAddressed, ShmAllReduce, StepCapacity, StepOutput,
    StepResult,
};
use model::forward::{LogitRows, Model, SeqInput};
use model::sampler::argmax;
use model::tensor_file::TensorFile;
use model::weights::TpShard;

use crate::golden_path;

/// The checkpoints of `golden/gen_model.py` with HF W4A4 goldens (`golden.safetensors`): the
/// Kimi-K2.5 layout at the small widths (latent 64, RoPE 16: `kimi-tiny`), DeepSeek-V3 without
/// a query LoRA and with group-limited routing (`dsv3-noqlora-grouped`), DeepSeek-V3 unsharded
/// with 32-column experts (`dsv3-mini-unsharded`), and Kimi-K2.5's own MLA widths
/// (`kimi-kernel-dims`). `kimi-chat-tiny` (trained) has greedy goldens instead
/// (`golden/data/serving/chat_model_golden.json`).
pub const GOLDEN_MODELS: [&str; 4] = [
    "kimi-tiny",
    "dsv3-noqlora-grouped",
    "dsv3-mini-unsharded",
    "kimi-kernel-dims",
];

/// The trained chat model in the Kimi-K2.5 layout (the default embedded model).
pub const CHAT_MODEL: &str = "kimi-chat-tiny";

/// A golden checkpoint as a model.
pub fn load_model(name: &str) -> Model {
    let dir = golden_path("models").join(name);
    let checkpoint = Checkpoint::open(&dir).unwrap_or_else(|e| panic!("{name}: {e}"));
    Model::new(
        checkpoint.model_config().clone(),
        checkpoint
            .load_weights()
            .unwrap_or_else(|e| panic!("{name}: {e}")),
    )
}

/// A golden checkpoint and its HF goldens (`golden.safetensors`).
pub fn load(name: &str) -> (Model, TensorFile) {
    let golden = golden_path("models").join(name).join("golden.safetensors");
    (
        load_model(name),
        TensorFile::open(&golden).unwrap_or_else(|e| panic!("{}: {e}", golden.display())),
    )
}

/// Token ids stored as int64 under `name`.
pub fn ids(golden: &TensorFile, name: &str) -> Vec<u32> {
    golden
        .i64_values(name)
        .unwrap()
        .into_iter()
        .map(|t| t as u32)
        .collect()
}

/// An executor for `model` (the whole model, or a rank's shard of `world`) with the default
/// tactics, a cache and a step workspace of `tokens`.
pub fn executor_for_rank<D: Device>(
    dev: D,
    model: &Model,
    dtype: KvCacheDtype,
    tokens: usize,
    world: usize,
) -> DeviceExecutor<D> {
    let tactics =
        ExecutorTactics::defaults_for_rank(dev.sm().unwrap(), &model.config, dtype, world).unwrap();
    let capacity = StepCapacity {
        tokens,
        logit_rows: tokens,
    };
    DeviceExecutor::new(dev, model, dtype, tokens, capacity, tactics, true).unwrap()
}

/// [`executor_for_rank`] of the whole model.
pub fn executor<D: Device>(
    dev: D,
    model: &Model,
    dtype: KvCacheDtype,
    tokens: usize,
) -> DeviceExecutor<D> {
    executor_for_rank(dev, model, dtype, tokens, 1)
}

/// Logits of every position of one prefill on the CPU forward pass; with
/// [`Model::device_roundings`] it rounds where the device kernels do.
pub fn cpu_prefill(model: &Model, tokens: &[u32], dtype: KvCacheDtype) -> Vec<f32> {
    let mut cache = model.new_cache(dtype, tokens.len());
    let seq = cache.add_sequence();
    model
        .forward(
            &CpuBackend,
            &mut cache,
            &[SeqInput { seq, tokens }],
            LogitRows::All,
            None,
        )
        .unwrap()
        .values
}

/// Logits of every position of one prefill on the device executor.
pub fn device_prefill<D: Device>(ex: &mut DeviceExecutor<D>, tokens: &[u32]) -> Vec<f32> {
    let seq = ex.add_sequence();
    let out = ex
        .step(
            &[SeqInput { seq, tokens }],
            LogitRows::All,
            StepOutput::Logits,
        )
        .unwrap();
    ex.free_sequence(seq).unwrap();
    match out {
        StepResult::Logits(l) => l.values,
        StepResult::Greedy(_) | StepResult::Sampled(_) => unreachable!("asked for logits"),
    }
}

/// `new_tokens` greedy tokens after `prompt` on the device (argmax on the device, ids read
/// back).
pub fn greedy_on_device<D: Device>(
    ex: &mut DeviceExecutor<D>,
    prompt: &[u32],
    new_tokens: usize,
) -> Vec<u32> {
    let seq = ex.add_sequence();
    let mut next = prompt.to_vec();
    let mut out = Vec::new();
    for _ in 0..new_tokens {
        let StepResult::Greedy(ids) = ex
            .step(
                &[SeqInput { seq, tokens: &next }],
                LogitRows::Last,
                StepOutput::Greedy,
            )
            .unwrap()
        else {
            unreachable!("asked for greedy ids")
        };
        out.push(ids[0]);
        next = vec![ids[0]];
    }
    ex.free_sequence(seq).unwrap();
    out
}

/// `new_tokens` greedy tokens after `prompt` on the CPU forward pass.
pub fn greedy_on_cpu(
    model: &Model,
    prompt: &[u32],
    new_tokens: usize,
    dtype: KvCacheDtype,
) -> Vec<u32> {
    let mut cache = model.new_cache(dtype, prompt.len() + new_tokens);
    let seq = cache.add_sequence();
    let mut next = prompt.to_vec();
    let mut out = Vec::new();
    for _ in 0..new_tokens {
        let logits = model
            .forward(
                &CpuBackend,
                &mut cache,
                &[SeqInput { seq, tokens: &next }],
                LogitRows::Last,
                None,
            )
            .unwrap();
        out.push(argmax(logits.row(0)));
        next = vec![*out.last().unwrap()];
    }
    out
}

/// Every rank's shard of `model` over `world` tensor-parallel ranks, as `--tp world` splits it.
pub fn shards(model: &Model, world: usize) -> Vec<Model> {
    (0..world)
        .map(|rank| {
            let weights = model
                .weights
                .shard(&model.config, TpShard { rank, world })
                .unwrap();
            Model::new(model.config.clone(), weights)
        })
        .collect()
}

/// Makes `ex` rank `rank` of `world` ranks that sum their partial products with the
/// all-reduce kernel over the shared-memory `segment`, for steps of up to `tokens` rows.
pub fn join_tp_group<D: HostAddressed + 'static>(
    ex: &mut DeviceExecutor<D>,
    segment: &str,
    rank: usize,
    world: usize,
    tokens: usize,
) {
    let all_reduce = ShmAllReduce::join(
        ex.device(),
        segment,
        rank,
        world,
        tokens * ex.config().hidden_size * 4,
        std::time::Duration::from_secs(120),
    )
    .unwrap();
    ex.set_all_reduce(Box::new(all_reduce)).unwrap();
}

/// The model cut to its first `layers` layers (the dense first layer, where no expert choice
/// can flip, when `layers` is 1).
pub fn first_layers(model: &Model, layers: usize) -> Model {
    let mut config = model.config.clone();
    config.num_hidden_layers = layers;
    let mut weights = model.weights.clone();
    weights.layers.truncate(layers);
    Model::new(config, weights)
}
