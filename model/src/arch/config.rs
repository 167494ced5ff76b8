//! Model and quantization configuration, parsed from the files a checkpoint ships as they are:
//! Kimi-K2.5's `config.json` (`model_type: kimi_k25`, the text model in `text_config`), plain
//! DeepSeek-V3 / Kimi-K2 configs, and ModelOpt's `hf_quant_config.json` or the
//! `quantization_config` inside `config.json`.

use std::path::{Path, PathBuf};

use kernels::files::{FileError, TEXT_FILE_LIMIT, read_text_bounded};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use thiserror::Error;

use super::quant_config::parse_quant;
pub use super::quant_config::{KvCacheQuant, QuantAlgo, QuantConfig, glob_match};
use super::rope::Rope;
pub use super::rope::{RopeParams, YarnScaling, yarn_mscale};

#[derive(Debug, Error)]
pub enum ConfigError {
    #[error(transparent)]
    Read(#[from] FileError),
    #[error("{path}: invalid JSON: {source}")]
    Json {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("{path}: {message}")]
    Invalid { path: PathBuf, message: String },
}

/// The text model's hyper-parameters (DeepSeek-V3 architecture).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// Dense MLP width (the first `first_k_dense_replace` layers).
    pub intermediate_size: usize,
    pub moe_intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub n_routed_experts: usize,
    pub n_shared_experts: usize,
    pub num_experts_per_tok: usize,
    pub first_k_dense_replace: usize,
    pub moe_layer_freq: usize,
    /// `None`: queries come from a plain `q_proj`.
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    pub rope_theta: f64,
    pub rope_scaling: Option<YarnScaling>,
    pub rms_norm_eps: f64,
    pub routed_scaling_factor: f64,
    pub n_group: usize,
    pub topk_group: usize,
    pub norm_topk_prob: bool,
    pub max_position_embeddings: usize,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    pub tie_word_embeddings: bool,
    /// DeepSeek-V3's multi-token-prediction layers, stored after the `num_hidden_layers`
    /// decoder layers; the model does not run them.
    #[serde(default)]
    pub num_nextn_predict_layers: usize,
}

/// Everything a checkpoint directory says about the model.
#[derive(Clone, Debug, PartialEq)]
pub struct CheckpointConfig {
    pub model: ModelConfig,
    pub quant: Option<QuantConfig>,
    /// `model_type` of the top-level config (`kimi_k25`, `deepseek_v3`, `kimi_k2`).
    pub model_type: String,
}

const TEXT_MODEL_TYPES: [&str; 2] = ["deepseek_v3", "kimi_k2"];
const WRAPPER_MODEL_TYPES: [&str; 1] = ["kimi_k25"];

impl CheckpointConfig {
    /// Reads `config.json` and, if present, `hf_quant_config.json` from a checkpoint directory.
    pub fn from_dir(dir: &Path) -> Result<Self, ConfigError> {
        let config_path = dir.join("config.json");
        let root = read_json(&config_path)?;
        let quant_path = dir.join("hf_quant_config.json");
        let hf_quant = if quant_path.exists() {
            Some(read_json(&quant_path)?)
        } else {
            None
        };
        let mut config = Self::from_json(
            &config_path,
            &root,
            hf_quant.as_ref().map(|v| (quant_path.as_path(), v)),
        )?;
        // generation_config.json may name another stop token (Kimi-K2.5: `<|im_end|>` there,
        // `[EOS]` in config.json); stop on every one of them.
        let generation_path = dir.join("generation_config.json");
        if generation_path.exists() {
            for id in token_ids(read_json(&generation_path)?.get("eos_token_id")) {
                if !config.model.eos_token_ids.contains(&id) {
                    config.model.eos_token_ids.push(id);
                }
            }
        }
        Ok(config)
    }

