//! NVFP4 quantization of a model's routed experts, as ModelOpt exports it: weights with
//! per-16 E4M3 block scales and an FP32 global scale (gate and up share one, since they run
//! as one fused GEMM), and `input_scale` calibrated from the activations a forward pass feeds
//! each expert (max calibration: `amax / (6 · 448)`).

pub mod generator;

use std::path::Path;

use anyhow::{Context, Result, anyhow, bail};
use kernels::formats::NVFP4_BLOCK;
use kernels::formats::nvfp4::{Nvfp4Matrix, amax, global_scale_for_amax};
use kernels::mla::cache::KvCacheDtype;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use safetensors::Dtype;
use serde_json::{Value, json};

use crate::arch::config::ModelConfig;
use crate::arch::names::{self, is_routed_expert_weight};
use crate::checkpoint::weights::Model;
use crate::checkpoint::weights::{ExpertMatrix, ExpertWeights, MlpWeights};
use crate::checkpoint::writer::{OutputKind, OwnedTensor, StagedOutput, write_sharded};
use crate::checkpoint::{Checkpoint, INDEX_FILE};
use crate::exec::cpu::{CpuOptions, cpu_runner};
use crate::exec::footprint::forward_bytes;
use crate::exec::ops::{LogitRows, SeqInput};
use crate::exec::runner::ModelRunner;
use crate::input::{InvalidInput, check_memory, largest_fitting};
use kernels::moe_gemm::reference::ExpertInputAmax;

/// One expert in the ModelOpt NVFP4 layout.
pub struct QuantizedExpert {
    pub gate: Nvfp4Matrix,
    pub up: Nvfp4Matrix,
    pub down: Nvfp4Matrix,
    pub gate_up_input_scale: f32,
    pub down_input_scale: f32,
}

/// Activation maxima at the routed experts' inputs, per MoE layer.
pub type Calibration = Vec<ExpertInputAmax>;

/// Runs the model on `tokens` (as one sequence, on the CPU) and records each routed expert's
/// input maxima.
pub fn calibrate(model: &Model, tokens: &[u32]) -> Result<Calibration> {
    let mut runner = cpu_runner(model, CpuOptions::new(KvCacheDtype::Bf16, tokens.len()));
    runner.ops_mut().observations.expert_input_amax = Some(Calibration::new());
    let seq = runner.add_sequence();
    runner.logits(&[SeqInput { seq, tokens }], LogitRows::Last)?;
    Ok(runner
        .ops_mut()
        .observations
        .expert_input_amax
        .take()
        .unwrap_or_default())
}

/// Seeded random calibration tokens (no tokenizer or dataset is needed to exercise every
/// expert's range on a generated model; real checkpoints should pass real text).
pub fn random_tokens(count: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..count)
        .map(|_| rng.random_range(0..vocab as u32))
        .collect()
}

fn bf16_values(m: &ExpertMatrix, what: &str) -> Result<Vec<f32>> {
    match m {
        ExpertMatrix::Bf16(w) => Ok(w.data.as_slice().iter().map(|v| v.to_f32()).collect()),
        ExpertMatrix::Nvfp4(_) => {
            bail!("{what} is already NVFP4; quantize needs a BF16 checkpoint")
        }
    }
}

