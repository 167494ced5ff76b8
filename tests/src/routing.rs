//! The routed experts' choices of a forward pass, recorded from the CPU runner, and the HF
//! golden's (`routing_w4a4.layers.L.*` of `golden.safetensors`), so that a test can tell a
//! changed expert choice from a changed value feeding the router.

use kernels::mla::cache::KvCacheDtype;
use kernels::moe_gemm::reference::Routing;
use model::checkpoint::tensor_file::TensorFile;
use model::checkpoint::weights::Model;
use model::exec::cpu::{CpuOptions, cpu_runner};
use model::exec::{LogitRows, ModelRunner, SeqInput};

/// One MoE layer's choice: per token, the experts sorted by id and their weights in that order.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerRouting {
    pub layer: usize,
    pub experts: Vec<Vec<u32>>,
    pub weights: Vec<Vec<f32>>,
}

impl LayerRouting {
    /// `routing`'s choice of every token, sorted by expert id.
    pub fn of(layer: usize, routing: &Routing) -> Self {
        let (mut experts, mut weights) = (Vec::new(), Vec::new());
        for t in 0..routing.tokens() {
            let slots = t * routing.top_k..(t + 1) * routing.top_k;
            let mut pairs: Vec<(u32, f32)> = routing.experts[slots.clone()]
                .iter()
                .copied()
                .zip(routing.weights[slots].iter().copied())
                .collect();
            pairs.sort_by_key(|&(e, _)| e);
            experts.push(pairs.iter().map(|&(e, _)| e).collect());
            weights.push(pairs.iter().map(|&(_, w)| w).collect());
        }
        Self {
            layer,
            experts,
            weights,
        }
    }
}

/// The HF golden's choices of every MoE layer (`first_moe_layer..layers`), in layer order.
///
/// # Panics
/// If the golden lacks them or they are malformed.
pub fn hf_routing(golden: &TensorFile, first_moe_layer: usize, layers: usize) -> Vec<LayerRouting> {
    (first_moe_layer..layers)
        .map(|layer| {
            let name = |what: &str| format!("routing_w4a4.layers.{layer}.{what}");
            let experts = golden.i64_values(&name("topk_indices")).unwrap();
            let weights = golden.f32_values(&name("topk_weights")).unwrap();
            let k = golden.info(&name("topk_indices")).unwrap().shape[1];
            LayerRouting {
                layer,
                experts: experts
                    .chunks_exact(k)
                    .map(|row| row.iter().map(|&e| e as u32).collect())
                    .collect(),
                weights: weights.chunks_exact(k).map(<[f32]>::to_vec).collect(),
            }
        })
        .collect()
}

/// The CPU model's choices in one prefill of `tokens` (FP32 cache), one per MoE layer in
/// layer order (the i-th MoE layer is layer `first_moe_layer + i`).
pub fn cpu_routing(model: &Model, tokens: &[u32], first_moe_layer: usize) -> Vec<LayerRouting> {
    let mut runner = cpu_runner(model, CpuOptions::new(KvCacheDtype::F32, tokens.len()));
    runner.ops_mut().observations.routings = Some(Vec::new());
    let seq = runner.add_sequence();
    runner
        .logits(&[SeqInput { seq, tokens }], LogitRows::All)
        .unwrap();
    runner
        .ops_mut()
        .observations
        .routings
        .take()
        .unwrap_or_default()
        .iter()
        .enumerate()
        .map(|(i, routing)| LayerRouting::of(first_moe_layer + i, routing))
        .collect()
}