    pub fn from_json(
        config_path: &Path,
        root: &Value,
        hf_quant: Option<(&Path, &Value)>,
    ) -> Result<Self, ConfigError> {
        let invalid = |message: String| ConfigError::Invalid {
            path: config_path.to_path_buf(),
            message,
        };
        let model_type = root
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| invalid("missing `model_type`".into()))?
            .to_string();
        let text = if WRAPPER_MODEL_TYPES.contains(&model_type.as_str()) {
            let text = root.get("text_config").ok_or_else(|| {
                invalid(format!("`model_type: {model_type}` needs a `text_config`"))
            })?;
            let text_type = text
                .get("model_type")
                .and_then(Value::as_str)
                .unwrap_or("deepseek_v3");
            if !TEXT_MODEL_TYPES.contains(&text_type) {
                return Err(invalid(format!(
                    "text_config.model_type `{text_type}` is not supported (expected one of {TEXT_MODEL_TYPES:?})"
                )));
            }
            text
        } else if TEXT_MODEL_TYPES.contains(&model_type.as_str()) {
            root
        } else {
            return Err(invalid(format!(
                "model_type `{model_type}` is not supported (expected one of {:?} or {:?})",
                WRAPPER_MODEL_TYPES, TEXT_MODEL_TYPES
            )));
        };
        let model = parse_text_config(text, root).map_err(invalid)?;

        let quant = match hf_quant {
            Some((path, value)) => {
                let section = value.get("quantization").unwrap_or(value);
                let producer = value.get("producer").map(|p| {
                    format!(
                        "{} {}",
                        p.get("name").and_then(Value::as_str).unwrap_or("?"),
                        p.get("version").and_then(Value::as_str).unwrap_or("?")
                    )
                });
                Some(
                    parse_quant(section, producer).map_err(|message| ConfigError::Invalid {
                        path: path.to_path_buf(),
                        message,
                    })?,
                )
            }
            None => {
                let embedded = root
                    .get("quantization_config")
                    .or_else(|| text.get("quantization_config"));
                match embedded {
                    Some(q) => Some(parse_quant(q, None).map_err(invalid)?),
                    None => None,
                }
            }
        };
        Ok(Self {
            model,
            quant,
            model_type,
        })
    }
}

fn read_json(path: &Path) -> Result<Value, ConfigError> {
    let text = read_text_bounded(path, TEXT_FILE_LIMIT)?;
    serde_json::from_str(&text).map_err(|source| ConfigError::Json {
        path: path.to_path_buf(),
        source,
    })
}

fn get_usize(v: &Value, key: &str) -> Result<usize, String> {
    v.get(key)
        .and_then(Value::as_u64)
        .map(|x| x as usize)
        .ok_or_else(|| format!("missing or non-integer `{key}`"))
}

fn get_f64(v: &Value, key: &str) -> Result<f64, String> {
    v.get(key)
        .and_then(Value::as_f64)
        .ok_or_else(|| format!("missing or non-numeric `{key}`"))
}

fn token_ids(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Some(Value::Array(items)) => items
            .iter()
            .filter_map(Value::as_u64)
            .map(|x| x as u32)
            .collect(),
        _ => Vec::new(),
    }
}

