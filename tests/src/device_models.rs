//! The golden checkpoints on the device runner and on the CPU runner, side by side:
//! loading, prefill and greedy decoding on either, shared by `tests/device_executor.rs` and
//! `tests/device_golden_models.rs`.

use kernels::device::Device;
use kernels::mla::cache::KvCacheDtype;
use model::arch::shard::TpShard;
use model::checkpoint::Checkpoint;
use model::checkpoint::tensor_file::TensorFile;
use model::checkpoint::weights::Model;
use model::exec::cpu::{CpuOptions, cpu_runner};
use model::exec::device::{
    DeviceOptions, DeviceRunner, ExecutorTactics, HostAddressed, ShmAllReduce, StepCapacity,
    device_runner,
};
use model::exec::{LogitRows, ModelRunner, SeqInput, StepOutput, StepResult};

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

/// The device options for `model` (the whole model, or a rank's shard of `world`): the
/// default tactics, a cache and a step workspace of `tokens`.
pub fn device_options<D: Device>(
    dev: &D,
    model: &Model,
    dtype: KvCacheDtype,
    tokens: usize,
    world: usize,
) -> DeviceOptions {
    DeviceOptions {
        kv_dtype: dtype,
        cache_tokens: tokens,
        capacity: StepCapacity {
            tokens,
            logit_rows: tokens,
        },
        tactics: ExecutorTactics::defaults_for_rank(dev.sm().unwrap(), &model.config, dtype, world)
            .unwrap(),
        selector: None,
        fill_memory: None,
        quiet: true,
    }
}

/// A device runner for `model` (the whole model, or a rank's shard of `world`) with the default
/// tactics, a cache and a step workspace of `tokens`.
pub fn executor_for_rank<D: Device>(
    dev: D,
    model: &Model,
    dtype: KvCacheDtype,
    tokens: usize,
    world: usize,
) -> DeviceRunner<D> {
    let options = device_options(&dev, model, dtype, tokens, world);
    device_runner(dev, model, options).unwrap()
}

/// [`executor_for_rank`] of the whole model.
pub fn executor<D: Device>(
    dev: D,
    model: &Model,
    dtype: KvCacheDtype,
    tokens: usize,
) -> DeviceRunner<D> {
    executor_for_rank(dev, model, dtype, tokens, 1)
}

/// Logits of every position of one prefill on the CPU backend.
pub fn cpu_prefill(model: &Model, tokens: &[u32], dtype: KvCacheDtype) -> Vec<f32> {
    cpu_prefill_with(model, tokens, CpuOptions::new(dtype, tokens.len()))
}

/// [`cpu_prefill`] under `options` (with `device_roundings`, rounding where the device
/// kernels do).
pub fn cpu_prefill_with(model: &Model, tokens: &[u32], options: CpuOptions) -> Vec<f32> {
    let mut runner = cpu_runner(model, options);
    let seq = runner.add_sequence();
    runner
        .logits(&[SeqInput { seq, tokens }], LogitRows::All)
        .unwrap()
        .values
}

/// Logits of every position of one prefill on the device runner.
pub fn device_prefill<D: Device>(ex: &mut DeviceRunner<D>, tokens: &[u32]) -> Vec<f32> {
    let seq = ex.add_sequence();
    let out = ex
        .logits(&[SeqInput { seq, tokens }], LogitRows::All)
        .unwrap();
    ex.free_sequence(seq).unwrap();
    out.values
}

/// `new_tokens` greedy tokens after `prompt` on the device (argmax on the device, ids read
/// back).
pub fn greedy_on_device<D: Device>(
    ex: &mut DeviceRunner<D>,
    prompt: &[u32],
    new_tokens: usize,
) -> Vec<u32> {
    let seq = ex.add_sequence();
    let mut next = prompt.to_vec();
    let mut out = Vec::new();
    for _ in 0..new_tokens {
        let StepResult::Ids(ids) = ex
            .run(
                &[SeqInput { seq, tokens: &next }],
                LogitRows::Last,
                StepOutput::Greedy,
                &[],
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

/// `new_tokens` greedy tokens after `prompt` on the CPU backend.
pub fn greedy_on_cpu(
    model: &Model,
    prompt: &[u32],
    new_tokens: usize,
    dtype: KvCacheDtype,
) -> Vec<u32> {
    let options = CpuOptions::new(dtype, prompt.len() + new_tokens);
    greedy_on_cpu_with(model, prompt, new_tokens, options)
}

/// [`greedy_on_cpu`] under `options` (with `device_roundings`, rounding where the device
/// kernels do).
pub fn greedy_on_cpu_with(
    model: &Model,
    prompt: &[u32],
    new_tokens: usize,
    options: CpuOptions,
) -> Vec<u32> {
    let mut runner = cpu_runner(model, options);
    let seq = runner.add_sequence();
    let mut next = prompt.to_vec();
    let mut out = Vec::new();
    for _ in 0..new_tokens {
        let ids = runner
            .step(&[SeqInput { seq, tokens: &next }], &[Default::default()])
            .unwrap();
        out.push(ids[0]);
        next = vec![ids[0]];
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
    ex: &mut DeviceRunner<D>,
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
