//! `model generate-checkpoint`: random-weight models in exactly the layout of
//! nvidia/Kimi-K2.5-NVFP4 (see golden/MODEL_LAYOUT.md): a `kimi_k25` config wrapping the text
//! model's `text_config`, `hf_quant_config.json`, sharded safetensors with an index, tensors
//! under `language_model.`, routed experts in NVFP4 with calibrated `input_scale`s, BF16
//! everywhere else.

use std::path::Path;

use anyhow::{Context, Result};
use half::bf16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use serde_json::json;

use crate::arch::config::ModelConfig;
use crate::arch::names;
use crate::arch::presets::Preset;
use crate::checkpoint::KIMI_K25_PREFIX;
use crate::checkpoint::weights::*;
use crate::checkpoint::writer::{OutputKind, OwnedTensor, StagedOutput, write_sharded};
use crate::input::InvalidInput;
use crate::quantize::{
    calibrate, expert_tensors, hf_quant_config, quantize_experts, random_tokens,
};

fn random_bf16(rng: &mut ChaCha8Rng, count: usize, std: f32) -> Vec<bf16> {
    let half_width = std * 3f32.sqrt();
    // Generate in parallel from per-chunk seeds so large presets are fast and still seeded.
    let seeds: Vec<u64> = (0..count.div_ceil(1 << 16)).map(|_| rng.random()).collect();
    let mut out = vec![bf16::ZERO; count];
    out.par_chunks_mut(1 << 16)
        .zip(seeds)
        .for_each(|(chunk, seed)| {
            let mut local = ChaCha8Rng::seed_from_u64(seed);
            for v in chunk {
                *v = bf16::from_f32(local.random_range(-half_width..half_width));
            }
        });
    out
}

fn matrix(rng: &mut ChaCha8Rng, rows: usize, cols: usize) -> Bf16Weight {
    Bf16Weight::owned(
        rows,
        cols,
        random_bf16(rng, rows * cols, 1.0 / (cols as f32).sqrt()),
    )
}

fn norm(rng: &mut ChaCha8Rng, len: usize) -> Vec<f32> {
    (0..len)
        .map(|_| bf16::from_f32(1.0 + rng.random_range(-0.1..0.1)).to_f32())
        .collect()
}

/// Random BF16 weights for every tensor of `c` (experts in BF16, before quantization).
pub fn random_weights(c: &ModelConfig, seed: u64) -> ModelWeights {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let heads = c.num_attention_heads;
    let dense = |rng: &mut ChaCha8Rng, inter: usize| DenseMlpWeights {
        gate: matrix(rng, inter, c.hidden_size),
        up: matrix(rng, inter, c.hidden_size),
        down: matrix(rng, c.hidden_size, inter),
    };
    let layers = (0..c.num_hidden_layers)
        .map(|layer| {
            let q = match c.q_lora_rank {
                Some(rank) => QueryProjection::LowRank {
                    a: matrix(&mut rng, rank, c.hidden_size),
                    norm: norm(&mut rng, rank),
                    b: matrix(&mut rng, heads * c.qk_head_dim(), rank),
                },
                None => {
                    QueryProjection::Full(matrix(&mut rng, heads * c.qk_head_dim(), c.hidden_size))
                }
            };
            let attention = AttentionWeights {
                q,
                kv_a: matrix(&mut rng, c.latent_cache_dim(), c.hidden_size),
                kv_a_norm: norm(&mut rng, c.kv_lora_rank),
                kv_b: matrix(
                    &mut rng,
                    heads * (c.qk_nope_head_dim + c.v_head_dim),
                    c.kv_lora_rank,
                ),
                o: matrix(&mut rng, c.hidden_size, heads * c.v_head_dim),
            };
            let mlp = if c.is_moe_layer(layer) {
                let inter = c.moe_intermediate_size;
                MlpWeights::Moe(MoeWeights {
                    router: matrix(&mut rng, c.n_routed_experts, c.hidden_size),
                    correction_bias: (0..c.n_routed_experts)
                        .map(|_| rng.random_range(-0.05..0.05))
                        .collect(),
                    experts: (0..c.n_routed_experts)
                        .map(|_| {
                            let d = dense(&mut rng, inter);
                            ExpertWeights {
                                gate: ExpertMatrix::Bf16(d.gate),
                                up: ExpertMatrix::Bf16(d.up),
                                down: ExpertMatrix::Bf16(d.down),
                            }
                        })
                        .collect(),
                    shared: (c.n_shared_experts > 0)
                        .then(|| dense(&mut rng, inter * c.n_shared_experts)),
                })
            } else {
                MlpWeights::Dense(dense(&mut rng, c.intermediate_size))
            };
            LayerWeights {
                input_norm: norm(&mut rng, c.hidden_size),
                attention,
                post_attention_norm: norm(&mut rng, c.hidden_size),
                mlp,
            }
        })
        .collect();
    ModelWeights {
        embed: Bf16Weight::owned(
            c.vocab_size,
            c.hidden_size,
            random_bf16(&mut rng, c.vocab_size * c.hidden_size, 1.0),
        ),
        layers,
        norm: norm(&mut rng, c.hidden_size),
        lm_head: matrix(&mut rng, c.vocab_size, c.hidden_size),
        vocab_rows: 0..c.vocab_size,
    }
}