fn parse_text_config(t: &Value, root: &Value) -> Result<ModelConfig, String> {
    if let Some(func) = t.get("scoring_func").and_then(Value::as_str)
        && func != "sigmoid"
    {
        return Err(format!(
            "scoring_func `{func}` is not supported (only `sigmoid`)"
        ));
    }
    if let Some(method) = t.get("topk_method").and_then(Value::as_str)
        && method != "noaux_tc"
    {
        return Err(format!(
            "topk_method `{method}` is not supported (only `noaux_tc`)"
        ));
    }
    if let Some(act) = t.get("hidden_act").and_then(Value::as_str)
        && act != "silu"
    {
        return Err(format!("hidden_act `{act}` is not supported (only `silu`)"));
    }
    let heads = get_usize(t, "num_attention_heads")?;
    if let Some(kv_heads) = t.get("num_key_value_heads").and_then(Value::as_u64)
        && kv_heads as usize != heads
    {
        return Err(format!(
            "num_key_value_heads {kv_heads} != num_attention_heads {heads}: MLA expects them equal"
        ));
    }
    let rope_scaling = match t.get("rope_scaling") {
        None | Some(Value::Null) => None,
        Some(rs) => {
            let kind = rs
                .get("rope_type")
                .or_else(|| rs.get("type"))
                .and_then(Value::as_str)
                .unwrap_or("");
            if kind != "yarn" {
                return Err(format!(
                    "rope_scaling type `{kind}` is not supported (only `yarn`)"
                ));
            }
            Some(YarnScaling {
                factor: get_f64(rs, "factor")?,
                original_max_position_embeddings: get_usize(
                    rs,
                    "original_max_position_embeddings",
                )?,
                beta_fast: rs.get("beta_fast").and_then(Value::as_f64).unwrap_or(32.0),
                beta_slow: rs.get("beta_slow").and_then(Value::as_f64).unwrap_or(1.0),
                mscale: rs.get("mscale").and_then(Value::as_f64).unwrap_or(1.0),
                mscale_all_dim: rs
                    .get("mscale_all_dim")
                    .and_then(Value::as_f64)
                    .unwrap_or(0.0),
            })
        }
    };
    let q_lora_rank = match t.get("q_lora_rank") {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            v.as_u64()
                .ok_or("`q_lora_rank` must be an integer or null")? as usize,
        ),
    };
    let n_routed_experts = get_usize(t, "n_routed_experts")?;
    let n_group = t.get("n_group").and_then(Value::as_u64).unwrap_or(1) as usize;
    let topk_group = t.get("topk_group").and_then(Value::as_u64).unwrap_or(1) as usize;
    let num_experts_per_tok = get_usize(t, "num_experts_per_tok")?;
    if n_group == 0 || n_routed_experts % n_group != 0 || topk_group > n_group {
        return Err(format!(
            "n_group {n_group} / topk_group {topk_group} do not divide {n_routed_experts} experts"
        ));
    }
    if num_experts_per_tok > topk_group * (n_routed_experts / n_group) {
        return Err(format!(
            "num_experts_per_tok {num_experts_per_tok} exceeds the experts of {topk_group} groups"
        ));
    }
    let mut eos = token_ids(t.get("eos_token_id"));
    if eos.is_empty() {
        eos = token_ids(root.get("eos_token_id"));
    }
    let config = ModelConfig {
        vocab_size: get_usize(t, "vocab_size")?,
        hidden_size: get_usize(t, "hidden_size")?,
        intermediate_size: get_usize(t, "intermediate_size")?,
        moe_intermediate_size: get_usize(t, "moe_intermediate_size")?,
        num_hidden_layers: get_usize(t, "num_hidden_layers")?,
        num_attention_heads: heads,
        n_routed_experts,
        n_shared_experts: t
            .get("n_shared_experts")
            .and_then(Value::as_u64)
            .unwrap_or(0) as usize,
        num_experts_per_tok,
        first_k_dense_replace: t
            .get("first_k_dense_replace")
            .and_then(Value::as_u64)
            .unwrap_or(0) as usize,
        moe_layer_freq: t.get("moe_layer_freq").and_then(Value::as_u64).unwrap_or(1) as usize,
        q_lora_rank,
        kv_lora_rank: get_usize(t, "kv_lora_rank")?,
        qk_nope_head_dim: get_usize(t, "qk_nope_head_dim")?,
        qk_rope_head_dim: get_usize(t, "qk_rope_head_dim")?,
        v_head_dim: get_usize(t, "v_head_dim")?,
        rope_theta: t
            .get("rope_theta")
            .and_then(Value::as_f64)
            .unwrap_or(10000.0),
        rope_scaling,
        rms_norm_eps: t
            .get("rms_norm_eps")
            .and_then(Value::as_f64)
            .unwrap_or(1e-6),
        routed_scaling_factor: t
            .get("routed_scaling_factor")
            .and_then(Value::as_f64)
            .unwrap_or(1.0),
        n_group,
        topk_group,
        norm_topk_prob: t
            .get("norm_topk_prob")
            .and_then(Value::as_bool)
            .unwrap_or(true),
        max_position_embeddings: get_usize(t, "max_position_embeddings")?,
        bos_token_id: token_ids(t.get("bos_token_id").or_else(|| root.get("bos_token_id")))
            .first()
            .copied(),
        eos_token_ids: eos,
        tie_word_embeddings: t
            .get("tie_word_embeddings")
            .or_else(|| root.get("tie_word_embeddings"))
            .and_then(Value::as_bool)
            .unwrap_or(false),
        num_nextn_predict_layers: t
            .get("num_nextn_predict_layers")
            .and_then(Value::as_u64)
            .unwrap_or(0) as usize,
    };
    check_ranges(&config)?;
    if !config.qk_rope_head_dim.is_multiple_of(2) {
        return Err(format!(
            "qk_rope_head_dim {} must be even",
            config.qk_rope_head_dim
        ));
    }
    if config.moe_layer_freq != 1 {
        return Err(format!(
            "moe_layer_freq {} is not supported (only 1)",
            config.moe_layer_freq
        ));
    }
    Ok(config)
}

