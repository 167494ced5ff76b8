//! The checkpoint's tensor names, the one place they are spelled: the loader, the generator,
//! the quantizer, the planner's and every backend's messages take them from here.
//!
//! DeepSeek-V3's layout (`model.layers.L.self_attn.q_a_proj.weight`, …); Kimi-K2.5's
//! checkpoint puts `language_model.` before every name (the loader resolves it). A linear
//! layer is a [`Tensor`]: its `.weight`, and for NVFP4 its `.weight_scale`, `.weight_scale_2`
//! and `.input_scale` beside it.

/// Prefix of the text model's tensors in Kimi-K2.5 (a multimodal wrapper).
pub const KIMI_K25_PREFIX: &str = "language_model.";

/// What every layer's name starts with.
pub const LAYERS: &str = "model.layers.";

/// Between a MoE layer's name and its routed experts' indices.
pub const ROUTED_EXPERTS: &str = "mlp.experts.";

// The leaf names of the layer's parts, also the labels the tactic lab and the runner give the
// products and places they stand for.
pub const SELF_ATTN: &str = "self_attn";
pub const Q_PROJ: &str = "q_proj";
pub const Q_A_PROJ: &str = "q_a_proj";
pub const Q_A_LAYERNORM: &str = "q_a_layernorm";
pub const Q_B_PROJ: &str = "q_b_proj";
pub const KV_A_PROJ_WITH_MQA: &str = "kv_a_proj_with_mqa";
pub const KV_A_LAYERNORM: &str = "kv_a_layernorm";
pub const KV_B_PROJ: &str = "kv_b_proj";
pub const O_PROJ: &str = "o_proj";
pub const MLP: &str = "mlp";
pub const GATE_PROJ: &str = "gate_proj";
pub const UP_PROJ: &str = "up_proj";
pub const DOWN_PROJ: &str = "down_proj";
pub const EMBED_TOKENS: &str = "embed_tokens";
pub const LM_HEAD: &str = "lm_head";

/// A linear layer (or a norm) by its name without the suffix: `X` of `X.weight`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tensor(String);