fn bf16_tensor(name: String, w: &Bf16Weight) -> OwnedTensor {
    OwnedTensor::bf16(name, vec![w.rows, w.cols], w.data.as_slice())
}

fn norm_tensor(name: String, values: &[f32]) -> OwnedTensor {
    let v: Vec<bf16> = values.iter().map(|&x| bf16::from_f32(x)).collect();
    OwnedTensor::bf16(name, vec![v.len()], &v)
}

/// Every non-routed-expert tensor of `weights`, named as in the checkpoint (`prefix` before
/// each name: Kimi-K2.5's `language_model.`).
pub fn non_expert_tensors(prefix: &str, weights: &ModelWeights) -> Vec<OwnedTensor> {
    let named = |t: names::Tensor| format!("{prefix}{}", t.weight());
    let mut t = vec![bf16_tensor(named(names::embed_tokens()), &weights.embed)];
    for (l, layer) in weights.layers.iter().enumerate() {
        let p = names::layer(l);
        t.push(norm_tensor(named(p.input_layernorm()), &layer.input_norm));
        t.push(norm_tensor(
            named(p.post_attention_layernorm()),
            &layer.post_attention_norm,
        ));
        let a = &layer.attention;
        match &a.q {
            QueryProjection::LowRank { a: qa, norm, b } => {
                t.push(bf16_tensor(named(p.q_a_proj()), qa));
                t.push(norm_tensor(named(p.q_a_layernorm()), norm));
                t.push(bf16_tensor(named(p.q_b_proj()), b));
            }
            QueryProjection::Full(q) => t.push(bf16_tensor(named(p.q_proj()), q)),
        }
        t.push(bf16_tensor(named(p.kv_a_proj_with_mqa()), &a.kv_a));
        t.push(norm_tensor(named(p.kv_a_layernorm()), &a.kv_a_norm));
        t.push(bf16_tensor(named(p.kv_b_proj()), &a.kv_b));
        t.push(bf16_tensor(named(p.o_proj()), &a.o));
        let dense = |t: &mut Vec<OwnedTensor>, mlp: names::Mlp, d: &DenseMlpWeights| {
            t.push(bf16_tensor(named(mlp.gate_proj()), &d.gate));
            t.push(bf16_tensor(named(mlp.up_proj()), &d.up));
            t.push(bf16_tensor(named(mlp.down_proj()), &d.down));
        };
        match &layer.mlp {
            MlpWeights::Dense(d) => dense(&mut t, p.mlp(), d),
            MlpWeights::Moe(m) => {
                t.push(bf16_tensor(named(p.router()), &m.router));
                t.push(OwnedTensor::f32(
                    format!("{prefix}{}", p.e_score_correction_bias()),
                    vec![m.correction_bias.len()],
                    &m.correction_bias,
                ));
                if let Some(s) = &m.shared {
                    dense(&mut t, p.shared_experts(), s);
                }
            }
        }
    }
    t.push(norm_tensor(named(names::norm()), &weights.norm));
    t.push(bf16_tensor(named(names::lm_head()), &weights.lm_head));
    t
}