/// Widest dimension accepted (vocabulary, hidden, MLP, ranks): 16 times the largest released
/// DeepSeek-V3-family model's, small enough that products of two never overflow.
pub const MAX_WIDTH: usize = 1 << 22;
/// Most decoder layers accepted (DeepSeek-V3 and Kimi-K2.5 have 61).
pub const MAX_LAYERS: usize = 1 << 12;
/// Most routed experts accepted (Kimi-K2.5 has 384).
pub const MAX_EXPERTS: usize = 1 << 16;

/// Ranges of every value the forward pass divides by, takes the logarithm of or allocates
/// for, so that a config the engine accepts cannot produce NaN by itself or ask for a size
/// no checkpoint could hold. Messages name the field and the value.
fn check_ranges(c: &ModelConfig) -> Result<(), String> {
    let widths = [
        ("vocab_size", c.vocab_size),
        ("hidden_size", c.hidden_size),
        ("num_attention_heads", c.num_attention_heads),
        ("kv_lora_rank", c.kv_lora_rank),
        ("qk_nope_head_dim", c.qk_nope_head_dim),
        ("qk_rope_head_dim", c.qk_rope_head_dim),
        ("v_head_dim", c.v_head_dim),
        ("q_lora_rank", c.q_lora_rank.unwrap_or(1)),
    ];
    for (name, value) in widths {
        if !(1..=MAX_WIDTH).contains(&value) {
            return Err(format!("`{name}` is {value}; it must be 1 to {MAX_WIDTH}"));
        }
    }
    let optional_widths = [
        ("intermediate_size", c.intermediate_size),
        ("moe_intermediate_size", c.moe_intermediate_size),
        ("n_shared_experts", c.n_shared_experts),
    ];
    for (name, value) in optional_widths {
        if value > MAX_WIDTH {
            return Err(format!(
                "`{name}` is {value}; it must be at most {MAX_WIDTH}"
            ));
        }
    }
    if !(1..=MAX_LAYERS).contains(&c.num_hidden_layers) {
        return Err(format!(
            "`num_hidden_layers` is {}; it must be 1 to {MAX_LAYERS}",
            c.num_hidden_layers
        ));
    }
    if c.num_nextn_predict_layers > MAX_LAYERS {
        return Err(format!(
            "`num_nextn_predict_layers` is {}; it must be at most {MAX_LAYERS}",
            c.num_nextn_predict_layers
        ));
    }
    if c.first_k_dense_replace > c.num_hidden_layers {
        return Err(format!(
            "`first_k_dense_replace` {} exceeds `num_hidden_layers` {}",
            c.first_k_dense_replace, c.num_hidden_layers
        ));
    }
    if (c.first_k_dense_replace > 0 || c.n_routed_experts == 0) && c.intermediate_size == 0 {
        return Err("`intermediate_size` is 0, but the model has dense MLP layers".into());
    }
    if c.n_routed_experts > MAX_EXPERTS {
        return Err(format!(
            "`n_routed_experts` is {}; it must be at most {MAX_EXPERTS}",
            c.n_routed_experts
        ));
    }
    if c.n_routed_experts > 0 {
        if c.num_experts_per_tok == 0 {
            return Err(
                "`num_experts_per_tok` is 0; every token must go to at least one expert".into(),
            );
        }
        if c.moe_intermediate_size == 0 {
            return Err("`moe_intermediate_size` is 0, but the model has routed experts".into());
        }
        if c.topk_group == 0 {
            return Err("`topk_group` is 0; at least one expert group must be kept".into());
        }
    }
    if c.max_position_embeddings == 0 {
        return Err("`max_position_embeddings` is 0".into());
    }
    let positive = [
        ("rms_norm_eps", c.rms_norm_eps),
        ("routed_scaling_factor", c.routed_scaling_factor),
    ];
    for (name, value) in positive {
        // The forward pass computes in f32: the value must stay positive and finite there.
        let narrowed = value as f32;
        if !(value > 0.0 && narrowed.is_finite() && narrowed > 0.0) {
            return Err(format!(
                "`{name}` is {value}; it must be a positive number that f32 can hold"
            ));
        }
    }
    if !(c.rope_theta.is_finite() && c.rope_theta > 1.0) {
        return Err(format!(
            "`rope_theta` is {}; it must be a finite number greater than 1",
            c.rope_theta
        ));
    }
    if let Some(y) = &c.rope_scaling {
        if !(y.factor.is_finite() && y.factor >= 1.0) {
            return Err(format!(
                "`rope_scaling.factor` is {}; YaRN needs a finite factor >= 1",
                y.factor
            ));
        }
        if y.original_max_position_embeddings == 0 {
            return Err("`rope_scaling.original_max_position_embeddings` is 0".into());
        }
        let betas = [("beta_fast", y.beta_fast), ("beta_slow", y.beta_slow)];
        for (name, value) in betas {
            if !(value.is_finite() && value > 0.0) {
                return Err(format!(
                    "`rope_scaling.{name}` is {value}; it must be a positive finite number"
                ));
            }
        }
        let mscales = [("mscale", y.mscale), ("mscale_all_dim", y.mscale_all_dim)];
        for (name, value) in mscales {
            if !(value.is_finite() && value >= 0.0) {
                return Err(format!(
                    "`rope_scaling.{name}` is {value}; it must be a finite number >= 0"
                ));
            }
        }
    }
    if !Rope::new(c).is_finite() {
        return Err(format!(
            "`rope_theta` {} and `rope_scaling` {:?} give RoPE frequencies or a scale that f32 cannot hold",
            c.rope_theta, c.rope_scaling
        ));
    }
    let scale = c.softmax_scale();
    if !(scale.is_finite() && scale > 0.0) {
        return Err(format!(
            "the attention softmax scale these values give is {scale}; it must be positive and finite"
        ));
    }
    Ok(())
}