/// Quantizes one expert. `amax_in`/`amax_down` are its calibrated activation maxima.
pub fn quantize_expert(
    expert: &ExpertWeights,
    amax_in: f32,
    amax_down: f32,
    expert_names: &names::Mlp,
) -> Result<QuantizedExpert> {
    let what = expert_names.path().as_str();
    let (gate, up, down) = (
        bf16_values(&expert.gate, what)?,
        bf16_values(&expert.up, what)?,
        bf16_values(&expert.down, what)?,
    );
    let (rows, cols) = (expert.gate.view().rows(), expert.gate.view().cols());
    let shared = global_scale_for_amax(amax(&gate).max(amax(&up)));
    let quantize = |values: &[f32],
                    rows,
                    cols,
                    global: Option<f32>,
                    name: names::Tensor|
     -> Result<Nvfp4Matrix> {
        match global {
            Some(g) => Nvfp4Matrix::quantize_with_global_scale(values, rows, cols, g),
            None => Nvfp4Matrix::quantize_weight(values, rows, cols),
        }
        .map_err(|e| anyhow!("{name}: {e}"))
    };
    let positive = |a: f32, name: String| -> Result<f32> {
        if a > 0.0 && a.is_finite() {
            Ok(global_scale_for_amax(a))
        } else {
            bail!("{name}: calibrated amax is {a}")
        }
    };
    Ok(QuantizedExpert {
        gate: quantize(&gate, rows, cols, Some(shared), expert_names.gate_proj())?,
        up: quantize(&up, rows, cols, Some(shared), expert_names.up_proj())?,
        down: quantize(&down, cols, rows, None, expert_names.down_proj())?,
        gate_up_input_scale: positive(amax_in, expert_names.gate_proj().input_scale())?,
        down_input_scale: positive(amax_down, expert_names.down_proj().input_scale())?,
    })
}

/// Quantizes every routed expert of `model` with the maxima from `calibration`. Experts no
/// calibration token reached take their layer's largest maxima, so their scales are at least
/// as wide as any seen.
pub fn quantize_experts(
    model: &Model,
    calibration: &Calibration,
) -> Result<Vec<(usize, Vec<QuantizedExpert>)>> {
    let mut out = Vec::new();
    let mut moe_index = 0;
    for (layer, weights) in model.weights.layers.iter().enumerate() {
        let MlpWeights::Moe(moe) = &weights.mlp else {
            continue;
        };
        let amax = calibration
            .get(moe_index)
            .ok_or_else(|| anyhow!("no calibration for layer {layer}"))?;
        moe_index += 1;
        let layer_in = amax.gate_up.iter().fold(0.0f32, |m, &v| m.max(v));
        let layer_down = amax.down.iter().fold(0.0f32, |m, &v| m.max(v));
        let experts = moe
            .experts
            .iter()
            .enumerate()
            .map(|(e, expert)| {
                let pick = |v: f32, fallback: f32| if v > 0.0 { v } else { fallback };
                let a_in = pick(amax.gate_up.get(e).copied().unwrap_or(0.0), layer_in);
                let a_down = pick(amax.down.get(e).copied().unwrap_or(0.0), layer_down);
                quantize_expert(expert, a_in, a_down, &names::layer(layer).routed_expert(e))
            })
            .collect::<Result<Vec<_>>>()?;
        out.push((layer, experts));
    }
    Ok(out)
}

/// The tensors of one quantized expert, named as in the checkpoint.
pub fn expert_tensors(
    prefix: &str,
    layer: usize,
    e: usize,
    q: &QuantizedExpert,
) -> Vec<OwnedTensor> {
    let mut tensors = Vec::new();
    let [(_, gate), (_, up), (_, down)] = names::layer(layer).routed_expert(e).projections();
    for (name, m, input_scale) in [
        (gate, &q.gate, q.gate_up_input_scale),
        (up, &q.up, q.gate_up_input_scale),
        (down, &q.down, q.down_input_scale),
    ] {
        tensors.push(OwnedTensor::new(
            format!("{prefix}{}", name.weight()),
            Dtype::U8,
            vec![m.rows, m.cols / 2],
            m.packed.clone(),
        ));
        tensors.push(OwnedTensor::new(
            format!("{prefix}{}", name.weight_scale()),
            Dtype::F8_E4M3,
            vec![m.rows, m.cols / NVFP4_BLOCK],
            m.block_scales.clone(),
        ));
        tensors.push(OwnedTensor::f32_scalar(
            format!("{prefix}{}", name.weight_scale_2()),
            m.global_scale,
        ));
        tensors.push(OwnedTensor::f32_scalar(
            format!("{prefix}{}", name.input_scale()),
            input_scale,
        ));
    }
    tensors
}

