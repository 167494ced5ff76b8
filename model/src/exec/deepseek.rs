//! The DeepSeek-V3 / Kimi-K2.5 forward step, written once: embedding, per layer the absorbed
//! MLA attention over the paged latent cache and the dense MLP or MoE (sigmoid `noaux_tc`
//! routing, shared experts, routed experts), the final norm, `lm_head` and the step's result.
//! Every backend runs this order of operations ([`StepOps`]); under tensor parallelism the
//! rank's partial sums are all-reduced where they join the residual stream, and the
//! vocabulary-parallel head gathers the ranks' columns.

use super::error::ExecError;
use super::ops::{Buf, StepOps, StepOutput, Sublayer};
use super::weights::{Attention, DenseMlp, Mlp, Weights};

/// Runs one step's operations on `ops` (after [`StepOps::begin_step`]).
pub fn forward<O: StepOps>(
    ops: &mut O,
    w: &Weights<O::Kinds>,
    output: StepOutput,
) -> Result<(), ExecError> {
    let tensor_parallel = w.shard.world > 1;
    ops.embed(&w.embed, w.vocab_rows.clone(), Buf::Residual)?;
    if tensor_parallel {
        // Each rank holds its vocabulary's rows, zeros for the others: the sum is the row.
        ops.all_reduce(Buf::Residual)?;
    }
    let mut added = Sublayer::Embedding;
    for (layer, lw) in w.layers.iter().enumerate() {
        // The previous layer's MLP output joins the residual in this layer's first norm.
        let pending = (layer > 0).then_some(Buf::Delta);
        ops.add_rms_norm(Buf::Residual, pending, &lw.input_norm, Buf::Normed, added)?;
        attention(ops, layer, &lw.attention)?;
        if tensor_parallel {
            ops.all_reduce(Buf::Delta)?;
        }
        added = Sublayer::Attention(layer);
        ops.add_rms_norm(
            Buf::Residual,
            Some(Buf::Delta),
            &lw.post_attention_norm,
            Buf::Normed,
            added,
        )?;
        match &lw.mlp {
            Mlp::Dense(mlp) => {
                ops.products(Buf::Normed, &[(&mlp.gate_up, Buf::GateUp)])?;
                down(ops, mlp, false)?;
            }
            Mlp::Moe(moe) => {
                // The router and the shared experts' gate and up read the same input.
                let mut first = vec![(&moe.router, Buf::RouterLogits)];
                if let Some(shared) = &moe.shared {
                    first.push((&shared.gate_up, Buf::GateUp));
                }
                ops.products(Buf::Normed, &first)?;
                ops.route(layer, Buf::RouterLogits, &moe.correction_bias)?;
                ops.routed_experts(layer, Buf::Normed, &moe.experts, Buf::Delta)?;
                if let Some(shared) = &moe.shared {
                    down(ops, shared, true)?;
                }
            }
        }
        if tensor_parallel {
            ops.all_reduce(Buf::Delta)?;
        }
        added = Sublayer::Mlp(layer);
    }
    head(ops, w, output, added)
}

/// One layer's attention, [`Buf::Normed`] → [`Buf::Delta`].
fn attention<O: StepOps>(
    ops: &mut O,
    layer: usize,
    a: &Attention<O::Kinds>,
) -> Result<(), ExecError> {
    // The query's first projection and the compressed KV read the same input.
    let kv = [
        (&a.kv_a_latent, Buf::KvLatent),
        (&a.kv_a_rope, Buf::KeyRope),
    ];
    match &a.q_a {
        Some((q_a, norm)) => {
            ops.products(Buf::Normed, &[(q_a, Buf::QueryLatent), kv[0], kv[1]])?;
            ops.rms_norm(Buf::QueryLatent, norm, Buf::QueryLatentNormed)?;
            ops.products(Buf::QueryLatentNormed, &[(&a.q_b, Buf::Query)])?;
        }
        None => ops.products(Buf::Normed, &[(&a.q_b, Buf::Query), kv[0], kv[1]])?,
    }
    ops.rope(Buf::KeyRope)?;
    ops.append_cache(layer, Buf::KvLatent, Buf::KeyRope, &a.kv_a_norm)?;
    ops.rope(Buf::Query)?;
    ops.absorb_query(Buf::Query, &a.w_uk_t, Buf::AbsorbedQuery, Buf::QueryRope)?;
    ops.attention(
        layer,
        Buf::AbsorbedQuery,
        Buf::QueryRope,
        Buf::AttentionLatent,
    )?;
    ops.unabsorb(Buf::AttentionLatent, &a.w_uv, Buf::AttentionOut)?;
    ops.products(Buf::AttentionOut, &[(&a.o, Buf::Delta)])
}

/// `down(silu(gate) · up)` from [`Buf::GateUp`] into [`Buf::Delta`] (added to it: the shared
/// experts after the routed ones).
fn down<O: StepOps>(ops: &mut O, mlp: &DenseMlp<O::Kinds>, add: bool) -> Result<(), ExecError> {
    ops.silu_mul(Buf::GateUp, Buf::Activated)?;
    if add {
        ops.product_add(Buf::Activated, &mlp.down, Buf::Delta)
    } else {
        ops.products(Buf::Activated, &[(&mlp.down, Buf::Delta)])
    }
}

/// The final norm, `lm_head` and the step's result. A vocabulary-parallel rank scores its own
/// ids; then:
/// - greedy: each rank's best (value, id) into its slot of [`Buf::ArgmaxPairs`], the slots
///   summed over the ranks (a gather: a value plus zeros is exact), the best slot the lower id
///   on ties: the id one device's argmax picks from whole rows, for 2 × ranks values moved per
///   row;
/// - logits and sampling: each rank's columns into zeroed full-vocabulary rows, summed over the
///   ranks (a gather again, exact), so every rank holds the whole rows one device computes and
///   draws what it draws. Sampling from a row split over ranks and drawing the same token
///   would need the key searches' counts and ordered sums across ranks at every step of the
///   search, a collective per key bit.
fn head<O: StepOps>(
    ops: &mut O,
    w: &Weights<O::Kinds>,
    output: StepOutput,
    added: Sublayer,
) -> Result<(), ExecError> {
    ops.add_rms_norm(Buf::Residual, Some(Buf::Delta), &w.norm, Buf::Normed, added)?;
    ops.select_rows(Buf::Normed, Buf::Selected)?;
    let ranks = w.shard.world;
    if ranks > 1 {
        if output == StepOutput::Greedy {
            ops.products(Buf::Selected, &[(&w.lm_head, Buf::Logits)])?;
            ops.argmax_shard(
                Buf::Logits,
                w.vocab_rows.clone(),
                w.shard.rank,
                ranks,
                Buf::ArgmaxPairs,
            )?;
            ops.all_reduce(Buf::ArgmaxPairs)?;
            return ops.argmax_ranks(Buf::ArgmaxPairs, ranks);
        }
        ops.vocab_columns(Buf::Selected, &w.lm_head, w.vocab_rows.clone(), Buf::Logits)?;
        ops.all_reduce(Buf::Logits)?;
    } else {
        ops.products(Buf::Selected, &[(&w.lm_head, Buf::Logits)])?;
    }
    match output {
        StepOutput::Logits => Ok(()),
        StepOutput::Greedy => ops.argmax(Buf::Logits),
        StepOutput::Sampled => ops.sample(Buf::Logits),
    }
}