impl ModelConfig {
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// The widths of a cached token's row, as the MLA kernels' tactics name them.
    pub fn mla_dims(&self) -> kernels::mla::MlaDims {
        kernels::mla::MlaDims {
            latent: self.kv_lora_rank,
            rope: self.qk_rope_head_dim,
        }
    }

    /// Values cached per token per layer: the normalized latent plus the RoPE'd key part.
    pub fn latent_cache_dim(&self) -> usize {
        self.kv_lora_rank + self.qk_rope_head_dim
    }

    pub fn is_moe_layer(&self, layer: usize) -> bool {
        layer >= self.first_k_dense_replace && self.n_routed_experts > 0
    }

    /// Whether the model splits over `world` tensor-parallel ranks the way
    /// [`crate::checkpoint::weights::ModelWeights::shard`] splits it: attention heads and every MLP's
    /// intermediate dimension evenly, routed experts' in whole NVFP4 blocks.
    pub fn check_tensor_parallel(&self, world: usize) -> Result<(), String> {
        let check = |what: &str, total: usize, align: usize| {
            if world == 0 || !total.is_multiple_of(world) || !(total / world).is_multiple_of(align)
            {
                return Err(format!(
                    "{what} = {total} cannot be split over {world} ranks in multiples of {align}"
                ));
            }
            Ok(())
        };
        check("num_attention_heads", self.num_attention_heads, 1)?;
        // Every rank holds some rows of the vocabulary (`TpShard::vocab_rows`).
        if self.vocab_size < world {
            return Err(format!(
                "vocab_size = {} cannot be split over {world} ranks",
                self.vocab_size
            ));
        }
        if (0..self.num_hidden_layers).any(|l| !self.is_moe_layer(l)) {
            check("intermediate_size", self.intermediate_size, 1)?;
        }
        if self.n_routed_experts > 0 && self.first_k_dense_replace < self.num_hidden_layers {
            check(
                "moe_intermediate_size",
                self.moe_intermediate_size,
                kernels::formats::NVFP4_BLOCK,
            )?;
            if self.n_shared_experts > 0 {
                check(
                    "shared expert intermediate",
                    self.moe_intermediate_size * self.n_shared_experts,
                    1,
                )?;
            }
        }
        Ok(())
    }

