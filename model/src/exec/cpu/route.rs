//! `noaux_tc` routing on the host (the device runs `route` in `layers.cu`).

use kernels::moe_gemm::reference::Routing;

use crate::arch::config::ModelConfig;

use super::rows::NORM_PARALLEL_ROWS;

/// `noaux_tc` routing: sigmoid scores; the correction bias is added for choosing experts only
/// (groups ranked by the sum of their two best biased scores, `topk_group` groups kept); the
/// weights are the chosen experts' unbiased scores, normalized, times `routed_scaling_factor`.
/// Ties go to the lower expert index, so the choice is deterministic.
pub fn route(logits: &[f32], bias: &[f32], c: &ModelConfig) -> Routing {
    use rayon::prelude::*;
    let experts = c.n_routed_experts;
    let rows = logits.len() / experts.max(1);
    // Each row's choice alone: a prefill's rows in parallel.
    let chosen: Vec<(Vec<usize>, Vec<f32>)> = if rows >= NORM_PARALLEL_ROWS {
        logits
            .par_chunks_exact(experts)
            .with_min_len(NORM_PARALLEL_ROWS / 4)
            .map(|row| route_row(row, bias, c))
            .collect()
    } else {
        logits
            .chunks_exact(experts)
            .map(|row| route_row(row, bias, c))
            .collect()
    };
    let mut routing = Routing {
        top_k: c.num_experts_per_tok,
        experts: Vec::with_capacity(rows * c.num_experts_per_tok),
        weights: Vec::with_capacity(rows * c.num_experts_per_tok),
    };
    for (experts, weights) in chosen {
        routing.experts.extend(experts.iter().map(|&e| e as u32));
        routing.weights.extend(weights);
    }
    routing
}

/// One row's experts (best first) and their weights; see [`route`].
fn route_row(row: &[f32], bias: &[f32], c: &ModelConfig) -> (Vec<usize>, Vec<f32>) {
    let k = c.num_experts_per_tok;
    let per_group = c.n_routed_experts / c.n_group;
    let scores: Vec<f32> = row.iter().map(|&l| 1.0 / (1.0 + (-l).exp())).collect();
    let mut choice: Vec<f32> = scores.iter().zip(bias).map(|(s, b)| s + b).collect();
    if c.n_group > 1 {
        let group_scores: Vec<f32> = choice
            .chunks_exact(per_group)
            .map(|g| {
                let mut sorted = g.to_vec();
                sorted.sort_by(|a, b| b.total_cmp(a));
                sorted.iter().take(2).sum()
            })
            .collect();
        let kept = top_indices(&group_scores, c.topk_group);
        for (g, chunk) in choice.chunks_exact_mut(per_group).enumerate() {
            if !kept.contains(&g) {
                chunk.fill(f32::NEG_INFINITY);
            }
        }
    }
    let chosen = top_indices(&choice, k);
    let mut weights: Vec<f32> = chosen.iter().map(|&e| scores[e]).collect();
    if c.norm_topk_prob {
        let sum: f32 = weights.iter().sum::<f32>() + 1e-20;
        weights.iter_mut().for_each(|w| *w /= sum);
    }
    weights
        .iter_mut()
        .for_each(|w| *w *= c.routed_scaling_factor as f32);
    (chosen, weights)
}

/// Indices of the `k` largest values, largest first, ties to the lower index.
fn top_indices(values: &[f32], k: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..values.len()).collect();
    order.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
    order.truncate(k);
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    fn routing_config(n_group: usize, topk_group: usize) -> ModelConfig {
        let text = serde_json::json!({
            "model_type": "deepseek_v3", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
            "moe_intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1,
            "n_routed_experts": 8, "num_experts_per_tok": 2, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
            "qk_rope_head_dim": 4, "v_head_dim": 8, "max_position_embeddings": 64,
            "n_group": n_group, "topk_group": topk_group, "routed_scaling_factor": 2.5, "norm_topk_prob": true
        });
        crate::arch::config::CheckpointConfig::from_json(std::path::Path::new("c"), &text, None)
            .unwrap()
            .model
    }

    #[test]
    fn bias_selects_but_does_not_weight() {
        let c = routing_config(1, 1);
        let logits = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7];
        let mut bias = [0.0f32; 8];
        bias[0] = 1.0; // makes expert 0 the best choice despite the lowest score
        let r = route(&logits, &bias, &c);
        assert_eq!(r.experts, vec![0, 7]);
        let (s0, s7) = (0.5f32, 1.0 / (1.0 + (-0.7f32).exp()));
        assert!((r.weights[0] - 2.5 * s0 / (s0 + s7)).abs() < 1e-6);
        assert!((r.weights.iter().sum::<f32>() - 2.5).abs() < 1e-5);
    }

    #[test]
    fn group_limited_top_k_ignores_experts_of_dropped_groups() {
        let c = routing_config(4, 1);
        // Group 3 (experts 6, 7) has the single best expert but group 0's two experts sum higher.
        let logits = [2.0, 2.0, -5.0, -5.0, -5.0, -5.0, 3.0, -5.0];
        let r = route(&logits, &[0.0; 8], &c);
        assert_eq!(r.experts, vec![0, 1]);
    }
}