/// `hf_quant_config.json` as ModelOpt writes it.
pub fn hf_quant_config(prefix: &str, config: &ModelConfig) -> Value {
    let exclude = names::unquantized_patterns(prefix, config.first_k_dense_replace);
    json!({
        "producer": {"name": "modelopt", "version": "0.47.0"},
        "quantization": {
            "quant_algo": "NVFP4",
            "kv_cache_quant_algo": "FP8",
            "group_size": NVFP4_BLOCK,
            "exclude_modules": exclude
        }
    })
}

/// Refuses a calibration length the model cannot run as one sequence: zero, beyond the
/// context, or more than the memory available.
pub fn check_calibration_tokens(config: &ModelConfig, calib_tokens: usize) -> Result<()> {
    let max = config.max_position_embeddings;
    if !(1..=max).contains(&calib_tokens) {
        return Err(InvalidInput(format!(
            "--calib-tokens {calib_tokens}: calibration runs one sequence of 1 to {max} tokens (max_position_embeddings)"
        ))
        .into());
    }
    let needed = |tokens: usize| forward_bytes(config, KvCacheDtype::Bf16, tokens, tokens, 1);
    check_memory(
        &format!("calibrating on {calib_tokens} tokens"),
        needed(calib_tokens),
        |available| match largest_fitting(calib_tokens, |t| needed(t) <= available) {
            Some(tokens) => format!("--calib-tokens {tokens} fits"),
            None => "not even one token fits".into(),
        },
    )?;
    Ok(())
}

/// `model quantize`: a BF16 DeepSeek-V3 / Kimi checkpoint to the ModelOpt NVFP4 layout, written
/// through a [`StagedOutput`]: the output may not be, hold or lie inside the input, and an
/// existing output is replaced only with `force`.
#[allow(clippy::too_many_arguments)]
pub fn quantize_checkpoint(
    input: &Path,
    output: &Path,
    calib_tokens: usize,
    seed: u64,
    max_shard_bytes: usize,
    force: bool,
) -> Result<()> {
    let checkpoint = Checkpoint::open(input)?;
    if checkpoint.config.quant.is_some() {
        return Err(InvalidInput(format!(
            "{}: already quantized ({:?})",
            input.display(),
            checkpoint.config.quant.as_ref().map(|q| q.quant_algo)
        ))
        .into());
    }
    check_calibration_tokens(checkpoint.model_config(), calib_tokens)?;
    let stage = StagedOutput::new(output, &[input], OutputKind::Folder, force)?;
    let model = Model::new(
        checkpoint.model_config().clone(),
        checkpoint.load_weights()?,
    );
    let tokens = random_tokens(calib_tokens, model.config.vocab_size, seed);
    let calibration = calibrate(&model, &tokens)?;
    let quantized = quantize_experts(&model, &calibration)?;

    let mut names: Vec<(&str, &crate::checkpoint::tensor_file::TensorFile)> =
        checkpoint.tensor_names().collect();
    names.sort_by_key(|(n, _)| *n);
    let mut tensors = Vec::new();
    for (name, file) in names {
        if is_routed_expert_weight(name) {
            continue;
        }
        let info = file.info(name)?;
        let bytes = file.bytes(name, &[info.dtype])?.to_vec();
        tensors.push(OwnedTensor::new(
            name,
            info.dtype,
            info.shape.clone(),
            bytes,
        ));
    }
    for (layer, experts) in &quantized {
        for (e, q) in experts.iter().enumerate() {
            tensors.extend(expert_tensors(&checkpoint.prefix, *layer, e, q));
        }
    }
    tensors.sort_by(|a, b| a.name.cmp(&b.name));
    let dir = stage.path();
    write_sharded(dir, tensors, max_shard_bytes)?;
    for entry in std::fs::read_dir(input)? {
        let path = entry?.path();
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_default();
        if path.is_file()
            && !name.ends_with(".safetensors")
            && name != INDEX_FILE
            && name != "hf_quant_config.json"
        {
            std::fs::copy(&path, dir.join(&name))
                .with_context(|| format!("copying {}", path.display()))?;
        }
    }
    let quant = hf_quant_config(&checkpoint.prefix, &model.config);
    std::fs::write(
        dir.join("hf_quant_config.json"),
        serde_json::to_string_pretty(&quant)?,
    )?;
    stage.commit()
}
