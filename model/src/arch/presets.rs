//! Named model sizes in the Kimi-K2.5 architecture: the small ones the tests and benches
//! generate, and Kimi-K2.5 itself (for `model plan` and the tuning lab's shapes).

use std::path::Path;

use serde_json::{Value, json};

use crate::arch::config::{CheckpointConfig, ModelConfig};

/// Named model sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Preset {
    /// A few hundred KB: for tests.
    Tiny,
    /// ~400 MB with Kimi's attention shapes (512 latent + 64 RoPE, 128/64/128 head dims) and
    /// 64 experts: makes the CPU decode loop a meaningful benchmark.
    Mini,
    /// `mini`'s widths at Kimi-K2.5's 61 layers (~2.8 GB, ~50,000 tensors): loading
    /// benchmarks (`bench --bin load-rate`).
    #[value(name = "mini-deep")]
    MiniDeep,
    /// The real Kimi-K2.5 dimensions (1 T parameters): for `model plan` only.
    #[value(name = "kimi-k2.5")]
    KimiK25,
}

impl Preset {
    pub fn id(self) -> &'static str {
        match self {
            Self::Tiny => "tiny",
            Self::Mini => "mini",
            Self::MiniDeep => "mini-deep",
            Self::KimiK25 => "kimi-k2.5",
        }
    }

    /// The `text_config` of the preset.
    pub fn text_config(self) -> Value {
        let kimi = json!({
            "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
            "vocab_size": 163840, "hidden_size": 7168, "intermediate_size": 18432,
            "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 64,
            "num_key_value_heads": 64, "n_routed_experts": 384, "n_shared_experts": 1,
            "num_experts_per_tok": 8, "first_k_dense_replace": 1, "moe_layer_freq": 1,
            "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
            "v_head_dim": 128, "rope_theta": 50000.0, "rms_norm_eps": 1e-5, "routed_scaling_factor": 2.827,
            "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                             "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
            "n_group": 1, "topk_group": 1, "norm_topk_prob": true, "scoring_func": "sigmoid",
            "topk_method": "noaux_tc", "hidden_act": "silu", "max_position_embeddings": 262144,
            "bos_token_id": 163584, "eos_token_id": 163585, "tie_word_embeddings": false,
            "attention_bias": false, "num_nextn_predict_layers": 0, "dtype": "bfloat16"
        });
        let mut t = kimi;
        let set = |t: &mut Value, pairs: &[(&str, Value)]| {
            for (k, v) in pairs {
                t[*k] = v.clone();
            }
        };
        match self {
            Self::KimiK25 => {}
            Self::Mini | Self::MiniDeep => set(
                &mut t,
                &[
                    ("vocab_size", json!(32768)),
                    ("hidden_size", json!(1024)),
                    ("intermediate_size", json!(2816)),
                    ("moe_intermediate_size", json!(384)),
                    ("num_hidden_layers", json!(6)),
                    ("num_attention_heads", json!(8)),
                    ("num_key_value_heads", json!(8)),
                    ("n_routed_experts", json!(64)),
                    ("q_lora_rank", json!(384)),
                    ("bos_token_id", json!(32000)),
                    ("eos_token_id", json!(32001)),
                ],
            ),
            Self::Tiny => set(
                &mut t,
                &[
                    ("vocab_size", json!(512)),
                    ("hidden_size", json!(64)),
                    ("intermediate_size", json!(128)),
                    ("moe_intermediate_size", json!(32)),
                    ("num_hidden_layers", json!(3)),
                    ("num_attention_heads", json!(2)),
                    ("num_key_value_heads", json!(2)),
                    ("n_routed_experts", json!(8)),
                    ("num_experts_per_tok", json!(2)),
                    ("q_lora_rank", json!(48)),
                    ("kv_lora_rank", json!(64)),
                    ("qk_nope_head_dim", json!(16)),
                    ("qk_rope_head_dim", json!(16)),
                    ("v_head_dim", json!(16)),
                    ("bos_token_id", json!(500)),
                    ("eos_token_id", json!(501)),
                ],
            ),
        }
        if self == Self::MiniDeep {
            t["num_hidden_layers"] = json!(61);
        }
        t
    }

    /// The whole `config.json`: Kimi-K2.5's multimodal wrapper around the text model.
    pub fn config_json(self) -> Value {
        let text = self.text_config();
        json!({
            "architectures": ["KimiK25ForConditionalGeneration"],
            "model_type": "kimi_k25",
            "bos_token_id": text["bos_token_id"],
            "eos_token_id": text["eos_token_id"],
            "dtype": "bfloat16",
            "tie_word_embeddings": false,
            "text_config": text,
            "vision_config": {"model_type": "moonvit3d"}
        })
    }

    pub fn model_config(self) -> ModelConfig {
        CheckpointConfig::from_json(Path::new(self.id()), &self.config_json(), None)
            .expect("presets are valid configs")
            .model
    }
}