    /// Softmax scale `qk_head_dim^-0.5 · mscale²` (YaRN's `mscale_all_dim` correction).
    pub fn softmax_scale(&self) -> f32 {
        let mut scale = (self.qk_head_dim() as f64).powf(-0.5);
        if let Some(y) = &self.rope_scaling
            && y.mscale_all_dim != 0.0
        {
            let m = yarn_mscale(y.factor, y.mscale_all_dim);
            scale *= m * m;
        }
        scale as f32
    }
}

impl<'a> From<&'a ModelConfig> for RopeParams<'a> {
    fn from(c: &'a ModelConfig) -> Self {
        RopeParams {
            dim: c.qk_rope_head_dim,
            theta: c.rope_theta,
            scaling: c.rope_scaling.as_ref(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::names;
    use serde_json::json;

    fn kimi_k25_json() -> Value {
        json!({
            "architectures": ["KimiK25ForConditionalGeneration"],
            "model_type": "kimi_k25",
            "text_config": {
                "model_type": "kimi_k2", "vocab_size": 163840, "hidden_size": 7168,
                "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
                "num_attention_heads": 64, "num_key_value_heads": 64, "n_routed_experts": 384,
                "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1,
                "moe_layer_freq": 1, "q_lora_rank": 1536, "kv_lora_rank": 512,
                "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                "rope_theta": 50000.0, "rms_norm_eps": 1e-5, "routed_scaling_factor": 2.827,
                "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                                 "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
                "n_group": 1, "topk_group": 1, "norm_topk_prob": true, "scoring_func": "sigmoid",
                "topk_method": "noaux_tc", "max_position_embeddings": 262144,
                "bos_token_id": 163584, "eos_token_id": 163585, "hidden_act": "silu"
            }
        })
    }

    #[test]
    fn kimi_k25_config_and_softmax_scale() {
        let quant = json!({"producer": {"name": "modelopt", "version": "0.37.0"},
            "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8", "group_size": 16,
                             "exclude_modules": names::unquantized_patterns("", 0)}});
        let c = CheckpointConfig::from_json(
            Path::new("config.json"),
            &kimi_k25_json(),
            Some((Path::new("q.json"), &quant)),
        )
        .unwrap();
        assert_eq!(c.model.hidden_size, 7168);
        assert_eq!(c.model.q_lora_rank, Some(1536));
        assert_eq!(c.model.eos_token_ids, vec![163585]);
        assert!(
            (c.model.softmax_scale() - 0.1446796).abs() < 1e-6,
            "{}",
            c.model.softmax_scale()
        );
        let q = c.quant.unwrap();
        assert_eq!(q.kv_cache_quant_algo, Some(KvCacheQuant::Fp8));
        let in_kimi = |t: names::Tensor| format!("{}{t}", names::KIMI_K25_PREFIX);
        let layer = names::layer(3);
        assert!(q.is_excluded(&in_kimi(layer.q_a_proj())));
        assert!(q.is_excluded(&in_kimi(layer.router())));
        assert!(!q.is_excluded(&in_kimi(layer.routed_expert(7).up_proj())));
    }

    #[test]
    fn unsupported_values_are_named() {
        let mut bad = kimi_k25_json();
        bad["text_config"]["scoring_func"] = json!("softmax");
        let err = CheckpointConfig::from_json(Path::new("cfg.json"), &bad, None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("cfg.json") && err.contains("softmax"), "{err}");
        let quant = json!({"quantization": {"quant_algo": "INT4_AWQ"}});
        let err = CheckpointConfig::from_json(
            Path::new("c.json"),
            &kimi_k25_json(),
            Some((Path::new("hf_quant_config.json"), &quant)),
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("hf_quant_config.json") && err.contains("INT4_AWQ"),
            "{err}"
        );
        let err =
            CheckpointConfig::from_json(Path::new("c.json"), &json!({"model_type": "llama"}), None)
                .unwrap_err()
                .to_string();
        assert!(err.contains("llama"), "{err}");
    }

    #[test]
    fn plain_deepseek_config_with_grouped_routing_and_no_q_lora() {
        let mut t = kimi_k25_json()["text_config"].clone();
        t["model_type"] = json!("deepseek_v3");
        t["q_lora_rank"] = Value::Null;
        t["n_group"] = json!(8);
        t["topk_group"] = json!(4);
        t["eos_token_id"] = json!([1, 2]);
        t["quantization_config"] =
            json!({"quant_method": "modelopt", "quant_algo": "NVFP4", "kv_cache_quant_algo": null});
        let c = CheckpointConfig::from_json(Path::new("config.json"), &t, None).unwrap();
        assert_eq!(c.model.q_lora_rank, None);
        assert_eq!((c.model.n_group, c.model.topk_group), (8, 4));
        assert_eq!(c.model.eos_token_ids, vec![1, 2]);
        assert_eq!(c.quant.unwrap().kv_cache_quant_algo, None);
    }

    #[test]
    fn values_that_would_make_nan_or_absurd_sizes_are_refused_by_name() {
        let cases = [
            ("rms_norm_eps", json!(-1e-5), "`rms_norm_eps` is -0.00001"),
            ("rms_norm_eps", json!(0.0), "`rms_norm_eps` is 0"),
            ("rope_theta", json!(0), "`rope_theta` is 0"),
            ("rope_theta", json!(1.0), "`rope_theta` is 1"),
            (
                "routed_scaling_factor",
                json!(1e300),
                "`routed_scaling_factor`",
            ),
            (
                "num_experts_per_tok",
                json!(0),
                "`num_experts_per_tok` is 0",
            ),
            (
                "num_hidden_layers",
                json!(1u64 << 40),
                "`num_hidden_layers` is 1099511627776",
            ),
            ("vocab_size", json!(0), "`vocab_size` is 0"),
            (
                "hidden_size",
                json!(1u64 << 40),
                "`hidden_size` is 1099511627776",
            ),
            (
                "first_k_dense_replace",
                json!(62),
                "`first_k_dense_replace` 62",
            ),
            (
                "max_position_embeddings",
                json!(0),
                "`max_position_embeddings` is 0",
            ),
        ];
        for (key, value, expected) in cases {
            let mut bad = kimi_k25_json();
            bad["text_config"][key] = value;
            let err = CheckpointConfig::from_json(Path::new("cfg.json"), &bad, None)
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("cfg.json") && err.contains(expected),
                "{key}: {err}"
            );
        }
        let rope_cases = [
            ("factor", json!(-64.0), "`rope_scaling.factor` is -64"),
            ("factor", json!(0.5), "`rope_scaling.factor` is 0.5"),
            ("beta_fast", json!(0), "`rope_scaling.beta_fast` is 0"),
            ("mscale", json!(-1.0), "`rope_scaling.mscale` is -1"),
            (
                "mscale",
                json!(1e40),
                "RoPE frequencies or a scale that f32 cannot hold",
            ),
            ("mscale_all_dim", json!(1e40), "softmax scale"),
        ];
        for (key, value, expected) in rope_cases {
            let mut bad = kimi_k25_json();
            bad["text_config"]["rope_scaling"][key] = value;
            let err = CheckpointConfig::from_json(Path::new("cfg.json"), &bad, None)
                .unwrap_err()
                .to_string();
            assert!(err.contains(expected), "{key}: {err}");
        }
    }

    #[test]
    fn tensor_parallel_splits_follow_the_sharding_rules() {
        let c = CheckpointConfig::from_json(Path::new("c"), &kimi_k25_json(), None)
            .unwrap()
            .model;
        for world in [1, 2, 4, 8] {
            c.check_tensor_parallel(world).unwrap();
        }
        let err = c.check_tensor_parallel(3).unwrap_err();
        assert!(err.contains("num_attention_heads = 64"), "{err}");
        assert!(c.check_tensor_parallel(0).is_err());
    }
}