impl Tensor {
    /// The layer whose values are `weight_name` (`X` of `X.weight`), if it names values.
    pub fn of_weight(weight_name: &str) -> Option<Tensor> {
        weight_name
            .strip_suffix(".weight")
            .map(|x| Tensor(x.to_string()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// `X.weight`: the values (NVFP4: the packed E2M1 codes).
    pub fn weight(&self) -> String {
        format!("{}.weight", self.0)
    }

    /// `X.weight_scale`: NVFP4 block scales (E4M3, one per 16 values).
    pub fn weight_scale(&self) -> String {
        format!("{}.weight_scale", self.0)
    }

    /// `X.weight_scale_2`: NVFP4's per-tensor FP32 scale.
    pub fn weight_scale_2(&self) -> String {
        format!("{}.weight_scale_2", self.0)
    }

    /// `X.input_scale`: the calibrated activation scale of a W4A4 layer.
    pub fn input_scale(&self) -> String {
        format!("{}.input_scale", self.0)
    }

    fn child(&self, name: &str) -> Tensor {
        Tensor(format!("{}.{name}", self.0))
    }
}

impl std::fmt::Display for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

pub fn embed_tokens() -> Tensor {
    Tensor(format!("model.{EMBED_TOKENS}"))
}

/// The final norm.
pub fn norm() -> Tensor {
    Tensor("model.norm".into())
}

pub fn lm_head() -> Tensor {
    Tensor(LM_HEAD.into())
}

/// Layer `layer`'s tensors.
pub fn layer(layer: usize) -> Layer {
    Layer(Tensor(format!("{LAYERS}{layer}")))
}

/// One decoder layer's tensors.
#[derive(Clone, Debug)]
pub struct Layer(Tensor);

impl Layer {
    /// `model.layers.L`.
    pub fn path(&self) -> &Tensor {
        &self.0
    }

    fn attention(&self, part: &str) -> Tensor {
        self.0.child(&format!("{SELF_ATTN}.{part}"))
    }

    pub fn input_layernorm(&self) -> Tensor {
        self.0.child("input_layernorm")
    }

    pub fn post_attention_layernorm(&self) -> Tensor {
        self.0.child("post_attention_layernorm")
    }

    /// The full query projection (models without a query LoRA).
    pub fn q_proj(&self) -> Tensor {
        self.attention(Q_PROJ)
    }

    pub fn q_a_proj(&self) -> Tensor {
        self.attention(Q_A_PROJ)
    }

    pub fn q_a_layernorm(&self) -> Tensor {
        self.attention(Q_A_LAYERNORM)
    }

    pub fn q_b_proj(&self) -> Tensor {
        self.attention(Q_B_PROJ)
    }

    /// The compressed KV's latent and RoPE-key rows, `[kv_lora_rank + rope, hidden]`.
    pub fn kv_a_proj_with_mqa(&self) -> Tensor {
        self.attention(KV_A_PROJ_WITH_MQA)
    }

    pub fn kv_a_layernorm(&self) -> Tensor {
        self.attention(KV_A_LAYERNORM)
    }

    /// Every head's W_UK over its W_UV, `[heads · (nope + v), kv_lora_rank]`.
    pub fn kv_b_proj(&self) -> Tensor {
        self.attention(KV_B_PROJ)
    }

    pub fn o_proj(&self) -> Tensor {
        self.attention(O_PROJ)
    }

    /// The MLP of a dense layer (`model.layers.L.mlp`).
    pub fn mlp(&self) -> Mlp {
        Mlp(self.0.child(MLP))
    }

    /// The router of a MoE layer (`mlp.gate`, `[experts, hidden]`).
    pub fn router(&self) -> Tensor {
        self.0.child(&format!("{MLP}.gate"))
    }

    /// The router's correction bias, added to the scores to choose experts only.
    pub fn e_score_correction_bias(&self) -> String {
        format!("{}.e_score_correction_bias", self.router())
    }

    /// The shared experts of a MoE layer, one MLP.
    pub fn shared_experts(&self) -> Mlp {
        Mlp(self.0.child(&format!("{MLP}.shared_experts")))
    }

    /// Every routed expert of a MoE layer, as a group (`mlp.experts`).
    pub fn routed_experts(&self) -> Tensor {
        self.0.child(ROUTED_EXPERTS.trim_end_matches('.'))
    }

    /// Routed expert `expert` of a MoE layer.
    pub fn routed_expert(&self, expert: usize) -> Mlp {
        Mlp(self.0.child(&format!("{ROUTED_EXPERTS}{expert}")))
    }
}

/// A SwiGLU MLP's projections.
#[derive(Clone, Debug)]
pub struct Mlp(Tensor);

impl Mlp {
    pub fn path(&self) -> &Tensor {
        &self.0
    }

    pub fn gate_proj(&self) -> Tensor {
        self.0.child(GATE_PROJ)
    }

    pub fn up_proj(&self) -> Tensor {
        self.0.child(UP_PROJ)
    }

    pub fn down_proj(&self) -> Tensor {
        self.0.child(DOWN_PROJ)
    }

    /// `(projection name, tensor)` of gate, up and down, in that order.
    pub fn projections(&self) -> [(&'static str, Tensor); 3] {
        [
            (GATE_PROJ, self.gate_proj()),
            (UP_PROJ, self.up_proj()),
            (DOWN_PROJ, self.down_proj()),
        ]
    }
}

/// The modules ModelOpt leaves in BF16 when it quantizes the routed experts to NVFP4, as
/// `hf_quant_config.json`'s `exclude_modules` globs: `lm_head`, attention, the shared experts,
/// the router, and the first `dense_layers` layers' MLPs.
pub fn unquantized_patterns(prefix: &str, dense_layers: usize) -> Vec<String> {
    let mut patterns = vec![
        format!("{prefix}{}", lm_head()),
        format!("*{SELF_ATTN}*"),
        "*shared_experts*".into(),
        format!("*{MLP}.gate"),
    ];
    patterns.extend((0..dense_layers).map(|l| format!("{prefix}{}*", layer(l).mlp().path())));
    patterns
}

/// Whether `name` (without the Kimi prefix) is a routed expert's projection weight.
pub fn is_routed_expert_weight(name: &str) -> bool {
    name.contains(&format!(".{ROUTED_EXPERTS}")) && name.ends_with("_proj.weight")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_deepseek_v3_layout() {
        let l = layer(3);
        assert_eq!(
            l.q_a_proj().weight(),
            "model.layers.3.self_attn.q_a_proj.weight"
        );
        assert_eq!(
            l.routed_expert(17).down_proj().weight_scale_2(),
            "model.layers.3.mlp.experts.17.down_proj.weight_scale_2"
        );
        assert_eq!(
            l.shared_experts().up_proj().weight(),
            "model.layers.3.mlp.shared_experts.up_proj.weight"
        );
        assert_eq!(
            l.e_score_correction_bias(),
            "model.layers.3.mlp.gate.e_score_correction_bias"
        );
        assert_eq!(embed_tokens().weight(), "model.embed_tokens.weight");
        assert!(is_routed_expert_weight(
            &l.routed_expert(0).gate_proj().weight()
        ));
        assert!(!is_routed_expert_weight(
            &l.shared_experts().gate_proj().weight()
        ));
    }
}