/// Writes a random-weight NVFP4 checkpoint of `preset` to `out` through a [`StagedOutput`]:
/// an existing output is replaced, as a whole, only with `force`.
pub fn generate_checkpoint(preset: Preset, out: &Path, seed: u64, force: bool) -> Result<()> {
    if preset == Preset::KimiK25 {
        return Err(InvalidInput(
            "the kimi-k2.5 preset has 1 T parameters; it exists for `model plan`, not for generation"
                .into(),
        )
        .into());
    }
    let stage = StagedOutput::new(out, &[], OutputKind::Folder, force)?;
    write_checkpoint(preset, stage.path(), seed)?;
    stage.commit()
}

/// Writes the checkpoint's files into the folder `out`, which exists.
fn write_checkpoint(preset: Preset, out: &Path, seed: u64) -> Result<()> {
    let config = preset.model_config();
    let weights = random_weights(&config, seed);
    let model = Model::new(config.clone(), weights);
    let tokens = random_tokens(
        64.max(config.n_routed_experts),
        config.vocab_size,
        seed ^ 0xCA11,
    );
    let calibration = calibrate(&model, &tokens).context("calibration forward pass")?;
    let quantized = quantize_experts(&model, &calibration)?;
    let prefix = KIMI_K25_PREFIX;
    let mut tensors = non_expert_tensors(prefix, &model.weights);
    for (layer, experts) in &quantized {
        for (e, q) in experts.iter().enumerate() {
            tensors.extend(expert_tensors(prefix, *layer, e, q));
        }
    }
    let total: usize = tensors.iter().map(|t| t.bytes.len()).sum();
    // At least two shards, so that the index is always exercised.
    let shard_bytes = (total / 2 + 1).min(256 << 20);
    write_sharded(out, tensors, shard_bytes)?;
    std::fs::write(
        out.join("config.json"),
        serde_json::to_string_pretty(&preset.config_json())?,
    )?;
    std::fs::write(
        out.join("hf_quant_config.json"),
        serde_json::to_string_pretty(&hf_quant_config(prefix, &config))?,
    )?;
    let generation =
        json!({"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_ids});
    std::fs::write(
        out.join("generation_config.json"),
        serde_json::to_string_pretty(&generation)?,
    )?;
    Ok(())
}

/// Where generated and unpacked default models live: `cache_dir`, else
/// `$XDG_CACHE_HOME/kimi-sm120` or `~/.cache/kimi-sm120`.
pub fn cache_base(cache_dir: Option<std::path::PathBuf>) -> std::path::PathBuf {
    cache_dir.unwrap_or_else(|| {
        std::env::var_os("XDG_CACHE_HOME")
            .map(std::path::PathBuf::from)
            .or_else(|| {
                std::env::var_os("HOME").map(|h| std::path::PathBuf::from(h).join(".cache"))
            })
            .unwrap_or_else(std::env::temp_dir)
            .join("kimi-sm120")
    })
}

/// The default model of `model run`: the `mini` preset, generated once into `cache_dir`
/// (default `$XDG_CACHE_HOME/kimi-sm120` or `~/.cache/kimi-sm120`) and reused afterwards.
pub fn default_checkpoint(cache_dir: Option<std::path::PathBuf>) -> Result<std::path::PathBuf> {
    generated_checkpoint(Preset::Mini, cache_dir)
}

/// `preset`'s random-weight model, generated once into `cache_dir` (as
/// [`default_checkpoint`]) and reused afterwards.
pub fn generated_checkpoint(
    preset: Preset,
    cache_dir: Option<std::path::PathBuf>,
) -> Result<std::path::PathBuf> {
    let base = cache_base(cache_dir);
    // The folder name carries the crate version so a changed generator makes a new model.
    let dir = base.join(format!("{}-{}", preset.id(), env!("CARGO_PKG_VERSION")));
    if dir.join(".complete").exists() {
        return Ok(dir);
    }
    // Staged aside and renamed into place, so an interrupted run never leaves a half model;
    // what is there without `.complete` is an older layout, replaced.
    let stage = StagedOutput::new_waiting(&dir, &[], OutputKind::Folder, true)?;
    if dir.join(".complete").exists() {
        // Another process generated it while this one waited.
        return Ok(dir);
    }
    eprintln!(
        "generating the {} model into {} (once)…",
        preset.id(),
        dir.display()
    );
    write_checkpoint(preset, stage.path(), 20261129)?;
    std::fs::write(stage.path().join(".complete"), b"")?;
    stage
        .commit()
        .with_context(|| format!("moving the model into {}", dir.display()))?;
    Ok(dir)
}
